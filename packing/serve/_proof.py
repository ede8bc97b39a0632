"""The proof: a request's output packed with others equals the same request run alone.

`verify_inference` runs seven requests of mixed lengths (some with dropped context frames,
different step counts) through one `Engine`, submitting them at different engine steps so the
pack holds requests at different steps and its composition changes; then runs each request
alone in a fresh engine with the same weights and seed, and compares. The error of a request
is ``max |packed - alone| / max |alone|`` over its latents and actions. fp32 on the CPU must
give <= 1e-5; ``document_mask=False`` (every request sees the others) must fail.

It also checks that the interesting situations occurred (not a vacuous pass): some step ran
three or more requests at three different steps, a request joined a running pack, and the pack
changed shape.

One request carries committed actions (real-time chunking): they must come back bit-identical.
Three chunks of one robot's session follow each other (each submitted when the one before
finishes): the second's context is the first's two frames plus two new ones, the third's
changes frame 1 and adds one. With ``context_cache=True`` the packed run goes through the cached engine
(`ContextCache`), still compared with each request alone in the uncached engine; the second
chunk must reuse the first's cached frames and the third must detect its changed frame (and
re-prefill), and both must equal the same chunk prefilled from scratch in a fresh cached
engine. ``stale_cache=True`` turns the hash check off (frames reused by position alone), a
stale cache the proof must catch, as ``document_mask=False`` is.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from packing.model import DiT, DiTConfig
from packing.serve._cache import ContextCache
from packing.serve._config import EngineConfig
from packing.serve._engine import Engine
from packing.serve._pack import PackShape
from packing.serve._request import Request, Result
from packing.serve._schedulers import FlowScheduler, Solver

__all__ = ["InferenceReport", "verify_inference"]

# (context frames, keep, frames, actions, steps, submitted at engine step, committed actions)
_PLAN: tuple[tuple[int, tuple[int, ...] | None, int, int, int, int, int], ...] = (
    (2, None, 1, 4, 4, 0, 0),
    (0, None, 2, 3, 3, 0, 0),
    (3, (0, 2), 1, 5, 5, 1, 2),
    (1, None, 1, 2, 2, 2, 0),
    (4, (0, 3), 2, 6, 6, 2, 0),
    (0, None, 1, 1, 3, 5, 0),
    (2, None, 2, 3, 4, 6, 0),
)
_SESSION = "robot 0"  # its three chunks are requests len(_PLAN) + 0, 1, 2


@dataclass
class InferenceReport:
    """Per-request errors and what the packed run went through."""

    passed: bool
    tolerance: float
    errors: dict[int, float]
    max_requests_at_once: int
    distinct_steps_at_once: int
    joined_mid_run: int
    shapes_used: list[str]
    committed_identical: bool = True
    scratch_errors: dict[int, float] = field(default_factory=dict)
    cache: dict[str, int] = field(default_factory=dict)
    config: dict[str, object] = field(default_factory=dict)

    def format(self) -> str:
        worst = max(self.errors.values())
        lines = [
            f"packing verify --inference: {'PASS' if self.passed else 'FAIL'}",
            f"  {len(self.errors)} requests packed vs alone, worst max rel error {worst:.2e} "
            f"(tolerance {self.tolerance:.0e})",
            f"  at most {self.max_requests_at_once} requests in one model call, at "
            f"{self.distinct_steps_at_once} different steps; {self.joined_mid_run} joined a "
            f"running pack; shapes {', '.join(self.shapes_used)}",
            f"  committed actions returned bit-identical: {self.committed_identical}",
        ]
        if self.cache:
            lines.append("  context cache: " + ", ".join(f"{k} {v}" for k, v in self.cache.items()))
        for rid, err in self.scratch_errors.items():
            lines.append(f"  session chunk {rid} vs prefilled from scratch: {err:.2e}")
        for rid, err in self.errors.items():
            mark = "ok" if err <= self.tolerance else "DIFFERS"
            lines.append(f"  request {rid}: {err:.2e} {mark}")
        return "\n".join(lines)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))


def verify_inference(
    *,
    mask: Literal["document", "frame-causal"] = "frame-causal",
    document_mask: bool = True,
    solver: Solver = "multistep2",
    seed: int = 0,
    tolerance: float = 1e-5,
    context_cache: bool = False,
    stale_cache: bool = False,
) -> InferenceReport:
    """Packed vs alone on the tiny reference DiT, fp32 on the CPU (a second or two)."""
    if mask not in ("document", "frame-causal"):
        raise ValueError(f"mask={mask!r}; choose 'document' or 'frame-causal'")
    if context_cache and mask != "frame-causal":
        raise ValueError(
            "context_cache=True needs mask='frame-causal' (--mask frame-causal): only a "
            "frame-causal context is independent of the generated tokens, so cacheable"
        )
    if stale_cache and not context_cache:
        raise ValueError("stale_cache=True is a control of the context cache; set context_cache")
    torch.manual_seed(seed)
    cfg = DiTConfig.tiny(
        latent_channels=8, latent_hw=(4, 8), action_dim=6, frame_causal=mask == "frame-causal",
        document_mask=document_mask, attention="sdpa",
    )  # fmt: skip
    model = DiT(cfg).eval()
    sched = FlowScheduler(solver=solver, shift=3.0)
    config = EngineConfig(
        shapes=(PackShape(frames=6, actions=8, requests=2), PackShape(frames=12, actions=16, requests=4)),
        scheduler=sched, max_steps=8,
    )  # fmt: skip
    cached = EngineConfig(  # generated frames only in a shape; the contexts are in the pool
        shapes=(PackShape(frames=4, actions=10, requests=3), PackShape(frames=6, actions=16, requests=4)),
        scheduler=sched, max_steps=8,
        context_cache=ContextCache(pages=10, page_frames=2, prefill_frames=(1, 3)),
    )  # fmt: skip
    requests = [_request(i, seed, *plan[:5], plan[6]) for i, plan in enumerate(_PLAN)]
    requests += _session(seed)
    engine = Engine(model, cached if context_cache else config)
    if stale_cache:
        engine.packs.pages.check_hashes = False  # type: ignore[attr-defined]
    packed, trace = _run_packed(engine, requests)
    errors, scratch, same = {}, {}, True
    for i, r in enumerate(requests):
        ref = _alone(model, config, r)
        errors[i] = _rel_error(packed[i], ref)
        if r.committed_actions is not None:
            k = r.committed
            same &= torch.equal(packed[i].action[:k], r.committed_actions)
            same &= torch.equal(ref.action[:k], r.committed_actions)
        if context_cache and i > len(_PLAN):  # a session chunk that reused cached frames
            scratch[i] = _rel_error(packed[i], _alone(model, cached, r))
    stats = engine.stats if context_cache else {}
    ok = all(e <= tolerance for e in [*errors.values(), *scratch.values()]) and same
    covered = trace["distinct"] >= 3 and trace["joined"] >= 1 and len(trace["shapes"]) >= 2
    if context_cache:  # both later chunks reused frames (2 + 1), and the change was seen
        covered &= stats["reused_frames"] >= 3 and (stale_cache or stats["mismatches"] >= 1)
    return InferenceReport(
        passed=ok and covered,
        tolerance=tolerance,
        errors=errors,
        max_requests_at_once=trace["most"],
        distinct_steps_at_once=trace["distinct"],
        joined_mid_run=trace["joined"],
        shapes_used=sorted(trace["shapes"]),
        committed_identical=same,
        scratch_errors=scratch,
        cache=stats,
        config=dict(mask=mask, document_mask=document_mask, solver=solver, seed=seed,
                    context_cache=context_cache, stale_cache=stale_cache),
    )  # fmt: skip


def _alone(model: DiT, config: EngineConfig, r: Request) -> Result:
    engine = Engine(model, config)
    engine.submit(r)
    (out,) = engine.run()
    return out


def _request(
    i: int, seed: int, ctx: int, keep: tuple[int, ...] | None, frames: int, actions: int,
    steps: int, committed: int = 0,
) -> Request:  # fmt: skip
    g = torch.Generator().manual_seed(1000 * seed + i)
    context = torch.randn(ctx, 8, 4, 8, generator=g)
    done = torch.randn(committed, 6, generator=g) if committed else None
    return Request(
        context=context, frames=frames, actions=actions, task=f"task {i}", seed=seed * 100 + i,
        steps=steps, keep_frames=keep, committed_actions=done,
    )  # fmt: skip


def _session(seed: int) -> list[Request]:
    """Three chunks of one robot episode: 2 frames; the same + 2 new; frame 1 changed + 1."""
    g = torch.Generator().manual_seed(1000 * seed + 999)
    frames = torch.randn(6, 8, 4, 8, generator=g)
    changed = frames.clone()
    changed[1] += 0.5
    return [
        Request(context=c, frames=1, actions=3, task="pick", seed=seed * 100 + 50 + j, steps=3,
                session=_SESSION)
        for j, c in enumerate((frames[:2], frames[:4], changed[:5]))
    ]  # fmt: skip


def _run_packed(engine: Engine, requests: list[Request]) -> tuple[dict[int, Result], dict]:
    """All requests through one engine, each plan request submitted at its planned step,
    each session chunk when the one before it finished."""
    ids: dict[int, int] = {}
    out: dict[int, Result] = {}
    trace: dict = {"most": 0, "distinct": 0, "joined": 0, "shapes": set()}
    chunks = list(range(len(_PLAN), len(requests)))
    while len(out) < len(requests):
        for i, plan in enumerate(_PLAN):
            if plan[5] == engine.clock and i not in ids:
                ids[i] = engine.submit(requests[i])
        if chunks and (chunks[0] == len(_PLAN) or ids.get(chunks[0] - 1, -1) in out):
            i = chunks.pop(0)
            ids[i] = engine.submit(requests[i])
        for r in engine.step():
            out[r.request_id] = r
        steps = [s for _, s in engine.last_pack]
        trace["most"] = max(trace["most"], len(steps))
        trace["distinct"] = max(trace["distinct"], len(set(steps)))
        trace["joined"] += sum(1 for s in steps if s == 0) if len(set(steps)) > 1 else 0
        trace["shapes"].add(
            f"{engine.shape.frames}x{engine.shape.actions}" if engine.shape else "-"
        )
    return {i: out[rid] for i, rid in ids.items()}, trace


def _rel_error(a: Result, b: Result) -> float:
    err = 0.0
    for x, y in ((a.latents, b.latents), (a.action, b.action)):
        scale = float(y.abs().max().clamp_min(1e-12))
        d = float((x - y).abs().max())
        err = max(err, d / scale if d == d else math.inf)  # NaN: not a match (max() drops it)
    return err
