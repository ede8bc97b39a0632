"""FLOPs of the reference DiT, from its own shapes: the one count every benchmark uses.

What is counted: every matmul the model runs on real tokens (linear layers, attention's two
products), nothing elementwise. Per episode of ``v`` video, ``a`` action and ``n`` text tokens
(``j = v + a`` joint tokens, width ``d``, FFN ``f``, patch features ``P``)::

    embed      2·v·P·d + 2·a·A·d                   patch and action embeddings
    text       2·n·2d²                             the text MLP, on the n text tokens
    time       2·(freq·d + d² + 6d²)               the timestep MLP, once per episode
    per block  2·j·(3d² + d² + d² + d² + 2df)      qkv, out, cross q, cross out, FFN
               2·n·2d²                             cross-attention K/V: on the TEXT tokens only
               4·pairs·d + 4·j·n·d                 self-attention (pairs = j², or fewer under
                                                   a frame-causal mask), cross-attention
    head       2·v·d·P + 2·a·d·A

Backward: a linear layer costs 2× its forward (input and weight gradients), except where its
input needs no gradient (the embeddings of the data and of the timestep: weight gradient
only). Attention is counted at the **model-FLOPs convention**, fwd+bwd = 3× the forward, the
way MFU is defined; the **hardware count**, 3.5× (a fused kernel's backward recomputes the
scores, as ``torch.utils.flop_counter`` counts it), is reported beside it. The old count this
replaces charged the cross-attention K/V projection to every joint token and counted
attention at 3.5×: 1.09–1.14× too high at Wan-2.2-5B widths.

MFU names its peak: ``MEASURED_PEAK_TFLOPS`` (bf16 matmul on random data on this workplace's
H200) and ``DATASHEET_PEAK_TFLOPS`` (the H200's dense bf16 datasheet figure).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MEASURED_PEAK_TFLOPS = 790.0
DATASHEET_PEAK_TFLOPS = 989.0
PEAKS = {"measured 790": MEASURED_PEAK_TFLOPS, "datasheet 989": DATASHEET_PEAK_TFLOPS}


@dataclass(frozen=True)
class EpisodeShape:
    """One episode as the model sees it: token counts per stream, and the fraction of the
    ``joint²`` self-attention pairs its mask keeps (1.0 for the document mask)."""

    video: int
    action: int
    text: int
    pairs_fraction: float = 1.0

    @property
    def joint(self) -> int:
        return self.video + self.action


@dataclass(frozen=True)
class Flops:
    """A count split the way MFU needs it. ``model`` = dense + attention at 3× (the MFU
    numerator); ``hardware`` = dense + attention at 3.5× (what the kernels execute)."""

    dense: float
    attention: float
    attention_hardware: float

    @property
    def model(self) -> float:
        return self.dense + self.attention

    @property
    def hardware(self) -> float:
        return self.dense + self.attention_hardware

    def __add__(self, other: Flops) -> Flops:
        return Flops(
            self.dense + other.dense,
            self.attention + other.attention,
            self.attention_hardware + other.attention_hardware,
        )

    def scaled(self, k: float) -> Flops:
        return Flops(self.dense * k, self.attention * k, self.attention_hardware * k)


ZERO = Flops(0.0, 0.0, 0.0)


def attention_flops(
    lengths_q: Sequence[int],
    lengths_k: Sequence[int] | None = None,
    *,
    heads: int,
    head_dim: int,
    causal_fraction: Sequence[float] | None = None,
    backward: bool = False,
    convention: str = "hardware",
) -> float:
    """FLOPs of attention over in-episode (q, k) pairs only: forward ``4·pairs·D·H`` (QKᵀ
    and PV); with ``backward``, 3× that (``convention="model"``) or 3.5× (``"hardware"``:
    the backward's 5 matmuls, one of them recomputing QKᵀ). ``causal_fraction[k]`` scales an
    episode's pairs when its mask keeps only part of them (frame-causal ~1/2 + 1/(2F))."""
    lk = lengths_q if lengths_k is None else lengths_k
    frac = causal_fraction or [1.0] * len(lengths_q)
    pairs = sum(q * k * f for q, k, f in zip(lengths_q, lk, frac, strict=True))
    return pair_flops(pairs, heads=heads, head_dim=head_dim, backward=backward,
                      convention=convention)  # fmt: skip


def pair_flops(
    pairs: float, *, heads: int, head_dim: int, backward: bool, convention: str = "hardware"
) -> float:
    """FLOPs of attention over ``pairs`` (q, k) pairs: see `attention_flops`."""
    if convention not in ("model", "hardware"):
        raise ValueError(f"convention={convention!r}; use 'model' (3x) or 'hardware' (3.5x)")
    fwd = 4.0 * pairs * head_dim * heads
    if not backward:
        return fwd
    return fwd * (3.0 if convention == "model" else 3.5)


def dit_flops(
    cfg: Any,
    episodes: Iterable[EpisodeShape | tuple[int, int, int]],
    *,
    backward: bool = True,
    blocks: int | None = None,
    outside_blocks: bool = True,
    per_token_conditioning: bool = False,
) -> Flops:
    """FLOPs of the reference DiT (`packing.model.DiTConfig` ``cfg``) over ``episodes``.

    ``episodes`` are `EpisodeShape` or ``(video, action, text)`` token counts, real tokens
    only (padding is work, not useful work). ``backward=False`` counts one forward (serving).
    ``blocks`` overrides ``cfg.depth`` and ``outside_blocks=False`` drops the embeddings, text
    and timestep MLPs and the heads (for a checkpointing recompute, which re-runs blocks only).
    ``per_token_conditioning`` runs the timestep MLP on every token (the slow variant).
    """
    d, f, p, na = cfg.dim, cfg.ffn_dim, cfg.patch_features, cfg.action_dim
    depth = cfg.depth if blocks is None else blocks
    lin, lin_in = (3.0, 2.0) if backward else (1.0, 1.0)  # fwd+bwd multipliers
    att_m, att_h = (3.0, 3.5) if backward else (1.0, 1.0)
    total = ZERO
    for ep in episodes:
        e = ep if isinstance(ep, EpisodeShape) else EpisodeShape(*ep)
        j, n = e.joint, e.text
        block_dense = 2.0 * j * (6 * d * d + 2 * d * f) + 2.0 * n * 2 * d * d
        block_attn = 4.0 * d * (j * j * e.pairs_fraction + j * n)
        dense = depth * block_dense * lin
        if outside_blocks:
            rows = j if per_token_conditioning else 1
            dense += lin_in * 2.0 * (e.video * p * d + e.action * na * d)  # data embeddings
            dense += lin_in * 2.0 * rows * cfg.freq_dim * d  # first timestep linear
            dense += lin * 2.0 * rows * 7 * d * d  # second timestep linear + its 6d projection
            dense += lin * 2.0 * n * 2 * d * d  # text MLP (its input, the embedding, has a grad)
            dense += lin * 2.0 * (e.video * d * p + e.action * d * na)  # the two heads
        total = total + Flops(dense, depth * block_attn * att_m, depth * block_attn * att_h)
    return total


def mfu(flops: Flops | float, seconds: float, *, gpus: int = 1) -> dict[str, float]:
    """MFU against both peaks, keyed by the peak's name: ``{"MFU of measured 790": ...,
    "MFU of datasheet 989": ...}``; a `Flops` gives its model count."""
    n = flops.model if isinstance(flops, Flops) else float(flops)
    if seconds <= 0:
        return {f"MFU of {k}": 0.0 for k in PEAKS}
    return {f"MFU of {k}": n / seconds / (peak * 1e12 * gpus) for k, peak in PEAKS.items()}


def tflops(flops: float, ms: float) -> float:
    """Achieved TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else 0.0


@dataclass(frozen=True)
class LingbotEpisode:
    """One LingBot-VA episode as its dual-stream transformer sees it: ``frames`` latent
    frames of ``tokens_per_frame`` tokens (32 at 8x16 with 2x2 patches) and
    ``actions_per_frame`` action tokens, each stream twice (noisy and clean copies), ``text``
    UMT5 rows (LeRobot's 512), and the (q, k) pairs its training mask keeps."""

    frames: int
    tokens_per_frame: int
    pairs: float
    actions_per_frame: int = 4
    text: int = 512

    @property
    def latent(self) -> int:  # one copy
        return self.frames * self.tokens_per_frame

    @property
    def action(self) -> int:  # one copy
        return self.frames * self.actions_per_frame

    @property
    def joint(self) -> int:  # both copies of both streams
        return 2 * (self.latent + self.action)


def lingbot_flops(
    cfg: Any,
    episodes: Iterable[LingbotEpisode],
    *,
    backward: bool = True,
    blocks: int | None = None,
    per_token_conditioning: bool = False,
) -> Flops:
    """FLOPs of LeRobot's LingBot-VA ``WanTransformer3DModel`` (``cfg``: its config, a mapping
    or attributes) over ``episodes``; the same convention as `dit_flops`. Per episode of
    ``j`` joint tokens (both copies), ``n`` text rows, width ``d``, FFN ``f``, patch features
    ``P`` (in_channels x 4), action width ``A``, timestep rows ``r``::

        embed      2·(2·lat)·P·d + 2·(2·act)·A·d        patch and action embeddings (weight grad)
        text       2·n·(text_dim·d + d²)                 PixArt projection (first: weight grad)
        time       2·r·(freq·d + d² + 6d²)               r = 4F (a row per copy, stream, frame);
                                                         r = j with ``per_token_conditioning``
                                                         (what LeRobot's forward_train runs)
        per block  2·j·(6d² + 2df) + 2·n·2d²             self qkvo, cross q/out, FFN; cross K/V
                   4·pairs·d + 4·j·n·d                   self-attention under the mask, cross
        head       2·lat·d·P + 2·act·d·A                 noisy copies only
    """
    get = cfg.__getitem__ if hasattr(cfg, "__getitem__") else lambda k: getattr(cfg, k)
    d = get("num_attention_heads") * get("attention_head_dim")
    f, a, td, fq = get("ffn_dim"), get("action_dim"), get("text_dim"), get("freq_dim")
    pt, ph, pw = get("patch_size")
    p = get("in_channels") * pt * ph * pw
    depth = get("num_layers") if blocks is None else blocks
    lin, lin_in = (3.0, 2.0) if backward else (1.0, 1.0)
    att_m, att_h = (3.0, 3.5) if backward else (1.0, 1.0)
    total = ZERO
    for e in episodes:
        j, n = e.joint, e.text
        rows = j if per_token_conditioning else 4 * e.frames
        dense = depth * lin * (2.0 * j * (6 * d * d + 2 * d * f) + 2.0 * n * 2 * d * d)
        dense += lin_in * 2.0 * (2 * e.latent * p * d + 2 * e.action * a * d)
        dense += lin_in * 2.0 * n * td * d + lin * 2.0 * n * d * d
        dense += lin_in * 2.0 * rows * fq * d + lin * 2.0 * rows * 7 * d * d
        dense += lin * 2.0 * (e.latent * d * p + e.action * d * a)
        attn = depth * 4.0 * d * (e.pairs + j * n)
        total = total + Flops(dense, attn * att_m, attn * att_h)
    return total
