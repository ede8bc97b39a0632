"""The training protocol shared by packed diffusers adapters and their unpacked references.

Both sides of `packing verify` are `FlowMatchingAdapter`s around the SAME diffusers
transformer (parameter names ``transformer.*``); they draw the same per-episode timesteps and
noise from ``(seed, step, episode_index)`` and differ only in how the velocity is computed:

    packed     PackedWan.velocity: K episodes in one call, document masks, per-episode adaLN
    reference  WanReference.velocity: the unmodified model's forward, one episode at a time

``forward(batch)`` returns the per-token flow-matching loss ``{latents: (T,)}`` (fp32, 0 on
padding, unreduced: reduce it with `packing.losses`), ``predict(batch)`` the per-token
velocity ``{latents: (T, ph*pw*C)}``. Text comes from a ``"text"`` stream of per-episode
text-encoder outputs ``(L_k, D_txt)``, or, with ``text_encoder=``, from the episodes' ``task``
strings (the encoder is called, never trained).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from packing.collate import Stream
from packing.conditioning import (
    broadcast_to_tokens,
    episode_timesteps,
    flow_matching_inputs,
    packed_noise,
    step_doc_ids,
)
from packing.integrations.diffusers.streams import pack_text_embeddings, patchify
from packing.layout import PackedBatch, StreamLayout

__all__ = ["FlowMatchingAdapter", "TextEncoder"]

TextEncoder = Callable[[Sequence[str]], Sequence[Tensor]]
TIMESTEP_SCALE = 1000.0  # diffusers' schedulers give the transformer t in [0, 1000]


class FlowMatchingAdapter(nn.Module):
    """Rectified-flow training of a diffusers video transformer on `PackedBatch` es.

    ``latent_hw`` (latent height, width) declares the streams for `PackedCollator`;
    ``timestep_shift`` is Wan's shift of the sampled t (1.0: none). Subclasses implement
    `velocity`.
    """

    patch_hw: tuple[int, int]
    transformer: Any  # the diffusers model (its attributes are typed by diffusers, not here)

    def __init__(
        self,
        transformer: nn.Module,
        *,
        latent_hw: tuple[int, int] | None = None,
        latents: str = "latents",
        text: str = "text",
        text_encoder: TextEncoder | None = None,
        timestep_shift: float = 1.0,
    ) -> None:
        super().__init__()
        self.transformer = transformer
        self.latent_hw = latent_hw
        self.latents_stream, self.text_stream = latents, text
        self.text_encoder = text_encoder
        self.timestep_shift = timestep_shift

    # -- streams and inputs ----------------------------------------------------------------
    @property
    def in_channels(self) -> int:
        return int(self.transformer.config.in_channels)

    @property
    def text_dim(self) -> int:
        return int(self.transformer.config.text_dim)

    @property
    def streams(self) -> list[Stream]:
        """Streams for `PackedCollator`: latent frames ``(C, H, W)``, then the text if it is data."""
        if self.latent_hw is None:
            raise ValueError(
                "the adapter was built without latent_hw=(H, W), so it cannot declare its "
                "latents stream; pass latent_hw (the VAE latent's height and width)"
            )
        h, w = self.latent_hw
        ph, pw = self.patch_hw
        if h % ph or w % pw:
            raise ValueError(f"latent_hw={self.latent_hw} is not divisible by the patch {ph}x{pw}")
        lat = Stream(
            self.latents_stream, grid=(h // ph, w // pw), step_shape=(self.in_channels, h, w)
        )
        if self.text_encoder is not None:
            return [lat]
        return [lat, Stream(self.text_stream, step_shape=(self.text_dim,))]

    def text_inputs(self, batch: PackedBatch, device: torch.device) -> tuple[Tensor, StreamLayout]:
        """The K episodes' text embeddings ``(T_txt, D_txt)`` and their layout."""
        if self.text_stream in batch.layouts:
            return batch.streams[self.text_stream].to(device), batch.layout(self.text_stream).to(
                device
            )
        k = batch.layout(self.latents_stream).num_docs
        if self.text_encoder is None or "task" not in batch.per_episode:
            raise KeyError(
                f"the batch has no {self.text_stream!r} stream of text-encoder outputs (L, "
                f"{self.text_dim}) per episode; add it to the episodes, or build the adapter "
                "with text_encoder= and give each episode its 'task' string"
            )
        embeddings = [e.to(device) for e in self.text_encoder(list(batch.per_episode["task"])[:k])]
        return pack_text_embeddings(embeddings)

    def flow_inputs(self, batch: PackedBatch) -> dict[str, Any]:
        """Per-episode ``t_K`` and the noised latents / velocity targets ``(S, C, H, W)``."""
        for key in ("seed", "step"):
            if key not in batch.extras:
                raise KeyError(
                    f"batch.extras[{key!r}] is missing: each episode's noise and timestep come "
                    "from (seed, step, episode_index); set batch.extras['seed'] and ['step'] "
                    "(the optimizer step)"
                )
        seed, step = int(batch.extras["seed"]), int(batch.extras["step"])
        p = next(self.transformer.parameters())
        name = self.latents_stream
        lay = batch.layout(name)
        x0 = batch.streams[name].to(p.device, p.dtype)
        t_K = episode_timesteps(
            seed, step, batch.episode_ids, shift=self.timestep_shift, device=p.device
        )
        noise = packed_noise(batch, seed=seed, step=step, stream=name, dtype=p.dtype)
        t_S = broadcast_to_tokens(t_K, step_doc_ids(lay, x0.shape[0]).to(p.device))
        xt, target = flow_matching_inputs(x0, noise.to(p.device), t_S)
        return {"t_K": t_K, "xt": xt, "target": target}

    # -- the protocol ------------------------------------------------------------------------
    def velocity(
        self,
        xt_SCHW: Tensor,
        timestep_K: Tensor,
        text_TD: Tensor,
        latent_layout: StreamLayout,
        text_layout: StreamLayout,
    ) -> Tensor:
        """The predicted velocity ``(S, C, H, W)`` of K packed episodes; ``timestep_K`` in
        diffusers' units (``1000 * t``), one per episode."""
        raise NotImplementedError

    def _run(self, batch: PackedBatch) -> tuple[Tensor, Tensor]:
        dev = next(self.transformer.parameters()).device
        inp = self.flow_inputs(batch)
        text, text_lay = self.text_inputs(batch, dev)
        lat_lay = batch.layout(self.latents_stream).to(dev)
        pred = self.velocity(inp["xt"], TIMESTEP_SCALE * inp["t_K"], text, lat_lay, text_lay)
        return pred, inp["target"]

    def predict(self, batch: PackedBatch) -> dict[str, Tensor]:
        """Per-token velocity ``{latents: (T, ph*pw*C)}``, padding rows 0."""
        pred = patchify(self._run(batch)[0], self.patch_hw)
        real = batch.layout(self.latents_stream).doc_ids_T.to(pred.device) >= 0
        return {self.latents_stream: torch.where(real[:, None], pred, 0.0)}

    def forward(self, batch: PackedBatch) -> dict[str, Tensor]:
        """Per-token flow-matching loss ``{latents: (T,)}``: mean squared error over a token's
        features, fp32, exactly 0 on padding."""
        pred, target = self._run(batch)
        err = patchify((pred.float() - target.float()).pow(2), self.patch_hw).mean(-1)
        real = batch.layout(self.latents_stream).doc_ids_T.to(err.device) >= 0
        return {self.latents_stream: torch.where(real, err, 0.0)}
