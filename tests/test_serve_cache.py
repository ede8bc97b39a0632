"""The context cache (packing.serve.ContextCache): cached == uncached for every request, a
session's chunks reuse exactly the frames they already sent, the pool's pages are evicted and
freed as documented, models whose context attends to generated tokens are refused; and
committed actions (real-time chunking) in both engines."""

from __future__ import annotations

import random

import pytest
import torch
from serve_robots import run_without_host_sync

from packing.cli import main
from packing.model import DiT, DiTConfig
from packing.serve import (
    ContextCache,
    Engine,
    EngineConfig,
    FlowScheduler,
    PackShape,
    Request,
    VideoEngine,
    verify_inference,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, 2 busy cores

SCHED = FlowScheduler(solver="multistep2", shift=3.0)


def _model(frame_causal: bool = True) -> DiT:
    torch.manual_seed(0)
    cfg = DiTConfig.tiny(latent_channels=8, latent_hw=(4, 8), action_dim=6,
                         frame_causal=frame_causal, attention="sdpa")  # fmt: skip
    return DiT(cfg).eval()


def _uncached() -> EngineConfig:
    return EngineConfig(shapes=(PackShape(frames=24, actions=24, requests=4),), scheduler=SCHED,
                        max_steps=6)  # fmt: skip


def _cached(
    pages: int = 16,
    page_frames: int = 2,
    prefill_frames: int = 3,
    context_frames: int | None = None,
) -> EngineConfig:
    return EngineConfig(
        shapes=(PackShape(frames=2, actions=6, requests=2), PackShape(frames=6, actions=16, requests=4)),
        scheduler=SCHED, max_steps=6,
        context_cache=ContextCache(pages=pages, page_frames=page_frames, prefill_frames=prefill_frames,
                                   context_frames=context_frames),
    )  # fmt: skip


def _alone(model: DiT, r: Request):
    engine = Engine(model, _uncached())
    engine.submit(r)
    (out,) = engine.run()
    return out


def _rel(a, b) -> float:
    err = 0.0
    for x, y in ((a.latents, b.latents), (a.action, b.action)):
        if y.numel():
            d = float((x - y).abs().max() / y.abs().max().clamp_min(1e-12))
            err = max(err, d if d == d else float("inf"))  # NaN is no match
    return err


def _frames(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 8, 4, 8, generator=torch.Generator().manual_seed(seed))


# -- the proof -------------------------------------------------------------------------------
@pytest.mark.parametrize("solver", ["euler", "multistep2"])
def test_cached_inference_equals_uncached_alone(solver):
    report = verify_inference(context_cache=True, solver=solver)
    assert report.passed, report.format()
    assert report.cache["reused_frames"] >= 3 and report.cache["mismatches"] >= 1
    assert report.cache["prefill_passes"] > len(report.errors) // 2  # passes of 3 frames
    assert max(report.errors.values()) <= 1e-5 and report.committed_identical
    assert set(report.scratch_errors) == {8, 9}  # the chunks that reused frames


def test_a_stale_cache_and_a_missing_document_mask_fail_the_proof():
    stale = verify_inference(context_cache=True, stale_cache=True)
    assert not stale.passed and stale.cache["mismatches"] == 0
    assert stale.errors[9] > 1e-3, stale.format()  # the changed frame was reused: stale
    assert max(e for i, e in stale.errors.items() if i != 9) <= 1e-5
    leaky = verify_inference(context_cache=True, document_mask=False)
    assert not leaky.passed and min(leaky.errors.values()) > 1e-3, leaky.format()


def test_cli_verify_inference_with_the_context_cache(capsys):
    flags = ["verify", "--inference", "--context-cache", "--mask", "frame-causal"]
    assert main(flags) == 0
    assert "context cache: prefilled_frames" in capsys.readouterr().out
    assert main([*flags, "--no-document-mask"]) == 1
    assert main(["verify", "--inference", "--context-cache"]) == 2  # a document-mask model
    assert "--mask frame-causal" in capsys.readouterr().err
    assert main(["verify", "--context-cache"]) == 2  # a flag of --inference only
    assert "add --inference" in capsys.readouterr().err


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_arrivals_cached_equal_uncached(seed, window):
    """Random requests (dropped frames, sessions continuing, committed actions) joining at
    random steps, small pool: every result equals the request alone without the cache.
    ``window=5``: each pack attends over its own pages only (3 a request), not the pool."""
    rng = random.Random(seed)
    model = _model()
    engine = Engine(
        model,
        _cached(pages=7, page_frames=2, prefill_frames=(rng.randint(1, 2), rng.randint(3, 5)),
                context_frames=window),
    )  # fmt: skip
    reqs, when, sessions = [], [], {}
    for i in range(9):
        s = f"robot {rng.randint(0, 2)}"
        prev = sessions.get(s)
        n = rng.randint(0, 5)
        ctx = _frames(n, 100 * seed + i)
        if prev is not None and n >= prev.shape[0]:  # continue the session's episode
            ctx[: prev.shape[0]] = prev
        sessions[s] = ctx
        keep = (
            tuple(sorted(rng.sample(range(n), rng.randint(1, n)))) if n > 2 and i % 3 == 0 else None
        )
        k = rng.randint(0, 2)
        reqs.append(Request(context=ctx, frames=rng.randint(0, 2), actions=k + rng.randint(1, 3),
                            seed=seed * 10 + i, task=f"t{i % 2}", steps=rng.randint(1, 6),
                            keep_frames=keep, session=s if i % 4 else None,
                            committed_actions=torch.randn(k, 6) if k else None))  # fmt: skip
        when.append(rng.randint(0, 8))
    ids, out, tick = {}, {}, 0
    while len(out) < len(reqs):
        for i, w in enumerate(when):
            if i not in ids and w <= tick:
                ids[i] = engine.submit(reqs[i])
        out.update({r.request_id: r for r in engine.step()})
        tick += 1
    assert engine.stats["prefill_passes"] > 0
    for i, r in enumerate(reqs):
        got = out[ids[i]]
        assert _rel(got, _alone(model, r)) <= 1e-5, (i, engine.stats)
        if r.committed:
            assert torch.equal(got.action[: r.committed], r.committed_actions)


# -- sessions ----------------------------------------------------------------------------------
def test_a_session_reuses_its_frames_and_re_prefills_a_changed_one():
    model, f = _model(), _frames(6)
    engine = Engine(model, _cached())

    def chunk(ctx: torch.Tensor, keep=None, session="arm") -> tuple[float, dict]:
        before = dict(engine.stats)
        r = Request(context=ctx, frames=1, actions=3, task="pick", seed=1, steps=3,
                    session=session, keep_frames=keep)  # fmt: skip
        engine.submit(r)
        (got,) = engine.run()
        return _rel(got, _alone(model, r)), {k: engine.stats[k] - before[k] for k in before}

    err, d = chunk(f[:3])
    assert err <= 1e-5 and d["prefilled_frames"] == 3 and d["reused_frames"] == 0
    err, d = chunk(f[:5])  # two new frames observed
    assert err <= 1e-5 and d["prefilled_frames"] == 2 and d["reused_frames"] == 3
    changed = f.clone()
    changed[1] += 1e-3  # a tiny change is a change: frames 1.. are prefilled again
    err, d = chunk(changed[:5])
    assert err <= 1e-5 and d["reused_frames"] == 1 and d["mismatches"] == 1
    err, d = chunk(changed[:6], keep=(0, 1, 3, 5))  # frame 2 dropped: frame 3's keys change
    assert err <= 1e-5 and d["reused_frames"] == 2 and d["prefilled_frames"] == 2
    err, d = chunk(changed[:6], keep=(0, 1, 3, 5), session="other arm")  # no sharing
    assert err <= 1e-5 and d["reused_frames"] == 0
    r = Request(context=changed[:6], frames=1, actions=3, task="place", seed=1, steps=3,
                session="arm")  # fmt: skip
    engine.submit(r)  # another task: the text changes every frame's keys
    (got,) = engine.run()
    assert _rel(got, _alone(model, r)) <= 1e-5


def test_a_corrupted_page_shows_in_the_result():
    """The control: the step really reads the cached pages (a page changed behind the hash
    check changes the next chunk), so the equality above is not vacuous."""
    model, f = _model(), _frames(4)
    engine = Engine(model, _cached())
    engine.submit(Request(context=f[:2], frames=1, actions=2, session="arm", steps=2))
    engine.run()
    engine.packs.pool.k[:, : engine.packs.pool.page_tokens] += 0.5  # page 0: frames 0, 1 of "arm"
    r = Request(context=f[:4], frames=1, actions=2, session="arm", steps=2)
    engine.submit(r)
    (got,) = engine.run()
    assert engine.stats["reused_frames"] == 2 and _rel(got, _alone(model, r)) > 1e-3


def test_two_chunks_of_one_session_never_share_a_pack():
    model, f = _model(), _frames(3)
    engine = Engine(model, _cached())
    a = engine.submit(Request(context=f[:2], frames=1, actions=2, session="arm", steps=2))
    b = engine.submit(Request(context=f[:3], frames=1, actions=2, session="arm", steps=2))
    c = engine.submit(Request(context=f[:1], frames=1, actions=2, session="leg", steps=2))
    engine.step()
    assert [rid for rid, _ in engine.last_pack] == [a]  # b waits for a; FIFO keeps c behind
    engine.run()
    assert engine.stats["reused_frames"] == 2 and c == b + 1


def test_lru_eviction_end_session_and_cancel_free_pages():
    model = _model()
    engine = Engine(model, _cached(pages=4, page_frames=2))  # 4 pages of 2 frames
    pool = engine.packs.pages
    for s in ("a", "b"):  # each keeps 2 pages after its request
        engine.submit(Request(context=_frames(3), frames=1, actions=2, session=s, steps=2))
        engine.run()
    assert len(pool.free) == 0 and list(pool.entries) == ["a", "b"]
    engine.submit(Request(context=_frames(3), frames=1, actions=2, session="a", steps=2))
    engine.run()  # "a" reused: now the most recently used
    assert list(pool.entries) == ["b", "a"] and engine.stats["evictions"] == 0
    r = Request(context=_frames(2, 5), frames=1, actions=2, steps=2)  # no session: 1 page
    engine.submit(r)
    (got,) = engine.run()
    assert engine.stats["evictions"] == 1 and list(pool.entries) == ["a"]  # "b" was LRU
    assert _rel(got, _alone(model, r)) <= 1e-5 and len(pool.free) == 2  # its page came back
    engine.end_session("a")
    assert len(pool.free) == 4 and not pool.entries
    engine.end_session("never seen")  # nothing to free
    rid = engine.submit(Request(context=_frames(4), frames=1, actions=2, session="c", steps=3))
    engine.step()
    assert len(pool.free) == 2 and engine.cancel(rid) and len(pool.free) == 4
    assert engine.run() == []
    rid = engine.submit(Request(context=_frames(4), frames=1, actions=2, session="d", steps=3))
    engine.step()
    engine.end_session("d")  # running: freed when it leaves
    assert len(pool.free) == 2
    engine.run()
    assert len(pool.free) == 4 and not pool.entries


# -- refusals and bad input ----------------------------------------------------------------
def test_a_model_whose_context_sees_generated_tokens_is_refused():
    with pytest.raises(ValueError, match=r"frame-causal model.*frame_causal=False"):
        Engine(_model(frame_causal=False), _cached())
    Engine(_model(frame_causal=False), _uncached())  # uncached: served as before
    with pytest.raises(ValueError, match=r"bidirectionally.*context_cache=None"):
        VideoEngine(None, [], context_cache=ContextCache(pages=4))  # type: ignore[arg-type]


def test_cache_config_and_requests_are_checked():
    for bad in (
        dict(pages=0),
        dict(pages=4, page_frames=0),
        dict(pages=2.0),
        dict(pages=4, prefill_frames=()),
        dict(pages=4, prefill_frames=(4, 0)),
    ):
        with pytest.raises((ValueError, TypeError), match="ContextCache"):
            ContextCache(**bad)  # type: ignore[arg-type]
    sizes = ContextCache(pages=1, prefill_frames=[32, 4, 4])
    assert sizes.pass_sizes == (4, 32) and [sizes.pass_size(n) for n in (1, 4, 5, 80)] == [
        4,
        4,
        32,
        32,
    ]
    with pytest.raises(TypeError, match="context_cache"):
        EngineConfig(shapes=(PackShape(frames=1, actions=1, requests=1),), context_cache=4)
    engine = Engine(_model(), _cached(pages=2, page_frames=2))
    with pytest.raises(ValueError, match=r"5 context frames, 3 pages.*ContextCache.pages"):
        engine.submit(Request(context=_frames(5), frames=1, actions=2, steps=2))
    with pytest.raises(ValueError, match=r"generates 7 frames.*generated ones"):
        engine.submit(Request(context=_frames(1), frames=7, actions=2, steps=2))


# -- real-time chunking ----------------------------------------------------------------------
@pytest.mark.parametrize("cached", [False, True])
def test_committed_actions_come_back_bit_identical(cached):
    model = _model()
    done = torch.randn(3, 6)
    r = Request(context=_frames(2), frames=1, actions=8, seed=4, steps=4, committed_actions=done)
    other = Request(context=_frames(3, 1), frames=1, actions=5, seed=5, steps=3)
    engine = Engine(model, _cached() if cached else _uncached())
    rid = engine.submit(r)
    engine.submit(other)
    got = {x.request_id: x for x in engine.run()}[rid]
    assert torch.equal(got.action[:3], done)
    assert _rel(got, _alone(model, r)) <= 1e-5
    free = _alone(model, Request(context=_frames(2), frames=1, actions=8, seed=4, steps=4))
    assert (got.action[3:] - free.action[3:]).abs().max() > 1e-3  # the commitment conditions


def test_committed_actions_are_checked():
    z = torch.zeros(1, 8, 4, 8)
    with pytest.raises(ValueError, match=r"committed_actions.*1 <= k <= actions=2"):
        Request(context=z, frames=1, actions=2, committed_actions=torch.zeros(3, 6))
    with pytest.raises(ValueError, match="committed_actions"):
        Request(context=z, frames=1, actions=2, committed_actions=torch.zeros(6))
    with pytest.raises(TypeError, match=r"float32.*\.float\(\)"):
        Request(context=z, frames=1, actions=2, committed_actions=torch.zeros(1, 6).double())
    engine = Engine(_model(), _uncached())
    with pytest.raises(ValueError, match=r"4 action dims.*action_dim=6"):
        engine.submit(Request(context=z, frames=1, actions=2, committed_actions=torch.zeros(1, 4)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_cached_engine_equals_uncached_and_makes_no_sync():
    torch.manual_seed(0)
    cfg = DiTConfig.tiny(latent_channels=8, latent_hw=(4, 8), action_dim=6, frame_causal=True)
    model = DiT(cfg).cuda().eval()
    reqs = [Request(context=_frames(i + 1, i), frames=1, actions=3, seed=i, steps=3,
                    session=f"s{i % 2}") for i in range(5)]  # fmt: skip
    cached = EngineConfig(shapes=(PackShape(frames=4, actions=12, requests=4),), max_steps=4,
                          cuda_graphs=True, context_cache=ContextCache(pages=16))  # fmt: skip
    engine = Engine(model, cached)
    engine.submit(reqs[0])
    engine.run()  # capture happens here, before the checked steps
    for r in reqs[1:]:
        engine.submit(r)
    out = run_without_host_sync(engine)
    ref_cfg = EngineConfig(shapes=(PackShape(frames=12, actions=12, requests=4),), max_steps=4)
    for r, got in zip(reqs[1:], out, strict=True):
        alone = Engine(model, ref_cfg)
        alone.submit(r)
        (want,) = alone.run()
        torch.testing.assert_close(got.latents, want.latents, rtol=1e-4, atol=1e-4)


def test_the_pool_masks_can_be_read_on_every_pair_of_their_padded_tiles():
    """A tiled kernel evaluates the mask_mod on the padding of a ragged last tile too (rows
    up to R * 128 - 1, columns up to C * 128 - 1; FlexAttention's own Triton kernel wraps
    them, a kernel that does not reads there). The pool's masks must answer such a pair with
    False and never index past their id tensors: the cached step's keys (pool ++ tail) and
    its queries are rarely a multiple of the tile (5B widths, 2 robots: 160 x 16,544)."""
    from packing.serve._cached_step import pool_mask

    model = _model()
    engine = Engine(model, _cached(pages=17, page_frames=2))  # N = 17 * 2 * 8 = 272 pool keys
    for i in range(2):
        engine.submit(Request(context=_frames(3, i), frames=2, actions=6, steps=2, seed=i))
    engine.step()  # admitted: page tables loaded, the pack laid out
    b, pool = engine.packs.buffers[engine._shape], engine.packs.pool
    doc_N, pos_N = pool.keys()
    cases = {
        "step": (b.doc_J, b.pos_J, torch.cat([doc_N, b.doc_J]), torch.cat([pos_N, b.pos_J])),
        "prefill": (b.doc_J, b.pos_J, doc_N, pos_N),
    }
    for name, (q_doc, q_pos, kv_doc, kv_pos) in cases.items():
        Tq, Tk = q_doc.shape[0], kv_doc.shape[0]
        assert Tq % 128 and Tk % 128, (name, Tq, Tk)  # both last tiles ragged: the case
        mask = pool_mask(q_doc, q_pos, kv_doc, kv_pos, backend="flex", inner=engine.packs._inner,
                         document_mask=True)  # fmt: skip
        R, C = -(-Tq // 128), -(-Tk // 128)
        q, kv = torch.arange(R * 128)[:, None], torch.arange(C * 128)[None, :]
        zero = torch.zeros((), dtype=torch.int64)
        got = mask.block_mask.mask_mod(zero, zero, q, kv)  # raised IndexError before
        dense = pool_mask(q_doc, q_pos, kv_doc, kv_pos, backend="sdpa", inner=engine.packs._inner,
                          document_mask=True)  # fmt: skip
        want = torch.zeros(R * 128, C * 128, dtype=torch.bool)
        want[:Tq, :Tk] = dense.dense_TT & dense.keep_T[:, None]
        assert torch.equal(got, want), name
        assert got[:Tq, :Tk].any(), name  # not vacuous: the real pairs attend


def test_a_request_removed_by_any_path_frees_its_pages_zeroed():
    model = _model()
    engine = Engine(model, _cached(pages=4, page_frames=2))
    rid = engine.submit(Request(context=_frames(3), frames=1, actions=2, session="arm", steps=3))
    engine.step()
    pt = engine.packs.pool.page_tokens
    engine.packs.pool.k[:, : 2 * pt] = float("nan")  # its 2 pages: as a failed request's could be
    assert engine._drop(rid)  # how cancel and the non-finite quarantine remove a member
    r = Request(context=_frames(1, 1), frames=1, actions=2, steps=3)  # 1 page; NaN pages masked
    engine.submit(r)
    (got,) = engine.run()
    assert "arm" not in engine.packs.pages.entries and len(engine.packs.pages.free) == 4
    assert _rel(got, _alone(model, r)) <= 1e-5
    pool = engine.packs.pages  # after a failed model call: entries whose request is gone are swept
    pool.claim("gone", [b"x"], owner=41)
    pool.claim("here", [b"y"], owner=42)
    pool.sweep({42})
    assert list(pool.entries) == ["here"]


def test_the_benchmark_flop_count_matches_flop_counter_mode():
    """benchmarks/serving/bench_cache.py's analytic FLOPs, pass by pass, equal torch's
    FlopCounterMode on a small config (cached and uncached engines)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serving" / "bench_cache.py"
    spec = importlib.util.spec_from_file_location("bench_cache", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.flop_counter_check(0)
    assert [r["engine"] for r in rows] == ["uncached", "cached"]
    assert all(r["counted"] == pytest.approx(r["analytic"], rel=1e-9) for r in rows), rows
    table = bench.flops_rows({"5B": bench.model_config("5b", 30)}, 10)
    short = {r["case"]: r["ratio"] for r in table if r["mix"] == "short"}
    assert 4 < short["first chunk"] < short["next chunk"]  # ~5x and ~8x (issue 34)


class _PrefillCrash(DiT):
    """Raises in a prefill (a model call with a cache) that holds the marked context."""

    def velocity(self, tokens, t_R, row_J, pack, cache=None):  # type: ignore[override]
        if cache is not None and bool((tokens["latents"] == 7.5).any()):
            raise RuntimeError("boom")
        return super().velocity(tokens, t_R, row_J, pack, cache)


def test_a_request_whose_prefill_raises_fails_alone():
    torch.manual_seed(0)
    cfg = _model().config
    model = _PrefillCrash(cfg).eval()
    model.load_state_dict(_model().state_dict())
    engine = Engine(model, _cached(pages=8))
    reqs = [Request(context=_frames(2, i), frames=1, actions=2, seed=i, steps=3, session=f"s{i}")
            for i in range(3)]  # fmt: skip
    reqs[1].context[0, 0, 0, 0] = 7.5  # the marked one (copied at submit with the mark)
    ids = [engine.submit(r) for r in reqs]
    out = {r.request_id: r for r in engine.run()}
    assert out[ids[1]].error is not None and "prefilling its context raised" in out[ids[1]].error
    assert "s1" not in engine.packs.pages.entries
    for i in (0, 2):
        assert out[ids[i]].error is None and _rel(out[ids[i]], _alone(_model(), reqs[i])) <= 1e-5


def test_a_steps_keys_follow_the_pages_its_pack_uses_not_the_pool(monkeypatch):
    """With ``context_frames`` a pack attends over its window of pages: the same two requests
    in a pool of 32 and of 512 pages run over the same number of keys, with equal results;
    without it (the control) the keys grow with the pool."""
    import packing.serve._cached_step as cached_step

    seen: list[int] = []
    real = cached_step.pool_mask

    def spy(q_doc, q_pos, kv_doc, kv_pos, **kw):
        seen.append(kv_doc.shape[0])
        return real(q_doc, q_pos, kv_doc, kv_pos, **kw)

    monkeypatch.setattr(cached_step, "pool_mask", spy)
    model = _model()
    reqs = [Request(context=_frames(5, i), frames=1, actions=3, steps=2, seed=i, session=f"s{i}")
            for i in range(2)]  # fmt: skip
    keys, outs = {}, {}
    for pages, window in ((32, 5), (512, 5), (32, None), (512, None)):
        seen.clear()
        engine = Engine(model, _cached(pages=pages, context_frames=window))
        for r in reqs:
            engine.submit(r)
        outs[pages, window] = sorted(engine.run(), key=lambda r: r.request_id)
        keys[pages, window] = max(seen)
    assert keys[32, 5] == keys[512, 5] == 2 * 3 * 2 * 8 + 2 * 8 + 6  # 2 requests x 3 pages
    assert keys[512, None] > 10 * keys[32, 5]  # the control: the whole pool
    for a, b in zip(outs[32, 5], outs[512, None], strict=True):
        assert _rel(a, b) <= 1e-5


def test_a_request_with_more_context_than_the_window_is_refused():
    engine = Engine(_model(), _cached(context_frames=4))
    with pytest.raises(
        ValueError, match=r"keeps 5 context frames, more than ContextCache\.context_frames=4"
    ):
        engine.submit(Request(context=_frames(5), frames=1, actions=2, steps=2))
    with pytest.raises(ValueError, match=r"ContextCache\.context_frames"):
        ContextCache(pages=4, context_frames=0)


def test_the_serving_masks_keep_flexattention_off_its_decoding_kernel():
    """A pack of one request has fewer than 128 queries (80 at 5B widths), which inductor
    lowers to FlexAttention's decoding kernel: 2.6 ms a call against 0.083 ms on an H200
    (benchmarks/reports/2026-12-04_served_engine.md). Every serving mask forces the main one."""
    from packing.attention import frame_causal
    from packing.serve._cached_step import pool_mask
    from packing.serve._step import cross_mask, masks_from_doc_ids

    doc, pos = torch.zeros(80, dtype=torch.int64), torch.arange(80)
    text = torch.zeros(16, dtype=torch.int64)
    inner = frame_causal(8)
    masks = [*masks_from_doc_ids(doc, text, backend="flex", inner=inner, document_mask=True),
             cross_mask(doc, text, backend="flex", document_mask=True),
             pool_mask(doc, pos, doc, pos, backend="flex", inner=inner, document_mask=True)]  # fmt: skip
    for m in masks:
        assert m.kernel_options == {"FORCE_USE_FLEX_ATTENTION": True}, m
    sdpa = pool_mask(doc, pos, doc, pos, backend="sdpa", inner=inner, document_mask=True)
    assert sdpa.kernel_options is None  # the control: SDPA has no such option
