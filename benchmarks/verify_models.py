"""Model factories for ``packing verify --model`` on the GPU, beyond the tiny default.

The default model's head dim (16) is one flash-attn-4 does not take, so on the H200 its
``auto`` attention is FlexAttention (Triton). ``head_dim_128`` keeps the tiny model's depth
and data but uses head dim 128, so ``auto`` picks FA4: varlen for the document mask,
``flex_flash`` for ``--mask frame-causal``::

    PYTHONPATH=. packing verify --device cuda --dtype bfloat16 \\
        --model benchmarks.verify_models:head_dim_128
"""

from __future__ import annotations

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
