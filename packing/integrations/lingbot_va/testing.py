"""Tiny random-init LingBot-VA policies built from LeRobot's own classes, for the proofs.

Nothing is downloaded: ``tiny_policy`` builds ``LingBotVAPolicy(LingBotVAConfig(...))`` with
LeRobot's code at a few thousand parameters (the VAE and text encoder are never loaded: the
packed path and the reference take latents and text embeddings; ``tiny_frozen_modules`` gives
a policy toy ones of LeRobot's own kinds, for the serving adapter's encoders). ``packing verify --model
packing.integrations.lingbot_va.testing:tiny_lingbot_va`` trains one packed against LeRobot's
own ``training_loss_from_streams``, one episode at a time (`PackedLingBotVA.reference`).

``ablation`` plants a mistake the proof must catch (tests/test_lingbot_va.py):
``"no_document_mask"`` (episodes see each other), ``"one_chunk_window"`` (the first
episode's chunk_size and window for the whole pack), ``"no_window"`` (the window ignored).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from packing._lazy import require
from packing.integrations.lingbot_va._episodes import lingbot_episodes
from packing.integrations.lingbot_va._packed import PackedLingBotVA

__all__ = [
    "ABLATIONS",
    "tiny_frozen_modules",
    "tiny_lingbot_va",
    "tiny_policy",
    "tiny_serving_policy",
    "toy_text_embeddings",
]

ABLATIONS = ("no_document_mask", "one_chunk_window", "no_window")
TEXT_ROWS = 512  # LeRobot's cross mask assumes 512 text rows (UMT5's max_sequence_length)


def tiny_policy(**overrides: Any) -> Any:
    """LeRobot's ``LingBotVAPolicy`` at toy size, fp32, ``attn_mode="flex"`` on the CPU."""
    conf = require("lerobot.policies.lingbot_va.configuration_lingbot_va", extra="lingbot")
    modeling = require("lerobot.policies.lingbot_va.modeling_lingbot_va", extra="lingbot")
    types = require("lerobot.configs.types", extra="lingbot")
    visual = types.PolicyFeature(type=types.FeatureType.VISUAL, shape=(3, 32, 32))
    options: dict[str, Any] = dict(
        num_attention_heads=2, attention_head_dim=12, in_channels=48, out_channels=48,
        action_dim=16, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, attn_mode="flex",
        dtype="float32", used_action_channel_ids=list(range(14)), action_per_frame=1,
        frame_chunk_size=2, input_features={"observation.images.image": visual}, device="cpu",
    )  # fmt: skip
    options.update(overrides)
    return modeling.LingBotVAPolicy(conf.LingBotVAConfig(**options))


def toy_text_embeddings(text_dim: int = 16, rows: int = TEXT_ROWS) -> Any:
    """A deterministic stand-in for UMT5: each task's ``(rows, text_dim)`` embedding is drawn
    from a generator seeded by the task's text."""

    def embed(task: str) -> Tensor:
        seed = int.from_bytes(hashlib.blake2b(task.encode(), digest_size=8).digest(), "little")
        g = torch.Generator().manual_seed(seed >> 1)
        return torch.randn(rows, text_dim, generator=g)

    return embed


class _VerifyLingBotVA(PackedLingBotVA):
    """`PackedLingBotVA` plus what ``packing verify`` reads: the dataset's features and how
    its episodes become LingBot-VA's."""

    dataset_keys = ("latents", "action")

    def adapt_episodes(self, episodes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        text = toy_text_embeddings(int(self.config.text_dim))
        ds = lingbot_episodes(
            [{**ep, "latents": ep["latents"].float()} for ep in episodes], text,
            action_per_frame=self.action_per_frame,
        )  # fmt: skip
        return [ds[i] for i in range(len(episodes))]


def tiny_lingbot_va(
    document_mask: bool = True, ablation: str | None = None, **overrides: Any
) -> PackedLingBotVA:
    """The ``packing verify --model`` factory: a tiny policy packed for latents of 8 x 16
    (the default dataset's), LeRobot's draw ranges. ``--no-document-mask`` must fail."""
    if ablation is not None and ablation not in ABLATIONS:
        raise ValueError(f"ablation={ablation!r}; use one of {ABLATIONS} or None")
    packed = _VerifyLingBotVA(tiny_policy(**overrides), latent_hw=(8, 16))
    packed._ablation = "no_document_mask" if not document_mask else ablation
    return packed


# serving: attn_mode "torch" (LeRobot's inference path), a short schedule and a cache window
# of two chunks, so the cache evicts within a few chunks
SERVING_TINY = dict(attn_mode="torch", frame_chunk_size=2, action_per_frame=2,
                    num_inference_steps=2, action_num_inference_steps=3, attn_window=4)  # fmt: skip


def tiny_serving_policy(**overrides: Any) -> Any:
    """`tiny_policy` for serving (``SERVING_TINY``): what ``packing verify --inference --model
    lingbot_va`` serves. On a GPU its heads are 24 wide, not 12: Inductor's FlexAttention
    refuses a head dim under 16 there (and LeRobot's RoPE needs a multiple of 6)."""
    torch.manual_seed(0)
    if torch.device(overrides.get("device", "cpu")).type != "cpu":
        overrides.setdefault("attention_head_dim", 24)
    return tiny_policy(**{**SERVING_TINY, **overrides})


def tiny_frozen_modules(policy: Any) -> Any:
    """Give ``policy`` toy frozen modules of LeRobot's own kinds, random-init and offline,
    where ``_ensure_frozen_modules`` would download the real ones: diffusers' Wan 2.2 VAE
    (48 latent channels, 16x spatial), a one-layer UMT5 encoder of the policy's ``text_dim``
    and a word-level tokenizer that appends ``</s>``, as T5's does. Returns the policy."""
    diffusers = require("diffusers", extra="lingbot")
    transformers = require("transformers", extra="lingbot")
    tokenizers = require("tokenizers", extra="lingbot")
    utils = require("lerobot.policies.lingbot_va.utils", extra="lingbot")
    words = [
        "<pad>",
        "</s>",
        "<unk>",
        *["pick", "up", "the", "cup", "put", "bowl", "on", "plate", "a", "red", "blue"],
    ]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)},
                                                           unk_token="<unk>"))  # fmt: skip
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    torch.manual_seed(1)
    vae = diffusers.AutoencoderKLWan(
        base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
        out_channels=12, patch_size=2, latents_mean=[0.1] * 48, latents_std=[2.0] * 48,
        scale_factor_spatial=16,
    ).eval()  # fmt: skip
    umt5 = transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=len(words), d_model=int(policy.config.text_dim), d_kv=8, d_ff=32,
        num_layers=1, num_heads=2)).eval()  # fmt: skip
    policy._frozen = {"vae": vae, "streaming_vae": utils.WanVAEStreamingWrapper(vae),
                      "text_encoder": umt5, "tokenizer": tokenizer}  # fmt: skip
    return policy
