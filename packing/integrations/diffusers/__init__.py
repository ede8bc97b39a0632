"""Train pretrained diffusers video transformers packed: ``pip install 'packing[diffusers]'``.

    from diffusers import WanTransformer3DModel
    from packing.integrations.diffusers import install

    model = WanTransformer3DModel.from_pretrained(path, subfolder="transformer")
    packed = install(model, latent_hw=(44, 80))   # processors swapped; no weight renamed
    collate = PackedCollator(packed.streams, token_budget=16_384)
    losses = packed(batch)                         # {latents: per-token loss (T,)}

``install`` picks the family by the model's class: the same lines pack an
``LTXVideoTransformer3DModel``.

Modules: `streams` (patchify, text packing), `processor` (the packed attention processor),
`adapter` (what every family shares: the flow-matching protocol of the packed model and its
unpacked reference, processors in and out, masks, the block loop), and one module a family:
`wan` (Wan 2.1 / 2.2), `ltx` (LTX-Video); `families` (`install`: which adapter packs which model).
"""

from packing._lazy import require

require("diffusers", extra="diffusers")

from packing.integrations.diffusers.adapter import (  # noqa: E402
    EpisodeReference,
    FamilyParts,
    FlowMatchingAdapter,
    PackedAdapter,
    toy_text_encoder,
)
from packing.integrations.diffusers.families import FAMILIES, install  # noqa: E402
from packing.integrations.diffusers.ltx import (  # noqa: E402
    LTXReference,
    PackedLTX,
    ltx_rope,
    tiny_ltx,
    tiny_ltx_model,
)
from packing.integrations.diffusers.processor import (  # noqa: E402
    PackedAttnProcessor,
    install_processors,
    separate_qkv,
    uninstall_processors,
)
from packing.integrations.diffusers.streams import (  # noqa: E402
    drop_masked_rows,
    pack_text_embeddings,
    patchify,
    unpatchify,
)
from packing.integrations.diffusers.wan import (  # noqa: E402
    PackedWan,
    WanReference,
    rope_from_table,
    rotate,
    tiny_wan,
    tiny_wan_2_1,
    tiny_wan_2_2,
)

__all__ = [
    "FAMILIES",
    "EpisodeReference",
    "FamilyParts",
    "FlowMatchingAdapter",
    "LTXReference",
    "PackedAdapter",
    "PackedAttnProcessor",
    "PackedLTX",
    "PackedWan",
    "WanReference",
    "drop_masked_rows",
    "install",
    "install_processors",
    "ltx_rope",
    "pack_text_embeddings",
    "patchify",
    "rope_from_table",
    "rotate",
    "separate_qkv",
    "tiny_ltx",
    "tiny_ltx_model",
    "tiny_wan",
    "tiny_wan_2_1",
    "tiny_wan_2_2",
    "toy_text_encoder",
    "uninstall_processors",
    "unpatchify",
]
