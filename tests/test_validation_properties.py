"""Property tests of the public boundary (issue 25, STYLE.md rule 14).

Valid random inputs give what a slow reference computes; invalid random values fed to every
public size, flag and sequence argument raise packing's own ``TypeError``/``ValueError`` naming
the argument, never a result and never an error from inside numpy or torch. Small settings
(``max_examples`` <= 50) keep CI fast.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from packing.attention import (
    dense_mask,
    document_mask_mod,
    frame_causal,
    make_block_mask,
    sliding_window,
)
from packing.data import PackedCollator, Stream, layout_from_lengths, unpack
from packing.model import DiTConfig
from packing.planning import (
    BufferedPacker,
    PackedBatchSampler,
    frames_to_tokens,
    plan_packs,
    split_windows,
)
from packing.serve import (
    EngineConfig,
    FlowScheduler,
    PackShape,
    Request,
    VideoRequest,
    VideoShape,
)
from packing.train import LossNormalizer, MemoryModel, StepProfiler, episode_seed, reduce_loss

PACKAGE = str(Path(__file__).resolve().parents[1] / "packing")
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- bad values, by the kind of argument they are fed to -------------------------------------
not_int = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),  # 128.0 too: a float is not a size
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.just(np.float64(2.0)),
    st.just(2.5),
    st.lists(st.integers(1, 3), max_size=2),
)
not_bool = st.one_of(
    st.integers(), st.text(max_size=3), st.none(), st.floats(allow_nan=False), st.just("no")
)


def _below(minimum: int) -> st.SearchStrategy[int]:
    return st.integers(-(2**40), minimum - 1)


# (entry, argument name, min): ``entry(value)`` calls a public function with that argument.
INT_ARGS: list[tuple[str, Callable[[Any], Any], int]] = [
    ("token_budget", lambda v: plan_packs([3, 4, 5], v), 1),
    ("max_docs", lambda v: plan_packs([3, 4, 5], 8, max_docs=v), 1),
    ("split_overlap", lambda v: plan_packs([3, 9], 4, oversize="split", split_overlap=v), 0),
    ("tokens_per_step", lambda v: plan_packs([3, 4], 8, tokens_per_step=v), 1),
    ("fixed_tokens", lambda v: plan_packs([3, 4], 8, fixed_tokens=v), 0),
    ("split_multiple", lambda v: plan_packs([3, 4], 8, split_multiple=v), 1),
    ("temporal_compression", lambda v: frames_to_tokens([5], temporal_compression=v), 1),
    ("action_tokens_per_frame", lambda v: frames_to_tokens([5], action_tokens_per_frame=v), 0),
    ("text_tokens", lambda v: frames_to_tokens([5], text_tokens=v), 0),
    ("latent_hw", lambda v: frames_to_tokens([5], latent_hw=(v, 16)), 1),
    ("seed", lambda v: PackedBatchSampler([3, 4, 5], 8, seed=v), 0),
    ("balance_window", lambda v: PackedBatchSampler([3, 4, 5], 8, balance_window=v), 1),
    ("replan_window", lambda v: PackedBatchSampler([3, 4], 8, replan=True, replan_window=v), 1),
    ("num_replicas", lambda v: PackedBatchSampler([3, 4, 5], 8, num_replicas=v, rank=0), 1),
    ("token_budget", lambda v: BufferedPacker(v), 1),
    ("buffer_size", lambda v: BufferedPacker(8, buffer_size=v), 1),
    ("token_budget", lambda v: PackedCollator(["x"], token_budget=v), 1),
    ("pad_to_multiple", lambda v: PackedCollator(["x"], pad_to_multiple=v), 1),
    ("max_docs", lambda v: PackedCollator(["x"], max_docs=v), 1),
    ("tokens_per_step", lambda v: Stream("x", tokens_per_step=v), 1),
    ("budget", lambda v: Stream("x", budget=v), 1),
    ("grid", lambda v: Stream("x", grid=(v, 2)), 1),
    ("block_size", lambda v: make_block_mask(torch.tensor([0, 0, 1]), block_size=v), 1),
    ("tokens_per_frame", lambda v: frame_causal(v), 1),
    ("window", lambda v: sliding_window(v), 0),
    ("num_steps", lambda v: split_windows(v, 4), 1),
    ("max_steps", lambda v: split_windows(10, v), 1),
    ("overlap", lambda v: split_windows(10, 4, overlap=v), 0),
    (
        "tokens_per_step",
        lambda v: reduce_loss(torch.ones(3), torch.tensor([0, 0, 1]), "frame", tokens_per_step=v),
        1,
    ),
    ("DiTConfig.depth", lambda v: dataclasses.replace(DiTConfig.tiny(), depth=v), 1),
    ("lengths[0]", lambda v: layout_from_lengths([v], [1], 8), 1),
    ("kernel_step", lambda v: StepProfiler(enabled=True, kernel_step=v), 0),
    ("tokens", lambda v: StepProfiler(enabled=False).micro_step(tokens=v), 0),
    (
        "multiple",
        lambda v: MemoryModel(fixed=0, per_token=1, per_token_block=0).max_tokens(
            1e9, 10, 2, 1, multiple=v
        ),
        1,
    ),
]
_CTX = torch.zeros(0, 4, 2, 2)  # a request with no context frames
_TXT = torch.zeros(3, 8)
INT_ARGS += [
    *[(f"PackShape.{k}", lambda v, k=k: PackShape(**{"frames": 2, "actions": 2, "requests": 1, k: v}), 1)
      for k in ("frames", "actions", "requests")],
    *[(f"VideoShape.{k}", lambda v, k=k: VideoShape(**{"frames": 2, "text": 4, "requests": 1, k: v}), 1)
      for k in ("frames", "text", "requests")],
    ("Request.frames", lambda v: Request(context=_CTX, frames=v, actions=2), 0),
    ("Request.actions", lambda v: Request(context=_CTX, frames=2, actions=v), 1),
    ("Request.steps", lambda v: Request(context=_CTX, frames=2, actions=2, steps=v), 1),
    ("VideoRequest.frames", lambda v: VideoRequest(context=_CTX, text=_TXT, frames=v), 1),
    ("VideoRequest.steps", lambda v: VideoRequest(context=_CTX, text=_TXT, frames=2, steps=v), 1),
    ("EngineConfig.max_steps", lambda v: EngineConfig(
        shapes=[PackShape(frames=2, actions=2, requests=1)], max_steps=v), 1),
    ("steps", lambda v: FlowScheduler().sigmas(v), 1),
]  # fmt: skip
# Entries whose argument is optional (None is valid: unset).
OPTIONAL = [
    call for name, call, _ in INT_ARGS if name in ("max_docs", "budget", "kernel_step", "tokens")
]
OPTIONAL += [INT_ARGS[16][1]]  # PackedCollator(token_budget=None)
BOOL_ARGS: list[tuple[str, Callable[[Any], Any]]] = [
    ("shuffle", lambda v: PackedBatchSampler([3, 4, 5], 8, shuffle=v)),
    ("replan", lambda v: PackedBatchSampler([3, 4, 5], 8, replan=v)),
    ("pin_memory", lambda v: PackedCollator(["x"], pin_memory=v)),
    ("check_finite", lambda v: PackedCollator(["x"], check_finite=v)),
    ("causal", lambda v: sliding_window(2, causal=v)),
    (
        "dp_averages_gradients",
        lambda v: LossNormalizer.for_step([torch.tensor([0, 0])], "token", dp_averages_gradients=v),
    ),
    ("DiTConfig.document_mask", lambda v: dataclasses.replace(DiTConfig.tiny(), document_mask=v)),
]
SEQUENCE_ARGS: list[tuple[str, Callable[[Any], Any]]] = [
    ("streams", lambda v: PackedCollator(v)),
    ("lengths", lambda v: plan_packs(v, 8)),
    ("layouts", lambda v: LossNormalizer.for_step(v, "token")),
    ("joint", lambda v: PackedCollator(["x", "y"], joint=[v])),
]


def _refused(call: Callable[[], Any], name: str) -> None:
    """``call()`` raises packing's TypeError/ValueError naming ``name``; anything else fails."""
    try:
        result = call()
    except (TypeError, ValueError) as e:
        head = name.split("[")[0].split(".")[-1]
        assert head in str(e), f"{type(e).__name__} does not name {name!r}: {e}"
        where = traceback.extract_tb(e.__traceback__)[-1].filename
        assert PACKAGE in where, f"raised inside a dependency ({where}), not by packing: {e}"
        return
    raise AssertionError(f"{name}: a bad value gave a result ({result!r}) instead of an error")


@SETTINGS
@given(entry=st.sampled_from(INT_ARGS), bad=not_int)
def test_a_size_that_is_not_an_int_is_refused_by_name(entry, bad):
    name, call, _ = entry
    if bad is None and any(call is c for c in OPTIONAL):  # None means "unset" there
        call(None)
        return
    _refused(lambda: call(bad), name)


@SETTINGS
@given(entry=st.sampled_from(INT_ARGS), data=st.data())
def test_a_size_below_its_minimum_is_refused_by_name(entry, data):
    name, call, minimum = entry
    _refused(lambda: call(data.draw(_below(minimum))), name)


@pytest.mark.parametrize(("name", "call", "minimum"), INT_ARGS, ids=[a[0] for a in INT_ARGS])
def test_numpy_ints_are_ints(name, call, minimum):
    """Nothing correct becomes an error: a numpy int equal to a valid Python int is accepted
    where the Python int is, with the same result."""
    value = max(minimum, {"split_overlap": 0, "overlap": 0, "token_budget": 8}.get(name, 2))
    try:
        want = call(value)
    except (TypeError, ValueError):  # the value is invalid for another reason: same for both
        with pytest.raises((TypeError, ValueError)):
            call(np.int64(value))
        return
    got = call(np.int64(value))
    if isinstance(want, np.ndarray):
        assert np.array_equal(got, want)
    elif isinstance(want, list):
        assert got == want


@SETTINGS
@given(bad=not_int, which=st.integers(0, 2))
def test_noise_keys_that_are_not_ints_are_refused_by_name(bad, which):
    keys = [0, 0, 0]
    keys[which] = bad
    _refused(lambda: episode_seed(*keys), ("seed", "step", "episode_index")[which])


@SETTINGS
@given(entry=st.sampled_from(BOOL_ARGS), bad=not_bool)
def test_a_flag_that_is_not_a_bool_is_refused_by_name(entry, bad):
    name, call = entry
    _refused(lambda: call(bad), name)


@SETTINGS
@given(entry=st.sampled_from(SEQUENCE_ARGS), text=st.text(min_size=1, max_size=4))
def test_a_string_is_never_read_as_a_sequence(entry, text):
    name, call = entry
    _refused(lambda: call(text), name)


# -- valid inputs against slow references -------------------------------------------------------
@st.composite
def doc_ids(draw: st.DrawFn) -> torch.Tensor:
    """Contiguous runs of increasing ids (some beyond int32), then padding."""
    lengths = draw(st.lists(st.integers(1, 5), min_size=1, max_size=5))
    gaps = draw(st.lists(st.sampled_from([1, 2, 2**31, 2**32]), min_size=len(lengths),
                         max_size=len(lengths)))  # fmt: skip
    ids, start = [], draw(st.sampled_from([0, 2**32 - 1]))
    for n, g in zip(lengths, gaps, strict=True):
        ids += [start] * n
        start += g
    ids += [-1] * draw(st.integers(0, 3))
    return torch.tensor(ids, dtype=torch.int64)


@SETTINGS
@given(ids=doc_ids())
def test_dense_mask_equals_the_pairwise_reference(ids):
    want = torch.tensor(
        [[bool(a == b and a >= 0) for b in ids.tolist()] for a in ids.tolist()], dtype=torch.bool
    )
    assert torch.equal(dense_mask(ids), want)
    mod = document_mask_mod(ids)
    q = torch.arange(len(ids))[:, None]
    assert torch.equal(mod(0, 0, q, q.T), want)


@SETTINGS
@given(ids=doc_ids(), data=st.data())
def test_reduce_loss_equals_the_per_episode_loop(ids, data):
    loss = torch.tensor(
        data.draw(st.lists(st.floats(0, 10), min_size=len(ids), max_size=len(ids))),
        dtype=torch.float64,
    )
    docs = [d for d in dict.fromkeys(ids.tolist()) if d >= 0]
    per_ep = [loss[ids == d] for d in docs]
    want_token = sum(float(x.sum()) for x in per_ep) / sum(len(x) for x in per_ep)
    want_episode = sum(float(x.mean()) for x in per_ep) / len(per_ep)
    assert float(reduce_loss(loss, ids, "token")) == pytest.approx(want_token)
    assert float(reduce_loss(loss, ids, "episode")) == pytest.approx(want_episode)


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 20), max_size=30),
    budget=st.integers(20, 40),
    max_docs=st.one_of(st.none(), st.integers(1, 4)),
    algorithm=st.sampled_from(["lookahead", "bfd", "ffd", "next_fit"]),
)
def test_plans_hold_every_episode_once_within_the_budget(lengths, budget, max_docs, algorithm):
    plan = plan_packs(lengths, budget, max_docs=max_docs, algorithm=algorithm)
    assert sorted(i for p in plan.packs for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= budget for p in plan.packs)
    assert max_docs is None or all(len(p) <= max_docs for p in plan.packs)
    if algorithm == "next_fit" and max_docs is None:  # the reference: greedy in data order
        packs: list[list[int]] = []
        for i, n in enumerate(lengths):
            if not packs or sum(lengths[j] for j in packs[-1]) + n > budget:
                packs.append([])
            packs[-1].append(i)
        assert plan.packs == packs


@SETTINGS
@given(
    num_steps=st.integers(1, 60),
    max_steps=st.integers(1, 12),
    multiple=st.integers(1, 3),
    overlap_k=st.integers(0, 3),
)
def test_split_windows_give_every_step_loss_exactly_once(num_steps, max_steps, multiple, overlap_k):
    overlap = overlap_k * multiple
    try:
        wins = split_windows(num_steps, max_steps, multiple=multiple, overlap=overlap)
    except ValueError as e:  # impossible windows are named, never a wrong split
        assert "split_overlap" in str(e) or "overlap" in str(e)
        assert overlap >= (max_steps // multiple) * multiple or max_steps < multiple
        return
    loss = [0] * num_steps
    for start, stop, loss_start in wins:
        assert stop - start <= max_steps and start <= loss_start <= stop
        for s in range(loss_start, stop):
            loss[s] += 1
    assert loss == [1] * num_steps


@SETTINGS
@given(
    frames=st.lists(st.integers(1, 50), min_size=1, max_size=6),
    tc=st.sampled_from([1, 4]),
    hw=st.sampled_from([(8, 16), (6, 10), (2, 2)]),
    action=st.integers(0, 8),
    text=st.integers(0, 20),
)
def test_frames_to_tokens_equals_its_formula(frames, tc, hw, action, text):
    got = frames_to_tokens(frames, temporal_compression=tc, latent_hw=hw,
                           action_tokens_per_frame=action, text_tokens=text)  # fmt: skip
    f_lat = [n if tc == 1 else 1 + (n - 1) // tc for n in frames]
    per_frame = (hw[0] // 2) * (hw[1] // 2)
    assert got.tolist() == [f * per_frame + f * action + text for f in f_lat]


@SETTINGS
@given(
    steps=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    multiple=st.sampled_from([1, 4, 128]),
)
def test_collate_then_unpack_gives_the_episodes_back(steps, multiple):
    eps = [
        {"x": torch.arange(n * 2, dtype=torch.float32).view(n, 2) + 100 * k, "episode_index": k}
        for k, n in enumerate(steps)
    ]
    batch = PackedCollator(["x"], pad_to_multiple=multiple, check_finite=True)(eps)
    back = unpack(batch)
    assert [b["episode_index"] for b in back] == list(range(len(steps)))
    assert all(torch.equal(b["x"], e["x"]) for b, e in zip(back, eps, strict=True))


@SETTINGS
@given(seed=st.integers(0, 2**40), step=st.integers(0, 10**6), ep=st.integers(0, 10**6))
def test_episode_seed_is_the_same_for_numpy_ints(seed, step, ep):
    assert episode_seed(np.int64(seed), np.int64(step), np.int64(ep)) == episode_seed(
        seed, step, ep
    )


@SETTINGS
@given(ids=st.lists(st.integers(-1, 3), min_size=1, max_size=12))
@example(ids=[0, 0, 1, 1, -1])  # accepted by both
@example(ids=[0, 0, 1, 1, 0, 0])  # refused by both (reduce_loss counted three episodes)
def test_reduce_loss_and_the_block_mask_accept_and_refuse_the_same_doc_ids(ids):
    t = torch.tensor(ids)
    outcomes = []
    for call in (
        lambda: make_block_mask(t, block_size=4),
        lambda: reduce_loss(torch.ones(len(ids)), t, "episode"),
    ):
        try:
            call()
            outcomes.append("ok")
        except ValueError as e:
            assert "doc_ids" in str(e)
            outcomes.append("refused")
    assert outcomes[0] == outcomes[1], (ids, outcomes)


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    seed=st.integers(0, 1000),
)
def test_hf_episodes_serve_frames_in_time_order_whatever_the_row_order(lengths, seed):
    datasets = pytest.importorskip("datasets")
    from packing.datasets import HFEpisodes

    rows = [(e, t) for e, n in enumerate(lengths) for t in range(n)]
    ds = datasets.Dataset.from_dict(
        {"episode_index": [e for e, _ in rows], "frame_index": [t for _, t in rows],
         "action": [[float(100 * e + t)] for e, t in rows]}
    ).shuffle(seed=seed)  # fmt: skip
    eps = HFEpisodes(ds, ["action"])
    for e, n in enumerate(lengths):
        assert eps[e]["action"][:, 0].tolist() == [100.0 * e + t for t in range(n)]


@pytest.mark.parametrize("flag", [np.True_, np.False_, True, False])
def test_numpy_bools_are_bools_and_come_back_as_python_bools(flag):
    from packing._validate import check_bool

    out = check_bool("flag", flag)
    assert type(out) is bool and out == bool(flag)
    PackedCollator(["x"], pin_memory=False, check_finite=flag)  # accepted


@SETTINGS
@given(
    steps=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    data=st.data(),
    bad=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
)
def test_check_finite_names_the_first_bad_value_of_the_right_episode(steps, data, bad):
    eps = [{"x": torch.zeros(n, 3), "episode_index": 10 + k} for k, n in enumerate(steps)]
    k = data.draw(st.integers(0, len(steps) - 1))
    row, col = data.draw(st.integers(0, steps[k] - 1)), data.draw(st.integers(0, 2))
    eps[k]["x"][row, col] = bad
    with pytest.raises(ValueError) as e:
        PackedCollator(["x"], check_finite=True)(eps)
    assert f"episode {k} (episode_index {10 + k}) 'x' holds {bad}" in str(e.value)
    assert f"at index ({row}, {col})" in str(e.value)
