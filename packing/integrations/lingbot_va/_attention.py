"""The attention op swapped into LeRobot's ``WanAttention`` modules while packed.

``WanAttention.forward`` computes q/k/v (norms, RoPE) and calls ``self.attn_op(q, k, v)`` on
``(1, S, H, D)`` tensors; with ``attn_mode="flex"`` that op is a ``FlexAttnFunc`` reading a
block mask from class attributes. `install` replaces each block's ``attn_op`` with a
`PackedAttentionOp` reading this step's `packing.attention.AttentionMask` (self or cross)
from a shared `MaskSlot`: no parameter is added, renamed or changed (``state_dict`` is the
same), and `uninstall` puts LeRobot's ops back.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from packing.attention import AttentionMask, packed_attention

__all__ = ["MaskSlot", "PackedAttentionOp", "swap_attention_ops"]


class MaskSlot:
    """This step's masks, set by the packed forward before the blocks run."""

    def __init__(self) -> None:
        self.self_mask: AttentionMask | None = None
        self.cross_mask: AttentionMask | None = None


class PackedAttentionOp(nn.Module):
    """``attn_op(q, k, v)`` over a packed sequence: ``(1, T, H, D)`` in and out."""

    def __init__(self, slot: MaskSlot, cross: bool) -> None:
        super().__init__()
        self.slot = slot
        self.cross = cross

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        mask = self.slot.cross_mask if self.cross else self.slot.self_mask
        if mask is None:
            raise RuntimeError(
                "the packed LingBot-VA attention ran outside PackedLingBotVA.forward (no mask "
                "set); call the packed module, or uninstall() to get LeRobot's ops back"
            )
        return packed_attention(query[0], key[0], value[0], mask)[None]

    def extra_repr(self) -> str:
        return f"cross={self.cross}"


def swap_attention_ops(blocks: Any, slot: MaskSlot | None) -> list[nn.Module]:
    """Put packed ops into every block's ``attn1`` / ``attn2`` (``slot=None``: nothing), return
    the ops that were there (for `restore_attention_ops`)."""
    old: list[nn.Module] = []
    for block in blocks:
        for attn in (block.attn1, block.attn2):
            old.append(attn.attn_op)
            if slot is not None:
                cross = attn.cross_attention_dim_head is not None
                del attn.attn_op  # a registered module; nn.Module refuses to reassign it
                attn.attn_op = PackedAttentionOp(slot, cross)
    return old


def restore_attention_ops(blocks: Any, ops: list[nn.Module]) -> None:
    it = iter(ops)
    for block in blocks:
        for attn in (block.attn1, block.attn2):
            del attn.attn_op
            attn.attn_op = next(it)
