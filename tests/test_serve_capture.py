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
            assert why is None, f"{key}: a graph captured at {recs[0][0]} replayed at {members}: {why}"
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
class _Mix:
    """A toy `VideoModel`: each frame mixes its own request's frames and text rows."""

    frame_shape, grid, text_dim, device = (2, 2, 2), (1, 2), 3, torch.device("cpu")

    def velocity(self, x_SCHW: Any, t_T: Any, text_XD: Any, pack: Any) -> Any:
        tpf = pack.doc_T.shape[0] // x_SCHW.shape[0]
        doc_S, t_S = pack.doc_T[::tpf], t_T[::tpf]
        same = ((doc_S[:, None] == doc_S[None, :]) & (doc_S[:, None] >= 0)).float()
        mixed = (same @ x_SCHW.reshape(x_SCHW.shape[0], -1)).reshape(x_SCHW.shape)
        words = (doc_S[:, None] == pack.text_doc_X[None, :]).float() @ text_XD
        return 0.1 * mixed - x_SCHW * t_S[:, None, None, None] + words.sum(1)[:, None, None, None]


def test_video_steps_are_replayable_across_compositions() -> None:
    from packing.serve import VideoEngine, VideoRequest, VideoShape

    engine = VideoEngine(_Mix(), [VideoShape(frames=12, text=12, requests=4)], max_steps=4)
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
