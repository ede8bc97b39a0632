"""PackedBatchSampler: every rank the same number of packs, every episode exactly once per
epoch, balanced ranks, and exact mid-epoch resume."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from packing.planning import plan_packs
from packing.planning._sampler import PackedBatchSampler, equalise_packs

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ranks(lengths, budget, world, **kw) -> list[PackedBatchSampler]:
    return [
        PackedBatchSampler(lengths, budget, num_replicas=world, rank=r, **kw) for r in range(world)
    ]


def test_two_ranks_hand_case():
    # Packs [8], [8], [7, 1], [5, 2] -> 4 packs, 2 steps; the heavier pack of each step goes
    # to the rank with fewer tokens so far.
    r0, r1 = ranks([8, 8, 7, 5, 2, 1], 8, 2, shuffle=False)
    assert len(r0) == len(r1) == 2
    got = [*list(r0), *list(r1)]
    assert sorted(i for p in got for i in p) == [0, 1, 2, 3, 4, 5]
    assert sorted(map(sorted, got)) == [[0], [1], [2, 5], [3, 4]]


def test_fewer_episodes_than_ranks_gives_empty_packs():
    samplers = ranks([5, 3], 8, 4)
    out = [list(s) for s in samplers]
    assert all(len(o) == 1 for o in out)
    assert sorted(i for o in out for p in o for i in p) == [0, 1]
    assert sum(p == [] for o in out for p in o) == 2


def test_equalise_splits_packs_instead_of_truncating():
    lengths = np.array([4, 3, 2, 1, 8])
    packs = equalise_packs([[0, 1, 2, 3], [4]], lengths, 3)
    assert len(packs) == 3 and sorted(i for p in packs for i in p) == [0, 1, 2, 3, 4]
    assert [] not in packs


def test_epoch_and_rank_defaults():
    s = PackedBatchSampler([3, 4, 5], 8)  # torch.distributed is not initialised here
    assert (s.num_replicas, s.rank) == (1, 0)
    with pytest.raises(ValueError, match="rank=2 is outside"):
        PackedBatchSampler([3], 8, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="pass lengths and token_budget"):
        PackedBatchSampler()
    with pytest.raises(ValueError, match="with plan= they would be ignored"):
        PackedBatchSampler(plan=plan_packs([3, 4], 8), max_docs=1)


def test_each_epoch_has_its_own_order_from_seed_and_epoch_not_the_global_rng():
    lengths = list(range(1, 61))
    a = PackedBatchSampler(lengths, 64, seed=7)
    b = PackedBatchSampler(lengths, 64, seed=7)
    np_state, py_state, torch_state = (
        np.random.get_state(),
        random.getstate(),
        torch.get_rng_state(),
    )
    e0 = list(a)
    a.set_epoch(1)
    e1 = list(a)
    np.random.seed(123)  # the global RNG must not matter
    assert list(b) == e0 and e0 != e1
    np.random.set_state(np_state)
    assert random.getstate() == py_state and torch.equal(torch.get_rng_state(), torch_state)
    assert sorted(map(sorted, e0)) == sorted(map(sorted, e1))  # same packs, new order


def test_works_as_a_dataloader_batch_sampler():
    data = [{"x": torch.full((n, 2), float(i)), "i": i} for i, n in enumerate([3, 5, 2, 7, 1])]
    sampler = PackedBatchSampler([3, 5, 2, 7, 1], 8, seed=1)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=lambda eps: [e["i"] for e in eps])
    assert sorted(i for batch in loader for i in batch) == [0, 1, 2, 3, 4]


def test_split_plan_yields_piece_ids():
    plan = plan_packs([5, 30, 4], 8, oversize="split", split_overlap=2)
    s = PackedBatchSampler(plan=plan, num_replicas=2, rank=0)
    t = PackedBatchSampler(plan=plan, num_replicas=2, rank=1)
    ids = sorted(i for p in [*s, *t] for i in p)
    assert plan.pieces_I4 is not None and ids == list(range(len(plan.pieces_I4)))


def test_invariants_over_many_layouts():
    seen = {"many_docs": 0, "empty": 0, "split": 0, "unequal": 0}

    @FAST
    @given(
        lengths=st.one_of(
            st.lists(st.integers(1, 50), min_size=1, max_size=70),
            st.lists(st.integers(1, 12), min_size=10, max_size=70),  # many episodes a pack
            st.lists(st.integers(40, 50), min_size=1, max_size=4),  # fewer packs than ranks
        ),
        budget=st.integers(50, 150),
        world=st.integers(1, 5),
        seed=st.integers(0, 3),
        epoch=st.integers(0, 3),
        shuffle=st.booleans(),
        balance=st.sampled_from(["tokens", "attention"]),
    )
    def check(lengths, budget, world, seed, epoch, shuffle, balance):
        samplers = ranks(lengths, budget, world, seed=seed, shuffle=shuffle, balance=balance)
        for s in samplers:
            s.set_epoch(epoch)
        out = [list(s) for s in samplers]
        # same number of packs on every rank, equal to len()
        assert {len(o) for o in out} == {len(samplers[0])}
        # every episode exactly once across ranks
        assert sorted(i for o in out for p in o for i in p) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in p) <= budget for o in out for p in o)
        # ranks' totals (of the balanced cost) differ by at most one pack's cost
        power = 1 if balance == "tokens" else 2
        totals = [sum(lengths[i] ** power for p in o for i in p) for o in out]
        biggest = max(sum(lengths[i] ** power for i in p) for o in out for p in o)
        assert max(totals) - min(totals) <= biggest
        plan_size = len(plan_packs(lengths, budget))
        seen["many_docs"] += any(len(p) >= 5 for o in out for p in o)
        seen["empty"] += any(p == [] for o in out for p in o)
        seen["split"] += len(samplers[0].packs) > plan_size and [] not in samplers[0].packs
        seen["unequal"] += len(set(totals)) > 1

    check()
    assert all(v >= 5 for v in seen.values()), seen


def test_resume_mid_epoch_yields_exactly_the_rest():
    seen = {"mid": 0}

    @FAST
    @given(
        # from one episode (a single pack, nothing to resume in the middle) to a few dozen
        lengths=st.one_of(
            st.lists(st.integers(1, 40), min_size=1, max_size=4),
            st.lists(st.integers(1, 40), min_size=8, max_size=60),
        ),
        world=st.integers(1, 4),
        epoch=st.integers(0, 2),
        cut=st.floats(0, 1),
    )
    def check(lengths, world, epoch, cut):
        for rank in range(world):
            a = PackedBatchSampler(lengths, 64, num_replicas=world, rank=rank, seed=5)
            a.set_epoch(epoch)
            full = list(a)
            k = int(cut * len(full))
            it = iter(a)
            head = [next(it) for _ in range(k)]
            state = a.state_dict()
            b = PackedBatchSampler(lengths, 64, num_replicas=world, rank=rank, seed=5)
            b.load_state_dict(state)
            b.set_epoch(epoch)  # the usual loop calls set_epoch again: the position is kept
            assert head + list(b) == full
            assert list(b) == full  # the next pass over the same epoch starts from the top
            seen["mid"] += 0 < k < len(full)

    check()
    assert seen["mid"] >= 20, seen


def test_state_dict_with_consumed_count_for_prefetching_loaders():
    s = PackedBatchSampler(list(range(1, 40)), 40, seed=2)
    full = list(s)
    it = iter(s)
    for _ in range(5):  # a DataLoader ran 5 ahead, training consumed 3
        next(it)
    t = PackedBatchSampler(list(range(1, 40)), 40, seed=2)
    t.load_state_dict(s.state_dict(consumed=3))
    assert list(t) == full[3:]


def test_resume_refuses_another_world_size_or_plan():
    state = PackedBatchSampler([3, 4, 5], 8, num_replicas=2, rank=0).state_dict()
    with pytest.raises(ValueError, match=r"num_replicas=2.*same world size and plan"):
        PackedBatchSampler([3, 4, 5], 8, num_replicas=1, rank=0).load_state_dict(state)
    with pytest.raises(ValueError, match="same world size and plan"):
        PackedBatchSampler([3, 4, 6], 8, num_replicas=2, rank=0).load_state_dict(state)


# ---- re-planning every epoch ----------------------------------------------------------------


def test_replan_gives_each_epoch_its_own_packs_each_episode_once_equal_counts():
    seen = {"changed": 0}

    @FAST
    @given(
        lengths=st.lists(st.integers(1, 40), min_size=1, max_size=80),
        world=st.integers(1, 4),
        window=st.sampled_from([4, 16, 16_384]),
        max_docs=st.sampled_from([None, 3]),
    )
    def check(lengths, world, window, max_docs):
        per_epoch = []
        for epoch in (0, 1):
            samplers = ranks(lengths, 64, world, seed=3, replan=True, replan_window=window,
                             max_docs=max_docs)  # fmt: skip
            for s in samplers:
                s.set_epoch(epoch)
            got = [list(s) for s in samplers]
            assert len({len(g) for g in got}) == 1 and len(got[0]) == len(samplers[0])
            items = sorted(i for g in got for p in g for i in p)
            assert items == list(range(len(lengths)))  # every episode exactly once
            for g in got:
                for p in g:
                    assert sum(lengths[i] for i in p) <= 64
                    assert max_docs is None or len(p) <= max_docs
            per_epoch.append({frozenset(p) for g in got for p in g if p})
        seen["changed"] += per_epoch[0] != per_epoch[1]

    check()
    assert seen["changed"] >= 20, seen  # packs really change from one epoch to the next


def test_replan_resumes_mid_epoch_and_reproduces_every_epoch():
    lengths = np.random.default_rng(0).integers(1, 40, 300).tolist()
    a = PackedBatchSampler(lengths, 64, seed=7, replan=True, replan_window=50)
    a.set_epoch(3)
    full = list(a)
    it = iter(a)
    head = [next(it) for _ in range(11)]
    b = PackedBatchSampler(lengths, 64, seed=7, replan=True, replan_window=50)
    b.load_state_dict(a.state_dict())
    assert head + list(b) == full
    c = PackedBatchSampler(lengths, 64, seed=7, replan=True, replan_window=50)
    c.set_epoch(3)
    assert list(c) == full
    fixed = PackedBatchSampler(lengths, 64, seed=7)
    with pytest.raises(ValueError, match="same world size and plan"):
        fixed.load_state_dict(a.state_dict())  # a re-planned position is not a fixed plan's


def test_replan_is_refused_with_a_prebuilt_plan():
    plan = plan_packs([3, 4, 5], 8)
    with pytest.raises(ValueError, match="replan=True plans the packs every epoch"):
        PackedBatchSampler(plan=plan, replan=True)


def test_replan_refuses_a_state_with_another_seed_and_resumes_with_the_same():
    # The seed decides each epoch's re-planned packs: another seed's state is refused, the
    # same seed's resumes to the very packs (even after caching another epoch's plan).
    lengths = np.random.default_rng(1).integers(1, 40, 200).tolist()
    a = PackedBatchSampler(lengths, 64, seed=11, replan=True, replan_window=40)
    a.set_epoch(2)
    full = list(a)
    b = PackedBatchSampler(lengths, 64, seed=0, replan=True, replan_window=40)
    with pytest.raises(ValueError, match="seed=11"):
        b.load_state_dict({**a.state_dict(), "consumed": 0})
    c = PackedBatchSampler(lengths, 64, seed=11, replan=True, replan_window=40)
    c.set_epoch(1)
    list(c)  # caches epoch 1's packs
    c.load_state_dict({**a.state_dict(), "consumed": 0})
    assert list(c) == full
