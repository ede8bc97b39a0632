"""Tiny random-init diffusers models and the unpacked references the proofs compare against.

Not for training: these build in milliseconds on a CPU and reach no hub, so the tests, the
docs' examples and ``packing verify --model packing.integrations.diffusers.testing:tiny_wan_2_2``
run anywhere. A reference (`WanReference`, `LTXReference`) runs the *unmodified* model one
episode per call, with the same per-episode conditioning as the packed adapter; `reference_generate`
denoises one `packing.serve.VideoRequest` alone through the unmodified Wan.
"""

from packing.integrations.diffusers._adapter import EpisodeReference, toy_text_encoder
from packing.integrations.diffusers._ltx import LTXReference, tiny_ltx, tiny_ltx_model
from packing.integrations.diffusers._serve import reference_generate
from packing.integrations.diffusers._wan import WanReference, tiny_wan, tiny_wan_2_1, tiny_wan_2_2

__all__ = [
    "EpisodeReference",
    "LTXReference",
    "WanReference",
    "reference_generate",
    "tiny_ltx",
    "tiny_ltx_model",
    "tiny_wan",
    "tiny_wan_2_1",
    "tiny_wan_2_2",
    "toy_text_encoder",
]
