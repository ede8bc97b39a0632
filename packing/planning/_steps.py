"""Steps of full packs, whatever defines a step: an episode count, a token or a time budget.

A step defined as "16 episodes" in a static token budget leaves the budget's tail empty
(81% full in the seed regime, 76% with short episodes, measured): the dense layers run on
that tail, so the step costs the budget's tokens, not its real ones. Here the definition
picks ONE static budget instead, and the packs are kept full; the number of episodes per
step then varies around the asked count (the loss normaliser, `packing.train.LossNormalizer`,
is exact for a varying count)::

    "16 episodes a step", episodes of 4.6K-10.7K tokens (mean 7.7K)
    fixed count      [e e e e e e e e e e e e e e e e ......]   16 eps, 81% of 152K
    composed         [e e e e e e e e e e e e e e e e e e e]   19 eps, >= 97% of 123K
                      budget = ceil(16 * 7.7K / 128) * 128

`step_token_budget` turns the definition into the budget; `fill_packs` re-plans the packs
that are below ``min_fill`` together with a few full ones until at most one (the epoch's
last) is underfull or no re-plan helps; `compose_steps` does both on top of `plan_packs`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from packing._validate import (
    check_choice,
    check_int,
    check_optional_int,
    check_real,
    check_sequence,
    is_int,
)
from packing.planning._plan import (
    _ALGORITHMS,
    Algorithm,
    PackPlan,
    as_lengths,
    plan_packs,
    positive_int,
)

__all__ = ["compose_steps", "fill_packs", "pack_fill", "step_token_budget"]


def step_token_budget(
    lengths: Any,
    *,
    episodes_per_step: float | None = None,
    step_seconds: float | None = None,
    seconds_per_token: float | None = None,
    seconds_per_pair: float = 0.0,
    multiple: int = 128,
) -> int:
    """The static token budget of a step defined by an episode count or a time budget.

    ``episodes_per_step=K``: ``K * mean(lengths)`` rounded up to ``multiple`` (so a step
    holds K episodes on average). ``step_seconds=S`` with a linear cost model
    ``seconds = seconds_per_token * tokens + seconds_per_pair * sum(length**2)`` (fit it
    with ``benchmarks/distributed/fit_microsteps.py``): the budget whose expected cost, at the lengths'
    mean ``length**2 / length``, is ``S``. Never below the longest episode.

        lengths [100, 300, 200], episodes_per_step=4, multiple=128 -> 4 * 200 = 800 -> 896
    """
    lengths_N = as_lengths(lengths)
    if not len(lengths_N) or (lengths_N < 1).any():
        raise ValueError("lengths must be non-empty token counts >= 1 (one per episode)")
    multiple = positive_int("multiple", multiple, "tokens, e.g. 128")
    if (episodes_per_step is None) == (step_seconds is None):
        raise ValueError("pass exactly one of episodes_per_step= or step_seconds=")
    mean = float(lengths_N.mean())
    seconds_per_pair = check_real("seconds_per_pair", seconds_per_pair, min=0.0)
    if episodes_per_step is not None and (seconds_per_token is not None or seconds_per_pair):
        raise ValueError(
            "seconds_per_token= and seconds_per_pair= are the cost model of step_seconds=; "
            "with episodes_per_step= they would be ignored: drop them"
        )
    if episodes_per_step is not None:
        episodes_per_step = check_real(
            "episodes_per_step", episodes_per_step, above=0.0, hint="episodes in a step, e.g. 16"
        )
        tokens = episodes_per_step * mean
    else:
        if seconds_per_token is None:
            raise ValueError(
                "step_seconds needs seconds_per_token > 0 (got None): the cost of one token "
                "through the model, e.g. fitted by benchmarks/distributed/fit_microsteps.py"
            )
        seconds_per_token = check_real("seconds_per_token", seconds_per_token, above=0.0)
        step_seconds = check_real("step_seconds", step_seconds, above=0.0)
        pairs_per_token = float((lengths_N.astype(np.float64) ** 2).mean()) / mean
        tokens = step_seconds / (seconds_per_token + seconds_per_pair * pairs_per_token)
    budget = max(math.ceil(tokens / multiple), 1) * multiple
    longest = int(lengths_N.max())
    return max(budget, -(-longest // multiple) * multiple)


def pack_fill(packs: list[list[int]], lengths: np.ndarray, token_budget: int) -> np.ndarray:
    """Real tokens / ``token_budget`` per pack, float64 ``(P,)``."""
    lengths = as_lengths(lengths)
    token_budget = positive_int("token_budget", token_budget, "tokens per pack")
    packs = check_packs(packs, len(lengths))
    return _fill(packs, lengths, token_budget)


def check_packs(packs: Any, num_items: int) -> list[list[int]]:
    """``packs`` as lists of item indices, each in ``[0, num_items)`` and in one pack once:
    ``[[0, 1], [1]]`` (item 1 twice) or ``[[-1]]`` would train an episode twice, or another
    one than meant (``-1`` is the last item to numpy)."""
    out = []
    seen: dict[int, int] = {}
    for p, pack in enumerate(check_sequence("packs", packs)):
        items = check_sequence(f"packs[{p}]", pack)
        for i in items:
            if not is_int(i) or not 0 <= i < num_items:
                raise ValueError(
                    f"packs[{p}] holds item {i!r}; items are indices into lengths, ints in "
                    f"[0, {num_items})"
                )
            if int(i) in seen:
                raise ValueError(
                    f"item {int(i)} is in packs[{seen[int(i)]}] and packs[{p}]; each item goes "
                    "in one pack once (plan_packs(...).packs does that)"
                )
            seen[int(i)] = p
        out.append([int(i) for i in items])
    return out


def _fill(packs: list[list[int]], lengths: np.ndarray, token_budget: int) -> np.ndarray:
    sizes = np.fromiter(map(len, packs), dtype=np.int64, count=len(packs))
    flat = np.fromiter((i for p in packs for i in p), dtype=np.int64, count=int(sizes.sum()))
    pack_of = np.repeat(np.arange(len(packs)), sizes)
    tokens = np.bincount(pack_of, weights=lengths[flat].astype(np.float64), minlength=len(packs))
    return tokens / token_budget


def fill_packs(
    packs: list[list[int]],
    lengths: Any,
    token_budget: int,
    *,
    min_fill: float = 0.97,
    algorithm: Algorithm = "lookahead",
    max_docs: int | None = None,
    rounds: int = 8,
) -> list[list[int]]:
    """``packs`` with their underfull ones re-planned: at most one pack below ``min_fill``
    (put last) when the lengths allow it, every item still exactly once.

    Each round takes the packs below ``min_fill`` and 2, 4, 8... times as many full packs
    (those with most episodes: their short episodes close gaps), re-plans them together, and
    keeps the result only if fewer packs are underfull and none was added. Packs already full are
    never touched otherwise, so a plan that is already full comes back unchanged (but
    reordered: the underfull pack, if any, last). Deterministic: no randomness.

        budget 10, min_fill 0.9: [[6], [5], [4, 4], [5, 4]] -> [[6, 4], [5, 5], [4, 4]]
        (lengths shown in place of indices; 28 tokens cannot fill three packs of 10)
    """
    lengths_N = as_lengths(lengths)
    token_budget = positive_int("token_budget", token_budget, "tokens per pack")
    _check_fill(min_fill)
    check_choice("algorithm", algorithm, sorted(_ALGORITHMS))
    max_docs = check_optional_int("max_docs", max_docs, min=1, hint="episodes per pack")
    rounds = check_int("rounds", rounds, min=0, hint="re-planning rounds")
    packs = check_packs(packs, len(lengths_N))
    for p, pack in enumerate(packs):  # the result keeps these invariants; so must the input
        tokens = int(lengths_N[pack].sum()) if pack else 0
        if tokens > token_budget:
            raise ValueError(
                f"packs[{p}] holds {tokens} tokens > token_budget={token_budget}; pass packs "
                "planned for this budget (plan_packs(lengths, token_budget).packs)"
            )
        if max_docs is not None and len(pack) > max_docs:
            raise ValueError(f"packs[{p}] holds {len(pack)} items > max_docs={max_docs}")
    for r in range(rounds):
        fill = _fill(packs, lengths_N, token_budget)
        under = np.flatnonzero(fill < min_fill)
        if len(under) <= 1:
            break
        full = np.flatnonzero(fill >= min_fill)
        docs = np.fromiter((len(packs[i]) for i in full), dtype=np.int64, count=len(full))
        # stable: equal counts keep plan order, so the choice is deterministic; a round that
        # did not help is retried with twice as many donors
        donors = full[np.argsort(-docs, kind="stable")[: len(under) * 2 ** (r + 1)]]
        pool = np.sort(np.concatenate([under, donors]))
        items = np.asarray([i for p in pool for i in packs[p]], dtype=np.int64)
        sub = plan_packs(lengths_N[items], token_budget, algorithm=algorithm, max_docs=max_docs)
        new = [sorted(items[p].tolist()) for p in sub.packs]
        new_under = int((_fill(new, lengths_N, token_budget) < min_fill).sum())
        if new_under >= len(under) or len(new) > len(pool):
            continue
        keep = np.setdiff1d(np.arange(len(packs)), pool)
        packs = [packs[i] for i in keep] + new
    packs = _swap_into_sink(packs, lengths_N, token_budget, min_fill, max_docs)
    fill = _fill(packs, lengths_N, token_budget)
    order = np.argsort(fill < min_fill, kind="stable")  # underfull packs last
    return [packs[i] for i in order]


def _check_fill(min_fill: Any) -> float:
    value = check_real("min_fill", min_fill, above=0.0, hint="a fraction of the budget")
    if value > 1.0:
        raise ValueError(f"min_fill={min_fill!r} must be in (0, 1] (a fraction of the budget)")
    return value


def _swap_into_sink(
    packs: list[list[int]],
    lengths_N: np.ndarray,
    budget: int,
    min_fill: float,
    max_docs: int | None,
) -> list[list[int]]:
    """Move the slack of the underfull packs into one of them (the emptiest, the sink).

    Re-planning spreads slack over several packs; here an underfull pack ``u`` takes an
    episode from the sink (if it fits), or swaps one of its episodes for a longer one of the
    sink, or of a full pack that stays >= ``min_fill`` after the swap, until ``u`` is full or
    no such move exists. Every move keeps every episode in exactly one pack, and a move
    (not a swap) only goes to a pack with fewer than ``max_docs`` episodes.
    """
    tok = [int(lengths_N[p].sum()) if p else 0 for p in packs]
    need = math.ceil(min_fill * budget - 1e-9)
    under = [i for i in range(len(packs)) if tok[i] < need]
    if len(under) <= 1:
        return packs
    packs = [list(p) for p in packs]
    sink = min(under, key=lambda i: (tok[i], i))
    full = [i for i in range(len(packs)) if tok[i] >= need]

    def best_swap(u: int, f: int, slack: int) -> tuple[int, int] | None:
        # an episode a of u for an episode b of f: u gains b - a, which must fit u's room
        # and f's slack; the largest gain wins (ties: the first pair)
        if not packs[u] or not packs[f]:
            return None
        a = lengths_N[packs[u]]
        b = lengths_N[packs[f]]
        gain = b[:, None] - a[None, :]
        ok = (gain > 0) & (gain <= min(budget - tok[u], slack))
        if not ok.any():
            return None
        j, i = np.unravel_index(np.argmax(np.where(ok, gain, -1)), gain.shape)
        return int(i), int(j)

    for u in (i for i in under if i != sink):
        for _ in range(4 * len(packs[u]) + 4):  # each move makes progress; bounded anyway
            if tok[u] >= need:
                break
            room = budget - tok[u]
            fits = [j for j, x in enumerate(packs[sink]) if lengths_N[x] <= room]
            if max_docs is not None and len(packs[u]) >= max_docs:
                fits = []
            if fits:  # the largest episode of the sink that fits moves over
                j = max(fits, key=lambda j: (lengths_N[packs[sink][j]], -j))
                x = packs[sink].pop(j)
                packs[u].append(x)
                tok[u] += int(lengths_N[x])
                tok[sink] -= int(lengths_N[x])
                continue
            for f, slack in [(sink, budget)] + [(f, tok[f] - need) for f in full]:
                swap = best_swap(u, f, slack)
                if swap is not None:
                    break
            if swap is None:
                break
            i, j = swap
            a, b = packs[u][i], packs[f][j]
            packs[u][i], packs[f][j] = b, a
            d = int(lengths_N[b] - lengths_N[a])
            tok[u] += d
            tok[f] -= d
    return [sorted(p) for p in packs if p]  # the sink may have given all its episodes away


def compose_steps(
    lengths: Any,
    *,
    token_budget: int | None = None,
    episodes_per_step: float | None = None,
    step_seconds: float | None = None,
    seconds_per_token: float | None = None,
    seconds_per_pair: float = 0.0,
    multiple: int = 128,
    min_fill: float = 0.97,
    algorithm: Algorithm = "lookahead",
    max_docs: int | None = None,
) -> PackPlan:
    """One pack per step, packs >= ``min_fill`` full except (at most) the last one.

    The step is defined by exactly one of ``token_budget`` (tokens), ``episodes_per_step``
    (an average count) or ``step_seconds`` (with the cost model of `step_token_budget`).
    ``plan.meta`` records the definition and the fill: ``{"defined_by": ..., "min_fill":
    0.97, "fill_min_except_last": ..., "underfull": n}``.

        compose_steps(lengths, episodes_per_step=16)   # ~16 episodes, packs >= 97% full
    """
    given = [x is not None for x in (token_budget, episodes_per_step, step_seconds)]
    if sum(given) != 1:
        raise ValueError(
            "define the step by exactly one of token_budget=, episodes_per_step= or "
            "step_seconds= (the others follow from it)"
        )
    lengths_N = as_lengths(lengths)
    _check_fill(min_fill)
    multiple = positive_int("multiple", multiple, "tokens, e.g. 128")
    if token_budget is not None and (seconds_per_token is not None or seconds_per_pair != 0.0):
        raise ValueError(
            "seconds_per_token= and seconds_per_pair= are the cost model of step_seconds=; "
            "with token_budget= they would be ignored: drop them"
        )
    if token_budget is not None and multiple != 128:
        raise ValueError(
            "multiple= rounds a budget made from episodes_per_step= or "
            "step_seconds=; with token_budget= it would be ignored: drop it"
        )
    if token_budget is None:
        token_budget = step_token_budget(
            lengths_N,
            episodes_per_step=episodes_per_step,
            step_seconds=step_seconds,
            seconds_per_token=seconds_per_token,
            seconds_per_pair=seconds_per_pair,
            multiple=multiple,
        )
        defined_by = (
            f"episodes_per_step={episodes_per_step}"
            if episodes_per_step is not None
            else f"step_seconds={step_seconds}"
        )
    else:
        defined_by = f"token_budget={token_budget}"
    plan = plan_packs(lengths_N, token_budget, algorithm=algorithm, max_docs=max_docs)
    packs = fill_packs(
        plan.packs, lengths_N, plan.token_budget, min_fill=min_fill, algorithm=algorithm,
        max_docs=max_docs,
    )  # fmt: skip
    fill = _fill(packs, lengths_N, plan.token_budget)
    sizes = np.fromiter(map(len, packs), dtype=np.int64, count=len(packs))
    meta = {
        "defined_by": defined_by,
        "min_fill": min_fill,
        "underfull": int((fill < min_fill).sum()),
        "fill_min_except_last": float(fill[:-1].min()) if len(fill) > 1 else 1.0,
        "fill_mean": float(fill.mean()) if len(fill) else 1.0,
    }
    return PackPlan(
        items_N=np.asarray([i for p in packs for i in p], dtype=np.int64),
        offsets_P1=np.concatenate(([0], np.cumsum(sizes))).astype(np.int64),
        item_lengths=lengths_N,
        token_budget=plan.token_budget,
        algorithm=algorithm,
        max_docs=max_docs,
        meta=meta,
    )
