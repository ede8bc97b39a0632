"""Spec of make_block_mask: the BlockMask attends exactly where the dense reference does.

* the *effective* mask (full tiles true, partial tiles through the mask_mod, unlisted tiles
  false) equals the reference, and every tile is classified as tightly as possible
  (full iff all pairs attend, listed iff some pair does), on random ragged layouts;
* Flex forward with the BlockMask equals SDPA with the dense mask and each episode run alone;
* a deliberately broken mask is caught by the same checks (no vacuous pass);
* the build reads no tensor values (it runs on the meta device), and its shapes and a compiled
  consumer do not change as the layout changes.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_masks import INNERS, RANDOM_MASKS, REFERENCE_INNER, reference_mask
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention.flex_attention import (
    BlockMask,
    and_masks,
    create_block_mask,
    flex_attention,
    or_masks,
)

from packing._layout_math import local_positions
from packing.attention import (
    causal,
    dense_mask,
    frame_causal,
    make_block_mask,
    sliding_window,
    with_block_rule,
)
from packing.attention._block_tables import block_tables
from packing.attention._render import EMPTY, FULL, PARTIAL, ascii_blocks, block_classes

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BLOCKS = st.sampled_from([1, 3, 16, 16, 32, 128, (16, 32), (32, 16)])

# Eager Flex on CPU materialises the scores: fine for these sizes.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def effective_mask(bm: BlockMask) -> torch.Tensor:
    """What Flex computes: full tiles attend, partial tiles ask mask_mod, the rest do not."""
    T_q, T_kv = bm.seq_lengths
    bq, bkv = bm.BLOCK_SIZE
    tiles = block_classes(bm)
    per_token = tiles.repeat_interleave(bq, 0).repeat_interleave(bkv, 1)[:T_q, :T_kv]
    zero = torch.zeros((), dtype=torch.int64)
    mod = bm.mask_mod(zero, zero, torch.arange(T_q)[:, None], torch.arange(T_kv)[None, :])
    return (per_token == FULL) | ((per_token == PARTIAL) & mod)


def tightest_tiles(mask: torch.Tensor, bq: int, bkv: int) -> torch.Tensor:
    """EMPTY/PARTIAL/FULL per tile from a dense mask; slots past T count as not attending."""
    T_q, T_kv = mask.shape
    Q, K = -(-T_q // bq), -(-T_kv // bkv)
    padded = F.pad(mask, (0, K * bkv - T_kv, 0, Q * bq - T_q)).view(Q, bq, K, bkv)
    any_, all_ = padded.any(3).any(1), padded.all(3).all(1)
    return torch.where(all_, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8)


def t32(x: list[int] | None) -> torch.Tensor | None:
    return None if x is None else torch.tensor(x, dtype=torch.int32)


# ------------------------------------------------------------------ hand-computed case


def test_three_episodes_picture():
    # Episodes [5, 2, 4] + 1 pad in tiles of 4 (the make_block_mask docstring picture).
    doc_ids = torch.tensor([0] * 5 + [1] * 2 + [2] * 4 + [-1])
    assert ascii_blocks(make_block_mask(doc_ids, block_size=4)) == "# + .\n+ + +\n. + +"
    assert ascii_blocks(make_block_mask(doc_ids, inner=causal(), block_size=4)) == (
        "+ . .\n+ + .\n. + +"
    )
    doc = make_block_mask.__doc__ or ""
    assert "# + .                + . ." in doc and ". + +                . + +" in doc


def test_aligned_episodes_give_only_full_tiles_and_padding_none():
    # Episodes padded to whole tiles: every listed tile is full; a tile of padding alone is
    # never visited (padding attends to nothing, so an empty tail costs no attention work).
    doc_ids = torch.tensor([0] * 32 + [1] * 16 + [-1] * 16)
    assert ascii_blocks(make_block_mask(doc_ids, block_size=16)) == (
        "# # . .\n# # . .\n. . # .\n. . . ."
    )


# ------------------------------------------------------------------ properties vs reference


def test_block_mask_is_exact_and_tight_on_random_layouts():
    seen: Counter[str] = Counter()

    @SETTINGS
    @given(**RANDOM_MASKS, block=BLOCKS)
    def check(doc, kv, inner, block) -> None:
        bm = make_block_mask(t32(doc), t32(kv), INNERS[inner], block_size=block)
        want = reference_mask(doc, kv, inner)
        assert bm.seq_lengths == tuple(want.shape)
        assert torch.equal(effective_mask(bm), want)
        tiles = block_classes(bm)
        assert torch.equal(tiles, tightest_tiles(want, *bm.BLOCK_SIZE))

        bq = bm.BLOCK_SIZE[0]
        q_tiles = F.pad(t32(doc), (0, -len(doc) % bq), value=-1).view(-1, bq)  # type: ignore[arg-type]
        real_docs = [set(r.tolist()) - {-1} for r in q_tiles]
        seen["tile spanning several episodes"] += any(len(s) > 1 for s in real_docs)
        seen["full tile"] += bool((tiles == FULL).any())
        seen["partial tile"] += bool((tiles == PARTIAL).any())
        seen["padding"] += -1 in doc
        seen["cross"] += kv is not None
        seen["inner"] += inner is not None

    check()
    assert min(seen.values()) >= 30, seen


def test_matches_create_block_mask_tile_for_tile():
    # torch's own builder evaluates every pair; ours must list the very same tiles.
    @settings(max_examples=60, deadline=None)
    @given(**RANDOM_MASKS, block=st.sampled_from([16, 32]))
    def check(doc, kv, inner, block) -> None:
        ours = make_block_mask(t32(doc), t32(kv), INNERS[inner], block_size=block)
        T_kv = len(doc) if kv is None else len(kv)
        ref = create_block_mask(ours.mask_mod, None, None, len(doc), T_kv, "cpu", block)
        assert torch.equal(block_classes(ours), block_classes(ref))
        # The q-side tables (walked by the backward pass) are built here from the transposed
        # tile flags: they must be exactly what BlockMask.from_kv_blocks derives.
        derived = BlockMask.from_kv_blocks(
            ours.kv_num_blocks, ours.kv_indices, ours.full_kv_num_blocks,
            ours.full_kv_indices, block, ours.mask_mod, ours.seq_lengths,
        )  # fmt: skip
        for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(ours, name), getattr(derived, name)), name
        # Flex's backward indexes the tables as contiguous: a transposed view gives right
        # outputs and wrong gradients on the GPU (seen on an H200: gradient cosine 0.05).
        for name in TABLES:
            assert getattr(ours, name).is_contiguous(), name

    check()


TABLES = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)  # fmt: skip


@pytest.mark.parametrize(
    ("composed", "same_as"),
    [
        (and_masks(causal(), sliding_window(3)), sliding_window(3, causal=True)),
        (or_masks(causal(), frame_causal(4)), frame_causal(4)),
    ],
)
def test_inner_without_rule_is_evaluated_on_candidate_tiles(composed, same_as):
    doc_ids = torch.tensor([0] * 40 + [1] * 3 + [2] * 50 + [-1] * 11)
    assert not hasattr(composed, "block_rule")
    for block in (16, (16, 32)):
        evaluated = make_block_mask(doc_ids, inner=composed, block_size=block)
        ruled = make_block_mask(doc_ids, inner=same_as, block_size=block)
        assert torch.equal(block_classes(evaluated), block_classes(ruled))
        assert torch.equal(effective_mask(evaluated), dense_mask(doc_ids, inner=same_as))


def test_inner_fallback_partial_is_exact_but_never_full():
    doc_ids = torch.tensor([0] * 40 + [1] * 3 + [2] * 50 + [-1] * 11)
    kv_ids = torch.tensor([0] * 7 + [2] * 20 + [-1] * 5)
    composed = and_masks(causal(), sliding_window(3))
    for kv in (None, kv_ids):
        bm = make_block_mask(doc_ids, kv, composed, 16, inner_fallback="partial")
        tiles = block_classes(bm)
        assert not (tiles == FULL).any()
        assert torch.equal(effective_mask(bm), dense_mask(doc_ids, kv, composed))
        # Every tile the documents allow is listed, even where the inner mask is empty.
        doc_only = block_classes(make_block_mask(doc_ids, kv, None, 16))
        assert torch.equal(tiles != EMPTY, doc_only != EMPTY)


# ------------------------------------------------------------------ attention outputs


def per_episode_attention(q, k, v, doc, kv_doc, inner_name):
    """Each episode alone, with the inner rule as a plain mask; padding queries give 0."""
    out = torch.zeros_like(q)
    kv_doc = doc if kv_doc is None else kv_doc
    for d in sorted(set(doc.tolist()) - {-1}):
        qi = (doc == d).nonzero().flatten()
        ki = (kv_doc == d).nonzero().flatten()
        if len(ki) == 0:
            continue
        m = REFERENCE_INNER[inner_name](torch.arange(len(qi))[:, None], torch.arange(len(ki)))
        out[:, :, qi] = F.scaled_dot_product_attention(
            q[:, :, qi], k[:, :, ki], v[:, :, ki], attn_mask=m
        )
    return out  # padding queries attend to nothing: 0


def packed_outputs_agree(q, k, v, bm, doc, kv_doc, inner_name) -> bool:
    flex = flex_attention(q, k, v, block_mask=bm)
    sdpa = F.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_mask(doc, kv_doc, INNERS[inner_name])
    )
    sdpa = torch.nan_to_num(sdpa)  # padding rows are empty: Flex gives 0
    alone = per_episode_attention(q, k, v, doc, kv_doc, inner_name)
    return torch.allclose(flex, sdpa, atol=1e-5) and torch.allclose(flex, alone, atol=1e-5)


@pytest.mark.parametrize("inner_name", list(INNERS))
@pytest.mark.parametrize("cross", [False, True])
def test_flex_equals_sdpa_and_each_episode_alone(inner_name, cross):
    torch.manual_seed(0)
    doc = torch.tensor([0] * 37 + [-1] * 3 + [1] + [2] * 64 + [-1] * 2 + [3] * 3 + [-1] * 9)
    kv_doc = torch.tensor([0] * 5 + [2] * 40 + [3] * 9 + [-1] * 6) if cross else None
    T_kv = len(doc) if kv_doc is None else len(kv_doc)
    q = torch.randn(1, 2, len(doc), 16)
    k, v = torch.randn(2, 1, 2, T_kv, 16)
    bm = make_block_mask(doc, kv_doc, INNERS[inner_name], block_size=16)
    assert packed_outputs_agree(q, k, v, bm, doc, kv_doc, inner_name)


def test_dense_mask_gradients_equal_each_episode_alone():
    # Flex has no CPU backward; the SDPA path (dense_mask) is checked here, Flex on the GPU.
    torch.manual_seed(0)
    doc = torch.tensor([0] * 29 + [1] + [2] * 50 + [-1] * 16)
    q, k, v = (torch.randn(1, 2, len(doc), 16, requires_grad=True) for _ in range(3))
    w = torch.randn(1, 2, len(doc), 16) * (doc >= 0)[:, None]  # pad tokens carry no loss
    mask = dense_mask(doc, inner=frame_causal(3))
    (F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * w).sum().backward()
    packed = [t.grad.clone() for t in (q, k, v)]  # type: ignore[union-attr]
    for t in (q, k, v):
        t.grad = None
    (per_episode_attention(q, k, v, doc, None, "frame_causal_3") * w).sum().backward()
    for got, t in zip(packed, (q, k, v), strict=True):
        assert torch.allclose(got, t.grad, atol=1e-5)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the checks can fail


def test_a_leaking_mask_is_caught():
    """A mask that ignores document ids attends across episodes: both checks must notice."""
    torch.manual_seed(0)
    doc = torch.tensor([0] * 37 + [1] + [2] * 64 + [-1] * 10)
    q, k, v = torch.randn(3, 1, 2, len(doc), 16)
    right = make_block_mask(doc, inner=causal(), block_size=16)

    def global_causal(b, h, q_idx, kv_idx):  # the bug: no doc ids, global positions
        return q_idx >= kv_idx

    leaky = create_block_mask(global_causal, None, None, len(doc), len(doc), "cpu", 16)
    assert packed_outputs_agree(q, k, v, right, doc, None, "causal")
    assert not packed_outputs_agree(q, k, v, leaky, doc, None, "causal")
    assert not torch.equal(effective_mask(leaky), reference_mask(doc.tolist(), None, "causal"))

    # A block classifier that drops partial tiles, or calls them full, is caught as well.
    partial_dropped = BlockMask.from_kv_blocks(
        torch.zeros_like(right.kv_num_blocks), right.kv_indices,
        right.full_kv_num_blocks, right.full_kv_indices, 16, right.mask_mod,
    )  # fmt: skip
    all_full = BlockMask.from_kv_blocks(
        torch.zeros_like(right.kv_num_blocks), right.kv_indices,
        right.kv_num_blocks, right.kv_indices, 16, right.mask_mod,
    )  # fmt: skip
    for broken in (partial_dropped, all_full):
        assert not torch.equal(effective_mask(broken), effective_mask(right))


# ------------------------------------------------------------------ no sync, static shapes


@pytest.mark.parametrize("inner", [None, causal(), frame_causal(32), sliding_window(64)])
def test_build_reads_no_tensor_values(inner):
    """On the meta device any .item()/.nonzero()/.tolist()/bool(tensor) raises: the build
    runs there, so it cannot sync with the GPU (prove it on one with set_sync_debug_mode)."""
    doc = torch.tensor([0] * 500 + [1] * 300 + [-1] * 224, device="meta")
    kv = torch.tensor([0] * 70 + [1] * 50 + [-1] * 8, device="meta")
    for k in (None, kv):
        bm = make_block_mask(doc, k, inner, block_size=128)
        assert bm.kv_indices.device.type == "meta"
    # The one documented sync: an inner mask without a rule under inner_fallback="evaluate".
    with pytest.raises(NotImplementedError):
        make_block_mask(doc, None, and_masks(causal(), frame_causal(2)), 128)
    make_block_mask(doc, None, and_masks(causal(), frame_causal(2)), 128, inner_fallback="partial")


def test_shapes_depend_only_on_lengths_and_block():
    def shapes(bm: BlockMask) -> list:
        names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
        names += ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
        return [tuple(getattr(bm, n).shape) for n in names] + [bm.seq_lengths]

    layouts = [[1000], [1] * 1000, [3, 997], [400, 400]]
    got = set()
    for lens in layouts:
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
        doc = F.pad(doc, (0, 1024 - len(doc)), value=-1)
        got.add(str(shapes(make_block_mask(doc, inner=causal(), block_size=128))))
        got.add(str(shapes(make_block_mask(doc, doc[:200], frame_causal(8), block_size=128))))
    assert len(got) == 2  # one for self-attention, one for the cross-attention shapes


def test_a_compiled_consumer_does_not_recompile_as_layouts_change():
    """Dynamo guards on the BlockMask (tensors, sizes, mask_mod); new layouts of the same T
    and the same inner mask reuse the first graph. (aot_eager: same guards, no C++ build.)"""
    torch._dynamo.reset()
    compiles = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=compiles, fullgraph=True)
    def attend(q, k, v, bm):
        return flex_attention(q, k, v, block_mask=bm)

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 256, 16)
    for lens in ([100, 56, 100], [3, 200, 53], [256], [10] * 20 + [56], [7, 9]):
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
        doc = F.pad(doc, (0, 256 - len(doc)), value=-1)
        bm = make_block_mask(doc, inner=causal(), block_size=128)
        out = attend(q, k, v, bm)
        assert torch.allclose(out, flex_attention(q, k, v, block_mask=bm), atol=1e-5)
    assert compiles.frame_count == 1


def test_local_positions_example():
    doc = torch.tensor([0, 0, 1, 1, 1, -1, 2])
    assert local_positions(doc).tolist() == [0, 1, 0, 1, 2, 0, 0]


def test_the_builder_compiles_as_one_graph_reused_across_layouts():
    """make_block_mask(compile=True) compiles block_tables with fullgraph=True: a sync or a
    data-dependent shape would break the graph. aot_eager keeps the test fast; the tables
    must equal the eager ones, and new layouts of the same T must not recompile."""
    torch._dynamo.reset()
    compiles = CompileCounterWithBackend("aot_eager")
    build = torch.compile(block_tables, backend=compiles, fullgraph=True, dynamic=False)
    rule = causal().block_rule  # type: ignore[attr-defined]
    for lens in ([100, 56, 100], [256], [1] * 30 + [200], [9] * 28):
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
        doc = F.pad(doc, (0, 256 - len(doc)), value=-1)
        got = build(doc, doc, rule, 32, 32, True)
        want = block_tables(doc, doc, rule, 32, 32, True)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert compiles.frame_count == 1


def test_the_builder_compiled_by_inductor_equals_eager_and_never_recompiles():
    """make_block_mask(compile=True) through the real Inductor backend (CPU here; the same
    graph failed to lower on CUDA before the document-only path stopped needing spans): the
    tables equal the eager builder's for every layout, and new layouts of the same T reuse
    the graph, for the document mask and for a ruled inner mask."""
    from torch._dynamo.utils import counters

    from packing.attention._masks import _compiled_block_tables

    torch._dynamo.reset()
    _compiled_block_tables.cache_clear()
    for inner in (None, causal()):
        before = counters["stats"]["unique_graphs"]
        for lens in ([100, 56, 100], [256], [1] * 30 + [200], [9] * 28, [37, 2, 60]):
            doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
            doc = F.pad(doc, (0, 320 - len(doc)), value=-1)
            got = make_block_mask(doc, inner=inner, block_size=32, compile=True)
            want = make_block_mask(doc, inner=inner, block_size=32)
            assert all(
                torch.equal(g, w)
                for g, w in zip(got.as_tuple()[2:10], want.as_tuple()[2:10], strict=True)
            ), (inner, lens)
        assert counters["stats"]["unique_graphs"] - before == 1, inner


def test_cuda_graph_builds_refuse_what_they_cannot_do_and_name_the_fix():
    """compile='cuda_graph' is a CUDA path: on CPU doc ids it raises naming compile=True, it
    needs a block rule (an unruled inner mask would need a sync), and a typo is an error, not
    a silent eager build. (The graphed tables are checked against eager in tests/test_gpu.py.)"""
    doc = torch.tensor([0] * 40 + [1] * 20 + [-1] * 4)
    with pytest.raises(ValueError, match=r"needs CUDA doc ids.*compile=True"):
        make_block_mask(doc, block_size=32, compile="cuda_graph")
    with pytest.raises(ValueError, match=r"needs an inner mask with a block_rule.*with_block_rule"):
        make_block_mask(doc, inner=and_masks(causal(), causal()), compile="cuda_graph")
    with pytest.raises(ValueError, match=r"compile='graph'; use False, True or 'cuda_graph'"):
        make_block_mask(doc, block_size=32, compile="graph")  # type: ignore[arg-type]


def test_docs_composition_recipe_is_exact_and_as_tight_as_evaluating():
    # The recipe of docs/masks.md: and_masks of two ruled masks, with the &-ed rules attached.
    fc, win = frame_causal(4), sliding_window(6)

    def rule(a, b, c, d):
        any1, all1 = fc.block_rule(a, b, c, d)  # type: ignore[attr-defined]
        any2, all2 = win.block_rule(a, b, c, d)  # type: ignore[attr-defined]
        return any1 & any2, all1 & all2

    local_frames = with_block_rule(and_masks(fc, win), rule, "frame_causal_4_window_6")
    doc = torch.tensor([0] * 37 + [1] * 2 + [2] * 60 + [-1] * 29)
    ruled = make_block_mask(doc, inner=local_frames, block_size=8, inner_fallback="error")
    evaluated = make_block_mask(doc, inner=and_masks(fc, win), block_size=8)
    assert torch.equal(effective_mask(ruled), dense_mask(doc, inner=and_masks(fc, win)))
    # Only the any side may over-approximate: listed tiles are a superset, full tiles agree.
    r, e = block_classes(ruled), block_classes(evaluated)
    assert torch.equal(r == FULL, e == FULL) and bool(((r != EMPTY) >= (e != EMPTY)).all())


# -- an extra mask_mod on per-token attributes (e.g. LingBot-VA's chunk rule) -----------------
def _parity_mask(kind_T: torch.Tensor, with_rule: bool):
    """Tokens of one kind (0 or 1, per token) see the same kind only; the tile rule reads
    per-tile sets of kinds, the dense mask the pairs."""
    from packing.attention import with_tile_rule

    def same_kind(b, h, q, kv):
        return kind_T[q] == kind_T[kv]

    if not with_rule:
        return same_kind

    def rule(bq: int, bkv: int):
        def tiles(block: int) -> tuple[torch.Tensor, torch.Tensor]:
            n = -(-kind_T.shape[0] // block)
            t = F.pad(kind_T, (0, n * block - kind_T.shape[0]), value=-1).view(n, block)
            return (t == 0).any(1), (t == 1).any(1)

        (q0, q1), (k0, k1) = tiles(bq), tiles(bkv)
        any_ = (q0[:, None] & k0[None]) | (q1[:, None] & k1[None])
        all_ = (q0[:, None] ^ q1[:, None]) & (k0[None] ^ k1[None]) & (q0[:, None] == k0[None])
        return any_, all_

    return with_tile_rule(same_kind, rule, "same_kind")


def test_an_extra_mask_mod_with_a_tile_rule_builds_the_exact_blocks_without_a_sync() -> None:
    doc = torch.tensor([0] * 40 + [1] * 30 + [2] * 50 + [-1] * 8)
    kind = torch.tensor(([0] * 16 + [1] * 16) * 4)[: doc.shape[0]]
    ruled = _parity_mask(kind, with_rule=True)
    dense = dense_mask(doc, None, None, ruled)
    assert ruled.__name__ == "same_kind"
    for block in (8, 16, 32):
        fast = make_block_mask(doc, None, None, block, mask_mod=ruled, inner_fallback="error")
        evaluated = make_block_mask(doc, None, None, block, mask_mod=_parity_mask(kind, False))
        assert torch.equal(fast.to_dense(), evaluated.to_dense()), block  # same tiles
        for name in ("full_kv_num_blocks", "kv_num_blocks"):
            assert torch.equal(getattr(fast, name), getattr(evaluated, name)), (block, name)
        assert block == 32 or int(fast.full_kv_num_blocks.sum()) > 0  # found full tiles
        # the BlockMask's own mask_mod is the document mask AND the extra rule
        q, kv = torch.arange(doc.shape[0])[:, None], torch.arange(doc.shape[0])[None]
        zero = torch.zeros((), dtype=torch.int64)
        assert torch.equal(fast.mask_mod(zero, zero, q, kv).expand_as(dense), dense)
    assert fast.mask_mod.__name__ == "document_and_same_kind"
    with pytest.raises(
        ValueError, match=r"'same_kind' has no tile_rule and inner_fallback='error'"
    ):
        make_block_mask(
            doc, None, None, 16, mask_mod=_parity_mask(kind, False), inner_fallback="error"
        )
    with pytest.raises(TypeError, match=r"mask_mod must be a FlexAttention mask_mod"):
        make_block_mask(doc, mask_mod=3)  # type: ignore[arg-type]


def test_prepare_attention_ands_the_extra_mask_mod_on_every_backend_it_allows() -> None:
    from packing.attention import prepare_attention
    from packing.data import layout_from_lengths

    lay = layout_from_lengths([20, 12], [20, 12], 40)
    kind = torch.tensor([0, 1] * 20)
    rule = _parity_mask(kind, with_rule=True)
    m = prepare_attention(lay, backend="sdpa", mask_mod=rule)
    want = dense_mask(lay.doc_ids_T, None, None, rule)
    has = want.any(1)
    assert torch.equal(m.dense_TT, want | ~has[:, None]) and m.mask_mod is rule
    assert "mask_mod=same_kind" in repr(m)
    flex = prepare_attention(lay, backend="flex", mask_mod=rule)
    assert flex.block_mask.mask_mod.__name__ == "document_and_same_kind"
    with pytest.raises(ValueError, match=r"varlen"):
        prepare_attention(lay, backend="varlen", mask_mod=rule, device="cpu")
