"""Pictures of attention masks: ASCII for docstrings and tests, PNG for the docs.

``ascii_mask`` draws a token-level bool mask (``#`` attends, ``.`` does not);
``ascii_blocks`` draws a FlexAttention ``BlockMask`` tile by tile (``#`` full, ``+`` partial,
``.`` skipped). Three episodes ``[3, 2, 3]`` + 1 pad::

    >>> print(ascii_mask(dense_mask(doc_ids)))          # doctest: +SKIP
    # # # . . . . . .
    # # # . . . . . .
    # # # . . . . . .
    . . . # # . . . .
    . . . # # . . . .
    . . . . . # # # .
    . . . . . # # # .
    . . . . . # # # .
    . . . . . . . . #

``save_png`` needs matplotlib, imported only when called (the ``plot`` extra, README: Install).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from packing._lazy import require

__all__ = ["EMPTY", "FULL", "PARTIAL", "ascii_blocks", "ascii_mask", "block_classes", "save_png"]

EMPTY, PARTIAL, FULL = 0, 1, 2
_TILE_CHAR = {EMPTY: ".", PARTIAL: "+", FULL: "#"}


def block_classes(block_mask: BlockMask) -> Tensor:
    """int8 ``(R, C)`` tile classes (R q tiles x C kv tiles) of a BlockMask's first batch row
    and head: EMPTY/PARTIAL/FULL.

    Read from ``kv_num_blocks``/``kv_indices`` (and the ``full_`` pair): the first
    ``num[i]`` entries of ``indices[i]`` are the listed tiles of q tile ``i``.
    """
    out = _listed(block_mask.kv_num_blocks, block_mask.kv_indices) * PARTIAL
    if block_mask.full_kv_num_blocks is not None and block_mask.full_kv_indices is not None:
        full = _listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        out = torch.where(full.bool(), FULL, out)
    return out.to(torch.int8)


def _listed(num: Tensor, indices: Tensor) -> Tensor:
    num_R, idx_RC = num[0, 0].long(), indices[0, 0].long()
    C = idx_RC.shape[-1]
    listed = torch.arange(C, device=idx_RC.device) < num_R[:, None]
    dense = torch.zeros(idx_RC.shape[0], C + 1, dtype=torch.int64, device=idx_RC.device)
    # Unlisted slots write to a spare last column, dropped below.
    dense.scatter_(1, torch.where(listed, idx_RC, C), 1)
    return dense[:, :C]


def ascii_blocks(block_mask: BlockMask, sep: str = " ") -> str:
    """One line per q tile: ``#`` full, ``+`` partial (mask_mod evaluated), ``.`` skipped."""
    rows = block_classes(block_mask).tolist()
    return "\n".join(sep.join(_TILE_CHAR[c] for c in row) for row in rows)


def ascii_mask(mask: Tensor, sep: str = " ") -> str:
    """One line per query: ``#`` where the bool ``(T_q, T_kv)`` mask attends, ``.`` elsewhere."""
    _check_mask(mask)
    if not isinstance(sep, str):
        raise TypeError(f"sep={sep!r} must be a string, e.g. ' '")
    return "\n".join(sep.join("#" if v else "." for v in row) for row in mask.bool().tolist())


def save_png(
    path: str | Path,
    mask: Tensor,
    *,
    block_mask: BlockMask | None = None,
    doc_ids: Tensor | None = None,
    title: str | None = None,
) -> Path:
    """Draw a bool ``(T_q, T_kv)`` mask to a PNG, coloured by episode, with the tile grid.

    With ``block_mask``, full tiles get a solid outline and partial tiles a dashed one (skipped
    tiles none), so the picture shows both what attends and what the kernel computes.
    ``doc_ids`` (the queries') colours each attending pair by its episode (grey: padding).
    """
    require("matplotlib", extra="plot").use("Agg")
    plt = require("matplotlib.pyplot", extra="plot")
    Rectangle = require("matplotlib.patches", extra="plot").Rectangle

    _check_mask(mask)
    m = mask.detach().cpu().bool()
    T_q, T_kv = m.shape
    # Colour index per pair: 7 (grey in tab10) for padding, episode d -> d mod 7 otherwise;
    # pairs that do not attend are left blank (NaN).
    if doc_ids is None:
        color = torch.zeros(T_q, T_kv)
    else:
        q_doc = doc_ids.detach().cpu().long()[:, None].expand(T_q, T_kv)
        color = torch.where(q_doc >= 0, q_doc % 7, 7).float()
    shown = color.masked_fill(~m, float("nan")).numpy()
    fig, ax = plt.subplots(figsize=(5, 5), dpi=120)
    # Square pixels unless q and kv lengths differ a lot (cross-attention): then fill the axes.
    aspect: Literal["equal", "auto"] = "equal" if 0.5 <= T_q / T_kv <= 2 else "auto"
    ax.imshow(
        shown, cmap=plt.get_cmap("tab10"), vmin=0, vmax=9, interpolation="nearest", aspect=aspect
    )
    if block_mask is not None:
        classes = block_classes(block_mask).cpu()
        bq, bkv = block_mask.BLOCK_SIZE
        for i, row in enumerate(classes.tolist()):
            for j, c in enumerate(row):
                if c == EMPTY:
                    continue
                ax.add_patch(
                    Rectangle(
                        (j * bkv - 0.5, i * bq - 0.5),
                        min(bkv, T_kv - j * bkv),
                        min(bq, T_q - i * bq),
                        fill=False,
                        edgecolor="black",
                        linewidth=1.4 if c == FULL else 0.9,
                        linestyle="-" if c == FULL else "--",
                    )
                )
    ax.set_xlabel("key / value token")
    ax.set_ylabel("query token")
    if title:
        ax.set_title(title, fontsize=10)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _check_mask(mask: object) -> None:
    """A bool (T_q, T_kv) tensor: a float mask would be drawn by its truthiness (0.5 as True)."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        what = f"a {mask.dtype} tensor" if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"mask must be a bool tensor (True = attend), got {what}; use dense_mask")
    if mask.ndim != 2:
        raise ValueError(f"mask must be 2-D (T_q, T_kv), got shape {tuple(mask.shape)}")
