"""Wan (diffusers ``WanTransformer3DModel``, Wan 2.1 and 2.2 TI2V) trained packed.

`install` wraps a loaded model in `PackedWan`; its ``forward`` runs K packed episodes through
the model's own modules (patch embedding, condition embedder, blocks, head) in one call::

    latents (S, C, H, W) --Conv3d patch (1, ph, pw)--> tokens (T, D)     e0.. | e1.. | pad
    timestep (K,)  --condition_embedder MLP on K rows--> gathered to T tokens by doc id
    text (T_txt, D_txt) --text_embedder--> ctx                           t0.. | t1.. | pad
    block       adaLN(table + e0[doc]) -> attn1 (document mask, RoPE at doc-local thw)
                -> attn2 (latent doc k -> text doc k) -> adaLN FFN
    head        adaLN(table + temb[doc]) -> proj_out -> unpatchify -> (S, C, H, W)

The block loop follows ``WanTransformerBlock.forward`` operation for operation (the fp32 casts
included); only the attention masks (an `AttentionMask` through ``attention_mask``, which
the block itself always passes as None) and the per-token conditioning rows differ.
`WanReference` is the unpacked side: the unmodified ``model.forward`` on one episode at a time.

RoPE: ``WanRotaryPosEmbed`` holds per-axis tables ``freqs_cos``/``freqs_sin`` ``(max_seq_len,
head_dim)``, computed in float64 (then stored as float32), the head dim split ``[t_dim | h_dim |
w_dim]`` (128 -> 44 / 42 / 42); its ``forward`` takes rows ``0..F-1``, ``0..H-1``, ``0..W-1`` of
one video's grid. Packed, each token gathers the rows of its own (t, h, w) inside its episode::

    thw_T3     (0,0,0) (0,0,1) ... (1,1,2) | (0,0,0) ...   episode 0, then episode 1 from 0
    cos_T1D    [cos_t[t] | cos_h[h] | cos_w[w]]             (T, 1, head_dim), tables' dtype

Gathering rows of the same tables is bit-identical to diffusers' slicing; `rotate` is the
model's own rotation (in the tables' dtype, cast back).

``conditioning="per_token"`` gathers the timestep to tokens first and runs the MLP on T rows:
the TI2V pipeline's per-token path (``timestep`` of shape (B, seq_len)), exact, slower. Tokens of
one episode at different timesteps (TI2V's clean first frame) take a ``(T,)`` timestep in
``velocity`` (`per_token_timesteps`), which runs the MLP on T rows whatever ``conditioning``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from einops import rearrange
from torch import Tensor, nn

from packing._lazy import require
from packing.attention import AttentionMask
from packing.integrations.diffusers._adapter import (
    EpisodeReference,
    FamilyParts,
    PackedAdapter,
    toy_text_encoder,
)
from packing.integrations.diffusers._streams import unpatchify
from packing.train import broadcast_to_tokens

_wan = require("diffusers.models.transformers.transformer_wan", extra="diffusers")

__all__ = [
    "PackedWan",
    "WanReference",
    "rope_from_table",
    "rotate",
    "tiny_wan",
    "tiny_wan_2_1",
    "tiny_wan_2_2",
]

Conditioning = Literal["per_episode", "per_token"]


def _check_wan(model: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Refuse what Wan packed cannot do; the family's ``patch_hw``/``text_dim`` for the adapter."""
    if not isinstance(model, _wan.WanTransformer3DModel):
        raise TypeError(f"expected a diffusers WanTransformer3DModel, got {type(model).__name__}")
    pt = model.config.patch_size[0]
    if pt != 1:
        raise ValueError(
            f"patch_size={tuple(model.config.patch_size)}: a temporal patch of {pt} is not "
            "supported (one latent frame is one packed step); Wan 2.1 / 2.2 use (1, 2, 2)"
        )
    if model.config.image_dim is not None or model.config.added_kv_proj_dim is not None:
        raise NotImplementedError(
            "Wan 2.1 I2V (image_dim / added_kv_proj_dim) is not supported packed: its image "
            "context has a fixed layout; use a T2V or TI2V model"
        )
    if options.get("text_mask") is not None:
        raise ValueError(
            "text_mask: diffusers' Wan takes no encoder attention mask (it attends to every "
            "text row it is given); store each episode's unpadded text instead"
        )
    cfg = model.config
    return dict(
        options,
        patch_hw=(int(cfg.patch_size[1]), int(cfg.patch_size[2])),
        text_dim=int(cfg.text_dim),
    )


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
            f"{max_len}; split long episodes (packing.planning._plan.split_windows) or build the model "
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


class WanReference(EpisodeReference):
    """The unpacked baseline: the unmodified ``WanTransformer3DModel.forward``, one episode per
    call, ``(1, C, F, H, W)`` latents, ``(1,)`` timestep and ``(1, L, D_txt)`` text."""

    def __init__(self, transformer: nn.Module, **options: Any) -> None:
        super().__init__(transformer, **_check_wan(transformer, options))

    def episode(
        self, xt_FCHW: Tensor, timestep_1: Tensor, text_1LD: Tensor, mask_1L: Tensor | None
    ) -> Tensor:
        video = rearrange(xt_FCHW, "f c h w -> 1 c f h w")
        pred = self.transformer(video, timestep_1, text_1LD, return_dict=False)[0]
        return rearrange(pred, "1 c f h w -> f c h w")


class PackedWan(PackedAdapter):
    """A loaded ``WanTransformer3DModel`` trained on packed batches (see the module picture).

    Options beyond `PackedAdapter`'s: ``conditioning`` (``"per_episode"``, or the exact but
    slower ``"per_token"``).
    """

    model_cls = _wan.WanTransformer3DModel
    reference_cls = WanReference

    @classmethod
    def family_parts(cls) -> FamilyParts:
        return FamilyParts(
            _wan.WanAttention, _wan._get_qkv_projections, rotate, _block_forward, _check_wan
        )

    def __init__(
        self, transformer: nn.Module, *, conditioning: Conditioning = "per_episode", **options: Any
    ) -> None:
        if conditioning not in ("per_episode", "per_token"):
            raise ValueError(f"conditioning={conditioning!r}; use 'per_episode' or 'per_token'")
        super().__init__(transformer, **options)
        self.conditioning = conditioning

    # -- per step, outside torch.compile -----------------------------------------------------
    @torch.compiler.disable
    def rope_rows(self, thw_T3: Tensor) -> tuple[Tensor, Tensor]:
        """Rows of the model's own ``freqs_cos/sin`` tables at each token's (t, h, w)."""
        rope = self.transformer.rope
        split = (rope.t_dim, rope.h_dim, rope.w_dim)
        return rope_from_table(rope.freqs_cos, rope.freqs_sin, split, thw_T3)

    # -- the packed forward --------------------------------------------------------------------
    def packed_forward(
        self, x_in: Tensor, prep: dict[str, Any], ids_T: Tensor, timestep: Tensor,
        text_TD: Tensor, per_token: bool = False,
    ) -> Tensor:  # fmt: skip
        m = self.transformer

        x = m.patch_embedding(rearrange(x_in, "s c h w -> 1 c s h w"))
        grid = (int(x.shape[-2]), int(x.shape[-1]))
        x = rearrange(x, "1 d s h w -> (s h w) d").contiguous()

        # Timestep MLP on K rows, gathered to the T tokens (per_token: on T rows, slower; a
        # (T,) timestep, TI2V's clean first frame, is per token whatever the conditioning).
        t_rows = timestep
        if self.conditioning == "per_token" and not per_token:
            t_rows = broadcast_to_tokens(timestep, ids_T)
        temb, tproj, ctx, _ = m.condition_embedder(t_rows, text_TD[None])
        e0 = tproj.unflatten(1, (6, -1))
        if self.conditioning == "per_episode" and not per_token:
            temb, e0 = broadcast_to_tokens(temb, ids_T), broadcast_to_tokens(e0, ids_T)

        x = self.run_blocks(
            m.blocks, x, ctx[0], e0, prep["rope"], prep["self_mask"], prep["cross_mask"]
        )
        shift, scale = (m.scale_shift_table + temb[:, None]).unbind(1)
        x = (m.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        return unpatchify(m.proj_out(x), self.patch_hw, grid)


def _block_forward(
    block: Any,
    x: Tensor,
    ctx: Tensor,
    e0_T6D: Tensor,
    rope: tuple[Tensor, Tensor],
    self_mask: AttentionMask,
    cross_mask: AttentionMask,
) -> Tensor:
    """``WanTransformerBlock.forward`` on packed tokens ``(T, D)`` with per-token adaLN rows."""
    shift, scale, gate, c_shift, c_scale, c_gate = (
        block.scale_shift_table + e0_T6D.float()
    ).unbind(1)
    h = (block.norm1(x.float()) * (1 + scale) + shift).type_as(x)
    x = (x.float() + block.attn1(h, None, self_mask, rope) * gate).type_as(x)
    h = block.norm2(x.float()).type_as(x)
    x = x + block.attn2(h, ctx, cross_mask, None)
    h = (block.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
    return (x.float() + block.ffn(h).float() * c_gate).type_as(x)


# -- tiny random-init models (tests, `packing verify --model`) ------------------------------------
def tiny_wan(style: Literal["2.1", "2.2"] = "2.2", **config: Any) -> nn.Module:
    """A 2-block random-init ``WanTransformer3DModel`` shaped like Wan 2.1 (16 latent channels)
    or Wan 2.2 TI2V-5B (48 channels); width 32, 2 heads of 16, text width 24."""
    base: dict[str, Any] = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=16 if style == "2.1" else 48,
        out_channels=16 if style == "2.1" else 48,
        text_dim=24,
        freq_dim=16,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        rope_max_seq_len=64,
    )
    if style not in ("2.1", "2.2"):
        raise ValueError(f"style={style!r}; choose '2.1' or '2.2'")
    return _wan.WanTransformer3DModel(**{**base, **config})  # type: ignore[no-any-return]


def _tiny_factory(style: Literal["2.1", "2.2"]) -> Callable[..., PackedWan]:
    def factory(document_mask: bool = True, mask: str = "document") -> PackedWan:
        if mask != "document":
            raise ValueError(f"mask={mask!r}: Wan attends to whole episodes; use 'document'")
        torch.manual_seed(0)
        return PackedWan(
            tiny_wan(style),
            latent_hw=(8, 16),
            text_encoder=toy_text_encoder(),
            document_mask=document_mask,
        )

    factory.__name__ = f"tiny_wan_{style.replace('.', '_')}"
    factory.__doc__ = (
        f"`packing verify --model packing.integrations.diffusers._wan:{factory.__name__}`: a "
        f"tiny Wan {style} packed, for the embedded dataset's (C, 8, 16) latents and task texts."
    )
    return factory


tiny_wan_2_1 = _tiny_factory("2.1")
tiny_wan_2_2 = _tiny_factory("2.2")
