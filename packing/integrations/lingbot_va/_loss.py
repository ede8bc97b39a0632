"""LingBot-VA's flow-matching loss per token, so that packing's reductions reproduce LeRobot's.

LeRobot's ``_flow_matching_loss`` (one episode of F latent frames) averages per frame, then
over frames::

    latents   frame f:  sum_{C,H,W} w_f (pred - target)^2  / (C*H*W + 1e-6)
    actions   frame f:  sum_{A,apf} w_f (pred - target)^2 m / (sum m + 1e-6)   m: used channels
    loss      mean_f latents(f) + mean_f actions(f)

Here each token carries its frame's value spread over the frame's tokens (``n`` tokens a
frame: ``n * sum_token / (denominator + 1e-6)``), so a per-frame mean of tokens gives back the
frame value exactly and `packing.train.LossNormalizer` reduces the rest:

    REDUCTIONS["episode"]  mean over each episode's frames, then over episodes: LingBot-VA's
                           trainer (batch 1 + gradient accumulation), and LeRobot at batch 1
    REDUCTIONS["frame"]    every frame of the step weighs the same: LeRobot's batch
                           ``.mean()`` over its (sample, frame) rows

Both are exact under packing, accumulation and data parallelism (one global denominator).
"""

from __future__ import annotations

from einops import rearrange
from torch import Tensor

from packing.data import PackedBatch
from packing.integrations.lingbot_va._inputs import StreamInputs

__all__ = ["REDUCTIONS", "per_token_losses"]

REDUCTIONS = {
    "episode": "LingBot-VA's trainer: one episode a micro-step + accumulation (mean of episodes)",
    "frame": "LeRobot's batch .mean(): every latent frame of the step weighs the same",
}


def per_token_losses(
    pred_lat: Tensor,
    pred_act: Tensor,
    lat: StreamInputs,
    act: StreamInputs,
    channel_mask: Tensor,
    used_channels: int,
    batch: PackedBatch,
    *,
    patch: tuple[int, ...],
) -> dict[str, Tensor]:
    """``{"latents": (T_lat,), "actions": (T_act,)}`` float32 per-token losses.

    ``pred_lat`` is ``(T_lat, prod(patch) * C)`` (the head's ``(p c)`` order), ``pred_act``
    ``(T_act, A)``; targets come from ``lat`` / ``act`` at step level.
    """
    lat_lay, act_lay = batch.layout("latents"), batch.layout("actions")
    _, ph, pw = patch
    tgt = rearrange(lat.target, "s c (h p2) (w p3) -> (s h w) (p2 p3 c)", p2=ph, p3=pw)
    n_lat = lat_lay.tokens_per_step
    w_lat = lat.weight_S.repeat_interleave(n_lat)[:, None]
    sq = (pred_lat.float() - tgt.float().detach()) ** 2 * w_lat
    elems = n_lat * tgt.shape[1]  # C*H*W of one frame
    loss_lat = sq.sum(1) * n_lat / (elems + 1e-6)

    apf = act_lay.tokens_per_step
    tgt_a = act.target.reshape(-1, act.target.shape[-1])
    m = channel_mask.float()[None]
    w_act = act.weight_S.repeat_interleave(apf)[:, None]
    sq_a = (pred_act.float() - tgt_a.float().detach()) ** 2 * w_act * m
    denom = used_channels * apf  # LeRobot's mask sum of one frame (host int: no sync)
    loss_act = sq_a.sum(1) * apf / (denom + 1e-6)
    return {"latents": loss_lat, "actions": loss_act}
