"""packing.serve under faults (issues 33.5, 35.2): everything a step needs is checked at
``submit`` or at construction; a request's tensors are copied at ``submit``; a request that
fails (its host work, the model call, a NaN in its state) fails alone, with ``Result.error``,
while every other request is served as if it had run alone; nothing queued is lost."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import packing.serve._step as step_module
from packing.model import DiT, DiTConfig
from packing.serve import (
    Engine,
    EngineConfig,
    PackShape,
    Request,
    Result,
    VideoEngine,
    VideoRequest,
    VideoShape,
)
from packing.serve._device import quarantine

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, 2 busy cores

FRAME = (8, 4, 8)  # the tiny DiT's latent (C, H, W): 8 tokens a frame, 6 action dims
MARK = 7.25  # a context value that makes the faulty models below fail on that request


def _model(cls: type[DiT] = DiT) -> DiT:
    torch.manual_seed(0)
    return cls(DiTConfig.tiny(latent_channels=8, latent_hw=(4, 8), action_dim=6,
                              attention="sdpa")).eval()  # fmt: skip


def _engine(model: DiT | None = None, requests: int = 3, **kw) -> Engine:
    shape = PackShape(frames=3 * requests, actions=4 * requests, requests=requests)
    return Engine(model or _model(), EngineConfig(shapes=(shape,), max_steps=4, **kw))


def _req(i: int, *, mark: bool = False, steps: int = 3, **kw) -> Request:
    ctx = torch.randn(1, *FRAME, generator=torch.Generator().manual_seed(100 + i))
    if mark:
        ctx[0, 0, 0, 0] = MARK
    return Request(context=ctx, frames=1, actions=3, seed=i, steps=steps, **kw)


def _alone(r: Request) -> Result:
    engine = _engine()
    engine.submit(r)
    (out,) = engine.run()
    return out


def _assert_equal_alone(got: Result, r: Request) -> None:
    assert got.error is None, got.error
    want = _alone(r)
    torch.testing.assert_close(got.latents, want.latents, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.action, want.action, rtol=1e-5, atol=1e-6)


# -- 1. everything a step needs is checked at submit or construction ------------------------
def test_a_seed_the_generator_cannot_take_is_refused_at_construction():
    z = torch.zeros(0, *FRAME)
    with pytest.raises(
        ValueError, match=r"Request\.seed=1180591620717411303424 must be <= 18446744073709551615"
    ):
        Request(context=z, frames=1, actions=1, seed=2**70)
    with pytest.raises(ValueError, match=r"Request\.seed=-1 must be >= 0"):  # -1 == 2**64 - 1
        Request(context=z, frames=1, actions=1, seed=-1)
    engine = _engine()
    engine.submit(Request(context=z, frames=1, actions=1, seed=2**64 - 1, steps=1))
    assert [r.error for r in engine.run()] == [None]


@settings(max_examples=40)
@given(
    seed=st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=2**64),
        st.floats(),
        st.booleans(),
        st.text(max_size=3),
    )
)
def test_every_seed_outside_the_generators_range_is_refused(seed):
    with pytest.raises((TypeError, ValueError), match=r"Request\.seed="):
        Request(context=torch.zeros(0, *FRAME), frames=1, actions=1, seed=seed)


@settings(max_examples=40)
@given(seed=st.integers(min_value=0, max_value=2**64 - 1))
def test_every_seed_accepted_is_one_the_generator_takes(seed):
    r = Request(context=torch.zeros(0, *FRAME), frames=1, actions=1, seed=seed)
    lat, act = r.noise(FRAME, 6)  # torch.Generator.manual_seed(seed) inside
    assert torch.isfinite(lat).all() and act.shape == (1, 6)


@settings(max_examples=30)
@given(
    shape=st.tuples(*[st.integers(1, 3)] * 4),
    data=st.data(),
    value=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
)
def test_a_non_finite_value_anywhere_is_refused_with_its_index(shape, data, value):
    index = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    ctx = torch.zeros(shape)
    ctx[index] = value
    with pytest.raises(
        ValueError, match=rf"'context' holds {value} at index \({', '.join(map(str, index))},?\)"
    ):
        Request(context=ctx, frames=1, actions=1)


def test_engine_config_refuses_what_a_step_would_fail_on():
    shape = PackShape(frames=2, actions=2, requests=1)
    with pytest.raises(TypeError, match=r"EngineConfig\.scheduler='euler' must be a FlowScheduler"):
        EngineConfig(shapes=(shape,), scheduler="euler")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"EngineConfig\.cuda_graphs='no' must be True or False"):
        EngineConfig(shapes=(shape,), cuda_graphs="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"EngineConfig\.attention='flash'; choose one of"):
        EngineConfig(shapes=(shape,), attention="flash")  # type: ignore[arg-type]


def test_buffers_too_large_for_the_device_fail_at_construction_naming_the_field(monkeypatch):
    model = _model()
    ok = PackShape(frames=2, actions=2, requests=2)
    with pytest.raises(ValueError, match=r"EngineConfig\.max_steps=1000000000000 must be <= 10000"):
        EngineConfig(shapes=(ok,), max_steps=10**12)  # past any size: refused by the config
    with pytest.raises(ValueError, match=r"PackShape\.frames=1000000000000 must be <= 1048576"):
        PackShape(frames=10**12, actions=2, requests=2)
    # within the limits but past the device's free memory (here: 1 MiB free)
    monkeypatch.setattr("packing.serve._device._free_bytes", lambda device: 1 << 20)
    wide = PackShape(frames=2, actions=2, requests=64)  # 64 x 10,000 steps of tables: 7.7 MB
    with pytest.raises(ValueError, match=r"schedule tables\); lower EngineConfig\.max_steps"):
        Engine(model, EngineConfig(shapes=(wide,), max_steps=10_000))
    big = PackShape(frames=4096, actions=2, requests=2)
    with pytest.raises(ValueError, match=r"lower PackShape\(frames=4096, .*'s sizes"):
        Engine(model, EngineConfig(shapes=(ok, big)))
    monkeypatch.undo()
    engine = Engine(model, EngineConfig(shapes=(ok,), max_steps=4))  # allocated up front
    assert set(engine.packs.buffers) == {ok}


# -- 2. a request's tensors are copied at submit ---------------------------------------------
def test_a_context_changed_after_submit_changes_nothing():
    buf = torch.randn(1, *FRAME)
    r = Request(context=buf, frames=1, actions=3, seed=3, steps=3)
    want = _alone(Request(context=buf.clone(), frames=1, actions=3, seed=3, steps=3))
    engine = _engine()
    engine.submit(r)
    buf.mul_(-1.0).add_(0.5)  # the robot loop refills its frame buffer
    (got,) = engine.run()
    torch.testing.assert_close(got.latents, want.latents, rtol=0, atol=0)


def test_a_context_that_requires_grad_leaves_no_grad_in_the_engine():
    ctx = torch.randn(1, *FRAME, requires_grad=True)
    engine = _engine()
    engine.submit(Request(context=ctx * 2, frames=1, actions=3, steps=2))
    engine.submit(_req(1, steps=4))
    first = engine.run()
    engine.submit(_req(2, steps=2))  # a later client
    later = engine.run()
    assert not any(r.latents.requires_grad or r.action.requires_grad for r in first + later)
    b = engine.packs.buffers[engine.shape]  # type: ignore[index]
    assert not any(t.requires_grad for t in (b.x_v, b.x_a, b.vp_v, b.vp_a))
    assert ctx.grad is None


# -- 3. a failure inside a step fails only the request at fault ------------------------------
class _CrashingModel(DiT):
    """Raises in the model call whenever the marked request is in the pack."""

    def velocity(self, tokens, t_R, row_J, pack):  # type: ignore[override]
        if bool((tokens["latents"] == MARK).any()):
            raise RuntimeError("boom")
        return super().velocity(tokens, t_R, row_J, pack)


class _BadHostWork(DiT):
    """Its patchify raises on the marked request's frames (host work at admission)."""

    def patchify(self, x):  # type: ignore[override]
        if bool((x == MARK).any()):
            raise ValueError("cannot patchify")
        return super().patchify(x)


@pytest.mark.parametrize("culprit", [0, 2])
def test_a_crash_in_the_model_call_fails_only_its_request(culprit):
    reqs = [_req(i, mark=i == culprit, steps=2 + i % 2) for i in range(4)]
    engine = _engine(_model(_CrashingModel), requests=3)  # 3 run, 1 waits
    ids = [engine.submit(r) for r in reqs]
    out = engine.run()
    assert sorted(r.request_id for r in out) == ids  # every request exactly once
    by_id = {r.request_id: r for r in out}
    assert by_id[ids[culprit]].error is not None
    assert "the model call raised RuntimeError: boom" in by_id[ids[culprit]].error
    assert by_id[ids[culprit]].latents.numel() == 0
    for i, r in enumerate(reqs):
        if i != culprit:
            _assert_equal_alone(by_id[ids[i]], r)
    engine.submit(reqs[1])  # still usable
    (again,) = engine.run()
    _assert_equal_alone(again, reqs[1])


def test_host_work_that_raises_fails_only_its_request_and_the_queue_stays():
    reqs = [_req(i, mark=i == 1) for i in range(4)]
    engine = _engine(_model(_BadHostWork), requests=2)
    ids = [engine.submit(r) for r in reqs]
    first = engine.step()  # never raises for a request's fault
    assert [(r.request_id, r.error is not None) for r in first] == [(ids[1], True)]
    assert "preparing it for the pack raised ValueError: cannot patchify" in first[0].error
    out = first + engine.run()
    assert sorted(r.request_id for r in out) == ids
    for r in out:
        if r.request_id != ids[1]:
            _assert_equal_alone(r, reqs[ids.index(r.request_id)])


def test_a_request_whose_result_cannot_be_read_fails_alone():
    class BadReadback(DiT):
        def unpatchify(self, x):  # type: ignore[override]
            if x.shape[0] == 2 * 8:  # the request generating 2 frames
                raise RuntimeError("readback")
            return super().unpatchify(x)

    engine = _engine(_model(BadReadback))
    good, bad = _req(0), Request(context=torch.zeros(0, *FRAME), frames=2, actions=1, steps=3)
    ids = [engine.submit(good), engine.submit(bad)]
    out = {r.request_id: r for r in engine.run()}
    assert "reading its result back raised RuntimeError: readback" in out[ids[1]].error
    _assert_equal_alone(out[ids[0]], good)


# -- 4. non-finite values ---------------------------------------------------------------------
def test_a_nan_or_inf_in_a_request_is_refused_naming_the_field_and_index():
    ctx = torch.zeros(2, *FRAME)
    ctx[1, 2, 3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"Request 'context' holds nan at index \(1, 2, 3, 4\)"):
        Request(context=ctx, frames=1, actions=1)
    ok = torch.zeros(1, *FRAME)
    r = Request(context=ok, frames=1, actions=1, steps=2)
    ok[0, 0, 0, 0] = float("inf")  # changed after construction: caught at submit
    engine = _engine()
    with pytest.raises(ValueError, match=r"Request 'context' holds inf at index \(0, 0, 0, 0\)"):
        engine.submit(r)
    assert engine.waiting == 0


class _NaNModel(DiT):
    """The velocity of pack slot ``slot`` (its rows, by ``row_J``) is NaN at call ``at``."""

    slot, at, calls = 0, 1, 0

    def velocity(self, tokens, t_R, row_J, pack):  # type: ignore[override]
        out = super().velocity(tokens, t_R, row_J, pack)
        if self.calls == self.at:
            out["latents"][row_J[pack.latents_dest_T] == self.slot] = float("nan")
        self.calls += 1
        return out


@pytest.fixture
def lagging(monkeypatch):
    """The host reads the non-finite flags only at the end of ``run()``, as when a GPU runs
    far behind the host: a failed request then stays in the pack for its remaining steps."""
    read = Engine._read_flags
    monkeypatch.setattr(
        Engine,
        "_read_flags",
        lambda self, *, wait: read(self, wait=True) if wait else None,
    )


@pytest.mark.parametrize("slot", [0, 1])
@pytest.mark.parametrize("lag", [False, True])
def test_a_request_whose_state_turns_nan_fails_and_its_pack_mate_equals_alone(slot, lag, request):
    if lag:
        request.getfixturevalue("lagging")
    model = _model(_NaNModel)
    model.slot = slot
    reqs = [_req(0, steps=4), _req(1, steps=4), _req(2, steps=2)]
    engine = _engine(model, requests=2)
    ids = [engine.submit(r) for r in reqs]
    out: dict[int, Result] = {}
    while engine.active or engine.waiting:
        out.update({r.request_id: r for r in engine.step()})
        b = engine.packs.buffers[engine.shape]  # type: ignore[index]
        assert torch.isfinite(b.x_v).all() and torch.isfinite(b.vp_v).all()  # zeroed at once
    out.update({r.request_id: r for r in engine.run()})
    assert sorted(out) == ids
    assert out[ids[slot]].error is not None
    assert out[ids[slot]].error.startswith("non-finite state at step 2 of 4")
    for i in (1 - slot, 2):  # the pack mate at the NaN step, and the one that waited
        _assert_equal_alone(out[ids[i]], reqs[i])


def test_without_zeroing_the_failed_rows_the_nan_reaches_the_pack_mate(monkeypatch, lagging):
    """The control: flag but keep the NaN rows (host lagging), and the other request's state
    turns NaN through attention at the next model call."""

    def flag_only(bad_K, states):
        quarantine(bad_K, [(x.clone(), s) for x, s in states])  # the real rows stay NaN

    monkeypatch.setattr(step_module, "quarantine", flag_only)
    engine = _engine(_model(_NaNModel), requests=2)
    ids = [engine.submit(_req(i, steps=4)) for i in range(2)]
    out = {r.request_id: r for r in engine.run()}
    assert out[ids[0]].error.startswith("non-finite state at step 2 of 4")  # type: ignore[union-attr]
    assert out[ids[1]].error.startswith("non-finite state at step 3 of 4")  # type: ignore[union-attr]


def test_quarantine_flags_and_zeroes_a_request_by_its_rows():
    x = torch.tensor([[1.0], [2.0], [float("nan")], [3.0], [float("inf")]])
    slot = torch.tensor([0, 0, 1, 1, -1])  # row 4 is padding: not state
    bad = torch.zeros(2, dtype=torch.bool)
    quarantine(bad, [(x, slot)])
    assert bad.tolist() == [False, True]
    assert x[:4, 0].tolist() == [1.0, 2.0, 0.0, 0.0] and x[4, 0].isinf()


# -- the same for VideoEngine (a packed diffusers Wan) ---------------------------------------
HW, C, D_TXT = (4, 6), 48, 24


@pytest.fixture
def wan():
    pytest.importorskip("diffusers")
    from packing.integrations.diffusers import ServedWan, install
    from packing.integrations.diffusers.testing import tiny_wan

    torch.manual_seed(0)
    return ServedWan(install(tiny_wan("2.2"), latent_hw=HW))


class _NaNWan:
    """A VideoModel whose velocity of pack slot ``slot`` (its frames) is NaN at call ``at``."""

    def __init__(self, inner, slot: int, at: int) -> None:
        self.inner, self.slot, self.at, self.calls = inner, slot, at, 0
        self.frame_shape, self.grid = inner.frame_shape, inner.grid
        self.text_dim, self.device = inner.text_dim, inner.device

    def velocity(self, x, t_T, text, pack):
        v = self.inner.velocity(x, t_T, text, pack)
        if self.calls == self.at:
            tpf = pack.doc_T.shape[0] // x.shape[0]
            v[pack.doc_T[::tpf] == self.slot] = float("nan")
        self.calls += 1
        return v


def _video_req(i: int, context: int = 1, steps: int = 3) -> VideoRequest:
    g = torch.Generator().manual_seed(i)
    return VideoRequest(text=torch.randn(3, D_TXT, generator=g),
                        context=torch.randn(context, C, *HW, generator=g), frames=2, seed=i,
                        steps=steps)  # fmt: skip


def _video_alone(model, r: VideoRequest):
    engine = VideoEngine(model, [VideoShape(frames=6, text=6, requests=2)], max_steps=4)
    engine.submit(r)
    (out,) = engine.run()
    return out


def test_video_engine_refuses_bad_config_and_nan_at_the_door(wan):
    with pytest.raises(TypeError, match=r"scheduler='euler' must be a FlowScheduler"):
        VideoEngine(wan, [VideoShape(frames=2, text=2, requests=1)], scheduler="euler")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_steps=1000000000000 must be <= 10000"):
        VideoEngine(wan, [VideoShape(frames=2, text=2, requests=1)], max_steps=10**12)
    with pytest.raises(ValueError, match=r"VideoShape\.frames=1000000000000 must be <= 1048576"):
        VideoShape(frames=10**12, text=2, requests=1)
    text = torch.zeros(3, D_TXT)
    text[2, 5] = float("inf")
    with pytest.raises(ValueError, match=r"VideoRequest 'text' holds inf at index \(2, 5\)"):
        VideoRequest(text=text, context=torch.zeros(0, C, *HW), frames=1)
    with pytest.raises(ValueError, match=r"VideoRequest\.seed=1180591620717411303424"):
        VideoRequest(text=text[:2], context=torch.zeros(0, C, *HW), frames=1, seed=2**70)


def test_video_engine_copies_at_submit_and_isolates_a_nan(wan):
    reqs = [_video_req(0), _video_req(1)]
    engine = VideoEngine(_NaNWan(wan, slot=0, at=1), [VideoShape(frames=6, text=6, requests=2)],
                         max_steps=4)  # fmt: skip
    mutable = reqs[1].context.clone()
    ids = [engine.submit(reqs[0]), engine.submit(VideoRequest(
        text=reqs[1].text, context=mutable, frames=2, seed=1, steps=3))]  # fmt: skip
    mutable.fill_(0.0)  # changed after submit: changes nothing
    out = {r.request_id: r for r in engine.run()}
    assert out[ids[0]].error is not None
    assert out[ids[0]].error.startswith("non-finite state at step 2 of 3")
    want = _video_alone(wan, reqs[1])
    assert out[ids[1]].error is None
    torch.testing.assert_close(out[ids[1]].latents, want.latents, rtol=1e-5, atol=1e-6)


def test_video_engine_isolates_a_crash_and_keeps_the_queue(wan):
    class Crashing(_NaNWan):
        def velocity(self, x, t_T, text, pack):
            if bool((x == MARK).any()):
                raise RuntimeError("boom")
            return self.inner.velocity(x, t_T, text, pack)

    bad = _video_req(5)
    bad.context[0, 0, 0, 0] = MARK  # before submit: the copy holds it
    reqs = [bad, _video_req(1), _video_req(2, context=0)]
    model = Crashing(wan, slot=-1, at=-1)
    engine = VideoEngine(model, [VideoShape(frames=6, text=6, requests=2)], max_steps=4)
    ids = [engine.submit(r) for r in reqs]
    out = {r.request_id: r for r in engine.run()}
    assert sorted(out) == ids
    assert "the model call raised RuntimeError: boom" in (out[ids[0]].error or "")
    for i in (1, 2):
        want = _video_alone(wan, reqs[i])
        assert out[ids[i]].error is None
        torch.testing.assert_close(out[ids[i]].latents, want.latents, rtol=1e-5, atol=1e-6)
    assert not any(r.latents.requires_grad for r in out.values())


def test_isolating_one_culprit_among_four_costs_four_extra_model_calls():
    class Counting(_CrashingModel):
        calls = 0

        def velocity(self, tokens, t_R, row_J, pack):  # type: ignore[override]
            self.calls += 1
            return super().velocity(tokens, t_R, row_J, pack)

    model = _model(Counting)
    engine = _engine(model, requests=4)
    for i in range(4):
        engine.submit(_req(i, mark=i == 3, steps=2))
    first = engine.step()
    # the pack of 4 raises; halves {0, 1} run and {2, 3} raises; {2} runs and {3} raises
    assert model.calls == 1 + 2 + 2
    assert [r.request_id for r in first] == [3] and engine.last_pack == (
        (0, 0),
        (1, 0),
        (2, 0),
        (3, 0),
    )
    assert engine.active == 3 and [m.step for m in engine._members] == [1, 1, 1]
    assert sorted(r.request_id for r in engine.run()) == [0, 1, 2]


def test_an_idle_engine_has_handed_out_every_result_even_with_late_flags(monkeypatch):
    """On CUDA the flags arrive late; a loop stepping while anything is active or waiting
    (the policy server's worker, the benchmarks) must still get every result."""
    from late_flags import flags_arrive_late

    flags_arrive_late(monkeypatch)
    engine = _engine()
    ids = [engine.submit(_req(i, steps=2 + i)) for i in range(2)]
    out: list[Result] = []
    while engine.active or engine.waiting:
        out += engine.step()
    assert sorted(r.request_id for r in out) == ids
    assert all(r.error is None for r in out)
