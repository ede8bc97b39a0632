"""The diffusers velocity's inputs (issue 25): timestep shapes, TI2V's per-token timesteps,
padding rows, and an adapter used twice or after uninstall."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from einops import rearrange

from packing.data import PackedCollator
from packing.integrations.diffusers import install, per_token_timesteps
from packing.integrations.diffusers.testing import tiny_ltx_model, tiny_wan

HW = (4, 6)  # Wan: a (2, 3) grid, 6 tokens a frame; LTX: 24
FRAMES, WORDS = [2, 3], [3, 5]  # 5 real frames, padded to 6


def _pack(packed):
    g = torch.Generator().manual_seed(1)
    eps = [
        {
            "latents": torch.randn(f, packed.in_channels, *HW, generator=g),
            "text": torch.randn(w, packed.text_dim, generator=g),
            "episode_index": i,
        }
        for i, (f, w) in enumerate(zip(FRAMES, WORDS, strict=True))
    ]
    budget = 6 * packed.streams[0].tokens_per_step
    b = PackedCollator(packed.streams, token_budget=budget)(eps)
    return b.streams["latents"], b.streams["text"], b.layout("latents"), b.layout("text")


def test_per_token_timesteps_mark_each_episodes_first_frame_clean():
    packed = install(tiny_wan("2.2"), latent_hw=HW)
    _, _, lay, _ = _pack(packed)
    t_T = per_token_timesteps(torch.tensor([700.0, 300.0]), lay)
    per_frame = t_T.view(-1, 6)
    assert (per_frame == per_frame[:, :1]).all()  # one value a frame
    assert per_frame[:, 0].tolist() == [0.0, 700.0, 0.0, 300.0, 300.0, 0.0]


def test_ti2v_per_token_timesteps_equal_the_unmodified_model_with_expand_timesteps():
    torch.manual_seed(0)
    model = tiny_wan("2.2")
    packed = install(model, latent_hw=HW)
    xt, text, lay, text_lay = _pack(packed)
    t_K = torch.tensor([700.0, 300.0])
    with torch.no_grad():
        got = packed.velocity(xt, per_token_timesteps(t_K, lay), text, lay, text_lay)
        for k, (s0, f, c0, w) in enumerate([(0, 2, 0, 3), (2, 3, 3, 5)]):
            # What WanImageToVideoPipeline(expand_timesteps=True) passes the transformer:
            # first_frame_mask (0 on the first latent frame) * t, one per (2x2 patch) token.
            first_frame_mask = torch.ones(1, 1, f, *HW)
            first_frame_mask[:, :, 0] = 0
            timestep = (first_frame_mask[0][0][:, ::2, ::2] * t_K[k]).flatten()[None]
            video = rearrange(xt[s0 : s0 + f], "f c h w -> 1 c f h w")
            want = model(video, timestep, text[None, c0 : c0 + w], return_dict=False)[0]
            torch.testing.assert_close(
                got[s0 : s0 + f], rearrange(want, "1 c f h w -> f c h w"), atol=1e-5, rtol=1e-5
            )
        per_episode = packed.velocity(xt, t_K, text, lay, text_lay)
    assert (per_episode[:1] - got[:1]).abs().max() > 1e-3  # guard: the clean frame differs


def test_ltx_takes_per_token_timesteps_like_its_reference():
    torch.manual_seed(0)
    packed = install(tiny_ltx_model(), latent_hw=HW)
    ref = packed.reference()
    xt, text, lay, text_lay = _pack(packed)
    t_T = per_token_timesteps(torch.tensor([700.0, 300.0]), lay)
    with torch.no_grad():
        torch.testing.assert_close(
            packed.velocity(xt, t_T, text, lay, text_lay),
            ref.velocity(xt, t_T, text, lay, text_lay),
            atol=1e-5,
            rtol=1e-5,
        )


@pytest.mark.parametrize("shape", [(7,), (2, 1), (36, 1), ()])
def test_a_timestep_of_another_shape_is_refused(shape):
    packed = install(tiny_wan("2.2"), latent_hw=HW)
    xt, text, lay, text_lay = _pack(packed)
    with pytest.raises(ValueError, match=r"timestep has shape .*pass \(2,\), one per episode"):
        packed.velocity(xt, torch.zeros(shape), text, lay, text_lay)
    with pytest.raises(TypeError, match=r"timestep_K must be a float tensor"):
        packed.velocity(xt, torch.zeros(2, dtype=torch.long), text, lay, text_lay)


def test_velocity_is_zero_on_padding_rows():
    packed = install(tiny_wan("2.2"), latent_hw=HW)
    xt, text, lay, text_lay = _pack(packed)
    assert sum(lay.steps_K) < xt.shape[0]  # guard: the pack has a padding step
    with torch.no_grad():
        out = packed.velocity(xt, torch.tensor([700.0, 300.0]), text, lay, text_lay)
    assert (out[sum(lay.steps_K) :] == 0).all() and (out[: sum(lay.steps_K)] != 0).any()


def test_install_twice_and_use_after_uninstall_are_refused():
    model = tiny_wan("2.2")
    packed = install(model, latent_hw=HW)
    with pytest.raises(ValueError, match=r"already installed.*uninstall\(\) before installing"):
        install(model, latent_hw=HW)
    xt, text, lay, text_lay = _pack(packed)
    packed.uninstall()
    with pytest.raises(ValueError, match=r"this PackedWan was uninstalled"):
        packed.velocity(xt, torch.tensor([700.0, 300.0]), text, lay, text_lay)
    again = install(model, latent_hw=HW)  # after uninstall, a fresh adapter works
    with torch.no_grad():
        again.velocity(xt, torch.tensor([700.0, 300.0]), text, lay, text_lay)
