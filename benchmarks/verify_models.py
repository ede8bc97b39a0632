"""Model factories for ``packing verify --model`` on the GPU, beyond the tiny default.

The default model's head dim (16) is one flash-attn-4 does not take, so on the H200 its
``auto`` attention is FlexAttention (Triton). ``head_dim_128`` keeps the tiny model's depth
and data but uses head dim 128, so ``auto`` picks FA4: varlen for the document mask,
``flex_flash`` for ``--mask frame-causal``::

    PYTHONPATH=. packing verify --device cuda --dtype bfloat16 \\
        --model benchmarks.verify_models:head_dim_128
"""

from __future__ import annotations

from typing import Any

from packing.model import DiT, DiTConfig


def head_dim_128(mask: str = "document", document_mask: bool = True) -> DiT:
    """The tiny reference model at width 256 with 2 heads of 128."""
    cfg = DiTConfig.tiny(
        dim=256,
        heads=2,
        ffn_dim=512,
        frame_causal=mask == "frame-causal",
        document_mask=document_mask,
    )
    return DiT(cfg)


def wan_head_dim_128(mask: str = "document", document_mask: bool = True) -> Any:
    """A 2-block diffusers Wan 2.2 TI2V (48 latent channels) at width 256, 2 heads of 128,
    packed (`packing.integrations.diffusers`); its reference is the unmodified model per
    episode. On the H200 ``auto`` runs FA4 varlen (with FA4 installed) or Flex::

        PYTHONPATH=. packing verify --device cuda --dtype bfloat16 \\
            --model benchmarks.verify_models:wan_head_dim_128
    """
    import torch

    from packing.integrations.diffusers import install
    from packing.integrations.diffusers.testing import tiny_wan, toy_text_encoder

    if mask != "document":
        raise ValueError(f"mask={mask!r}: Wan attends to whole episodes; use 'document'")
    torch.manual_seed(0)
    model = tiny_wan("2.2", attention_head_dim=128, ffn_dim=512, text_dim=64, freq_dim=64)
    return install(
        model,
        latent_hw=(8, 16),
        text_encoder=toy_text_encoder(text_dim=64),
        document_mask=document_mask,
    )
