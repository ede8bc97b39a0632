"""Spec of the mask_mods: who attends to whom inside a pack, checked against an obvious reference.

The reference below knows nothing of packing.attention._masks: it walks the doc ids to find each token's
episode-local position and writes the rule of the spec as a broadcast expression.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import and_masks, create_mask

from packing.attention import _masks as masks
from packing.attention import ascii_mask
from packing.attention._masks import (
    causal,
    dense_mask,
    document_mask_mod,
    frame_causal,
    make_block_mask,
    sliding_window,
    validate_doc_ids,
    with_block_rule,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# The inner rules written out as the spec states them, on episode-local positions.
REFERENCE_INNER = {
    None: lambda i, j: torch.ones_like(i, dtype=torch.bool),
    "causal": lambda i, j: i >= j,
    "frame_causal_3": lambda i, j: i // 3 >= j // 3,
    "frame_causal_4x2": lambda i, j: i // 4 >= j // 2,
    "sliding_window_2": lambda i, j: (i - j).abs() <= 2,
    "causal_sliding_window_3": lambda i, j: (i - j >= 0) & (i - j <= 3),
}
INNERS = {
    None: None,
    "causal": causal(),
    "frame_causal_3": frame_causal(3),
    "frame_causal_4x2": frame_causal(4, 2),
    "sliding_window_2": sliding_window(2),
    "causal_sliding_window_3": sliding_window(3, causal=True),
}


def local_positions_by_loop(doc: list[int]) -> list[int]:
    pos, prev, run = [], None, 0
    for d in doc:
        run = run + 1 if d == prev else 0
        pos.append(run if d >= 0 else 0)
        prev = d
    return pos


def reference_mask(doc: list[int], kv_doc: list[int] | None, inner: str | None) -> torch.Tensor:
    """Same episode, inner rule in local positions; padding attends to nothing."""
    kv = doc if kv_doc is None else kv_doc
    qd, kd = torch.tensor(doc)[:, None], torch.tensor(kv)[None, :]
    qi = torch.tensor(local_positions_by_loop(doc))[:, None]
    kj = torch.tensor(local_positions_by_loop(kv))[None, :]
    return (qd == kd) & (qd >= 0) & REFERENCE_INNER[inner](qi, kj)


@st.composite
def packed_doc_ids(draw: st.DrawFn, *, allow_absent: bool = False) -> list[int]:
    """Episodes in id order, ragged lengths (many 1-token ones), padding between and at the tail."""
    k = draw(st.integers(1, 8))
    out: list[int] = []
    for d in range(k):
        out += [-1] * draw(st.sampled_from([0, 0, 0, 1, 3]))  # alignment padding
        lo = 0 if allow_absent else 1
        n = draw(st.one_of(st.integers(lo, 3), st.integers(lo, 40)))
        out += [d] * n
    out += [-1] * draw(st.sampled_from([0, 0, 1, 7, 20]))
    if not out:
        out = [-1]
    return out


# A random pack, an optional key side (self-attention when None) and an inner mask: the
# draws every mask property test starts from (tests/test_block_mask.py uses them too).
RANDOM_MASKS = dict(
    doc=packed_doc_ids(),
    kv=st.one_of(st.none(), packed_doc_ids(allow_absent=True)),
    inner=st.sampled_from(list(INNERS)),
)


# ------------------------------------------------------------------ hand-computed pictures


def picture(doc: str) -> list[str]:
    """The ``#``/``.`` rows of a docstring picture, labels stripped."""
    cells = [re.search(r"(?:[#.] )+[#.]$", line.rstrip()) for line in doc.splitlines()]
    return [c.group(0).replace(" ", "") for c in cells if c]


def rows(mask: torch.Tensor) -> list[str]:
    return ascii_mask(mask, sep="").splitlines()


def test_module_picture_is_the_document_mask():
    doc_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, -1])
    assert rows(dense_mask(doc_ids)) == picture(masks.__doc__ or "")


def test_frame_causal_picture():
    assert rows(dense_mask(torch.zeros(6, dtype=torch.int32), inner=frame_causal(2))) == picture(
        frame_causal.__doc__ or ""
    )


def test_sliding_window_picture():
    got = rows(dense_mask(torch.zeros(5, dtype=torch.int32), inner=sliding_window(1)))
    assert got == picture(sliding_window.__doc__ or "")


def test_causal_restarts_at_each_episode():
    # episodes [2, 3]: the second episode's first token sees only itself.
    got = dense_mask(torch.tensor([0, 0, 1, 1, 1]), inner=causal())
    assert rows(got) == ["#....", "##...", "..#..", "..##.", "..###"]


def test_cross_attention_padding_query_sees_nothing_and_pad_keys_are_never_seen():
    # 2 episodes of video queries [3, 2] + 2 pad, text keys [1, 2] + 1 pad.
    q = torch.tensor([0, 0, 0, 1, 1, -1, -1])
    kv = torch.tensor([0, 1, 1, -1])
    got = dense_mask(q, kv)
    assert got.shape == (7, 4)
    assert rows(got) == ["#...", "#...", "#...", ".##.", ".##.", "....", "...."]


def test_padding_attends_to_nothing_even_between_episodes():
    got = dense_mask(torch.tensor([0, -1, 1, 1, -1]), inner=causal())
    assert rows(got) == ["#....", ".....", "..#..", "..##.", "....."]


def test_names_are_readable_and_factories_cached():
    assert causal().__name__ == "causal"
    assert frame_causal(32).__name__ == "frame_causal_32"
    assert frame_causal(32, 1).__name__ == "frame_causal_32x1"
    assert sliding_window(64).__name__ == "sliding_window_64"
    assert sliding_window(64, causal=True).__name__ == "causal_sliding_window_64"
    d = torch.tensor([0, 0, 1])
    assert document_mask_mod(d).__name__ == "document"
    assert document_mask_mod(d, inner=frame_causal(2)).__name__ == "document_frame_causal_2"
    assert document_mask_mod(d, d[:2], causal()).__name__ == "cross_document_causal"
    # Same arguments, same object: torch.compile sees one function, not a new closure per step.
    assert causal() is causal() and frame_causal(8) is frame_causal(8)


# ------------------------------------------------------------------ properties vs reference


def test_dense_mask_equals_reference_on_random_layouts():
    seen: Counter[str] = Counter()

    @SETTINGS
    @given(**RANDOM_MASKS)
    def check(doc: list[int], kv: list[int] | None, inner: str | None) -> None:
        kv_t = None if kv is None else torch.tensor(kv, dtype=torch.int32)
        got = dense_mask(torch.tensor(doc, dtype=torch.int32), kv_t, INNERS[inner])
        want = reference_mask(doc, kv, inner)
        assert torch.equal(got, want)
        seen["cross" if kv is not None else "self"] += 1
        seen["padding"] += -1 in doc
        seen["one-token episode"] += any(doc.count(d) == 1 for d in set(doc) if d >= 0)
        seen["inner"] += inner is not None

    check()
    # Guard against a vacuous pass: the interesting layouts did occur.
    assert min(seen.values()) >= 30, seen


def test_mask_mod_traces_under_vmap_like_flex_does():
    doc = torch.tensor([0, 0, 0, 1, 2, 2, -1], dtype=torch.int32)
    kv = torch.tensor([0, 1, 1, 2, 2], dtype=torch.int32)
    for d, k in ((doc, None), (doc, kv)):
        mm = document_mask_mod(d, k, frame_causal(2))
        via_vmap = create_mask(mm, None, None, d.shape[0], (d if k is None else k).shape[0], "cpu")
        assert torch.equal(via_vmap[0, 0], dense_mask(d, k, frame_causal(2)))


def test_mask_mod_answers_the_padding_of_a_ragged_last_tile_with_false():
    """flash-attn-4's Flex kernel calls the mask_mod on every pair of a tile before it masks
    the rows and columns past the lengths: a ragged pack (here 7 queries, 5 keys, tiles of
    4) must read inside its ids there and say False, never index past them."""
    doc = torch.tensor([0, 0, 0, 1, 2, 2, -1], dtype=torch.int32)
    kv = torch.tensor([0, 1, 1, 2, 2], dtype=torch.int32)
    for d, k, inner in ((doc, None, None), (doc, kv, frame_causal(2)), (doc, None, causal())):
        mm = document_mask_mod(d, k, inner)
        tq, tk = d.shape[0], (d if k is None else k).shape[0]
        q, kv_i = torch.arange(8)[:, None], torch.arange(8)[None, :]  # both last tiles ragged
        got = mm(torch.tensor(0), torch.tensor(0), q, kv_i)  # raised IndexError before
        want = torch.zeros(8, 8, dtype=torch.bool)
        want[:tq, :tk] = dense_mask(d, k, inner)
        assert torch.equal(got.expand(8, 8), want)
        assert want.any()


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from([n for n in INNERS if n is not None]),
    a=st.integers(0, 20),
    da=st.integers(0, 12),
    c=st.integers(0, 20),
    dc=st.integers(0, 12),
)
def test_block_rules_are_exact_on_rectangles(name: str, a: int, da: int, c: int, dc: int) -> None:
    """rule(a, b, c, d) says exactly whether any / all pairs of rows a..b x cols c..d attend."""
    b, d = a + da, c + dc
    i = torch.arange(a, b + 1)[:, None]
    j = torch.arange(c, d + 1)[None, :]
    pairs = REFERENCE_INNER[name](i, j)
    t = [torch.tensor([v]) for v in (a, b, c, d)]
    r_any, r_all = INNERS[name].block_rule(*t)  # type: ignore[union-attr]
    assert bool(r_any) == bool(pairs.any()) and bool(r_all) == bool(pairs.all())


# ------------------------------------------------------------------ errors name the fix


@pytest.mark.parametrize(
    ("doc_ids", "error", "match"),
    [
        (torch.tensor([0.0, 1.0]), TypeError, r"integer tensor.*got torch.float32"),
        (torch.tensor([True, False]), TypeError, r"integer tensor.*got torch.bool"),
        (torch.zeros(2, 3, dtype=torch.int32), ValueError, r"must be 1-D \(T,\).*\(2, 3\)"),
        (torch.zeros(0, dtype=torch.int32), ValueError, r"empty"),
        (torch.tensor([0, -2, 1]), ValueError, r"doc_ids\[1\] = -2.*-1 for padding"),
        (torch.tensor([0, 0, 1, 0]), ValueError, r"document 0 at position 3 follows document 1"),
        (torch.tensor([0, -1, 0]), ValueError, r"document 0 at position 2 follows document 0"),
        (torch.tensor([1, 1, 0]), ValueError, r"contiguous run"),
    ],
)
def test_bad_doc_ids_are_rejected_by_every_builder(doc_ids, error, match):
    for build in (dense_mask, document_mask_mod, make_block_mask, validate_doc_ids):
        with pytest.raises(error, match=match):
            build(doc_ids)


def test_bad_kv_doc_ids_name_kv_doc_ids():
    with pytest.raises(ValueError, match=r"kv_doc_ids: document 0 at position 2"):
        make_block_mask(torch.tensor([0, 1]), torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match=r"doc_ids is on cpu but kv_doc_ids on meta"):
        make_block_mask(torch.tensor([0, 1]), torch.tensor([0, 1], device="meta"))


@pytest.mark.parametrize("block_size", [0, -128, (16, 0), True, (16,), 1.5])
def test_block_size_must_be_positive(block_size):
    with pytest.raises(ValueError, match=r"block_size=.*positive int"):
        make_block_mask(torch.tensor([0, 0, 1]), block_size=block_size)


def test_inner_factories_validate_their_arguments():
    with pytest.raises(ValueError, match=r"tokens_per_frame=0; use a positive int"):
        frame_causal(0)
    with pytest.raises(ValueError, match=r"kv_tokens_per_frame=-1; use a positive int"):
        frame_causal(4, -1)
    with pytest.raises(ValueError, match=r"window=-1; use an int >= 0"):
        sliding_window(-1)


def test_inner_fallback_errors():
    composed = and_masks(causal(), sliding_window(2))
    d = torch.tensor([0, 0, 1])
    with pytest.raises(ValueError, match=r"has no block_rule and inner_fallback='error'"):
        make_block_mask(d, inner=composed, inner_fallback="error")
    with pytest.raises(ValueError, match=r"inner_fallback='fast'; use 'evaluate'"):
        make_block_mask(d, inner=composed, inner_fallback="fast")  # type: ignore[arg-type]


def test_with_block_rule_names_and_attaches():
    def every_other(b, h, q, kv):
        return (q - kv) % 2 == 0

    def rule(a, b, c, d):
        true = torch.ones_like(a, dtype=torch.bool)
        single = (a == b) & (c == d)
        return true, single & ((a - c) % 2 == 0)

    inner = with_block_rule(every_other, rule, "every_other")
    assert inner.__name__ == "every_other" and inner.block_rule is rule  # type: ignore[attr-defined]
    doc = torch.tensor([0] * 5 + [1] * 4)
    ref = (torch.arange(9)[:, None] - torch.arange(9)[None, :]) % 2 == 0
    assert torch.equal(dense_mask(doc, inner=inner), dense_mask(doc) & ref)


def test_render_png_and_ascii(tmp_path):
    pytest.importorskip("matplotlib")
    from packing.attention import ascii_blocks, save_png

    doc = torch.tensor([0] * 20 + [1] * 5 + [2] * 30 + [-1] * 9)
    bm = make_block_mask(doc, inner=causal(), block_size=16)
    out = save_png(tmp_path / "m.png", dense_mask(doc, inner=causal()), block_mask=bm, doc_ids=doc)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ascii_blocks(bm) == "+ . . .\n+ + . .\n. + + .\n. + + +"
    with pytest.raises(ValueError, match=r"mask must be 2-D"):
        ascii_mask(torch.ones(3, dtype=torch.bool))
