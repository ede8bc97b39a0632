"""The proof that the served LingBot-VA equals LeRobot's policy run for each robot alone.

`prove_serving` runs robots through one `LingBotVAEngine` on a tiny LeRobot policy (CPU,
fp32): they join mid-run at different engine steps and at different chunk indices (a robot
may arrive with an episode already under way: its history is replayed), one changes an
earlier keyframe of its history, and each robot's chunks (actions and predicted latents)
are compared with `ReferenceRobot` (LeRobot's ``predict_action_chunk``, one robot per
policy, the same history and the same noise). ``ablation`` plants what must fail:
``"no_history_check"`` (the changed keyframe served from the stale cache) and
``"no_document_mask"`` (robots see each other's caches).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from packing.integrations.lingbot_va._serve import LingBotVAEngine
from packing.integrations.lingbot_va._serve_packs import LingShape, phase_shapes
from packing.integrations.lingbot_va._serve_reference import ReferenceRobot
from packing.integrations.lingbot_va._serve_request import ChunkRequest
from packing.integrations.lingbot_va.testing import tiny_serving_policy

__all__ = ["ABLATIONS", "ServingReport", "prove_serving", "tiny_serving_policy"]

ABLATIONS = ("no_history_check", "no_document_mask")


@dataclass
class _Robot:
    name: str
    start: int  # engine step it first submits at
    first: int  # its first chunk index (> 0: it arrives with a history)
    chunks: int  # its last chunk index + 1
    prompt: Tensor
    frames: Tensor  # every latent frame of its episode
    actions: Tensor = field(default_factory=lambda: torch.zeros(0))
    out: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    change_at: int | None = None  # the chunk whose request changes keyframe 1
    next: int = 0
    waiting: bool = False


@dataclass
class ServingReport:
    """Max |served - LeRobot| over every compared chunk, and what the run went through."""

    latents: float
    actions: float
    chunks: int
    max_pack: int  # robots in the fullest pack
    mixed_steps: bool  # a pack held robots at different steps
    evicted: int  # cache slots evicted (LeRobot's window reached)
    errors: dict[str, str]
    # steps run in packs of robots all in their video loop, all in their action loop, mixed
    pack_kinds: dict[str, int] = field(default_factory=dict)
    tolerance: float = 1e-5  # fp32 on the CPU; the caller's on another device or dtype

    @property
    def ok(self) -> bool:
        return not self.errors and max(self.latents, self.actions) <= self.tolerance


def _robots(policy: Any, text: Any) -> list[_Robot]:
    F_, (H, W), A = policy.config.frame_chunk_size, policy._latent_hw, policy.config.action_dim
    out = []
    for i, (start, first, chunks, task) in enumerate(
        [(0, 0, 4, "pick"), (3, 0, 3, "place"), (5, 2, 4, "pick"), (1, 0, 4, "stack")]
    ):
        g = torch.Generator().manual_seed(10 + i)
        frames = torch.randn(1 + chunks * F_, 48, H, W, generator=g)
        r = _Robot(f"robot{i}", start, first, chunks, text(task), frames, next=first)
        hist = torch.randn(first * F_, policy.config.action_per_frame, A, generator=g)
        hist[: policy.config.action_per_frame] = 0
        r.actions = hist
        out.append(r)
    out[3].change_at = 3  # its chunk 3 arrives with chunk 0's keyframe 1 changed
    return out


def _request(r: _Robot, F_: int, negative: Tensor) -> ChunkRequest:
    """Its next chunk; ``actions=None`` (the chunks it was served) unless it arrived with a
    history (then the history it brings, plus what it was served since)."""
    k = r.next
    frames = r.frames[: max(1, k * F_)].clone()
    if r.change_at is not None and k >= r.change_at:
        frames[1] += 0.5  # an earlier keyframe, changed after it was fed back
    actions = None if r.first == 0 or k > r.first else r.actions[: k * F_]
    return ChunkRequest(session=r.name, frames=frames, actions=actions, prompt=r.prompt,
                        negative=negative, seed=_seed(r.name, k))  # fmt: skip


def _seed(name: str, k: int) -> int:
    return 1000 * k + int(name.removeprefix("robot"))


def prove_serving(
    ablation: str | None = None,
    policy: Any = None,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    cuda_graphs: bool = False,
    tolerance: float = 1e-5,
) -> ServingReport:
    """Serve the robots, compare each with LeRobot alone (module docstring), both on
    ``device`` in ``dtype`` (the tiny policy's ``config.dtype``); ``cuda_graphs``: the
    engine warms up and replays every step and feedback pass from a CUDA graph."""
    from packing.integrations.lingbot_va.testing import toy_text_embeddings

    if ablation is not None and ablation not in ABLATIONS:
        raise ValueError(f"ablation={ablation!r}; use one of {ABLATIONS} or None")
    if policy is None:
        policy = tiny_serving_policy(device=device, dtype=dtype).to(device)
    cfg, F_ = policy.config, policy.config.frame_chunk_size
    text = toy_text_embeddings(int(cfg.text_dim))
    negative = text("")
    # the default packs (one loop alone, and every action slot with 1, 2, 4 video slots),
    # and smaller packs of one loop
    shapes = [*phase_shapes(4), LingShape(video=2, action=0), LingShape(video=0, action=2)]
    engine = LingBotVAEngine(policy, robots=4, shapes=shapes,
                             check_history=ablation != "no_history_check",
                             document_mask=ablation != "no_document_mask",
                             cuda_graphs=cuda_graphs)  # fmt: skip
    if cuda_graphs:
        engine.warm_up()  # as the server does: every graph captured before a robot joins
    robots = _robots(policy, text)
    ids: dict[int, _Robot] = {}
    errors: dict[str, str] = {}
    max_pack, mixed = 0, False
    while any(r.next < r.chunks for r in robots) or engine.active or engine.waiting:
        for r in robots:
            if not r.waiting and r.next < r.chunks and engine.clock >= r.start:
                ids[engine.submit(_request(r, F_, negative))] = r
                r.waiting = True
        for res in engine.step():
            r = ids.pop(res.request_id)
            r.waiting = False
            if res.error is not None:
                errors[r.name] = res.error
                r.next = r.chunks
                continue
            r.out[r.next] = (res.latents, res.action)
            r.next += 1
        max_pack = max(max_pack, len(engine.last_pack))
        mixed |= len({s for _, s in engine.last_pack}) > 1
    lat = act = 0.0
    n = 0
    for r in robots:
        packs: Any = engine.packs
        served = packs.executed(r.name, r.chunks) if not errors else None
        for k, (ref_lat, ref_act) in _reference(policy, r, F_, negative, served).items():
            lat = max(lat, (r.out[k][0].cpu() - ref_lat.cpu()).abs().max().item())
            act = max(act, (r.out[k][1].cpu() - ref_act.cpu()).abs().max().item())
            n += 1
    st = engine.stats
    kinds = {k: st[f"steps_in_{k}_packs"] for k in ("video", "action", "mixed")}
    return ServingReport(lat, act, n, max_pack, mixed, st["evicted_slots"], errors,
                         pack_kinds=kinds, tolerance=tolerance)  # fmt: skip


def _reference(
    policy: Any, r: _Robot, F_: int, negative: Tensor, served: Tensor | None
) -> dict[int, tuple[Tensor, Tensor]]:
    """LeRobot alone on each of the robot's chunks: its own loop (executed = predicted), but
    with the history a robot arrived with, and, once a keyframe changed, a fresh policy on the
    new history with the actions the robot executed (``served``)."""

    out: dict[int, tuple[Tensor, Tensor]] = {}
    runs = [(range(r.first, r.chunks), None if r.first == 0 else r.actions)]
    if r.change_at is not None:
        runs = [(range(0, r.change_at), None), (range(r.change_at, r.chunks), served)]
    for chunks, executed in runs:
        last = chunks[-1]
        req = _request(_Robot(**{**r.__dict__, "next": last}), F_, negative)
        device = next(policy.parameters()).device
        ref_policy = type(policy)(copy.deepcopy(policy.config))  # LeRobot's, same config
        ref_policy.load_state_dict(policy.state_dict())
        robot = ReferenceRobot(ref_policy.to(device), r.prompt, negative)  # draws as served
        for k in range(last + 1):
            fb = req.frames[:1] if k == 0 else req.frames[(k - 1) * F_ : k * F_]
            given = None if executed is None or k == 0 or (k - 1) * F_ >= executed.shape[0] else (
                executed[(k - 1) * F_ : k * F_])  # fmt: skip
            lat, _, action = robot.chunk(fb, given, _seed(r.name, k))
            if k in chunks:
                out[k] = (lat, action)
    return out
