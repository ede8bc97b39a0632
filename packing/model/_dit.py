"""A small, readable Wan-like video-action DiT that trains on packed batches.

Per episode: latents ``(F, C, H, W)`` and actions ``(A, action_dim)``, with its task text.
Packed, episodes [0, 1] of 2 and 1 latent frames (grid 4x8 = 32 tokens a frame) and 3 and 2
actions become ONE joint self-attention sequence, each episode's video then its actions::

    latents  (S, C, H, W) --patchify (1,2,2)--> video tokens  v0 x64 | v1 x32 | pad
    action   (S_a, 14)    --linear-->           action tokens a0 x3  | a1 x2  | pad
    joint                                       v0.. a0.. | v1.. a1.. | pads   (J tokens)
    self-attention  document mask (+ frame-causal option) over the joint sequence
    cross-attention joint tokens of episode k -> text tokens of episode k (q != kv layouts)
    adaLN           timestep MLP on K rows, gathered to the J tokens by doc id

Nothing mixes episodes outside attention: norms are per token, the timestep MLP runs once
per episode and is gathered (running it per token cost a quarter of the step in our
measurement), noise and timesteps come from `packing.train._conditioning` keyed by
``(seed, step, episode_index)``, and RoPE uses doc-local (t, h, w) positions.

The model protocol (`packing verify`): ``forward(batch)`` returns the per-token flow-matching
loss of each predicted stream, ``{"latents": (T_v,), "action": (T_a,)}`` in fp32, exactly 0
on padding, unreduced; ``predict(batch)`` returns the per-token velocity predictions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from einops import rearrange
from torch import Tensor, nn

from packing._validate import check_bool, check_int, check_int_tuple, check_real, check_sequence
from packing.attention import (
    AttentionMask,
    Backend,
    frame_causal,
    packed_attention,
    prepare_attention,
)
from packing.data import (
    PackedBatch,
    PackedCollator,
    Stream,
    StreamLayout,
    joint_layout,
    layout_from_lengths,
)
from packing.model._rope import apply_rope, rope_angles, rope_split
from packing.train import (
    batch_rng_keys,
    broadcast_to_tokens,
    episode_timesteps,
    flow_matching_inputs,
    packed_noise,
    step_doc_ids,
)

__all__ = [
    "BOS",
    "DiT",
    "DiTConfig",
    "KVCache",
    "PackInputs",
    "pack_text",
    "param_count",
    "text_tokens",
    "tiny_reference_model",
]

BOS = 256  # byte-level text: 256 byte values, then one begin-of-text token


# -- configuration -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class DiTConfig:
    """Sizes and options of the reference DiT (plain data, validated here).

    ``patch`` is (t, h, w); the temporal patch must be 1 because the collate lays one latent
    frame out as one step of ``grid = latent_hw / patch[1:]`` tokens. ``text_len`` caps the
    byte-level task text (BOS included). ``document_mask=False`` drops the document term from
    every attention mask: a deliberately broken model that `packing verify` must catch.

    ``frame_causal=True`` applies ``packing.attention._masks.frame_causal(tokens_per_frame)`` to the joint
    sequence, whose episodes hold their video tokens first and their actions after them. So a
    video token of frame f sees the episode's frames <= f (and no action); the actions see
    all of the episode's video, and the actions of their own and earlier chunks of
    ``tokens_per_frame`` actions. Cross-attention to the text stays document-only.

    ``conditioning="per_token"`` runs the timestep MLP on every token instead of once per
    episode: the same function, far more work (the mistake the benchmarks price; `packing
    verify` passes it, because it is slow, not wrong).
    """

    dim: int
    heads: int
    depth: int
    ffn_dim: int
    latent_channels: int = 48
    patch: tuple[int, int, int] = (1, 2, 2)
    latent_hw: tuple[int, int] = (8, 16)
    action_dim: int = 14
    text_len: int = 64
    vocab: int = BOS + 1
    freq_dim: int = 256
    frame_causal: bool = False
    document_mask: bool = True
    conditioning: Literal["per_episode", "per_token"] = "per_episode"
    attention: Backend = "auto"
    rope_theta: float = 10000.0
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("dim", "heads", "depth", "ffn_dim", "latent_channels", "action_dim"):
            check_int(f"DiTConfig.{name}", getattr(self, name), min=1)
        for name in ("text_len", "vocab", "freq_dim"):
            check_int(f"DiTConfig.{name}", getattr(self, name), min=1)
        object.__setattr__(self, "patch", check_int_tuple("DiTConfig.patch", self.patch, length=3))
        object.__setattr__(
            self, "latent_hw", check_int_tuple("DiTConfig.latent_hw", self.latent_hw, length=2)
        )
        for name in ("frame_causal", "document_mask"):
            check_bool(f"DiTConfig.{name}", getattr(self, name))
        check_real("DiTConfig.rope_theta", self.rope_theta, above=0)
        check_real("DiTConfig.eps", self.eps, above=0)
        if self.dim % self.heads:
            raise ValueError(
                f"DiTConfig: dim={self.dim} is not divisible by heads={self.heads}; pick heads "
                f"that divide dim (head dim 128 is what the fast kernels like)"
            )
        rope_split(self.head_dim)  # raises for an odd or tiny head dim
        pt, ph, pw = self.patch
        if pt != 1:
            raise ValueError(
                f"DiTConfig.patch={self.patch}: temporal patch {pt} is not supported; the "
                "collate lays one latent frame out as one step, so use patch=(1, ph, pw)"
            )
        h, w = self.latent_hw
        if h % ph or w % pw:
            raise ValueError(
                f"DiTConfig.latent_hw={self.latent_hw} is not divisible by the patch "
                f"{self.patch[1:]}; pad the latents or change the patch"
            )
        if self.text_len < 1 or self.vocab <= BOS:
            raise ValueError(f"text_len={self.text_len} must be >= 1 and vocab > {BOS}")
        if self.conditioning not in ("per_episode", "per_token"):
            raise ValueError(
                f"DiTConfig.conditioning={self.conditioning!r}; use 'per_episode' (the MLP on K "
                "rows, gathered to tokens) or 'per_token' (the slow equivalent)"
            )
        if self.attention not in ("auto", "sdpa", "flex", "flex_flash", "varlen"):
            raise ValueError(f"DiTConfig.attention={self.attention!r} is not a backend")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def grid(self) -> tuple[int, int]:
        """Tokens of one latent frame, (h, w): (8, 16) latents with 2x2 patches -> (4, 8)."""
        return self.latent_hw[0] // self.patch[1], self.latent_hw[1] // self.patch[2]

    @property
    def tokens_per_frame(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def patch_features(self) -> int:
        return self.latent_channels * self.patch[0] * self.patch[1] * self.patch[2]

    @classmethod
    def tiny(cls, **overrides: Any) -> DiTConfig:
        """CPU tests and ``packing verify``: 2 blocks of width 64, 4 heads of 16."""
        base: dict[str, Any] = dict(dim=64, heads=4, depth=2, ffn_dim=128, freq_dim=64)
        return cls(**{**base, **overrides})

    @classmethod
    def wan_1_3b(cls, depth: int = 30, **overrides: Any) -> DiTConfig:
        """Wan-2.1-1.3B widths: dim 1536, 12 heads of 128, FFN 8960."""
        return cls(**{**dict(dim=1536, heads=12, depth=depth, ffn_dim=8960), **overrides})

    @classmethod
    def wan_2_2_5b(cls, depth: int = 30, **overrides: Any) -> DiTConfig:
        """Wan-2.2-5B widths: dim 3072, 24 heads of 128, FFN 14336."""
        return cls(**{**dict(dim=3072, heads=24, depth=depth, ffn_dim=14336), **overrides})

    def streams(self) -> list[Stream]:
        """The streams the model reads, primary first, for `PackedCollator`."""
        c, (h, w) = self.latent_channels, self.latent_hw
        return [
            Stream("latents", grid=self.grid, step_shape=(c, h, w)),
            Stream("action", step_shape=(self.action_dim,)),
        ]


def _h2d(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor to ``device`` without a host-device sync (``non_blocking``: a pageable
    source is staged by the driver, so it is safe to free right after); a no-op when it is
    there already. A blocking copy would make the CPU wait for the GPU's queue every step."""
    return t.to(device, non_blocking=True)


# -- text ----------------------------------------------------------------------------------------


def text_tokens(task: str, text_len: int = 64) -> Tensor:
    """Deterministic byte-level tokens of a task string: ``[BOS, utf-8 bytes...]``, int64.

    ``text_tokens("open", 8) == tensor([256, 111, 112, 101, 110])``; truncated to ``text_len``
    tokens, never empty (an empty task is ``[BOS]``), so every episode has a text document.
    """
    if not isinstance(task, str):
        raise TypeError(f"task={task!r} must be a str (the episode's task text)")
    check_int("text_len", text_len, min=1)
    data = task.encode("utf-8")[: max(text_len - 1, 0)]
    return torch.tensor([BOS, *data], dtype=torch.int64)[:text_len]


def pack_text(
    tasks: list[str], text_len: int = 64, pad_to_multiple: int = 64
) -> tuple[Tensor, StreamLayout]:
    """Pack the K episodes' task texts as a stream: tokens ``(T_txt,)`` and their layout.

    A ``"text"`` stream of ``text_tokens`` through `PackedCollator` with ``pad_to_multiple``
    (padding tokens are 0; no task gives one all-padding block). Host work only.
    """
    tasks = check_sequence("tasks", tasks, of=str)
    text = Stream("text", step_shape=(), dtype=torch.int64)
    collate = PackedCollator([text], pad_to_multiple=pad_to_multiple)
    batch = collate([{"text": text_tokens(t, text_len)} for t in tasks])
    return batch.streams["text"], batch.layout("text")


def _one_document(lay: StreamLayout) -> StreamLayout:
    """All real tokens of a pack as ONE document: the broken mask of ``document_mask=False``."""
    n = lay.num_tokens
    return layout_from_lengths([n] if n else [], [n] if n else [], lay.padded_len).to(
        lay.doc_ids_T.device
    )


# -- blocks --------------------------------------------------------------------------------------
class KVCache(NamedTuple):
    """One layer's view of a key/value pool (`packing.serve`'s context cache): this pass's
    keys and values go to rows ``rows`` of ``k``/``v`` ``(N, H, D)``, then the queries attend
    over the rows ``keys`` names: ``k[:keys]`` for an int, ``k[keys]`` for an int64 index
    tensor (a window of the pool's pages gathered, these tokens' rows among them)::

        k      [ page 0 | page 1 | page 2 | ... | this pass's rows | ... ]
        keys   [ page 2 rows, page 0 rows, this pass's rows ]    (a window, gathered)
    """

    k: Tensor
    v: Tensor
    rows: Tensor
    keys: int | Tensor


# Outside torch.compile: an in-place write into a graph input is what a pool is, and a compiled
# graph would functionalise it (copy the whole pool back). The attention after it is compiled.
@torch.compiler.disable
def _store(cache: KVCache, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    cache.k.index_copy_(0, cache.rows, k.to(cache.k.dtype))
    cache.v.index_copy_(0, cache.rows, v.to(cache.v.dtype))
    if isinstance(cache.keys, Tensor):
        return cache.k.index_select(0, cache.keys), cache.v.index_select(0, cache.keys)
    return cache.k[: cache.keys], cache.v[: cache.keys]


class SelfAttention(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.norm_q = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.norm_k = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.out = nn.Linear(cfg.dim, cfg.dim)

    def forward(
        self, x: Tensor, angles: Tensor, mask: AttentionMask, cache: KVCache | None = None
    ) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = apply_rope(self.norm_q(q).unflatten(-1, (self.heads, -1)), angles)
        k = apply_rope(self.norm_k(k).unflatten(-1, (self.heads, -1)), angles)
        v = v.unflatten(-1, (self.heads, -1))
        if cache is not None:  # keys and values: the pool's, these tokens' written in first
            k, v = _store(cache, k, v)
        return self.out(packed_attention(q.to(v.dtype), k.to(v.dtype), v, mask).flatten(1))


class CrossAttention(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.kv = nn.Linear(cfg.dim, 2 * cfg.dim)
        self.norm_q = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.norm_k = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.out = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: Tensor, ctx: Tensor, mask: AttentionMask) -> Tensor:
        k, v = self.kv(ctx).chunk(2, dim=-1)
        q = self.norm_q(self.q(x)).unflatten(-1, (self.heads, -1))
        k = self.norm_k(k).unflatten(-1, (self.heads, -1))
        v = v.unflatten(-1, (self.heads, -1))
        return self.out(packed_attention(q.to(v.dtype), k.to(v.dtype), v, mask).flatten(1))


class Block(nn.Module):
    """Wan's block: adaLN self-attention, cross-attention to text, adaLN FFN (gated)."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.self_attn = SelfAttention(cfg)
        self.norm3 = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.cross_attn = CrossAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.dim, cfg.ffn_dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(cfg.ffn_dim, cfg.dim),
        )
        self.modulation = nn.Parameter(torch.randn(1, 6, cfg.dim) / cfg.dim**0.5)

    def forward(
        self,
        x: Tensor,
        e0_J6D: Tensor,
        ctx: Tensor,
        angles: Tensor,
        self_mask: AttentionMask,
        cross_mask: AttentionMask,
        cache: KVCache | None = None,
    ) -> Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation + e0_J6D).unbind(1)
        h = self.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * self.self_attn(h, angles, self_mask, cache)
        x = x + self.cross_attn(self.norm3(x), ctx, cross_mask)
        return x + gate2 * self.ffn(self.norm2(x) * (1 + scale2) + shift2)


def timestep_embedding(t_K: Tensor, dim: int) -> Tensor:
    """Sinusoidal embedding of ``1000 * t`` (Wan's scale), ``(K,) -> (K, dim)``, float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t_K.device) / half)
    args = 1000.0 * t_K.float()[:, None] * freqs
    return torch.cat([args.cos(), args.sin()], dim=-1)


# -- the model -----------------------------------------------------------------------------------
class DiT(nn.Module):
    """The reference packed video-action DiT (see the module docstring for the picture).

    ``model(batch)`` needs ``batch.extras["seed"]`` and ``["step"]`` (the optimizer step both
    the packed and the unpacked run agree on) and ``batch["episode_index"]``; the episodes'
    text comes from a ``"text"`` stream of `text_tokens` if the batch has one, else from
    ``batch["task"]`` through `pack_text`.
    """

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        cfg = config
        self.config = cfg
        self.streams = cfg.streams()
        self.patch_embed = nn.Linear(cfg.patch_features, cfg.dim)
        self.action_embed = nn.Linear(cfg.action_dim, cfg.dim)
        self.text_embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.text_mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.dim, cfg.dim)
        )
        self.time_mlp = nn.Sequential(
            nn.Linear(cfg.freq_dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim)
        )
        self.time_proj = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, 6 * cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.head_norm = nn.LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.head_modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)
        self.video_head = nn.Linear(cfg.dim, cfg.patch_features)
        self.action_head = nn.Linear(cfg.dim, cfg.action_dim)

    # -- layouts and inputs ------------------------------------------------------------------
    def patchify(self, x_SCHW: Tensor) -> Tensor:
        """``(S, C, H, W) -> (S * h * w, C * ph * pw)`` tokens in (t, h, w) row-major order."""
        _, ph, pw = self.config.patch
        return rearrange(x_SCHW, "s c (h ph) (w pw) -> (s h w) (c ph pw)", ph=ph, pw=pw)

    def unpatchify(self, x_TP: Tensor) -> Tensor:
        """Inverse of `patchify`: ``(S * h * w, C * ph * pw) -> (S, C, H, W)``."""
        _, ph, pw = self.config.patch
        gh, gw = self.config.grid
        return rearrange(x_TP, "(s h w) (c ph pw) -> s c (h ph) (w pw)", h=gh, w=gw, ph=ph, pw=pw)

    def _text(self, batch: PackedBatch, device: torch.device) -> tuple[Tensor, StreamLayout]:
        if "text" in batch.layouts:
            return _h2d(batch.streams["text"], device), batch.layout("text").to(
                device, non_blocking=True
            )
        k = batch.layout(batch.primary).num_docs
        if k == 0:  # an all-padding pack (a rank with no episode): no text either
            tokens, lay = pack_text([], self.config.text_len)
            return _h2d(tokens, device), lay.to(device, non_blocking=True)
        if "task" not in batch.per_episode:
            raise KeyError(
                "the DiT attends to each episode's task text: the batch has neither a 'text' "
                "stream (packing.model._dit.text_tokens per episode) nor per-episode 'task' strings"
            )
        tokens, lay = pack_text(list(batch.per_episode["task"])[:k], self.config.text_len)
        return _h2d(tokens, device), lay.to(device, non_blocking=True)

    def _inputs(self, batch: PackedBatch) -> dict[str, Any]:
        """Noised inputs, targets and per-episode times, all keyed by (seed, step, episode)."""
        seed, step = batch_rng_keys(batch)
        p = next(self.parameters())
        dev, dtype = p.device, p.dtype
        lat_lay, act_lay = batch.layout("latents"), batch.layout("action")
        k = lat_lay.num_docs
        # The RNG keys are host ints (batch.episode_ids survives .to(device)): no sync.
        ep_K = torch.tensor(batch.episode_ids, dtype=torch.int64)
        t_K = episode_timesteps(seed, step, ep_K, device=dev)
        lat = _h2d(batch.streams["latents"], dev).to(dtype)
        act = _h2d(batch.streams["action"], dev).to(dtype)
        n_lat = packed_noise(batch, seed=seed, step=step, stream="latents", dtype=dtype)
        n_act = packed_noise(batch, seed=seed, step=step, stream="action", dtype=dtype)
        if ep_K.numel() and len(set(ep_K.tolist())) != k:
            raise ValueError(
                f"episode_index {ep_K.tolist()} repeats inside one pack: both copies would draw "
                "the same noise; give each copy its own episode_index"
            )
        t_lat = broadcast_to_tokens(t_K, _h2d(step_doc_ids(lat_lay, lat.shape[0]), dev))
        t_act = broadcast_to_tokens(t_K, _h2d(act_lay.doc_ids_T, dev))
        xt_lat, v_lat = flow_matching_inputs(lat, _h2d(n_lat, dev), t_lat)
        xt_act, v_act = flow_matching_inputs(act, _h2d(n_act, dev), t_act)
        return dict(t_K=t_K, xt_lat=xt_lat, v_lat=v_lat, xt_act=xt_act, v_act=v_act)

    def _action_thw(self, batch: PackedBatch, dev: torch.device) -> Tensor:
        """Doc-local (t, h, w) of action tokens: t is the latent frame the action falls in
        (``a * F // A`` for action ``a`` of ``A``, episode of ``F`` frames); (h, w) is one
        past the grid's corner, a place no video token occupies."""
        lat_lay, act_lay = batch.layout("latents"), batch.layout("action")
        ids = _h2d(act_lay.doc_ids_T, dev)
        frames = _h2d(torch.tensor(lat_lay.steps_K, dtype=torch.int64), dev)
        actions = _h2d(torch.tensor(act_lay.steps_K, dtype=torch.int64).clamp_min(1), dev)
        pos = _h2d(act_lay.position_ids_T, dev).long()
        t = pos * broadcast_to_tokens(frames, ids) // broadcast_to_tokens(actions, ids, 1)
        gh, gw = self.config.grid
        hw = torch.tensor([gh, gw], dtype=torch.int64, device=dev).expand(t.shape[0], 2)
        return torch.cat([t[:, None], hw], dim=1)

    # -- forward -------------------------------------------------------------------------------
    @torch.compiler.disable
    def prepare(self, batch: PackedBatch) -> dict[str, Any]:
        """Everything host-side of a step, once: per-episode noise and timesteps, the joint
        layout, RoPE positions, text tokens and the two attention masks shared by all blocks.

        Kept out of ``torch.compile`` (it reads Python ints and seeds generators); what
        follows in `forward` is pure tensor work with static shapes.
        """
        cfg = self.config
        p = next(self.parameters())
        dev = p.device
        prep = self._inputs(batch)
        joint = joint_layout(batch, ("latents", "action"))
        if joint.layout.doc_ids_T.device != dev:
            joint = joint.to(dev, non_blocking=True)
        thw_v = batch.layout("latents").thw_T3
        if thw_v is None:
            raise ValueError("stream 'latents' must be a grid stream (Stream(grid=...))")
        thw_a = self._action_thw(batch, dev)
        prep["thw_J3"] = joint.join({"latents": _h2d(thw_v, dev).long(), "action": thw_a})
        prep["joint"] = joint
        txt, txt_lay = self._text(batch, dev)
        prep["text"] = txt
        # Masks: built once per step, shared by every block.
        q_lay = joint.layout if cfg.document_mask else _one_document(joint.layout)
        kv_lay = txt_lay if cfg.document_mask else _one_document(txt_lay)
        inner = frame_causal(cfg.tokens_per_frame) if cfg.frame_causal else None
        adt = _attention_dtype(p)
        hd = cfg.dim // cfg.heads  # lets `auto` skip kernels that do not take this head dim
        prep["self_mask"] = prepare_attention(
            q_lay, None, inner, cfg.attention, device=dev, dtype=adt, head_dim=hd
        )
        prep["cross_mask"] = prepare_attention(
            q_lay, kv_lay, None, cfg.attention, device=dev, dtype=adt, head_dim=hd
        )
        return prep

    def predict(self, batch: PackedBatch) -> dict[str, Tensor]:
        """Per-token velocity predictions ``{"latents": (T_v, C*ph*pw), "action": (T_a, A)}``."""
        return self._run(batch)[0]

    def forward(self, batch: PackedBatch) -> dict[str, Tensor]:
        """Per-token flow-matching losses (fp32, 0 on padding), unreduced."""
        pred, target = self._run(batch)
        out = {}
        for name in ("latents", "action"):
            err = (pred[name].float() - target[name].float()).pow(2).mean(-1)
            real = _h2d(batch.layout(name).doc_ids_T, err.device) >= 0
            out[name] = torch.where(real, err, 0.0)
        return out

    def _run(self, batch: PackedBatch) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        cfg = self.config
        prep = self.prepare(batch)
        joint = prep["joint"]
        # Conditioning: the timestep MLP runs on K rows, then is gathered to the J tokens
        # (per_token: the timestep is gathered first and the MLP runs on J rows, slower).
        ids_J = joint.layout.doc_ids_T
        t_rows = prep["t_K"]
        if cfg.conditioning == "per_token":
            t_rows = broadcast_to_tokens(t_rows, ids_J)
        # The dtype the patch embedding's output has (autocast's when on), as before.
        dtype = _attention_dtype(next(self.parameters()))
        e = self.time_mlp(timestep_embedding(t_rows, cfg.freq_dim).to(dtype))
        e0 = self.time_proj(e).unflatten(1, (6, cfg.dim))
        if cfg.conditioning == "per_token":
            e_J, e0_J = e, e0
        else:
            e_J, e0_J = broadcast_to_tokens(e, ids_J), broadcast_to_tokens(e0, ids_J)
        tokens = {"latents": self.patchify(prep["xt_lat"]), "action": prep["xt_act"]}
        pack = PackInputs(
            src_index_J=joint.src_index_J,
            latents_dest_T=joint.dest_index["latents"],
            action_dest_T=joint.dest_index["action"],
            thw_J3=prep["thw_J3"],
            text_X=prep["text"],
            self_mask=prep["self_mask"],
            cross_mask=prep["cross_mask"],
        )
        pred = self._denoise(tokens, e_J, e0_J, pack)
        target = {"latents": self.patchify(prep["v_lat"]), "action": prep["v_act"]}
        return pred, target

    def velocity(
        self,
        tokens: dict[str, Tensor],
        t_R: Tensor,
        row_J: Tensor,
        pack: PackInputs,
        cache: Sequence[KVCache] | None = None,
    ) -> dict[str, Tensor]:
        """The velocity of noisy tokens at per-token times: the inference entry point.

        ``tokens`` are token level, ``{"latents": (T_v, C*ph*pw), "action": (T_a, A)}`` (see
        `patchify`); ``t_R`` holds R flow-matching times (``t = 0`` data, ``1`` noise) and
        ``row_J`` names the row of ``t_R`` each joint token is conditioned on (-1: padding,
        conditioned on nothing, as in training). A pack of two requests at times 0.9 and 0.3
        whose clean context frames sit at ``t = 0``::

            t_R     [0.9, 0.3, 0.0]
            joint   c0 c0 g0 g0 a0 | c1 g1 a1 a1 | pad
            row_J    2  2  0  0  0 |  2  1  1  1 |  -1

        The timestep MLP runs on the R rows and is gathered to the tokens, so with
        ``row_J = doc ids`` and ``t_R = t_K`` this is exactly the training forward's
        prediction. Pure tensor work with shapes fixed by the pack's budget (no host-device
        sync): `packing.serve` captures it in a CUDA graph. Returns ``{"latents": (T_v,
        C*ph*pw), "action": (T_a, A)}`` in the model's dtype.

        ``cache`` (one `KVCache` per block): each block writes these tokens' keys and values
        into its pool and attends over the pool (``pack.self_mask`` is then a mask over the
        pool's keys): how `packing.serve`'s context cache prefills a context once and runs
        only the generated tokens at every step. ``None``: the keys are the pack's own.
        """
        cfg = self.config
        dtype = _attention_dtype(next(self.parameters()))
        e = self.time_mlp(timestep_embedding(t_R, cfg.freq_dim).to(dtype))
        e0 = self.time_proj(e).unflatten(1, (6, cfg.dim))
        e_J, e0_J = broadcast_to_tokens(e, row_J), broadcast_to_tokens(e0, row_J)
        if cache is not None and len(cache) != cfg.depth:
            raise ValueError(f"cache has {len(cache)} layers, the model {cfg.depth} blocks")
        return self._denoise(tokens, e_J, e0_J, pack, cache)

    def _denoise(
        self,
        tokens: dict[str, Tensor],
        e_J: Tensor,
        e0_J: Tensor,
        pack: PackInputs,
        cache: Sequence[KVCache] | None = None,
    ) -> dict[str, Tensor]:
        """The transformer on token-level inputs: joint sequence, blocks, the two heads."""
        cfg = self.config
        x_v = self.patch_embed(tokens["latents"])
        x_a = self.action_embed(tokens["action"])
        # The joint order is one gather (packing.data.JointLayout.join, unchecked).
        x = torch.cat([x_v, x_a], dim=0).index_select(0, pack.src_index_J)
        angles = rope_angles(pack.thw_J3, cfg.head_dim, cfg.rope_theta)
        ctx = self.text_mlp(self.text_embed(pack.text_X))
        for i, block in enumerate(self.blocks):
            layer = None if cache is None else cache[i]
            x = block(x, e0_J, ctx, angles, pack.self_mask, pack.cross_mask, layer)
        shift, scale = (self.head_modulation + e_J[:, None]).unbind(1)
        x = self.head_norm(x) * (1 + scale) + shift
        return {
            "latents": self.video_head(x.index_select(0, pack.latents_dest_T)),
            "action": self.action_head(x.index_select(0, pack.action_dest_T)),
        }


class PackInputs(NamedTuple):
    """What `DiT.velocity` needs about a pack besides the tokens, all device tensors.

    ``src_index_J`` puts ``cat(latent tokens, action tokens)`` into the joint order and the
    two ``*_dest_T`` take it back (`packing.data.JointLayout`); ``thw_J3`` are the joint
    tokens' (t, h, w) RoPE positions; ``text_X`` the packed text tokens; the masks come from
    `packing.attention.prepare_attention` or are built from doc ids inside a captured step.
    """

    src_index_J: Tensor
    latents_dest_T: Tensor
    action_dest_T: Tensor
    thw_J3: Tensor
    text_X: Tensor
    self_mask: AttentionMask
    cross_mask: AttentionMask


def _attention_dtype(p: Tensor) -> torch.dtype:
    """The dtype q/k/v will have: autocast's when it is on for the parameters' device."""
    kind = p.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return p.dtype


def tiny_reference_model(
    mask: str = "document",
    document_mask: bool = True,
    *,
    latent_shape: tuple[int, int, int] = (48, 8, 16),
    action_dim: int = 14,
) -> DiT:
    """The factory `packing verify` uses: ``DiTConfig.tiny()``, seeded weights.

    ``mask="frame-causal"`` turns on frame-causal self-attention; ``document_mask=False`` builds
    the deliberately leaking model of ``packing verify --no-document-mask``. ``latent_shape``
    ``(C, H, W)`` and ``action_dim`` size it to a dataset (verify reads them from the dataset's
    features); an odd ``H`` or ``W`` gets 1x1 patches instead of 2x2.
    """
    if mask not in ("document", "frame-causal"):
        raise ValueError(f"mask={mask!r}; choose 'document' or 'frame-causal'")
    c, h, w = latent_shape
    patch = (1, 2, 2) if h % 2 == 0 and w % 2 == 0 else (1, 1, 1)
    return DiT(
        DiTConfig.tiny(
            frame_causal=mask == "frame-causal",
            document_mask=document_mask,
            latent_channels=c,
            latent_hw=(h, w),
            patch=patch,
            action_dim=action_dim,
        )
    )


def param_count(cfg: DiTConfig) -> int:
    """Parameters of ``DiT(cfg)``, counted from the config alone (no allocation)."""
    if not isinstance(cfg, DiTConfig):
        raise TypeError(f"cfg must be a DiTConfig, got {type(cfg).__name__}")
    d, f, p = cfg.dim, cfg.ffn_dim, cfg.patch_features

    def lin(i: int, o: int) -> int:
        return i * o + o

    attn_self = lin(d, 3 * d) + 2 * d + lin(d, d)  # qkv, q/k RMSNorm weights, out
    attn_cross = lin(d, d) + lin(d, 2 * d) + 2 * d + lin(d, d)
    block = attn_self + attn_cross + 2 * d + lin(d, f) + lin(f, d) + 6 * d  # + norm3, modulation
    embed = lin(p, d) + lin(cfg.action_dim, d) + cfg.vocab * d + 2 * lin(d, d)
    time = lin(cfg.freq_dim, d) + lin(d, d) + lin(d, 6 * d)
    head = 2 * d + lin(d, p) + lin(d, cfg.action_dim)
    return embed + time + cfg.depth * block + head
