"""The reference DiT: a pack of episodes computes what each episode computes alone.

Fixture episodes are ragged (3, 1 and 2 latent frames; 7, 1 and 4 actions; tasks of different
lengths, one empty) and carry their identity in ``episode_index``, which keys their noise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reference import rel

from packing.data import PackedBatch, PackedCollator, Stream
from packing.model._dit import (
    BOS,
    DiT,
    DiTConfig,
    pack_text,
    param_count,
    text_tokens,
    tiny_reference_model,
)

TOL = 1e-5  # fp32 on CPU; measured ~2e-7 for losses, ~1e-6 for gradients
SEED, STEP = 3, 5


def episode(index: int, frames: int, actions: int, task: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + index)
    return {
        "latents": torch.randn(frames, 48, 8, 16, generator=g).half(),
        "action": torch.randn(actions, 14, generator=g),
        "task": task,
        "episode_index": index,
    }


EPISODES = [
    episode(17, 3, 7, "pick up the red cube"),
    episode(4, 1, 1, "open"),
    episode(9, 2, 4, ""),
]


def collate(model: DiT, eps: list[dict[str, Any]], **kw: Any) -> PackedBatch:
    batch = PackedCollator(model.streams, **kw)(eps)
    batch.extras.update(seed=SEED, step=STEP)
    return batch


def doc_rows(batch: PackedBatch, stream: str, k: int) -> slice:
    cu = batch.layout(stream).cu_seqlens_K1
    return slice(int(cu[k]), int(cu[k + 1]))


def model(**overrides: Any) -> DiT:
    torch.manual_seed(0)
    return DiT(DiTConfig.tiny(**overrides))


# -- packed == one episode at a time ------------------------------------------------------------
@pytest.mark.parametrize("frame_causal", [False, True], ids=["document", "frame_causal"])
def test_packed_losses_and_gradients_equal_one_episode_at_a_time(frame_causal: bool) -> None:
    m = model(frame_causal=frame_causal)
    packed = collate(m, EPISODES)
    assert packed.num_docs == 3 and packed.layout("latents").num_tokens == 6 * 32
    out = m(packed)
    sum(v.sum() for v in out.values()).backward()  # type: ignore[union-attr]
    g_packed = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()

    for k, ep in enumerate(EPISODES):
        alone = collate(m, [ep])
        out_k = m(alone)
        sum(v.sum() for v in out_k.values()).backward()  # type: ignore[union-attr]
        for s in ("latents", "action"):
            n = alone.layout(s).num_tokens
            mine = out[s][doc_rows(packed, s, k)]
            assert mine.shape[0] == n
            assert rel(mine, out_k[s][:n]) < TOL, (k, s)
            assert out_k[s][n:].abs().max() == 0  # padding of the single-episode pack
    g_alone = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert g_packed.keys() == g_alone.keys()
    assert len(g_packed) == len(list(m.parameters()))  # every parameter gets a gradient
    for name, g in g_packed.items():
        assert g_alone[name].abs().max() > 0, name
        assert rel(g, g_alone[name]) < TOL, name


def test_per_token_conditioning_is_the_same_function_only_slower() -> None:
    # The mistake the benchmarks price (the timestep MLP on every token instead of once per
    # episode) changes the cost, not the result: same weights, same losses and gradients.
    right, slow = model(), model(conditioning="per_token")
    slow.load_state_dict(right.state_dict())
    batch = collate(right, EPISODES)
    grads = []
    for m in (right, slow):
        out = m(batch)
        sum(v.sum() for v in out.values()).backward()  # type: ignore[union-attr]
        grads.append({n: p.grad for n, p in m.named_parameters()})
        for s in out:
            assert rel(out[s], right(batch)[s]) < TOL, s
    for name, g in grads[0].items():
        assert rel(grads[1][name], g) < TOL, name


def test_losses_are_per_token_fp32_and_exactly_zero_on_padding() -> None:
    m = model()
    batch = collate(m, EPISODES)
    with torch.no_grad():
        out = m(batch)
    assert set(out) == {"latents", "action"}
    for s, loss in out.items():
        lay = batch.layout(s)
        assert loss.shape == (lay.padded_len,) and loss.dtype == torch.float32
        assert lay.padded_len > lay.num_tokens  # there is padding to check
        assert (loss[lay.num_tokens :] == 0).all()
        assert (loss[: lay.num_tokens] > 0).all()
    pred = m.predict(batch)
    assert pred["latents"].shape == (batch.layout("latents").padded_len, 48 * 4)
    assert pred["action"].shape == (batch.layout("action").padded_len, 14)


def test_the_comparison_catches_a_model_without_the_document_mask() -> None:
    m = model(document_mask=False)
    packed = collate(m, EPISODES)
    with torch.no_grad():
        out = m(packed)
        alone = m(collate(m, [EPISODES[0]]))
    n = packed.layout("latents").lengths_K[0]
    assert rel(out["latents"][:n], alone["latents"][:n]) > 1e-3


def test_frame_causal_hides_later_frames_and_the_document_mask_does_not() -> None:
    # Perturb the last latent frame of episode 0: with frame-causal attention its first two
    # frames' predictions do not move; with the document mask alone they do.
    changed = {}
    for fc in (False, True):
        m = model(frame_causal=fc)
        batch = collate(m, EPISODES)
        poked = collate(m, EPISODES)
        poked.streams["latents"][2] += 1.0  # episode 0 has frames 0, 1, 2
        with torch.no_grad():
            a, b = m.predict(batch)["latents"], m.predict(poked)["latents"]
        changed[fc] = float((a[:64] - b[:64]).abs().max())
    assert changed[True] == 0.0
    assert changed[False] > 1e-3


def test_text_stream_and_task_strings_give_the_same_model() -> None:
    m = model()
    eps = [{**ep, "text": text_tokens(ep["task"], m.config.text_len)} for ep in EPISODES]
    streams = [*m.streams, Stream("text", pad_value=0)]
    with_text = PackedCollator(streams, pad_to_multiple=64)(eps)
    with_text.extras.update(seed=SEED, step=STEP)
    with torch.no_grad():
        a = m(with_text)
        b = m(collate(m, EPISODES))
    for s in ("latents", "action"):
        n = with_text.layout(s).num_tokens
        assert n > 0
        # Rounding-level, not bitwise: the two text layouts differ in padding, and SDPA's CPU
        # kernel visits the key blocks that the opened padding rows touch (padding queries
        # attend to nothing and are opened, then zeroed), which reorders the softmax sums.
        torch.testing.assert_close(a[s][:n], b[s][:n], rtol=1e-6, atol=1e-6)


def test_noise_and_timesteps_follow_the_episode_not_the_pack() -> None:
    m = model()
    with torch.no_grad():
        fwd = m(collate(m, EPISODES))
        rev = m(collate(m, EPISODES[::-1]))
    # episode 17 is first in one pack and last in the other; its losses are the same
    n = 3 * 32
    last = collate(m, EPISODES[::-1]).layout("latents").cu_seqlens_K1[2]
    assert rel(fwd["latents"][:n], rev["latents"][int(last) : int(last) + n]) < TOL
    with torch.no_grad():
        other_step = collate(m, EPISODES)
        other_step.extras["step"] = STEP + 1
        assert rel(m(other_step)["latents"][:n], fwd["latents"][:n]) > 1e-3


def test_missing_seed_and_repeated_episodes_are_refused() -> None:
    m = model()
    batch = PackedCollator(m.streams)(EPISODES)
    with pytest.raises(KeyError, match=r"extras\['seed'\].*set batch.extras"):
        m(batch)
    with pytest.raises(ValueError, match=r"both have episode_index 17"):  # by the collator
        collate(m, [EPISODES[0], EPISODES[0]])


# -- text -----------------------------------------------------------------------------------------
def test_text_tokens_are_bytes_after_bos() -> None:
    assert text_tokens("open", 8).tolist() == [BOS, 111, 112, 101, 110]
    assert text_tokens("", 8).tolist() == [BOS]
    assert text_tokens("abcdef", 3).tolist() == [BOS, 97, 98]
    tokens, lay = pack_text(["ab", "", "c"], text_len=8, pad_to_multiple=4)
    assert tokens.tolist() == [BOS, 97, 98, BOS, BOS, 99, 0, 0]
    assert lay.doc_ids_T.tolist() == [0, 0, 0, 1, 2, 2, -1, -1]


# -- configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(dim=64, heads=5), "dim=64 is not divisible by heads=5"),
        (dict(patch=(2, 2, 2)), r"temporal patch 2 is not supported.*patch=\(1, ph, pw\)"),
        (dict(latent_hw=(7, 16)), r"latent_hw=\(7, 16\) is not divisible"),
        (dict(dim=8, heads=4), "head_dim=2 must be even and >= 6"),
        (dict(attention="flash"), "'flash' is not a backend"),
        (dict(depth=0), "depth=0 must be >= 1"),
        (dict(conditioning="per_batch"), "conditioning='per_batch'; use 'per_episode'"),
    ],
)
def test_config_is_validated(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DiTConfig.tiny(**overrides)


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = DiTConfig.tiny()
    with pytest.raises(AttributeError):
        cfg.dim = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        DiTConfig(64, 4, 2, 128)  # type: ignore[misc]
    assert cfg.grid == (4, 8) and cfg.tokens_per_frame == 32 and cfg.patch_features == 192


def test_parameter_count_is_analytic_and_matches_the_module() -> None:
    tiny = DiTConfig.tiny()
    assert param_count(tiny) == sum(p.numel() for p in DiT(tiny).parameters())
    for cfg in (DiTConfig.wan_1_3b(depth=2), DiTConfig.wan_2_2_5b(depth=2)):
        with torch.device("meta"):
            m = DiT(cfg)
        assert param_count(cfg) == sum(p.numel() for p in m.parameters())
    wan5 = DiTConfig.wan_2_2_5b()
    assert wan5.head_dim == 128 and wan5.ffn_dim == 14336 and wan5.depth == 30
    # 30 blocks at Wan-2.2-5B width: ~4.9B without Wan's T5 text projection
    assert 4.7e9 < param_count(wan5) < 5.2e9
    assert 1.2e9 < param_count(DiTConfig.wan_1_3b()) < 1.5e9


def test_verify_factory() -> None:
    assert tiny_reference_model().config == DiTConfig.tiny()
    assert tiny_reference_model(mask="frame-causal").config.frame_causal
    assert not tiny_reference_model(document_mask=False).config.document_mask
    with pytest.raises(ValueError, match="mask='causal'"):
        tiny_reference_model(mask="causal")


def test_leak_detector_finds_nothing_bit_exact_and_catches_the_broken_model() -> None:
    from packing.verify import find_leaks

    for frame_causal, gradients in ((False, True), (True, False)):
        m = model(frame_causal=frame_causal).eval()
        # atol=0: the other episodes' rows must stay bit-identical
        report = find_leaks(m.predict, collate(m, EPISODES), gradients=gradients)
        assert report.comparisons > 0
        report.raise_if_leaking()
    broken = model(document_mask=False).eval()
    assert not find_leaks(broken.predict, collate(broken, EPISODES), gradients=False).ok


def test_an_all_padding_pack_gives_zero_loss_and_zero_gradients() -> None:
    # What a data-parallel rank gets when there are fewer episodes than ranks.
    m = model()
    streams = [
        Stream("latents", grid=(4, 8), step_shape=(48, 8, 16), dtype=torch.float16),
        Stream("action", step_shape=(14,), dtype=torch.float32),
    ]
    empty = PackedCollator(streams)([])
    empty.extras.update(seed=SEED, step=STEP)
    out = m(empty)
    assert all(v.shape[0] > 0 and (v == 0).all() for v in out.values())
    sum(v.sum() for v in out.values()).backward()  # type: ignore[union-attr]
    assert all(p.grad is None or (p.grad == 0).all() for p in m.parameters())


def test_a_step_moves_host_data_to_the_device_without_blocking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On the GPU a blocking host-to-device copy is a host-device sync: the CPU waits for the
    # GPU's queue to drain, every micro-step (10 per micro-step were counted on the H200 under
    # FSDP). Every device move the model's step asks for must be non_blocking. On the CPU the
    # moves are no-ops, so the spy checks how they are asked for.
    blocking: list[str] = []
    to = torch.Tensor.to

    def spy(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # a literal "cpu" is a host read the code does on purpose (checks of CPU tensors)
        names_device = "device" in kwargs or any(
            isinstance(a, torch.device) or (isinstance(a, str) and a != "cpu") for a in args
        )
        if names_device and not kwargs.get("non_blocking", False):
            import traceback

            blocking.append(traceback.format_stack(limit=2)[0].strip())
        return to(self, *args, **kwargs)

    m = model()
    batch = collate(m, EPISODES)
    monkeypatch.setattr(torch.Tensor, "to", spy)
    out = m(batch)
    sum(v.float().sum() for v in out.values()).backward()  # type: ignore[union-attr]
    assert not blocking, "\n".join(blocking)
