"""A diffusers Wan trained packed vs the unmodified model at batch 1 and bucketed, one GPU.

The model is diffusers' ``WanTransformer3DModel`` with the Wan-2.2-TI2V-5B transformer config
(3072 wide, 24 heads of 128, FFN 14336, 48 latent channels, umT5 text width 4096), random
init, ``--depth`` blocks; bf16 autocast, fused AdamW, the same initial weights and the same
episodes every step in both variants:

* ``packed[auto]``: `packing.integrations.diffusers.install(model)`; one pack per optimizer
  step (static budgets for latents and text, static ``max_docs``), ``packing.attention``
  backend ``auto`` (FA4 varlen where installed, else Flex), the block step compiled once
  (`PackedWan.compile_blocks`).
* ``unpacked[diffusers]``: the unmodified model's ``forward``, one episode per micro-step +
  gradient accumulation, ``compile_repeated_blocks(dynamic=True)`` (diffusers' regional
  compile; one graph for all episode lengths), and diffusers' fastest attention backend on
  this machine, picked by a timed probe over its native SDPA backends (flash-attn 2/3 are not
  installed there; FA4 is not a diffusers backend; all probe timings are in the JSON).
* ``unpacked_bucketed[diffusers]``: the unmodified ``forward`` on ``(B, C, F, H, W)`` batches,
  length bucketing as Open-Sora does it for video: each episode cropped to the frame bucket
  below it (4 buckets), ``budget // bucket tokens`` rows a batch, the text zero-padded to the
  batch's longest (diffusers' Wan pipeline pads umT5 text with zeros and attends to them);
  same backend and compile; checkpointed where the packed row is (its batches are pack-sized).
  It trains on fewer tokens (the cropped frames) and other text padding, so its loss is not
  compared; tokens/s counts the tokens it trained on.

Episodes are latent frames of ``(48, 8, 16)`` (32 tokens a frame after 2x2 patches, as in
bench_step) with their own umT5-width text of 16-128 tokens. Regimes: ``seed`` episodes of
4.6K-10.7K tokens in 64K-token packs, ``short`` 0.3K-2.5K tokens in 48K-token packs.
Reported: step time (median, CUDA events), real latent tokens/s, ratio to unpacked, peak
memory, recompiles after warm-up, and each step's loss next to the unpacked one on the same
episodes ("loss rel diff": bf16 noise, a packing bug would show as O(1)).

    python benchmarks/diffusers/bench_diffusers_wan.py --out /tmp/wan       # one H200, ~3-4 min
    python benchmarks/diffusers/bench_diffusers_wan.py --depth 30 \
        --checkpointing seed=both,short=packed --out /tmp/wan30   # checkpointed where it must be
    python benchmarks/diffusers/bench_diffusers_wan.py --quick --out /tmp/q  # tiny Wan on CPU
"""

from __future__ import annotations

import gc
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import harness
from packing.data import PackedCollator
from packing.integrations.diffusers import PackedWan, install
from packing.integrations.diffusers.testing import WanReference, tiny_wan

TI2V_5B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=24,
    attention_head_dim=128,
    in_channels=48,
    out_channels=48,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=14336,
    cross_attn_norm=True,
    eps=1e-6,
    rope_max_seq_len=1024,
)
LATENT_HW = (8, 16)  # 4 x 8 = 32 tokens a latent frame
# regime: (budget tokens, min frames, max frames, max_docs, text tokens min/max)
REGIMES = {"seed": (65536, 144, 336, 16), "short": (49152, 10, 79, 160)}
QUICK_REGIMES = {"seed": (1024, 4, 8, 16), "short": (512, 1, 3, 64)}
TEXT_LEN = (16, 128)
UNPACKED_BACKENDS = ("native", "_native_flash", "_native_cudnn", "_native_efficient")
CHECKPOINTING = ("none", "packed", "unpacked", "both")


def build_model(args: Any, dev: torch.device) -> torch.nn.Module:
    """The model, built on ``dev`` (a 5B init on the host takes minutes; on the GPU, seconds)."""
    torch.manual_seed(args.seed)
    if args.quick:
        return tiny_wan("2.2").to(dev)
    from diffusers import WanTransformer3DModel

    with torch.device(dev):
        return WanTransformer3DModel(**TI2V_5B, num_layers=args.depth)


def checkpointed(setting: str, regime: str, kind: str) -> bool:
    """Whether ``kind`` (packed / unpacked) runs checkpointed in ``regime``: ``setting`` is one
    of none/packed/unpacked/both for every regime, or per regime, ``seed=both,short=packed``."""
    if "=" in setting:
        per = dict(part.split("=", 1) for part in setting.split(","))
        setting = per.get(regime, "none")
    if setting not in CHECKPOINTING:
        raise ValueError(f"--checkpointing {setting!r}: choose from {CHECKPOINTING}, or per "
                         "regime as seed=both,short=packed")  # fmt: skip
    return setting in (kind, "both")


def draw_steps(
    args: Any, regime: tuple[int, ...], channels: int, text_dim: int
) -> list[list[dict[str, Any]]]:
    """Per optimizer step, episodes of random lengths filling the token budget (host tensors)."""
    budget, fmin, fmax, max_docs = regime
    tpf = (LATENT_HW[0] // 2) * (LATENT_HW[1] // 2)
    rng = random.Random(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    steps, index = [], 0
    for _ in range(args.warmup + args.steps):
        eps: list[dict[str, Any]] = []
        tokens = 0
        while len(eps) < max_docs:
            f = rng.randint(fmin, fmax)
            if tokens + f * tpf > budget - 128:
                break
            words = rng.randint(*TEXT_LEN) if not args.quick else rng.randint(2, 9)
            eps.append({
                "latents": torch.randn(f, channels, *LATENT_HW, generator=g),
                "text": torch.randn(words, text_dim, generator=g).to(torch.bfloat16 if not args.quick else torch.float32),
                "episode_index": index,
            })  # fmt: skip
            tokens += f * tpf
            index += 1
        steps.append(eps)
    return steps


def probe_backends(dev: torch.device, heads: int, head_dim: int,
                   lengths: list[int]) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """diffusers' fastest native attention backend here, timed fwd+bwd on the run's own
    episode lengths (the shortest, median and longest); every timing goes into the JSON."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    if dev.type != "cuda":
        return "native", {}
    s = sorted(lengths)
    picks = sorted({s[0], s[len(s) // 2], s[-1]})
    times: dict[str, Any] = {}
    for name in UNPACKED_BACKENDS:
        per: dict[str, float] = {}
        try:
            for n in picks:
                q, k, v = (torch.randn(1, n, heads, head_dim, device=dev, dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))  # fmt: skip

                def run(name: str = name, q: Any = q, k: Any = k, v: Any = v) -> None:
                    dispatch_attention_fn(q, k, v, backend=name).sum().backward()

                per[str(n)] = harness.time_fn(run, device=dev, warmup=2, iters=5).median_ms
            times[name] = {"ms": per, "total ms": sum(per.values())}
        except Exception as e:  # a backend this machine lacks: recorded, not chosen
            times[name] = f"{type(e).__name__}: {str(e)[:80]}"
    ok = {n: t["total ms"] for n, t in times.items() if isinstance(t, dict)}
    return min(ok, key=ok.__getitem__), times


def run_variant(kind: str, args: Any, state: dict[str, torch.Tensor],
                steps_eps: list[list[dict[str, Any]]], regime: tuple[int, ...], rname: str,
                dev: torch.device, backend: str) -> dict[str, Any]:  # fmt: skip
    # No dynamo reset between variants: the two compile different code objects (the packed
    # block step, WanTransformerBlock.forward), and the unpacked dynamic graph serves both
    # regimes (one compile saved). The packed step is compiled static (dynamic=False), so the
    # second regime's budget compiles a second static graph instead of a dynamic one.
    budget, _, _, max_docs = regime
    compiled = dev.type == "cuda" and not args.no_compile
    model = build_model(args, dev)
    model.load_state_dict(state)  # the same initial weights in every variant
    if checkpointed(args.checkpointing, rname, kind):
        # diffusers' own switch; the packed adapter's run_blocks honours it too (per block,
        # use_reentrant=False): what lets the seed regime's 64K pack fit at 30 blocks
        model.enable_gradient_checkpointing()
    runner: PackedWan | WanReference
    if kind == "packed":
        runner = install(model, latent_hw=LATENT_HW, attention="auto")
        if compiled:
            runner.compile_blocks(dynamic=False)
        lat, txt = runner.streams
        text_budget = max_docs * (TEXT_LEN[1] if not args.quick else 16)
        collate = PackedCollator([replace(lat, budget=budget), replace(txt, budget=text_budget)],
                                 max_docs=max_docs)  # fmt: skip
        micro = lambda eps: [collate(eps)]  # noqa: E731
    else:
        if dev.type == "cuda":
            model.set_attention_backend(backend)
        if compiled:
            model.compile_repeated_blocks(dynamic=True)
        runner = WanReference(model, latent_hw=LATENT_HW)
        collate = PackedCollator(runner.streams, pad_to_multiple=1)
        micro = lambda eps: [collate([e]) for e in eps]  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    plans = [micro(eps) for eps in steps_eps]
    times: list[Any] = []
    losses: list[torch.Tensor] = []
    g0 = 0
    if dev.type == "cuda":
        torch.cuda.synchronize()
    for s, mbs in enumerate(plans):
        if s == args.warmup:
            g0 = harness.dynamo_counters()["unique_graphs"]
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
        denom = float(sum(mb.layout("latents").num_tokens for mb in mbs))
        start = harness.mark(dev)
        step_loss = torch.zeros((), device=dev)
        for mb in mbs:
            b = mb.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else mb
            b.extras.update(seed=args.seed, step=s)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = runner(b)["latents"].sum() / denom
            loss.backward()
            step_loss += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
        if s >= args.warmup:
            times.append((start, harness.mark(dev)))
        if s == 0:
            print(
                f"  {kind}: first step done ({_elapsed(dev, start):.1f} s incl. compile)",
                flush=True,
            )
    if dev.type == "cuda":
        torch.cuda.synchronize()  # every recorded event has completed before it is read
    ms = [harness.elapsed_ms(dev, a, b) for a, b in times]
    timed = steps_eps[args.warmup :]
    tpf = (LATENT_HW[0] // 2) * (LATENT_HW[1] // 2)
    tokens = sum(e["latents"].shape[0] * tpf for eps in timed for e in eps)
    attention = backend
    if kind == "packed":
        mb = plans[-1][0].to(dev)
        mask = runner.prepare(mb.layout("latents"), mb.layout("text"), torch.bfloat16)["self_mask"]
        attention = f"packing {mask.backend} ({mask.kernel})"
    variant = f"{kind}[{'auto' if kind == 'packed' else 'diffusers'}]"
    return {
        **_row(variant, attention, compiled, timed, plans[args.warmup :], ms, tokens, dev, g0),
        "losses": torch.stack(losses).float().tolist(),
    }


def _row(
    variant: str,
    attention: str,
    compiled: bool,
    timed: list[Any],
    timed_plans: list[Any],
    ms: list[float],
    tokens: float,
    dev: torch.device,
    g0: int,
    **extra: Any,
) -> dict[str, Any]:
    """The fields every variant reports: its timed steps' episodes, micro-steps, times,
    tokens/s, peak memory and recompiles (``extra`` goes before the last three)."""
    t = harness.summarize(ms)
    return {
        "variant": variant,
        "attention": attention,
        "compiled": compiled,
        "episodes/step": sum(len(e) for e in timed) / len(timed),
        "micro-steps/step": sum(len(p) for p in timed_plans) / len(timed),
        "step ms": t.median_ms,
        "p10-p90 ms": f"{t.p10_ms:.0f}-{t.p90_ms:.0f}",
        "tokens/s": tokens / (sum(ms) * 1e-3),
        **extra,
        "peak GB": torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else 0.0,
        "recompiles after warm-up": harness.dynamo_counters()["unique_graphs"] - g0,
        "timing": t.as_dict(),
    }


def bucket_batches(
    eps: list[dict[str, Any]], budget: int, fmin: int, fmax: int, buckets: int = 4
) -> list[tuple[int, list[dict[str, Any]]]]:
    """Open-Sora-style frame buckets, cropped: each episode to the bucket edge below its frame
    count, ``budget // (edge * tokens a frame)`` rows a batch. ``[(frames, episodes), ...]``."""
    tpf = (LATENT_HW[0] // 2) * (LATENT_HW[1] // 2)
    span = (fmax - fmin) / buckets
    edges = sorted({fmin, *(int(fmin + span * i) for i in range(1, buckets))})
    groups: dict[int, list[dict[str, Any]]] = {}
    for ep in eps:
        f = ep["latents"].shape[0]
        groups.setdefault(max(e for e in edges if e <= f), []).append(ep)
    out = []
    for f in sorted(groups):
        rows = max(1, budget // (f * tpf))
        items = groups[f]
        out += [(f, items[lo : lo + rows]) for lo in range(0, len(items), rows)]
    return out


def bucketed_loss(model: torch.nn.Module, f: int, eps: list[dict[str, Any]], seed: int,
                  step: int, denom: float, dev: torch.device) -> torch.Tensor:  # fmt: skip
    """One ``(B, C, f, H, W)`` batch through the unmodified ``forward``: rectified flow, a
    timestep and noise per episode (seeded by episode and step), text zero-padded."""
    x0 = torch.stack([e["latents"][:f] for e in eps]).to(dev, non_blocking=True)  # (B, f, C, H, W)
    x0 = x0.permute(0, 2, 1, 3, 4)
    words = max(e["text"].shape[0] for e in eps)
    text = torch.zeros(len(eps), words, eps[0]["text"].shape[1], dtype=eps[0]["text"].dtype)
    for r, e in enumerate(eps):
        text[r, : e["text"].shape[0]] = e["text"]
    g = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + step)
    noise = torch.randn(x0.shape, generator=g, device=dev, dtype=x0.dtype)
    t = torch.rand(len(eps), generator=g, device=dev)
    xt = (1 - t)[:, None, None, None, None] * x0 + t[:, None, None, None, None] * noise
    pred = model(xt, t * 1000, text.to(dev, non_blocking=True), return_dict=False)[0]
    return (pred.float() - (noise - x0).float()).pow(2).mean(1).sum() / denom


def run_bucketed(args: Any, state: dict[str, torch.Tensor], steps_eps: list[list[dict[str, Any]]],
                 regime: tuple[int, ...], rname: str, dev: torch.device,
                 backend: str) -> dict[str, Any]:  # fmt: skip
    """``unpacked_bucketed``: the unmodified model on cropped frame-bucket batches."""
    budget, fmin, fmax, _ = regime
    compiled = dev.type == "cuda" and not args.no_compile
    model = build_model(args, dev)
    model.load_state_dict(state)
    if checkpointed(args.checkpointing, rname, "packed"):  # pack-sized batches: as packed
        model.enable_gradient_checkpointing()
    if dev.type == "cuda":
        model.set_attention_backend(backend)
    if compiled:
        model.compile_repeated_blocks(dynamic=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    plans = [bucket_batches(eps, budget, fmin, fmax) for eps in steps_eps]
    tpf = (LATENT_HW[0] // 2) * (LATENT_HW[1] // 2)
    times: list[Any] = []
    g0 = 0
    for s, batches in enumerate(plans):
        if s == args.warmup:
            warm_unseen_shapes(model, plans, args, dev)
            g0 = harness.dynamo_counters()["unique_graphs"]
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
        denom = float(sum(f * tpf * len(eps) for f, eps in batches))
        start = harness.mark(dev)
        for f, eps in batches:
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = bucketed_loss(model, f, eps, args.seed, s, denom, dev)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s >= args.warmup:
            times.append((start, harness.mark(dev)))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    ms = [harness.elapsed_ms(dev, a, b) for a, b in times]
    trained = sum(f * tpf * len(eps) for p in plans[args.warmup :] for f, eps in p)
    held = sum(e["latents"].shape[0] * tpf for eps in steps_eps[args.warmup :] for e in eps)
    timed = steps_eps[args.warmup :]
    return _row("unpacked_bucketed[diffusers]", backend, compiled, timed, plans[args.warmup :],
                ms, trained, dev, g0, **{"cropped fraction": 1 - trained / held,
                "shapes": len({(len(eps), f) for p in plans for f, eps in p})})  # fmt: skip


def warm_unseen_shapes(model: torch.nn.Module, plans: list[list[tuple[int, list[dict[str, Any]]]]],
                       args: Any, dev: torch.device) -> None:  # fmt: skip
    """Compile, before the timed steps, every ``(rows, frames)`` batch shape they hold that the
    warm-up steps did not: dynamo specialises on a batch of 1 even under ``dynamic=True``, so
    without this a timed step can hold a recompile (the 2026-12-01 H200 run held 2). One forward
    and backward a shape, the gradients then dropped: the weights are left as they were."""
    seen = {(len(eps), f) for p in plans[: args.warmup] for f, eps in p}
    for p in plans[args.warmup :]:
        for f, eps in p:
            if (len(eps), f) in seen:
                continue
            seen.add((len(eps), f))
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                bucketed_loss(model, f, eps, args.seed, len(plans), 1.0, dev).backward()
    model.zero_grad(set_to_none=True)


def _elapsed(dev: torch.device, a: Any) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize()
        b = torch.cuda.Event(enable_timing=True)
        b.record()
        b.synchronize()
        return float(a.elapsed_time(b)) / 1e3
    return time.perf_counter() - a


def main() -> None:
    p = harness.base_parser(__doc__.split("\n")[0])
    p.add_argument("--depth", type=int, default=4, help="Wan blocks (the 5B model has 30)")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (compile included)")
    p.add_argument("--regimes", default="seed,short")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument(
        "--checkpointing",
        default="none",
        help="per-block gradient checkpointing: none, packed, unpacked or both, or per regime "
        "(seed=both,short=packed: at 30 blocks what fits one H200)",
    )
    p.add_argument("--budget", type=int, default=None,
                   help="packed latent-token budget for every regime (default: the regime's; "
                   "size it with benchmarks/distributed/find_token_budget.py's memory model)")  # fmt: skip
    p.add_argument(
        "--variants",
        default="unpacked,packed",
        help="of unpacked (batch 1 + accumulation), unpacked_bucketed, packed",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=0.0,
        help="start no variant past this many seconds (the JSON has what finished)",
    )
    p.add_argument("--unpacked-backend", default="probe",
                   help="diffusers attention backend of the unpacked run (default: fastest probed)")  # fmt: skip
    args = p.parse_args()
    if args.out and not args.out.endswith(".json"):  # a folder: JSON and table go inside it
        args.out = str(Path(args.out) / "diffusers_wan.json")
    if args.quick:
        args.depth, args.steps, args.warmup = 2, 2, 1
    dev = torch.device(args.device)
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096
    kinds = args.variants.split(",")
    bad = [k for k in kinds if k not in ("unpacked", "unpacked_bucketed", "packed")]
    if bad:
        raise SystemExit(f"--variants {bad}: choose from unpacked, unpacked_bucketed, packed")
    for rname in args.regimes.split(","):
        for kind in ("unpacked", "packed"):
            checkpointed(args.checkpointing, rname, kind)  # a bad setting fails before the runs
    model0 = build_model(args, dev)
    cfg = model0.config
    state = {k: v.detach().cpu() for k, v in model0.state_dict().items()}
    del model0
    regimes = dict(QUICK_REGIMES if args.quick else REGIMES)
    if args.budget:
        regimes = {k: (args.budget, *v[1:]) for k, v in regimes.items()}
    drawn = {r: draw_steps(args, regimes[r], cfg.in_channels, cfg.text_dim)
             for r in args.regimes.split(",")}  # fmt: skip
    tpf = (LATENT_HW[0] // 2) * (LATENT_HW[1] // 2)
    lengths = [e["latents"].shape[0] * tpf for st in drawn.values() for eps in st for e in eps]
    if args.unpacked_backend == "probe":
        backend, probe = probe_backends(dev, cfg.num_attention_heads, cfg.attention_head_dim,
                                        lengths)  # fmt: skip
    else:
        backend, probe = args.unpacked_backend, {}
    print(f"unpacked attention backend: {backend} {probe}", flush=True)
    rows: list[dict[str, Any]] = []
    t_start = time.monotonic()
    for rname in args.regimes.split(","):
        steps_eps = drawn[rname]
        for kind in kinds:
            print(f"{rname}: {kind} ...", flush=True)
            ck = checkpointed(args.checkpointing, rname, "packed" if kind != "unpacked" else kind)
            if args.deadline_s and time.monotonic() - t_start > args.deadline_s:
                row = {
                    "variant": kind,
                    "error": f"not run: past the {args.deadline_s:g} s deadline",
                }
            else:
                try:
                    if kind == "unpacked_bucketed":
                        row = run_bucketed(args, state, steps_eps, regimes[rname], rname, dev,
                                           backend)  # fmt: skip
                    else:
                        row = run_variant(kind, args, state, steps_eps, regimes[rname], rname,
                                          dev, backend)  # fmt: skip
                except Exception as e:  # one failed variant must not lose the other rows
                    row = {"variant": kind, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append({"regime": rname, "checkpointed": ck, **row})
            gc.collect()  # the variant's model, optimizer state and graphs go before the next
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            harness.write_json("diffusers_wan", args, {"rows": rows, "probe": probe}, device=dev,
                              partial=True)  # fmt: skip
    for r in rows:
        base = next((b for b in rows if b["regime"] == r["regime"]
                     and b["variant"] == "unpacked[diffusers]" and "error" not in b), None)  # fmt: skip
        bucketed = next((b for b in rows if b["regime"] == r["regime"]
                         and b["variant"].startswith("unpacked_bucketed") and "error" not in b),
                        None)  # fmt: skip
        if bucketed and "error" not in r:
            r["vs bucketed"] = r["tokens/s"] / bucketed["tokens/s"]
        if base and "error" not in r:
            r["vs unpacked"] = r["tokens/s"] / base["tokens/s"]
        if base and "error" not in r and "losses" in r:
            lp, lu = torch.tensor(r["losses"]), torch.tensor(base["losses"])
            r["loss rel diff"] = float(((lp - lu).abs() / lu.abs()).max())
            if not torch.isfinite(lp).all():
                r["error"] = "non-finite loss"
    cols = ["regime", "variant", "checkpointed", "attention", "episodes/step", "micro-steps/step",
            "step ms",
            "p10-p90 ms", "tokens/s", "vs unpacked", "vs bucketed", "loss rel diff",
            "cropped fraction", "peak GB",
            "recompiles after warm-up", "error"]  # fmt: skip
    print()
    what = "tiny Wan (smoke, numbers mean nothing)" if args.quick else "Wan-2.2-TI2V-5B config"
    print(f"{what}, {cfg.num_layers} blocks, bf16 autocast, AdamW; "
          f"{args.steps} timed steps after {args.warmup} warm-up")  # fmt: skip
    table = harness.markdown_table(rows, cols)
    print(table)
    path = harness.write_json("diffusers_wan", args, {"rows": rows, "probe": probe,
                                              "unpacked_backend": backend}, device=dev)  # fmt: skip
    path.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
