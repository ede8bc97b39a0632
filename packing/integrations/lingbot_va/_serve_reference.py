"""LeRobot's own LingBot-VA inference for one robot: the reference the served model equals.

`ReferenceRobot` drives an unmodified ``LingBotVAPolicy`` through ``predict_action_chunk``
chunk by chunk, as ``select_action`` does, with three things set from outside instead of
loaded: the prompt embeddings (``_prompt_embeds``, ``_negative_prompt_embeds``: the text
encoder's output), the latents ``_encode_frames`` returns (the VAE's output for the
observation or the buffered keyframes) and ``_executed_actions`` (what the robot executed:
LeRobot sets its own prediction there, a client may send what it really ran). The noise is
``torch.manual_seed(seed)`` right before the call, which is what `ChunkRequest.seed` draws
on an fp32 CPU policy; elsewhere LeRobot draws from that device's generator, in its dtype,
so ``host_noise=True`` (the default there) makes its two ``torch.randn`` draws the engine's:
a CPU generator seeded with ``seed``, fp32, then cast and moved
(`packing.integrations.lingbot_va._serve_request.draw_noise`): the same noise on any
device, so a served robot can be held against LeRobot's there too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor

__all__ = ["ReferenceRobot"]


class _NoVAE:
    """Stands in for the frozen modules (``_frozen`` must be non-empty, or the policy loads
    the VAE and UMT5 from the hub); `ReferenceRobot` supplies the latents itself."""

    def clear_cache(self) -> None:
        pass


class ReferenceRobot:
    """One robot's episode through LeRobot's policy (which keeps one robot's cache: make one
    policy per robot, or run robots one after another)."""

    def __init__(self, policy: Any, prompt: Tensor, negative: Tensor | None, *,
                 host_noise: bool | None = None) -> None:  # fmt: skip
        self.policy = policy
        self.device = next(policy.parameters()).device
        own = self.device.type == "cpu" and policy.dtype == torch.float32  # draw_noise's draws
        self.host_noise = not own if host_noise is None else host_noise
        policy._frozen = {"streaming_vae": _NoVAE()}
        policy.reset()
        policy._prompt_embeds = prompt[None].to(self.device, policy.dtype)
        policy._negative_prompt_embeds = (
            None if negative is None else negative[None].to(self.device, policy.dtype)
        )
        self.chunks = 0
        self._latents: Tensor | None = None
        self._seed = 0
        infer = type(policy)._infer

        def recorded(*args: Any, **kw: Any) -> Any:
            with _host_noise(self._seed) if self.host_noise else nullcontext():
                actions, latents = infer(policy, *args, **kw)
            self._latents = latents
            return actions, latents

        policy._infer = recorded

    @torch.no_grad()
    def chunk(
        self, feedback: Tensor, executed: Tensor | None, seed: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The next chunk. ``feedback``: chunk 0's conditioning frame ``(1, C, H, W)``, later
        the previous chunk's latent frames ``(F, C, H, W)`` (for chunk 1: the conditioning
        frame, then the keyframes observed during chunk 0); ``executed``: the previous
        chunk's actions ``(F, apf, action_dim)`` (None: the chunk LeRobot predicted). Returns the predicted
        latents ``(F, C, H, W)``, the model-space actions ``(F, apf, action_dim)`` and
        ``predict_action_chunk``'s own output ``(steps, n_used)``."""
        p = self.policy
        if self.chunks == 1:  # LeRobot prepends its own conditioning latent to chunk 0's
            feedback = feedback[1:]
        self._seed = seed
        clip = feedback.permute(1, 0, 2, 3)[None].to(self.device, p.dtype)  # (1, C, F, H, W)
        p._encode_frames = lambda raw: clip
        if self.chunks == 0:
            batch = {k: torch.zeros(1, 3, 1, 1) for k in p.config.obs_cam_keys}
            torch.manual_seed(seed)
            out = p.predict_action_chunk(batch)
        else:
            p._obs_buffer = [None]  # non-empty: _compute_kv_cache feeds the latents back
            if executed is not None:  # else LeRobot's own: the chunk it predicted
                p._executed_actions = executed.permute(2, 0, 1)[None, ..., None].to(
                    self.device, p.dtype
                )
            torch.manual_seed(seed)
            out = p.predict_action_chunk(None)
        self.chunks += 1
        actions = p._executed_actions[0, ..., 0].permute(1, 2, 0)  # (F, apf, A)
        assert self._latents is not None
        return self._latents[0].permute(1, 0, 2, 3).float(), actions.float(), out[0]


@contextmanager
def _host_noise(seed: int) -> Iterator[None]:
    """Within: ``torch.randn(*size, device=, dtype=)`` draws from one CPU generator seeded
    with ``seed`` (in fp32, then moved and cast): `draw_noise`'s draws, in the same order."""
    g, randn = torch.Generator().manual_seed(seed), torch.randn

    def drawn(*size: Any, device: Any = None, dtype: Any = None, **kw: Any) -> Tensor:
        return randn(*size, generator=g, **kw).to(device=device, dtype=dtype)

    torch.randn = drawn  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.randn = randn
