"""`LingBotVAAdapter.from_policy`: LeRobot's own VAE and UMT5 behind the served LingBot-VA,
each robot's frames encoded as LeRobot's policy encodes them for that robot alone.

The frozen modules are toy ones of LeRobot's own kinds (`tiny_frozen_modules`: diffusers'
Wan 2.2 VAE, transformers' UMT5, a word-level tokenizer), random-init and offline."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("lerobot.policies.lingbot_va", reason="needs packing[lingbot]")
from lerobot.policies.lingbot_va.utils import WanVAEStreamingWrapper

from packing.integrations.lingbot_va import (
    ChunkRequest,
    LingBotVAAdapter,
    LingBotVAEngine,
    LingShape,
    PolicyEncoders,
)
from packing.integrations.lingbot_va.testing import (
    tiny_frozen_modules,
    tiny_serving_policy,
)

# raw frames a message carries: the conditioning observation, then each chunk's keyframes
SCHEDULE = (1, 4, 4, 8)


@pytest.fixture(scope="module")
def policy() -> Any:
    return tiny_frozen_modules(tiny_serving_policy())


def _messages(policy: Any, seed: int) -> list[dict[str, np.ndarray]]:
    """One robot's camera frames, message by message: uint8 (n, H, W, 3) per camera."""
    g = np.random.default_rng(seed)
    H, W = policy.config.height, policy.config.width
    return [{k: g.integers(0, 256, (n, H, W, 3), dtype=np.uint8) for k in policy.config.obs_cam_keys}
            for n in SCHEDULE]  # fmt: skip


def _alone(policy: Any, messages: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
    """LeRobot's ``_encode_frames`` for one robot alone: its own streaming VAE, message after
    message, each frame as LeRobot's processors hand it over (float (1, 3, H, W) in [0, 1])."""
    policy._frozen["streaming_vae"] = WanVAEStreamingWrapper(policy._frozen["vae"])
    return [policy._encode_frames(_raw(m))[0].transpose(0, 1) for m in messages]


def _raw(message: dict[str, np.ndarray]) -> list[dict[str, torch.Tensor]]:
    """A message's frames one by one, each camera's as LeRobot's processors hand it to the
    policy: float (1, 3, H, W) in [0, 1]."""
    n = next(iter(message.values())).shape[0]
    return [{k: torch.from_numpy(v[i]).permute(2, 0, 1)[None].float() / 255
             for k, v in message.items()} for i in range(n)]  # fmt: skip


def test_robots_interleaved_each_encode_as_lerobot_alone(policy: Any) -> None:
    """Two robots' messages interleaved through one `PolicyEncoders`: each robot's latents
    are exactly those of LeRobot's policy encoding that robot alone (its causal VAE cache
    carried from chunk to chunk); through LeRobot's one shared cache they are not."""
    enc = PolicyEncoders(policy)
    robots = {s: _messages(policy, seed) for s, seed in (("a", 0), ("b", 1))}
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    for i in range(len(SCHEDULE)):
        for s in ("a", "b"):
            got[s].append(enc(s, robots[s][i]))
    for s, msgs in robots.items():
        for k, (g, w) in enumerate(zip(got[s], _alone(policy, msgs), strict=True)):
            assert torch.equal(g, w), (s, k)
    # the negative control: LeRobot's one streaming VAE for both robots (robot b's keyframes
    # in between robot a's; b's conditioning frame would not even encode mid-stream)
    policy._frozen["streaming_vae"] = WanVAEStreamingWrapper(policy._frozen["vae"])
    order = [("a", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3)]
    mixed = {(s, i): policy._encode_frames(_raw(robots[s][i]))[0].transpose(0, 1) for s, i in order}
    assert torch.equal(mixed["a", 1], got["a"][1])  # before b's frames came in
    assert (mixed["a", 3] - got["a"][3]).abs().max() > 1e-3


def test_an_unserved_chunk_puts_the_episodes_vae_cache_back(policy: Any) -> None:
    """The robot sends the same frames again after an unserved chunk: they encode as the
    first time, and the episode goes on as LeRobot's alone; without the hook they do not."""
    enc = PolicyEncoders(policy)
    msgs = _messages(policy, 2)
    enc("r", msgs[0])
    first = enc("r", msgs[1])
    enc.unserved("r")
    again = enc("r", msgs[1])
    assert torch.equal(first, again)
    rest = [enc("r", m) for m in msgs[2:]]
    want = _alone(policy, msgs)
    assert all(torch.equal(g, w) for g, w in zip(rest, want[2:], strict=True))
    stale = enc("r", msgs[1])  # the same frames once more, with no unserved(): the cache moved
    assert not torch.equal(stale, first)


def test_the_prompt_is_lerobots_umt5_embedding_and_a_long_one_is_refused(policy: Any) -> None:
    enc = PolicyEncoders(policy)
    adapter = LingBotVAAdapter.from_policy(policy)
    for prompt in ("pick up the red cup", "", "put  the &amp; bowl on the plate"):
        want = policy._encode_prompt(prompt)[0][0]  # LeRobot's: padded to max_sequence_length
        assert torch.equal(adapter._embed(prompt), want.float())
        assert enc.text(prompt).shape[0] < want.shape[0]  # the real tokens only
    L = policy.config.max_sequence_length
    with pytest.raises(ValueError, match=rf"is {L + 1} tokens, more than the text encoder takes "
                                         rf"\(max_sequence_length={L}\)"):  # fmt: skip
        enc.text(" ".join(["cup"] * L))  # L words and </s>: LeRobot would cut it silently


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        (np.zeros((1, 128, 128, 3), dtype=np.float32), r"\(n, H, W, 3\) uint8 or .*float32"),
        (np.zeros((1, 3, 128, 128), dtype=np.uint8), r"got uint8 \(1, 3, 128, 128\)"),
        (np.full((1, 3, 128, 128), 2.0, dtype=np.float32), r"float frames in \[0, 1\]"),
        (np.full((1, 3, 128, 128), np.nan, dtype=np.float32), r"float frames in \[0, 1\]"),
    ],
)
def test_frames_a_policy_cannot_read_are_refused_naming_the_camera(policy: Any, frames: Any,
                                                                   match: str) -> None:  # fmt: skip
    enc = PolicyEncoders(policy)
    cams = policy.config.obs_cam_keys
    good = np.zeros((1, 128, 128, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match=rf"observation\['{cams[1]}'\] must be .*" + match):
        enc("r", {cams[0]: good, cams[1]: frames})
    with pytest.raises(ValueError, match=r"the message carries no frames"):
        enc("r", {cams[0]: good[:0], cams[1]: good[:0]})
    with pytest.raises(ValueError, match=r"first message carries 2 frames a camera; it takes 1"):
        enc("r", {cams[0]: np.concatenate([good, good]), cams[1]: np.concatenate([good, good])})
    with pytest.raises(ValueError, match=r"different frame counts \[1, 2\]"):
        enc("r", {cams[0]: good, cams[1]: np.zeros((2, 128, 128, 3), dtype=np.uint8)})


def test_a_refused_observation_leaves_the_vae_cache_and_an_ended_episode_frees_it(
    policy: Any,
) -> None:
    """A message the adapter refuses after encoding (a restarted episode's frame count)
    leaves the robot's VAE cache as it was; the episode's end frees it."""
    adapter = LingBotVAAdapter.from_policy(policy)
    enc = adapter.encoder
    msgs = _messages(policy, 3)
    cams = policy.config.obs_cam_keys
    obs = {"task": "pick up the cup"}
    adapter.request({**obs, **msgs[0]}, "r")
    with pytest.raises(ValueError, match=r"in whole groups of 4 .*an episode restarted mid-chunk"):
        adapter.request({**obs, **{k: v[:1] for k, v in msgs[1].items()}}, "r")
    with pytest.raises(ValueError, match=r"encode to 2 latent frames; chunk 1 of this episode "
                                         r"takes 1 .*an episode restarted mid-chunk"):  # fmt: skip
        adapter.request({**obs, **msgs[3]}, "r")  # 8 frames: the VAE encodes, the adapter refuses
    req = adapter.request({**obs, **msgs[1]}, "r")
    want = _alone(policy, msgs)
    assert torch.equal(req.frames[1:], want[1].float())  # as if the refused one never came
    assert set(enc._caches) == {"r"} and cams
    adapter.end_session("r")
    assert enc._caches == {}


def test_an_observation_from_camera_images_to_an_action_chunk(policy: Any) -> None:
    """The whole first mile: camera images and a task through the adapter's LeRobot
    encoders, the engine, and back as the chunk's actions."""
    adapter = LingBotVAAdapter.from_policy(policy)
    engine = LingBotVAEngine(policy, robots=2, shapes=[LingShape(video=1, action=1)])
    req = adapter.request({"task": "pick up the cup", **_messages(policy, 4)[0]}, "r")
    assert isinstance(req, ChunkRequest)
    engine.submit(req)
    (result,) = engine.run()
    reply = adapter.reply(result)
    n_used = len(policy.config.used_action_channel_ids)
    assert result.error is None and reply["actions"].shape[1] == n_used
    assert (
        np.array_equal(reply["actions"], result.action.numpy())
        and np.isfinite(reply["actions"]).all()
    )


def _select_action_alone(policy: Any, frames: list[dict[str, np.ndarray]], task: str,
                         seeds: list[int], chunks: int) -> tuple[list[torch.Tensor], list[Any]]:  # fmt: skip
    """LeRobot's ``select_action`` for one robot alone, observation by observation (uint8
    images as LeRobot's processors hand them over: float, /255): each chunk's actions, and
    the observations the robot's message for that chunk carries (the first observation, then
    the keyframes ``select_action`` buffered during the chunk before)."""
    policy.reset()
    cams = list(policy.config.obs_cam_keys)
    actions: list[list[torch.Tensor]] = []
    messages: list[list[dict[str, np.ndarray]]] = []
    buffered: list[dict[str, np.ndarray]] = []
    for t, obs in enumerate(frames):
        if t > 0 and (policy._prev_j + 1) % policy._keyframe_stride == 0:
            buffered.append(obs)  # select_action's own keyframe rule
        if t == 0 or len(policy._action_queue) == 0:  # this call predicts the next chunk
            if len(actions) == chunks:
                break
            torch.manual_seed(seeds[len(actions)])  # the noise ChunkRequest.seed draws
            messages.append([obs] if t == 0 else buffered)
            buffered, actions = [], [*actions, []]
        batch: dict[str, Any] = {k: torch.from_numpy(obs[k]).permute(2, 0, 1)[None].float() / 255
                                 for k in cams}  # fmt: skip
        actions[-1].append(policy.select_action({**batch, "task": [task]})[0])
    return [torch.stack(a) for a in actions], messages


def test_camera_images_to_actions_equal_lerobots_select_action_per_robot() -> None:
    """The whole first mile, two robots: each sends the observations LeRobot's
    ``select_action`` would see (the first, then each chunk's keyframes), the adapter
    encodes them with the policy's own VAE and UMT5, the engine packs both robots' chunks
    (robot 1 joining a chunk later), and each robot's action chunks equal ``select_action``
    run for that robot alone, observation by observation (1e-5)."""
    policy = tiny_frozen_modules(tiny_serving_policy(action_per_frame=4))  # keyframe stride 1
    cams, (H, W) = list(policy.config.obs_cam_keys), (policy.config.height, policy.config.width)
    tasks = ["pick up the red cup", "put the bowl on the plate"]
    seeds = [[11 + 1000 * k for k in range(3)], [5 + 1000 * k for k in range(3)]]
    want, messages = [], []
    for r in (0, 1):
        g = np.random.default_rng(r)
        frames = [{k: g.integers(0, 256, (H, W, 3), dtype=np.uint8) for k in cams}
                  for _ in range(40)]  # fmt: skip
        w, m = _select_action_alone(policy, frames, tasks[r], seeds[r], chunks=3)
        want.append(w)
        messages.append(m)
    assert [len(m) for m in messages[0]] == [1, 4, 8]  # the conditioning frame, keyframes
    adapter = LingBotVAAdapter.from_policy(policy)
    engine = LingBotVAEngine(policy, robots=2, shapes=[LingShape(video=2, action=2)])
    served = 0
    for rnd in range(4):
        sent = {}
        for r, i in ((0, rnd), (1, rnd - 1)):  # robot 1 joins one chunk later
            if 0 <= i < 3:
                obs = {k: np.stack([f[k] for f in messages[r][i]]) for k in cams}
                req = adapter.request({"task": tasks[r], "seed": seeds[r][i], **obs}, f"robot{r}")
                sent[engine.submit(req)] = (r, i)
        for res in engine.run():
            r, i = sent.pop(res.request_id)
            got = torch.from_numpy(adapter.reply(res)["actions"])
            torch.testing.assert_close(got, want[r][i], rtol=0, atol=1e-5)
            served += 1
        assert sent == {}
    assert served == 6
