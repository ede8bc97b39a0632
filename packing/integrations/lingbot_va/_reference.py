"""The unpacked side of the proof: LeRobot's own ``training_loss_from_streams``, one episode
a call, after ``torch.manual_seed`` of the episode's seed (its draws, its ``forward_train``,
its ``FlexAttnFunc`` masks, its ``_flow_matching_loss``).

On a CPU in fp32 two of LeRobot's choices cannot run as they are, and `lerobot_in_fp32`
changes only those, for the duration of the call:

- ``FlexAttnFunc`` casts q/k/v to bf16 and builds its mask with a compiled
  ``create_block_mask``; FlexAttention has no CPU backward. Its own mask_mods
  (``_get_mask_mod``, ``_get_cross_mask_mod``, built by its own ``init_mask``) are evaluated
  densely instead, and attention runs as SDPA in the inputs' dtype (fully masked rows read 0,
  as FlexAttention returns).
- ``forward_train`` rounds its four input copies to bf16 and feeds them to the embedders,
  which torch refuses for fp32 weights; the rounded values are cast to the weights' dtype
  (the packed side rounds the same way).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from packing._lazy import require
from packing.data import PackedBatch
from packing.integrations.lingbot_va._draws import lingbot_seed
from packing.train import batch_rng_keys

__all__ = ["LeRobotReference", "lerobot_in_fp32"]


class LeRobotReference(nn.Module):
    """``forward(batch of one episode) -> {"latents": loss.expand(T_lat)}``: LeRobot's scalar
    loss on every latent token, which `packing.train.LossNormalizer` reduces back to it
    ("episode": the episode's loss; "frame": its loss weighted by its frames)."""

    def __init__(self, packed: Any) -> None:
        super().__init__()
        policy = packed._policy[0] if packed._policy else None
        if policy is None:
            raise ValueError(
                "reference() runs LeRobot's LingBotVAPolicy.training_loss_from_streams, so it "
                "needs the policy: install(policy, ...) rather than install(policy.transformer)"
            )
        utils = require("lerobot.policies.lingbot_va.utils", extra="lingbot")
        packed.uninstall()
        try:
            copied = copy.deepcopy(policy)
        finally:
            packed._reinstall()
        self.transformer = copied.transformer  # the same names as the packed module's
        self._policy = (copied,)
        self._flex = utils.FlexAttnFunc
        self.used = tuple(packed.used_channels)
        self.apf = packed.action_per_frame

    def forward(self, batch: PackedBatch) -> dict[str, Tensor]:
        if batch.num_docs != 1:
            raise ValueError(
                f"the LeRobot reference takes one episode a call, got {batch.num_docs}"
            )
        policy = self._policy[0]
        seed, step = batch_rng_keys(batch)
        (episode,) = batch.episode_ids
        f = batch.layout("latents").steps_K[0]
        # Contiguous, as LeRobot's VAE output is: its noise is zeros_like(latents).normal_(),
        # which fills in memory order, so a permuted view would get its noise in another order.
        latents = batch["latents"][:f].permute(1, 0, 2, 3)[None].contiguous()
        act = batch["actions"][:f]  # (F, apf, n_used)
        A = int(policy.config.action_dim)
        full = act.new_zeros((f, self.apf, A))
        full[..., list(self.used)] = act
        actions = full.permute(2, 0, 1)[None, ..., None].to(latents.dtype).contiguous()
        mask = torch.zeros(A, dtype=latents.dtype, device=latents.device)
        mask[list(self.used)] = 1.0
        text = batch["text"][: batch.layout("text").lengths_K[0]][None]
        with lerobot_in_fp32(self._flex):
            torch.manual_seed(lingbot_seed(seed, step, episode))
            loss, _ = policy.training_loss_from_streams(
                latents, actions, mask.view(1, -1, 1, 1, 1).expand_as(actions), text
            )
        return {"latents": loss.expand(batch.layout("latents").padded_len)}


@contextlib.contextmanager
def lerobot_in_fp32(flex: Any) -> Iterator[None]:
    """Run LeRobot's training path in the weights' dtype on any device (module docstring)."""
    import torch._inductor.config

    utils = require("lerobot.policies.lingbot_va.utils", extra="lingbot")
    embed = utils.WanTransformer3DModel._input_embed

    def input_embed(self: Any, latents: Tensor, input_type: str = "latent") -> Tensor:
        return embed(self, latents.to(self.patch_embedding_mlp.weight.dtype), input_type)

    def dense_block_mask(mask_mod: Any, B: int, H: int, Q: int, KV: int, **_: Any) -> Tensor:
        dev = _.get("device")
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        q = torch.arange(Q, device=dev)[:, None]
        kv = torch.arange(KV, device=dev)[None, :]
        return mask_mod(zero, zero, q, kv).expand(Q, KV)

    def attention(
        self: Any, query: Tensor, key: Tensor, value: Tensor, dtype: Any = None
    ) -> Tensor:
        mask = flex.cross_attention_mask if self.is_cross else flex.attention_mask
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (H, S, D)
        has = mask.any(1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has[:, None])
        out = torch.where(has[None, :, None], out, 0.0)
        return out.transpose(0, 1)[None]

    with (
        mock.patch.object(utils.WanTransformer3DModel, "_input_embed", input_embed),
        mock.patch.object(flex, "flex_attn", object()),  # skips _ensure_compiled's compile
        mock.patch.object(flex, "compiled_create_block_mask", staticmethod(dense_block_mask)),
        mock.patch.object(flex, "forward", attention),
    ):
        yield
