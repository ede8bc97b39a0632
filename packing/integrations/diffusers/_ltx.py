"""LTX-Video (diffusers ``LTXVideoTransformer3DModel``) trained packed.

`install` wraps a loaded model in `PackedLTX`; its ``forward`` runs K packed episodes through
the model's own modules in one call, as `wan` does (the same `PackedAdapter` underneath)::

    latents (S, C, H, W) --patchify (1x1: a latent pixel is a token)--> proj_in -> (T, D)
    timestep (K,)  --time_embed (adaLN-single) on K rows--> gathered to T tokens by doc id
    text (T_txt, D_txt) --drop rows the tokenizer masked--> caption_projection -> ctx
    block       adaLN(table + temb[doc]) -> attn1 (document mask, RoPE at doc-local thw)
                -> attn2 (latent doc k -> text doc k) -> adaLN FFN
    head        LayerNorm * (1 + scale[doc]) + shift[doc] -> proj_out -> (S, C, H, W)

RoPE: LTX computes cos/sin from each token's (t, h, w), scaled by ``rope_interpolation_scale``
(the pipeline passes ``(VAE time ratio / fps, VAE space ratio, VAE space ratio)``) and divided
by the model's base sizes, interleaved per frequency over the whole width (not per head). Packed,
the model's own ``rope`` module gets each token's doc-local coordinates through its
``video_coords`` input, scaled op for op as its own grid is: bit-identical per episode.

Text: the pipeline pads T5 prompts to 128 rows and passes ``encoder_attention_mask``, which
the model turns into a -10000 bias, so padded rows get no weight. Packed, those rows are
dropped (a ``text_mask`` stream of the tokenizer's mask), so the cross-attention document mask
never lets a query see them; unpadded text needs no mask.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from packing._lazy import require
from packing.attention import AttentionMask
from packing.integrations.diffusers._adapter import (
    EpisodeReference,
    FamilyParts,
    PackedAdapter,
    toy_text_encoder,
)
from packing.integrations.diffusers._processor import separate_qkv
from packing.integrations.diffusers._streams import patchify, unpatchify
from packing.train import broadcast_to_tokens

_ltx = require("diffusers.models.transformers.transformer_ltx", extra="diffusers")

__all__ = [
    "PIPELINE_ROPE_SCALE",
    "LTXReference",
    "PackedLTX",
    "ltx_rope",
    "tiny_ltx",
    "tiny_ltx_model",
]

RopeScale = tuple[float, float, float]
PIPELINE_ROPE_SCALE: RopeScale = (8 / 25, 32, 32)  # LTXPipeline's, at its default 25 fps
_TOKEN = (1, 1)  # LTX's VAE does the patching: one latent pixel is one token


def _check_ltx(model: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Refuse what LTX packed cannot do; the family's ``patch_hw``/``text_dim`` for the adapter."""
    if not isinstance(model, _ltx.LTXVideoTransformer3DModel):
        raise TypeError(
            f"expected a diffusers LTXVideoTransformer3DModel, got {type(model).__name__}"
        )
    cfg = model.config
    if (cfg.patch_size, cfg.patch_size_t) != (1, 1):
        raise ValueError(
            f"patch_size={cfg.patch_size}, patch_size_t={cfg.patch_size_t}: only 1 and 1 (the "
            "released LTX-Video transformers; their VAE does the patching) are supported packed"
        )
    return dict(options, patch_hw=_TOKEN, text_dim=int(cfg.caption_channels))


def ltx_rope(rope: Any, thw_T3: Tensor, scale: RopeScale | None) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each ``(T, inner_dim)`` fp32: LTX's RoPE at each token's (t, h, w).

    ``LTXVideoRotaryPosEmbed`` scales its grid as ``t * scale[0] * patch_size_t / base`` (no
    scaling for ``scale=None``); its ``video_coords`` path divides by ``base`` only. Handing it
    ``t * scale[0] * patch_size_t`` (or ``t * base``, exact in fp32 for integer ``t``) leaves
    the same fp32 operations in the same order, and the rest is the module's own code.
    """
    g = thw_T3.to(torch.float32).T[None]  # (1, 3, T)
    if scale is None:
        base = (rope.base_num_frames, rope.base_height, rope.base_width)
        coords = [g[:, a] * base[a] for a in range(3)]
    else:
        patch = (rope.patch_size_t, rope.patch_size, rope.patch_size)
        coords = [g[:, a] * scale[a] * patch[a] for a in range(3)]
    video_coords = torch.stack(coords, dim=1)
    cos, sin = rope(video_coords, video_coords=video_coords)  # reads only its batch and device
    return cos[0], sin[0]


def rotate(x_THD: Tensor, cos_TD: Tensor, sin_TD: Tensor) -> Tensor:
    """LTX's own ``apply_rotary_emb``, which rotates the width before the head split."""
    x = x_THD.flatten(1)[None]
    return _ltx.apply_rotary_emb(x, (cos_TD[None], sin_TD[None]))[0].view_as(x_THD)


class LTXReference(EpisodeReference):
    """The unpacked baseline: the unmodified ``LTXVideoTransformer3DModel.forward``, one episode
    per call, ``(1, F*H*W, C)`` tokens, ``(1,)`` timestep, ``(1, L, D_txt)`` text and its
    ``(1, L)`` encoder attention mask (all ones without a ``text_mask`` stream)."""

    def __init__(
        self,
        transformer: nn.Module,
        *,
        rope_interpolation_scale: RopeScale | None = PIPELINE_ROPE_SCALE,
        **options: Any,
    ) -> None:
        super().__init__(transformer, **_check_ltx(transformer, options))
        self.rope_interpolation_scale = rope_interpolation_scale

    def episode(
        self, xt_FCHW: Tensor, timestep_1: Tensor, text_1LD: Tensor, mask_1L: Tensor | None
    ) -> Tensor:
        f, _, h, w = xt_FCHW.shape
        mask = (
            torch.ones(text_1LD.shape[:2], device=text_1LD.device) if mask_1L is None else mask_1L
        )
        pred = self.transformer(
            patchify(xt_FCHW, _TOKEN)[None],
            text_1LD,
            timestep_1,
            mask,
            num_frames=f,
            height=h,
            width=w,
            rope_interpolation_scale=self.rope_interpolation_scale,
            return_dict=False,
        )[0]
        return unpatchify(pred[0], _TOKEN, (h, w))


class PackedLTX(PackedAdapter):
    """A loaded ``LTXVideoTransformer3DModel`` trained on packed batches (see the module
    picture). Options beyond `PackedAdapter`'s: ``rope_interpolation_scale`` (the pipeline's
    ``(8 / fps, 32, 32)``; default its 25 fps; None: the model's unscaled grid)."""

    model_cls = _ltx.LTXVideoTransformer3DModel
    reference_cls = LTXReference

    @classmethod
    def family_parts(cls) -> FamilyParts:
        return FamilyParts(_ltx.LTXAttention, separate_qkv, rotate, _block_forward, _check_ltx)

    def __init__(
        self,
        transformer: nn.Module,
        *,
        rope_interpolation_scale: RopeScale | None = PIPELINE_ROPE_SCALE,
        **options: Any,
    ) -> None:
        super().__init__(transformer, **options)
        self.rope_interpolation_scale = rope_interpolation_scale

    def options(self) -> dict[str, Any]:
        return {**super().options(), "rope_interpolation_scale": self.rope_interpolation_scale}

    @torch.compiler.disable
    def rope_rows(self, thw_T3: Tensor) -> tuple[Tensor, Tensor]:
        """LTX's rotary (cos, sin) at each token's (t, h, w), its interpolation scale applied."""
        return ltx_rope(self.transformer.rope, thw_T3, self.rope_interpolation_scale)

    def packed_forward(
        self, x_in: Tensor, prep: dict[str, Any], ids_T: Tensor, timestep: Tensor,
        text_TD: Tensor, per_token: bool = False,
    ) -> Tensor:  # fmt: skip
        m = self.transformer

        x = m.proj_in(patchify(x_in, _TOKEN))
        # adaLN-single on K rows, gathered to the T tokens (a (T,) timestep: on T rows).
        temb, emb = m.time_embed(timestep, batch_size=len(timestep), hidden_dtype=x.dtype)
        if not per_token:
            temb, emb = broadcast_to_tokens(temb, ids_T), broadcast_to_tokens(emb, ids_T)
        temb_T6D = temb.unflatten(1, (6, -1))
        ctx = m.caption_projection(text_TD[None])[0]

        x = self.run_blocks(
            m.transformer_blocks,
            x,
            ctx,
            temb_T6D,
            prep["rope"],
            prep["self_mask"],
            prep["cross_mask"],
        )
        shift, scale = (m.scale_shift_table + emb[:, None]).unbind(1)
        x = m.norm_out(x) * (1 + scale) + shift
        return unpatchify(m.proj_out(x), _TOKEN, tuple(x_in.shape[-2:]))  # type: ignore[arg-type]


def _block_forward(
    block: Any,
    x: Tensor,
    ctx: Tensor,
    temb_T6D: Tensor,
    rope: tuple[Tensor, Tensor],
    self_mask: AttentionMask,
    cross_mask: AttentionMask,
) -> Tensor:
    """``LTXVideoTransformerBlock.forward`` on packed tokens ``(T, D)`` with per-token adaLN
    rows (its cross-attention reads the un-normalised ``x``, as upstream)."""
    shift, scale, gate, m_shift, m_scale, m_gate = (block.scale_shift_table + temb_T6D).unbind(1)
    x = x + block.attn1(block.norm1(x) * (1 + scale) + shift, None, self_mask, rope) * gate
    x = x + block.attn2(x, ctx, cross_mask, None)
    return x + block.ff(block.norm2(x) * (1 + m_scale) + m_shift) * m_gate


# -- tiny random-init models (tests, `packing verify --model`) ------------------------------------
def tiny_ltx_model(**config: Any) -> nn.Module:
    """A 2-block random-init ``LTXVideoTransformer3DModel``: 48 latent channels, width 32 (2
    heads of 16; ``32 % 6 = 2`` exercises LTX's RoPE padding), caption width 24."""
    base: dict[str, Any] = dict(
        in_channels=48,
        out_channels=48,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        num_layers=2,
        caption_channels=24,
    )
    return _ltx.LTXVideoTransformer3DModel(**{**base, **config})  # type: ignore[no-any-return]


def tiny_ltx(document_mask: bool = True, mask: str = "document") -> PackedLTX:
    """`packing verify --model packing.integrations.diffusers.testing:tiny_ltx`: a tiny LTX-Video
    packed, for the embedded dataset's (48, 8, 16) latents and task texts."""
    if mask != "document":
        raise ValueError(f"mask={mask!r}: LTX attends to whole episodes; use 'document'")
    torch.manual_seed(0)
    return PackedLTX(
        tiny_ltx_model(),
        latent_hw=(8, 16),
        text_encoder=toy_text_encoder(),
        document_mask=document_mask,
    )
