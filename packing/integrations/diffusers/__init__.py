"""Train pretrained diffusers video transformers packed: the ``diffusers`` extra (README: Install).

    from diffusers import WanTransformer3DModel
    from packing.integrations.diffusers import install

    model = WanTransformer3DModel.from_pretrained(path, subfolder="transformer")
    packed = install(model, latent_hw=(44, 80))   # processors swapped; no weight renamed
    collate = PackedCollator(packed.streams, token_budget=16 * 880)  # 880 tokens a frame
    losses = packed(batch)                         # {latents: per-token loss (T,)}

The budget is a multiple of a latent frame's tokens: (44 / 2) x (80 / 2) = 880 with Wan's 2x2
patches (16_384 is not, and the collator refuses it). ``install`` picks the family by the
model's class: the same lines pack an ``LTXVideoTransformer3DModel``.

- `install` -> a `PackedAdapter` (`PackedWan`, `PackedLTX`; `FAMILIES` lists them);
  ``packed.uninstall()`` restores the model's own processors. `FamilyParts` is what a new
  family supplies (docs/porting.md).
- `per_token_timesteps`: a ``(T,)`` timestep for ``packed.velocity`` (Wan 2.2 TI2V's clean
  first frame, the pipeline's ``expand_timesteps``).
- Streams: `patchify` / `unpatchify` (latents <-> tokens), `pack_text_embeddings` and
  `drop_masked_rows` (the text encoder's output per episode).
- `ServedWan`: a `PackedWan` served by `packing.serve.VideoEngine` (packed inference, each
  request at its own step; docs/inference.md).
- `packing.integrations.diffusers.testing`: tiny random-init models, a toy text encoder and the
  unpacked references the proofs compare against (``packing verify --model
  packing.integrations.diffusers.testing:tiny_wan_2_2``).
"""

from packing._lazy import require

require("diffusers", extra="diffusers")

from packing.integrations.diffusers._adapter import (  # noqa: E402
    FamilyParts,
    PackedAdapter,
    per_token_timesteps,
)
from packing.integrations.diffusers._families import FAMILIES, install  # noqa: E402
from packing.integrations.diffusers._ltx import PackedLTX  # noqa: E402
from packing.integrations.diffusers._serve import ServedWan  # noqa: E402
from packing.integrations.diffusers._streams import (  # noqa: E402
    drop_masked_rows,
    pack_text_embeddings,
    patchify,
    unpatchify,
)
from packing.integrations.diffusers._wan import PackedWan  # noqa: E402

__all__ = [
    "FAMILIES",
    "FamilyParts",
    "PackedAdapter",
    "PackedLTX",
    "PackedWan",
    "ServedWan",
    "drop_masked_rows",
    "install",
    "pack_text_embeddings",
    "patchify",
    "per_token_timesteps",
    "unpatchify",
]
