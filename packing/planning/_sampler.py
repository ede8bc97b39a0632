"""A batch sampler that yields packs of dataset indices, the same number on every rank.

    plan (P packs) -> equalise to a multiple of R ranks -> per epoch: shuffle from (seed, epoch),
    group into steps of R packs of similar cost -> each rank takes one pack per step

Two ranks, episodes of ``[8, 8, 7, 5, 2, 3]`` tokens, budget 8, ``shuffle=False``. The plan
has five packs ``[0] [1] [2] [3, 5] [4]``; five is not a multiple of two, so the pack with most
episodes is split in two (never truncated, never dropped). Each step pairs packs of similar
cost, and the heavier pack of a step goes to the rank with fewer tokens so far, so per-rank
totals differ by at most one pack's cost::

    step   rank 0          rank 1
    0      [0]  8 tokens   [1]  8
    1      [2]  7          [3]  5
    2      [4]  2          [5]  3      (rank 1 was lighter: 13 < 15)
    total       17              16

Every rank computes the same table from (plan, seed, epoch, num_replicas), so no
communication is needed. With fewer episodes than ranks a rank gets an empty pack ``[]``: the
collator turns it into an all-padding batch with zero loss weight, which it can only build when
the streams are declared with ``step_shape``/``dtype`` (it has no episode to copy shapes from);
the rank still runs forward and backward, so DDP/FSDP collectives stay matched.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator
from itertools import chain
from typing import Any, Literal

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from packing._validate import check_bool, check_int, check_real
from packing.planning._plan import Algorithm, Oversize, PackPlan, plan_packs, positive_int
from packing.planning._steps import fill_packs, step_token_budget

__all__ = ["PackedBatchSampler", "equalise_packs"]

Balance = Literal["tokens", "attention"]


def equalise_packs(
    packs: list[list[int]], lengths: np.ndarray, num_replicas: int, min_tokens: float = 0.0
) -> list[list[int]]:
    """Split packs until their number is a multiple of ``num_replicas``; pad with ``[]`` only
    when no pack has two episodes left to split. Splitting keeps every episode exactly once.

    Packs with fewer than ``min_tokens`` tokens are split first: halving a pack that is
    already underfull (the step composer's last one) leaves the full packs full, where
    halving a full one would add two half-empty packs."""
    packs = list(packs)
    docs, tokens = _docs_and_cost(packs, lengths.astype(np.float64))
    while len(packs) % num_replicas or not packs:
        # The pack with most episodes (then most tokens, then first) loses least by halving;
        # an underfull pack before any full one.
        under = (tokens < min_tokens) * (docs.max(initial=0) + 1) * (tokens.max(initial=0) + 1)
        key = np.where(docs > 1, under + docs * (tokens.max(initial=0) + 1) + tokens, -1)
        i = int(np.argmax(key)) if len(key) else 0
        if not len(key) or key[i] < 0:
            packs.append([])
            docs, tokens = np.append(docs, 0), np.append(tokens, 0)
            continue
        halves: tuple[list[int], list[int]] = ([], [])
        loads = [0, 0]
        for item in sorted(packs[i], key=lambda x: (-int(lengths[x]), x)):
            side = 0 if loads[0] <= loads[1] else 1
            halves[side].append(item)
            loads[side] += int(lengths[item])
        packs[i] = halves[0]
        packs.append(halves[1])
        docs[i], tokens[i] = len(halves[0]), loads[0]
        docs, tokens = np.append(docs, len(halves[1])), np.append(tokens, loads[1])
    return packs


def _docs_and_cost(packs: list[list[int]], per_item: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Episodes per pack and the sum of ``per_item`` over each pack, vectorised."""
    docs = np.fromiter(map(len, packs), dtype=np.int64, count=len(packs))
    flat = np.fromiter(chain.from_iterable(packs), dtype=np.int64, count=int(docs.sum()))
    pack_of = np.repeat(np.arange(len(packs)), docs)
    return docs, np.bincount(pack_of, weights=per_item[flat], minlength=len(packs))


class PackedBatchSampler(Sampler[list[int]]):
    """Yields, for this rank, one pack (a list of item indices) per step.

    Give either ``lengths`` and ``token_budget`` (the plan is built here with ``plan_packs``)
    or a prebuilt ``plan`` (see ``PackPlan.from_json``/``from_arrow``). Without ``oversize="split"``
    items are dataset indices; with it they are rows of ``plan.pieces_I4``.

    ``num_replicas``/``rank`` default to ``torch.distributed`` when it is initialised, else 1/0.
    ``balance="attention"`` balances ranks by the sum of squared episode lengths (the cost of
    document-masked attention) instead of tokens. ``__len__`` is the number of packs this rank
    yields in a full epoch, identical on every rank. ``**split`` (``tokens_per_step``,
    ``fixed_tokens``, ``split_multiple``, ``split_overlap``) goes to ``plan_packs`` with
    ``oversize="split"``.

    ``replan=True`` re-plans the packs every epoch from ``(seed, epoch)``, so the episodes that
    share a step change from one epoch to the next (with a fixed plan only the order of the
    packs changes): the epoch's items are shuffled, cut into windows of ``replan_window``
    items and each window is planned with ``algorithm``. Every item is still in exactly one
    pack per epoch, every rank yields the same number of packs, and a state_dict resumes
    mid-epoch (the epoch's plan is recomputed from the seed). The number of packs per epoch,
    so ``len(sampler)``, can differ by a few from epoch to epoch; planning in windows costs
    a little fill (docs/planning.md gives the measured cost).

    The step's padding tail: a pack's dense layers cost its whole budget, so packs planned
    here are kept >= ``min_fill`` (default 0.97) full by `fill_packs`, all but at most one
    per plan (per window with ``replan``) when the lengths allow it; ``min_fill=None``
    keeps the planner's packs as they are (a prebuilt ``plan=`` is always kept as is); to
    reach a multiple of the ranks the underfull pack is halved first. A
    step defined by an episode count is ``episodes_per_step=K`` instead of
    ``token_budget``: the budget is ``K * mean(lengths)`` rounded up to 128
    (`step_token_budget`), and the count per step varies around K while the packs stay
    full; a time budget is ``token_budget=step_token_budget(lengths, step_seconds=...)``.
    """

    def __init__(
        self,
        lengths: Any = None,
        token_budget: int | None = None,
        *,
        plan: PackPlan | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        balance: Balance = "tokens",
        balance_window: int = 64,
        algorithm: Algorithm = "lookahead",
        max_docs: int | None = None,
        oversize: Oversize = "error",
        replan: bool = False,
        replan_window: int = 16_384,
        episodes_per_step: float | None = None,
        min_fill: float | None = 0.97,
        **split: int,
    ) -> None:
        replan = check_bool("replan", replan)
        replan_window = check_int("replan_window", replan_window, min=1, hint="items")
        if replan and plan is not None:
            raise ValueError(
                "replan=True plans the packs every epoch from lengths=; a prebuilt plan= is "
                "fixed. Pass lengths and token_budget instead"
            )
        if episodes_per_step is not None:
            if token_budget is not None or plan is not None:
                raise ValueError(
                    "episodes_per_step= defines the step's token budget from lengths=; pass "
                    "it instead of token_budget= (or plan=), not with it"
                )
            if lengths is None:
                raise ValueError("episodes_per_step= needs lengths= (the budget is planned)")
            token_budget = step_token_budget(lengths, episodes_per_step=episodes_per_step)
        if min_fill is not None and not 0.0 < check_real("min_fill", min_fill) <= 1.0:
            raise ValueError(f"min_fill={min_fill!r} must be in (0, 1], or None (plan as is)")
        self.min_fill = min_fill if plan is None else None  # a prebuilt plan is kept as is
        plan = _plan_of(plan, lengths, token_budget, algorithm, max_docs, oversize, split)
        if len(plan.items_N) == 0:  # it would yield one empty step an epoch, all padding
            raise ValueError(
                "PackedBatchSampler got no episode (lengths=[] or an empty plan): nothing to "
                "sample; pass the dataset's episode lengths"
            )
        if self.min_fill is not None:
            plan = _filled(plan, self.min_fill, algorithm, max_docs)
        num_replicas, rank = _world(num_replicas, rank)
        if balance not in ("tokens", "attention"):
            raise ValueError(f"balance={balance!r}; choose 'tokens' or 'attention'")
        seed = check_int(
            "seed", seed, min=0, hint="numpy seeds the epoch's shuffle with [seed, epoch]"
        )
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle={shuffle!r} must be True or False")
        self.plan = plan
        self.shuffle, self.seed = shuffle, check_int("seed", seed)
        self.num_replicas, self.rank = num_replicas, rank
        self.balance_window = positive_int("balance_window", balance_window, "steps")
        self.balance = balance
        self.replan, self.replan_window = replan, replan_window
        self._algorithm, self._max_docs = algorithm, max_docs
        self._epoch_cache: tuple[tuple[int, int], list[list[int]], np.ndarray] | None = None
        if self.replan:  # the packs of epoch 0 (each epoch has its own)
            self.packs, self.cost_P = self._plan_epoch(self.replan_packs(0))
        else:
            self.packs, self.cost_P = self._plan_epoch(plan.packs)
        self.epoch = 0
        self._start = 0  # steps already consumed in self.epoch, from load_state_dict
        self._yielded = 0
        self._fingerprint = zlib.crc32(
            np.concatenate([plan.item_lengths, plan.items_N, plan.offsets_P1]).tobytes()
        )
        if self.replan:
            self._fingerprint = zlib.crc32(
                f"replan {self.replan_window} min_fill {self.min_fill}".encode(),
                self._fingerprint,
            )

    def __len__(self) -> int:
        return self._num_steps(self.epoch)

    def all_ranks(self) -> AllRanks:
        """Every rank's packs, step by step (rank 0's, rank 1's, ... of step 0, then step 1):
        the batch sampler for a loader that deals batches to processes round-robin, as
        Hugging Face Accelerate's ``prepare`` does. Process ``r`` then gets exactly this
        sampler's rank-``r`` packs; given a per-rank sampler, ``prepare`` would keep one pack
        in ``num_replicas`` of its share and drop the rest."""
        return AllRanks(self)

    def _num_steps(self, epoch: int) -> int:
        return len(self._epoch_packs(epoch)[0]) // self.num_replicas

    def _plan_epoch(self, packs: list[list[int]]) -> tuple[list[list[int]], np.ndarray]:
        """Equalise ``packs`` to a multiple of the ranks and cost them."""
        lengths = self.plan.item_lengths
        floor = 0.0 if self.min_fill is None else self.min_fill * self.plan.token_budget
        packs = equalise_packs(packs, lengths, self.num_replicas, min_tokens=floor)
        power = 1 if self.balance == "tokens" else 2
        _, cost_P = _docs_and_cost(packs, lengths.astype(np.float64) ** power)
        return packs, cost_P

    def _epoch_packs(self, epoch: int) -> tuple[list[list[int]], np.ndarray]:
        """The packs of ``epoch`` and their costs: the fixed plan, or with ``replan`` the plan
        of the epoch's shuffled windows (cached for the last epoch asked for)."""
        if not self.replan:
            return self.packs, self.cost_P
        key = (self.seed, epoch)  # load_state_dict may change the seed
        if self._epoch_cache is None or self._epoch_cache[0] != key:
            self._epoch_cache = (key, *self._plan_epoch(self.replan_packs(epoch)))
        return self._epoch_cache[1], self._epoch_cache[2]

    def replan_packs(self, epoch: int) -> list[list[int]]:
        """The packs planned for ``epoch`` (``replan=True``), before equalising to the ranks:
        the plan's items shuffled by ``(seed, epoch)``, planned ``replan_window`` at a time."""
        epoch = check_int("epoch", epoch, min=0)
        items = np.random.default_rng([self.seed, epoch, 1]).permutation(self.plan.items_N)
        packs: list[list[int]] = []
        for lo in range(0, len(items), self.replan_window):
            window = items[lo : lo + self.replan_window]
            sub = plan_packs(
                self.plan.item_lengths[window],
                self.plan.token_budget,
                algorithm=self._algorithm,
                max_docs=self._max_docs,
            )
            sub_packs = sub.packs
            if self.min_fill is not None:
                sub_packs = fill_packs(
                    sub_packs, sub.item_lengths, sub.token_budget, min_fill=self.min_fill,
                    algorithm=self._algorithm, max_docs=self._max_docs,
                )  # fmt: skip
            packs += [window[p].tolist() for p in sub_packs]
        return packs

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (its shuffle); a resumed position is kept for the epoch it was in."""
        epoch = check_int("set_epoch(epoch)", epoch, min=0)
        if epoch != self.epoch:
            self._start = 0
        self.epoch = epoch

    def schedule(self, epoch: int | None = None) -> np.ndarray:
        """Pack ids of the epoch as a (steps, num_replicas) table; column r is rank r's order."""
        epoch = self.epoch if epoch is None else check_int("epoch", epoch, min=0)
        packs, cost_P = self._epoch_packs(epoch)
        n, r = len(packs), self.num_replicas
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        # Sort by cost inside windows of a few steps so each step's packs cost about the same,
        # while packs still travel across the whole epoch from one epoch to the next.
        win = r * self.balance_window
        for lo in range(0, n, win):
            chunk = order[lo : lo + win]
            order[lo : lo + win] = chunk[np.argsort(-cost_P[chunk], kind="stable")]
        steps: np.ndarray = order.reshape(-1, r)
        if self.shuffle:
            steps = steps[rng.permutation(len(steps))]
        # Heaviest pack of a step to the rank with the least cost so far (ties: lower rank):
        # this keeps every rank's running total within one pack's cost of every other's.
        if r == 1:  # nothing to balance
            return steps
        table = np.empty_like(steps)
        load = np.zeros(r)
        for s, row in enumerate(steps):
            row = row[np.argsort(-cost_P[row], kind="stable")]
            ranks = np.argsort(load, kind="stable")
            table[s, ranks] = row
            load[ranks] += cost_P[row]
        return table

    def __iter__(self) -> Iterator[list[int]]:
        # Not a generator itself: the position must reset when iter() is called, not at the
        # first next(), or a state_dict taken in between would describe the previous pass.
        start, self._start = self._start, 0
        self._yielded = start
        packs = self._epoch_packs(self.epoch)[0]
        return self._yield(packs, self.schedule()[start:, self.rank].tolist())

    def _yield(self, packs: list[list[int]], pack_ids: list[int]) -> Iterator[list[int]]:
        for p in pack_ids:
            self._yielded += 1
            yield list(packs[p])

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Position to resume from. ``consumed`` = packs the training loop has used this epoch;
        pass it when a DataLoader prefetches (the sampler runs ahead of training by up to
        ``num_workers * prefetch_factor`` packs); by default, the packs yielded so far.

        The settings that shape an epoch's order are saved too, so that a sampler built
        differently refuses the state instead of serving some episodes twice and others never.
        """
        if consumed is not None:
            consumed = check_int(
                "consumed", consumed, min=0, max=len(self), hint="packs used this epoch"
            )
        return {
            "epoch": self.epoch,
            "consumed": self._yielded if consumed is None else consumed,
            "version": _STATE_VERSION,
            "num_replicas": self.num_replicas,
            "fingerprint": self._fingerprint,
            **{k: getattr(self, k) for k in _ORDER_SETTINGS},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next ``__iter__`` yields exactly the packs of ``state['epoch']`` that
        were not consumed. Refuses a state saved by a sampler whose plan, world size, seed,
        shuffle or balancing differ (the remaining packs would not be the ones not served)."""
        need = ("epoch", "consumed", "num_replicas", "fingerprint", *_ORDER_SETTINGS)
        if not isinstance(state, dict):
            raise TypeError(
                f"state must be the dict PackedBatchSampler.state_dict() returned, got "
                f"{type(state).__name__}"
            )
        missing = [k for k in need if k not in state]
        version = state.get("version")
        if missing and version is None:
            raise KeyError(
                f"sampler state lacks {missing}: it was saved by an older packing release "
                f"(state version 1, without a 'version' key; this release reads version "
                f"{_STATE_VERSION}). Its epoch order cannot be reproduced safely: restart the "
                f"epoch (sampler.set_epoch(state['epoch'])) or resume with the release that "
                f"saved it"
            )
        if version is not None and version != _STATE_VERSION:
            raise ValueError(
                f"sampler state version {version!r}, this release reads version "
                f"{_STATE_VERSION}; resume with the packing release that saved it, or restart "
                "the epoch with set_epoch"
            )
        if missing:
            raise KeyError(
                f"sampler state lacks {missing}; pass the dict PackedBatchSampler.state_dict() "
                f"returned (it has {list(need)})"
            )
        if state["num_replicas"] != self.num_replicas or state["fingerprint"] != self._fingerprint:
            raise ValueError(
                f"state was saved with num_replicas={state['num_replicas']} and plan "
                f"fingerprint {state['fingerprint']}, this sampler has {self.num_replicas} and "
                f"{self._fingerprint}; resume with the same world size and plan (save the plan "
                f"with PackPlan.to_json and pass plan=)"
            )
        for k in _ORDER_SETTINGS:
            if state[k] != getattr(self, k):
                raise ValueError(
                    f"state was saved with {k}={state[k]!r}, this sampler has {k}="
                    f"{getattr(self, k)!r}: the epoch's order would differ, serving some "
                    f"episodes twice and others never; build the sampler with {k}={state[k]!r}"
                )
        consumed, epoch = state["consumed"], state["epoch"]
        epoch = check_int("state epoch", epoch, min=0)
        consumed = check_int("state consumed", consumed)
        steps = self._num_steps(epoch)
        if not 0 <= consumed <= steps:
            raise ValueError(f"consumed={consumed} is outside [0, {steps}]")
        self.epoch = epoch
        self._start = self._yielded = consumed


# state_dict's format: 1 had no "version" key (and no replan settings); 2 has them all.
_STATE_VERSION = 2

# What decides an epoch's order besides the plan and the world size.
_ORDER_SETTINGS = ("seed", "shuffle", "balance", "balance_window", "replan", "replan_window")


def _plan_of(
    plan: PackPlan | None,
    lengths: Any,
    token_budget: int | None,
    algorithm: Algorithm,
    max_docs: int | None,
    oversize: Oversize,
    split: dict[str, int],
) -> PackPlan:
    """The sampler's plan: the prebuilt ``plan`` or one planned from ``lengths``, never both
    (planning arguments given with a prebuilt plan would be ignored, so they are refused)."""
    if plan is None:
        if lengths is None or token_budget is None:
            raise ValueError("pass lengths and token_budget, or a prebuilt plan=")
        return plan_packs(
            lengths, token_budget, algorithm=algorithm, max_docs=max_docs, oversize=oversize,
            **split,
        )  # fmt: skip
    if lengths is not None or token_budget is not None:
        raise ValueError("pass either plan= or lengths/token_budget, not both")
    if split or max_docs is not None or oversize != "error" or algorithm != "lookahead":
        raise ValueError(
            "algorithm/max_docs/oversize/split arguments plan packs from lengths=; with "
            "plan= they would be ignored: pass them to plan_packs when building the plan"
        )
    return plan


def _filled(
    plan: PackPlan, min_fill: float, algorithm: Algorithm, max_docs: int | None
) -> PackPlan:
    """``plan`` with its underfull packs re-planned by `fill_packs` (the same items)."""
    packs = fill_packs(
        plan.packs, plan.item_lengths, plan.token_budget, min_fill=min_fill,
        algorithm=algorithm, max_docs=max_docs,
    )  # fmt: skip
    sizes = np.fromiter(map(len, packs), dtype=np.int64, count=len(packs))
    return dataclasses.replace(
        plan,
        items_N=np.fromiter(chain.from_iterable(packs), dtype=np.int64, count=int(sizes.sum())),
        offsets_P1=np.concatenate(([0], np.cumsum(sizes))).astype(np.int64),
    )


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """(ranks, this rank): given, or from the initialised process group, or (1, 0)."""
    live = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if live else 1
    if rank is None:
        rank = dist.get_rank() if live else 0
    num_replicas = check_int(
        "num_replicas", num_replicas, min=1, max=2**20, hint="data-parallel ranks"
    )
    rank = check_int("rank", rank, min=0)
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank={rank} is outside [0, num_replicas={num_replicas})")
    return num_replicas, rank


class AllRanks(Sampler[list[int]]):
    """`PackedBatchSampler.all_ranks`: the schedule's table read row by row."""

    def __init__(self, sampler: PackedBatchSampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler) * self.sampler.num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        packs = self.sampler._epoch_packs(self.sampler.epoch)[0]
        for row in self.sampler.schedule().tolist():
            for p in row:
                yield list(packs[p])
