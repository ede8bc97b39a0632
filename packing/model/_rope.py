"""3D rotary position embedding from doc-local (t, h, w) positions, split across the head dim.

Each token carries the position it has *inside its episode* (``batch["thw"]`` for a grid
stream), so a packed episode is rotated exactly as it would be alone. Head dim ``D`` is split
as in Wan: ``D - 4 * (D // 6)`` channels for t, ``2 * (D // 6)`` each for h and w (128 ->
44 / 42 / 42); each axis rotates its channel pairs by ``pos * theta ** (-2i / d_axis)``::

    thw_T3   (0,0,0) (0,0,1) ... (1,0,0) ... | (0,0,0) ...     two episodes, both start at 0
    angle    (T, D/2) = [t * inv_t | h * inv_h | w * inv_w]

Pairs are adjacent channels ``(x[2i], x[2i+1])`` (Wan's complex view of the head dim).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["apply_rope", "rope_angles", "rope_split"]


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Channels given to (t, h, w): ``rope_split(128) == (44, 42, 42)``."""
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"head_dim={head_dim} must be even and >= 6 for a 3D RoPE split")
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def rope_angles(thw_T3: Tensor, head_dim: int, theta: float = 10000.0) -> Tensor:
    """Rotation angles ``(T, head_dim // 2)`` in float32 from integer or float positions."""
    pos = thw_T3.to(torch.float32)
    parts = []
    for axis, d in enumerate(rope_split(head_dim)):
        inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=pos.device) / d)
        parts.append(pos[:, axis, None] * inv)
    return torch.cat(parts, dim=-1)


def apply_rope(x_THD: Tensor, angles_T: Tensor) -> Tensor:
    """Rotate the channel pairs of ``x`` ``(T, H, D)`` by ``angles`` ``(T, D/2)``; same dtype.

    Computed in float32 and cast back, so bf16 activations are rotated without extra error.
    """
    x = x_THD.float().unflatten(-1, (-1, 2))  # (T, H, D/2, 2)
    cos = angles_T.cos()[:, None, :]
    sin = angles_T.sin()[:, None, :]
    a, b = x[..., 0], x[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return out.to(x_THD.dtype)
