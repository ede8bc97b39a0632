"""Which episodes go together: a token-budget packing plan, built once and reused every epoch.

    episodes -> lengths (tokens) -> plan_packs -> PackPlan -> PackedBatchSampler -> collate

Three episodes of ``[5, 3, 4]`` tokens and a budget of 8::

    plan_packs([5, 3, 4], 8)     -> packs [[0, 1], [2]]      tokens [8, 4]
    efficiency = real tokens / (packs * budget) = 12 / 16 = 75%

An episode longer than the budget follows ``oversize``: ``"error"`` (default) names it and the
fix; ``"drop"`` leaves it out, counts it in ``plan.dropped`` and warns; ``"split"`` cuts it
into windows on step boundaries (`packing.planning._pieces.split_windows`). With ``"split"`` the items
are *pieces*, rows ``(episode, start, stop, loss_start)`` of ``plan.pieces_I4`` in steps, and
packs hold piece ids; the data loader slices ``episode[start:stop]`` on every step-level stream
and gives the steps before ``loss_start`` zero loss weight (they are context the previous piece
already trained on). Without ``"split"``, item ``i`` is episode ``i``.

Plans are deterministic: the same lengths and arguments give the same packs; randomness (pack
order per epoch) belongs to the sampler.

Legend (``docs/index.md``): ``N`` items to plan, ``P`` packs, ``P1`` = P + 1 offsets.
"""

from __future__ import annotations

import gc
import json
import warnings
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

import numpy as np

from packing._validate import check_choice, check_int, check_int_tuple, check_optional_int, is_int
from packing.planning._binpack import (
    best_fit_decreasing,
    first_fit_decreasing,
    lookahead,
    next_fit,
    stable_argsort,
)
from packing.planning._pieces import pieces_of

__all__ = ["PackPlan", "frames_to_tokens", "plan_packs"]


Algorithm = Literal["bfd", "ffd", "lookahead", "next_fit"]
Oversize = Literal["error", "split", "drop"]
_ALGORITHMS = {
    "bfd": best_fit_decreasing,
    "ffd": first_fit_decreasing,
    "lookahead": lookahead,
    "next_fit": next_fit,
}
_FORMAT = "packing.plan/v1"
_PIECE_COLUMNS = ("episode", "start", "stop", "loss_start")


def frames_to_tokens(
    num_frames: Any,
    *,
    temporal_compression: int = 1,
    latent_hw: tuple[int, int] = (8, 16),
    patch: tuple[int, int, int] = (1, 2, 2),
    action_tokens_per_frame: int = 0,
    text_tokens: int = 0,
) -> np.ndarray:
    """Tokens of each episode from its frame count (vectorised over an array of counts).

    With ``temporal_compression > 1`` the frames are raw video frames and a Wan-style causal
    VAE keeps the first frame and compresses the rest: ``F_latent = 1 + (N - 1) // tc``. A
    latent frame of ``latent_hw = (H, W)`` cut into ``patch = (pt, ph, pw)`` patches gives
    ``(H / ph) * (W / pw)`` tokens, ``pt`` latent frames per token frame. Action tokens are
    counted per latent frame (one action chunk per latent frame), text tokens once::

        tokens = (F_latent / pt) * (H/ph) * (W/pw) + F_latent * action_tokens_per_frame + text

        frames_to_tokens([240, 222], action_tokens_per_frame=4, text_tokens=512)
        -> [9152, 8504]      # 48x240x8x16 latents: 240 * 32 + 240 * 4 + 512
    """
    n = np.asarray(num_frames)
    if n.size == 0:
        raise ValueError("num_frames is empty; pass one frame count per episode")
    if n.dtype.kind not in "iu":
        raise TypeError(
            f"num_frames must be integer frame counts, got {n.dtype}; convert them yourself "
            "(frames_to_tokens never truncates 3.7 frames to 3)"
        )
    n = n.astype(np.int64, copy=False)
    h, w = check_int_tuple("latent_hw", latent_hw, length=2)
    pt, ph, pw = check_int_tuple("patch", patch, length=3)
    check_int("temporal_compression", temporal_compression, min=1, hint="raw frames per latent")
    check_int(
        "action_tokens_per_frame", action_tokens_per_frame, min=0, hint="a token count: 0 or more"
    )
    check_int("text_tokens", text_tokens, min=0, hint="a token count: 0 or more")
    if h % ph or w % pw:
        raise ValueError(
            f"latent_hw={latent_hw} is not divisible by patch={patch} in (h, w); "
            f"pick a patch that divides the latent grid"
        )
    if temporal_compression < 1 or pt < 1:
        raise ValueError(
            f"temporal_compression={temporal_compression} and patch[0]={pt} must be >= 1"
        )
    if (n < 1).any():
        bad = int(np.flatnonzero(n < 1)[0])
        raise ValueError(f"episode {bad} has {int(n.flat[bad])} frames; drop empty episodes first")
    f_lat = n if temporal_compression == 1 else 1 + (n - 1) // temporal_compression
    if pt > 1 and (f_lat % pt).any():
        bad = int(np.flatnonzero(f_lat % pt)[0])
        raise ValueError(
            f"episode {bad} has {int(f_lat.flat[bad])} latent frames, not a multiple of the "
            f"temporal patch {pt}; trim episodes to a multiple of {pt} latent frames"
        )
    per_frame = (h // ph) * (w // pw)
    return (f_lat // pt) * per_frame + f_lat * action_tokens_per_frame + text_tokens


@dataclass(frozen=True, eq=False, kw_only=True)
class PackPlan:
    """Packs as a CSR table: pack ``p`` holds items ``items_N[offsets_P1[p]:offsets_P1[p + 1]]``.

    ``item_lengths`` are tokens per item; ``pieces_I4`` is ``None`` unless ``oversize="split"``
    (then item ``i`` is the piece ``pieces_I4[i] = (episode, start, stop, loss_start)``);
    ``dropped`` lists the episodes left out by ``oversize="drop"``.
    """

    items_N: np.ndarray
    offsets_P1: np.ndarray
    item_lengths: np.ndarray
    token_budget: int
    pieces_I4: np.ndarray | None = None
    dropped: tuple[int, ...] = ()
    algorithm: str = "lookahead"
    max_docs: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A plan is trusted by the sampler and the collator: one built by hand or read from a
        # file is checked here, once (vectorised), so no pack trains an item twice or overflows.
        budget = check_int("token_budget", self.token_budget, min=1, hint="tokens per pack")
        max_docs = check_optional_int("max_docs", self.max_docs, min=1, hint="items per pack")
        arrays = {"items_N": self.items_N, "offsets_P1": self.offsets_P1}
        arrays["item_lengths"] = self.item_lengths
        for name, a in arrays.items():
            if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "iu":
                raise TypeError(f"PackPlan {name} must be a 1-D integer numpy array, got {a!r}")
        items, off, n = self.items_N, self.offsets_P1, len(self.item_lengths)
        if len(off) < 1 or off[0] != 0 or off[-1] != len(items) or (np.diff(off) < 0).any():
            raise ValueError(
                f"PackPlan offsets_P1 must rise from 0 to len(items_N)={len(items)}, got {off}"
            )
        if len(items) and (items.min() < 0 or items.max() >= n):
            bad = int(items[(items < 0) | (items >= n)][0])
            raise ValueError(f"PackPlan holds item {bad}; items index item_lengths, [0, {n})")
        if len(np.unique(items)) != len(items):
            vals, counts = np.unique(items, return_counts=True)
            raise ValueError(f"PackPlan holds item {int(vals[counts > 1][0])} more than once")
        cum = np.concatenate(([0], np.cumsum(self.item_lengths[items], dtype=np.int64)))
        tokens = cum[off[1:]] - cum[off[:-1]]
        if (tokens > budget).any():
            p = int(np.flatnonzero(tokens > budget)[0])
            raise ValueError(
                f"PackPlan pack {p} holds {int(tokens[p])} tokens > token_budget={budget}"
            )
        if max_docs is not None and (np.diff(off) > max_docs).any():
            p = int(np.flatnonzero(np.diff(off) > max_docs)[0])
            raise ValueError(
                f"PackPlan pack {p} holds {int(np.diff(off)[p])} items > max_docs={max_docs}"
            )

    def __len__(self) -> int:
        return len(self.offsets_P1) - 1

    def __getitem__(self, p: int) -> list[int]:
        return self.items_N[self.offsets_P1[p] : self.offsets_P1[p + 1]].tolist()

    @property
    def packs(self) -> list[list[int]]:
        items, off = self.items_N.tolist(), self.offsets_P1.tolist()
        # Hundreds of thousands of new lists would trigger the cyclic GC again and again (4x
        # slower); plain lists of ints cannot form cycles, so pause it while building them.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return [items[a:b] for a, b in pairwise(off)]
        finally:
            if enabled:
                gc.enable()

    @property
    def num_docs_P(self) -> np.ndarray:
        return np.diff(self.offsets_P1)

    @property
    def tokens_P(self) -> np.ndarray:
        """Real tokens per pack."""
        return self._reduce(self.item_lengths)

    @property
    def attention_cost_P(self) -> np.ndarray:
        """Sum of squared document lengths per pack: the cost of document-masked attention."""
        return self._reduce(self.item_lengths.astype(np.float64) ** 2)

    def _reduce(self, per_item: np.ndarray) -> np.ndarray:
        pack_of = np.repeat(np.arange(len(self)), self.num_docs_P)
        return np.bincount(pack_of, weights=per_item[self.items_N], minlength=len(self)).astype(
            per_item.dtype
        )

    @property
    def efficiency(self) -> float:
        """Real tokens / (packs * token_budget)."""
        return float(self.item_lengths[self.items_N].sum()) / max(len(self) * self.token_budget, 1)

    def to_json(self, path: str | Path) -> None:
        """Write the plan as one JSON document (fine up to a few million items)."""
        Path(path).write_text(json.dumps(self._header() | {"packs": self.packs}))

    @classmethod
    def from_json(cls, path: str | Path) -> PackPlan:
        doc = json.loads(Path(path).read_text())
        return cls._from_parts(doc, doc.pop("packs"))

    def to_arrow(self, path: str | Path) -> None:
        """Save as a Hugging Face ``datasets`` Arrow table (memory-mapped when loaded), one row
        per pack: ``items``, their ``lengths`` and, for split plans, the pieces' ``episode``,
        ``start``, ``stop``, ``loss_start``; the rest of the plan in the dataset description.
        Needs the ``hf`` extra (README: Install)."""
        from packing._lazy import require

        datasets = require("datasets", extra="hf")
        pa = require("pyarrow", extra="hf")
        offsets = pa.array(self.offsets_P1)

        def per_pack(values: np.ndarray) -> Any:
            return pa.LargeListArray.from_arrays(offsets, pa.array(values[self.items_N]))

        columns = {
            "items": per_pack(np.arange(len(self.item_lengths))),
            "lengths": per_pack(self.item_lengths),
        }
        if self.pieces_I4 is not None:
            for j, name in enumerate(_PIECE_COLUMNS):
                columns[name] = per_pack(self.pieces_I4[:, j])
        head = {k: v for k, v in self._header().items() if k not in ("item_lengths", "pieces")}
        dropped = list(self.dropped)
        head |= {
            "num_items": len(self.item_lengths),
            "dropped_lengths": self.item_lengths[dropped].tolist(),
        }
        info = datasets.DatasetInfo(description=json.dumps(head))
        datasets.Dataset(pa.table(columns), info=info).save_to_disk(str(path))

    @classmethod
    def from_arrow(cls, path: str | Path) -> PackPlan:
        from packing._lazy import require

        datasets = require("datasets", extra="hf")
        table = datasets.load_from_disk(str(path))
        head = json.loads(table.info.description)
        if head.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a packing plan (format={head.get('format')!r})")

        def flat(name: str) -> np.ndarray:
            return table.data.column(name).combine_chunks().values.to_numpy().astype(np.int64)

        col = table.data.column("items").combine_chunks()
        items = flat("items")
        item_lengths = np.zeros(head["num_items"], dtype=np.int64)
        item_lengths[items] = flat("lengths")
        item_lengths[head["dropped"]] = head["dropped_lengths"]
        pieces = None
        if _PIECE_COLUMNS[0] in table.column_names:
            pieces = np.zeros((head["num_items"], 4), dtype=np.int64)
            pieces[items] = np.stack([flat(c) for c in _PIECE_COLUMNS], axis=1)
        return cls(
            items_N=items,
            offsets_P1=col.offsets.to_numpy().astype(np.int64),
            item_lengths=item_lengths,
            token_budget=check_int("the plan file's token_budget", head["token_budget"], min=1),
            pieces_I4=pieces,
            dropped=tuple(head["dropped"]),
            algorithm=head["algorithm"],
            max_docs=head["max_docs"],
            meta=head.get("meta", {}),
        )

    def _header(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "token_budget": self.token_budget,
            "algorithm": self.algorithm,
            "max_docs": self.max_docs,
            "item_lengths": self.item_lengths.tolist(),
            "pieces": None if self.pieces_I4 is None else self.pieces_I4.tolist(),
            "dropped": list(self.dropped),
            "meta": self.meta,
        }

    @classmethod
    def _from_parts(cls, head: dict[str, Any], packs: list[list[int]]) -> PackPlan:
        if head.get("format") != _FORMAT:
            raise ValueError(
                f"not a packing plan (format={head.get('format')!r}, want {_FORMAT!r})"
            )
        sizes = np.fromiter((len(p) for p in packs), dtype=np.int64, count=len(packs))
        items = [i for p in packs for i in p]
        return cls(
            items_N=np.asarray(items, dtype=np.int64),
            offsets_P1=np.concatenate(([0], np.cumsum(sizes))).astype(np.int64),
            item_lengths=np.asarray(head["item_lengths"], dtype=np.int64),
            token_budget=check_int("the plan file's token_budget", head["token_budget"], min=1),
            pieces_I4=None if head["pieces"] is None else np.asarray(head["pieces"], np.int64),
            dropped=tuple(head["dropped"]),
            algorithm=head["algorithm"],
            max_docs=head["max_docs"],
            meta=head.get("meta", {}),
        )


def as_lengths(lengths: Any, what: str = "lengths") -> np.ndarray:
    """``lengths`` as int64 (N,), or a ValueError that names the bad value and the fix.

    One-dimensional integers only: ``[3.7, 4.9]`` is not truncated to ``[3, 4]`` (a pack
    would hold more real tokens than its budget), strings are not parsed, a 2-D array is not
    flattened. Sizes are checked against ``token_budget`` by the caller.
    """
    if isinstance(lengths, list | tuple) and len(lengths) == 0:
        # Every episode filtered out: an empty plan, not numpy's float64 dtype of [].
        return np.zeros(0, dtype=np.int64)
    if isinstance(lengths, str | bytes) or lengths is None:
        raise TypeError(
            f"{what} must be a 1-D sequence of integer token counts, got {type(lengths).__name__}"
        )
    try:
        arr = np.asarray(lengths)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be a 1-D sequence of integer token counts ({e})") from e
    if arr.dtype.kind == "b" or _has_bool(lengths):
        first = _first_bool(lengths)
        raise TypeError(
            f"{what} holds a bool (episode {first}); a length is a token count: True would "
            "be planned as 1 token"
        )
    if arr.ndim != 1:
        raise ValueError(
            f"{what} must be one-dimensional (one token count per episode), got shape "
            f"{arr.shape}; pass one length per episode"
        )
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":  # np.array([]) of an empty selection
            return np.zeros(0, dtype=np.int64)
        if arr.dtype.kind == "O" and all(isinstance(v, int) for v in arr.tolist()):
            big = next(v for v in arr.tolist() if not -(2**63) <= v < 2**63)
            raise ValueError(f"{what}: {big} tokens is out of range (int64); check the lengths")
        bad = 0
        if arr.dtype.kind == "f" and len(arr):
            odd = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
            bad = int(odd[0]) if len(odd) else 0
        value = arr[bad].item() if len(arr) else None
        raise TypeError(
            f"{what} must be integers (tokens per episode), got {arr.dtype} (episode {bad}: "
            f"{value!r}); convert them yourself, e.g. np.ceil(x).astype(np.int64): the planner "
            "never truncates"
        )
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and len(arr) and arr.max() >= 2**63:
        raise ValueError(f"{what}: {int(arr.max())} tokens is out of range (int64)")
    return arr.astype(np.int64, copy=False)


def _has_bool(lengths: Any) -> bool:
    """A Python list or tuple holding a bool (numpy makes ``[True, 3]`` an int array)."""
    return isinstance(lengths, list | tuple) and any(isinstance(v, bool) for v in lengths)


def _first_bool(lengths: Any) -> int:
    if not isinstance(lengths, list | tuple):
        return 0  # a numpy bool array: its first entry
    return next(i for i, v in enumerate(lengths) if isinstance(v, bool))


def positive_int(name: str, value: Any, unit: str) -> int:
    """``value`` as an int >= 1, or an error naming it: ``8.9`` is not rounded, ``None`` or
    ``True`` is not a budget."""
    if not is_int(value):
        raise TypeError(f"{name}={value!r} must be a positive int ({unit})")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1 ({unit})")
    return int(value)


def _check_options(
    algorithm: Any,
    oversize: Any,
    tokens_per_step: Any,
    fixed_tokens: Any,
    split_multiple: Any,
    split_overlap: Any,
) -> None:
    """`plan_packs`' choices and split sizes, checked with the validation helper."""
    check_choice("algorithm", algorithm, sorted(_ALGORITHMS))
    check_choice("oversize", oversize, ("error", "split", "drop"))
    check_int("tokens_per_step", tokens_per_step, min=1, hint="tokens of one step (frame)")
    check_int("fixed_tokens", fixed_tokens, min=0, hint="tokens every piece repeats, e.g. text")
    check_int("split_multiple", split_multiple, min=1, hint="steps a cut falls on a multiple of")
    check_int(
        "split_overlap",
        split_overlap,
        min=0,
        hint="no-loss context steps repeated from the previous piece; a negative overlap "
        "would leave steps out of every piece",
    )


def plan_packs(
    lengths: Any,
    token_budget: int,
    *,
    algorithm: Algorithm = "lookahead",
    max_docs: int | None = None,
    oversize: Oversize = "error",
    tokens_per_step: int = 1,
    fixed_tokens: int = 0,
    split_multiple: int = 1,
    split_overlap: int = 0,
) -> PackPlan:
    """Pack episodes of ``lengths`` tokens into packs of at most ``token_budget`` tokens.

    ``algorithm``: ``"lookahead"`` (default: open each pack from the middle of the lengths
    left, fill it so the shortest still fits, close with the best fit; >= 99% full, 0.5-9M
    episodes/s on one core, docs/planning.md), ``"bfd"`` best-fit decreasing (the
    classic; ~96% on narrow length ranges), ``"ffd"`` first-fit decreasing, ``"next_fit"``
    greedy in data order (the naive baseline). ``max_docs`` caps the
    episodes per pack. For ``oversize="split"`` an episode's length must be
    ``fixed_tokens + steps * tokens_per_step`` (e.g. 512 text tokens + 36 tokens per latent
    frame); windows hold at most ``(token_budget - fixed_tokens) // tokens_per_step`` steps,
    cut on multiples of ``split_multiple`` with ``split_overlap`` no-loss context steps.
    """
    lengths_N = as_lengths(lengths)
    token_budget = positive_int("token_budget", token_budget, "tokens per pack, e.g. 8192")
    if max_docs is not None:
        max_docs = positive_int("max_docs", max_docs, "episodes per pack, or None")
    _check_options(
        algorithm, oversize, tokens_per_step, fixed_tokens, split_multiple, split_overlap
    )
    if (lengths_N < 1).any():
        bad = int(np.flatnonzero(lengths_N < 1)[0])
        raise ValueError(
            f"episode {bad} has {int(lengths_N[bad])} tokens; drop empty episodes before planning"
        )
    over = np.flatnonzero(lengths_N > token_budget)
    pieces_I4: np.ndarray | None = None
    dropped: tuple[int, ...] = ()
    item_lengths = lengths_N
    keep: np.ndarray = np.arange(len(lengths_N))
    if len(over) and oversize == "error":
        e = int(over[0])
        raise ValueError(
            f"episode {e} has {int(lengths_N[e]):,} tokens > token_budget={token_budget:,} "
            f"({len(over)} episode(s) over, longest {int(lengths_N[over].max()):,}); raise "
            f"token_budget, or pass oversize='split' (windows with no-loss overlap) or "
            f"oversize='drop' (left out and reported)"
        )
    if oversize == "drop" and len(over):
        dropped = tuple(over.tolist())
        keep = np.flatnonzero(lengths_N <= token_budget)
        warnings.warn(
            f"oversize='drop': left out {len(over)} episode(s) longer than "
            f"token_budget={token_budget:,} (first: {list(dropped[:10])}); see plan.dropped",
            stacklevel=2,
        )
    elif oversize == "split":
        pieces_I4 = pieces_of(
            lengths_N, token_budget, tokens_per_step, fixed_tokens, split_multiple, split_overlap
        )
        item_lengths = fixed_tokens + (pieces_I4[:, 2] - pieces_I4[:, 1]) * tokens_per_step
        keep = np.arange(len(pieces_I4))
    if len(keep) == 0:  # nothing to plan (every episode filtered out or dropped)
        bin_N = np.zeros(0, dtype=np.int64)
    else:
        bin_N = _without_gc(_ALGORITHMS[algorithm], item_lengths[keep], token_budget, max_docs)
    # Group items by bin: a stable sort keeps each pack's items in their input order.
    order = stable_argsort(bin_N)
    counts = np.bincount(bin_N, minlength=int(bin_N.max()) + 1 if len(bin_N) else 0)
    return PackPlan(
        items_N=keep[order].astype(np.int64),
        offsets_P1=np.concatenate(([0], np.cumsum(counts))).astype(np.int64),
        item_lengths=item_lengths.astype(np.int64),
        token_budget=int(token_budget),
        pieces_I4=pieces_I4,
        dropped=dropped,
        algorithm=algorithm,
        max_docs=max_docs,
    )


def _without_gc(fn: Any, *args: Any) -> np.ndarray:
    """``fn(*args)`` with Python's cyclic GC paused: the planners allocate many small lists and
    dicts (none can form a cycle), which would trigger collections of the whole heap (every
    module torch loaded) in the middle of a plan, making some calls 2-3x slower than others."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return np.asarray(fn(*args))
    finally:
        if enabled:
            gc.enable()
