"""LeRobot's LingBot-VA trained packed equals LeRobot's own path one episode at a time.

The proof runs `packing verify` on a tiny policy built from LeRobot's classes against
``PackedLingBotVA.reference()``: LeRobot's unmodified ``training_loss_from_streams`` (its draws
after ``torch.manual_seed`` of the episode's seed, its ``forward_train``, its
``FlexAttnFunc`` mask_mods evaluated densely, its loss). Negative controls must fail.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot.policies.lingbot_va.modeling_lingbot_va")
pytest.importorskip("transformers")

from packing.attention import dense_mask, make_block_mask
from packing.integrations.lingbot_va import (
    REDUCTIONS,
    draw_episode,
    dual_stream_tokens,
    install,
    lingbot_episodes,
    lingbot_va_mask,
)
from packing.integrations.lingbot_va import testing as T
from packing.verify import VerifyConfig, run_verify

sys.path.insert(0, str(Path(__file__).parent))  # accelerate_worker

MODEL = "packing.integrations.lingbot_va.testing:tiny_lingbot_va"


def _episode(i: int, frames: int, apf: int = 2, hw: tuple[int, int] = (4, 4)) -> dict:
    g = torch.Generator().manual_seed(100 + i)
    return {
        "latents": torch.randn(frames, 48, *hw, generator=g),
        "actions": torch.randn(frames, apf, 14, generator=g),
        "text": T.toy_text_embeddings(16)(f"task {i % 2}"),
        "episode_index": i,
    }


@functools.cache
def _packed(apf: int = 2):
    torch.manual_seed(0)
    return install(T.tiny_policy(action_per_frame=apf), latent_hw=(4, 4))


# -- the proof -------------------------------------------------------------------------------
def test_verify_passes_against_lerobots_own_training_path() -> None:
    report = run_verify(VerifyConfig(model=MODEL))
    assert report.passed, report.format()
    assert "reference()" in report.format()  # the unpacked side is LeRobot's path
    assert max(report.pack_sizes) >= 3  # packs really held several episodes
    assert len({round(s.loss_unpacked, 6) for s in report.steps}) == 3  # weights moved
    assert report.leak is not None and report.leak.ok


def test_verify_passes_with_lerobots_per_frame_mean() -> None:
    report = run_verify(VerifyConfig(model=MODEL, reduction="frame", steps=1, leak_check=False))
    assert report.passed, report.format()


def test_verify_passes_on_two_ranks_under_fsdp2() -> None:
    config = VerifyConfig(model=MODEL, nproc=2, episodes=6, steps=1, leak_check=False)
    report = run_verify(config)
    assert report.passed, report.format()


@pytest.mark.parametrize("ablation", T.ABLATIONS)
def test_verify_fails_on_each_planted_mistake(ablation: str, monkeypatch) -> None:
    monkeypatch.setattr(T, "ablated", functools.partial(T.tiny_lingbot_va, ablation=ablation),
                        raising=False)  # fmt: skip
    config = VerifyConfig(
        model="packing.integrations.lingbot_va.testing:ablated", steps=1, leak_check=False
    )
    report = run_verify(config)
    assert not report.passed, f"{ablation} passed:\n{report.format()}"
    assert any("loss differs" in f or "gradient" in f for f in report.failures), report.failures


def test_no_document_mask_flag_fails() -> None:
    report = run_verify(VerifyConfig(model=MODEL, document_mask=False, steps=1))
    assert not report.passed
    assert report.leak is not None and not report.leak.ok


def test_packed_pack_equals_each_episode_alone_through_lerobot() -> None:
    """apf=2 (two actions a latent frame), a pack of ragged episodes: the packed episode loss
    is the mean of LeRobot's per-episode losses, and every LeRobot loss equals the packed
    module's on that episode alone."""
    packed = _packed(2)
    eps = [_episode(0, 3), _episode(1, 5), _episode(2, 2)]
    collate = packed.collator(token_budget=4 * 12, text_budget=3 * 512)
    ref = packed.reference()
    alone = []
    for ep in eps:
        b = collate([ep])
        b.extras.update(seed=3, step=7)
        lerobot = float(ref(b)["latents"][0])
        assert abs(float(packed.loss(b)) - lerobot) <= 1e-6 * abs(lerobot)
        alone.append(lerobot)
    pack = collate(eps)
    pack.extras.update(seed=3, step=7)
    draws = packed.draws(pack)
    assert len({(d.chunk_size, d.window_size) for d in draws}) == 3  # per-episode draws
    got = float(packed.loss(pack, "episode"))
    assert abs(got - sum(alone) / 3) <= 1e-6 * abs(got)
    frames = [3, 5, 2]
    want_frame = sum(f * x for f, x in zip(frames, alone, strict=True)) / sum(frames)
    assert abs(float(packed.loss(pack, "frame")) - want_frame) <= 1e-6 * want_frame
    assert set(REDUCTIONS) == {"episode", "frame"}


def test_draws_are_lerobots_after_manual_seed() -> None:
    """`draw_episode` makes LeRobot's calls on its own generator: the same numbers as the
    global RNG after torch.manual_seed of the episode's seed."""
    from packing.integrations.lingbot_va._draws import lingbot_seed

    seen = set()
    for episode in range(6):
        d = draw_episode(0, 1, episode, latent_shape=(4, 3, 2, 2), action_shape=(5, 3, 2, 1))
        torch.manual_seed(lingbot_seed(0, 1, episode))
        ids = (torch.rand(3) * 1000).clamp(0, 999).long()
        noise = torch.zeros(1, 4, 3, 2, 2).normal_()[0]
        assert torch.equal(ids, d.latent_ids) and torch.equal(noise, d.latent_noise)
        cond = torch.rand(1).item() < 0.5
        assert cond == (d.cond_ids is not None)
        seen.add(cond)
        if cond:
            assert torch.equal(
                (torch.rand(3) * 0.5 + 0.5).mul(1000).clamp(0, 999).long(), d.cond_ids
            )
            assert torch.equal(torch.zeros(1, 4, 3, 2, 2).normal_()[0], d.cond_noise)
        assert torch.equal((torch.rand(3) * 1000).clamp(0, 999).long(), d.action_ids)
        assert torch.equal(torch.zeros(1, 5, 3, 2, 1).normal_()[0], d.action_noise)
        torch.rand(1)
        assert d.chunk_size == int(torch.randint(1, 5, (1,)))
        assert d.window_size == int(torch.randint(4, 65, (1,)))
    assert seen == {True, False}  # both branches of the noisy condition were drawn


# -- the mask ---------------------------------------------------------------------------------
def test_mask_equals_lerobots_flexattn_mask_per_episode_and_blocks_are_exact() -> None:
    """Per episode, the packed mask (document & lingbot_va) is LeRobot's own
    ``FlexAttnFunc._get_mask_mod`` on that episode alone (its token order, padded by -1);
    the block mask from tile rules equals the dense mask's tiles."""
    from lerobot.policies.lingbot_va.utils import FlexAttnFunc

    packed = _packed(2)
    eps = [_episode(0, 3), _episode(1, 5), _episode(2, 4)]
    batch = packed.collator(token_budget=4 * 13, text_budget=3 * 512)(eps)
    chunks, windows = [1, 2, 3], [4, 5, 9]
    tok = dual_stream_tokens(batch, chunks, windows, action_per_frame=2)
    rule = lingbot_va_mask(tok)
    dense = dense_mask(tok.layout.doc_ids_T, None, None, rule)
    doc = tok.doc_J
    for k, (f, c, w) in enumerate(zip([3, 5, 4], chunks, windows, strict=True)):
        idx = torch.nonzero(doc == k).flatten()
        ours = dense[idx][:, idx]
        lat, act = f * 4, f * 2  # 4 latent tokens and 2 actions a frame
        frame_l = torch.arange(f).repeat_interleave(4)
        frame_a = torch.arange(f).repeat_interleave(2)
        frame_ids = torch.cat([frame_l // c * 2] * 2 + [frame_a // c * 2 + 1] * 2)
        noise_ids = torch.cat(
            [torch.zeros(lat), torch.ones(lat), torch.zeros(act), torch.ones(act)]
        ).long()
        seq = torch.zeros_like(frame_ids)
        mod = FlexAttnFunc._get_mask_mod(seq, frame_ids, noise_ids, w)
        n = frame_ids.shape[0]
        zero = torch.zeros((), dtype=torch.int64)
        theirs = mod(zero, zero, torch.arange(n)[:, None], torch.arange(n)[None])
        assert torch.equal(ours, theirs), k
    for block in (16, 32):
        _check_blocks(tok.layout.doc_ids_T, rule, dense, block, tok)


def test_block_mask_from_tile_rules_finds_full_tiles_on_larger_frames() -> None:
    """16 latent tokens a frame (a 4 x 4 grid): whole tiles of one copy and chunk are full."""
    from packing.data import PackedCollator, Stream

    collate = PackedCollator(
        [Stream("latents", grid=(4, 4)), Stream("actions", tokens_per_step=2)], pad_to_multiple=16
    )
    eps = [{"latents": torch.zeros(f, 1, 4, 4), "actions": torch.zeros(f, 2, 1), "episode_index": i}
           for i, f in enumerate([6, 9, 4])]  # fmt: skip
    tok = dual_stream_tokens(collate(eps), [2, 1, 4], [4, 7, 64], action_per_frame=2)
    rule = lingbot_va_mask(tok)
    dense = dense_mask(tok.layout.doc_ids_T, None, None, rule)
    fulls = [_check_blocks(tok.layout.doc_ids_T, rule, dense, b, tok) for b in (16, 32, 48)]
    assert min(fulls) > 0, fulls  # the rules found full tiles: sparsity, not just safety


def _check_blocks(doc: torch.Tensor, rule, dense: torch.Tensor, block: int, tok=None) -> int:
    """Every tile with a true pair is listed, every full tile is truly full (the attention is
    exact); returns the number of full tiles."""
    bm = make_block_mask(doc, None, None, block, mask_mod=rule, inner_fallback="error")
    listed = bm.to_dense()[0, 0].bool()
    want_any, want_all = _tiles(dense, block), _tiles(dense, block, all_=True)
    assert not (want_any & ~listed).any(), f"block {block}: a tile with a true pair is missing"
    n = listed.shape[0]
    full = torch.zeros(n, n, dtype=torch.bool)
    for r in range(n):
        k = int(bm.full_kv_num_blocks[0, 0, r])  # type: ignore[index]
        full[r, bm.full_kv_indices[0, 0, r, :k].long()] = True  # type: ignore[index]
    assert not (full & ~want_all).any(), f"block {block}: a tile listed full is not"
    # Exact where a q tile and a kv tile each hold one part (copy and stream) of one episode;
    # a tile mixing parts or episodes mixes their chunk ranges: listed, masked pair by pair.
    T = doc.shape[0]
    part = doc * 4 + (tok.copy_J + 2 * tok.kind_J if tok is not None else 0)

    def tiles(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, n * block - T), value=-1).view(n, block)

    d, pt = tiles(doc), tiles(part)
    one = (d >= 0).all(1) & (pt.amin(1) == pt.amax(1))
    both = one[:, None] & one[None]
    assert not (listed & ~want_any & both).any(), f"block {block}: loose on one-part tiles"
    return int(full.sum())


def _tiles(dense: torch.Tensor, block: int, all_: bool = False) -> torch.Tensor:
    T = dense.shape[0]
    n = -(-T // block)
    padded = torch.zeros(n * block, n * block, dtype=torch.bool)
    padded[:T, :T] = dense
    tiles = padded.view(n, block, n, block)
    return tiles.all(3).all(1) if all_ else tiles.any(3).any(1)


# -- checkpoints, datasets -------------------------------------------------------------------
def test_a_checkpoint_saved_by_lerobot_loads_and_trains_packed(tmp_path) -> None:
    from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy

    torch.manual_seed(0)
    policy = T.tiny_policy(action_per_frame=2)
    policy.save_pretrained(tmp_path / "ckpt")
    loaded = LingBotVAPolicy.from_pretrained(tmp_path / "ckpt")
    assert loaded.config.attn_mode == "flex"
    for (n, a), (_, b) in zip(
        policy.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), n
    packed = install(loaded, latent_hw=(4, 4))
    assert list(packed.state_dict()) == [
        "transformer." + k for k in loaded.transformer.state_dict()
    ]
    opt = torch.optim.AdamW(packed.parameters(), lr=1e-3)
    batch = packed.collator(token_budget=4 * 8, text_budget=2 * 512)(
        [_episode(0, 3), _episode(1, 4)]
    )
    losses = []
    for step in range(2):
        batch.extras.update(seed=0, step=step)
        loss = packed.loss(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[0] != losses[1]
    packed.uninstall()  # LeRobot's own ops are back
    assert type(loaded.transformer.blocks[0].attn1.attn_op).__name__ == "FlexAttnFunc"


def test_lingbot_episodes_from_a_latent_dataset() -> None:
    from packing.datasets import LeRobotEpisodes, default_dataset_root

    source = LeRobotEpisodes(default_dataset_root(), keys=["latents", "action"])
    ds = lingbot_episodes(source, T.toy_text_embeddings(16), action_per_frame=1)
    ep = ds[0]
    assert ep["actions"].shape == (source.lengths[0], 1, 14)
    assert ep["text"].shape == (512, 16) and ep["episode_index"] == source.episode_ids[0]
    with pytest.raises(ValueError, match=r"episode 0: 5 action rows do not match its 5 latent "
                       r"frames x action_per_frame=2 = 10; pass last_frame='drop'"):  # fmt: skip
        lingbot_episodes(source, T.toy_text_embeddings(16), action_per_frame=2)[0]
    dropped = lingbot_episodes(
        source, T.toy_text_embeddings(16), action_per_frame=2, last_frame="drop"
    )[0]
    assert dropped["latents"].shape[0] == 2 and dropped["actions"].shape == (2, 2, 14)


# -- bad input: one line naming the episode or argument, and the fix -------------------------
def test_bad_episodes_are_refused_at_the_collator_naming_the_episode() -> None:
    collate = _packed(2).collator(token_budget=4 * 12)
    short = _episode(7, 1)
    with pytest.raises(ValueError, match=r"episode 7 has 1 latent frames, shorter than one chunk "
                       r"\(the policy's frame_chunk_size=2\); drop it"):  # fmt: skip
        collate([_episode(0, 3), short])
    bad = {**_episode(8, 3), "actions": torch.zeros(3, 3, 14)}
    with pytest.raises(ValueError, match=r"episode 8: actions \(3, 3, 14\) do not match its 3 "
                       r"latent frames; LingBot-VA takes \(3, action_per_frame=2, 14"):  # fmt: skip
        collate([bad])
    wide = {**_episode(9, 3), "text": torch.zeros(512, 32)}
    with pytest.raises(ValueError, match=r"episode 9: text embeddings \(512, 32\) are not "
                       r"\(L, text_dim=16\)"):  # fmt: skip
        collate([wide])
    nameless = {k: v for k, v in _episode(3, 3).items() if k != "episode_index"}
    with pytest.raises(ValueError, match=r"episode at position 0 has no 'episode_index'"):
        collate([nameless])


def test_bad_models_and_options_are_refused_at_install() -> None:
    with pytest.raises(ValueError, match=r"attn_mode='torch'; LingBot-VA trains with "
                       r"attn_mode='flex'"):  # fmt: skip
        install(T.tiny_policy(attn_mode="torch"), latent_hw=(4, 4))
    policy = T.tiny_policy()
    for name, value in (("chunk_sizes", (0, 4)), ("chunk_sizes", (3, 2)), ("windows", (4, -1))):
        with pytest.raises(ValueError, match=rf"{name}=.* is out of range; pass an inclusive"):
            install(policy, latent_hw=(4, 4), **{name: value})
    with pytest.raises(ValueError, match=r"latent_hw=\(5, 4\); pass the latent frame's"):
        install(policy, latent_hw=(5, 4))
    with pytest.raises(TypeError, match=r"expected LeRobot's LingBotVAPolicy .* got Linear"):
        install(torch.nn.Linear(2, 2), latent_hw=(4, 4))


def test_diffusers_install_points_lerobots_wan_at_this_integration() -> None:
    pytest.importorskip("diffusers")
    from packing.integrations.diffusers import install as diffusers_install

    transformer = T.tiny_policy().transformer
    with pytest.raises(TypeError) as err:
        diffusers_install(transformer, latent_hw=(4, 4))
    msg = str(err.value)
    assert "lerobot.policies.lingbot_va.utils.WanTransformer3DModel" in msg
    assert "diffusers.models" in msg and "packing.integrations.lingbot_va.install" in msg


# -- Hugging Face Accelerate -----------------------------------------------------------------
def test_packed_sampler_under_accelerate_prepare_is_exact_once(tmp_path) -> None:
    """Two CPU processes: ``accelerator.prepare`` deals the loader's batches round-robin, so
    ``sampler.all_ranks()`` gives each process exactly its rank's packs (every episode once
    an epoch, none twice), while a per-rank sampler under ``prepare`` drops half of them."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("accelerate")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).with_name("accelerate_worker.py")
    out = tmp_path / "seen"
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(Path(__file__).parents[1])}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(worker), str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))  # fmt: skip
    for p in procs:
        log = p.communicate(timeout=300)[0].decode()
        assert p.returncode == 0, log[-3000:]
    seen = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]
    from accelerate_worker import LENGTHS

    for epoch in (0, 1):
        got = [e for r in (0, 1) for b in seen[r][f"all_ranks/{epoch}"] for e in b]
        assert sorted(got) == list(range(len(LENGTHS))), (epoch, sorted(got))  # once each
        for r in (0, 1):  # and each process got its own rank's packs, in order
            assert seen[r][f"all_ranks/{epoch}"] == seen[r][f"all_ranks/{epoch}/own"]
    trap = [e for r in (0, 1) for b in seen[r]["per_rank/0"] for e in b]
    assert len(set(trap)) < len(LENGTHS)  # the per-rank sampler under prepare drops episodes


# -- properties ------------------------------------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    frames=st.lists(st.integers(1, 7), min_size=1, max_size=4),
    chunks=st.lists(st.integers(1, 4), min_size=4, max_size=4),
    windows=st.lists(st.integers(0, 12), min_size=4, max_size=4),
    grid=st.sampled_from([(1, 1), (2, 2), (1, 3)]),
    apf=st.integers(1, 3),
    block=st.sampled_from([8, 16, 24]),
)
def test_block_mask_invariants_on_random_packs(frames, chunks, windows, grid, apf, block) -> None:
    """Any pack: every tile with a true pair is listed, only full tiles are full, and tiles of
    one episode are exact (the dense mask, from the same mask_mod, is the reference)."""
    from packing.data import PackedCollator, Stream

    collate = PackedCollator(
        [Stream("latents", grid=grid), Stream("actions", tokens_per_step=apf)], pad_to_multiple=8
    )
    eps = [{"latents": torch.zeros(f, 1, *grid), "actions": torch.zeros(f, apf, 1), "episode_index": i}
           for i, f in enumerate(frames)]  # fmt: skip
    k = len(frames)
    tok = dual_stream_tokens(collate(eps), chunks[:k], windows[:k], action_per_frame=apf)
    rule = lingbot_va_mask(tok)
    dense = dense_mask(tok.layout.doc_ids_T, None, None, rule)
    _check_blocks(tok.layout.doc_ids_T, rule, dense, block, tok)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    frames=st.integers(0, 5),
    act_shape=st.tuples(st.integers(0, 6), st.integers(1, 3), st.integers(13, 15)),
    text_width=st.sampled_from([8, 16, 32]),
)
def test_random_episodes_are_packed_or_refused_naming_the_episode(frames, act_shape, text_width):
    """A random episode is either LingBot-VA's (packed) or refused with packing's ValueError
    naming it: never cropped, padded, or an error from inside torch."""
    collate = _packed(2).collator(token_budget=4 * 8)
    ep = {
        "latents": torch.zeros(frames, 48, 4, 4),
        "actions": torch.zeros(*act_shape),
        "text": torch.zeros(5, text_width),
        "episode_index": 11,
    }
    valid = frames >= 2 and act_shape == (frames, 2, 14) and text_width == 16
    if valid:
        batch = collate([ep])
        assert batch.layout("latents").steps_K == (frames,)
        return
    with pytest.raises(ValueError, match=r"^episode 11"):
        collate([ep])
