"""LingBot-VA's dual-stream sequence, packed: four copies per episode, one attention sequence.

LingBot-VA's transformer attends over a clean and a noisy copy of each stream (latent frames,
actions). Packed, every episode's four parts sit side by side (joint order, doc ids from
`packing.data.joint_layout`), padding at the tail::

    episode 0 (F=2 frames)                             episode 1 (F=3)          pad
    [noisy lat | clean lat | noisy act | clean act]    [noisy lat | ... ]       . . .
     copy 0      copy 1      copy 0      copy 1
     kind 0      kind 0      kind 1      kind 1

Per token (legend: ``_J`` joint tokens, ``_K`` episodes)::

    doc_J     episode (-1 padding)             frame_J   doc-local latent frame
    copy_J    0 noisy, 1 clean (-1 padding)    kind_J    0 latent, 1 action
    chunk_J   frame // chunk_size[doc] * 2 + kind   (LeRobot's ``frame_ids``: latent and
              action chunks interleave, so the window counts half-chunks)
    window_J  window_size[doc]                 grid_J3   RoPE (f, h, w) of LeRobot's get_mesh_id

Everything comes from the layouts' host-side lengths and the per-episode draws (host ints):
built with numpy, copied to the device once, no host-device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from packing._validate import check_int, check_sequence, is_int
from packing.data import JointLayout, PackedBatch, StreamLayout, joint_layout

__all__ = ["COPIES", "DualStreamTokens", "dual_stream_tokens"]

# The four parts of an episode in joint order: (name, stream, copy).
COPIES = (
    ("noisy_latents", "latents", 0),
    ("clean_latents", "latents", 1),
    ("noisy_actions", "actions", 0),
    ("clean_actions", "actions", 1),
)


@dataclass(frozen=True)
class DualStreamTokens:
    """Per-token attributes of a packed LingBot-VA sequence (see the module legend)."""

    joint: JointLayout
    doc_J: Tensor
    copy_J: Tensor
    kind_J: Tensor
    frame_J: Tensor
    chunk_J: Tensor
    window_J: Tensor
    grid_J3: Tensor  # float32 (J, 3)

    @property
    def layout(self) -> StreamLayout:
        """The joint layout (doc ids, positions) of the whole sequence."""
        return self.joint.layout

    def join(self, parts: dict[str, Tensor]) -> Tensor:
        """``{noisy_latents, clean_latents, noisy_actions, clean_actions}`` tokens -> (J, ...)."""
        return self.joint.join(parts)

    def take(self, x_J: Tensor, part: str) -> Tensor:
        """The tokens of one part (e.g. ``"noisy_latents"``), in its stream's order."""
        return x_J.index_select(0, self.joint.dest_index[part])


def dual_stream_tokens(
    batch: PackedBatch,
    chunk_size_K: Sequence[int],
    window_K: Sequence[int],
    *,
    action_per_frame: int,
) -> DualStreamTokens:
    """The joint layout and per-token attributes of ``batch`` (streams ``latents`` and
    ``actions``, one latent frame a step in both) for per-episode ``chunk_size_K`` and
    ``window_K``. Two episodes of 1 and 2 frames, 1 latent token and 1 action a frame,
    chunk sizes ``[1, 2]``::

        doc_J    0 0 0 0 | 1 1 1 1 1 1 1 1
        copy_J   0 1 0 1 | 0 0 1 1 0 0 1 1
        kind_J   0 0 1 1 | 0 0 0 0 1 1 1 1
        frame_J  0 0 0 0 | 0 1 0 1 0 1 0 1
        chunk_J  0 0 1 1 | 0 0 0 0 1 1 1 1
    """
    if not isinstance(batch, PackedBatch):
        raise TypeError(f"batch must be a PackedBatch, got {type(batch).__name__}")
    check_int("action_per_frame", action_per_frame, min=1, hint="actions a latent frame")
    lat, act = batch.layout("latents"), batch.layout("actions")
    if action_per_frame != act.tokens_per_step:
        raise ValueError(
            f"action_per_frame={action_per_frame} but the batch's actions stream has "
            f"{act.tokens_per_step} actions a latent frame; pass {act.tokens_per_step}"
        )
    for name, values in (("chunk_size_K", chunk_size_K), ("window_K", window_K)):
        got = check_sequence(name, values)
        if len(got) != lat.num_docs or not all(
            is_int(v) and v >= (name == "chunk_size_K") for v in got
        ):
            raise ValueError(
                f"{name}={values!r}; pass one int per episode of the pack ({lat.num_docs}), "
                "chunk sizes >= 1 and windows >= 0"
            )
    parts = {name: (lat if stream == "latents" else act) for name, stream, _ in COPIES}
    shadow = PackedBatch(streams={}, layouts=parts, per_episode={}, primary="noisy_latents")
    joint = joint_layout(shadow, [name for name, _, _ in COPIES]).to("cpu")
    src = joint.src_index_J.numpy()
    cols = [_part_columns(lat, copy=c, kind=0) for c in (0, 1)]
    cols += [_part_columns(act, copy=c, kind=1, apf=action_per_frame) for c in (0, 1)]
    doc, copy, kind, frame, grid = (np.concatenate(x)[src] for x in zip(*cols, strict=True))
    real = doc >= 0
    chunk_k = np.asarray(list(chunk_size_K) or [1], dtype=np.int64)
    window_k = np.asarray(list(window_K) or [0], dtype=np.int64)
    d = np.where(real, doc, 0)
    chunk = np.where(real, frame // chunk_k[d] * 2 + kind, -1)
    window = np.where(real, window_k[d], 0)
    dev = lat.doc_ids_T.device
    t = {k: torch.from_numpy(np.ascontiguousarray(v)).to(dev, non_blocking=True) for k, v in
         dict(doc=doc, copy=copy, kind=kind, frame=frame, chunk=chunk, window=window,
              grid=grid).items()}  # fmt: skip
    return DualStreamTokens(
        joint=joint.to(dev, non_blocking=True),
        doc_J=t["doc"],
        copy_J=t["copy"],
        kind_J=t["kind"],
        frame_J=t["frame"],
        chunk_J=t["chunk"],
        window_J=t["window"],
        grid_J3=t["grid"],
    )


def _part_columns(
    lay: StreamLayout, *, copy: int, kind: int, apf: int = 1
) -> tuple[np.ndarray, ...]:
    """(doc, copy, kind, frame, grid) of one part's padded tokens, in its stream's order."""
    doc = lay.doc_ids_T.cpu().numpy().astype(np.int64)
    pos = lay.position_ids_T.cpu().numpy().astype(np.int64)
    real = doc >= 0
    frame = np.where(real, pos // lay.tokens_per_step, 0)
    if kind == 0:  # latent tokens: (f, h, w) of the patch grid, as get_mesh_id(action=False)
        thw = lay.thw_T3
        grid = np.zeros((doc.shape[0], 3), np.float32) if thw is None else thw.cpu().numpy()
        grid = grid.astype(np.float32)
    else:  # action tokens: f + (j + 1) / (apf + 1), h = w = -1, as get_mesh_id(action=True)
        offset = (torch.ones(apf).cumsum(0) / (apf + 1)).numpy()  # float32, LeRobot's values
        f = torch.from_numpy(frame) + torch.from_numpy(offset[pos % apf])  # LeRobot's promotion
        grid = np.stack([f.numpy(), -np.ones_like(f.numpy()), -np.ones_like(f.numpy())], 1)
    grid = np.where(real[:, None], grid, 0).astype(np.float32)
    n = doc.shape[0]
    copy_col = np.where(real, copy, -1)
    return doc, copy_col, np.full(n, kind), frame, grid
