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
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from packing.model._dit import DiT, DiTConfig
from packing.serve._engine import Engine, EngineConfig
from packing.serve._pack import PackShape
from packing.serve._request import Request, Result
from packing.serve._schedulers import FlowScheduler, Solver

__all__ = ["InferenceReport", "verify_inference"]

# (context frames, keep, frames, actions, steps, submitted at engine step)
_PLAN: tuple[tuple[int, tuple[int, ...] | None, int, int, int, int], ...] = (
    (2, None, 1, 4, 4, 0),
    (0, None, 2, 3, 3, 0),
    (3, (0, 2), 1, 5, 5, 1),
    (1, None, 1, 2, 2, 2),
    (4, (0, 3), 2, 6, 6, 2),
    (0, None, 1, 1, 3, 5),
    (2, None, 2, 3, 4, 6),
)


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
        ]
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
) -> InferenceReport:
    """Packed vs alone on the tiny reference DiT, fp32 on the CPU (a second or two)."""
    if mask not in ("document", "frame-causal"):
        raise ValueError(f"mask={mask!r}; choose 'document' or 'frame-causal'")
    torch.manual_seed(seed)
    cfg = DiTConfig.tiny(
        latent_channels=8, latent_hw=(4, 8), action_dim=6, frame_causal=mask == "frame-causal",
        document_mask=document_mask, attention="sdpa",
    )  # fmt: skip
    model = DiT(cfg).eval()
    config = EngineConfig(
        shapes=(PackShape(frames=6, actions=8, requests=2), PackShape(frames=12, actions=16, requests=4)),
        scheduler=FlowScheduler(solver=solver, shift=3.0),
        max_steps=8,
    )  # fmt: skip
    requests = [_request(i, seed, *plan[:5]) for i, plan in enumerate(_PLAN)]
    packed, trace = _run_packed(model, config, requests)
    errors = {}
    for i, r in enumerate(requests):
        alone = Engine(model, config)
        alone.submit(r)
        (ref,) = alone.run()
        errors[i] = _rel_error(packed[i], ref)
    ok = all(e <= tolerance for e in errors.values())
    covered = trace["distinct"] >= 3 and trace["joined"] >= 1 and len(trace["shapes"]) >= 2
    return InferenceReport(
        passed=ok and covered,
        tolerance=tolerance,
        errors=errors,
        max_requests_at_once=trace["most"],
        distinct_steps_at_once=trace["distinct"],
        joined_mid_run=trace["joined"],
        shapes_used=sorted(trace["shapes"]),
        config=dict(mask=mask, document_mask=document_mask, solver=solver, seed=seed),
    )


def _request(
    i: int, seed: int, ctx: int, keep: tuple[int, ...] | None, frames: int, actions: int, steps: int
) -> Request:
    g = torch.Generator().manual_seed(1000 * seed + i)
    return Request(
        context=torch.randn(ctx, 8, 4, 8, generator=g), frames=frames, actions=actions,
        task=f"task {i}", seed=seed * 100 + i, steps=steps, keep_frames=keep,
    )  # fmt: skip


def _run_packed(
    model: DiT, config: EngineConfig, requests: list[Request]
) -> tuple[dict[int, Result], dict]:
    """All requests through one engine, each submitted at its planned step."""
    engine = Engine(model, config)
    ids: dict[int, int] = {}
    out: dict[int, Result] = {}
    trace: dict = {"most": 0, "distinct": 0, "joined": 0, "shapes": set()}
    while len(out) < len(requests):
        for i, plan in enumerate(_PLAN):
            if plan[5] == engine.clock and i not in ids:
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
        err = max(err, float((x - y).abs().max()) / scale)
    return err
