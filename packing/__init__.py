"""packing: pack whole episodes into one sequence for video-action diffusion transformers."""

from packing.layout import PackedBatch, StreamLayout

__all__ = ["PackedBatch", "StreamLayout"]
__version__ = "0.1.0"
