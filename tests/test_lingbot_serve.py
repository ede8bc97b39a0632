"""LeRobot's LingBot-VA served to several robots at once (packing.integrations.lingbot_va).

The proof: robots joining mid-run, at different chunk indices, one with a changed earlier
keyframe, LeRobot's cache window evicting, each robot's chunks equal to LeRobot's own
``predict_action_chunk`` run for that robot alone with the same noise (1e-5, fp32 CPU); the
planted mistakes fail; one robot's fault fails that robot alone; bad input is one line to
that robot.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lerobot.policies.lingbot_va")
pytest.importorskip("transformers")

from packing.integrations.lingbot_va._serve import LingBotVAEngine  # noqa: E402
from packing.integrations.lingbot_va._serve_packs import LingShape  # noqa: E402
from packing.integrations.lingbot_va._serve_proof import (  # noqa: E402
    ABLATIONS,
    TINY,
    prove_serving,
    tiny_serving_policy,
)
from packing.integrations.lingbot_va._serve_reference import ReferenceRobot  # noqa: E402
from packing.integrations.lingbot_va._serve_request import ChunkRequest  # noqa: E402
from packing.integrations.lingbot_va.testing import tiny_policy, toy_text_embeddings  # noqa: E402

TEXT = toy_text_embeddings(16)


def test_served_robots_equal_lerobot_alone() -> None:
    r = prove_serving()
    assert r.ok, r
    assert r.latents <= 1e-5 and r.actions <= 1e-5
    # the interesting situations happened (not a vacuous pass)
    assert r.chunks >= 13 and r.max_pack >= 3 and r.mixed_steps and r.evicted > 0


@pytest.mark.parametrize("ablation", ABLATIONS)
def test_planted_mistakes_fail(ablation: str) -> None:
    r = prove_serving(ablation)
    assert not r.ok and max(r.latents, r.actions) > 1e-4, r


def _first_chunk(name: str, seed: int, scale: float = 1.0) -> ChunkRequest:
    g = torch.Generator().manual_seed(seed)
    return ChunkRequest(session=name, frames=scale * torch.randn(1, 48, 8, 8, generator=g),
                        actions=torch.zeros(0, 2, 16), prompt=TEXT(name), negative=TEXT(""),
                        seed=seed)  # fmt: skip


def _run(engine: LingBotVAEngine) -> dict[int, object]:
    return {res.request_id: res for res in engine.run()}


def test_one_robots_fault_fails_only_that_robot() -> None:
    policy = tiny_serving_policy()
    engine = LingBotVAEngine(policy, robots=3, shapes=[LingShape(video=3, action=3)])
    good, bad = _first_chunk("good", 1), _first_chunk("bad", 2, scale=3e38)
    ids = engine.submit(good), engine.submit(bad)
    out = _run(engine)
    assert out[ids[1]].error is not None and "non-finite" in out[ids[1]].error
    assert out[ids[0]].error is None
    ref = tiny_policy(**TINY)
    ref.load_state_dict(policy.state_dict())
    lat, _, act = ReferenceRobot(ref, good.prompt, good.negative).chunk(good.frames, None, 1)
    assert (out[ids[0]].latents - lat).abs().max() <= 1e-5
    assert (out[ids[0]].action - act).abs().max() <= 1e-5
    # the failed robot's next request rebuilds its session and is served
    again = _run_one(engine, _first_chunk("bad", 2))
    assert again.error is None


def _run_one(engine: LingBotVAEngine, req: ChunkRequest):  # type: ignore[no-untyped-def]
    rid = engine.submit(req)
    return _run(engine)[rid]


def test_bad_input_is_one_line_to_that_robot() -> None:
    policy = tiny_serving_policy()
    engine = LingBotVAEngine(policy, robots=1, shapes=[LingShape(video=2, action=2)])
    ok = _first_chunk("ok", 1)
    # an observation lacking a camera: its latent frame is narrower than the config's
    with pytest.raises(ValueError, match=r"session 'ok' .*encode every camera the config names"):
        engine.submit(ChunkRequest(session="ok", frames=ok.frames[..., :4], actions=ok.actions,
                                   prompt=ok.prompt, negative=ok.negative))  # fmt: skip
    with pytest.raises(ValueError, match=r"prompt is \(600, 16\).*max_sequence_length=512"):
        engine.submit(ChunkRequest(session="ok", frames=ok.frames, actions=ok.actions,
                                   prompt=torch.zeros(600, 16), negative=ok.negative))  # fmt: skip
    with pytest.raises(ValueError, match=r"restarted mid-chunk"):
        engine.submit(ChunkRequest(session="ok", frames=torch.zeros(3, 48, 8, 8),
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
