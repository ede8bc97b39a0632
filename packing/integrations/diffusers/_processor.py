"""A packed attention processor for diffusers attention modules, installed and removed in place.

diffusers routes every attention call through ``module.processor(attn, hidden_states,
encoder_hidden_states, attention_mask, rotary_emb)``. `PackedAttnProcessor` takes over when
``attention_mask`` is a `packing.attention._packed.AttentionMask` (built once per step by
`packing.attention._packed.prepare_attention`, so ``auto`` picks FA4 varlen / Flex / SDPA exactly as
for the reference DiT) and hands every other call to the processor it replaced, so the model's
own ``forward`` (pipelines, inference) keeps working unchanged while it is installed::

    packed call   hidden (T, D), encoder (T_txt, D) or None, AttentionMask, (cos, sin) or None
                  -> q, k, v (T, H*Dh) -> norm_q/k -> (T, H, Dh) -> the family's RoPE rotation
                  -> packing.attention._packed.packed_attention -> to_out
    any other     -> the original processor, untouched

Processors are not parameters: installing adds, renames and moves no weight, so
``state_dict()``, ``save_pretrained`` and ``from_pretrained`` see the model as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from packing.attention import AttentionMask, packed_attention

__all__ = ["PackedAttnProcessor", "install_processors", "separate_qkv", "uninstall_processors"]

QKV = Callable[[Any, Tensor, "Tensor | None"], tuple[Tensor, Tensor, Tensor]]
Rotate = Callable[[Tensor, Tensor, Tensor], Tensor]  # (x_THD, cos, sin) -> x_THD rotated


def separate_qkv(
    attn: Any, hidden: Tensor, encoder: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``to_q``, ``to_k``, ``to_v`` of a module without fused projections (LTX)."""
    kv = hidden if encoder is None else encoder
    return attn.to_q(hidden), attn.to_k(kv), attn.to_v(kv)


class PackedAttnProcessor:
    """Packed self- or cross-attention for a diffusers attention module with ``to_q/k/v``,
    ``norm_q/k`` over all heads and ``to_out`` (Wan, LTX).

    ``qkv(attn, hidden, encoder)`` returns the projections (the model family's own helper, so
    fused projections work); ``rotate(x_THD, cos, sin)`` is the family's RoPE rotation, applied
    to q and k when the call carries ``(cos, sin)``; ``original`` is the processor replaced.
    """

    def __init__(self, original: Any, qkv: QKV, rotate: Rotate) -> None:
        self.original = original
        self.qkv = qkv
        self.rotate = rotate

    def __call__(
        self,
        attn: Any,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Any = None,
        rotary_emb: tuple[Tensor, Tensor] | None = None,
        **kwargs: Any,
    ) -> Tensor:
        if not isinstance(attention_mask, AttentionMask):
            return self.original(  # type: ignore[no-any-return]
                attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs
            )
        if getattr(attn, "add_k_proj", None) is not None:
            raise NotImplementedError(
                "packed attention does not support image-context attention (add_k_proj, Wan "
                "2.1 I2V); use a text-to-video or TI2V model"
            )
        q, k, v = self.qkv(attn, hidden_states, encoder_hidden_states)
        q = attn.norm_q(q).unflatten(-1, (attn.heads, -1))
        k = attn.norm_k(k).unflatten(-1, (attn.heads, -1))
        v = v.unflatten(-1, (attn.heads, -1))
        if rotary_emb is not None:
            q, k = self.rotate(q, *rotary_emb), self.rotate(k, *rotary_emb)
        out = (
            packed_attention(q.to(v.dtype), k.to(v.dtype), v, attention_mask).flatten(1).type_as(q)
        )
        return attn.to_out[1](attn.to_out[0](out))  # type: ignore[no-any-return]


def install_processors(model: nn.Module, attention_cls: type, qkv: QKV, rotate: Rotate) -> int:
    """Wrap the processor of every ``attention_cls`` module of ``model``; returns how many.

    A model whose processors are already packed is refused: a second adapter over the same
    model would share them, and uninstalling either would break the other.
    """
    modules = [m for m in model.modules() if isinstance(m, attention_cls)]
    if any(isinstance(m.processor, PackedAttnProcessor) for m in modules):
        raise ValueError(
            f"this {type(model).__name__} is already installed (its attention processors are "
            "packed): keep using the adapter install() returned, or call its uninstall() "
            "before installing again"
        )
    count = 0
    for module in modules:
        module.set_processor(PackedAttnProcessor(module.processor, qkv, rotate))  # type: ignore[operator]
        count += 1
    if count == 0:
        raise ValueError(
            f"{type(model).__name__} has no {attention_cls.__name__} module; is this the model "
            "family the adapter is for?"
        )
    return count


def uninstall_processors(model: nn.Module) -> None:
    """Put back every processor that `install_processors` replaced."""
    for module in model.modules():
        proc = getattr(module, "processor", None)
        if isinstance(proc, PackedAttnProcessor):
            module.set_processor(proc.original)  # type: ignore[operator]
