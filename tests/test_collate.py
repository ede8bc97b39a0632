"""The collate contract: K episodes -> one PackedBatch, exactly, and back."""

from __future__ import annotations

import copy
import pickle

import hypothesis.strategies as st
import numpy as np
import pytest
import reference
import torch
from hypothesis import given, settings

from packing.data import (
    PackedBatch,
    PackedCollator,
    Stream,
    joint_layout,
    layout_from_lengths,
    pack,
    unpack,
)
from packing.data import _collate as collate

SETTINGS = settings(max_examples=150, deadline=None)


def identity_episode(i: int, n: int, width: int = 3, **extra):
    """Values encode identity: x[t, c] = 1000 * episode + 10 * t + c."""
    t = torch.arange(n)[:, None] * 10 + torch.arange(width)[None, :]
    return {"x": (1000 * i + t).float(), "episode_index": i, **extra}


def test_three_episodes_by_hand():
    eps = [identity_episode(i, n) for i, n in enumerate([2, 4, 3])]
    b = pack(eps, pad_to_multiple=4)
    assert b["doc_ids"].tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2, -1, -1, -1]
    assert b["position_ids"].tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 2, 0, 0, 0]
    assert b["cu_seqlens"].tolist() == [0, 2, 6, 9]
    assert b["max_seqlen"] == 4 and isinstance(b["max_seqlen"], int)
    assert b["doc_ids"].dtype == torch.int32 and b["cu_seqlens"].dtype == torch.int32
    assert b["episode_index"].tolist() == [0, 1, 2]
    assert b["x"].shape == (12, 3)
    assert torch.equal(b["x"][9:], torch.zeros(3, 3)), "padding is the stream's pad value"
    assert b.num_docs == 3 and b.layout().num_tokens == 9


def test_default_padding_is_a_multiple_of_128():
    b = pack([identity_episode(0, 130)])
    assert b["x"].shape[0] == 256 and b["doc_ids"][130:].eq(-1).all()


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=9),
    multiple=st.sampled_from([1, 8, 128]),
)
def test_every_token_lands_in_its_episode_at_its_position(lengths, multiple):
    eps = [identity_episode(i, n) for i, n in enumerate(lengths)]
    b = pack(eps, pad_to_multiple=multiple)
    total = sum(lengths)
    doc, pos = b["doc_ids"].long(), b["position_ids"].long()
    real = doc >= 0
    assert int(real.sum()) == total and bool(real[:total].all()), "padding only at the tail"
    expected = 1000 * doc[real] + 10 * pos[real]
    assert torch.equal(b["x"][real][:, 0], expected.float())
    assert b["x"].shape[0] % multiple == 0 and b["x"].shape[0] - total < multiple
    cu = b["cu_seqlens"].tolist()
    assert cu == [0, *np.cumsum(lengths).tolist()]
    assert b["max_seqlen"] == max(lengths)


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    dtype=st.sampled_from([torch.float16, torch.float32, torch.int64, torch.bool]),
)
def test_unpack_returns_the_episodes_exactly(lengths, dtype):
    g = torch.Generator().manual_seed(sum(lengths))
    eps = []
    for i, n in enumerate(lengths):
        x = (torch.randn(n, 2, 3, generator=g) * 10).to(dtype)
        eps.append(
            {
                "x": x,
                "y": torch.randn(n, generator=g),
                "episode_index": 7 * i,
                "task": f"task {i}",
                "timestep": 0.1 * i,  # a float64 python float must survive exactly
                "flag": i % 2 == 0,
                "cond": torch.tensor(float(i)),
            }
        )
    back = unpack(pack(eps))
    assert len(back) == len(eps)
    for a, b in zip(eps, back, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
            else:
                assert type(a[k]) is type(b[k]) and a[k] == b[k], k


def test_per_episode_values_are_stacked_per_document():
    eps = [identity_episode(i, 2, task=f"t{i}", timestep=0.25 * i) for i in range(3)]
    b = pack(eps)
    assert b["task"] == ["t0", "t1", "t2"]
    assert b["timestep"].dtype == torch.float64 and b["timestep"].tolist() == [0, 0.25, 0.5]


def test_missing_episode_index_is_the_position_in_the_pack_and_unpack_does_not_invent_it():
    eps = [{"x": torch.ones(2, 1)}, {"x": torch.ones(3, 1)}]
    b = pack(eps)
    assert b["episode_index"].tolist() == [0, 1]
    assert all("episode_index" not in e for e in unpack(b))


# -- several streams, token expansion ------------------------------------------------------


def video_action_episode(i: int, frames: int, actions_per_frame: int = 3):
    lat = torch.full((frames, 4, 8, 16), float(i), dtype=torch.float16)
    act = torch.arange(frames * actions_per_frame, dtype=torch.float32)[:, None] + 1000 * i
    return {"latents": lat, "action": act.repeat(1, 2), "episode_index": i}


def test_declared_streams_get_their_own_layouts():
    eps = [video_action_episode(i, f) for i, f in enumerate([2, 3, 1])]
    col = PackedCollator([Stream("latents", grid=(4, 8)), Stream("action")], pad_to_multiple=64)
    b = col(eps)
    video, action = b.layout("latents"), b.layout("action")
    assert video.lengths_K == (64, 96, 32) and video.steps_K == (2, 3, 1)
    assert video.tokens_per_step == 32 and b["latents"].shape == (6, 4, 8, 16)
    assert b["latents"].dtype == torch.float16, "dtypes are preserved"
    assert action.lengths_K == (6, 9, 3) and b["action"].shape == (64, 2)
    assert action.cu_seqlens_K1.tolist() == [0, 6, 15, 18]
    assert b["doc_ids"] is video.doc_ids_T, "the first stream is the primary one"


def test_grid_stream_has_3d_positions_in_row_major_order():
    b = PackedCollator([Stream("latents", grid=(4, 8))])([video_action_episode(0, 2)])
    thw = b["thw"]
    assert thw.shape == (128, 3)
    assert thw[0].tolist() == [0, 0, 0] and thw[1].tolist() == [0, 0, 1]
    assert thw[8].tolist() == [0, 1, 0] and thw[31].tolist() == [0, 3, 7]
    assert thw[32].tolist() == [1, 0, 0] and thw[63].tolist() == [1, 3, 7]
    t, h, w = thw[:64].long().unbind(-1)
    assert torch.equal(t * 32 + h * 8 + w, b["position_ids"][:64].long())


@SETTINGS
@given(frames=st.lists(st.integers(1, 5), min_size=1, max_size=5))
def test_grid_positions_restart_in_every_episode(frames):
    eps = [video_action_episode(i, f) for i, f in enumerate(frames)]
    b = PackedCollator([Stream("latents", grid=(2, 4)), Stream("action")])(eps)
    lay = b.layout("latents")
    doc, thw = lay.doc_ids_T.long(), lay.thw_T3.long()
    for k, f in enumerate(frames):
        rows = thw[doc == k]
        assert rows.shape[0] == 8 * f
        assert rows[:, 0].tolist() == [t for t in range(f) for _ in range(8)]


def test_joint_layout_puts_each_episodes_tokens_side_by_side_and_back():
    eps = [video_action_episode(i, f) for i, f in enumerate([2, 1, 3])]
    b = PackedCollator([Stream("latents", grid=(1, 2)), Stream("action")], pad_to_multiple=8)(eps)
    j = joint_layout(b, ("latents", "action"))
    v, a = b.layout("latents"), b.layout("action")
    xv = 1 + torch.arange(v.padded_len).float()  # video tokens: positive
    xa = -1 - torch.arange(a.padded_len).float()  # action tokens: negative
    x = j.join({"latents": xv, "action": xa})
    assert x.shape[0] == v.padded_len + a.padded_len
    # episode 0: 4 video tokens then 6 action tokens; then episode 1 ...
    assert x[:10].tolist() == [1, 2, 3, 4, -1, -2, -3, -4, -5, -6]
    assert j.layout.lengths_K == (10, 5, 15)
    assert j.layout.doc_ids_T[:30].tolist() == [0] * 10 + [1] * 5 + [2] * 15
    assert j.layout.doc_ids_T[30:].eq(-1).all()
    back = j.split(x)
    assert torch.equal(back["latents"], xv) and torch.equal(back["action"], xa)
    assert joint_layout(b, ("latents", "action")) is j, "cached on the batch"
    assert j.padded_lens == (v.padded_len, a.padded_len)
    assert not hasattr(j, "lengths"), "no old names in an unreleased package"


@SETTINGS
@given(frames=st.lists(st.integers(1, 4), min_size=1, max_size=6), mult=st.sampled_from([1, 8]))
def test_joint_tokens_keep_their_episode(frames, mult):
    eps = [video_action_episode(i, f, actions_per_frame=2) for i, f in enumerate(frames)]
    col = PackedCollator([Stream("latents", grid=(1, 2)), Stream("action")], pad_to_multiple=mult)
    b = col(eps)
    j = joint_layout(b, ("latents", "action"))
    docs = {n: b.layout(n).doc_ids_T for n in ("latents", "action")}
    joined = j.join(docs)
    assert torch.equal(joined, j.layout.doc_ids_T), "every token stays in its document"
    # ... and in its place: inside a document, each stream's tokens keep their order, so the
    # joined stream positions count up from 0, as many as the stream has in that episode.
    pos = j.join({n: b.layout(n).position_ids_T for n in docs})
    for s, name in enumerate(docs):
        for k, n in enumerate(b.layout(name).lengths_K):
            here = (j.stream_ids_J == s) & (joined == k)
            assert pos[here].tolist() == list(range(n))


def test_joint_layout_can_be_built_in_the_worker_and_moves_with_the_batch():
    col = PackedCollator(
        [Stream("latents", grid=(4, 8)), Stream("action")], joint=[("latents", "action")]
    )
    b = col([video_action_episode(0, 2)])
    assert ("latents", "action") in b.joint_layouts
    moved = b.to("cpu")
    assert isinstance(moved.joint_layouts[("latents", "action")].src_index_J, torch.Tensor)
    assert joint_layout(moved, ("latents", "action")) is moved.joint_layouts[("latents", "action")]
    assert set(b) == {
        "latents",
        "action",
        "doc_ids",
        "position_ids",
        "cu_seqlens",
        "max_seqlen",
        "thw",
        "episode_index",
    }, "the cache is not part of the mapping"


# -- static shapes ------------------------------------------------------------------------------


@SETTINGS
@given(packs=st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=4), min_size=2, max_size=4))
def test_token_budget_and_max_docs_give_one_shape_for_every_pack(packs):
    col = PackedCollator(token_budget=128, max_docs=4)
    shapes = set()
    for lengths in packs:
        b = col([identity_episode(i, n) for i, n in enumerate(lengths)])
        shapes.add((b["x"].shape, b["cu_seqlens"].shape, b["episode_index"].shape))
        k = len(lengths)
        assert b["cu_seqlens"][k:].eq(sum(lengths)).all(), "empty documents at the end"
        assert b["episode_index"][k:].eq(-1).all()
        assert b.num_docs == k
    assert shapes == {((128, 3), (5,), (4,))}


def test_the_mapping_reads_the_fields_in_place():
    b = PackedCollator([Stream("latents", grid=(4, 8)), Stream("action")])(
        [video_action_episode(0, 2), video_action_episode(1, 3)]
    )
    assert b["latents"] is b.streams["latents"] and b["action"] is b.streams["action"]
    assert b["doc_ids"] is b.layout().doc_ids_T and b["thw"] is b.layout().thw_T3
    assert b["max_seqlen"] == b.layout().max_seqlen
    assert b["episode_index"] is b.per_episode["episode_index"]
    b.extras.update(step=3, _note="private")
    assert b["step"] == 3 and "_note" not in b and len(b) == len(list(b)) == 9
    assert b.episode_ids == b.host_episode_ids == (0, 1)
    with pytest.raises(KeyError, match="'nope' is not in this PackedBatch; keys are"):
        b["nope"]


def test_empty_pack_with_declared_streams_is_all_padding():
    col = PackedCollator(
        [Stream("x", step_shape=(3,), dtype=torch.float32)], token_budget=64, max_docs=2
    )
    b = col([])
    assert b["x"].shape == (64, 3) and b["doc_ids"].eq(-1).all()
    assert b.num_docs == 0 and b["cu_seqlens"].tolist() == [0, 0, 0]
    assert unpack(b) == []


# -- bad input: clear errors, nothing dropped ---------------------------------------------------


def test_empty_list_without_declared_shapes_says_how_to_fix_it():
    with pytest.raises(ValueError, match=r"empty pack.*step_shape and dtype"):
        pack([])


def test_zero_length_episode_is_an_error_naming_it():
    eps = [identity_episode(0, 2), {"x": torch.zeros(0, 3), "episode_index": 17}]
    with pytest.raises(
        ValueError, match=r"episode 1 \(episode_index 17\) has 0 steps in stream 'x'"
    ):
        pack(eps)


def test_episode_over_the_budget_names_it_and_the_fix():
    eps = [identity_episode(0, 10), identity_episode(5, 300)]
    with pytest.raises(
        ValueError,
        match=r"budget=256.*episode 1 \(episode_index 5\) alone has 300 tokens.*plan_packs",
    ):
        pack(eps, token_budget=256)


def test_pack_over_the_budget_is_never_truncated():
    eps = [identity_episode(i, 100) for i in range(3)]
    with pytest.raises(ValueError, match="pack has 300 tokens in stream 'x' > budget=256"):
        pack(eps, token_budget=256)


def test_streams_of_different_lengths_must_be_declared():
    ep = {"latents": torch.zeros(4, 2), "action": torch.zeros(12, 2)}
    with pytest.raises(ValueError, match=r"different lengths.*declare them.*Stream\('latents'\)"):
        pack([ep])


def test_dtype_mismatch_between_episodes_is_an_error():
    eps = [
        identity_episode(0, 2),
        {"x": torch.zeros(2, 3, dtype=torch.float64), "episode_index": 1},
    ]
    with pytest.raises(
        TypeError, match=r"episode 1 .*stream 'x' has dtype torch.float64, expected torch.float32"
    ):
        pack(eps)


def test_declared_dtype_is_checked_not_cast():
    col = PackedCollator([Stream("x", dtype=torch.float16)])
    with pytest.raises(TypeError, match=r"expected torch.float16.*never casts"):
        col([identity_episode(0, 2)])


def test_trailing_shape_mismatch_is_an_error():
    eps = [identity_episode(0, 2), identity_episode(1, 2, width=4)]
    with pytest.raises(ValueError, match=r"steps of shape \(4,\), expected \(3,\)"):
        pack(eps)


def test_missing_key_is_an_error_naming_episode_and_key():
    eps = [identity_episode(0, 2, task="a"), identity_episode(1, 2)]
    with pytest.raises(KeyError, match=r"episode 1 .*missing \['task'\]"):
        pack(eps)
    with pytest.raises(KeyError, match="has no stream 'action'"):
        PackedCollator(["x", "action"])([identity_episode(0, 2)])


def test_too_many_documents_for_max_docs():
    with pytest.raises(ValueError, match="3 episodes > max_docs=2"):
        pack([identity_episode(i, 1) for i in range(3)], max_docs=2)


def test_bad_configuration_is_rejected_when_built():
    with pytest.raises(ValueError, match="multiple of tokens_per_step=32"):
        Stream("latents", grid=(4, 8), budget=100)
    with pytest.raises(ValueError, match="disagrees with grid"):
        Stream("latents", grid=(4, 8), tokens_per_step=16)
    with pytest.raises(ValueError, match="pad_to_multiple"):
        PackedCollator(pad_to_multiple=0)
    with pytest.raises(TypeError, match="list of episode dicts"):
        pack("not a list")  # type: ignore[arg-type]


def test_mixed_types_of_a_per_episode_value_are_an_error():
    eps = [identity_episode(0, 1, timestep=0.5), identity_episode(1, 1, timestep="0.5")]
    with pytest.raises(TypeError, match="key 'timestep' is str"):
        pack(eps)


# -- plumbing -----------------------------------------------------------------------------------


def test_numpy_streams_are_accepted():
    b = pack([{"x": np.ones((3, 2), dtype=np.float32)}])
    assert b["x"].dtype == torch.float32 and b.layout().lengths_K == (3,)


def test_works_in_dataloader_workers():
    data = [identity_episode(i, 1 + i % 5) for i in range(12)]
    loader = torch.utils.data.DataLoader(
        data, batch_size=4, num_workers=2, collate_fn=PackedCollator(token_budget=64)
    )
    seen = []
    for b in loader:
        assert b["x"].shape == (64, 3)
        seen += b["episode_index"].tolist()
    assert sorted(seen) == list(range(12))
    pickle.dumps(PackedCollator(["x"], token_budget=64))


def test_in_a_worker_the_pack_is_built_in_shared_memory():
    # default_collate's trick: the pack reaches the main process without a second copy into
    # shared memory (1.17x packs/s through DataLoader(num_workers=1) on a 2-core CPU).
    data = [identity_episode(i, 3) for i in range(4)]
    col = PackedCollator(token_budget=16)

    def built_shared(episodes):  # runs in the worker, before the hand-off
        return col(episodes)["x"].is_shared()

    loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=1, collate_fn=built_shared)
    assert list(loader) == [True, True]
    assert not col(data[:2])["x"].is_shared(), "outside a worker: ordinary memory"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pin_memory():
    b = pack([identity_episode(0, 3)], pin_memory=True)
    assert b["x"].is_pinned() and b.pin_memory()["doc_ids"].is_pinned()


def test_layout_from_lengths_pads_cu_seqlens_for_max_docs():
    lay = layout_from_lengths([2, 4, 3], [2, 4, 3], padded=12, max_docs=5)
    assert lay.cu_seqlens_K1.tolist() == [0, 2, 6, 9, 9, 9]
    assert lay.num_docs == 3 and lay.efficiency == 0.75


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 300), min_size=0, max_size=12),
    tail=st.integers(0, 200),
    grid=st.sampled_from([None, (1, 1), (2, 3), (4, 8)]),
    max_docs=st.sampled_from([None, 12, 20]),
)
def test_fast_layout_equals_the_token_by_token_reference(lengths, tail, grid, max_docs):
    hw = 1 if grid is None else grid[0] * grid[1]
    tokens = [n * hw for n in lengths]
    padded = sum(tokens) + tail * hw
    if padded == 0:
        padded = hw
    fast = layout_from_lengths(tokens, lengths, padded, hw, grid, max_docs)
    slow = reference.layout_from_lengths(tokens, lengths, padded, hw, grid, max_docs)
    for name in ("doc_ids_T", "position_ids_T", "cu_seqlens_K1", "thw_T3"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.is_contiguous() and torch.equal(a, b), name
    assert fast.max_seqlen == slow.max_seqlen and fast.lengths_K == slow.lengths_K


def test_layouts_do_not_share_memory_between_packs():
    # The layout is built from cached templates; a pack's tensors must still be its own.
    a = layout_from_lengths([3, 2], [3, 2], 8, 1, (1, 1))
    b = layout_from_lengths([3, 2], [3, 2], 8, 1, (1, 1))
    a.position_ids_T.add_(100)
    a.thw_T3.add_(100)
    a.doc_ids_T.add_(100)
    assert b.position_ids_T.tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert b.thw_T3[:, 0].tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert b.doc_ids_T.tolist() == [0, 0, 0, 1, 1, -1, -1, -1]


def test_many_documents_of_one_token():
    lay = layout_from_lengths([1] * 5000, [1] * 5000, 5120)
    assert lay.doc_ids_T[:5000].tolist() == list(range(5000))
    assert (lay.position_ids_T == 0).all()


# -- batches never share state, and the lean path --------------------------------------------------------------

LAYOUT_FIELDS = ("doc_ids_T", "position_ids_T", "cu_seqlens_K1", "thw_T3")


def grid_episodes(frames: list[int], dtype: torch.dtype = torch.float32) -> list[dict]:
    """Episodes of a grid stream (4 tokens a frame) and an action stream, values encoding
    identity, with the per-episode values of a real dataset (int index, str task)."""
    return [
        {
            "latents": (1000 * i + torch.arange(n * 6).reshape(n, 2, 3)).to(dtype),
            "action": (1000 * i + torch.arange(n * 2).reshape(n, 2)).float(),
            "episode_index": 10 + i,
            "task": f"task {i}",
        }
        for i, n in enumerate(frames)
    ]


def grid_collator(**kw) -> PackedCollator:
    return PackedCollator(
        [Stream("latents", grid=(2, 2), budget=96), Stream("action", budget=32)], **kw
    )


def assert_same_batch(a, b) -> None:
    """Every stream, layout field and per-episode value equal (dtypes and shapes included)."""
    assert list(a.streams) == list(b.streams) and a.value_kinds == b.value_kinds
    for name in a.streams:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
        la, lb = a.layout(name), b.layout(name)
        for field in LAYOUT_FIELDS:
            x, y = getattr(la, field), getattr(lb, field)
            assert (x is None) == (y is None), field
            if x is not None:
                assert x.dtype == y.dtype and x.is_contiguous() and torch.equal(x, y), field
        assert la.lengths_K == lb.lengths_K and la.steps_K == lb.steps_K
        assert la.max_seqlen == lb.max_seqlen
    for key, value in a.per_episode.items():
        other = b.per_episode[key]
        same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
        assert same, key
    assert a.episode_ids == b.episode_ids


def test_a_layout_edited_by_the_caller_does_not_reach_the_next_batch():
    # Layouts are built from cached read-only templates; batches mutated in place must leave
    # them (and so the next batch) untouched.
    eps = grid_episodes([3, 5, 2])
    want = copy.deepcopy(grid_collator()(eps))  # its own tensors, whatever the collator shares
    col = grid_collator()
    for _ in range(3):
        batch = col(eps)
        assert_same_batch(batch, want)
        for name in batch.streams:
            batch[name].add_(7)
            for field in LAYOUT_FIELDS:
                t = getattr(batch.layout(name), field)
                if t is not None:
                    t.add_(7)
        batch.per_episode["episode_index"].add_(7)


def test_every_batch_has_its_own_memory():
    col = grid_collator()
    eps = grid_episodes([4, 4])
    batches = [col(eps) for _ in range(4)]
    tensors = [
        t
        for b in batches
        for n in b.streams
        for t in (b[n], *(getattr(b.layout(n), f) for f in LAYOUT_FIELDS))
        if t is not None
    ]
    ptrs = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(ptrs) == len(tensors) == 4 * (5 + 4), "a tensor is shared between batches"


@SETTINGS
@given(
    frames=st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=4), min_size=1, max_size=6),
    max_docs=st.sampled_from([None, 4]),
)
def test_a_collator_gives_the_same_batch_whatever_it_collated_before(frames, max_docs):
    # Random packs, some repeated, through one collator (whose templates grow as it goes):
    # each batch equals the one a new collator builds.
    col = grid_collator(max_docs=max_docs)
    for f in frames + frames[::-1]:
        eps = grid_episodes(f)
        assert_same_batch(col(eps), grid_collator(max_docs=max_docs)(eps))


def test_the_lean_path_and_the_checked_path_give_the_same_batch():
    # numpy arrays and per-episode numpy ints are not plain: they take the checked path.
    eps = grid_episodes([3, 1, 4])
    slow = [
        {**e, "latents": e["latents"].numpy(), "episode_index": np.int64(e["episode_index"])}
        for e in eps
    ]
    col = grid_collator(max_docs=5)
    assert col._plain_columns(eps) is not None and col._plain_columns(slow) is None
    assert_same_batch(col(eps), col(slow))


def test_a_large_pack_in_numpy_memory_behaves_like_any_tensor():
    # Buffers of > 32 MiB come from numpy (transparent huge pages): still a plain tensor that
    # pickles, moves to shared memory, clones and unpacks.
    n = 2_200_000  # 2 x 2.2M rows x 2 fp32 = 35.2 MB
    eps = [{"x": torch.full((n, 2), float(i)), "episode_index": i} for i in range(2)]
    batch = pack(eps, token_budget=2 * n + 64)
    x = batch["x"]
    assert x.shape == (2 * n + 64, 2) and x.dtype == torch.float32 and x.is_contiguous()
    assert x.numel() * 4 > collate._HUGE_PAGE_BYTES
    assert torch.equal(pickle.loads(pickle.dumps(x)), x)
    assert torch.equal(x.clone().share_memory_(), x)
    x.share_memory_()
    assert x.is_shared() and x[:n].eq(0).all() and x[n : 2 * n].eq(1).all()
    assert x[2 * n :].eq(0).all()
    assert [ep["x"].shape[0] for ep in unpack(batch)] == [n, n]


def test_a_later_episode_of_another_step_shape_is_named_for_a_declared_stream():
    # The lean path checks the first episode's step shape; torch.cat finds the others.
    col = PackedCollator([Stream("x", step_shape=(3,))])
    eps = [identity_episode(0, 2), identity_episode(1, 2), identity_episode(2, 2, width=4)]
    with pytest.raises(ValueError, match=r"episode 2 .*steps of shape \(4,\), expected \(3,\)"):
        col(eps)


def test_host_episode_ids_are_python_ints_however_the_index_was_given():
    # Mixed int / numpy int indices take the checked path; the host ids are ints either way.
    for index in ([3, 5], [np.int64(3), 5], [3, np.int32(5)], [torch.tensor(3), torch.tensor(5)]):
        eps = [identity_episode(i, 2) | {"episode_index": v} for i, v in enumerate(index)]
        batch = pack(eps)
        assert batch.episode_ids == (3, 5)
        assert all(type(i) is int for i in batch.episode_ids), index
        assert batch["episode_index"].dtype == torch.int64


def test_the_batchs_namespaces_never_overlap():
    """``batch["doc_ids"]`` is always the layout's ids: an episode key, a stream or an extras
    key of a reserved or already used name is refused, naming the key."""
    c = PackedCollator([Stream("latents", budget=8)])
    eps = [{"latents": torch.zeros(3, 2)}, {"latents": torch.zeros(2, 2)}]
    b = c(eps)
    assert b["doc_ids"].tolist() == [0, 0, 0, 1, 1, -1, -1, -1]
    with pytest.raises(ValueError, match="key 'doc_ids' is both in the layout and in per-episode"):
        c([{**ep, "doc_ids": 7} for ep in eps])
    with pytest.raises(ValueError, match="key 'latents' is both in streams and in per-episode"):
        PackedBatch(
            streams=b.streams, layouts=b.layouts, per_episode={"latents": 1}, primary="latents"
        )
    with pytest.raises(
        ValueError, match=r"extras\['cu_seqlens'\]: 'cu_seqlens' is already in the layout"
    ):
        b.extras["cu_seqlens"] = [0, 3]  # added after construction: refused at the write
