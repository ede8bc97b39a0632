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

``conditioning="per_token"`` gathers the timestep to tokens first and runs the MLP on T rows:
the TI2V pipeline's per-token path (``timestep`` of shape (B, seq_len)), exact, slower; use it
when tokens of one episode need different timesteps (e.g. a clean first frame).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from einops import rearrange
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from packing._lazy import require
from packing.attention import AttentionMask, Backend, prepare_attention
from packing.conditioning import broadcast_to_tokens
from packing.integrations.diffusers.adapter import FlowMatchingAdapter, TextEncoder
from packing.integrations.diffusers.processor import install_processors, uninstall_processors
from packing.integrations.diffusers.rope import rope_from_table
from packing.integrations.diffusers.streams import unpatchify
from packing.layout import StreamLayout, layout_from_lengths

_wan = require("diffusers.models.transformers.transformer_wan", extra="diffusers")

__all__ = [
    "PackedWan",
    "WanReference",
    "install",
    "tiny_wan",
    "tiny_wan_2_1",
    "tiny_wan_2_2",
    "toy_text_encoder",
]

Conditioning = Literal["per_episode", "per_token"]


def _check_wan(model: Any) -> None:
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


def _one_document(lay: StreamLayout) -> StreamLayout:
    """All real tokens as ONE document: the broken mask of ``document_mask=False``."""
    n = lay.num_tokens
    return layout_from_lengths([n] if n else [], [n] if n else [], lay.padded_len).to(
        lay.doc_ids_T.device
    )


class PackedWan(FlowMatchingAdapter):
    """A loaded ``WanTransformer3DModel`` trained on packed batches (see the module picture).

    The model is held as ``self.transformer``, unchanged but for its attention processors
    (`uninstall` puts them back); save it with ``packed.transformer.save_pretrained``.
    ``attention`` is the `packing.attention` backend (``auto``: FA4 varlen / Flex / SDPA).
    ``document_mask=False`` lets episodes see each other: the broken model verify must fail.
    """

    def __init__(
        self,
        transformer: nn.Module,
        *,
        latent_hw: tuple[int, int] | None = None,
        latents: str = "latents",
        text: str = "text",
        text_encoder: TextEncoder | None = None,
        timestep_shift: float = 1.0,
        attention: Backend = "auto",
        conditioning: Conditioning = "per_episode",
        document_mask: bool = True,
    ) -> None:
        _check_wan(transformer)
        if conditioning not in ("per_episode", "per_token"):
            raise ValueError(f"conditioning={conditioning!r}; use 'per_episode' or 'per_token'")
        super().__init__(
            transformer,
            latent_hw=latent_hw,
            latents=latents,
            text=text,
            text_encoder=text_encoder,
            timestep_shift=timestep_shift,
        )
        cfg: Any = transformer.config
        self.patch_hw = (int(cfg.patch_size[1]), int(cfg.patch_size[2]))
        self.attention_backend = attention
        self.conditioning = conditioning
        self.document_mask = document_mask
        self._block_fn: Callable[..., Tensor] = _block_forward
        install_processors(transformer, _wan.WanAttention, _wan._get_qkv_projections)

    def uninstall(self) -> nn.Module:
        """Put the model's own attention processors back; returns the model."""
        uninstall_processors(self.transformer)
        return self.transformer

    def compile_blocks(self, **compile_options: Any) -> PackedWan:
        """``torch.compile`` the packed block step (one compiled function for every block, its
        weights graph inputs); per-step host work (`prepare`, noise, layouts) stays eager.
        Give packs static shapes (``Stream(budget=...)``, ``max_docs``) so it compiles once."""
        self._block_fn = torch.compile(_block_forward, **compile_options)
        return self

    def __enter__(self) -> PackedWan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def reference(self) -> WanReference:
        """The unpacked baseline for `packing verify`: a copy of the model, unmodified, run one
        episode at a time, with this adapter's streams and flow-matching options."""
        model = copy.deepcopy(self.transformer)
        uninstall_processors(model)
        return WanReference(
            model,
            latent_hw=self.latent_hw,
            latents=self.latents_stream,
            text=self.text_stream,
            text_encoder=self.text_encoder,
            timestep_shift=self.timestep_shift,
        )

    # -- per step, outside torch.compile -----------------------------------------------------
    @torch.compiler.disable
    def prepare(
        self, latent_layout: StreamLayout, text_layout: StreamLayout, dtype: torch.dtype
    ) -> dict[str, Any]:
        """The two attention masks and the RoPE rows, built once per step for every block."""
        m = self.transformer
        dev = m.rope.freqs_cos.device
        q_lay = latent_layout if self.document_mask else _one_document(latent_layout)
        kv_lay = text_layout if self.document_mask else _one_document(text_layout)
        if latent_layout.thw_T3 is None:
            raise ValueError(
                f"stream {self.latents_stream!r} must be a grid stream (Stream(grid=...))"
            )
        rope = m.rope
        split = (rope.t_dim, rope.h_dim, rope.w_dim)
        kw: dict[str, Any] = dict(device=dev, dtype=dtype, head_dim=m.config.attention_head_dim)
        be = self.attention_backend
        return {
            "self_mask": prepare_attention(q_lay, None, None, be, **kw),
            "cross_mask": prepare_attention(q_lay, kv_lay, None, be, **kw),
            "rope": rope_from_table(rope.freqs_cos, rope.freqs_sin, split, latent_layout.thw_T3),
        }

    # -- the packed forward --------------------------------------------------------------------
    def velocity(
        self,
        xt_SCHW: Tensor,
        timestep_K: Tensor,
        text_TD: Tensor,
        latent_layout: StreamLayout,
        text_layout: StreamLayout,
    ) -> Tensor:
        m = self.transformer
        x_in = xt_SCHW.to(m.dtype)
        prep = self.prepare(latent_layout, text_layout, _attention_dtype(x_in))
        ids_T = latent_layout.doc_ids_T.to(x_in.device)

        x = m.patch_embedding(rearrange(x_in, "s c h w -> 1 c s h w"))
        grid = (int(x.shape[-2]), int(x.shape[-1]))
        x = rearrange(x, "1 d s h w -> (s h w) d").contiguous()

        # Timestep MLP on K rows, gathered to the T tokens (per_token: on T rows, slower).
        t_rows = timestep_K
        if self.conditioning == "per_token":
            t_rows = broadcast_to_tokens(timestep_K, ids_T)
        temb, tproj, ctx, _ = m.condition_embedder(t_rows, text_TD[None])
        e0 = tproj.unflatten(1, (6, -1))
        if self.conditioning == "per_episode":
            temb, e0 = broadcast_to_tokens(temb, ids_T), broadcast_to_tokens(e0, ids_T)
        ctx = ctx[0]

        for block in m.blocks:
            args = (block, x, ctx, e0, prep["rope"], prep["self_mask"], prep["cross_mask"])
            if torch.is_grad_enabled() and m.gradient_checkpointing:
                x = checkpoint(self._block_fn, *args, use_reentrant=False)
            else:
                x = self._block_fn(*args)

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


def _attention_dtype(x: Tensor) -> torch.dtype:
    """The dtype q/k/v will have: autocast's when it is on for the device."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class WanReference(FlowMatchingAdapter):
    """The unpacked baseline: the unmodified ``WanTransformer3DModel.forward``, one episode per
    call, ``(1, C, F, H, W)`` latents, ``(1,)`` timestep and ``(1, L, D_txt)`` text."""

    def __init__(self, transformer: nn.Module, **kwargs: Any) -> None:
        _check_wan(transformer)
        super().__init__(transformer, **kwargs)
        cfg: Any = transformer.config
        self.patch_hw = (int(cfg.patch_size[1]), int(cfg.patch_size[2]))

    def velocity(
        self,
        xt_SCHW: Tensor,
        timestep_K: Tensor,
        text_TD: Tensor,
        latent_layout: StreamLayout,
        text_layout: StreamLayout,
    ) -> Tensor:
        out = torch.zeros_like(xt_SCHW)
        s0 = c0 = 0
        for k, (frames, words) in enumerate(
            zip(latent_layout.steps_K, text_layout.lengths_K, strict=True)
        ):
            video = rearrange(xt_SCHW[s0 : s0 + frames], "f c h w -> 1 c f h w")
            pred = self.transformer(
                video,
                timestep=timestep_K[k : k + 1],
                encoder_hidden_states=text_TD[None, c0 : c0 + words],
                return_dict=False,
            )[0]
            out[s0 : s0 + frames] = rearrange(pred, "1 c f h w -> f c h w").to(out.dtype)
            s0, c0 = s0 + frames, c0 + words
        return out


def install(transformer: nn.Module, **options: Any) -> PackedWan:
    """Pack a loaded ``WanTransformer3DModel``: ``packed = install(model, latent_hw=(H, W))``.

    Options are `PackedWan`'s. Adds and renames no parameter (``model.state_dict()`` is as
    before); ``packed.uninstall()`` (or ``with install(...) as packed:``) undoes it.
    """
    return PackedWan(transformer, **options)


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


def toy_text_encoder(text_dim: int = 24, seed: int = 0) -> TextEncoder:
    """A stand-in for umT5 in tests: byte tokens of the task (`packing.model.text_tokens`) looked
    up in a fixed seeded table, ``(len + 1, text_dim)`` per task. Deterministic, not trained."""
    from packing.model import text_tokens

    table = torch.randn(257, text_dim, generator=torch.Generator().manual_seed(seed))

    def encode(tasks: Sequence[str]) -> list[Tensor]:
        return [table[text_tokens(t)] for t in tasks]

    return encode


def _tiny_factory(style: Literal["2.1", "2.2"]) -> Callable[..., PackedWan]:
    def factory(document_mask: bool = True, mask: str = "document") -> PackedWan:
        if mask != "document":
            raise ValueError(f"mask={mask!r}: Wan attends to whole episodes; use 'document'")
        torch.manual_seed(0)
        return install(
            tiny_wan(style),
            latent_hw=(8, 16),
            text_encoder=toy_text_encoder(),
            document_mask=document_mask,
        )

    factory.__name__ = f"tiny_wan_{style.replace('.', '_')}"
    factory.__doc__ = (
        f"`packing verify --model packing.integrations.diffusers.wan:{factory.__name__}`: a "
        f"tiny Wan {style} packed, for the embedded dataset's (C, 8, 16) latents and task texts."
    )
    return factory


tiny_wan_2_1 = _tiny_factory("2.1")
tiny_wan_2_2 = _tiny_factory("2.2")
