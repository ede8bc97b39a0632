"""A pretrained diffusers Wan trains packed: equal to the unmodified model, one episode at a time.

The packed side is `packing.integrations.diffusers.install(model)`; the unpacked side is the
same weights in an untouched ``WanTransformer3DModel`` whose own ``forward`` sees one episode
per call (`WanReference`), with gradient accumulation. Both Wan 2.1 (16 latent channels) and
Wan 2.2 TI2V (48) shapes, tiny and random-init: no hub access.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from packing.data import PackedBatch, PackedCollator
from packing.integrations.diffusers import install, pack_text_embeddings, patchify, unpatchify
from packing.integrations.diffusers._processor import PackedAttnProcessor
from packing.integrations.diffusers._wan import rope_from_table
from packing.integrations.diffusers.testing import tiny_wan
from packing.planning import plan_packs
from packing.verify import compare_packed_unpacked

HW = (4, 6)  # latent height, width -> a (2, 3) grid of 6 tokens a frame
FRAMES = [3, 1, 5, 2, 4]  # latent frames per episode: ragged
WORDS = [7, 3, 11, 5, 2]  # text-encoder tokens per episode: each its own length
BUDGET = 60  # tokens a pack: two packs of several episodes each


def episodes(channels: int, text_dim: int = 24) -> list[dict[str, object]]:
    g = torch.Generator().manual_seed(1)
    return [
        {
            "latents": torch.randn(f, channels, *HW, generator=g),
            "text": torch.randn(w, text_dim, generator=g),
            "episode_index": 10 + i,
        }
        for i, (f, w) in enumerate(zip(FRAMES, WORDS, strict=True))
    ]


def compare(style: str, steps: int = 2, **options: object):
    torch.manual_seed(0)
    packed = install(tiny_wan(style), latent_hw=HW, **options)  # type: ignore[arg-type]
    eps = episodes(packed.in_channels)
    packs = plan_packs([f * 6 for f in FRAMES], BUDGET).packs
    assert max(len(p) for p in packs) >= 2  # guard: a pack really holds several episodes
    return compare_packed_unpacked(
        packed,
        eps,
        collate_unpacked=PackedCollator(packed.streams),
        collate_packed=PackedCollator(packed.streams, token_budget=BUDGET),
        packs=packs,
        steps=steps,
        reference=packed.reference(),
    )


@pytest.mark.parametrize("style", ["2.1", "2.2"])
def test_packed_wan_equals_the_unmodified_model_one_episode_at_a_time(style: str) -> None:
    report = compare(style)
    assert report.passed, report.format()
    assert report.config == {} and report.leak is not None and report.leak.ok
    assert max(r.loss_rel for r in report.steps) <= 1e-6
    assert all(g.rel <= 1e-5 for g in report.grads)
    assert len(report.grads) == sum(1 for _ in tiny_wan(style).parameters())


def test_removing_the_document_mask_fails_the_comparison() -> None:
    report = compare("2.2", steps=1, document_mask=False)
    assert not report.passed
    assert any("loss differs" in f for f in report.failures)
    assert report.leak is not None and not report.leak.ok


def test_per_token_conditioning_is_the_same_function_only_slower() -> None:
    report = compare("2.2", steps=1, conditioning="per_token")
    assert report.passed, report.format()


def test_install_adds_no_parameter_and_uninstall_restores_the_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tiny_wan("2.1")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(1, 16, 2, *HW)
    t, text = torch.tensor([500.0]), torch.randn(1, 5, 24)
    out_before = model(x, t, text, return_dict=False)[0]
    with install(model, latent_hw=HW) as packed:
        assert list(packed.transformer.state_dict()) == list(before)
        assert all(isinstance(a.processor, PackedAttnProcessor) for a in _attentions(model))
        # The model's own forward (pipelines, inference) is untouched while installed.
        assert torch.equal(model(x, t, text, return_dict=False)[0], out_before)
        model.save_pretrained(tmp_path)
    assert all(type(a.processor) is WanAttnProcessor for a in _attentions(model))
    loaded = WanTransformer3DModel.from_pretrained(tmp_path)
    assert all(torch.equal(v, before[k]) for k, v in loaded.state_dict().items())
    # Same weights bit for bit; the output only within fp32 rounding (a reloaded tensor's
    # memory alignment can change the CPU kernels' summation order).
    torch.testing.assert_close(loaded(x, t, text, return_dict=False)[0], out_before)


def _attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "processor")]


def test_rope_rows_are_bit_identical_to_diffusers_tables() -> None:
    model = tiny_wan("2.2")
    f, (h, w) = 5, (3, 4)
    cos_ref, sin_ref = model.rope(torch.zeros(1, 48, f, 2 * h, 2 * w))  # (1, f*h*w, 1, D)
    # Two episodes of 2 and 5 frames packed: the second must get the diffusers rows of a
    # 5-frame video, the first the first rows of them.
    lay = PackedCollator([replace(install(model, latent_hw=(6, 8)).streams[0], budget=None)])(
        [{"latents": torch.zeros(n, 48, 6, 8), "episode_index": i} for i, n in enumerate([2, 5])]
    ).layout()
    split = (model.rope.t_dim, model.rope.h_dim, model.rope.w_dim)
    cos, sin = rope_from_table(model.rope.freqs_cos, model.rope.freqs_sin, split, lay.thw_T3)
    assert cos.dtype == cos_ref.dtype == model.rope.freqs_cos.dtype
    n0 = 2 * h * w
    assert torch.equal(cos[:n0], cos_ref[0, :n0]) and torch.equal(sin[:n0], sin_ref[0, :n0])
    assert torch.equal(cos[n0 : n0 + 5 * h * w], cos_ref[0]) and torch.equal(
        sin[n0:][: 5 * h * w], sin_ref[0]
    )


def test_rope_positions_past_the_table_are_refused() -> None:
    model = tiny_wan("2.2")  # rope_max_seq_len=64
    thw = torch.tensor([[64, 0, 0]])
    with pytest.raises(ValueError, match="rope_max_seq_len=64"):
        rope_from_table(model.rope.freqs_cos, model.rope.freqs_sin, (8, 4, 4), thw)


def test_patchify_is_diffusers_token_order_and_unpatchify_inverts_it() -> None:
    model = tiny_wan("2.1")
    x = torch.arange(3 * 16 * 4 * 6, dtype=torch.float32).reshape(3, 16, 4, 6)
    tokens = patchify(x, (2, 2))
    assert tokens.shape == (3 * 2 * 3, 2 * 2 * 16)
    assert torch.equal(unpatchify(tokens, (2, 2), (2, 3)), x)
    # diffusers' own un-patchify of proj_out features gives back the same video.
    b, fr, hh, ww = 1, 3, 2, 3
    ref = tokens.reshape(b, fr, hh, ww, 1, 2, 2, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    assert torch.equal(ref.flatten(6, 7).flatten(4, 5).flatten(2, 3)[0].transpose(0, 1), x)
    # and the Conv3d patch embedding reads tokens in the same (t, h, w) order.
    x = torch.randn(3, 16, 4, 6)
    tokens = patchify(x, (2, 2))
    conv = model.patch_embedding(x.transpose(0, 1)[None]).flatten(2).transpose(1, 2)[0]
    w_lin = model.patch_embedding.weight.permute(0, 2, 3, 4, 1).reshape(32, -1)  # (ph, pw, c)
    lin = tokens @ w_lin.T + model.patch_embedding.bias
    torch.testing.assert_close(conv, lin)


def test_text_embeddings_pack_with_their_own_layout() -> None:
    a, b = torch.ones(3, 4), 2 * torch.ones(6, 4)
    text, lay = pack_text_embeddings([a, b], pad_to_multiple=4)
    assert text.shape == (12, 4) and lay.lengths_K == (3, 6)
    assert lay.doc_ids_T.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, -1, -1, -1]
    assert torch.equal(text[3:9], b) and not text[9:].any()
    with pytest.raises(ValueError, match="episode 1 has shape"):
        pack_text_embeddings([a, torch.ones(0, 4)])


def test_noise_and_timestep_follow_the_episode_not_the_pack() -> None:
    torch.manual_seed(0)
    packed = install(tiny_wan("2.2"), latent_hw=HW)
    eps = episodes(48)
    one = PackedCollator(packed.streams)([eps[2]])
    two = PackedCollator(packed.streams)([eps[0], eps[2]])
    keys = {"seed": 3, "step": 1}
    a = packed.flow_inputs(replace(one, extras={**one.extras, **keys}))
    b = packed.flow_inputs(replace(two, extras={**two.extras, **keys}))
    assert torch.equal(a["t_K"][0], b["t_K"][1])
    assert torch.equal(a["xt"][:5], b["xt"][3:8])


def test_missing_text_and_wrong_models_are_refused() -> None:
    torch.manual_seed(0)
    packed = install(tiny_wan("2.2"), latent_hw=HW)
    batch: PackedBatch = PackedCollator(packed.streams[:1])(
        [{"latents": torch.randn(2, 48, *HW), "episode_index": 0}]
    )
    batch = replace(batch, extras={**batch.extras, "seed": 0, "step": 0})
    with pytest.raises(KeyError, match="no 'text' stream"):
        packed(batch)
    with pytest.raises(TypeError, match="WanTransformer3DModel"):
        install(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="temporal patch"):
        install(tiny_wan("2.2", patch_size=(2, 2, 2)))
    with pytest.raises(ValueError, match="latent_hw"):
        _ = install(tiny_wan("2.2")).streams
    with pytest.raises(ValueError, match="Wan takes no encoder attention mask"):
        install(tiny_wan("2.2"), text_mask="text_mask")


def reference_of(packed: torch.nn.Module) -> torch.nn.Module:
    """A ``--reference`` factory: the unmodified model of a packed one, one episode a call."""
    return packed.reference()  # type: ignore[operator,no-any-return]


@pytest.mark.parametrize("flags", [[], ["--reference", "test_diffusers:reference_of"]])
def test_packing_verify_runs_the_unmodified_model_on_the_embedded_dataset(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from packing.cli import main

    model = ["--model", "packing.integrations.diffusers.testing:tiny_wan_2_2"]
    args = ["verify", *model, "--steps", "1", "--episodes", "6", *flags]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "unpacked side: " + (flags[1] if flags else "PackedWan.reference()") in out
    assert main([*args, "--no-document-mask"]) == 1


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    plain = install(tiny_wan("2.1"), latent_hw=HW)
    ckpt = install(tiny_wan("2.1"), latent_hw=HW)
    ckpt.load_state_dict(plain.state_dict())
    ckpt.transformer.enable_gradient_checkpointing()
    assert ckpt.transformer.gradient_checkpointing  # the packed loop reads this flag
    batch = PackedCollator(plain.streams)(episodes(16)[:3])
    batch = replace(batch, extras={**batch.extras, "seed": 0, "step": 0})
    for m in (plain, ckpt):
        m(batch)["latents"].sum().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
