"""Per-episode conditioning survives packing: broadcast by doc id, and per-episode randomness
that depends on (seed, step, episode, stream) only -- never on the pack, its order or the rank."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packing.data import Stream, layout_from_lengths, pack
from packing.train._conditioning import (
    _splitmix64,
    broadcast_to_tokens,
    cfg_dropout_mask,
    episode_noise,
    episode_seed,
    episode_timesteps,
    flow_matching_inputs,
    packed_noise,
    step_doc_ids,
)

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DOC_IDS = torch.tensor([0, 0, 1, 1, 1, 1, 2, 2, 2, -1, -1, -1], dtype=torch.int32)


# -- broadcast_to_tokens -------------------------------------------------------------------------
def test_broadcast_three_episodes_by_hand() -> None:
    t_K = torch.tensor([0.1, 0.7, 0.4])
    assert broadcast_to_tokens(t_K, DOC_IDS).tolist() == pytest.approx(
        [0.1, 0.1, 0.7, 0.7, 0.7, 0.7, 0.4, 0.4, 0.4, 0, 0, 0]
    )
    mod_KD = torch.tensor([[1.0, -1.0], [2.0, -2.0], [3.0, -3.0]])  # e.g. adaLN shift, scale
    out = broadcast_to_tokens(mod_KD, DOC_IDS, pad_value=-9.0)
    assert out.shape == (12, 2)
    assert out[:, 0].tolist() == [1, 1, 2, 2, 2, 2, 3, 3, 3, -9, -9, -9]
    assert out[:, 1].tolist() == [-1, -1, -2, -2, -2, -2, -3, -3, -3, -9, -9, -9]


def test_broadcast_accepts_a_layout_and_bool_values() -> None:
    lay = layout_from_lengths([2, 4, 3], [2, 4, 3], 12)
    drop_K = torch.tensor([False, True, False])
    out = broadcast_to_tokens(drop_K, lay, pad_value=False)
    assert out.dtype == torch.bool
    assert out.tolist() == [False] * 2 + [True] * 4 + [False] * 6


def test_broadcast_backward_sums_each_episode_tokens() -> None:
    # The conditioning MLP runs on K rows; its gradient is the sum over the episode's tokens.
    mod_KD = torch.ones(3, 4, requires_grad=True)
    broadcast_to_tokens(mod_KD, DOC_IDS).sum().backward()
    assert mod_KD.grad is not None
    assert mod_KD.grad[:, 0].tolist() == [2.0, 4.0, 3.0]  # lengths; padding adds nothing


def test_broadcast_all_padding_pack_gives_pad_rows() -> None:
    out = broadcast_to_tokens(torch.zeros(0, 3), torch.full((5,), -1), pad_value=0.5)
    assert out.shape == (5, 3) and bool((out == 0.5).all())


def test_broadcast_rejects_non_vector_doc_ids() -> None:
    with pytest.raises(ValueError, match=r"doc_ids must be \(T,\)"):
        broadcast_to_tokens(torch.zeros(3), DOC_IDS.view(3, 4))


def test_step_doc_ids_of_a_grid_stream() -> None:
    # Steps [1, 2], 2 tokens per step, padded to 8 tokens = 4 step rows.
    lay = layout_from_lengths([2, 4], [1, 2], 8, tokens_per_step=2, grid=(1, 2))
    assert lay.doc_ids_T.tolist() == [0, 0, 1, 1, 1, 1, -1, -1]
    assert step_doc_ids(lay).tolist() == [0, 1, 1, -1]
    assert step_doc_ids(lay, num_steps=6).tolist() == [0, 1, 1, -1, -1, -1]
    with pytest.raises(ValueError, match="episodes have 3 steps but num_steps=2"):
        step_doc_ids(lay, num_steps=2)


# -- seeds -----------------------------------------------------------------------------------
def test_splitmix64_matches_the_reference_sequence() -> None:
    # First two outputs of splitmix64 seeded with 0 (Vigna's reference implementation).
    assert _splitmix64(0) == 0xE220A8397B1DCDAF
    assert _splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


def test_episode_seed_is_pinned() -> None:
    # Pinned so that a change to the mix (which would change every run's noise) is deliberate.
    assert episode_seed(0, 0, 0) == 6582728405822073705
    assert episode_seed(1, 2, 3) == 4429856924193479116
    assert episode_seed(1, 2, 3, "latents") == 2582631104349601534


def test_episode_seed_separates_every_key() -> None:
    seeds = {
        episode_seed(s, step, e, stream)
        for s in range(4)
        for step in range(8)
        for e in range(64)
        for stream in ("latents", "action", "timestep")
    }
    assert len(seeds) == 4 * 8 * 64 * 3  # no collisions between neighbouring keys
    assert all(0 <= x < 2**63 for x in seeds)  # valid for manual_seed and int64


# -- timesteps and CFG dropout ----------------------------------------------------------------
@PROPERTY
@given(
    episodes=st.lists(st.integers(0, 10_000), min_size=1, max_size=12),
    data=st.data(),
)
def test_timesteps_depend_only_on_the_episode(episodes: list[int], data: st.DataObject) -> None:
    order = data.draw(st.permutations(range(len(episodes))))
    t = episode_timesteps(3, 11, episodes, distribution="logit_normal", shift=3.0)
    t_perm = episode_timesteps(
        3, 11, [episodes[i] for i in order], distribution="logit_normal", shift=3.0
    )
    assert torch.equal(t_perm, t[list(order)])
    for i, e in enumerate(episodes):  # a pack of one -- the unpacked reference
        assert torch.equal(
            episode_timesteps(3, 11, [e], distribution="logit_normal", shift=3.0), t[i : i + 1]
        )


def test_timesteps_distributions() -> None:
    eps = list(range(4000))
    u = episode_timesteps(0, 0, eps, dtype=torch.float64)
    assert bool(((u > 0) & (u < 1)).all())
    # Kolmogorov-Smirnov distance to U(0, 1); 0.026 is the 1% critical value for n = 4000.
    ks = (u.sort().values - (torch.arange(4000, dtype=torch.float64) + 0.5) / 4000).abs().max()
    assert ks.item() < 0.026
    ln = episode_timesteps(0, 0, eps, distribution="logit_normal", dtype=torch.float64)
    z = torch.logit(ln)  # sigmoid(N(0, 1)) -> logit is standard normal
    assert abs(z.mean().item()) < 0.06 and abs(z.std().item() - 1.0) < 0.05
    shifted = episode_timesteps(0, 0, eps, shift=5.0, dtype=torch.float64)
    assert torch.allclose(shifted, 5 * u / (1 + 4 * u))
    assert shifted.mean().item() > 0.7  # shift > 1 moves mass toward noise
    other_step = episode_timesteps(0, 1, eps, dtype=torch.float64)
    assert (other_step != u).double().mean().item() > 0.99


def test_timesteps_refuse_device_indices_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"host-device sync. Pass batch.episode_ids"):
        episode_timesteps(0, 0, torch.zeros(3, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="distribution='normal'"):
        episode_timesteps(0, 0, [1], distribution="normal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shift=0"):
        episode_timesteps(0, 0, [1], shift=0)


def test_cfg_dropout_mask() -> None:
    eps = list(range(5000))
    assert not cfg_dropout_mask(0, 0, eps, 0.0).any()
    assert cfg_dropout_mask(0, 0, eps, 1.0).all()
    drop = cfg_dropout_mask(0, 0, eps, 0.3)
    assert drop.dtype == torch.bool and abs(drop.double().mean().item() - 0.3) < 0.02
    assert torch.equal(cfg_dropout_mask(0, 0, eps[::-1], 0.3), drop.flip(0))
    # Its own stream: whether an episode is dropped tells nothing about its timestep.
    t = episode_timesteps(0, 0, eps, dtype=torch.float64)
    assert abs(t[drop].mean().item() - t[~drop].mean().item()) < 0.03
    with pytest.raises(ValueError, match=r"p=1.5 must be in \[0, 1\]"):
        cfg_dropout_mask(0, 0, eps, 1.5)


# -- noise -----------------------------------------------------------------------------------
def test_episode_noise_is_a_function_of_its_keys() -> None:
    a = episode_noise(0, 5, 17, (3, 4), stream="latents")
    assert torch.equal(a, episode_noise(0, 5, 17, (3, 4), stream="latents"))
    for other in (
        episode_noise(0, 5, 18, (3, 4), stream="latents"),  # another episode
        episode_noise(0, 6, 17, (3, 4), stream="latents"),  # another step
        episode_noise(1, 5, 17, (3, 4), stream="latents"),  # another seed
        episode_noise(0, 5, 17, (3, 4), stream="action"),  # another stream
    ):
        assert not torch.allclose(a, other)
    bf16 = episode_noise(0, 5, 17, (3, 4), stream="latents", dtype=torch.bfloat16)
    assert torch.equal(bf16, a.to(torch.bfloat16))


def _episode(index: int, steps: int, step_shape: tuple[int, ...] = (2,)) -> dict[str, object]:
    x = torch.full((steps, *step_shape), 100.0 * index) + torch.arange(steps).view(
        -1, *[1] * len(step_shape)
    )
    return {"x": x, "episode_index": index}


def test_packed_noise_by_hand() -> None:
    batch = pack([_episode(7, 2), _episode(3, 4), _episode(5, 3)], pad_to_multiple=12)
    noise = packed_noise(batch, seed=1, step=4, stream="x")
    assert noise.shape == batch["x"].shape == (12, 2) and noise.dtype == batch["x"].dtype
    assert torch.equal(noise[0:2], episode_noise(1, 4, 7, (2, 2), stream="x"))
    assert torch.equal(noise[2:6], episode_noise(1, 4, 3, (4, 2), stream="x"))
    assert torch.equal(noise[6:9], episode_noise(1, 4, 5, (3, 2), stream="x"))
    assert bool((noise[9:] == 0).all())


def test_packed_noise_of_a_grid_stream_is_per_step() -> None:
    eps = [{"lat": torch.zeros(n, 3, 2, 4), "episode_index": e} for e, n in [(9, 1), (2, 2)]]
    batch = pack(eps, streams=[Stream("lat", grid=(1, 2))], pad_to_multiple=8)
    lay = batch.layout("lat")
    assert lay.tokens_per_step == 2 and batch["lat"].shape[0] == 4  # 3 real steps + 1 pad
    noise = packed_noise(batch, seed=0, step=0, stream="lat")
    assert torch.equal(noise[0:1], episode_noise(0, 0, 9, (1, 3, 2, 4), stream="lat"))
    assert torch.equal(noise[1:3], episode_noise(0, 0, 2, (2, 3, 2, 4), stream="lat"))
    assert bool((noise[3] == 0).all())
    # The layout form gives the same tensor.
    same = packed_noise(
        lay, seed=0, step=0, stream="lat", step_shape=(3, 2, 4), episode_index_K=[9, 2]
    )
    assert torch.equal(same, noise)


def test_packed_noise_with_max_docs_and_empty_pack() -> None:
    batch = pack([_episode(7, 2), _episode(3, 1)], pad_to_multiple=4, max_docs=4)
    assert batch["episode_index"].tolist() == [7, 3, -1, -1]
    noise = packed_noise(batch, seed=0, step=0, stream="x")
    assert torch.equal(noise[2:3], episode_noise(0, 0, 3, (1, 2), stream="x"))
    empty = pack([], streams=[Stream("x", step_shape=(2,), dtype=torch.float32)], pad_to_multiple=4)
    assert bool((packed_noise(empty, seed=0, step=0, stream="x") == 0).all())


def test_packed_noise_refuses_position_keyed_episodes() -> None:
    batch = pack([{"x": torch.zeros(2, 2)}, {"x": torch.zeros(3, 2)}])
    with pytest.raises(ValueError, match="carry no 'episode_index'"):
        packed_noise(batch, seed=0, step=0, stream="x")
    lay = batch.layout("x")
    with pytest.raises(ValueError, match="needs step_shape= and episode_index_K="):
        packed_noise(lay, seed=0, step=0, stream="x")
    with pytest.raises(ValueError, match="has 2 episodes but 3 episode indices"):
        packed_noise(lay, seed=0, step=0, stream="x", step_shape=(2,), episode_index_K=[1, 2, 3])


def test_packed_inputs_identical_whatever_the_packing() -> None:
    """Noise, timesteps and x_t of an episode are the same in any pack, order or position,
    and equal to what the episode alone (the unpacked reference) gets."""
    seen = Counter[str]()

    @PROPERTY
    @given(steps=st.lists(st.integers(1, 7), min_size=1, max_size=8), data=st.data())
    def check(steps: list[int], data: st.DataObject) -> None:
        episodes = [_episode(100 + 13 * i, n) for i, n in enumerate(steps)]
        order = data.draw(st.permutations(range(len(episodes))))
        cut = data.draw(st.integers(0, len(episodes)))
        packs = [[episodes[i] for i in order[:cut]], [episodes[i] for i in order[cut:]]]
        got: dict[int, torch.Tensor] = {}
        first_noise: dict[int, torch.Tensor] = {}
        for members in packs:
            if not members:
                continue
            batch = pack(members, pad_to_multiple=data.draw(st.sampled_from([1, 5, 16])))
            noise = packed_noise(batch, seed=2, step=9, stream="x")
            t_K = episode_timesteps(2, 9, batch.episode_ids)
            t_S = broadcast_to_tokens(t_K, batch.doc_ids)
            x_t, target = flow_matching_inputs(batch["x"], noise, t_S)
            lay = batch.layout("x")
            pad = slice(lay.num_tokens, None)
            assert bool((noise[pad] == 0).all()) and bool((x_t[pad] == 0).all())
            start = 0
            for ep, n in zip(members, lay.steps_K, strict=True):
                idx = int(ep["episode_index"])  # type: ignore[call-overload]
                got[idx] = torch.cat([x_t[start : start + n], target[start : start + n]], 1)
                first_noise[idx] = noise[start]
                seen["not first in its pack"] += start > 0
                start += n
            seen["padded"] += lay.padded_len > lay.num_tokens
            seen["several episodes in a pack"] += len(members) > 1
        for ep in episodes:  # the unpacked reference: the episode alone
            idx = int(ep["episode_index"])  # type: ignore[call-overload]
            x0 = ep["x"]
            assert isinstance(x0, torch.Tensor)
            noise = episode_noise(2, 9, idx, tuple(x0.shape), stream="x")
            t = episode_timesteps(2, 9, [idx]).expand(x0.shape[0])
            ref = torch.cat(flow_matching_inputs(x0, noise, t), dim=1)
            assert torch.equal(got[idx], ref), f"episode {idx} saw other inputs when packed"
        # Different episodes got different noise.
        assert len({tuple(v.tolist()) for v in first_noise.values()}) == len(first_noise)

    check()
    assert seen["not first in its pack"] > 20, seen
    assert seen["padded"] > 10 and seen["several episodes in a pack"] > 20, seen


# -- flow matching -----------------------------------------------------------------------------
def test_flow_matching_inputs_convention() -> None:
    x0 = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]])
    noise = torch.tensor([[5.0, 6.0], [7.0, 8.0], [0.0, 0.0]])
    x_t, v = flow_matching_inputs(x0, noise, torch.tensor([0.0, 1.0, 0.5]))
    assert x_t.tolist() == [[1.0, 2.0], [7.0, 8.0], [0.0, 0.0]]  # t=0 data, t=1 noise, pad 0
    assert v.tolist() == [[4.0, 4.0], [4.0, 4.0], [0.0, 0.0]]  # noise - x0
    # The target is the velocity d x_t / d t.
    t = torch.tensor([0.3, 0.6, 0.2], dtype=torch.float64)
    a, _ = flow_matching_inputs(x0.double(), noise.double(), t)
    b, v = flow_matching_inputs(x0.double(), noise.double(), t + 1e-6)
    assert torch.allclose((b - a) / 1e-6, v.double(), atol=1e-6)


def test_flow_matching_inputs_checks_shapes() -> None:
    with pytest.raises(ValueError, match="one value per row"):
        flow_matching_inputs(torch.zeros(4, 2), torch.zeros(4, 2), torch.zeros(3))
    with pytest.raises(ValueError, match="must match"):
        flow_matching_inputs(torch.zeros(4, 2), torch.zeros(4, 3), torch.zeros(4))


def test_noise_uses_no_global_rng() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    episode_noise(0, 0, 1, (4,))
    episode_timesteps(0, 0, [1, 2])
    assert torch.equal(torch.get_rng_state(), before)
    assert math.isfinite(float(episode_noise(0, 0, 1, (4,)).sum()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_device_sync_on_cuda() -> None:
    batch = pack([_episode(7, 2), _episode(3, 4)], pad_to_multiple=8).to("cuda")
    mod_KD = torch.rand(2, 4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        t_K = episode_timesteps(0, 0, batch.episode_ids, device="cuda")
        broadcast_to_tokens(t_K, batch.doc_ids)
        broadcast_to_tokens(mod_KD, batch.doc_ids)
        noise = packed_noise(batch, seed=0, step=0, stream="x")
        cfg_dropout_mask(0, 0, batch.episode_ids, 0.1, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # Per episode, the CUDA generator's draws are the same whatever the pack.
    assert torch.equal(noise[2:6], episode_noise(0, 0, 3, (4, 2), stream="x", device="cuda"))
