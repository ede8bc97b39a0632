"""The baselines a skeptic picks, over the reference DiT's own modules (same weights, same math).

* lean per-episode: one episode per micro-step at its exact length, the blocks compiled
  ``dynamic=True`` (one graph for every block and length), attention without a mask (one
  unpadded episode needs none) through the backend a probe picked on the run's shapes
  (`benchmarks/attention/backends.py`; SDPA's default dispatch unless another is faster), inputs (noise, timestep, RoPE positions, text) prepared ahead
  as a data loader would. None of the reference path's per-micro-step work (PackedBatch,
  joint layout, masks, host-side RNG) is left in the step.
* length bucketing as Open-Sora 2.0 does it (``opensora_steps``: more buckets, one bucket a
  step, a fixed row count per bucket); or with the step's own episodes (``bucket_step``):
  episodes go to a few length buckets, each bucket
  has its own batch size (``rows * bucket length ~ token target``: about equal time per
  micro-step), a micro-step is a ``(B, L_bucket)`` batch. ``pad``: an episode is padded up to
  its bucket, padded keys masked (a key-padding mask: SDPA ``attn_mask`` or a Flex block mask);
  ``crop``: cut down to the bucket below (Open-Sora's choice; no padding, frames lost).

Shapes: ``(B, L, D)`` activations, ``(B, H, L, hd)`` for attention; an episode's joint tokens
are its video tokens, then its actions (as in the packed model); text is padded to
``text_len`` with a key-padding mask in cross-attention (all rows, every variant but lean)::

    bucket 1 (L=192): [v v v v a a . .]  [v v v v v a a .]     B=2 rows, "." padding
    bucket 2 (L=320): [v v v v v v v a a a . .]                 B=1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import packing.model._dit as pm
from benchmarks.attention import backends
from benchmarks.harness import EpisodeShape
from packing.data import PackedCollator, Stream
from packing.data._joint import joint_layout
from packing.model import DiT
from packing.model._rope import apply_rope, rope_angles


@dataclass
class EpisodeInputs:
    """One episode's prepared step inputs, on the device (what a data loader hands over)."""

    xt_v: Tensor  # (T_v, C*ph*pw) noised video tokens
    v_v: Tensor  # (T_v, C*ph*pw) velocity target
    xt_a: Tensor  # (T_a, action_dim)
    v_a: Tensor  # (T_a, action_dim)
    t: Tensor  # (1,) timestep
    thw: Tensor  # (T_v + T_a, 3) doc-local positions, joint order
    text: Tensor  # (L_txt,) tokens

    @property
    def tokens(self) -> int:
        return self.thw.shape[0]  # joint tokens: video + actions


@torch.no_grad()
def prepare_episodes(model: DiT, episodes: list[dict[str, Any]], step: int,
                     dev: torch.device) -> list[EpisodeInputs]:  # fmt: skip
    """Each episode's noise, timestep and positions exactly as the reference model draws them
    for ``(seed=0, step, episode_index)``, so losses agree with the packed run. The batch goes
    to ``dev`` first: `packed_noise` draws with the generators of the batch's device, and the
    packed run's batches are on the GPU (the first H200 run drew here on the CPU: same
    distribution, other samples, a 1% loss difference)."""
    cfg = model.config
    collate = PackedCollator([*cfg.streams(), Stream("text")], pad_to_multiple=1)
    out = []
    for ep in episodes:
        batch = collate([ep])
        ids = batch.per_episode["episode_index"]
        batch = batch.to(dev)
        batch.per_episode["episode_index"] = ids  # host ints: the RNG keys
        batch.extras["seed"], batch.extras["step"] = 0, step
        prep = _inputs_only(model, batch, dev)
        out.append(
            EpisodeInputs(
                xt_v=model.patchify(prep["xt_lat"]).to(dev),
                v_v=model.patchify(prep["v_lat"]).to(dev),
                xt_a=prep["xt_act"].to(dev),
                v_a=prep["v_act"].to(dev),
                t=prep["t_K"].to(dev),
                thw=prep["thw_J3"].to(dev),
                text=prep["text"].to(dev),
            )
        )
    return out


def _inputs_only(model: DiT, batch: Any, dev: torch.device) -> dict[str, Any]:
    """`DiT.prepare` without its attention masks (a baseline needs none, and building a Flex
    block mask per episode length costs compiles): noised inputs, targets, timesteps, the
    joint (t, h, w) positions and the text tokens."""
    prep = model._inputs(batch)
    joint = joint_layout(batch, ("latents", "action"))
    if joint.layout.doc_ids_T.device != dev:
        joint = joint.to(dev)
    thw_v = batch.layout("latents").thw_T3
    thw_a = model._action_thw(batch, dev)
    prep["thw_J3"] = joint.join({"latents": thw_v.to(dev).long(), "action": thw_a})
    prep["text"] = model._text(batch, dev)[0]
    return prep


# -- attention on (B, H, L, hd) -------------------------------------------------------------------
def sdpa_flash(q: Tensor, k: Tensor, v: Tensor, mask: Any = None) -> Tensor:
    """SDPA forced to FLASH: what the runs before issue 37 used (a probe candidate now)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v)


def sdpa_masked(q: Tensor, k: Tensor, v: Tensor, mask: Any) -> Tensor:
    """``mask`` (B, 1, 1, L_kv) bool, True = attend. On the GPU only SDPA's fused masked
    kernels (memory-efficient, cuDNN) may run: a careful user would not let it fall back to
    the math path (an (L, L) score matrix per head), and an unsupported call raises instead."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def flex_masked(q: Tensor, k: Tensor, v: Tensor, mask: Any) -> Tensor:
    """``mask`` a Flex BlockMask of the batch's key padding."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=mask)


def key_padding_block_mask(lengths_B: Tensor, L: int) -> Any:
    """Flex block mask: row b attends to keys ``< lengths_B[b]`` (its real tokens)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def key_padding(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return kv < lengths_B[b]

    return create_block_mask(key_padding, len(lengths_B), None, L, L, device=lengths_B.device)


Attention = Callable[[Tensor, Tensor, Tensor, Any], Tensor]

ATTENTION_NAMES = {
    "lean": "sdpa default dispatch (per episode)",
    "bucket_sdpa": "sdpa + key-padding mask",
    "bucket_flex": "flex + key-padding block mask",
    "bucket_crop": "sdpa default dispatch (cropped rows)",
    "bucket_opensora": "sdpa + key-padding mask",
}


# -- the forward over the reference blocks ------------------------------------------------------
def _rope(x_BLHD: Tensor, angles_BL: Tensor) -> Tensor:
    b, n = x_BLHD.shape[:2]
    return apply_rope(x_BLHD.flatten(0, 1), angles_BL.flatten(0, 1)).unflatten(0, (b, n))


def block_forward(blk: Any, x: Tensor, e0_B6D: Tensor, ctx: Tensor, angles: Tensor,
                  self_attn: Attention, self_mask: Any, cross_attn: Attention,
                  cross_mask: Any) -> Tensor:  # fmt: skip
    """`packing.model._dit.Block.forward` on ``(B, L, D)`` rows (the same modules)."""
    mods = (blk.modulation + e0_B6D).unbind(1)
    shift1, scale1, gate1, shift2, scale2, gate2 = (m[:, None] for m in mods)
    sa, ca = blk.self_attn, blk.cross_attn
    q, k, v = sa.qkv(blk.norm1(x) * (1 + scale1) + shift1).chunk(3, dim=-1)
    q = _rope(sa.norm_q(q).unflatten(-1, (sa.heads, -1)), angles)
    k = _rope(sa.norm_k(k).unflatten(-1, (sa.heads, -1)), angles)
    v = v.unflatten(-1, (sa.heads, -1))
    o = self_attn(q.to(v.dtype).transpose(1, 2), k.to(v.dtype).transpose(1, 2),
                  v.transpose(1, 2), self_mask)  # fmt: skip
    x = x + gate1 * sa.out(o.transpose(1, 2).flatten(2))
    kc, vc = ca.kv(ctx).chunk(2, dim=-1)
    qc = ca.norm_q(ca.q(blk.norm3(x))).unflatten(-1, (ca.heads, -1))
    kc = ca.norm_k(kc).unflatten(-1, (ca.heads, -1))
    vc = vc.unflatten(-1, (ca.heads, -1))
    o = cross_attn(qc.to(vc.dtype).transpose(1, 2), kc.to(vc.dtype).transpose(1, 2),
                   vc.transpose(1, 2), cross_mask)  # fmt: skip
    x = x + ca.out(o.transpose(1, 2).flatten(2))
    return x + gate2 * blk.ffn(blk.norm2(x) * (1 + scale2) + shift2)


# What the loss functions call per block: `block_forward`, or the bench's compiled copy of it
# (``torch.compile(block_forward, dynamic=True)``: one graph per attention function, shared by
# every block -- the modules are inlined as inputs -- and by every length).
block_fn: Callable[..., Tensor] = block_forward


def _conditioning(model: DiT, t_B: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    cfg = model.config
    e = model.time_mlp(pm.timestep_embedding(t_B, cfg.freq_dim).to(dtype))
    return e, model.time_proj(e).unflatten(1, (6, cfg.dim))


def lean_episode_loss(model: DiT, xt_v: Tensor, v_v: Tensor, xt_a: Tensor, v_a: Tensor,
                      t: Tensor, thw: Tensor, text: Tensor, denom_v: Tensor, denom_a: Tensor,
                      self_attn: Attention = backends.sdpa,
                      cross_attn: Attention = backends.sdpa) -> Tensor:  # fmt: skip
    """One episode, exact length, no mask: the step loss's share of this episode. The
    attention defaults to SDPA's default dispatch; the bench passes the probe's choice."""
    cfg = model.config
    x_v = model.patch_embed(xt_v)
    x = torch.cat([x_v, model.action_embed(xt_a)])[None]
    angles = rope_angles(thw, cfg.head_dim, cfg.rope_theta)[None]
    e, e0 = _conditioning(model, t, x.dtype)
    ctx = model.text_mlp(model.text_embed(text))[None]
    for blk in model.blocks:
        x = block_fn(blk, x, e0, ctx, angles, self_attn, None, cross_attn, None)
    shift, scale = (model.head_modulation + e[:, None]).unbind(1)
    x = model.head_norm(x[0]) * (1 + scale) + shift
    n_v = xt_v.shape[0]
    err_v = (model.video_head(x[:n_v]).float() - v_v.float()).pow(2).mean(-1)
    err_a = (model.action_head(x[n_v:]).float() - v_a.float()).pow(2).mean(-1)
    return err_v.sum() / denom_v + err_a.sum() / denom_a


def bucket_batch_loss(model: DiT, xt_v: Tensor, v_v: Tensor, xt_a: Tensor, v_a: Tensor,
                      t_B: Tensor, thw_BL3: Tensor, text_BL: Tensor, src_BL: Tensor,
                      gather_N: Tensor, n_v: Tensor, text_keep: Tensor, self_attn: Attention,
                      self_mask: Any, denom_v: Tensor, denom_a: Tensor,
                      cross_attn: Attention = sdpa_masked) -> Tensor:  # fmt: skip
    """A ``(B, L)`` bucket batch: rows gathered from the flat video + action tokens by
    ``src_BL`` (padding points at a zero row), padded keys masked by ``self_mask``."""
    cfg = model.config
    b, n = src_BL.shape
    x_flat = torch.cat([model.patch_embed(xt_v), model.action_embed(xt_a)])
    x_flat = torch.cat([x_flat, x_flat.new_zeros(1, cfg.dim)])
    x = x_flat[src_BL.flatten()].unflatten(0, (b, n))
    angles = rope_angles(thw_BL3.flatten(0, 1), cfg.head_dim, cfg.rope_theta).unflatten(0, (b, n))
    e, e0 = _conditioning(model, t_B, x.dtype)
    ctx = model.text_mlp(model.text_embed(text_BL))
    for blk in model.blocks:
        x = block_fn(blk, x, e0, ctx, angles, self_attn, self_mask, cross_attn, text_keep)
    shift, scale = (model.head_modulation + e[:, None]).unbind(1)
    x = model.head_norm(x) * (1 + scale[:, None]) + shift[:, None]
    # back to the flat token order: real slots only, video first then actions (``n_v`` is
    # an empty (T_v, 0) tensor: the count as a shape, which dynamic=True traces as a symbol)
    x_real = x.flatten(0, 1)[gather_N]
    err_v = (model.video_head(x_real[: n_v.shape[0]]).float() - v_v.float()).pow(2).mean(-1)
    err_a = (model.action_head(x_real[n_v.shape[0] :]).float() - v_a.float()).pow(2).mean(-1)
    return err_v.sum() / denom_v + err_a.sum() / denom_a


# -- bucketing ------------------------------------------------------------------------------------
def bucket_bounds(tmin: int, tmax: int, buckets: int, multiple: int) -> list[int]:
    """``buckets`` joint-token lengths spanning [tmin, tmax], each a multiple of ``multiple``
    (tokens a frame: buckets are frame counts, as Open-Sora's; a cropped row then fills its
    bucket exactly): ``bucket_bounds(4752, 11088, 4, 33)`` -> ``[6336, 7920, 9504, 11088]``."""
    span = (tmax - tmin) / buckets
    up = [-(-int(tmin + span * (i + 1)) // multiple) * multiple for i in range(buckets)]
    return sorted(set(up))


def crop_bounds(tmin: int, tmax: int, buckets: int, multiple: int) -> list[int]:
    """The lower edges for ``crop``: every episode >= ``tmin`` is cut down to one of them
    (``crop_bounds(4752, 11088, 4, 33)`` -> ``[4752, 6336, 7920, 9504]``)."""
    return sorted(
        {-(-tmin // multiple) * multiple, *bucket_bounds(tmin, tmax, buckets, multiple)[:-1]}
    )


def bounds_for(mode: str, tmin: int, tmax: int, buckets: int, multiple: int) -> list[int]:
    """Upper edges to pad up to (``pad``) or lower edges to crop down to (``crop``)."""
    pick = crop_bounds if mode == "crop" else bucket_bounds
    return pick(tmin, tmax, buckets, multiple)


PAD_ALIGN = 16  # padded bucket rows are a multiple of this many tokens


@dataclass
class BucketBatch:
    args: tuple[Tensor, ...]  # the tensors of bucket_batch_loss, in order, up to self_attn
    lengths_B: Tensor
    L: int
    real_tokens: int
    slots: int
    cropped_tokens: int
    row_shapes: list[EpisodeShape]  # each row's real (video, action, text) tokens: useful FLOPs
    weight: float = 1.0  # 0: a copy that only keeps the ranks' micro-step counts equal


def bucket_step(inputs: list[EpisodeInputs], bounds: list[int], token_target: int,
                mode: str, text_len: int, dev: torch.device,
                min_batches: int = 0) -> list[BucketBatch]:  # fmt: skip
    """The step's episodes as bucket batches: ``pad`` (up to the bucket above) or ``crop``
    (the video cut to the bucket below, actions kept in proportion); batch size per bucket
    ``max(1, token_target // L)`` (Open-Sora's equal-time rule, by tokens).

    ``min_batches``: under FSDP every rank must run as many micro-steps as the others (each
    one all-gathers every block): the batch with most rows is halved until there are that
    many, and if every batch has one row, copies of the last one train with weight 0."""
    groups: dict[int, list[tuple[EpisodeInputs, int]]] = {}
    for ep in inputs:
        n = ep.tokens
        if mode == "pad":
            L = next(b for b in bounds if b >= n)
            keep = n
        elif mode == "crop":
            below = [b for b in bounds if b <= n]
            L = below[-1] if below else n  # shorter than every bucket: its own length
            keep = L
        else:
            raise ValueError(f"mode={mode!r}; choose 'pad' or 'crop'")
        groups.setdefault(L, []).append((ep, keep))
    chunks: list[tuple[int, list[tuple[EpisodeInputs, int]]]] = []
    for L in sorted(groups):
        rows = max(1, token_target // L)
        items = groups[L]
        # padded rows: the row length rounded up to the masked kernels' alignment (SDPA's
        # memory-efficient kernel wants the mask's last dim a multiple of 16); cropped rows
        # are exact (no mask, flash needs no alignment)
        slots = -(-L // PAD_ALIGN) * PAD_ALIGN if mode == "pad" else L
        chunks += [(slots, items[lo : lo + rows]) for lo in range(0, len(items), rows)]
    while len(chunks) < min_batches and chunks and max(len(c) for _, c in chunks) > 1:
        i = max(range(len(chunks)), key=lambda j: (len(chunks[j][1]), -j))
        L, items = chunks[i]
        chunks[i : i + 1] = [(L, items[: len(items) // 2]), (L, items[len(items) // 2 :])]
    out = [_bucket_batch(items, L, text_len, dev) for L, items in chunks]
    while out and len(out) < min_batches:
        out.append(dataclasses.replace(out[-1], weight=0.0))
    return out


def _crop(ep: EpisodeInputs, keep: int) -> EpisodeInputs:
    """The episode's first ``keep`` joint tokens' worth: video and actions cut in proportion,
    the video to whole frames (the positions say which frame a token is in)."""
    n_v, n_a = ep.xt_v.shape[0], ep.xt_a.shape[0]
    if keep >= n_v + n_a:
        return ep
    frames = int(ep.thw[n_v - 1, 0]) + 1
    per_frame = n_v // frames
    per_frame_a = n_a / frames
    f = max(1, int(keep // (per_frame + per_frame_a)))
    kv, ka = f * per_frame, int(f * per_frame_a)
    thw = torch.cat([ep.thw[:kv], ep.thw[n_v : n_v + ka]])
    return EpisodeInputs(ep.xt_v[:kv], ep.v_v[:kv], ep.xt_a[:ka], ep.v_a[:ka], ep.t, thw, ep.text)


def _bucket_batch(items: list[tuple[EpisodeInputs, int]], L: int, text_len: int,
                  dev: torch.device) -> BucketBatch:  # fmt: skip
    eps = [_crop(ep, keep) for ep, keep in items]
    n_v = [e.xt_v.shape[0] for e in eps]
    n_a = [e.xt_a.shape[0] for e in eps]
    total_v, total_a = sum(n_v), sum(n_a)
    pad_src = total_v + total_a  # the zero row
    src = torch.full((len(eps), L), pad_src, dtype=torch.int64)
    thw = torch.zeros(len(eps), L, 3, dtype=torch.int64)
    order_v, order_a = [], []  # flat slot of each real video / action token, in flat order
    ov = oa = 0
    for r, e in enumerate(eps):
        j = n_v[r] + n_a[r]
        src[r, : n_v[r]] = torch.arange(ov, ov + n_v[r])
        src[r, n_v[r] : j] = torch.arange(total_v + oa, total_v + oa + n_a[r])
        thw[r, :j] = e.thw.cpu()
        order_v += range(r * L, r * L + n_v[r])
        order_a += range(r * L + n_v[r], r * L + j)
        ov, oa = ov + n_v[r], oa + n_a[r]
    # a bool mask would read the real slots row-major, video and actions interleaved by
    # row; the loss wants all video first: gather with an explicit order
    gather = torch.tensor(order_v + order_a, dtype=torch.int64)
    text = torch.zeros(len(eps), text_len, dtype=torch.int64)
    keep = torch.zeros(len(eps), 1, 1, text_len, dtype=torch.bool)
    for r, e in enumerate(eps):
        m = e.text.shape[0]
        text[r, :m] = e.text.cpu()
        keep[r, ..., :m] = True
    args = (
        torch.cat([e.xt_v for e in eps]), torch.cat([e.v_v for e in eps]),
        torch.cat([e.xt_a for e in eps]), torch.cat([e.v_a for e in eps]),
        torch.cat([e.t for e in eps]), thw.to(dev), text.to(dev), src.to(dev),
        gather.to(dev), torch.empty(total_v, 0, device=dev), keep.to(dev),
    )  # fmt: skip
    original = sum(ep.tokens for ep, _ in items)
    real_tokens = total_v + total_a
    return BucketBatch(
        args=args,
        lengths_B=torch.tensor([a + b for a, b in zip(n_v, n_a, strict=True)], device=dev),
        L=L,
        real_tokens=real_tokens,
        slots=len(eps) * L,
        cropped_tokens=original - real_tokens,
        row_shapes=[
            EpisodeShape(a, b, e.text.shape[0]) for a, b, e in zip(n_v, n_a, eps, strict=True)
        ],
    )


def opensora_steps(inputs: list[EpisodeInputs], bounds: list[int], token_target: int,
                   text_len: int, dev: torch.device, seed: int) -> tuple[list[BucketBatch], int]:  # fmt: skip
    """Open-Sora's bucket sampler: one bucket a step. Each episode goes to the bucket above
    its length (padded, key-masked); every bucket has ONE row count, ``token_target // L``,
    so a run has at most ``len(bounds)`` shapes; each full batch is one optimizer step, the
    steps in a seeded shuffled order; a bucket's last partial batch waits for the next epoch
    (their episode count is returned, not trained)::

        bucket L=192, 3 rows: [e1 e4 e7] [e9 e2 e5] (e8 deferred)   -> 2 steps
        bucket L=320, 1 row:  [e3] [e6]                             -> 2 steps
    """
    import random

    groups: dict[int, list[EpisodeInputs]] = {}
    for ep in inputs:
        groups.setdefault(next(b for b in bounds if b >= ep.tokens), []).append(ep)
    batches, deferred = [], 0
    for L in sorted(groups):
        rows = opensora_rows(L, token_target)
        items = groups[L]
        full = len(items) // rows * rows
        deferred += len(items) - full
        slots = -(-L // PAD_ALIGN) * PAD_ALIGN
        batches += [
            _bucket_batch([(ep, ep.tokens) for ep in items[lo : lo + rows]], slots, text_len, dev)
            for lo in range(0, full, rows)
        ]
    random.Random(seed).shuffle(batches)
    return batches, deferred


def opensora_rows(L: int, token_target: int) -> int:
    """Open-Sora's rows for a bucket: its row count at the token target (padded length)."""
    return max(1, token_target // (-(-L // PAD_ALIGN) * PAD_ALIGN))
