"""A diffusers LTX-Video trains packed: equal to the unmodified model, one episode at a time.

The packed side is `packing.integrations.diffusers.install(model)` (a `PackedLTX`, picked by
the model's class); the unpacked side is
the same weights in an untouched ``LTXVideoTransformer3DModel`` whose own ``forward`` sees one
episode per call (`LTXReference`), with its own ``encoder_attention_mask`` and
``rope_interpolation_scale``, and gradient accumulation. Tiny and random-init: no hub access.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import LTXVideoTransformer3DModel
from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor

from packing.data import PackedCollator
from packing.integrations.diffusers import (
    PackedLTX,
    drop_masked_rows,
    install,
    pack_text_embeddings,
)
from packing.integrations.diffusers._ltx import PIPELINE_ROPE_SCALE, ltx_rope
from packing.integrations.diffusers._processor import PackedAttnProcessor
from packing.integrations.diffusers.testing import tiny_ltx_model
from packing.planning import plan_packs
from packing.verify import compare_packed_unpacked

HW = (3, 4)  # latent height, width: 12 tokens a frame (LTX: one latent pixel is a token)
FRAMES = [3, 1, 5, 2, 4]  # latent frames per episode: ragged
WORDS = [7, 3, 11, 5, 2]  # real text-encoder rows per episode: each its own length
PAD_TO = 12  # the tokenizer pads every prompt to this many rows (the pipeline: 128)
BUDGET = 120  # tokens a pack: two packs of several episodes each


def episodes(padded: bool) -> list[dict[str, object]]:
    """Five episodes; ``padded``: text padded to PAD_TO rows of large garbage, mask 0 there,
    so a packed run that attended to a padded row would be far off."""
    g = torch.Generator().manual_seed(1)
    eps: list[dict[str, object]] = []
    for i, (f, w) in enumerate(zip(FRAMES, WORDS, strict=True)):
        ep: dict[str, object] = {
            "latents": torch.randn(f, 48, *HW, generator=g),
            "text": torch.randn(w, 24, generator=g),
            "episode_index": 10 + i,
        }
        if padded:
            garbage = 100 * torch.randn(PAD_TO - w, 24, generator=g)
            ep["text"] = torch.cat([ep["text"], garbage])  # type: ignore[list-item]
            ep["text_mask"] = (torch.arange(PAD_TO) < w).float()
        eps.append(ep)
    return eps


def compare(padded: bool = True, steps: int = 2, **options: object):
    torch.manual_seed(0)
    mask = {"text_mask": "text_mask"} if padded else {}
    packed = install(tiny_ltx_model(), latent_hw=HW, **mask, **options)  # type: ignore[arg-type]
    assert isinstance(packed, PackedLTX)
    packs = plan_packs([f * 12 for f in FRAMES], BUDGET).packs
    assert max(len(p) for p in packs) >= 2  # guard: a pack really holds several episodes
    return compare_packed_unpacked(
        packed,
        episodes(padded),
        collate_unpacked=PackedCollator(packed.streams),
        collate_packed=PackedCollator(packed.streams, token_budget=BUDGET),
        packs=packs,
        steps=steps,
        reference=packed.reference(),
    )


@pytest.mark.parametrize("padded", [True, False], ids=["padded-text+mask", "unpadded-text"])
def test_packed_ltx_equals_the_unmodified_model_one_episode_at_a_time(padded: bool) -> None:
    report = compare(padded)
    assert report.passed, report.format()
    assert report.leak is not None and report.leak.ok
    assert max(r.loss_rel for r in report.steps) <= 1e-6
    assert all(g.rel <= 1e-5 for g in report.grads)
    assert len(report.grads) == sum(1 for _ in tiny_ltx_model().parameters())


def test_removing_the_document_mask_fails_the_comparison() -> None:
    report = compare(steps=1, document_mask=False)
    assert not report.passed
    assert any("loss differs" in f for f in report.failures)
    assert report.leak is not None and not report.leak.ok


def test_attending_to_the_padded_text_rows_fails_the_comparison(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from packing.integrations.diffusers import _adapter as adapter

    monkeypatch.setattr(adapter, "drop_masked_rows", lambda text, layout, mask: (text, layout))
    report = compare(steps=1)
    assert not report.passed
    assert any("loss differs" in f for f in report.failures)


def test_padded_text_rows_are_never_attended() -> None:
    torch.manual_seed(0)
    packed = install(tiny_ltx_model(), latent_hw=HW, text_mask="text_mask")
    eps = episodes(padded=True)[:3]
    batch = PackedCollator(packed.streams)(eps)
    batch = replace(batch, extras={**batch.extras, "seed": 0, "step": 0})
    loss = packed(batch)["latents"]
    for ep, w in zip(eps, WORDS, strict=False):
        ep["text"][w:] = -1e4 * torch.ones(PAD_TO - w, 24)  # type: ignore[index]
    changed = PackedCollator(packed.streams)(eps)
    changed = replace(changed, extras={**changed.extras, "seed": 0, "step": 0})
    assert torch.equal(packed(changed)["latents"], loss)


def test_drop_masked_rows_keeps_each_episodes_real_rows_in_order() -> None:
    a, b = torch.arange(3.0)[:, None], 10 + torch.arange(4.0)[:, None]
    text, lay = pack_text_embeddings([a, b], pad_to_multiple=8)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 0])
    kept, kept_lay = drop_masked_rows(text, lay, mask)
    assert kept[:, 0].tolist() == [0, 1, 10, 11, 12, 0, 0, 0]
    assert kept_lay.doc_ids_T.tolist() == [0, 0, 1, 1, 1, -1, -1, -1]
    with pytest.raises(ValueError, match="episode 1 has no real row"):
        drop_masked_rows(text, lay, torch.tensor([1, 0, 0, 0, 0, 0, 0, 0]))


@pytest.mark.parametrize("scale", [PIPELINE_ROPE_SCALE, (0.4, 16.0, 16.0), None])
def test_rope_is_bit_identical_to_the_models_own_for_every_episode(scale) -> None:
    model = tiny_ltx_model()  # width 32: 5 frequencies per axis + 2 padding columns
    frames, (h, w) = [2, 7, 1, 13], (5, 6)
    lay = PackedCollator([replace(install(model, latent_hw=(h, w)).streams[0], budget=None)])(
        [{"latents": torch.zeros(n, 48, h, w), "episode_index": i} for i, n in enumerate(frames)]
    ).layout()
    assert lay.thw_T3 is not None
    cos, sin = ltx_rope(model.rope, lay.thw_T3, scale)
    start = 0
    for f in frames:
        cos_ref, sin_ref = model.rope(torch.zeros(1, f * h * w, 48), f, h, w, scale)
        n = f * h * w
        assert torch.equal(cos[start : start + n], cos_ref[0])
        assert torch.equal(sin[start : start + n], sin_ref[0])
        start += n
    assert start > frames[0] * h * w  # guard: episodes after the first were checked


def test_install_adds_no_parameter_and_uninstall_restores_the_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tiny_ltx_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, t = torch.randn(1, 2 * 12, 48), torch.tensor([500.0])
    text, mask = torch.randn(1, 5, 24), torch.tensor([[1.0, 1, 1, 0, 0]])
    kw = dict(num_frames=2, height=3, width=4, rope_interpolation_scale=PIPELINE_ROPE_SCALE)
    out_before = model(x, text, t, mask, **kw, return_dict=False)[0]
    with install(model, latent_hw=HW) as packed:
        assert list(packed.transformer.state_dict()) == list(before)
        assert all(isinstance(a.processor, PackedAttnProcessor) for a in _attentions(model))
        # The model's own forward (pipelines, inference) is untouched while installed.
        assert torch.equal(model(x, text, t, mask, **kw, return_dict=False)[0], out_before)
        model.save_pretrained(tmp_path)
    assert all(type(a.processor) is LTXVideoAttnProcessor for a in _attentions(model))
    loaded = LTXVideoTransformer3DModel.from_pretrained(tmp_path)
    assert all(torch.equal(v, before[k]) for k, v in loaded.state_dict().items())
    torch.testing.assert_close(loaded(x, text, t, mask, **kw, return_dict=False)[0], out_before)


def _attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "processor")]


def test_wrong_models_patch_sizes_and_masks_are_refused() -> None:
    with pytest.raises(TypeError, match="LTXVideoTransformer3DModel"):
        install(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="patch_size=2"):
        install(tiny_ltx_model(patch_size=2))
    packed = install(tiny_ltx_model(), latent_hw=HW, text_mask="text_mask")
    eps = episodes(padded=True)[:2]
    eps[1]["text_mask"] = eps[1]["text_mask"][:-1]  # type: ignore[index]
    batch = PackedCollator(packed.streams)(eps)
    batch = replace(batch, extras={**batch.extras, "seed": 0, "step": 0})
    with pytest.raises(ValueError, match=r"'text_mask' has \[12, 11\] rows per episode"):
        packed(batch)


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    plain = install(tiny_ltx_model(), latent_hw=HW)
    ckpt = install(tiny_ltx_model(), latent_hw=HW)
    ckpt.load_state_dict(plain.state_dict())
    ckpt.transformer.enable_gradient_checkpointing()
    batch = PackedCollator(plain.streams)(episodes(padded=False)[:3])
    batch = replace(batch, extras={**batch.extras, "seed": 0, "step": 0})
    for m in (plain, ckpt):
        m(batch)["latents"].sum().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_packing_verify_runs_the_unmodified_ltx_on_the_embedded_dataset(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from packing.cli import main

    args = ["verify", "--model", "packing.integrations.diffusers.testing:tiny_ltx", "--steps", "1"]
    args += ["--episodes", "6"]
    assert main(args) == 0
    assert "unpacked side: PackedLTX.reference()" in capsys.readouterr().out
    assert main([*args, "--no-document-mask"]) == 1
