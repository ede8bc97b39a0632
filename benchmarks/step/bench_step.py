"""Training step, end to end: packed vs one episode per micro-step vs padded batches.

The reference DiT (`packing.model._dit`, a few blocks at Wan-2.2-5B width: 3072, 24 heads of 128,
FFN 14336), bf16 autocast, fused AdamW, the same episodes and weights in every variant. One
optimizer step consumes the same set of episodes in every variant:

* ``packed[auto]`` / ``packed[flex]``: one pack (static token budgets for latents, actions and
  text, static ``max_docs``) per optimizer step, blocks compiled once.
* ``unpacked SDPA flash``: one episode per micro-step + gradient accumulation, blocks compiled
  with ``dynamic=True``, attention = plain ``scaled_dot_product_attention`` (flash kernel, no
  mask: one unpadded episode needs none) -- the strongest unpacked setup.
* ``lean``: one episode per micro-step, exact length, SDPA flash, one compiled block function
  (``dynamic=True``) over the same modules, inputs prepared ahead, none of the reference
  path's per-micro-step host work (benchmarks/step/baselines.py).
* ``bucket_sdpa`` / ``bucket_flex`` / ``bucket_crop``: length bucketing as Open-Sora 2.0 does
  it (``--buckets`` frame buckets, a batch size per bucket for about equal micro-step tokens,
  rows padded with a key-padding mask through SDPA or Flex, or cropped to the bucket below);
  the padding and cropped-data fractions and the number of shapes are reported.
* ``fill``: the whole step (packed auto) at fills of ``--fills`` of one static budget, one
  compiled model: step time against fill x the full pack's time (the padding tail).
* ``padded batch``: every episode padded to the longest of the step (the FLOPs and memory of a
  ``(K, L_max)`` batch; run through the packed model so the kernels are the same).
* ``packed, per-token conditioning``: the mistake -- the timestep MLP run on every token.
* ``packed eager``: no compile.
* ``cudagraphs``: packed auto with each block compiled ``mode="reduce-overhead"`` (CUDA graphs;
  not in the default list).

Reported: step time (median over timed steps, CUDA events), real tokens/s, ratio vs the
unpacked baseline, peak memory, MFU (model FLOPs of the real tokens from
`benchmarks/harness/flops.py`, against the measured 790 and the datasheet 989 TFLOP/s, each
field named by its peak), and graphs compiled after warm-up
(recompiles). Packs are drawn at random each step.

Every step's loss is recorded (on the device, read after the timed loop) and compared with the
unpacked variant's on the same episodes ("loss rel diff"). A non-finite loss marks the row as
an error: in session 2 a packed row was timed on NaN weights (a varlen padding bug since
fixed), and its GEMMs ran 20% faster than on real data.

    python benchmarks/step/bench_step.py                 # H200 (~6 min)
    python benchmarks/step/bench_step.py --quick         # tiny model on CPU, for CI
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import packing.model._dit as pm
from benchmarks import harness
from benchmarks.attention import backends
from benchmarks.harness import ZERO, EpisodeShape, Flops, dit_flops, mfu
from benchmarks.step import baselines as bl
from packing.data import PackedBatch, PackedCollator, Stream
from packing.model import DiT, DiTConfig, text_tokens
from packing.train import StepProfiler

ACTIONS_PER_FRAME = 1


def packed_collator(mcfg: Any, budget: int, max_docs: int) -> PackedCollator:
    """The static-shape collator of the packed variants: latents at ``budget`` tokens, the
    actions and text sized from it (every pack one shape, so the compiled step compiles once)."""
    a_budget = -(-budget // mcfg.tokens_per_frame * ACTIONS_PER_FRAME // 128) * 128
    return PackedCollator(
        [Stream("latents", grid=mcfg.grid, budget=budget, step_shape=(48, 8, 16)),
         Stream("action", budget=a_budget), Stream("text", budget=max_docs * mcfg.text_len)],
        max_docs=max_docs,
    )  # fmt: skip


def random_packs(args: Any, cfg: DiTConfig, budget: int, fmin: int, fmax: int, max_docs: int,
                 n_steps: int, seed: int | None = None) -> list[list[dict[str, Any]]]:  # fmt: skip
    """``n_steps`` random packs drawn from a pool of episodes (random lengths, random order),
    each filled up to the token budget (one frame = ``cfg.tokens_per_frame`` tokens)."""
    seed = args.seed if seed is None else seed
    rng = torch.Generator().manual_seed(seed)
    prng = random.Random(seed)
    pool_size = 24 if args.quick else 96
    pool = [make_episode(i, prng.randint(fmin, fmax), cfg, rng) for i in range(pool_size)]
    packs = []
    for _ in range(n_steps):
        order = prng.sample(range(pool_size), pool_size)
        eps, tok = [], 0
        for i in order:
            n = pool[i]["latents"].shape[0] * cfg.tokens_per_frame
            if tok + n > budget - 128 or len(eps) >= max_docs:
                continue
            eps.append(pool[i])
            tok += n
        packs.append(eps)
    return packs


def make_episode(i: int, frames: int, cfg: DiTConfig, rng: torch.Generator) -> dict[str, Any]:
    c, (h, w) = cfg.latent_channels, cfg.latent_hw
    return {
        "latents": torch.randn(frames, c, h, w, generator=rng),
        "action": torch.randn(frames * ACTIONS_PER_FRAME, cfg.action_dim, generator=rng),
        "text": text_tokens(f"task {i % 13}: pick the {i}th object", cfg.text_len),
        "episode_index": i,
    }


def pad_episode(ep: dict[str, Any], frames: int) -> dict[str, Any]:
    """The episode padded with zero frames to ``frames`` (the cost of a padded batch row)."""
    f = ep["latents"].shape[0]
    out = dict(ep)
    out["latents"] = torch.cat(
        [ep["latents"], ep["latents"].new_zeros(frames - f, *ep["latents"].shape[1:])]
    )
    a = ep["action"]
    out["action"] = torch.cat([a, a.new_zeros((frames - f) * ACTIONS_PER_FRAME, a.shape[1])])
    return out


# -- the unpacked baseline's attention: one unpadded episode -> plain SDPA, flash kernel -----
_LIB_ATTENTION = pm.packed_attention


def sdpa_one_episode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
    """(T, H, D) of ONE unpadded episode: no mask is needed; SDPA's default dispatch (forcing
    FLASH ran 1.88x slower than the default on a 7K-token episode of the H200)."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None])  # fmt: skip
    return o[0].transpose(0, 1)


# -- FLOPs ------------------------------------------------------------------------------------
def episode_shape(cfg: DiTConfig, ep: dict[str, Any]) -> EpisodeShape:
    """The token counts `harness.flops.dit_flops` needs, from one episode's tensors."""
    return EpisodeShape(
        ep["latents"].shape[0] * cfg.tokens_per_frame, ep["action"].shape[0], ep["text"].shape[0]
    )


def step_flops(cfg: DiTConfig, episodes: list[dict[str, Any]]) -> Flops:
    """Useful fwd+bwd FLOPs of one optimizer step over these (unpadded) episodes."""
    return dit_flops(cfg, [episode_shape(cfg, ep) for ep in episodes])


def mfu_fields(flops: Flops, seconds: float) -> dict[str, float]:
    """The MFU columns every row reports: against both peaks, named, plus the hardware
    count's achieved TFLOP/s (attention at 3.5x) beside the model count's."""
    return {
        **mfu(flops, seconds),
        "model TFLOP/s": flops.model / seconds / 1e12 if seconds > 0 else 0.0,
        "hardware TFLOP/s": flops.hardware / seconds / 1e12 if seconds > 0 else 0.0,
    }


# -- one variant ---------------------------------------------------------------------------
def loss_of(out: dict[str, torch.Tensor], denom: dict[str, float]) -> torch.Tensor:
    return out["latents"].sum() / denom["latents"] + out["action"].sum() / denom["action"]


def to_device(batch: PackedBatch, dev: torch.device) -> PackedBatch:
    """Pinned, non-blocking copy; episode ids stay on the host (the model's RNG keys are read
    there, and reading them from the GPU would be a sync)."""
    ep = batch.per_episode["episode_index"]
    b = batch.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else batch
    b.per_episode["episode_index"] = ep
    return b


def run_variant(name: str, args: Any, cfg: DiTConfig, steps_eps: list[list[dict[str, Any]]],
                dev: torch.device, state: dict[str, torch.Tensor]) -> dict[str, Any]:  # fmt: skip
    """Train ``len(steps_eps)`` optimizer steps; the first ``args.warmup`` are untimed."""
    kind = name.split(":")[0]
    # Each variant compiles from scratch: Block.forward is one code object shared by every
    # variant, and without a reset the variants' graphs pile up in one cache until dynamo hits
    # its recompile limit and silently runs the rest eager (seen in the first H200 run).
    torch._dynamo.reset()
    _forget_compiled_block()
    if dev.type != "cuda":
        attn = "auto"  # CPU: sdpa (the unpacked run swaps in plain SDPA anyway)
    elif kind == "unpacked":
        attn = "varlen"  # only cu_seqlens get built; sdpa_one_episode does the attention
    else:
        attn = "flex" if "flex" in name else "auto"
    # the mistake: DiTConfig(conditioning="per_token") runs the timestep MLP on every token
    conditioning = "per_token" if kind == "per_token" else "per_episode"
    mcfg = DiTConfig(**{**cfg.__dict__, "attention": attn, "conditioning": conditioning})
    model = DiT(mcfg).to(dev)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    compiled = kind != "eager" and not args.no_compile and dev.type == "cuda"
    if compiled:
        for i, b in enumerate(model.blocks):
            model.blocks[i] = torch.compile(
                b,
                dynamic=True if kind == "unpacked" else None,
                # CUDA graphs (cudagraph trees) over each block: the static token budget keeps
                # the tensor shapes fixed; a new Python int (FA4's max_seqlen) re-records.
                mode="reduce-overhead" if kind == "cudagraphs" else None,
            )
    pm.packed_attention = sdpa_one_episode if kind == "unpacked" else _LIB_ATTENTION

    budget = args.budget
    tpf = mcfg.tokens_per_frame
    if kind == "unpacked":
        collator = PackedCollator([*mcfg.streams(), Stream("text")], pad_to_multiple=1)
    else:
        collator = packed_collator(mcfg, budget, args.max_docs)

    def micro_batches(eps: list[dict[str, Any]]) -> list[PackedBatch]:
        if kind == "unpacked":
            return [collator([e]) for e in eps]
        if kind == "padded":
            fmax = max(e["latents"].shape[0] for e in eps)
            eps = [pad_episode(e, fmax) for e in eps]
            # a padded batch of K rows of L_max may not fit the pack budget: split it
            out, cur = [], []
            for e in eps:
                if (len(cur) + 1) * fmax * tpf > budget:
                    out.append(collator(cur))
                    cur = []
                cur.append(e)
            return [*out, collator(cur)]
        return [collator(eps)]

    # collate ahead (collate speed is bench_collate's subject) and pin
    plans = [micro_batches(eps) for eps in steps_eps]
    g0 = None
    times: list[Any] = []
    step_losses: list[torch.Tensor] = []  # on the device: read once, after the timed loop
    peak = 0
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for s, (eps, mbs) in enumerate(zip(steps_eps, plans, strict=True)):
        if s == args.warmup:
            # Peak memory of the timed steps. Not for CUDA graphs: their memory pool is
            # allocated while recording (in warm-up) and replays allocate nothing, so a reset
            # here read 16-18 GB against 74-94 GB for the same step uncaptured (runs 7-8).
            if dev.type == "cuda" and kind != "cudagraphs":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            g0 = harness.dynamo_counters()["unique_graphs"]
        denom = {"latents": float(sum(e["latents"].shape[0] * tpf for e in eps)),
                 "action": float(sum(e["action"].shape[0] for e in eps))}  # fmt: skip
        started = _timer(dev)
        step_loss = torch.zeros((), device=dev)
        for mb in mbs:
            if kind == "cudagraphs":
                torch.compiler.cudagraph_mark_step_begin()  # outputs of the last replay are done
            batch = to_device(mb, dev)
            batch.extras["seed"], batch.extras["step"] = 0, s
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                out = model(batch)
            loss = loss_of(out, denom)
            loss.backward()
            step_loss += loss.detach().float()
        step_losses.append(step_loss)
        finish_step(opt, dev, started, s >= args.warmup, times)
    times = _elapsed(dev, times)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    profile = None
    if args.profile and kind in ("packed", "unpacked", "per_token"):
        # One extra, untimed step under packing.train._profile: per-micro-step records and the
        # kernel table of its first micro-step, grouped attention / GEMM / elementwise / other.
        prof = StepProfiler(enabled=True, kernel_step=0, device=dev)
        for mb in plans[-1]:
            batch = to_device(mb, dev)
            batch.extras["seed"], batch.extras["step"] = 0, len(plans)
            with prof.micro_step(batch):
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                    out = model(batch)
                loss_of(out, denom).backward()
        opt.zero_grad(set_to_none=True)
        profile = prof.as_dict()
        if prof.kernel_table is not None:
            print(f"\n{name}\n{prof.kernel_table.markdown()}\n", flush=True)
    pm.packed_attention = _LIB_ATTENTION
    losses = torch.stack(step_losses).tolist()
    timed = steps_eps[args.warmup :]
    tok = [sum(e["latents"].shape[0] * tpf + e["action"].shape[0] for e in eps) for eps in timed]
    t = harness.summarize(times)
    ms_total = sum(times)
    flops = sum((step_flops(mcfg, eps) for eps in timed), ZERO)
    micro = sum(len(p) for p in plans[args.warmup :]) / max(len(timed), 1)
    resolved = None
    try:
        mb = plans[-1][0]
        resolved = pm.prepare_attention(mb.layout(), None, None, mcfg.attention, device=dev,
                                        dtype=torch.bfloat16).backend  # fmt: skip
    except Exception as e:
        resolved = f"? {type(e).__name__}"
    return {
        "variant": name,
        "attention": "sdpa default dispatch (per episode)" if kind == "unpacked" else resolved,
        "compiled": compiled,
        "steps timed": len(times),
        "micro-steps/step": micro,
        "step ms": t.median_ms,
        "p10-p90 ms": f"{t.p10_ms:.0f}-{t.p90_ms:.0f}",
        "tokens/s": sum(tok) / (ms_total * 1e-3),
        "peak GB": peak / 1e9,
        **mfu_fields(flops, ms_total * 1e-3),
        "recompiles after warm-up": harness.dynamo_counters()["unique_graphs"] - (g0 or 0),
        "losses": losses,
        "timing": t.as_dict(),
        "profile": profile,
    }


def opensora_pool(args: Any, cfg: DiTConfig, bounds: list[int]) -> list[dict[str, Any]]:
    """Fresh episodes of the regime's lengths, enough for ``warmup + steps`` full bucket
    batches (Open-Sora trains a bucket's batch only once it is full; the rest waits)."""
    tpf = cfg.tokens_per_frame + ACTIONS_PER_FRAME
    rng = torch.Generator().manual_seed(args.seed + 7)
    prng = random.Random(args.seed + 7)
    counts: dict[int, int] = {}
    pool: list[dict[str, Any]] = []
    need = args.warmup + args.steps
    while len(pool) < 4000:
        full = sum(c // bl.opensora_rows(L, args.budget) for L, c in counts.items())
        if full >= need:
            break
        f = prng.randint(args.fmin, args.fmax)
        L = next(b for b in bounds if b >= f * tpf)
        counts[L] = counts.get(L, 0) + 1
        pool.append(make_episode(10_000 + len(pool), f, cfg, rng))
    return pool


_PROBES: dict[tuple[Any, ...], dict[str, Any]] = {}


def probe_attention(kind: str, args: Any, cfg: DiTConfig, prepared: list[Any], plans: list[Any],
                    dev: torch.device) -> dict[str, Any]:  # fmt: skip
    """The self- and cross-attention this baseline runs: the fastest candidate on its own
    shapes (`benchmarks/attention/backends.py`), probed once per regime and kind of shape;
    ``--probe none`` keeps SDPA's default dispatch. Every timing goes into the row's JSON."""
    h, hd = cfg.heads, cfg.head_dim
    on_gpu = dev.type == "cuda"
    wanted = args.probe.split(",") if args.probe not in ("none", "") else ["sdpa"]
    if not on_gpu:
        wanted = ["sdpa"]  # the CPU smoke: one candidate, the probe's code still runs
    masked_self = kind in ("bucket_sdpa", "bucket_opensora")
    if kind == "lean":
        lengths = [x.tokens for inputs in prepared for x in inputs]
        text = max(x.text.shape[0] for inputs in prepared for x in inputs)
        picks = backends.representative(lengths, 2)
        self_shapes = [(1, h, n, n, hd) for n in picks]
        cross_shapes = [(1, h, n, text, hd) for n in picks]
    else:
        flat = sorted((b for p in plans for b in p), key=lambda b: b.L)
        picks = [flat[len(flat) // 2], flat[-1]] if len(flat) > 1 else flat
        self_shapes = [(b.slots // b.L, h, b.L, b.L, hd) for b in picks]
        cross_shapes = [(b.slots // b.L, h, b.L, cfg.text_len, hd) for b in picks]
    key = (args.regime, kind if masked_self else "unmasked" if kind != "bucket_flex" else "flex",
           tuple(self_shapes))  # fmt: skip
    if key in _PROBES:
        return _PROBES[key]
    pool_self = backends.masked() if masked_self else backends.unmasked()
    if kind == "bucket_sdpa":  # the SDPA row: SDPA's backends only (Flex has its own row)
        pool_self.pop("flex")
    self_c = {n: f for n, f in pool_self.items() if n in wanted or n == "sdpa"}
    cross_c = {n: f for n, f in backends.masked().items() if n in wanted and n != "flex"}
    cross_c.setdefault("sdpa", backends.sdpa)

    def key_mask(shape: tuple[int, ...], name: str) -> Any:
        b, _, _, lk, _ = shape
        n = max(1, lk * 9 // 10) if lk > 1 else 1  # 10% padding in every row
        lengths = torch.full((b,), n, device=dev)
        if name == "flex":
            return bl.key_padding_block_mask(lengths, lk)
        return (torch.arange(lk, device=dev)[None] < lengths[:, None])[:, None, None]

    def text_mask(shape: tuple[int, ...], name: str) -> Any:
        b, _, _, lk, _ = shape
        keep = torch.zeros(b, 1, 1, lk, dtype=torch.bool, device=dev)
        keep[..., : min(lk, 31)] = True  # ~31 text tokens an episode, the rest padding
        return keep

    out: dict[str, Any] = {}
    if kind == "bucket_flex":
        out["self"] = {"role": "self", "chosen": "flex", "note": "the Flex row: not probed"}
    else:
        out["self"] = backends.choose("self", self_shapes, self_c, device=dev,
                                      make_mask=key_mask if masked_self else None)  # fmt: skip
    out["cross"] = backends.choose("cross", cross_shapes, cross_c, device=dev,
                                   make_mask=None if kind == "lean" else text_mask)  # fmt: skip
    _PROBES[key] = out
    return out


def run_baseline(name: str, args: Any, cfg: DiTConfig, steps_eps: list[list[dict[str, Any]]],
                 dev: torch.device, state: dict[str, torch.Tensor]) -> dict[str, Any]:  # fmt: skip
    """The lean per-episode loop or length bucketing (benchmarks/step/baselines.py) on the
    same steps, weights and per-episode noise as `run_variant` (``bucket_opensora``: its own
    pool of episodes, one bucket a step); inputs prepared before the timed loop (a data
    loader's work); attention probed on the run's shapes (`probe_attention`)."""
    kind = name.split(":")[0]
    # No dynamo reset: the baselines' compiled block is their own function (not Block.forward),
    # so its graphs carry over between the baseline variants and regimes of one run.
    model = DiT(cfg).to(dev)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    compiled = not args.no_compile and dev.type == "cuda"
    whole = kind == "lean_whole"  # the whole episode loss compiled as one graph, not blocks
    kind = "lean" if whole else kind
    lean = bl.lean_episode_loss
    bucket = bl.bucket_batch_loss
    global _COMPILED_BLOCK
    if compiled and _COMPILED_BLOCK is None:
        _COMPILED_BLOCK = torch.compile(bl.block_forward, dynamic=True)
    bl.block_fn = _COMPILED_BLOCK if compiled and not whole else bl.block_forward
    if compiled and whole:
        lean = torch.compile(bl.lean_episode_loss, dynamic=True)
    tpf = cfg.tokens_per_frame + ACTIONS_PER_FRAME
    mode = "crop" if kind == "bucket_crop" else "pad"
    n_buckets = args.opensora_buckets if kind == "bucket_opensora" else args.buckets
    bounds = bl.bounds_for(mode, args.fmin * tpf, args.fmax * tpf, n_buckets, tpf)
    prepared: list[Any] = []
    plans: list[Any] = []
    deferred = None
    if kind == "bucket_opensora":
        pool = bl.prepare_episodes(model, opensora_pool(args, cfg, bounds), 0, dev)
        batches, deferred = bl.opensora_steps(pool, bounds, args.budget, cfg.text_len, dev,
                                              args.seed)  # fmt: skip
        plans = [[b] for b in batches[: args.warmup + args.steps]]
        prepared = [[] for _ in plans]
    else:
        for s, eps in enumerate(steps_eps):
            inputs = bl.prepare_episodes(model, eps, s, dev)
            prepared.append(inputs)
            if kind != "lean":
                plans.append(bl.bucket_step(inputs, bounds, args.budget, mode, cfg.text_len, dev))
    probe = probe_attention(kind, args, cfg, prepared, plans, dev)
    chosen_self, chosen_cross = probe["self"]["chosen"], probe["cross"]["chosen"]
    self_fn = (backends.unmasked() | backends.masked())[chosen_self]
    cross_fn = backends.masked()[chosen_cross]

    def micro_step(item: Any, dv: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
        """One micro-step's forward and backward; its share of the step loss (detached)."""
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            if kind == "lean":
                x = item
                loss = lean(model, x.xt_v, x.v_v, x.xt_a, x.v_a, x.t, x.thw, x.text, dv, da,
                            self_fn, cross_fn)  # fmt: skip
            else:
                mask = (bl.key_padding_block_mask(item.lengths_B, item.L)
                        if chosen_self == "flex" else _key_padding(item, dev))  # fmt: skip
                if kind == "bucket_crop":
                    mask = None  # cropped rows are exact: no padding to mask
                loss = bucket(model, *item.args, self_fn, mask, dv, da, cross_fn)
        loss.backward()
        return loss.detach().float()

    started = time.monotonic()
    graphs0 = harness.dynamo_counters()["unique_graphs"]
    if compiled:
        # Dynamic shapes still compile more than one graph: dynamo specialises a batch of one
        # row (its 0/1 rule), inductor guards on a length's divisibility by 8 and on size
        # ranges, so a step can meet a graph no earlier step needed (seen on the H200: 2-16 s
        # steps among 0.6 s ones). Every micro-batch of the run goes through forward and
        # backward once first, untimed (gradients dropped, no optimizer step): the timed steps
        # measure the steady state, and "graphs" says what a run pays to reach it.
        one = torch.ones((), device=dev)
        for s, inputs in enumerate(prepared):
            for item in inputs if kind == "lean" else plans[s]:
                micro_step(item, one, one)
            opt.zero_grad(set_to_none=True)
    graphs = harness.dynamo_counters()["unique_graphs"] - graphs0
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    compile_s = time.monotonic() - started
    times: list[Any] = []
    step_losses: list[torch.Tensor] = []
    g0 = None
    cut = None
    for s, inputs in enumerate(prepared):
        if args.variant_limit and time.monotonic() - started > args.variant_limit:
            cut = f"cut at the {args.variant_limit:g} s variant limit after {s} steps"
            break
        if s == args.warmup:
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            g0 = harness.dynamo_counters()["unique_graphs"]
        # the step's denominators: the tokens trained on (cropped tokens are not)
        if kind == "lean":
            n_v = sum(x.xt_v.shape[0] for x in inputs)
            n_a = sum(x.xt_a.shape[0] for x in inputs)
        else:
            n_v = sum(b.args[0].shape[0] for b in plans[s])
            n_a = sum(b.args[2].shape[0] for b in plans[s])
        dv = torch.tensor(float(n_v), device=dev)
        da = torch.tensor(float(n_a), device=dev)
        clock = _timer(dev)
        step_loss = torch.zeros((), device=dev)
        for item in inputs if kind == "lean" else plans[s]:
            step_loss += micro_step(item, dv, da)
        step_losses.append(step_loss)
        finish_step(opt, dev, clock, s >= args.warmup, times)
    times = _elapsed(dev, times)
    if len(times) < 2:
        raise RuntimeError(f"{cut or 'no timed steps'}: {len(times)} timed, too few to report")
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
    profile = None
    if args.profile and kind == "lean":
        # As the packed step is profiled: one extra, untimed step under StepProfiler, the
        # per-micro-step records of every episode and the kernel table of the longest one.
        last = prepared[-1]
        longest = max(range(len(last)), key=lambda i: last[i].tokens)
        prof = StepProfiler(enabled=True, kernel_step=longest, device=dev)
        one = torch.ones((), device=dev)
        for x in last:
            with prof.micro_step(tokens=x.tokens, padded_tokens=x.tokens, documents=1):
                micro_step(x, one, one)
        opt.zero_grad(set_to_none=True)
        profile = prof.as_dict()
        if prof.kernel_table is not None:
            print(f"\n{name}\n{prof.kernel_table.markdown()}\n", flush=True)
    ran = slice(args.warmup, args.warmup + len(times))  # the timed steps (fewer if cut)
    timed = steps_eps[ran]
    tpf_v = cfg.tokens_per_frame
    tok = [sum(e["latents"].shape[0] * tpf_v + e["action"].shape[0] for e in eps) for eps in timed]
    ms_total = sum(times)
    row: dict[str, Any] = {
        "variant": name,
        "attention": f"self {chosen_self}, cross {chosen_cross} (probed)",
        "attention probe": probe,
        "profile": profile,
        "compiled": compiled,
        "steps timed": len(times),
        "micro-steps/step": (
            sum(len(x) for x in prepared[ran])
            if kind == "lean"
            else sum(len(p) for p in plans[ran])
        )
        / max(len(timed), 1),
        "compile s": compile_s,
        "graphs": graphs,
        "cut": cut,
        "step ms": harness.summarize(times).median_ms,
        "p10-p90 ms": "{:.0f}-{:.0f}".format(*_p10_p90(times)),
        "peak GB": peak / 1e9,
        "recompiles after warm-up": harness.dynamo_counters()["unique_graphs"] - (g0 or 0),
        "losses": torch.stack(step_losses).tolist(),
        "timing": harness.summarize(times).as_dict(),
    }
    if kind == "bucket_opensora":
        row["deferred episodes"] = deferred  # a bucket's partial batch waits for the next epoch
        row["episodes/step"] = sum(len(b.row_shapes) for p in plans[ran] for b in p) / len(times)
    if kind in ("bucket_crop", "bucket_opensora"):
        # tokens/s and MFU count what was trained on: cropped tokens are not, and Open-Sora's
        # steps are its own pool's batches, not the shared steps' episodes
        shapes = [sh for p in plans[ran] for b in p for sh in b.row_shapes]
        row["tokens/s"] = sum(sh.joint for sh in shapes) / (ms_total * 1e-3)
        flops = dit_flops(cfg, shapes)
    else:
        row["tokens/s"] = sum(tok) / (ms_total * 1e-3)
        flops = sum((step_flops(cfg, eps) for eps in timed), ZERO)
    row.update(mfu_fields(flops, ms_total * 1e-3))
    if kind != "lean":
        flat = [b for p in plans[ran] for b in p]
        real = sum(b.real_tokens for b in flat)
        row["padding fraction"] = 1 - real / sum(b.slots for b in flat)
        row["cropped fraction"] = sum(b.cropped_tokens for b in flat) / (
            real + sum(b.cropped_tokens for b in flat)
        )
        row["buckets"] = bounds
        row["shapes"] = len({(b.slots // b.L, b.L) for b in flat})
    return row


_COMPILED_BLOCK: Any = None


def _forget_compiled_block() -> None:
    """After a dynamo reset the baselines' compiled block must be compiled again."""
    global _COMPILED_BLOCK
    _COMPILED_BLOCK = None


def _key_padding(mb: Any, dev: torch.device) -> torch.Tensor:
    """(B, 1, 1, L) bool, True on each row's real keys."""
    return (torch.arange(mb.L, device=dev)[None] < mb.lengths_B[:, None])[:, None, None]


def _timer(dev: torch.device) -> tuple[Any, Any]:
    """A step's start: a recorded CUDA event and its unrecorded end, or the host clock."""
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        return a, b
    return time.perf_counter(), None


def finish_step(opt: Any, dev: torch.device, started: tuple[Any, Any], timed: bool,
                times: list[Any]) -> None:  # fmt: skip
    """The optimizer step, then the step's clock stopped and kept if the step is ``timed``
    (``_elapsed`` reads the kept CUDA events after one synchronize, past the loop)."""
    opt.step()
    opt.zero_grad(set_to_none=True)
    a, b = started
    if dev.type == "cuda":
        b.record()
        stop: Any = (a, b)
    else:
        stop = (time.perf_counter() - a) * 1e3
    if timed:
        times.append(stop)


def _elapsed(dev: torch.device, times: list[Any]) -> list[float]:
    if dev.type == "cuda":
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in times]
    return list(times)


def _p10_p90(times: list[float]) -> tuple[float, float]:
    t = harness.summarize(times)
    return t.p10_ms, t.p90_ms


def run_fill_axis(args: Any, cfg: DiTConfig, regime: tuple[int, int, int, int], dev: torch.device,
                  state: dict[str, torch.Tensor]) -> list[dict[str, Any]]:  # fmt: skip
    """The whole step at fills of 50-100% of one static budget: packed auto, one compiled
    model, the same collator (so no recompile between fills). Goal: step time within 10% of
    fill x the full pack's time."""
    budget, fmin, fmax, max_docs = regime
    steps = max(args.steps // 2, 2)
    fills = [float(f) for f in args.fills.split(",")]
    sets = {f: random_packs(args, cfg, int(budget * f), fmin, fmax, max_docs,
                            args.warmup + steps, seed=args.seed + 7) for f in fills}  # fmt: skip
    torch._dynamo.reset()
    _forget_compiled_block()
    mcfg = DiTConfig(**{**cfg.__dict__, "attention": "auto"})
    model = DiT(mcfg).to(dev)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    if not args.no_compile and dev.type == "cuda":
        for i, b in enumerate(model.blocks):
            model.blocks[i] = torch.compile(b)
    tpf = mcfg.tokens_per_frame
    collator = packed_collator(mcfg, budget, max_docs)
    rows = []
    for f in sorted(fills, reverse=True):  # the full pack first: its time is the reference
        eps_list = sets[f]
        mbs = [collator(eps) for eps in eps_list]
        times = []
        for s, (eps, mb) in enumerate(zip(eps_list, mbs, strict=True)):
            denom = {"latents": float(sum(e["latents"].shape[0] * tpf for e in eps)),
                     "action": float(sum(e["action"].shape[0] for e in eps))}  # fmt: skip
            started = _timer(dev)
            batch = to_device(mb, dev)
            batch.extras["seed"], batch.extras["step"] = 0, s
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                out = model(batch)
            loss_of(out, denom).backward()
            finish_step(opt, dev, started, s >= args.warmup, times)
        times = _elapsed(dev, times)
        real = [sum(e["latents"].shape[0] * tpf for e in eps) for eps in eps_list[args.warmup :]]
        rows.append({"fill target": f, "fill": sum(real) / (len(real) * budget),
                     "step ms": harness.summarize(times).median_ms,
                     "timing": harness.summarize(times).as_dict()})  # fmt: skip
    full = max(rows, key=lambda r: r["fill target"])
    for r in rows:
        r["ms / (fill x full ms)"] = r["step ms"] / (r["fill"] / full["fill"] * full["step ms"])
    return rows


def variant_row(
    name: str, regime: str, args: Any, cfg: DiTConfig, steps_eps: Any, dev: Any, state: Any
) -> dict[str, Any]:
    """One variant's row; a failure is recorded in the row (never hidden) and printed."""
    try:
        if name.split(":")[0] in (
            "lean",
            "lean_whole",
            "bucket_sdpa",
            "bucket_flex",
            "bucket_crop",
            "bucket_opensora",
        ):
            row = run_baseline(name, args, cfg, steps_eps, dev, state)
        else:
            row = run_variant(name, args, cfg, steps_eps, dev, state)
    except Exception as e:
        row = {"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    bad = [i for i, x in enumerate(row.get("losses", [])) if not math.isfinite(x)]
    if bad:
        # NaN weights run at another speed (data-dependent GEMM power): not a valid timing.
        row["error"] = f"non-finite loss from step {bad[0]} on: timings not valid"
    row["regime"] = regime
    row.setdefault("episodes/step", sum(len(e) for e in steps_eps) / len(steps_eps))
    print({k: v for k, v in row.items() if k not in ("timing", "profile", "losses")}, flush=True)
    return row


def main() -> None:
    p = harness.base_parser(__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--long-steps", type=int, default=0,
                   help="also run packed[auto] for this many steps (recompile count)")  # fmt: skip
    p.add_argument("--regimes", default="seed,short")
    p.add_argument("--variants", default="lean,unpacked,packed,packed_flex,bucket_sdpa,"
                   "bucket_flex,bucket_crop,padded,per_token,eager,fill")  # fmt: skip
    p.add_argument("--buckets", type=int, default=4, help="length buckets for bucket_*")
    p.add_argument("--fills", default="0.5,0.625,0.75,0.875,1.0", help="the fill axis")
    p.add_argument("--fill-regimes", default="seed,short", help="regimes given the fill axis")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--variant-limit", type=float, default=0.0,
                   help="seconds a baseline variant may run (compile included); past it the "
                   "variant stops at a step boundary and reports the steps it timed")  # fmt: skip
    p.add_argument(
        "--profile",
        action="store_true",
        help="kernel tables (packing.train.StepProfiler) of packed and lean steps",
    )
    p.add_argument(
        "--probe",
        default="sdpa,sdpa_flash,sdpa_cudnn,sdpa_efficient,flex,fa4",
        help="attention candidates the baselines probe on their shapes ('none': "
        "SDPA's default dispatch)",
    )
    p.add_argument(
        "--opensora-buckets",
        type=int,
        default=8,
        help="length buckets of bucket_opensora (Open-Sora's sampler)",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=0.0,
        help="start no variant past this many seconds (the JSON has what finished)",
    )
    args = p.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    # 4 blocks x (fwd under grad, first-block fp32 input vs bf16) need a few graphs per
    # variant; the default limit of 8 would silently fall back to eager.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096
    if args.quick:
        cfg = DiTConfig.tiny(depth=1)
        regimes = {"seed": (512, 4, 8, 16), "short": (512, 1, 3, 64)}
        args.steps, args.warmup = 2, 1
        # no Flex backward on the CPU
        args.variants = ",".join(v for v in args.variants.split(",")
                                 if v not in ("packed_flex", "bucket_flex"))  # fmt: skip
    else:
        cfg = DiTConfig.wan_2_2_5b(depth=args.depth)
        # budget tokens, min frames, max frames, max_docs   (32 tokens / frame)
        regimes = {"seed": (65536, 144, 336, 16), "short": (49152, 10, 79, 160)}
    ref = DiT(cfg)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    del ref
    rows: list[dict[str, Any]] = []
    variants = {
        "unpacked": "unpacked: 1 episode/micro-step, SDPA default dispatch, compiled dynamic",
        "packed": "packed: backend auto, compiled",
        "packed_flex": "packed: backend flex (Triton), compiled",
        "padded": "padded: pad to longest, compiled",
        "per_token": "per_token: packed auto, timestep MLP per token (mistake)",
        "eager": "eager: packed auto, no compile",
        "cudagraphs": "cudagraphs: packed auto, compiled, CUDA graphs (reduce-overhead)",
        "lean": "lean: 1 episode/micro-step, exact length, probed attention, blocks compiled dynamic",
        "lean_whole": "lean_whole: lean, the whole episode loss compiled dynamic (one graph)",
        "bucket_sdpa": "bucket_sdpa: length buckets, batch per bucket, padded, SDPA key mask",
        "bucket_flex": "bucket_flex: length buckets, batch per bucket, padded, Flex key mask",
        "bucket_crop": "bucket_crop: length buckets, batch per bucket, cropped (Open-Sora)",
        "bucket_opensora": "bucket_opensora: Open-Sora's sampler, more buckets, one bucket a step",
    }
    fill_rows: list[dict[str, Any]] = []
    model_info = cfg.__dict__ | {"attention": None}

    def checkpoint() -> None:  # the first H200 step run was cut before its only write
        harness.write_json("step", args, {"rows": rows, "fill_axis": fill_rows,
                          "model": model_info}, device=dev, partial=True)  # fmt: skip

    t_start = time.monotonic()
    for rname in args.regimes.split(","):
        budget, fmin, fmax, max_docs = regimes[rname]
        args.budget, args.max_docs, args.fmin, args.fmax = budget, max_docs, fmin, fmax
        args.regime = rname
        steps_eps = random_packs(args, cfg, budget, fmin, fmax, max_docs, args.warmup + args.steps)
        for v in args.variants.split(","):
            if v == "fill":
                if rname not in args.fill_regimes.split(","):
                    continue
                try:
                    got = run_fill_axis(args, cfg, regimes[rname], dev, state)
                except Exception as e:
                    got = [{"error": f"{type(e).__name__}: {str(e)[:300]}"}]
                fill_rows.extend({"regime": rname, **r} for r in got)
                print(got, flush=True)
                checkpoint()
                continue
            name = variants[v]
            if args.deadline_s and time.monotonic() - t_start > args.deadline_s:
                rows.append({"variant": name, "regime": rname,
                             "error": f"not run: past the {args.deadline_s:g} s deadline"})  # fmt: skip
                checkpoint()
                continue
            print(f"== {rname} {v} {time.strftime('%H:%M:%S')}", flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(variant_row(name, rname, args, cfg, steps_eps, dev, state))
            checkpoint()
        if args.long_steps and rname == "seed" and "packed" in args.variants.split(","):
            long_eps = random_packs(args, cfg, budget, fmin, fmax, max_docs,
                                    args.warmup + args.long_steps, seed=args.seed + 1)  # fmt: skip
            name = variants["packed"] + f", {args.long_steps} steps"
            rows.append(variant_row(name, rname, args, cfg, long_eps, dev, state))
            checkpoint()
    valid = [r for r in rows if "step ms" in r and not r.get("error")]
    base = {r["regime"]: r for r in valid if r["variant"].startswith("unpacked")}
    lean = {r["regime"]: r for r in valid if r["variant"].startswith("lean:")}
    best: dict[str, dict[str, Any]] = {}  # the best baseline a skeptic would pick, per regime
    for r in valid:
        is_baseline = r["variant"].startswith(("lean", "bucket"))
        if is_baseline and r["tokens/s"] > best.get(r["regime"], {}).get("tokens/s", 0):
            best[r["regime"]] = r
    for r in valid:
        b = base.get(r["regime"]) or lean.get(r["regime"])
        if base.get(r["regime"]):
            r["vs unpacked"] = r["tokens/s"] / base[r["regime"]]["tokens/s"]
        if lean.get(r["regime"]):
            r["vs lean"] = r["tokens/s"] / lean[r["regime"]]["tokens/s"]
        if best.get(r["regime"]):
            r["vs best baseline"] = r["tokens/s"] / best[r["regime"]]["tokens/s"]
            r["best baseline"] = best[r["regime"]]["variant"].split(":")[0]
        # the same episodes and weights; padded rows also train on their zero frames (a cost
        # model of a padded batch) and cropped rows on fewer, so their loss differs by design
        # (Open-Sora's steps are other batches of other episodes)
        comparable = not r["variant"].startswith(("padded", "bucket_crop", "bucket_opensora"))
        if b and comparable and len(r["losses"]) == len(b["losses"]):
            r["loss rel diff"] = max(
                abs(x - y) / abs(y) for x, y in zip(r["losses"], b["losses"], strict=True)
            )
    cols = ["regime", "variant", "attention", "episodes/step", "micro-steps/step", "step ms",
            "p10-p90 ms", "tokens/s", "vs unpacked", "vs lean", "vs best baseline",
            "loss rel diff", "MFU of measured 790", "MFU of datasheet 989", "padding fraction", "cropped fraction", "shapes", "peak GB",
            "recompiles after warm-up", "steps timed", "compile s", "graphs", "cut", "error"]  # fmt: skip
    print(harness.markdown_table(rows, cols))
    if fill_rows:
        print(harness.markdown_table(fill_rows, ["regime", "fill target", "fill", "step ms",
                                                "ms / (fill x full ms)", "error"]))  # fmt: skip
    harness.write_json("step", args, {"rows": rows, "fill_axis": fill_rows, "model": model_info},
                      device=dev)  # fmt: skip


if __name__ == "__main__":
    main()
