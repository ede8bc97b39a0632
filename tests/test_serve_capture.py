"""Every served step can be captured in a CUDA graph and replayed, checked on the CPU.

For each `Packs` (the reference DiT, the DiT over a context cache, a `VideoModel`, LeRobot's
LingBot-VA), robots join and leave between steps through the real engine, and every step
(and every prefill or feedback pass the engine captures by key) is recorded op by op
(tests/replay_check.py): no op may need the host, and every step of a key must run the same
ops with the same Python arguments, reading every tensor it did not create at the address
the first one read, the address a captured graph replays. Planted mistakes (a ``.item()`` in
the step, a buffer replaced instead of copied into at admission) must fail the check. The
LingBot-VA masks rebuilt at admission are checked through FlexAttention on the CPU.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
from reference import MixModel
from replay_check import host_syncs, record, recording, replay_mismatch

from packing.model import DiT, DiTConfig
from packing.serve import ContextCache, Engine, EngineConfig, PackShape, Request
from packing.serve._step import Buffers

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, 2 busy cores


def _check(calls: list[tuple[Any, Any]]) -> int:
    """Fail on a host sync or a step that would not replay its key's first; returns the most
    compositions one key was checked across (the guard against a vacuous pass)."""
    by_key: dict[Any, list[tuple[Any, Any]]] = defaultdict(list)
    for (key, members), ops in calls:
        by_key[key].append((members, ops))
    most = 0
    for key, recs in by_key.items():
        first = recs[0][1]
        for members, ops in recs:
            syncs = host_syncs(ops)
            assert not syncs, f"{key} with {members} needs the host: {syncs[:3]}"
            why = replay_mismatch(first, ops)
            assert why is None, (
                f"{key}: a graph captured at {recs[0][0]} replayed at {members}: {why}"
            )
        most = max(most, len({m for m, _ in recs}))
    return most


# -- the reference DiT, with and without a context cache -----------------------------------
def _dit_engine(cached: bool) -> Engine:
    torch.manual_seed(0)
    cfg = DiTConfig.tiny(latent_channels=8, latent_hw=(4, 8), action_dim=6, attention="sdpa",
                         frame_causal=True)  # fmt: skip
    cache = ContextCache(pages=16, page_frames=2, prefill_frames=3) if cached else None
    shape = PackShape(frames=(2 if cached else 12), actions=16, requests=4)
    return Engine(DiT(cfg).eval(), EngineConfig(shapes=(shape,), max_steps=4,
                                                context_cache=cache))  # fmt: skip


def _dit_request(i: int) -> Request:
    ctx = torch.randn(1 + i % 3, 8, 4, 8, generator=torch.Generator().manual_seed(i))
    return Request(context=ctx, frames=1, actions=3, seed=i, steps=2 + i % 3,
                   session=f"robot{i % 2}")  # fmt: skip


def _run_dit(engine: Engine) -> list[tuple[Any, Any]]:
    """Requests joining at every step (different robots, steps, context lengths)."""
    packs: Any = engine.packs
    key = lambda s: (("step", s), frozenset(r for r, _ in engine.last_pack))  # noqa: E731
    with recording(packs, "step", key) as calls:
        if hasattr(packs, "_run_prefill"):
            prefill = lambda s, b: (("prefill", s, b.x.shape[0]), len(calls))  # noqa: E731
            with recording(packs, "_run_prefill", prefill) as passes:
                _serve_dit(engine)
            return calls + passes
        _serve_dit(engine)
    return calls


def _serve_dit(engine: Engine) -> None:
    for i in range(6):
        engine.submit(_dit_request(i))
        out = engine.step()
        assert all(r.error is None for r in out), out
    assert all(r.error is None for r in engine.run())


@pytest.mark.parametrize("cached", [False, True], ids=["dit", "cached_dit"])
def test_dit_steps_are_replayable_across_compositions(cached: bool) -> None:
    assert _check(_run_dit(_dit_engine(cached))) >= 4


def test_a_host_read_planted_in_the_step_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _dit_engine(cached=False)
    velocity = engine.model.velocity

    def reads_back(tokens: Any, t_R: Any, row_J: Any, pack: Any) -> Any:
        if float(t_R.max()) > 2.0:  # a Python branch on a device value: a sync
            raise AssertionError("unreachable")
        return velocity(tokens, t_R, row_J, pack)

    monkeypatch.setattr(engine.model, "velocity", reads_back)
    with pytest.raises(AssertionError, match=r"needs the host: .*_local_scalar_dense"):
        _check(_run_dit(engine))


def test_a_buffer_replaced_at_admission_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    load = Buffers.load

    def replaces(self: Buffers, host: Any, t_table: Any, coef: Any, step_K: Any) -> None:
        load(self, host, t_table, coef, step_K)
        self.coef = self.coef.clone()  # a new tensor: a captured graph reads the old one

    monkeypatch.setattr(Buffers, "load", replaces)
    with pytest.raises(AssertionError, match="reads a tensor from outside the step at another"):
        _check(_run_dit(_dit_engine(cached=False)))


def test_the_cpu_only_host_checks_are_skipped_on_other_devices() -> None:
    """The checker leaves out two host reads (`replay_check.CPU_ONLY`) because they run on
    the CPU only: on the meta device (where a host read raises) they read nothing."""
    from packing.attention._masks import _check_pair
    from packing.train import broadcast_to_tokens

    ids = torch.tensor([0, 0, 1, -1])
    on_cpu = record(lambda: (_check_pair(ids, ids), broadcast_to_tokens(torch.ones(2), ids)))
    assert any(op.cpu_only and op.problem for op in on_cpu)  # it does read on the CPU
    meta = ids.to("meta")
    _check_pair(meta, meta)
    broadcast_to_tokens(torch.ones(2, device="meta"), meta)


# -- a VideoModel (VideoPacks) ---------------------------------------------------------------
def test_video_steps_are_replayable_across_compositions() -> None:
    from packing.serve import VideoEngine, VideoRequest, VideoShape

    engine = VideoEngine(MixModel(), [VideoShape(frames=12, text=12, requests=4)], max_steps=4)
    key = lambda s: (s, frozenset(r for r, _ in engine.last_pack))  # noqa: E731
    with recording(engine.packs, "step", key) as calls:
        for i in range(6):
            g = torch.Generator().manual_seed(i)
            engine.submit(VideoRequest(text=torch.randn(1 + i % 2, 3, generator=g),
                                       context=torch.randn(i % 2, 2, 2, 2, generator=g),
                                       frames=2, seed=i, steps=2 + i % 3))  # fmt: skip
            engine.step()
        assert all(r.error is None for r in engine.run())
    assert _check(calls) >= 4


# -- LeRobot's LingBot-VA (ServedLingBotVA): its steps and its feedback passes ---------------
def _lingbot(attention: str = "auto", **options: Any) -> Any:
    pytest.importorskip("lerobot.policies.lingbot_va")
    pytest.importorskip("transformers")
    from packing.integrations.lingbot_va._serve import LingBotVAEngine
    from packing.integrations.lingbot_va._serve_packs import phase_shapes
    from packing.integrations.lingbot_va.testing import tiny_serving_policy

    # packs of the video loop alone, the action loop alone (the other stream's tensors have
    # no rows) and of both
    return LingBotVAEngine(tiny_serving_policy(), robots=3, shapes=phase_shapes(2),
                           attention=attention, **options)  # fmt: skip


# robot: (engine step it first submits at, chunks): chunk 1 on feeds its keyframes back
ROBOTS = {"a": (0, 2), "b": (2, 1), "c": (4, 2)}


def _serve_lingbot(engine: Any) -> tuple[dict[tuple[str, int], Any], list[tuple[Any, Any]]]:
    """The robots through ``engine``, each next chunk asked as soon as the last came back;
    every step and feedback pass recorded."""
    from packing.integrations.lingbot_va._serve_request import ChunkRequest
    from packing.integrations.lingbot_va.testing import toy_text_embeddings

    text, F_ = toy_text_embeddings(16), engine.packs.cfg.frame_chunk_size
    frames = {n: torch.randn(1 + c * F_, 48, 8, 16, generator=torch.Generator().manual_seed(i))
              for i, (n, (_, c)) in enumerate(ROBOTS.items())}  # fmt: skip
    nxt, ids, out = dict.fromkeys(ROBOTS, 0), {}, {}
    members = lambda *_: frozenset(r for r, _ in engine.last_pack)  # noqa: E731
    with recording(engine.packs, "step", lambda s: (("step", s), members())) as calls, \
            recording(engine.packs, "_run_feedback", lambda: (("feedback",), len(calls))) as fb:  # fmt: skip
        for _ in range(500):
            for n, (start, chunks) in ROBOTS.items():
                if n not in ids.values() and nxt[n] < chunks and engine.clock >= start:
                    k = nxt[n]
                    ids[engine.submit(ChunkRequest(
                        session=n, frames=frames[n][: max(1, k * F_)], actions=None,
                        prompt=text(n), negative=text(""), seed=10 * k + len(n)))] = n  # fmt: skip
            for res in engine.step():
                n = ids.pop(res.request_id)
                assert res.error is None, res.error
                out[(n, nxt[n])] = res
                nxt[n] += 1
            if not (ids or any(nxt[n] < c for n, (_, c) in ROBOTS.items())):
                break
    assert len(out) == sum(c for _, c in ROBOTS.values()), out.keys()
    return out, calls + fb


def test_lingbot_steps_and_feedback_passes_are_replayable() -> None:
    engine = _lingbot()
    _, calls = _serve_lingbot(engine)
    assert _check(calls) >= 4
    # the packs ran in every kind of shape: one loop's (either) and mixed
    shapes = [key[1] for (key, _), _ops in calls if key[0] == "step"]
    kinds = {(s.video > 0, s.action > 0) for s in shapes}
    assert kinds == {(True, False), (False, True), (True, True)}, kinds
    assert sum(key == ("feedback",) for (key, _), _ in calls) >= 4  # 2 calls a fed-back chunk


def test_lingbot_a_buffer_replaced_at_admission_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lerobot.policies.lingbot_va")
    from packing.integrations.lingbot_va._serve_packs import StepBuffers

    load = StepBuffers.load

    def replaces(self: StepBuffers, host: Any) -> None:
        load(self, host)
        self.src_v = self.src_v.clone()  # a new tensor: a captured graph reads the old one

    monkeypatch.setattr(StepBuffers, "load", replaces)
    with pytest.raises(AssertionError, match="reads a tensor from outside the step at another"):
        _check(_serve_lingbot(_lingbot())[1])


def test_lingbot_flex_path_equals_sdpa_and_is_replayable() -> None:
    """The CUDA path's masks (FlexAttention block masks, rebuilt at every admission into the
    first composition's mask) run eagerly on the CPU: the same chunks as dense SDPA, and the
    steps replayable (the mask rule's doc tensors included: the recorder reads its closure)."""
    dense, _ = _serve_lingbot(_lingbot("sdpa"))
    engine = _lingbot("flex")
    assert engine.packs.backend == "flex" and engine.packs.buffers[engine.packs.shapes[0]].call.masks[0].block_mask is not None  # fmt: skip
    flex, calls = _serve_lingbot(engine)
    assert _check(calls) >= 4
    for key, want in dense.items():
        torch.testing.assert_close(flex[key].latents, want.latents, rtol=0, atol=1e-5)
        torch.testing.assert_close(flex[key].action, want.action, rtol=0, atol=1e-5)


def _composition(seed: int, Q: int, P: int, docs: int) -> dict[str, torch.Tensor]:
    """Docs in no order, as runs with holes (-1): whole 128-blocks (full blocks), then
    64-runs (partial blocks)."""
    g = torch.Generator().manual_seed(seed)

    def run(n: int) -> torch.Tensor:
        half = n // 2
        return torch.cat([torch.randint(-1, docs, (half // 128,), generator=g).repeat_interleave(128),
                          torch.randint(-1, docs, ((n - half) // 64,), generator=g).repeat_interleave(64)])  # fmt: skip

    return {"doc_Q": run(Q), "kdoc_P": run(P), "tdoc_Q": run(Q)}


def _attend(q: torch.Tensor, k: torch.Tensor, q_doc: torch.Tensor, k_doc: torch.Tensor,
            document_mask: bool) -> torch.Tensor:  # fmt: skip
    """The rule by hand: softmax over the allowed keys; a query with none gives 0."""
    allowed = (q_doc[:, None] >= 0) & (k_doc[None, :] >= 0)
    if document_mask:
        allowed &= q_doc[:, None] == k_doc[None, :]
    s = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, k)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("document_mask", [True, False])
def test_lingbot_masks_rebuilt_into_the_first_equal_fresh_ones(backend: str,
                                                               document_mask: bool) -> None:  # fmt: skip
    """`CallBuffers.load` copies each new composition's masks into the first one's tensors
    (a captured graph reads those): after empty -> A -> B, the first mask object attends as
    B's own fresh mask does, and as the rule by hand (FlexAttention eager on the CPU)."""
    pytest.importorskip("lerobot.policies.lingbot_va")  # the package needs it at import
    from packing.attention import packed_attention
    from packing.integrations.lingbot_va._serve_step import CallBuffers, doc_mask

    Qv, Qa, P, X = 384, 128, 1024, 256
    tkey_X = torch.arange(X // 64).repeat_interleave(64)
    cb = CallBuffers(Qv, Qa, P, 4, torch.device("cpu"))
    args: dict[str, Any] = dict(backend=backend, document_mask=document_mask)
    cb.load({}, tkey_X, **args)  # the empty composition, as the engine starts
    first = cb.masks
    g = torch.Generator().manual_seed(0)
    q, k, t = (torch.randn(n, 2, 8, generator=g) for n in (Qv + Qa, P, X))
    outs, blocks = [], torch.zeros(2, dtype=torch.int64)  # full, partial blocks seen
    for seed in (1, 2):
        cb.load(_composition(seed, Qv + Qa, P, docs=2), tkey_X, **args)
        assert cb.masks is first  # the same objects, their tensors copied into
        fresh = (doc_mask(cb.doc_Q, cb.kdoc_P, **args), doc_mask(cb.tdoc_Q, tkey_X, **args))
        if backend == "flex":
            bm = fresh[0].block_mask
            blocks += torch.stack([bm.full_kv_num_blocks.sum(), bm.kv_num_blocks.sum()])
        for mask, want_mask, keys, kd in ((first[0], fresh[0], k, cb.kdoc_P),
                                          (first[1], fresh[1], t, tkey_X)):  # fmt: skip
            got = packed_attention(q, keys, keys, mask)
            torch.testing.assert_close(got, packed_attention(q, keys, keys, want_mask),
                                       rtol=0, atol=0)  # fmt: skip
            want = _attend(q, keys, cb.doc_Q if keys is k else cb.tdoc_Q, kd, document_mask)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        outs.append(packed_attention(q, k, k, first[0]))
    assert (outs[0] - outs[1]).abs().max() > 0.1  # the two compositions attend differently
    assert backend == "sdpa" or (blocks > 0).all()  # full blocks and partial ones occurred


def test_lingbot_attention_takes_only_what_a_pool_mask_runs_on() -> None:
    with pytest.raises(ValueError, match=r"attention.*'varlen'.*'auto', 'sdpa', 'flex'"):
        _lingbot("varlen")


def test_reference_host_noise_is_lerobots_own_draw_on_the_cpu() -> None:
    """`ReferenceRobot(host_noise=True)` (what the GPU proof runs: the engine's draws) gives
    on the CPU exactly LeRobot's ``torch.manual_seed(seed)`` draws."""
    pytest.importorskip("lerobot.policies.lingbot_va")
    from packing.integrations.lingbot_va._serve_reference import ReferenceRobot
    from packing.integrations.lingbot_va.testing import tiny_serving_policy, toy_text_embeddings

    text = toy_text_embeddings(16)
    frame = torch.randn(1, 48, 8, 16, generator=torch.Generator().manual_seed(0))
    outs = [ReferenceRobot(tiny_serving_policy(), text("a"), text(""), host_noise=h)
            .chunk(frame, None, seed=7) for h in (False, True)]  # fmt: skip
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
