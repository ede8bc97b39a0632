"""LeRobot's LingBot-VA trained packed vs its own path vs a lean per-episode loop, one GPU.

The model is LeRobot 0.6.1's dual-stream ``WanTransformer3DModel`` (``lerobot.policies.
lingbot_va``) at Wan2.2-5B widths (3072 wide, 24 heads of 128, FFN 14336, 48 latent
channels, UMT5 text 4096), ``--blocks`` blocks, random init, bf16 as ``LingBotVAPolicy``
keeps it, fused AdamW, activation checkpointing on every block in every arm. Every arm
trains the same episodes from the same weights with the same draws (timestep ids, noise, the
noisy-condition branch, chunk 1-4 and window 4-64, drawn per episode; `common.make_episode`):

* ``lerobot``: LeRobot's own path, one episode per micro-step + gradient accumulation:
  ``forward_train`` through its ``FlexAttnFunc`` (block masks rebuilt by its compiled
  ``create_block_mask`` every episode, ``flex_attention`` compiled ``dynamic=True``, blocks
  eager, the timestep MLP on every token) and its ``_flow_matching_loss``; blocks wrapped in
  ``checkpoint_wrapper``. torch's default recompile limit, as its trainer runs.
* ``lean``: the best per-episode loop a careful user writes over the same modules: one
  episode per micro-step at its exact length (no padding), the block step compiled
  ``dynamic=True`` (one graph for every length; attention runs between its graphs, compiled
  on its own, as LeRobot's does), the timestep MLP once per frame, block masks cached per
  (frames, chunk, window), self-attention through the faster of FlexAttention and SDPA with a
  dense mask (a timed fwd+bwd probe on the run's median episode; timings in the JSON),
  cross-attention SDPA without a mask.
* ``packed`` (row ``packed[lingbot_va]``): K episodes in one sequence of a static token
  budget (``max_docs`` static too) through `packing.integrations.lingbot_va` (``install``,
  its collator, ``loss(batch, "episode")``), each block compiled once and checkpointed here.
* ``packed_bench`` (row ``packed[bench]``): the same layout built in this script
  (`common.layout` + torch's compiled ``create_block_mask``): what ran before the
  integration existed, kept as a second implementation to compare against.

Regimes: ``seed`` the notes' episodes (144-336 latent frames: 4.6K-10.7K latent tokens a
copy, 10.4K-24.2K model tokens) in packs of ``--budget`` model tokens; ``short`` LeRobot's
recipe, fixed 16-frame windows (4 latent frames, 288 model tokens) at batch 1 with
accumulation against ``--windows`` windows a pack. Reported: step time (median and spread,
CUDA events), model tokens/s (both copies, real tokens only), ratio to lerobot and lean, MFU
on the counted FLOPs (`harness.flops.lingbot_flops`: per-frame conditioning, the mask's own
pairs; identical for every arm), peak memory, recompiles after warm-up, the first step's loss
next to lerobot's, and packing's own share of a packed step (collate on the host; masks and
conditioning timed on the device, each bracketed by a sync).

    python benchmarks/lingbot/bench_lingbot.py --blocks 4,30 --out /tmp/lingbot   # one H200
    python benchmarks/lingbot/bench_lingbot.py --smoke                     # tiny, CPU, ~1 min
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
import types
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import harness
from benchmarks.harness import LingbotEpisode, lingbot_flops
from benchmarks.lingbot import common as lb

# regime: frames min/max, budget (model tokens), max_docs
SEED = (144, 336)
SHORT_FRAMES = 4
SMOKE = {"seed": (5, 9, 384, 4), "short": (4, 4, 256, 4)}


# -- steps -------------------------------------------------------------------------------------
def draw_steps(args: Any, regime: str, cfg: dict[str, Any], hw: tuple[int, int], n: int,
               budget: int, max_docs: int, dev: torch.device) -> list[list[lb.Episode]]:  # fmt: skip
    """``n`` optimizer steps of episodes: seed-regime lengths filling ``budget`` model tokens,
    or ``max_docs`` short windows (the same episodes for every arm)."""
    rng = random.Random(args.seed)
    lo, hi = (SMOKE[regime][:2] if args.smoke else
              (SEED if regime == "seed" else (SHORT_FRAMES, SHORT_FRAMES)))  # fmt: skip
    per_frame = 2 * ((hw[0] // 2) * (hw[1] // 2) + lb.ACTIONS_PER_FRAME)
    steps, index = [], 0
    for step in range(n):
        eps: list[lb.Episode] = []
        used = 0
        while len(eps) < max_docs:
            f = rng.randint(lo, hi)
            if used + f * per_frame > budget:
                break
            eps.append(lb.make_episode(index, f, cfg, hw, args.seed, step, dev))
            used += f * per_frame
            index += 1
        steps.append(eps)
    return steps


# -- arms --------------------------------------------------------------------------------------
class Arm:
    """One arm's model, optimizer and step function over a list of episodes on the device."""

    name = ""

    def __init__(self, args: Any, model: Any, dev: torch.device, hw: tuple[int, int]) -> None:
        self.args, self.model, self.dev, self.hw = args, model, dev, hw
        self.cfg = lb.TINY if args.smoke else lb.WAN_5B
        self.holder = lb.loss_holder((1, 2, 2))
        self.amask = lb.action_mask(self.cfg, dev)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
        self.info: dict[str, Any] = {}

    def step(self, eps: list[lb.Episode], prepared: Any) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, eps: list[lb.Episode]) -> Any:
        """Host work a data loader does ahead (collate); None where the arm has none."""
        return None

    def finish(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class LeRobotArm(Arm):
    name = "lerobot"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, blk in enumerate(self.model.blocks):
            self.model.blocks[i] = checkpoint_wrapper(blk)
        if self.dev.type != "cuda":  # no Flex backward on the CPU: the dense stand-in
            from torch.nn.attention.flex_attention import create_block_mask

            utils, _ = lb.lerobot_lingbot()
            utils.FlexAttnFunc.flex_attn = lb.dense_flex
            utils.FlexAttnFunc.compiled_create_block_mask = (
                lambda *a, _compile=False, **k: create_block_mask(*a, **k))  # fmt: skip
        self.info["attention"] = "LeRobot FlexAttnFunc (mask rebuilt per episode)"

    def step(self, eps: list[lb.Episode], prepared: Any) -> torch.Tensor:
        total = torch.zeros((), device=self.dev)
        for ep in eps:
            loss = lb.lerobot_loss(self.model, self.holder, ep, self.amask) / len(eps)
            loss.backward()
            total += loss.detach()
        return total


def _lean_block_step(*a: Any) -> Any:  # its own code object: its own compile cache
    return lb.block_step(*a)


def _packed_block_step(*a: Any) -> Any:
    return lb.block_step(*a)


class LeanArm(Arm):
    name = "lean"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        lb.swap_attention(self.model)
        on_gpu = self.dev.type == "cuda"
        step = torch.compile(_lean_block_step, dynamic=True) if on_gpu else None
        self.run_blocks = lb.blocks_runner(self.model, checkpointing=True, compiled_step=step)
        self.loss_module = lb.LeanLoss(self.model)
        self.masks: OrderedDict[tuple[int, int, int], Any] = OrderedDict()
        self.attend = lb.flex
        self.info["compiled"] = on_gpu

    def probe(self, steps: list[list[lb.Episode]]) -> None:
        """FlexAttention vs SDPA with the dense mask, fwd+bwd on the median episode's shape and
        mask; the faster one runs every episode."""
        if self.dev.type != "cuda":
            self.info["attention probe"] = {"chosen": "flex", "note": "CPU: not probed"}
            return
        eps = sorted((e for s in steps for e in s), key=lambda e: e.frames)
        ep = eps[len(eps) // 2]
        lay = lb.layout_to(lb.layout([ep], self.hw, pad_to=1), self.dev)
        h, d = self.cfg["num_attention_heads"], self.cfg["attention_head_dim"]
        ms: dict[str, float] = {}
        for name, fn, mask in (("flex", lb.flex, self._block_mask(lay)),
                               ("sdpa", lb.sdpa, lb.dense_lingbot_mask(lay))):  # fmt: skip
            q, k, v = (torch.randn(1, h, lay.T, d, device=self.dev, dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))  # fmt: skip

            def run(fn: Any = fn, mask: Any = mask, q: Any = q, k: Any = k, v: Any = v) -> None:
                fn(q, k, v, mask).sum().backward()

            ms[name] = harness.time_fn(run, device=self.dev, warmup=2, iters=5).median_ms
        chosen = min(ms, key=ms.__getitem__)
        self.attend = lb.flex if chosen == "flex" else lb.sdpa
        self.info["attention probe"] = {"tokens": lay.T, "ms fwd+bwd": ms, "chosen": chosen}

    def _block_mask(self, lay: lb.Layout) -> Any:
        mod = lb.lingbot_mask_mod(lay.doc, lay.fid, lay.nid, lay.window)
        return lb.block_mask(mod, lay.T, lay.T, self.dev)

    def mask(self, ep: lb.Episode, lay: lb.Layout) -> Any:
        key = (ep.frames, ep.chunk, ep.window)
        if key not in self.masks:
            m = self._block_mask(lay) if self.attend is lb.flex else lb.dense_lingbot_mask(lay)
            self.masks[key] = m
            if len(self.masks) > 16:  # dense masks are T x T: keep the recent ones
                self.masks.popitem(last=False)
        return self.masks[key]

    def prepare(self, eps: list[lb.Episode]) -> Any:
        return [lb.layout([ep], self.hw, pad_to=1) for ep in eps]

    def before_episode(self, *, last: bool) -> None:
        """A hook before each micro-step (FSDP: sync and reshard on the last one only)."""

    def step(self, eps: list[lb.Episode], prepared: Any) -> torch.Tensor:
        lb.MASKS.self_attend, lb.MASKS.cross_attend = self.attend, lb.sdpa
        total = torch.zeros((), device=self.dev)
        for i, (ep, host_lay) in enumerate(zip(eps, prepared, strict=True)):
            self.before_episode(last=i == len(eps) - 1)
            lay = lb.layout_to(host_lay, self.dev)
            inp = lb.noise_inputs([ep], self.holder, self.amask, lb.TEXT_LEN, num_docs=len(eps))
            lb.MASKS.self_mask, lb.MASKS.cross_mask = self.mask(ep, lay), None
            loss = self.loss_module(inp, lay, self.run_blocks)
            loss.backward()
            total += loss.detach()
        return total


class PackedBenchArm(Arm):
    """K episodes in one static sequence, built here (the integration's stand-in)."""

    name = "packed[bench]"

    def __init__(self, *a: Any, budget: int, max_docs: int) -> None:
        super().__init__(*a)
        lb.swap_attention(self.model)
        on_gpu = self.dev.type == "cuda"
        step = torch.compile(_packed_block_step, dynamic=False) if on_gpu else None
        self.run_blocks = lb.blocks_runner(self.model, checkpointing=True, compiled_step=step)
        self.loss_module = lb.LeanLoss(self.model)
        self.budget, self.max_docs = budget, max_docs
        self.slots = max_docs * lb.TEXT_LEN
        # static id buffers, filled in place each step: one mask_mod object, one compile
        i64 = dict(dtype=torch.int64, device=self.dev)
        self.ids = {k: torch.full((budget,), -1, **i64) for k in ("doc", "fid", "nid")}
        self.ids["window"] = torch.zeros(max_docs, **i64)
        self.ids["text_doc"] = torch.full((self.slots,), -1, **i64)
        self.self_mod = lb.lingbot_mask_mod(*(self.ids[k] for k in ("doc", "fid", "nid", "window")))
        self.cross_mod = lb.text_mask_mod(self.ids["doc"], self.ids["text_doc"])
        self.info["compiled"] = on_gpu
        self.info["attention"] = "flex (self + cross, one block mask each a step)"
        self.parts: dict[str, list[float]] = {"masks": [], "conditioning": []}

    def prepare(self, eps: list[lb.Episode]) -> Any:
        return lb.layout(eps, self.hw, T=self.budget, text_slots=self.slots)

    def masks(self, lay: lb.Layout) -> tuple[Any, Any]:
        for k in ("doc", "fid", "nid"):
            self.ids[k].copy_(getattr(lay, k))
        self.ids["window"][: lay.window.shape[0]].copy_(lay.window)
        self.ids["text_doc"].copy_(lay.text_doc)
        t = self.budget
        return (
            lb.block_mask(self.self_mod, t, t, self.dev),
            lb.block_mask(self.cross_mod, t, self.slots, self.dev),
        )

    def step(self, eps: list[lb.Episode], prepared: Any, timed_parts: bool = False) -> torch.Tensor:
        lb.MASKS.self_attend = lb.MASKS.cross_attend = lb.flex
        lay = lb.layout_to(prepared, self.dev)
        t0 = _now(self.dev, timed_parts)
        lb.MASKS.self_mask, lb.MASKS.cross_mask = self.masks(lay)
        t1 = _now(self.dev, timed_parts)
        inp = lb.noise_inputs(eps, self.holder, self.amask, self.slots)
        if timed_parts:  # the conditioning MLP runs inside lean_loss: timed on its own here
            t2 = _now(self.dev, True)
            with torch.no_grad():
                lb.conditioning(self.model, inp, lay)
            t3 = _now(self.dev, True)
            self.parts["masks"].append(t1 - t0)
            self.parts["conditioning"].append(t3 - t2 + (t2 - t1))  # noising + MLP + gather
        loss = self.loss_module(inp, lay, self.run_blocks)
        loss.backward()
        return loss.detach()


class PackedLingbotArm(Arm):
    """K episodes in one pack through `packing.integrations.lingbot_va` (``install``, its
    ``collator`` with static budgets, ``loss(batch, "episode")``). Each block compiled once
    (static shapes) and checkpointed here, the integration's attention op kept out of the
    compiled graph (its mask is new every step: a guard on it would recompile each step)."""

    name = "packed[lingbot_va]"

    def __init__(self, *a: Any, budget: int, max_docs: int) -> None:
        super().__init__(*a)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        from packing.integrations.lingbot_va import install
        from packing.integrations.lingbot_va._attention import PackedAttentionOp

        if not getattr(PackedAttentionOp.forward, "_torchdynamo_disable", False):
            PackedAttentionOp.forward = torch._dynamo.disable(PackedAttentionOp.forward)
        # LeRobot's defaults, passed: install(transformer) without config= reads the config
        # class, where used_action_channel_ids is a field factory (AttributeError, reported)
        cfg = types.SimpleNamespace(action_per_frame=lb.ACTIONS_PER_FRAME, frame_chunk_size=4,
                                    used_action_channel_ids=list(range(lb.USED_ACTIONS)),
                                    snr_shift=5.0, action_snr_shift=0.05)  # fmt: skip
        self.packed = install(self.model, latent_hw=self.hw, config=cfg)
        on_gpu = self.dev.type == "cuda"
        blocks = self.packed.transformer.blocks
        for i, blk in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(torch.compile(blk, dynamic=False) if on_gpu else blk)
        self.loss_module = self.packed
        tpf = (self.hw[0] // 2) * (self.hw[1] // 2)
        frames = budget // (2 * (tpf + lb.ACTIONS_PER_FRAME))
        self.collate = self.packed.collator(frames * tpf, max_docs=max_docs,
                                            text_budget=max_docs * lb.TEXT_LEN)  # fmt: skip
        self.info["compiled"] = on_gpu
        self.info["attention"] = f"packing.attention backend {self.packed.backend}"

    def prepare(self, eps: list[lb.Episode]) -> Any:
        return self.collate([{
            "latents": ep.latents.cpu(),
            "actions": ep.actions[:, : lb.USED_ACTIONS].permute(0, 2, 1).cpu(),
            "text": ep.text.cpu(),
            "episode_index": ep.index,
        } for ep in eps])  # fmt: skip

    def step(self, eps: list[lb.Episode], prepared: Any) -> torch.Tensor:
        batch = prepared.to(self.dev, non_blocking=True) if self.dev.type == "cuda" else prepared
        batch.extras.update(seed=self.args.seed, step=eps[0].step)
        loss = self.loss_module.loss(batch, "episode")
        loss.backward()
        return loss.detach()


def _now(dev: torch.device, sync: bool) -> float:
    if sync and dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() * 1e3


# -- one arm over the steps ----------------------------------------------------------------------
def run_arm(arm: Arm, steps: list[list[lb.Episode]], warmup: int) -> dict[str, Any]:
    dev = arm.dev
    prepared = [arm.prepare(eps) for eps in steps]  # collate ahead, as a loader worker would
    times: list[tuple[Any, Any]] = []
    losses: list[torch.Tensor] = []
    g0 = 0
    t_first = time.perf_counter()
    for s, eps in enumerate(steps):
        if s == warmup:
            harness.sync(dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            g0 = harness.dynamo_counters()["unique_graphs"]
        a = harness.mark(dev)
        losses.append(arm.step(eps, prepared[s]))
        arm.finish()
        b = harness.mark(dev)
        if s >= warmup:
            times.append((a, b))
        if s == 0:
            harness.sync(dev)
            arm.info["first step s (compile)"] = time.perf_counter() - t_first
            print(f"    first step {arm.info['first step s (compile)']:.1f} s", flush=True)
    harness.sync(dev)
    ms = [harness.elapsed_ms(dev, a, b) for a, b in times]
    timed = steps[warmup:]
    return {
        "ms": ms,
        "losses": [float(x) for x in torch.stack(losses).float().tolist()],
        "peak GB": torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else 0.0,
        "recompiles after warm-up": harness.dynamo_counters()["unique_graphs"] - g0,
        "timed episodes": timed,
    }


def packed_parts(
    arm: PackedBenchArm, steps: list[list[lb.Episode]], step_ms: float
) -> dict[str, Any]:
    """Packing's own work in a packed step: collate (host, `common.layout`), masks and
    conditioning (device, each bracketed by a sync: an upper bound), against the step time."""
    collate = harness.time_host(lambda: arm.prepare(steps[-1]), warmup=1, iters=5)
    for eps in steps[-1:]:
        arm.step(eps, arm.prepare(eps), timed_parts=True)
        arm.opt.zero_grad(set_to_none=True)
    masks = statistics.median(arm.parts["masks"])
    cond = statistics.median(arm.parts["conditioning"])
    return {
        "collate ms (host, a loader worker's)": collate.median_ms,
        "masks ms": masks,
        "conditioning ms (noising, timestep MLP, gather)": cond,
        "step ms": step_ms,
        "share of step (masks + conditioning)": (masks + cond) / step_ms,
        "share of step incl. collate": (masks + cond + collate.median_ms) / step_ms,
    }


def lingbot_parts(
    arm: PackedLingbotArm, steps: list[list[lb.Episode]], step_ms: float
) -> dict[str, Any]:
    """`packed_parts` for the integration: its collator on the host; its draws, noising
    (``stream_inputs``), conditioning (``_time``) and masks (``_set_masks``) on the device,
    each bracketed by a sync in one extra step (an upper bound)."""
    import packing.integrations.lingbot_va._packed as pk

    acc = {"masks": 0.0, "draws": 0.0, "inputs": 0.0, "conditioning": 0.0}

    def timed(key: str, fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            t0 = _now(arm.dev, True)
            out = fn(*a, **k)
            acc[key] += _now(arm.dev, True) - t0
            return out

        return run

    p, inputs = arm.packed, pk.stream_inputs
    p._set_masks, p._time = timed("masks", p._set_masks), timed("conditioning", p._time)
    p.draws, pk.stream_inputs = timed("draws", p.draws), timed("inputs", inputs)
    try:
        arm.step(steps[-1], arm.prepare(steps[-1]))
        arm.opt.zero_grad(set_to_none=True)
    finally:
        del p._set_masks, p._time, p.draws  # the instance's wrappers: the methods are back
        pk.stream_inputs = inputs
    collate = harness.time_host(lambda: arm.prepare(steps[-1]), warmup=1, iters=5)
    own = sum(acc.values())
    return {
        "collate ms (host, a loader worker's)": collate.median_ms,
        "masks ms": acc["masks"],
        "conditioning ms (noising, timestep MLP, gather)": acc["draws"]
        + acc["inputs"]
        + acc["conditioning"],
        "parts ms": acc,
        "step ms": step_ms,
        "share of step (masks + conditioning)": own / step_ms,
        "share of step incl. collate": (own + collate.median_ms) / step_ms,
    }


def kernel_table(arm: Any, eps: list[lb.Episode]) -> str:
    """The packed step's top kernels by device time (torch.profiler), as text."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if arm.dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        arm.step(eps, arm.prepare(eps))
        harness.sync(arm.dev)
    arm.opt.zero_grad(set_to_none=True)
    key = "cuda_time_total" if arm.dev.type == "cuda" else "cpu_time_total"
    return str(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))


# -- rows ---------------------------------------------------------------------------------------
def make_row(name: str, arm: Arm, res: dict[str, Any], blocks: int, regime: str,
             hw: tuple[int, int]) -> dict[str, Any]:  # fmt: skip
    t = harness.summarize(res["ms"])
    timed = res["timed episodes"]
    tokens = sum(lb.tokens_of(eps, hw) for eps in timed)
    seconds = sum(res["ms"]) * 1e-3
    shapes = [LingbotEpisode(**s) for eps in timed for s in lb.useful_shapes(eps, hw)]
    flops = lingbot_flops({**arm.cfg, "num_layers": blocks}, shapes)
    return {
        "blocks": blocks,
        "regime": regime,
        "arm": name,
        "episodes/step": sum(len(e) for e in timed) / len(timed),
        "micro-steps/step": (
            1.0 if name.startswith("packed") else sum(len(e) for e in timed) / len(timed)
        ),
        "tokens/step": tokens / len(timed),
        "step ms": t.median_ms,
        "p10-p90 ms": f"{t.p10_ms:.0f}-{t.p90_ms:.0f}",
        "tokens/s": tokens / seconds,
        **harness.mfu(flops, seconds),
        "model TFLOP/s": flops.model / seconds / 1e12,
        "peak GB": res["peak GB"],
        "first loss": res["losses"][0],
        "losses": res["losses"],
        "recompiles after warm-up": res["recompiles after warm-up"],
        "timing": t.as_dict(),
        **arm.info,
    }


def make_arm(name: str, args: Any, state: dict[str, torch.Tensor], blocks: int,
             dev: torch.device, hw: tuple[int, int], budget: int,
             max_docs: int) -> Arm:  # fmt: skip
    cfg = lb.TINY if args.smoke else lb.WAN_5B
    model = lb.build_model(cfg, blocks, dev, args.seed)
    model.load_state_dict(state)
    if name == "lerobot":
        return LeRobotArm(args, model, dev, hw)
    if name == "lean":
        return LeanArm(args, model, dev, hw)
    if name == "packed":
        return PackedLingbotArm(args, model, dev, hw, budget=budget, max_docs=max_docs)
    return PackedBenchArm(args, model, dev, hw, budget=budget, max_docs=max_docs)


def regime_sizes(args: Any, regime: str) -> tuple[int, int]:
    if args.smoke:
        return SMOKE[regime][2], SMOKE[regime][3]
    if regime == "seed":
        return args.budget, 8
    return args.windows * SHORT_FRAMES * 72, args.windows


def main() -> None:
    p = harness.base_parser(__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny LingBot-VA on the CPU, seconds")
    p.add_argument("--blocks", default="4,30", help="transformer depths to run (5B has 30)")
    p.add_argument("--regimes", default="seed,short")
    p.add_argument(
        "--arms",
        default="packed,packed_bench,lerobot,lean",
        help="packed (the integration), packed_bench (built here), lerobot, lean",
    )
    p.add_argument("--short-blocks", default="4", help="depths that also run the short regime")
    p.add_argument("--budget", type=int, default=73728, help="seed packs: model tokens")
    p.add_argument("--windows", type=int, default=128, help="short: 16-frame windows a pack")
    p.add_argument("--steps", type=int, default=4, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (compile included)")
    p.add_argument(
        "--long-steps",
        type=int,
        default=3,
        help="timed steps at 30 blocks and in the short regime (after 1 warm-up)",
    )
    p.add_argument("--deadline-s", type=float, default=0.0, help="start no arm past this")
    args = p.parse_args()
    if args.smoke:
        args.device, args.quick, args.steps, args.warmup = "cpu", True, 2, 1
        args.blocks, args.short_blocks = "2", "2"
    if args.out and not args.out.endswith(".json"):
        args.out = str(Path(args.out) / "lingbot_va_h200.json")
    dev = torch.device(args.device)
    hw = lb.TINY_HW if args.smoke else lb.LATENT_HW
    cfg = lb.TINY if args.smoke else lb.WAN_5B
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {"profile": {}, "kernels": {}}
    t_start = time.monotonic()
    for blocks in (int(b) for b in args.blocks.split(",")):
        state = _initial_state(cfg, blocks, dev, args.seed)
        for regime in args.regimes.split(","):
            if regime == "short" and str(blocks) not in args.short_blocks.split(","):
                continue
            budget, max_docs = regime_sizes(args, regime)
            long_run = blocks >= 30 or regime == "short"  # fewer, longer steps: compiled already
            warmup = 1 if long_run and not args.smoke else args.warmup
            n_steps = warmup + (args.long_steps if long_run and not args.smoke else args.steps)
            steps = draw_steps(args, regime, cfg, hw, n_steps, budget, max_docs, dev)
            for name in args.arms.split(","):
                tag = f"{blocks} blocks, {regime}, {name}"
                if args.deadline_s and time.monotonic() - t_start > args.deadline_s:
                    rows.append({"blocks": blocks, "regime": regime, "arm": name,
                                 "error": f"not run: past the {args.deadline_s:g} s deadline"})  # fmt: skip
                    continue
                print(f"{tag} ...", flush=True)
                try:
                    arm = make_arm(name, args, state, blocks, dev, hw, budget, max_docs)
                    if isinstance(arm, LeanArm):
                        arm.probe(steps)
                    res = run_arm(arm, steps, warmup)
                    row = make_row(arm.name, arm, res, blocks, regime, hw)
                    if isinstance(arm, (PackedBenchArm, PackedLingbotArm)):
                        parts = packed_parts if isinstance(arm, PackedBenchArm) else lingbot_parts
                        extra["profile"][tag] = parts(arm, steps, row["step ms"])  # type: ignore[operator]
                        row["packing share"] = extra["profile"][tag][
                            "share of step (masks + conditioning)"
                        ]
                        if blocks < 30:  # the profiler's trace of a 30-block step is slow
                            extra["kernels"][tag] = kernel_table(arm, steps[-1])
                            print(extra["kernels"][tag], flush=True)
                    del arm
                except Exception as e:  # one failed arm must not lose the others
                    row = {"blocks": blocks, "regime": regime, "arm": name,
                           "error": f"{type(e).__name__}: {str(e)[:400]}"}  # fmt: skip
                    print(f"  {tag}: {row['error']}", flush=True)
                rows.append(row)
                _free(dev)
                harness.write_json("lingbot_va_h200", args, {"rows": rows, **extra}, device=dev,
                                   partial=True)  # fmt: skip
        del state
        _free(dev)
    compare(rows)
    cols = ["blocks", "regime", "arm", "episodes/step", "micro-steps/step", "tokens/step",
            "step ms", "p10-p90 ms", "tokens/s", "vs lerobot", "vs lean",
            "MFU of measured 790", "peak GB", "first loss", "loss rel diff", "packing share",
            "recompiles after warm-up", "error"]  # fmt: skip
    what = (
        "tiny LingBot-VA on the CPU (smoke: numbers mean nothing)"
        if args.smoke
        else ("LeRobot LingBot-VA transformer, Wan2.2-5B widths, bf16, checkpointed, AdamW")
    )
    table = (
        f"{what}; {args.steps} timed steps after {args.warmup} warm-up ({args.long_steps} "
        "after 1 at 30 blocks and in the short regime)\n\n" + harness.markdown_table(rows, cols)
    )
    print()
    print(table)
    path = harness.write_json("lingbot_va_h200", args, {"rows": rows, **extra}, device=dev)
    path.with_suffix(".md").write_text(table + "\n")


def compare(rows: list[dict[str, Any]]) -> None:
    """Ratios to the lerobot and lean rows of the same depth and regime, and the first step's
    loss against lerobot's (the same weights, episodes and draws: bf16 noise only)."""
    for r in rows:
        if "error" in r:
            continue
        for base in ("lerobot", "lean"):
            b = next((x for x in rows if x["arm"] == base and x["blocks"] == r["blocks"]
                      and x["regime"] == r["regime"] and "error" not in x), None)  # fmt: skip
            if b is not None:
                r[f"vs {base}"] = r["tokens/s"] / b["tokens/s"]
                if base == "lerobot":
                    r["loss rel diff"] = abs(r["first loss"] - b["first loss"]) / abs(
                        b["first loss"]
                    )
        if r["first loss"] != r["first loss"]:
            r["error"] = "non-finite loss"


def _initial_state(
    cfg: dict[str, Any], blocks: int, dev: torch.device, seed: int
) -> dict[str, Any]:
    """The initial weights every arm loads (kept on the device: a 5B copy is 10 GB)."""
    model = lb.build_model(cfg, blocks, dev, seed)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    return state


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
