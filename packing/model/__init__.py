"""The reference video-action DiT: a small Wan-like model that `packing verify` trains.

- `DiT`, `DiTConfig`: the model (``DiTConfig.tiny()``, or Wan-2.2-5B widths) taking a
  `PackedBatch` and returning per-token losses.
- `tiny_reference_model`: the factory `packing verify` uses by default (``--model``).
- `text_tokens`, `pack_text`: the toy text stream the reference model cross-attends to.
- `param_count`: parameters of a config, without building it.
- `PackInputs`: what `DiT.velocity` (the inference entry point, per-token times) takes
  about a pack besides its tokens; `KVCache`: one block's view of a key/value pool, which
  `DiT.velocity(cache=...)` writes and attends over (`packing.serve`'s context cache).
"""

from packing.model._dit import (
    DiT,
    DiTConfig,
    KVCache,
    PackInputs,
    pack_text,
    param_count,
    text_tokens,
    tiny_reference_model,
)

__all__ = [
    "DiT",
    "DiTConfig",
    "KVCache",
    "PackInputs",
    "pack_text",
    "param_count",
    "text_tokens",
    "tiny_reference_model",
]
