"""Packed inference: many requests in one model call, each at its own denoising step.

- `Request`, `Result`: one episode's next chunk (clean context frames, frames and actions to
  generate, seed, steps, optional kept context frames) and what comes back; a request that
  fails comes back alone with ``Result.error`` set, the others go on (docs/inference.md).
- `Engine`, `EngineConfig`, `PackShape`: continuous batching into a few static pack shapes,
  one model call per step, optionally captured in CUDA graphs (docs/inference.md).
- `FlowScheduler`, `reference_sample`: flow-matching Euler and a 2nd-order multistep solver
  as per-step coefficients, and the scalar loop they are tested against.
- `VideoEngine`, `VideoRequest`, `VideoShape`, `VideoModel`, `VideoPack`: the same batching
  for any model behind a one-call protocol (velocity over the pack from per-token times), e.g.
  a packed diffusers Wan (`packing.integrations.diffusers.ServedWan`).
- `verify_inference`, `InferenceReport`: the proof that each request's output packed with
  others equals the same request run alone (``packing verify --inference``).
- `PolicyServer`, `ServerConfig`: robots speak openpi's websocket protocol (msgpack with
  numpy arrays, metadata on connect, ``/healthz``, an API key off loopback) to one or more
  engines, whose continuous batcher packs every robot's requests together (docs/serving.md;
  ``packing serve``; needs ``pip install 'packing[serve]'``).
- `DiTAdapter`, `WanAdapter`: an observation dict becomes a request, a result the reply.
- `PolicyClient`, `ServerError`: a robot's side in Python (openpi-client works too).
"""

from packing.serve._adapter import DiTAdapter, WanAdapter
from packing.serve._client import PolicyClient, ServerError
from packing.serve._config import ServerConfig
from packing.serve._engine import Engine, EngineConfig
from packing.serve._pack import PackShape
from packing.serve._proof import InferenceReport, verify_inference
from packing.serve._request import Request, Result
from packing.serve._schedulers import FlowScheduler, reference_sample
from packing.serve._server import PolicyServer
from packing.serve._video import VideoEngine
from packing.serve._video_request import VideoModel, VideoPack, VideoRequest, VideoShape

__all__ = [
    "DiTAdapter",
    "Engine",
    "EngineConfig",
    "FlowScheduler",
    "InferenceReport",
    "PackShape",
    "PolicyClient",
    "PolicyServer",
    "Request",
    "Result",
    "ServerConfig",
    "ServerError",
    "VideoEngine",
    "VideoModel",
    "VideoPack",
    "VideoRequest",
    "VideoShape",
    "WanAdapter",
    "reference_sample",
    "verify_inference",
]
