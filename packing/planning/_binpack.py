"""Bin packing of item lengths under a token budget: the algorithms, over plain integer arrays.

Each function takes ``lengths_N`` (int64, every value in ``[1, budget]``) and returns
``bin_N``: the bin (pack) of every item, bins numbered ``0..P-1`` in the order they were opened.
Four items and a budget of 7::

    lengths  [5, 3, 4, 2]          sorted decreasing: 5, 4, 3, 2
    bfd      5 -> new bin 0 (room 2); 4 -> new bin 1 (room 3);
             3 -> bin 1 (tightest room >= 3); 2 -> bin 0
    bin_N    [0, 1, 1, 0]          packs [[0, 3], [1, 2]], 14 / (2 * 7) = 100% full

Why the fast best-fit is fast: items are taken in runs of equal length. Inside a run of
length ``L``, best fit sends the next item to the open bin with the smallest room ``r >= L``,
and after taking it that bin has room ``r - L``, still the smallest room ``>= L`` if it is
``>= L`` at all. So a bin with room ``r`` takes ``r // L`` items of the run in a row, every bin
with the same room behaves the same, and a whole run is placed with a few list and numpy
operations per distinct room level rather than per item. Bins with equal room are
interchangeable, so this is exactly best-fit decreasing (``tests/reference.py`` has the
one-item-at-a-time version the tests compare it to).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

import numpy as np

from packing._layout_math import ceil_div

__all__ = [
    "best_fit_decreasing",
    "best_fit_lookahead",
    "first_fit_decreasing",
    "lookahead",
    "min_packs",
    "next_fit",
    "opener_index",
    "stable_argsort",
]


def _runs(sorted_len: np.ndarray) -> tuple[list[int], list[int]]:
    """Start and stop of each run of equal values in a sorted array."""
    change = np.flatnonzero(np.diff(sorted_len)) + 1
    starts = [0, *change.tolist()]
    stops = [*change.tolist(), len(sorted_len)]
    return starts, stops


def stable_argsort(keys: np.ndarray) -> np.ndarray:
    """Stable argsort of non-negative integers, as 16-bit radix passes (numpy radix-sorts
    16-bit keys in O(N); int64 keys take a comparison sort, ~5x slower at 1M items)."""
    if len(keys) == 0:
        return np.zeros(0, dtype=np.int64)
    order: np.ndarray = np.arange(len(keys))
    top, shift = int(keys.max()), 0
    while True:
        digit = ((keys[order] >> shift) & 0xFFFF).astype(np.uint16)
        order = order[np.argsort(digit, kind="stable")]
        shift += 16
        if top >> shift == 0:
            return order


def _decreasing(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Stable on the reversed lengths: equal lengths keep index order, so plans are deterministic.
    order = stable_argsort(int(lengths.max()) - lengths)
    return order, lengths[order]


def _take(
    k_max: np.ndarray, c: int
) -> tuple[int, np.ndarray]:  # how many bins a run of c items uses, and items per bin
    cum = np.cumsum(k_max)
    m = int(np.searchsorted(cum, c)) + 1 if cum[-1] >= c else len(k_max)
    k = k_max[:m].copy()
    k[-1] -= max(int(cum[m - 1]) - c, 0)
    return m, k


def _assign(out: np.ndarray, pos: int, bins: Sequence[int], per: int, last: int) -> None:
    """out[pos:] = each of ``bins`` repeated ``per`` times, the last one ``last`` times."""
    n = per * (len(bins) - 1) + last
    if n <= 16:  # numpy's call overhead dominates for a few items
        for j, b in enumerate(bins):
            for _ in range(per if j < len(bins) - 1 else last):
                out[pos] = b
                pos += 1
        return
    reps = np.full(len(bins), per, dtype=np.int64)
    reps[-1] = last
    out[pos : pos + n] = np.repeat(np.asarray(bins, dtype=np.int64), reps)


def best_fit_decreasing(
    lengths: np.ndarray, budget: int, max_docs: int | None = None
) -> np.ndarray:
    """Best-fit decreasing, placing runs of equal lengths at once (see the module docstring).

    ``max_docs`` caps the items per bin; a bin that reaches it is closed.
    """
    n = len(lengths)
    bin_sorted = np.empty(n, dtype=np.int64)
    if n == 0:
        return bin_sorted
    order, sorted_len = _decreasing(lengths)
    min_len = int(sorted_len[-1])
    levels: list[int] = []  # open room levels, ascending
    bins_at: dict[int, list[int]] = {}  # room level -> open bins with that room
    docs = np.zeros(n, dtype=np.int64)  # items per bin (only read when max_docs is set)
    n_bins = 0

    def put(bins: list[int], room: int) -> None:
        # A bin whose room is below the shortest item can never take anything again.
        if room < min_len or not bins:
            return
        if room not in bins_at:
            bins_at[room] = []
            insort(levels, room)
        bins_at[room].extend(bins)

    starts, stops = _runs(sorted_len)
    for s, e in zip(starts, stops, strict=False):
        L, c, pos = int(sorted_len[s]), e - s, s
        moves: list[tuple[list[int], int]] = []  # applied after the run: rooms now < L
        i = bisect_left(levels, L)
        while c > 0 and i < len(levels):
            r = levels[i]
            bins = bins_at[r]
            if max_docs is None:  # plain ints: most levels hold a handful of bins
                per = r // L
                m = min(len(bins), ceil_div(c, per))
                used = bins[len(bins) - m :]
                last = min(per, c - per * (m - 1))
                _assign(bin_sorted, pos, used, per, last)
                placed = per * (m - 1) + last
                if m > 1:
                    moves.append((used[:-1], r - per * L))
                moves.append((used[-1:], r - last * L))
            else:
                window = min(len(bins), c)  # every open bin takes at least one item
                cand = np.asarray(bins[len(bins) - window :][::-1], dtype=np.int64)
                k_max = np.minimum(r // L, max_docs - docs[cand])
                m, k = _take(k_max, c)
                used_a = cand[:m]
                placed = int(k.sum())
                bin_sorted[pos : pos + placed] = np.repeat(used_a, k)
                docs[used_a] += k
                rooms = r - k * L
                keep = (rooms >= min_len) & (docs[used_a] < max_docs)
                for room in np.unique(rooms[keep]).tolist():
                    moves.append((used_a[keep & (rooms == room)].tolist(), room))
            pos, c = pos + placed, c - placed
            del bins[len(bins) - m :]
            if not bins:
                del bins_at[r]
                levels.pop(i)
            else:
                i += 1
        if c > 0:  # no open bin has room: open new ones, each filled with the run
            n_bins = _open_bins(bin_sorted, docs, moves, pos, c, L, n_bins, budget, max_docs)
        for bins_moved, room in moves:
            put(bins_moved, room)
    bin_N = np.empty(n, dtype=np.int64)
    bin_N[order] = bin_sorted
    return bin_N


def _open_bins(
    bin_sorted: np.ndarray,
    docs: np.ndarray,
    moves: list[tuple[list[int], int]],
    pos: int,
    c: int,
    L: int,
    n_bins: int,
    budget: int,
    max_docs: int | None,
) -> int:
    """Open as many bins as ``c`` items of length ``L`` need (from sorted position ``pos``),
    each filled with the run; their rooms go to ``moves``. Returns the new bin count."""
    per = budget // L
    if max_docs is not None:
        per = min(per, max_docs)
    need = ceil_div(c, per)
    last = c - per * (need - 1)
    _assign(bin_sorted, pos, range(n_bins, n_bins + need), per, last)
    docs[n_bins : n_bins + need - 1] = per
    docs[n_bins + need - 1] = last
    if need > 1 and (max_docs is None or per < max_docs):
        moves.append((list(range(n_bins, n_bins + need - 1)), budget - per * L))
    if max_docs is None or last < max_docs:
        moves.append(([n_bins + need - 1], budget - last * L))
    return n_bins + need


def first_fit_decreasing(
    lengths: np.ndarray, budget: int, max_docs: int | None = None
) -> np.ndarray:
    """First-fit decreasing: each item goes to the lowest-numbered bin with room.

    Runs of equal lengths are placed at once (the first bin with room takes ``room // L`` of
    them, then the next), but finding the bins scans every bin per run, so this is the slower
    reference point; ``best_fit_decreasing`` is the default.
    """
    n = len(lengths)
    bin_sorted = np.empty(n, dtype=np.int64)
    if n == 0:
        return bin_sorted
    order, sorted_len = _decreasing(lengths)
    room = np.zeros(n, dtype=np.int64)
    docs = np.zeros(n, dtype=np.int64)
    n_bins = 0
    starts, stops = _runs(sorted_len)
    for s, e in zip(starts, stops, strict=False):
        L, c, pos = int(sorted_len[s]), e - s, s
        open_ = room[:n_bins] >= L
        if max_docs is not None:
            open_ &= docs[:n_bins] < max_docs
        cand = np.flatnonzero(open_)
        if len(cand):
            k_max = room[cand] // L
            if max_docs is not None:
                k_max = np.minimum(k_max, max_docs - docs[cand])
            m, k = _take(k_max, c)
            used = cand[:m]
            placed = int(k.sum())
            bin_sorted[pos : pos + placed] = np.repeat(used, k)
            room[used] -= k * L
            docs[used] += k
            pos, c = pos + placed, c - placed
        if c > 0:
            per = budget // L if max_docs is None else min(budget // L, max_docs)
            ids = n_bins + np.arange(c, dtype=np.int64) // per
            bin_sorted[pos : pos + c] = ids
            counts = np.bincount(ids - n_bins)
            new = np.arange(n_bins, n_bins + len(counts))
            room[new] = budget - counts * L
            docs[new] = counts
            n_bins += len(counts)
    bin_N = np.empty(n, dtype=np.int64)
    bin_N[order] = bin_sorted
    return bin_N


def next_fit(lengths: np.ndarray, budget: int, max_docs: int | None = None) -> np.ndarray:
    """Greedy next-fit in the given order (the naive baseline): close a bin when the next item
    does not fit. Keeps the data order, wastes the tail of every bin."""
    bin_N = np.empty(len(lengths), dtype=np.int64)
    b, room, docs = 0, budget, 0
    for i, L in enumerate(lengths.tolist()):
        if room < L or (max_docs is not None and docs >= max_docs):
            b, room, docs = b + 1, budget, 0
        room -= L
        docs += 1
        bin_N[i] = b
    return bin_N


def opener_index(n: int, longest: int, budget: int, quantile: float = 0.5) -> int:
    """Which of ``n`` lengths left (ascending, the last is ``longest``) opens the next pack.

    The longest when it is over half the budget (no two such items share a pack anyway), else
    the one at ``quantile`` (0.5: the middle), so the short items are not all spent as fillers
    of the first packs. Budget 8: lengths ``[1, 2, 3, 5]`` -> 3 (5 > 4); ``[1, 2, 3, 4]`` -> 2.
    The opener of ``best_fit_lookahead`` (over distinct lengths) and of
    ``packing.planning._online.BufferedPacker`` (over buffered episodes).
    """
    return n - 1 if 2 * longest > budget else min(int(quantile * n), n - 1)


def best_fit_lookahead(
    lengths: np.ndarray, budget: int, max_docs: int | None = None, *, opener: float = 0.5
) -> np.ndarray:
    """One pack at a time: open it, add the longest item that still leaves room for the
    shortest one left, and close with the best fit.

    A pack opens with the longest item left when that is over half the budget, else with the
    distinct length at quantile ``opener`` of those left (0.5: the middle one). Best-fit
    decreasing packs the long items first, three mid-size items per pack when the budget is
    ~4x the median, leaving gaps no item can fill (~96%); opening with the longest and
    filling with look-ahead fixes those packs but spends the short items as fillers, and the
    last packs hold only mid-size items (~98.9%); opening from the middle keeps both ends
    available to the end (>= 99% on the benchmark's lengths at 4x-8x the median except near
    4.3x, where ``lookahead`` tries a second opener). Works on distinct lengths (a few Python
    operations per pack), so it is slower than ``best_fit_decreasing``.
    """
    if len(lengths) == 0:
        return np.empty(0, dtype=np.int64)
    order, sorted_len = _decreasing(lengths)
    state = _LookaheadState.start(sorted_len, budget)
    _run_lookahead(state, budget, _cap(len(lengths), max_docs), opener)
    bin_N = np.empty(len(lengths), dtype=np.int64)
    bin_N[order] = state.bins(len(lengths))
    return bin_N


def lookahead(lengths: np.ndarray, budget: int, max_docs: int | None = None) -> np.ndarray:
    """The better of ``best_fit_lookahead`` with openers at quantiles 0.5 and 0.65 (fewer packs;
    ties go to 0.5). Each dips just under 99% for budgets near 4.3x the median of narrow length
    ranges, at different budgets; the better of the two stays >= 99.1% from 4x to 8x (scanned
    in steps of 0.05x on the benchmark's lengths).

    The two runs share what they can, with the same plan as two separate runs:
    - the sort, and the packs opened by an item over half the budget (every pack while the
      longest item left is over half the budget opens with it, whatever the opener: the runs
      only differ after that, so the state is copied there);
    - the second run is skipped when the first reaches the lower bound on the number of packs,
      ``max(ceil(sum / budget), ceil(n / max_docs))``: the second cannot use fewer, and ties
      go to the first.
    """
    n = len(lengths)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    order, sorted_len = _decreasing(lengths)
    cap = _cap(n, max_docs)
    first = _LookaheadState.start(sorted_len, budget)
    _run_lookahead(first, budget, cap, 0.5, until_half_ends=True)
    second = first.copy()
    _run_lookahead(first, budget, cap, 0.5)
    if first.b > min_packs(int(sorted_len.sum()), n, budget, max_docs):
        _run_lookahead(second, budget, cap, 0.65)
        if second.b < first.b:
            first = second
    bin_N = np.empty(n, dtype=np.int64)
    bin_N[order] = first.bins(n)
    return bin_N


def min_packs(total: int, n: int, budget: int, max_docs: int | None = None) -> int:
    """A lower bound on the packs any plan needs: the tokens over the budget, and the items over
    ``max_docs``, rounded up. ``min_packs(10, 3, 4)`` is 3; ``min_packs(10, 9, 8, 2)`` is 5."""
    bound = ceil_div(total, budget)
    return bound if max_docs is None else max(bound, ceil_div(n, max_docs))


def _cap(n: int, max_docs: int | None) -> int:
    return n if max_docs is None else max_docs


class _LookaheadState:
    """Where a lookahead run stands: what is left, and the packs made so far.

    Items of one length are interchangeable: per length it keeps ``[next, stop)`` sorted
    positions (items of a length are taken in increasing order) instead of a list of item
    ids, so one dict lookup per item gives both. Packs built one item at a time are recorded
    as the items' sorted positions (``one_pos``) and each pack's id and size; repeated packs
    as blocks ``(first position, items, first pack, items per pack)``.
    """

    __slots__ = ("b", "blocks", "half", "one_pos", "pack_ids", "pack_sizes", "span", "vals")

    def __init__(
        self,
        vals: list[int],
        span: dict[int, list[int]],
        half: bool,
        b: int = 0,
        one_pos: list[int] | None = None,
        pack_ids: list[int] | None = None,
        pack_sizes: list[int] | None = None,
        blocks: list[tuple[int, int, int, int]] | None = None,
    ) -> None:
        self.vals = vals  # distinct lengths left, ascending
        self.span = span
        self.half = half  # the longest left is over half the budget (it opens the next pack)
        self.b = b  # packs so far
        self.one_pos = [] if one_pos is None else one_pos
        self.pack_ids = [] if pack_ids is None else pack_ids
        self.pack_sizes = [] if pack_sizes is None else pack_sizes
        self.blocks = [] if blocks is None else blocks

    @classmethod
    def start(cls, sorted_len: np.ndarray, budget: int) -> _LookaheadState:
        """Nothing placed yet, over lengths sorted in decreasing order (non-empty)."""
        starts, stops = _runs(sorted_len)
        vals = [int(sorted_len[s]) for s in reversed(starts)]
        span = {int(sorted_len[s]): [s, e] for s, e in zip(starts, stops, strict=False)}
        return cls(vals, span, 2 * vals[-1] > budget)

    def copy(self) -> _LookaheadState:
        """An independent copy (spans of lengths already used up are never read again)."""
        span = self.span
        return _LookaheadState(
            self.vals[:],
            {v: span[v][:] for v in self.vals},
            self.half,
            self.b,
            self.one_pos[:],
            self.pack_ids[:],
            self.pack_sizes[:],
            self.blocks[:],
        )

    def bins(self, n: int) -> np.ndarray:
        """The pack of every sorted position, once every item is placed."""
        bin_sorted = np.empty(n, dtype=np.int64)
        bin_sorted[np.asarray(self.one_pos, dtype=np.int64)] = np.repeat(
            np.asarray(self.pack_ids, dtype=np.int64), self.pack_sizes
        )
        if self.blocks:
            # Block (p, c, b, m): positions p .. p + c - 1 go to packs b .. b + c/m - 1, m items
            # each, the last pack's items first (the order the one-at-a-time loop would use).
            p0, count, b0, per = (
                np.asarray(x, dtype=np.int64) for x in zip(*self.blocks, strict=True)
            )
            q = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
            last_first = np.repeat(count, count) - 1 - q
            bin_sorted[np.repeat(p0, count) + q] = np.repeat(b0, count) + last_first // np.repeat(
                per, count
            )
        return bin_sorted


def _run_lookahead(
    state: _LookaheadState,
    budget: int,
    cap: int,
    opener: float,
    *,
    until_half_ends: bool = False,
) -> None:
    """Build packs into ``state`` until every item is placed, or (``until_half_ends``) until
    the longest item left is no longer over half the budget (the packs up to there do not
    depend on ``opener``).

    One loop on purpose (~60 lines): it is the planner's hot path, ~1.2 us an item, and each
    choice depends on the previous one; inlining the opener and one dict lookup per item
    made it 1.2-1.3x faster with identical plans (docs/benchmarks.md §7).
    """
    vals, span, b, half = state.vals, state.span, state.b, state.half
    take = state.one_pos.append
    pack_ids, pack_sizes, blocks = state.pack_ids, state.pack_sizes, state.blocks
    while vals:
        # Open over the distinct lengths left (the longest if over half the budget, else the
        # middle one): opening with the longest would use up the short items as fillers.
        left = len(vals)
        if half:
            half = 2 * vals[-1] > budget
        if until_half_ends and not half:
            break
        j = left - 1 if half else min(int(opener * left), left - 1)
        pattern: list[int] = []
        room, size = budget, 0
        few = False  # some length of this pack has < 2 items left: the pack cannot repeat
        while True:
            v = vals[j]
            sp = span[v]
            p = sp[0]
            take(p)
            sp[0] = p = p + 1
            if sp[1] - p < 2:
                few = True
                if p == sp[1]:
                    vals.pop(j)
            pattern.append(v)
            room -= v
            size += 1
            if not vals or size >= cap:
                break
            # The largest length <= room, and the largest that leaves room for the shortest:
            # the longest left when it fits (no bisection), which is most of the fill steps.
            last = len(vals) - 1
            if vals[last] <= room:
                j = last
            else:
                j = bisect_left(vals, room + 1) - 1
                if j < 0:
                    break
            if vals[j] < room and size + 1 < cap:
                spare = room - vals[0]
                k = last if vals[last] <= spare else bisect_left(vals, spare + 1) - 1
                if k > 0 or (k == 0 and span[vals[0]][1] - span[vals[0]][0] > 1):
                    j = k
        pack_ids.append(b)
        pack_sizes.append(size)
        b += 1
        if few:
            continue
        # While every length of this pack is left at least twice over, the next packs see the
        # same choices (no length runs out, the shortest stays the shortest): repeat the pack
        # k - 2 times at once instead of one item at a time. A length's count before this pack
        # is what is left now plus what the pack took (m).
        mult = {v: pattern.count(v) for v in dict.fromkeys(pattern)}
        reps = min((span[v][1] - span[v][0] + m) // m for v, m in mult.items()) - 2
        if reps > 0:
            for v, m in mult.items():
                sp = span[v]
                blocks.append((sp[0], m * reps, b, m))
                sp[0] += m * reps
            b += reps
    state.b, state.half = b, half
