"""packing.serve: schedulers against the scalar reference, the host pack layout, the engine's
vectorised update, and the proof that packed inference equals each request alone."""

from __future__ import annotations

import math

import pytest
import torch
from serve_robots import run_without_host_sync

from packing.cli import main
from packing.model import DiT, DiTConfig
from packing.serve import (
    Engine,
    EngineConfig,
    FlowScheduler,
    PackShape,
    Request,
    reference_sample,
    verify_inference,
)
from packing.serve._pack import build_pack

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, 2 busy cores


# -- schedulers ----------------------------------------------------------------------------
def test_sigmas_and_coefficients_by_hand():
    s = FlowScheduler(solver="euler")
    assert s.sigmas(4) == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert s.coefficients(4) == [(-0.25, 0.0)] * 4
    shifted = FlowScheduler(shift=3.0).sigmas(2)
    assert shifted == pytest.approx([1.0, 1.5 / 2.0, 0.0])  # 3 * 0.5 / (1 + 2 * 0.5)
    # multistep2, uniform steps h: a = 1.5 h, b = -0.5 h (the classical AB2)
    ab = FlowScheduler(solver="multistep2").coefficients(4)
    assert ab[0] == (-0.25, 0.0)
    assert ab[1:] == [pytest.approx((-0.375, 0.125))] * 3


def _ode(x: float, t: float) -> float:
    return math.cos(3.0 * t) * x + t


@pytest.mark.parametrize("solver", ["euler", "multistep2"])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_coefficients_reproduce_the_scalar_reference(solver, shift):
    sch = FlowScheduler(solver=solver, shift=shift)
    for steps in (1, 2, 5, 9):
        x, v_prev = 0.7, 0.0
        sig = sch.sigmas(steps)
        for i, (a, b) in enumerate(sch.coefficients(steps)):
            v = _ode(x, sig[i])
            x, v_prev = x + a * v + b * v_prev, v
        assert x == pytest.approx(reference_sample(_ode, 0.7, sch, steps), rel=1e-12)


def test_multistep2_is_second_order_and_euler_first():
    # dx/dt = x: from x(1) = 1, x(0) = e^-1 exactly
    exact = math.exp(-1.0)
    for solver, order in (("euler", 1), ("multistep2", 2)):
        sch = FlowScheduler(solver=solver)
        e1 = abs(reference_sample(lambda x, t: x, 1.0, sch, 64) - exact)
        e2 = abs(reference_sample(lambda x, t: x, 1.0, sch, 128) - exact)
        assert math.log2(e1 / e2) == pytest.approx(order, abs=0.15)


def test_scheduler_rejects_bad_values():
    with pytest.raises(ValueError, match="solver='unipc'"):
        FlowScheduler(solver="unipc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shift=0"):
        FlowScheduler(shift=0)
    with pytest.raises(ValueError, match="steps=0"):
        FlowScheduler().sigmas(0)


# -- the host pack -------------------------------------------------------------------------
def test_build_pack_matches_the_docstring_picture():
    z = torch.zeros
    reqs = [
        Request(context=z(1, 1, 1, 2), frames=1, actions=2),
        Request(context=z(0, 1, 1, 2), frames=1, actions=1),
    ]
    p = build_pack(reqs, PackShape(frames=4, actions=4, requests=2), grid=(1, 2), text_len=2)
    R = 2
    assert p.doc_J.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, -1, -1, -1]
    assert p.row_J.tolist() == [R, R, 0, 0, 0, 0, 1, 1, 1, -1, -1, -1]
    assert p.slot_v.tolist() == [-1, -1, 0, 0, 1, 1, -1, -1]
    assert p.slot_a.tolist() == [0, 0, 1, -1]
    assert p.video_start == (0, 4) and p.action_start == (0, 2)


def test_kept_frames_keep_their_episode_positions():
    ctx = torch.zeros(4, 1, 1, 2)
    r = Request(context=ctx, frames=1, actions=2, keep_frames=(0, 3))
    p = build_pack([r], PackShape(frames=4, actions=2, requests=1), grid=(1, 2), text_len=2)
    video = p.thw_J3[p.latents_dest_T][:6, 0].tolist()  # 2 kept + 1 generated frame
    assert video == [0, 0, 3, 3, 4, 4]
    actions = p.thw_J3[p.action_dest_T][:, 0].tolist()
    assert actions == [0, 5 // 2]  # action a of A at frame a * F // A, F = 4 + 1


def test_request_and_engine_reject_bad_input():
    z = torch.zeros
    with pytest.raises(ValueError, match="keep_frames"):
        Request(context=z(3, 8, 4, 8), frames=1, actions=1, keep_frames=(2, 1))
    with pytest.raises(ValueError, match="F_c, C, H, W"):
        Request(context=z(8, 4, 8), frames=1, actions=1)
    with pytest.raises(ValueError, match="actions=0"):
        Request(context=z(0, 8, 4, 8), frames=1, actions=0)
    engine = Engine(_model(), EngineConfig(shapes=(PackShape(frames=2, actions=4, requests=1),),
                                           max_steps=4))  # fmt: skip
    with pytest.raises(ValueError, match=r"model takes \(C, H, W\)"):
        engine.submit(Request(context=z(1, 4, 4, 8), frames=1, actions=1))
    with pytest.raises(ValueError, match="max_steps=4"):
        engine.submit(Request(context=z(0, 8, 4, 8), frames=1, actions=1, steps=5))
    with pytest.raises(ValueError, match="largest PackShape"):
        engine.submit(Request(context=z(2, 8, 4, 8), frames=1, actions=1, steps=2))


# -- the engine ----------------------------------------------------------------------------
def _model(**kw) -> DiT:
    torch.manual_seed(0)
    cfg = DiTConfig.tiny(latent_channels=8, latent_hw=(4, 8), action_dim=6, attention="sdpa", **kw)
    return DiT(cfg).eval()


class _ODEModel(DiT):
    """The DiT's plumbing with an analytic velocity: v = cos(3 t) x + t per token, t the
    token's own time, so the engine's vectorised update can be checked elementwise."""

    def velocity(self, tokens, t_R, row_J, pack):  # type: ignore[override]
        t_J = torch.where(row_J >= 0, t_R[row_J.clamp(min=0)], 0.0)
        out = {}
        for name, dest in (("latents", pack.latents_dest_T), ("action", pack.action_dest_T)):
            t = t_J[dest][:, None]
            out[name] = torch.cos(3.0 * t) * tokens[name] + t
        return out


@pytest.mark.parametrize("solver", ["euler", "multistep2"])
def test_vectorised_update_equals_the_scalar_loop_per_element(solver):
    model = _ODEModel(_model().config)
    sch = FlowScheduler(solver=solver, shift=2.0)
    config = EngineConfig(shapes=(PackShape(frames=6, actions=9, requests=3),), scheduler=sch,
                          max_steps=6)  # fmt: skip
    engine = Engine(model, config)
    reqs = [Request(context=torch.randn(i, 8, 4, 8), frames=1, actions=3, seed=i, steps=3 + i)
            for i in range(3)]  # fmt: skip
    ids = [engine.submit(reqs[0])]
    engine.step()  # the others join a running pack, so the pack holds mixed steps
    ids += [engine.submit(r) for r in reqs[1:]]
    results = {r.request_id: r for r in engine.run()}
    for rid, r in zip(ids, reqs, strict=True):
        lat0, act0 = r.noise((8, 4, 8), 6)
        got = torch.cat([results[rid].latents.flatten(), results[rid].action.flatten()])
        start = torch.cat([lat0.flatten(), act0.flatten()])
        want = [reference_sample(_ode, float(x), sch, r.steps) for x in start[::7]]
        assert got[::7].tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_engine_admits_fifo_and_changes_shape():
    small, large = PackShape(frames=3, actions=4, requests=1), PackShape(frames=6, actions=8,
                                                                          requests=2)  # fmt: skip
    engine = Engine(_model(), EngineConfig(shapes=(large, small), max_steps=4))
    z = torch.zeros(1, 8, 4, 8)
    a = engine.submit(Request(context=z, frames=1, actions=2, steps=2))
    b = engine.submit(Request(context=z, frames=1, actions=2, steps=3))
    c = engine.submit(Request(context=z, frames=1, actions=2, steps=2))
    engine.step()
    assert engine.shape == large and engine.last_pack == ((a, 0), (b, 0)) and engine.waiting == 1
    assert [r.request_id for r in engine.step()] == [a]
    assert [r.request_id for r in engine.step()] == [b]  # c joined b, which was at step 2
    assert engine.last_pack == ((b, 2), (c, 0))
    assert [r.request_id for r in engine.step()] == [c]
    assert engine.last_pack == ((c, 1),) and engine.shape == small and engine.active == 0


# -- the proof -----------------------------------------------------------------------------
@pytest.mark.parametrize("mask", ["document", "frame-causal"])
def test_packed_inference_equals_each_request_alone(mask):
    report = verify_inference(mask=mask)
    assert report.passed, report.format()
    assert report.distinct_steps_at_once >= 3 and report.joined_mid_run >= 1
    assert len(report.shapes_used) == 2


def test_the_proof_fails_without_the_document_mask():
    report = verify_inference(document_mask=False)
    assert not report.passed
    assert min(report.errors.values()) > 1e-3, report.format()


def test_cli_verify_inference_exit_status(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["verify", "--inference", "--json", str(out)]) == 0
    assert "PASS" in capsys.readouterr().out and out.exists()
    assert main(["verify", "--inference", "--no-document-mask"]) == 1
    assert main(["verify", "--inference", "--device", "cuda"]) == 2


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_arrivals_packed_equal_alone(seed):
    """Random requests joining at random steps, two shapes, both solvers: packed == alone."""
    import random

    rng = random.Random(seed)
    model = _model(frame_causal=seed % 2 == 1)
    sch = FlowScheduler(solver=("euler", "multistep2")[seed % 2], shift=2.0)
    shapes = (
        PackShape(frames=6, actions=8, requests=2),
        PackShape(frames=14, actions=20, requests=4),
    )
    config = EngineConfig(shapes=shapes, scheduler=sch, max_steps=6)
    reqs, when = [], []
    for i in range(6):
        n = rng.randint(0, 4)
        keep = tuple(sorted(rng.sample(range(n), rng.randint(1, n)))) if n > 1 else None
        reqs.append(Request(context=torch.randn(n, 8, 4, 8), frames=rng.randint(0, 2),
                            actions=rng.randint(1, 4), seed=seed * 10 + i, task=f"t{i}",
                            steps=rng.randint(1, 6), keep_frames=keep))  # fmt: skip
        when.append(rng.randint(0, 6))
    engine, ids, out = Engine(model, config), {}, {}
    mixed, tick = False, 0
    while len(out) < len(reqs):
        for i, w in enumerate(when):
            if i not in ids and w <= tick:
                ids[i] = engine.submit(reqs[i])
        out.update({r.request_id: r for r in engine.step()})  # idle: a no-op, time passes
        mixed |= len({s for _, s in engine.last_pack}) > 1
        tick += 1
    assert mixed, "no step held requests at different steps"
    for i, r in enumerate(reqs):
        alone = Engine(model, config)
        alone.submit(r)
        (ref,) = alone.run()
        got = out[ids[i]]
        assert got.latents.shape == (r.frames, 8, 4, 8)
        for a, b in ((got.latents, ref.latents), (got.action, ref.action)):
            if b.numel():  # frames=0 generates actions only
                assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp_min(1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_engine_equals_eager_and_makes_no_sync():
    model = _model().cuda()
    shapes = (PackShape(frames=12, actions=16, requests=4),)
    reqs = [Request(context=torch.randn(i, 8, 4, 8), frames=1, actions=3, seed=i, steps=3 + i % 2)
            for i in range(5)]  # fmt: skip
    results = {}
    for graphs in (False, True):
        engine = Engine(model, EngineConfig(shapes=shapes, cuda_graphs=graphs, max_steps=4))
        engine.submit(reqs[0])
        engine.step()  # capture (graphs) happens here, before the checked steps
        for r in reqs[1:]:
            engine.submit(r)
        out = run_without_host_sync(engine)
        results[graphs] = {r.request_id: r for r in out}
    for rid, r in results[True].items():
        torch.testing.assert_close(r.latents, results[False][rid].latents, rtol=1e-5, atol=1e-5)


def test_cancel_drops_a_waiting_or_running_request_and_the_rest_equal_alone():
    shape = PackShape(frames=6, actions=8, requests=2)
    reqs = [Request(context=torch.randn(1, 8, 4, 8), frames=1, actions=2, seed=i, steps=3)
            for i in range(3)]  # fmt: skip
    engine = Engine(_model(), EngineConfig(shapes=(shape,), max_steps=4))
    a, b, c = (engine.submit(r) for r in reqs)
    engine.step()  # a and b run, c waits
    assert engine.cancel(b) and engine.cancel(c) and not engine.cancel(c)
    assert not engine.cancel(99)
    results = engine.run()
    assert [r.request_id for r in results] == [a]
    alone = Engine(_model(), EngineConfig(shapes=(shape,), max_steps=4))
    alone.submit(reqs[0])
    (want,) = alone.run()
    torch.testing.assert_close(results[0].latents, want.latents, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0].action, want.action, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="request_id"):
        engine.cancel(1.5)
    with pytest.raises(TypeError, match="session"):
        engine.end_session(3)
    with pytest.raises(TypeError, match=r"Request\.session"):
        Request(context=torch.zeros(0, 8, 4, 8), frames=1, actions=1, session=7)
