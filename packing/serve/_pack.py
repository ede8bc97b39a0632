"""Host side of a pack: where each request's tokens lie, built at admission, never per step.

Two requests in a pack of 4 frames (grid 1x2: 2 tokens a frame) and 4 action tokens; request
0 has one context frame and generates one frame and 2 actions, request 1 generates one frame
and 1 action (``.`` is padding)::

    video stream   c0 c0 g0 g0 g1 g1 . .        action stream   a0 a0 a1 .
    joint          c0 c0 g0 g0 a0 a0 | g1 g1 a1 | . . .
    doc_J           0  0  0  0  0  0 |  1  1  1 | -1 -1 -1
    row_J           R  R  0  0  0  0 |  1  1  1 | -1 -1 -1     t_R[R] = 0: clean context
    slot (video)   -1 -1  0  0  1  1 -1 -1        the scheduler updates slot >= 0 rows
    pos_J           0  1  2  3  4  5 |  0  1  2 | 0  0  0     place in the whole document

A committed action (real-time chunking, ``Request.committed_actions``) is a context token of
the action stream: row R (t = 0), slot -1. With ``context=False`` (the context cache: the
context lives in the pool) only the generated tokens are laid out, and ``pos_J`` still counts
the context in front (request 0 above: ``g0 g0 a0 a0`` at 2 3 4 5).

Every tensor has a shape fixed by the `PackShape` alone, so a captured step replays over any
composition: admission copies these into the step's static buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from packing._layout_math import local_positions
from packing._validate import check_int
from packing.data import PackedBatch, joint_layout, layout_from_lengths
from packing.model import text_tokens
from packing.serve._limits import MAX_ACTIONS, MAX_FRAMES, MAX_REQUESTS
from packing.serve._request import Request

__all__ = ["HostPack", "PackShape", "build_pack"]


@dataclass(frozen=True, kw_only=True)
class PackShape:
    """A static pack: ``frames`` latent frames (all requests' context and generated frames),
    ``actions`` action tokens and at most ``requests`` requests. One compiled graph each."""

    frames: int
    actions: int
    requests: int

    def __post_init__(self) -> None:
        for name, top in (("frames", MAX_FRAMES), ("actions", MAX_ACTIONS),
                          ("requests", MAX_REQUESTS)):  # fmt: skip
            v = check_int(f"PackShape.{name}", getattr(self, name), min=1, max=top)
            object.__setattr__(self, name, v)

    def fits(self, requests: Sequence[Request]) -> bool:
        frames = sum(len(r.kept) + r.frames for r in requests)
        actions = sum(r.actions for r in requests)
        return len(requests) <= self.requests and frames <= self.frames and actions <= self.actions


class HostPack(NamedTuple):
    """The index tensors of one pack composition (int64, CPU), with each request's offsets."""

    doc_J: Tensor
    row_J: Tensor
    src_index_J: Tensor
    latents_dest_T: Tensor
    action_dest_T: Tensor
    thw_J3: Tensor
    text_X: Tensor
    text_doc_X: Tensor
    slot_v: Tensor  # (T_v,) request of each generated video token, -1 elsewhere
    slot_a: Tensor  # (T_a,) request of each generated action token, -1 elsewhere
    pos_J: Tensor  # (J,) place of each joint token in its whole document (context included)
    video_start: tuple[int, ...]  # first video token of each request
    action_start: tuple[int, ...]


def build_pack(
    requests: Sequence[Request],
    shape: PackShape,
    *,
    grid: tuple[int, int],
    text_len: int,
    context: bool = True,
) -> HostPack:
    """Lay ``requests`` out in ``shape`` (host work only: a few numpy/torch CPU calls);
    ``context=False``: their generated tokens only (the context is cached elsewhere)."""
    gh, gw = grid
    tpf = gh * gw
    R = shape.requests
    n_ctx = [len(r.kept) if context else 0 for r in requests]
    frames = [c + r.frames for c, r in zip(n_ctx, requests, strict=True)]
    lay_v = layout_from_lengths(
        [f * tpf for f in frames], frames, shape.frames * tpf, tpf, grid, max_docs=R
    )
    acts = [r.actions for r in requests]
    lay_a = layout_from_lengths(acts, acts, shape.actions, max_docs=R)
    batch = PackedBatch(
        streams={}, layouts={"latents": lay_v, "action": lay_a}, per_episode={}, primary="latents"
    )
    joint = joint_layout(batch, ("latents", "action"))
    doc_v, doc_a = lay_v.doc_ids_T.long(), lay_a.doc_ids_T.long()
    thw_v, ctx_v = _video_positions(requests, lay_v.thw_T3, doc_v, tpf, context)
    pos_a = lay_a.position_ids_T.long()
    thw_a = _action_positions(requests, pos_a, doc_a, grid)
    row_v = torch.where(doc_v >= 0, torch.where(ctx_v, R, doc_v), -1)
    k_K = torch.tensor([r.committed for r in requests] + [0], dtype=torch.int64)
    ctx_a = (doc_a >= 0) & (pos_a < k_K[doc_a])  # committed actions: clean, t = 0
    row_a = torch.where(ctx_a, R, doc_a)
    # Each document's tokens before the laid-out ones (the cached context), for pos_J.
    skip_K = torch.tensor(
        [(len(r.kept) - c) * tpf for c, r in zip(n_ctx, requests, strict=True)] + [0]
    )
    doc_J = joint.layout.doc_ids_T.long()
    text = [text_tokens(r.task, text_len) for r in requests]
    lens = [t.shape[0] for t in text]
    lay_t = layout_from_lengths(lens, lens, R * text_len, max_docs=R)
    text_X = torch.zeros(R * text_len, dtype=torch.int64)
    if text:
        text_X[: sum(lens)] = torch.cat(text)
    return HostPack(
        doc_J=doc_J,
        row_J=joint.join({"latents": row_v, "action": row_a}),
        src_index_J=joint.src_index_J,
        latents_dest_T=joint.dest_index["latents"],
        action_dest_T=joint.dest_index["action"],
        thw_J3=joint.join({"latents": thw_v, "action": thw_a}),
        text_X=text_X,
        text_doc_X=lay_t.doc_ids_T.long(),
        slot_v=torch.where(ctx_v, -1, doc_v),
        slot_a=torch.where(ctx_a, -1, doc_a),
        pos_J=torch.where(doc_J >= 0, local_positions(doc_J).long() + skip_K[doc_J], 0),
        video_start=tuple(int(x) for x in lay_v.cu_seqlens_K1[: len(requests)]),
        action_start=tuple(int(x) for x in lay_a.cu_seqlens_K1[: len(requests)]),
    )


def _video_positions(
    requests: Sequence[Request], thw_T3: Tensor | None, doc_T: Tensor, tpf: int, context: bool
) -> tuple[Tensor, Tensor]:
    """(t, h, w) of the video tokens with t the frame's place in the whole episode (a kept
    context frame keeps its index, generated frames follow the full context), and a bool
    per token: is it context. Padding: (0, 0, 0), not context."""
    assert thw_T3 is not None
    pos, is_ctx = [], []
    for r in requests:
        n_ctx, kept = r.context.shape[0], r.kept if context else ()
        pos += [*kept, *range(n_ctx, n_ctx + r.frames)]
        is_ctx += [True] * len(kept) + [False] * r.frames
    real = len(pos) * tpf
    thw = thw_T3.long().clone()
    frame_of_token = torch.arange(real) // tpf
    thw[:real, 0] = torch.tensor(pos, dtype=torch.int64)[frame_of_token]
    ctx = torch.zeros(doc_T.shape[0], dtype=torch.bool)
    ctx[:real] = torch.tensor(is_ctx, dtype=torch.bool)[frame_of_token]
    return thw, ctx


def _action_positions(
    requests: Sequence[Request], pos_T: Tensor, doc_T: Tensor, grid: tuple[int, int]
) -> Tensor:
    """The reference DiT's rule (`DiT._action_thw`) over the whole episode: action ``a`` of
    ``A`` sits at frame ``a * F // A`` (``F``: context + generated frames), (h, w) one past
    the grid's corner."""
    f = torch.tensor([r.context.shape[0] + r.frames for r in requests] + [0], dtype=torch.int64)
    a = torch.tensor([r.actions for r in requests] + [1], dtype=torch.int64)
    k = torch.where(doc_T >= 0, doc_T, len(requests))
    t = pos_T * f[k] // a[k]
    hw = torch.tensor(grid, dtype=torch.int64).expand(t.shape[0], 2)
    return torch.cat([t[:, None], hw], dim=1)


def initial_tokens(
    r: Request, frame: tuple[int, int, int], action_dim: int
) -> tuple[Tensor, Tensor]:
    """A request's starting latents ``(frames, C, H, W)`` and actions ``(actions, A)``, fp32
    CPU: its seeded noise, with the committed actions (if any) in the first rows."""
    lat, act = r.noise(frame, action_dim)
    if r.committed_actions is not None:
        act[: r.committed] = r.committed_actions.detach().cpu()
    return lat, act
