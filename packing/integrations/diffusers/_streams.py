"""Packed streams in and out of a diffusers video transformer's layout.

A diffusers video transformer reads one video ``(B, C, F, H, W)`` and patchifies it into
``F/pt * H/ph * W/pw`` tokens in (t, h, w) row-major order. Packed, the latents stay at step
level, one latent frame per step, the K episodes concatenated along the frame axis
(``batch["latents"]`` is ``(S, C, H, W)``); the tokens follow the same order::

    latents  (S, C, H, W)  frames  e0 e0 | e1 e1 e1 | pad
    tokens   (S*h*w, F)    e0 f0 (h,w row-major), e0 f1 ..., e1 f0 ..., pad     F = ph*pw*C

Feature order inside a token is ``(ph, pw, C)``: the order diffusers' Wan un-patchifies its
``proj_out`` features in, so `unpatchify` of the model's output tokens is its own layout.

Text-encoder outputs (umT5 embeddings ``(L_k, D_txt)``, each episode its own length L_k) are
packed as their own stream with their own layout; the cross-attention mask pairs latent
document k with text document k (`pack_text_embeddings`). Text padded by the tokenizer (LTX's
T5 prompts, 128 rows with an attention mask) keeps only its real rows (`drop_masked_rows`), so
no query can attend to a padded one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from einops import rearrange
from torch import Tensor

from packing._layout_math import padded_length
from packing._validate import check_int, check_int_tuple, check_optional_int, check_sequence
from packing.data import StreamLayout, layout_from_lengths

__all__ = ["drop_masked_rows", "pack_text_embeddings", "patchify", "unpatchify"]


def patchify(x_SCHW: Tensor, patch_hw: tuple[int, int]) -> Tensor:
    """``(S, C, H, W) -> (S * h * w, ph * pw * C)`` tokens in (t, h, w) order, features (ph, pw, C).

    Two frames of a ``(C=1, 2, 4)`` latent with 2x2 patches give ``2 * 1 * 2 = 4`` tokens of 4
    features: frame 0 left patch, frame 0 right patch, frame 1 left, frame 1 right.
    """
    ph, pw = check_int_tuple("patch_hw", patch_hw, length=2)
    if not isinstance(x_SCHW, Tensor) or x_SCHW.dim() != 4:
        raise ValueError(f"patchify takes latents x_SCHW (S, C, H, W), got {_shape(x_SCHW)}")
    if x_SCHW.shape[-2] % ph or x_SCHW.shape[-1] % pw:
        raise ValueError(
            f"latents of shape {tuple(x_SCHW.shape)} do not split into {ph}x{pw} patches; "
            "pad the latents to a multiple of the patch"
        )
    return rearrange(x_SCHW, "s c (h ph) (w pw) -> (s h w) (ph pw c)", ph=ph, pw=pw)


def unpatchify(tokens_TF: Tensor, patch_hw: tuple[int, int], grid: tuple[int, int]) -> Tensor:
    """The inverse of `patchify`: ``(S * h * w, ph * pw * C) -> (S, C, H, W)`` for ``grid=(h, w)``."""
    ph, pw = check_int_tuple("patch_hw", patch_hw, length=2)
    h, w = check_int_tuple("grid", grid, length=2)
    if not isinstance(tokens_TF, Tensor) or tokens_TF.dim() != 2:
        raise ValueError(f"unpatchify takes tokens_TF (T, F), got {_shape(tokens_TF)}")
    if tokens_TF.shape[0] % (h * w) or tokens_TF.shape[1] % (ph * pw):
        raise ValueError(
            f"tokens of shape {tuple(tokens_TF.shape)} are not whole frames of grid {(h, w)} "
            f"with {ph}x{pw} patches"
        )
    return rearrange(tokens_TF, "(s h w) (ph pw c) -> s c (h ph) (w pw)", h=h, w=w, ph=ph, pw=pw)


def pack_text_embeddings(
    embeddings: Sequence[Tensor], pad_to_multiple: int = 64, padded_len: int | None = None
) -> tuple[Tensor, StreamLayout]:
    """Pack K episodes' text embeddings ``(L_k, D)`` as one stream ``(T_txt, D)`` plus its layout.

    Lengths ``[3, 5]`` with ``pad_to_multiple=4`` -> 8 real rows padded to 8, doc ids
    ``[0 0 0 1 1 1 1 1]``; with ``[3, 6]`` -> padded to 12, 3 padding rows of zeros (doc -1).
    The same result as a ``"text"`` stream of these tensors through `PackedCollator`.
    ``padded_len`` fixes the length (a static shape for ``torch.compile``).
    """
    embeddings = check_sequence("embeddings", embeddings, of=Tensor)
    # 2**31 text tokens is beyond any encoder; larger would overflow torch's sizes.
    check_int("pad_to_multiple", pad_to_multiple, min=1, max=2**31, hint="text tokens")
    check_optional_int("padded_len", padded_len, min=1, max=2**31, hint="text tokens")
    if not embeddings:
        raise ValueError("pack_text_embeddings: no episodes; pass one (L_k, D) tensor per episode")
    dims = {tuple(e.shape[1:]) for e in embeddings}
    for i, e in enumerate(embeddings):
        if e.dim() != 2 or e.shape[0] == 0:
            raise ValueError(
                f"text embedding of episode {i} has shape {tuple(e.shape)}; expected (L, D) with "
                "L >= 1 (an empty prompt still has its end-of-text token)"
            )
    if len(dims) != 1:
        raise ValueError(f"text embeddings have different widths {sorted(dims)}; one encoder only")
    lengths = [int(e.shape[0]) for e in embeddings]
    total = sum(lengths)
    if padded_len is None:
        padded_len = padded_length(total, pad_to_multiple)
    if total > padded_len:
        raise ValueError(f"text embeddings have {total} tokens > padded_len={padded_len}")
    out = embeddings[0].new_zeros((padded_len, embeddings[0].shape[1]))
    out[:total] = torch.cat(list(embeddings))
    return out, layout_from_lengths(lengths, lengths, padded_len).to(out.device)


def drop_masked_rows(
    text_TD: Tensor, layout: StreamLayout, mask_T: Tensor
) -> tuple[Tensor, StreamLayout]:
    """Keep the rows whose tokenizer mask is nonzero, each episode's in order; same length.

    Two episodes of 3 and 4 rows, masks ``[1 1 0 | 1 1 1 0]``, padded to 8 -> rows
    ``a0 a1 b0 b1 b2`` then 3 rows of zeros, lengths ``[2, 3]``, doc ids
    ``[0 0 1 1 1 -1 -1 -1]``. The kept lengths are read on the host: one device sync per
    step, only for text that carries a mask (store unpadded text to avoid it).
    """
    if not isinstance(mask_T, Tensor) or mask_T.shape != layout.doc_ids_T.shape:
        raise ValueError(
            f"mask_T must be a tensor shaped like the text's doc ids {tuple(layout.doc_ids_T.shape)}"
            f", got {_shape(mask_T)}; pass the tokenizer's attention_mask packed as a stream"
        )
    keep = (mask_T != 0) & (layout.doc_ids_T >= 0)
    lengths = torch.bincount(layout.doc_ids_T[keep].long(), minlength=layout.num_docs).tolist()
    if 0 in lengths:
        k = lengths.index(0)
        raise ValueError(
            f"the text of the pack's episode {k} has no real row (its text mask is all 0); "
            "every prompt keeps at least its end-of-text token, so check the text_mask stream"
        )
    rows = text_TD[keep]
    out = text_TD.new_zeros(text_TD.shape)
    out[: rows.shape[0]] = rows
    return out, layout_from_lengths(lengths, lengths, layout.padded_len).to(text_TD.device)


def _shape(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
