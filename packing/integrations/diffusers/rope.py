"""RoPE for packed tokens, read from the diffusers model's own tables at doc-local positions.

diffusers' ``WanRotaryPosEmbed`` holds per-axis tables ``freqs_cos``/``freqs_sin``
``(max_seq_len, head_dim)``, computed in float64 (then stored as float32), the head dim split ``[t_dim | h_dim | w_dim]``
(128 -> 44 / 42 / 42); its ``forward`` takes rows ``0..F-1``, ``0..H-1``, ``0..W-1`` of one
video's grid. Packed, each token gathers the rows of its own (t, h, w) inside its episode::

    thw_T3     (0,0,0) (0,0,1) ... (1,1,2) | (0,0,0) ...   episode 0, then episode 1 from 0
    cos_T1D    [cos_t[t] | cos_h[h] | cos_w[w]]             (T, 1, head_dim), tables' dtype

Gathering rows of the same tables is bit-identical to diffusers' slicing; `rotate` is the
model's own rotation (in the tables' dtype, cast back), so an episode is rotated in a pack
exactly as it is alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rope_from_table", "rotate"]


def rope_from_table(
    freqs_cos: Tensor, freqs_sin: Tensor, split: tuple[int, int, int], thw_T3: Tensor
) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each ``(T, 1, head_dim)``, the tables' rows at each token's (t, h, w).

    ``split`` is ``(t_dim, h_dim, w_dim)``; positions must lie below the tables' length.
    """
    max_len = int(freqs_cos.shape[0])
    pos = thw_T3.long()
    if pos.device.type == "cpu" and pos.numel() and int(pos.max()) >= max_len:
        raise ValueError(
            f"a token's (t, h, w) position {int(pos.max())} >= the model's rope_max_seq_len="
            f"{max_len}; split long episodes (packing.plan.split_windows) or build the model "
            "with a larger rope_max_seq_len"
        )
    pos = pos.to(freqs_cos.device)
    parts_cos, parts_sin = freqs_cos.split(split, dim=1), freqs_sin.split(split, dim=1)
    cos = torch.cat([parts_cos[a][pos[:, a]] for a in range(3)], dim=-1)
    sin = torch.cat([parts_sin[a][pos[:, a]] for a in range(3)], dim=-1)
    return cos[:, None, :], sin[:, None, :]


def rotate(x_THD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """diffusers Wan's ``apply_rotary_emb``: interleaved pairs, tables' dtype, cast back.

    ``cos``/``sin`` hold each frequency twice (``repeat_interleave``); the even columns are
    the distinct values. Kept operation for operation so packed and unpacked round alike.
    """
    x1, x2 = x_THD.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x_THD)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x_THD)
