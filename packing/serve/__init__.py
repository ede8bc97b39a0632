"""Packed inference: many requests in one model call, each at its own denoising step.

- `Request`, `Result`: one episode's next chunk (clean context frames, frames and actions to
  generate, seed, steps, optional kept context frames) and what comes back; a request that
  fails comes back alone with ``Result.error`` set, the others go on (docs/inference.md).
- `Engine`, `EngineConfig`, `PackShape`: continuous batching into a few static pack shapes,
  one model call per step, optionally captured in CUDA graphs (docs/inference.md).
- `ContextCache`: a frame-causal model's clean context computed once per request (and reused
  across a session's chunks) into a paged K/V pool; each step runs the generated tokens only.
- `FlowScheduler`, `reference_sample`: flow-matching Euler and a 2nd-order multistep solver
  as per-step coefficients, and the scalar loop they are tested against.
- `VideoEngine`, `VideoRequest`, `VideoShape`, `VideoModel`, `VideoPack`: the same batching
  for any model behind a one-call protocol (velocity over the pack from per-token times), e.g.
  a packed diffusers Wan (`packing.integrations.diffusers.ServedWan`).
- `verify_inference`, `InferenceReport`: the proof that each request's output packed with
  others equals the same request run alone (``packing verify --inference``).

Serving a model of your own: `packing.serve.protocol` (the engine's per-model protocol,
`Packs`, for model authors) and ``Engine.from_packs(packs)`` (docs/serving-your-model.md).
The policy server that puts robots in front of an engine is `packing.server`.
"""

from packing.serve._cache import ContextCache
from packing.serve._config import EngineConfig
from packing.serve._engine import Engine
from packing.serve._pack import PackShape
from packing.serve._proof import InferenceReport, verify_inference
from packing.serve._request import Request, Result
from packing.serve._schedulers import FlowScheduler, reference_sample
from packing.serve._video import VideoEngine
from packing.serve._video_request import VideoModel, VideoPack, VideoRequest, VideoShape

__all__ = [
    "ContextCache",
    "Engine",
    "EngineConfig",
    "FlowScheduler",
    "InferenceReport",
    "PackShape",
    "Request",
    "Result",
    "VideoEngine",
    "VideoModel",
    "VideoPack",
    "VideoRequest",
    "VideoShape",
    "reference_sample",
    "verify_inference",
]
