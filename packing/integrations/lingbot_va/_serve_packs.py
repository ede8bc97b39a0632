"""The static buffers of a served LingBot-VA pack shape, and its step.

A `LingShape` holds ``video`` robots in their video loop and ``action`` robots in their
action loop; each robot's state is one copy of its chunk (``L`` latent tokens or ``A``
action tokens), its queries one copy per guidance row. The step (`lingbot_step`) gathers the
queries from the state, runs `forward_call`, combines the rows with classifier-free
guidance, and takes each robot's Euler step with its own time and ``dt`` (LeRobot's
``FlowMatchScheduler.step``), all as tensor work::

    robots   k:   0 (video, step 7)    1 (video, step 0)    2 (action, step 31)
    state         x_v rows 0..L-1      x_v rows L..2L-1     x_a rows 0..A-1
    queries       c u                  c u                  c          (guidance rows)
    update        x += (u + g (c - u)) dt_k[n_k]            x += c dt_k[n_k]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from packing._validate import check_int
from packing.integrations.lingbot_va._serve_step import CallBuffers, Pools, forward_call
from packing.serve.protocol import quarantine

__all__ = [
    "LingShape",
    "StepBuffers",
    "check_shapes",
    "lingbot_step",
    "phase_shapes",
    "shape_order",
]


@dataclass(frozen=True, kw_only=True)
class LingShape:
    """A static pack: at most ``video`` robots in their video loop and ``action`` robots in
    their action loop, together. A slot no robot fills is still computed (static shapes),
    so a pack of robots all in one loop runs best in a shape of that loop alone: ``video=0``
    (or ``action=0``) makes one (`phase_shapes`)."""

    video: int
    action: int

    def __post_init__(self) -> None:
        for name in ("video", "action"):
            object.__setattr__(self, name, check_int(f"LingShape.{name}", getattr(self, name),
                                                     min=0, max=4096))  # fmt: skip
        if self.video + self.action == 0:
            raise ValueError("LingShape(video=0, action=0) holds no robot; give video >= 1 or "
                             "action >= 1")  # fmt: skip

    @property
    def requests(self) -> int:
        return self.video + self.action

    def fits(self, phases: Any) -> bool:
        kinds = [p.kind for p in phases]
        return kinds.count("video") <= self.video and kinds.count("action") <= self.action


def phase_shapes(robots: int) -> list[LingShape]:
    """The default packs for ``robots`` robots: all in their action loop, all in their video
    loop, and mixes of every action slot with 1, 2, 4, ... video slots up to ``robots``. An
    action step then costs its action tokens alone, and robots out of step (a few in their
    video loop, the rest in their action loop) pay at most twice their video slots, not
    ``robots`` of them::

        phase_shapes(8): (video 0, action 8) (1, 8) (2, 8) (4, 8) (8, 0) (8, 8)
    """
    robots = check_int("robots", robots, min=1, max=4096)
    mixed = [1 << i for i in range(robots.bit_length()) if 1 << i < robots] + [robots]
    return [LingShape(video=0, action=robots), LingShape(video=robots, action=0),
            *(LingShape(video=v, action=robots) for v in mixed)]  # fmt: skip


def check_shapes(shapes: Any) -> list[LingShape]:
    """``shapes`` sorted smallest first (by robots, then video slots; the engine orders them
    by their tokens, `shape_order`), the largest holding every other (the engine admits a
    robot when the largest could hold the pack) and both loops (every chunk runs both)."""
    shapes = list(shapes) if isinstance(shapes, (list, tuple)) else shapes
    if (
        not isinstance(shapes, list)
        or not shapes
        or not all(isinstance(s, LingShape) for s in shapes)
    ):
        raise ValueError(f"shapes={shapes!r}; give one or more LingShape (or None: phase_shapes)")
    shapes = sorted(set(shapes), key=lambda s: (s.video + s.action, s.video))
    big = shapes[-1]
    small = [s for s in shapes if s.video > big.video or s.action > big.action]
    if small or big.video == 0 or big.action == 0:
        need = LingShape(video=max(1, *(s.video for s in shapes)),
                         action=max(1, *(s.action for s in shapes)))  # fmt: skip
        why = (f"{small[0]} does not fit in it" if small
               else "every chunk runs a video loop and an action loop")  # fmt: skip
        raise ValueError(f"shapes={shapes!r}: the largest, {big}, must hold every other shape "
                         f"and both loops ({why}); add {need}")  # fmt: skip
    return shapes


@dataclass(frozen=True)
class Geometry:
    """The served model's sizes (from LeRobot's config)."""

    L: int  # latent tokens of a chunk
    A: int  # action tokens of a chunk
    tpf: int  # latent tokens of a frame
    features: int  # a latent token's features (C p_t p_h p_w)
    action_dim: int
    cv: int  # guidance rows in the video loop (2 with guidance, else 1)
    ca: int  # guidance rows in the action loop
    capacity: int  # a region's slots (LeRobot's total_token_len)


def shape_order(shapes: list[LingShape], g: Geometry) -> list[LingShape]:
    """``shapes`` cheapest first by the query tokens a step computes (a video slot is
    ``cv L`` of them, an action slot ``ca A``): the engine runs a pack in the first that holds
    it, so 2 video robots take ``(2, 8)`` over ``(8, 0)``. The shape holding every other
    stays last (it is no cheaper than any)."""
    return sorted(shapes, key=lambda s: (query_tokens(g, s.video, s.action), s.video))


def query_tokens(g: Geometry, video: int, action: int) -> int:
    """The query tokens of ``video`` robots in their video loop and ``action`` in their action
    loop (guidance rows included): what a step of them computes."""
    return video * g.cv * g.L + action * g.ca * g.A


class StepBuffers:
    """The state, schedule tables and index tensors of one `LingShape`."""

    def __init__(self, shape: LingShape, g: Geometry, *, max_steps: int, pool_rows: int,
                 half_dim: int, used: Tensor, device: torch.device) -> None:  # fmt: skip
        Rv, Ra, R = shape.video, shape.action, shape.requests
        f32: dict[str, Any] = dict(dtype=torch.float32, device=device)
        i64: dict[str, Any] = dict(dtype=torch.int64, device=device)
        self.x_v = torch.zeros(Rv * g.L, g.features, **f32)
        self.x_a = torch.zeros(Ra * g.A, g.action_dim, **f32)
        self.vp_v, self.vp_a = torch.zeros_like(self.x_v), torch.zeros_like(self.x_a)
        self.slot_v = torch.full((Rv * g.L,), -1, **i64)  # robot of a row (-1: fixed, pad)
        self.slot_a = torch.full((Ra * g.A,), -1, **i64)
        self.gslot_v = torch.full((Rv * g.L,), R, **i64)  # robot of a row (R: pad)
        self.gslot_a = torch.full((Ra * g.A,), R, **i64)
        self.cq_v, self.uq_v = torch.zeros(Rv * g.L, **i64), torch.zeros(Rv * g.L, **i64)
        self.cq_a, self.uq_a = torch.zeros(Ra * g.A, **i64), torch.zeros(Ra * g.A, **i64)
        Qv, Qa = Rv * g.cv * g.L, Ra * g.ca * g.A
        self.src_v, self.src_a = torch.zeros(Qv, **i64), torch.zeros(Qa, **i64)
        self.tslot_Q = torch.full((Qv + Qa,), R, **i64)  # robot whose time a query takes
        self.rslot_Q = torch.full((Qv + Qa,), R, **i64)  # robot of a query (R: padding)
        self.guide_K = torch.zeros(R + 1, **f32)  # guidance scale (0: conditional row only)
        self.t_table = torch.zeros(R, max_steps, **f32)
        self.dt_table = torch.zeros(R, max_steps, **f32)
        self.step_K = torch.zeros(R, **i64)
        self.bad_K = torch.zeros(R, dtype=torch.bool, device=device)
        self.used_A = used.to(device=device, dtype=torch.float32)  # 1: a used action channel
        self.call = CallBuffers(Qv, Qa, pool_rows, half_dim, device)

    def state(self) -> tuple[Tensor, ...]:
        return (self.x_v, self.x_a, self.vp_v, self.vp_a, self.step_K)

    def load(self, host: dict[str, Tensor]) -> None:
        for name, src in host.items():
            dst = getattr(self, name)
            dst.copy_(src.pin_memory() if dst.device.type == "cuda" else src, non_blocking=True)


def _guided(out: Tensor, cq: Tensor, uq: Tensor, g_rows: Tensor) -> Tensor:
    """LeRobot's ``u + g (c - u)`` where the robot has guidance (``g > 0``), else ``c``."""
    c, u = out[cq], out[uq]
    return torch.where((g_rows > 0)[:, None], u + g_rows[:, None] * (c - u), c)


def lingbot_step(model: Any, b: StepBuffers, pools: Pools) -> None:
    """One step of every robot in the pack, in place on ``b`` (no host sync)."""
    R, N = b.t_table.shape
    n_K = b.step_K.clamp(max=N - 1)[:, None]
    zero = b.t_table.new_zeros(1)
    t_K1 = torch.cat([b.t_table.gather(1, n_K)[:, 0], zero])  # row R: clean tokens, padding
    dt_K1 = torch.cat([b.dt_table.gather(1, n_K)[:, 0], zero])
    x_a = b.x_a * b.used_A  # LeRobot zeroes the unused channels in place before each call
    out_v, out_a, bad_Q = forward_call(model, b.call, pools, b.x_v[b.src_v], x_a[b.src_a],
                                       t_K1[b.tslot_Q])  # fmt: skip
    vel_v = _guided(out_v, b.cq_v, b.uq_v, b.guide_K[b.gslot_v])
    vel_a = _guided(out_a, b.cq_a, b.uq_a, b.guide_K[b.gslot_a])
    new_v = b.x_v + vel_v * dt_K1[b.gslot_v][:, None]  # FlowMatchScheduler.step
    new_a = x_a + vel_a * dt_K1[b.gslot_a][:, None]
    b.x_v.copy_(torch.where((b.slot_v >= 0)[:, None], new_v, b.x_v))
    b.x_a.copy_(torch.where((b.slot_a >= 0)[:, None], new_a, b.x_a))
    quarantine(b.bad_K, ((b.x_v, b.slot_v), (b.x_a, b.slot_a)))
    kv_bad = torch.zeros(R + 1, device=bad_Q.device).index_add_(0, b.rslot_Q, bad_Q.float())
    b.bad_K.logical_or_(kv_bad[:R] > 0)  # its keys went non-finite (written as 0): it fails
    b.step_K.add_(1)
