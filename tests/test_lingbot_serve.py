"""LeRobot's LingBot-VA served to several robots at once (packing.integrations.lingbot_va).

The proof: robots joining mid-run, at different chunk indices, one with a changed earlier
keyframe, LeRobot's cache window evicting, each robot's chunks equal to LeRobot's own
``predict_action_chunk`` run for that robot alone with the same noise (1e-5, fp32 CPU); the
planted mistakes fail; one robot's fault fails that robot alone; bad input is one line to
that robot.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lerobot.policies.lingbot_va")
pytest.importorskip("transformers")

from packing.integrations.lingbot_va._serve import LingBotVAEngine
from packing.integrations.lingbot_va._serve_packs import LingShape
from packing.integrations.lingbot_va._serve_proof import (
    ABLATIONS,
    prove_serving,
    tiny_serving_policy,
)
from packing.integrations.lingbot_va._serve_reference import ReferenceRobot
from packing.integrations.lingbot_va._serve_request import ChunkRequest
from packing.integrations.lingbot_va.testing import SERVING_TINY as TINY
from packing.integrations.lingbot_va.testing import tiny_policy, toy_text_embeddings

TEXT = toy_text_embeddings(16)


def test_served_robots_equal_lerobot_alone() -> None:
    r = prove_serving()
    assert r.ok, r
    assert r.latents <= 1e-5 and r.actions <= 1e-5
    # the interesting situations happened (not a vacuous pass)
    assert r.chunks >= 13 and r.max_pack >= 3 and r.mixed_steps and r.evicted > 0
    # packs of one loop (no slot of the other computed) and mixed packs both ran
    assert min(r.pack_kinds.values()) > 0, r.pack_kinds


@pytest.mark.parametrize("ablation", ABLATIONS)
def test_planted_mistakes_fail(ablation: str) -> None:
    r = prove_serving(ablation)
    assert not r.ok and max(r.latents, r.actions) > 1e-4, r


def _first_chunk(name: str, seed: int, scale: float = 1.0) -> ChunkRequest:
    g = torch.Generator().manual_seed(seed)
    return ChunkRequest(session=name, frames=scale * torch.randn(1, 48, 8, 16, generator=g),
                        actions=torch.zeros(0, 2, 16), prompt=TEXT(name), negative=TEXT(""),
                        seed=seed)  # fmt: skip


def _run(engine: LingBotVAEngine) -> dict[int, object]:
    return {res.request_id: res for res in engine.run()}


def test_one_robots_fault_fails_only_that_robot() -> None:
    policy = tiny_serving_policy()
    engine = LingBotVAEngine(policy, robots=3, shapes=[LingShape(video=3, action=3)])
    good, bad = _first_chunk("good", 1), _first_chunk("bad", 2)
    shape = engine.packs.shapes[0]

    def fault(module, inputs, out):  # type: ignore[no-untyped-def]
        # a fault inside the model on the bad robot's latent tokens: its two docs (2 and 3,
        # after the good robot's conditional and unconditional rows) go NaN
        doc = engine.packs.buffers[shape].call.doc_Q[: out.shape[0]]
        return torch.where(((doc == 2) | (doc == 3))[:, None], float("nan"), out)

    hook = policy.transformer.patch_embedding_mlp.register_forward_hook(fault)
    ids = engine.submit(good), engine.submit(bad)
    out = _run(engine)
    hook.remove()
    assert out[ids[1]].error is not None and "non-finite" in out[ids[1]].error
    assert out[ids[0]].error is None
    ref = tiny_policy(**TINY)
    ref.load_state_dict(policy.state_dict())
    lat, _, act = ReferenceRobot(ref, good.prompt, good.negative).chunk(good.frames, None, 1)
    assert (out[ids[0]].latents - lat).abs().max() <= 1e-5
    assert (out[ids[0]].action - act).abs().max() <= 1e-5
    # the failed robot's next request rebuilds its session and is served
    assert _run_one(engine, _first_chunk("bad", 2)).error is None


def test_a_model_call_raising_with_one_robot_fails_only_that_robot() -> None:
    policy = tiny_serving_policy()
    engine = LingBotVAEngine(policy, robots=3, shapes=[LingShape(video=1, action=1),
                                                       LingShape(video=3, action=3)])  # fmt: skip
    good, other = _first_chunk("good", 1), _first_chunk("other", 3)
    bad = _first_chunk("bad", 2)
    bad = ChunkRequest(session="bad", frames=torch.full_like(bad.frames, 7.0), actions=None,
                       prompt=bad.prompt, negative=bad.negative)  # fmt: skip

    def fault(module, inputs, out):  # type: ignore[no-untyped-def]
        if bool((inputs[0] == 7.0).all(dim=-1).any()):  # the bad robot's conditioning frame
            raise RuntimeError("planted: the kernel fails on this robot's tokens")
        return out

    hook = policy.transformer.patch_embedding_mlp.register_forward_hook(fault)
    ids = engine.submit(good), engine.submit(bad), engine.submit(other)
    out = _run(engine)
    hook.remove()
    assert out[ids[1]].error is not None and "planted" in out[ids[1]].error
    for rid, req in ((ids[0], good), (ids[2], other)):
        assert out[rid].error is None
        ref2 = tiny_policy(**TINY)
        ref2.load_state_dict(policy.state_dict())
        lat, _, act = ReferenceRobot(ref2, req.prompt, req.negative).chunk(
            req.frames, None, req.seed
        )
        assert (out[rid].latents - lat).abs().max() <= 1e-5
        assert (out[rid].action - act).abs().max() <= 1e-5
    # the good robots' sessions go on: their next chunk is served from their caches
    nxt = ChunkRequest(session="good", frames=torch.cat([good.frames, torch.randn(1, 48, 8, 16)]),
                       actions=None, prompt=good.prompt, negative=good.negative, seed=5)  # fmt: skip
    assert _run_one(engine, nxt).error is None
    assert engine.stats["rebuilds"] == 0


def _run_one(engine: LingBotVAEngine, req: ChunkRequest):  # type: ignore[no-untyped-def]
    rid = engine.submit(req)
    return _run(engine)[rid]


def test_bad_input_is_one_line_to_that_robot() -> None:
    policy = tiny_serving_policy()
    engine = LingBotVAEngine(policy, robots=1, shapes=[LingShape(video=2, action=2)])
    ok = _first_chunk("ok", 1)
    # an observation lacking a camera: its latent frame is narrower than the config's
    with pytest.raises(ValueError, match=r"session 'ok' .*encode every camera the config names"):
        engine.submit(ChunkRequest(session="ok", frames=ok.frames[..., :8], actions=ok.actions,
                                   prompt=ok.prompt, negative=ok.negative))  # fmt: skip
    with pytest.raises(ValueError, match=r"prompt is \(600, 16\).*max_sequence_length=512"):
        engine.submit(ChunkRequest(session="ok", frames=ok.frames, actions=ok.actions,
                                   prompt=torch.zeros(600, 16), negative=ok.negative))  # fmt: skip
    with pytest.raises(ValueError, match=r"restarted mid-chunk"):
        engine.submit(ChunkRequest(session="ok", frames=torch.zeros(3, 48, 8, 16),
                                   actions=torch.zeros(3, 2, 16), prompt=ok.prompt,
                                   negative=ok.negative))  # fmt: skip
    with pytest.raises(ValueError, match=r"negative is None"):
        engine.submit(ChunkRequest(session="ok", frames=ok.frames, actions=ok.actions,
                                   prompt=ok.prompt))  # fmt: skip
    # more robots than the pool holds: the second robot's chunk fails, the first's is served
    a, b = engine.submit(ok), engine.submit(_first_chunk("two", 2))
    out = _run(engine)
    assert out[a].error is None
    assert out[b].error is not None and "pool" in out[b].error and "\n" not in out[b].error
    engine.end_session("ok")
    assert _run_one(engine, _first_chunk("two", 2)).error is None


def test_bf16_robot_agrees_with_lerobots_bf16_policy_on_the_same_noise() -> None:
    """Off the fp32 CPU, LeRobot draws its noise in its own dtype and generator; the reference
    draws the served noise there (fp32, a CPU generator, then cast), so a bf16 (or CUDA)
    robot can be held against LeRobot's. Without that, the two chunks are unrelated."""
    sd = tiny_serving_policy().state_dict()

    def bf16() -> object:
        p = tiny_policy(**{**TINY, "dtype": "bfloat16"})
        p.load_state_dict(sd)
        return p.eval()

    req = _first_chunk("a", 1)
    req = ChunkRequest(session="a", frames=req.frames, actions=None, prompt=req.prompt,
                       negative=req.negative, seed=3)  # fmt: skip
    engine = LingBotVAEngine(bf16(), robots=1, shapes=[LingShape(video=1, action=1)])
    served = _run_one(engine, req)
    assert served.error is None
    _, _, act = ReferenceRobot(bf16(), req.prompt, req.negative).chunk(req.frames, None, 3)
    assert (served.action - act.float()).abs().max() <= 0.05  # bf16 through 2 layers
    # the negative control: LeRobot's own bf16 draws are other noise
    own = ReferenceRobot(bf16(), req.prompt, req.negative, host_noise=False)
    _, _, other = own.chunk(req.frames, None, 3)
    assert (served.action - other.float()).abs().max() > 0.5


# -- through the policy server (openpi protocol, in-process) -------------------------------
def _toy_vae(session: str, frames: dict) -> torch.Tensor:
    """n frames of the first camera -> n latent frames, keyed by their bytes (not by the
    session: the reference calls it too)."""
    import hashlib

    arr = next(iter(frames.values()))
    seed = int.from_bytes(hashlib.blake2b(arr.tobytes(), digest_size=7).digest(), "little")
    return torch.randn(arr.shape[0], 48, 8, 16, generator=torch.Generator().manual_seed(seed))


def _toy_text(prompt: str) -> torch.Tensor:
    return TEXT(prompt).repeat(2, 1)[: 3 + len(prompt.split())]  # unpadded; the adapter pads


def _observations(robot: int, chunks: int, F_: int = 2) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(robot)
    out = []
    for k in range(chunks):
        n = 1 if k == 0 else F_ - 1 if k == 1 else F_
        out.append({"observation.images.image": rng.random((n, 3, 32, 32), dtype=np.float32),
                    "observation.images.image2": rng.random((n, 3, 32, 32), dtype=np.float32),
                    "observation.state": np.zeros(8, np.float32), "task": f"task {robot}",
                    "seed": 100 * robot + k})  # fmt: skip
    return out


def test_lingbot_robots_over_the_wire_each_equal_lerobot_alone() -> None:
    pytest.importorskip("websockets", reason="needs packing[serve]")
    import threading

    import numpy as np

    from packing.integrations.lingbot_va._serve_adapter import LingBotVAAdapter
    from packing.server import PolicyClient, PolicyServer, ServerConfig, ServerError

    policy = tiny_serving_policy()
    engine = LingBotVAEngine(policy, robots=2, shapes=[LingShape(video=2, action=2)])
    adapter = LingBotVAAdapter(config=policy.config, encoder=_toy_vae, text_encoder=_toy_text)
    srv = PolicyServer(engine, adapter, ServerConfig(port=0))
    replies: dict[int, list] = {0: [], 1: []}
    with srv.running() as address:

        def robot(i: int) -> None:
            with PolicyClient(*address, timeout_s=120) as c:
                if i == 1:  # bad input first: one line to this robot, nothing else changes
                    obs = _observations(i, 1)[0]
                    with pytest.raises(ServerError, match="lacks camera"):
                        c.infer({k: v for k, v in obs.items() if k != "observation.images.image2"})
                    with pytest.raises(ServerError, match="more than the text encoder takes"):
                        c.infer({**obs, "task": "go " * 600})
                for obs in _observations(i, 3):
                    replies[i].append(c.infer(obs)["actions"])
                with pytest.raises(ServerError, match="restarted mid-chunk"):
                    c.infer({**_observations(i, 3)[2], "observation.images.image":
                             np.zeros((1, 3, 32, 32), np.float32)})  # fmt: skip
                c.end_episode()

        threads = [threading.Thread(target=robot, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    assert srv.summary()["answered"] >= 6
    for i in range(2):
        assert len(replies[i]) == 3
        ref = tiny_policy(**TINY)
        ref.load_state_dict(policy.state_dict())
        prompt = torch.cat([_toy_text(f"task {i}"), torch.zeros(512 - 5, 16)])
        negative = torch.cat([_toy_text(""), torch.zeros(512 - 3, 16)])
        rob = ReferenceRobot(ref, prompt, negative)
        obs = _observations(i, 3)
        lat = [_toy_vae("", {"c": o["observation.images.image"]}) for o in obs]
        feed = [lat[0], torch.cat(lat[:2]), lat[2]]
        for k in range(3):
            _, _, want = rob.chunk(feed[k], None, 100 * i + k)
            np.testing.assert_allclose(replies[i][k], want.numpy(), rtol=0, atol=1e-5)


def test_an_ended_episode_frees_the_adapters_frames_and_the_engines_session() -> None:
    """Over the wire: after ``end_episode`` the adapter keeps no frames of that episode and
    the engine no session (its cache regions and text slots are free again)."""
    pytest.importorskip("websockets", reason="needs packing[serve]")
    from packing.integrations.lingbot_va._serve_adapter import LingBotVAAdapter
    from packing.server import PolicyClient, PolicyServer, ServerConfig

    policy = tiny_serving_policy()
    engine = LingBotVAEngine(policy, robots=1, shapes=[LingShape(video=1, action=1)])
    adapter = LingBotVAAdapter(config=policy.config, encoder=_toy_vae, text_encoder=_toy_text)
    srv = PolicyServer(engine, adapter, ServerConfig(port=0))
    with srv.running() as address, PolicyClient(*address, timeout_s=120) as c:
        c.infer(_observations(0, 1)[0])
        (first,) = adapter._state
        assert set(engine.packs.sessions) == {first}
        c.end_episode()
        # the next episode's reply comes after the engine loop ended the first (it ends the
        # sessions it was told of before it steps); robots=1: the pool held only one
        c.infer(_observations(1, 1)[0])
        (second,) = adapter._state
        assert second != first and set(engine.packs.sessions) == {second}


def test_a_chunk_that_failed_is_served_when_the_robot_asks_again() -> None:
    """Over the wire: robot 0's second chunk fails in the engine (a planted fault); the robot
    sends the same observation again, as a failed or busy reply invites, and is served; every
    chunk it gets equals LeRobot's for that robot alone, the failed attempt leaving no trace
    in the adapter's episode or the engine's session."""
    pytest.importorskip("websockets", reason="needs packing[serve]")
    import numpy as np

    from packing.integrations.lingbot_va._serve_adapter import LingBotVAAdapter
    from packing.server import PolicyClient, PolicyServer, ServerConfig, ServerError

    policy = tiny_serving_policy()
    engine = LingBotVAEngine(policy, robots=1, shapes=[LingShape(video=1, action=1)])
    adapter = LingBotVAAdapter(config=policy.config, encoder=_toy_vae, text_encoder=_toy_text)
    armed = [False]

    def fault(module, inputs, out):  # type: ignore[no-untyped-def]
        if armed[0]:
            raise RuntimeError("planted: this call fails once")
        return out

    hook = policy.transformer.patch_embedding_mlp.register_forward_hook(fault)
    obs, replies = _observations(0, 3), []
    srv = PolicyServer(engine, adapter, ServerConfig(port=0))
    with srv.running() as address, PolicyClient(*address, timeout_s=120) as c:
        replies.append(c.infer(obs[0])["actions"])
        armed[0] = True
        with pytest.raises(ServerError, match="planted"):
            c.infer(obs[1])
        armed[0] = False
        replies += [c.infer(obs[1])["actions"], c.infer(obs[2])["actions"]]
    hook.remove()
    ref = tiny_policy(**TINY)
    ref.load_state_dict(policy.state_dict())
    prompt = torch.cat([_toy_text("task 0"), torch.zeros(512 - 5, 16)])
    negative = torch.cat([_toy_text(""), torch.zeros(512 - 3, 16)])
    rob = ReferenceRobot(ref, prompt, negative)
    lat = [_toy_vae("", {"c": o["observation.images.image"]}) for o in obs]
    for k, feed in enumerate([lat[0], torch.cat(lat[:2]), lat[2]]):
        _, _, want = rob.chunk(feed, None, k)
        np.testing.assert_allclose(replies[k], want.numpy(), rtol=0, atol=1e-5)


def test_an_unserved_chunk_leaves_the_adapters_episode_as_it_was() -> None:
    """What the server calls when a request is not served (busy, failed, past its deadline):
    the same observation then builds the same request; an unserved first chunk leaves no
    episode (a new task is no change of task); a served one is not undone."""
    from packing.integrations.lingbot_va._serve_adapter import LingBotVAAdapter

    policy = tiny_serving_policy()
    adapter = LingBotVAAdapter(config=policy.config, encoder=_toy_vae, text_encoder=_toy_text)
    obs = _observations(0, 2)
    adapter.request({**obs[0], "task": "other"}, "s")
    adapter.unserved("s")
    assert "s" not in adapter._state
    first = adapter.request(obs[0], "s")
    again = [adapter.request(obs[1], "s")]
    adapter.unserved("s")
    again.append(adapter.request(obs[1], "s"))
    assert torch.equal(again[0].frames, again[1].frames) and again[0].seed == again[1].seed
    assert again[1].frames.shape[0] == first.frames.shape[0] + 1
    adapter.unserved("s")
    adapter.unserved("s")  # once: the chunk before it was served
    assert adapter._state["s"].chunks == 1
    adapter.unserved("never asked")  # nothing to undo


def test_bench_lingbot_serve_smoke(tmp_path) -> None:
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.serving.bench_lingbot_serve import main

    out = tmp_path / "bench.json"
    payload = main(["--smoke", "--mixed-robots", "2", "--stagger-robots", "2",
                    "--out", str(out)])  # fmt: skip
    rows = payload["rows"]
    assert {r["server"] for r in rows} == {
        "LeRobot, one robot at a time",
        "packed (LingBotVAEngine)",
        "packed, one mixed pack shape",
        "packed, robots out of step",
    }
    assert {r["robots"] for r in rows} == {1, 2} and len(rows) == 12
    assert all(r["chunks_per_s"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0 for r in rows)
    # robot 0 of every packed run is the LeRobot arm's robot: the benchmark checks itself
    agree = [v for sched in payload["agreement"].values() for v in sched.values()]
    assert len(agree) == 8 and max(agree) <= 1e-5, payload["agreement"]  # 4 arms, 2 schedules
    assert set(payload["goals"]) == {r["schedule"] for r in rows}
    assert json.loads(out.read_text())["provenance"]
    # a run of 8 robots alone still has its base row, one robot (what every ratio divides by)
    from benchmarks.serving.bench_lingbot_serve import alone_rows

    base = alone_rows("s", "LeRobot", [100.0, 120.0], [8])
    assert [(r["robots"], r["derived"]) for r in base] == [(1, False), (8, True)]
    assert base[1]["p99_ms"] == 8 * base[0]["p99_ms"]
    # the engine's default packs: robots all in one loop ran in that loop's shape; the A/B
    # arm ran every step in its one mixed shape
    # arm ran every step in its one mixed shape, half of it padding (2 robots: a video and an
    # action slot each, one loop at a time filled); robots out of step ran mixed packs too
    for r in rows:
        st = r.get("stats", {})
        if r["server"] == "packed (LingBotVAEngine)":
            assert st["steps_in_video_packs"] > 0 and st["steps_in_action_packs"] > 0, st
            assert st["steps_in_mixed_packs"] == 0, st
            assert st["query_tokens_filled"] == st["query_tokens_computed"] > 0, st
        elif r["server"] == "packed, one mixed pack shape":
            assert st["steps_in_video_packs"] == st["steps_in_action_packs"] == 0, st
            assert st["steps_in_mixed_packs"] > 0, st
            assert st["query_tokens_filled"] < st["query_tokens_computed"], st
        elif r["server"] == "packed, robots out of step":
            assert st["steps_in_mixed_packs"] > 0, st


def test_verify_inference_model_lingbot_va_names_only_the_served_proof() -> None:
    import subprocess
    import sys

    run = [sys.executable, "-m", "packing", "verify", "--model", "lingbot_va"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "add --inference" in out.stderr
    out = subprocess.run([*run[:4], "--inference", "--model", "nope"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and "module:factory' (or lingbot_va" in out.stderr


def test_pack_shapes_are_checked_when_the_engine_is_built() -> None:
    """A shape set the engine could deadlock on (a robot waiting for a pack the largest shape
    cannot hold) or that holds no robot is refused up front, naming the shape to add."""
    from packing.integrations.lingbot_va._serve_packs import phase_shapes

    with pytest.raises(ValueError, match=r"LingShape\(video=0, action=0\) holds no robot"):
        LingShape(video=0, action=0)
    with pytest.raises(ValueError, match=r"LingShape.action=-1 must be >= 0"):
        LingShape(video=1, action=-1)
    policy = tiny_serving_policy()
    bad = [
        ([LingShape(video=2, action=0)], r"both loops.*add LingShape\(video=2, action=1\)"),
        ([LingShape(video=0, action=3)], r"both loops.*add LingShape\(video=1, action=3\)"),
        ([LingShape(video=4, action=1), LingShape(video=1, action=3)],
         r"LingShape\(video=1, action=3\) does not fit in it\); add LingShape\(video=4, action=3\)"),
        ([], r"shapes=\[\]; give one or more LingShape"),
        ([(1, 1)], r"give one or more LingShape"),
    ]  # fmt: skip
    for shapes, message in bad:
        with pytest.raises(ValueError, match=message):
            LingBotVAEngine(policy, robots=2, shapes=shapes)
    # the default: each loop alone, and every action slot with 1, 2, ... 3 video slots,
    # ordered by the tokens a step computes (the tiny policy: 128 a video slot, 4 an action
    # slot), so a pack of 2 video robots runs in (2, 3), not (3, 0)
    engine = LingBotVAEngine(policy, robots=3)
    V, A = (lambda s: LingShape(video=s, action=0)), (lambda s: LingShape(video=0, action=s))
    mix = [LingShape(video=v, action=3) for v in (1, 2, 3)]
    assert engine.packs.shapes == [A(3), mix[0], mix[1], V(3), mix[2]]
    assert sorted(phase_shapes(3), key=str) == sorted(engine.packs.shapes, key=str)
    assert [(s.video, s.action) for s in phase_shapes(8)] == [
        (0, 8), (8, 0), (1, 8), (2, 8), (4, 8), (8, 8)]  # fmt: skip
    phases = [SimpleNamespace(kind=k) for k in ("video", "video", "action")]
    assert next(s for s in engine.packs.shapes if s.fits(phases)) == mix[1]


def test_fill_lingbot_packs_counts_what_padding_each_shape_set_computes(tmp_path) -> None:
    """The counts behind docs/lingbot-va-serving.md's fill table: in step, the default packs
    compute no padding and the one mixed shape half its tokens as padding (2 robots, one
    loop filled at a time); out of step, the default computes fewer tokens than each loop
    alone plus one mixed shape, which computes fewer than the one mixed shape."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.serving.fill_lingbot_packs import main

    rows = main(["--quick", "--device", "cpu", "--out", str(tmp_path / "fill.json")])["rows"]
    got = {(r["arrival"], r["packs"]): r for r in rows}
    assert len(got) == 6
    assert got["in step", "phase"]["fill"] == got["in step", "loops"]["fill"] == 1.0
    assert got["in step", "mixed"]["fill"] == 0.5
    apart = [got["out of step", k]["tokens_per_chunk"] for k in ("phase", "loops", "mixed")]
    assert apart == sorted(apart) and len(set(apart)) == 3, apart
    assert got["out of step", "phase"]["steps"]["mixed"] > 0  # they were out of step
