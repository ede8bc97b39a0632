"""Seeded episode lengths for the attention and mask benchmarks."""

from __future__ import annotations

import torch


def seeded_lengths(
    rng: torch.Generator, n: int, lo: int, hi: int, *, multiple: int = 1
) -> list[int]:
    """``n`` episode lengths uniform in [lo, hi], rounded to ``multiple`` (32 tokens = one
    latent frame of 8x16 with 2x2 patches)."""
    xs = torch.randint(lo // multiple, hi // multiple + 1, (n,), generator=rng).tolist()
    return [max(multiple, int(x) * multiple) for x in xs]


def fill_pack(
    rng: torch.Generator, budget: int, lo: int, hi: int, *, multiple: int = 1
) -> list[int]:
    """Episode lengths drawn in [lo, hi] until the next one would overflow ``budget``."""
    out: list[int] = []
    total = 0
    while True:
        (n,) = seeded_lengths(rng, 1, lo, hi, multiple=multiple)
        if total + n > budget:
            if not out:
                out.append(min(n, budget))
            return out
        out.append(n)
        total += n
