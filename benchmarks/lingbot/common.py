"""LeRobot's LingBot-VA for the benchmarks: its classes as they are, one set of draws per
episode, LeRobot's own training step, and a lean forward over one or K episodes.

Every arm trains the same `WanTransformer3DModel` (``lerobot.policies.lingbot_va.utils``),
weights and block code unmodified. What differs is the code around the blocks:

* ``lerobot_loss``: LeRobot's path for one episode -- its ``_add_noise_stream`` (copied, the
  random calls replaced by the episode's draws), ``transformer(input_dict, train_mode=True)``
  (``forward_train``: ``FlexAttnFunc.init_mask`` rebuilds the block masks each call, the
  timestep MLP runs on every token) and ``LingBotVAPolicy._flow_matching_loss``.
* ``lean_loss``: the same math over one episode or K episodes laid out one after another
  (the lean loop and the packed fallback): embeddings once per stream, the timestep MLP once
  per frame and gathered to tokens, the blocks called with their attention op swapped for
  one that takes a mask from `MASKS`, the loss reduced per frame, then per episode, as
  LeRobot reduces it at batch 1 with accumulation (the upstream trainer's per-episode mean).

An episode is F latent frames; its model tokens, LeRobot's order (one copy = noisy or clean)::

    [ noisy latents 32F | clean latents 32F | noisy actions 4F | clean actions 4F ]  = 72F
    a pack: [ ep 0 (72 F0) | ep 1 (72 F1) | ... | pad to the budget ]

Ids every token carries (LeRobot's ``FlexAttnFunc.init_mask``): doc (-1 pad), chunk-level
frame id (latents ``2 (f // chunk)``, actions ``2 (f // chunk) + 1``), noise id (0 noisy, 1
clean); chunk and window are per episode.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

WAN_5B = dict(patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128,
              in_channels=48, out_channels=48, action_dim=30, text_dim=4096, freq_dim=256,
              ffn_dim=14336, cross_attn_norm=True, eps=1e-6, rope_max_seq_len=1024)  # fmt: skip
TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=8,
            out_channels=8, action_dim=30, text_dim=32, freq_dim=32, ffn_dim=128,
            cross_attn_norm=True, eps=1e-6, rope_max_seq_len=1024)  # fmt: skip
LATENT_HW = (8, 16)  # 4 x 8 = 32 tokens a latent frame after 2x2 patches
TINY_HW = (4, 4)  # 4 tokens a frame
ACTIONS_PER_FRAME = 4
USED_ACTIONS = 7  # LIBERO's 7 of the 30 action channels
TEXT_LEN = 512  # LeRobot's cross mask assumes 512 UMT5 tokens a sample


def lerobot_lingbot() -> tuple[Any, Any]:
    """LeRobot's ``lingbot_va`` ``utils`` and ``modeling_lingbot_va`` modules, unmodified.

    ``import lerobot.policies`` imports every policy's config (and their packages); where
    one of those is missing (the GPU machine carries only lerobot, diffusers, draccus and a
    few small wheels) the two parent packages are registered empty and the two modules load
    from their files, as they are."""
    try:
        import lerobot.policies.lingbot_va.modeling_lingbot_va as modeling
        import lerobot.policies.lingbot_va.utils as utils

        return utils, modeling
    except ImportError:
        for k in [k for k in sys.modules if k.startswith("lerobot.policies")]:
            del sys.modules[k]
    import lerobot

    root = lerobot.__path__[0] + "/policies"
    for name, path in (
        ("lerobot.policies", root),
        ("lerobot.policies.lingbot_va", root + "/lingbot_va"),
    ):
        mod = types.ModuleType(name)
        mod.__path__ = [path]
        sys.modules[name] = mod
    import lerobot.policies.lingbot_va.modeling_lingbot_va as modeling
    import lerobot.policies.lingbot_va.utils as utils

    return utils, modeling


def build_model(cfg: dict[str, Any], blocks: int, device: torch.device, seed: int) -> Any:
    """LeRobot's transformer, ``attn_mode="flex"`` (its training mode), in bf16 as
    ``LingBotVAPolicy`` keeps it; built on ``device`` (a 5B init on the host takes minutes)."""
    utils, _ = lerobot_lingbot()
    torch.manual_seed(seed)
    with torch.device(device):
        model = utils.WanTransformer3DModel(**cfg, num_layers=blocks, attn_mode="flex")
    return model.to(torch.bfloat16)


def schedulers() -> tuple[Any, Any]:
    """LeRobot's two training schedulers (``_ensure_train_schedulers``: latent shift 5.0,
    action shift 0.05, 1000 steps, training weights)."""
    utils, _ = lerobot_lingbot()
    lat = utils.FlowMatchScheduler(shift=5.0, sigma_min=0.0, extra_one_step=True)
    act = utils.FlowMatchScheduler(shift=0.05, sigma_min=0.0, extra_one_step=True)
    lat.set_timesteps(1000, training=True)
    act.set_timesteps(1000, training=True)
    return lat, act


# -- episodes and their draws -----------------------------------------------------------------
@dataclass
class Episode:
    """One episode's data and its draws (LeRobot draws these inside ``training_loss_from_streams``;
    here they are drawn once, keyed by the episode, so every arm sees the same inputs).
    Frame-major, bf16 as the VAE and LeRobot's noise give them."""

    index: int
    step: int  # the optimizer step it trains in (its draws are keyed by seed, step, index)
    latents: Tensor  # (F, C, h, w)
    actions: Tensor  # (F, 30, 4) with the unused channels 0
    text: Tensor  # (512, text_dim)
    lat_ids: Tensor  # (F,) timestep ids
    lat_noise: Tensor  # (F, C, h, w)
    cond: bool  # the noisy-condition branch (p 0.5, latents only)
    cond_ids: Tensor  # (F,) in [500, 1000)
    cond_noise: Tensor  # (F, C, h, w)
    act_ids: Tensor  # (F,)
    act_noise: Tensor  # (F, 30, 4)
    chunk: int  # 1-4
    window: int  # 4-64

    @property
    def frames(self) -> int:
        return int(self.latents.shape[0])

    def to(self, device: torch.device) -> Episode:
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, Tensor) else v)
                 for k, v in self.__dict__.items()}  # fmt: skip
        return Episode(**moved)


def make_episode(index: int, frames: int, cfg: dict[str, Any], hw: tuple[int, int], seed: int,
                 step: int = 0, device: torch.device | None = None) -> Episode:  # fmt: skip
    """Random latents, actions and text (keyed by ``(seed, index)``) and LeRobot's draws for
    ``(seed, step, index)`` from `packing.integrations.lingbot_va.draw_episode` (the numbers
    LeRobot's ``training_loss_from_streams`` draws after ``torch.manual_seed`` of that
    episode's seed, noise on ``device`` as LeRobot draws it there), so every arm, the
    integration's included, trains on the same inputs."""
    from packing.integrations.lingbot_va import draw_episode

    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    c, a, bf = cfg["in_channels"], cfg["action_dim"], torch.bfloat16
    used = torch.zeros(a, 1)
    used[:USED_ACTIONS] = 1
    dev = device or torch.device("cpu")
    d = draw_episode(seed, step, index, latent_shape=(c, frames, *hw),
                     action_shape=(a, frames, ACTIONS_PER_FRAME, 1), device=dev, dtype=bf)  # fmt: skip
    cond = d.cond_ids is not None
    return Episode(
        index=index,
        step=step,
        latents=torch.randn(frames, c, *hw, generator=g).to(dev, bf),
        actions=(torch.randn(frames, a, ACTIONS_PER_FRAME, generator=g) * used).to(dev, bf),
        text=torch.randn(TEXT_LEN, cfg["text_dim"], generator=g).to(dev, bf),
        lat_ids=d.latent_ids,
        lat_noise=d.latent_noise.permute(1, 0, 2, 3),
        cond=cond,
        cond_ids=d.cond_ids if cond else torch.zeros(frames, dtype=torch.int64),
        cond_noise=(
            d.cond_noise.permute(1, 0, 2, 3)
            if cond
            else torch.zeros(frames, c, *hw, device=dev, dtype=bf)
        ),
        act_ids=d.action_ids,
        act_noise=d.action_noise[..., 0].permute(1, 0, 2),
        chunk=d.chunk_size,
        window=d.window_size,
    )


def action_mask(cfg: dict[str, Any], device: torch.device) -> Tensor:
    """LeRobot's ``actions_mask`` channel row: 1 on the used channels."""
    m = torch.zeros(cfg["action_dim"], device=device, dtype=torch.bfloat16)
    m[:USED_ACTIONS] = 1
    return m


# -- (a) LeRobot's own path ---------------------------------------------------------------------
def _lerobot_stream(latent: Tensor, ids: Tensor, noise: Tensor, cond_ids: Tensor | None,
                    cond_noise: Tensor | None, sched: Any, mask: Tensor | None,
                    action_mode: bool) -> dict[str, Tensor]:  # fmt: skip
    """``LingBotVAPolicy._add_noise_stream`` line by line, its random calls replaced by the
    episode's draws (``latent`` is LeRobot's ``(1, C, F, h, w)``)."""
    utils, _ = lerobot_lingbot()
    device = latent.device
    patch_f, patch_h, patch_w = (1, 1, 1) if action_mode else (1, 2, 2)
    timesteps = sched.timesteps[ids.cpu()].to(device)
    noisy_latents = sched.add_noise(latent, noise, timesteps, t_dim=2)
    targets = sched.training_target(latent, noise, timesteps)
    grid_id = utils.get_mesh_id(latent.shape[-3] // patch_f, latent.shape[-2] // patch_h,
                                latent.shape[-1] // patch_w, t=1 if action_mode else 0, f_w=1,
                                f_shift=0, action=action_mode).to(device)[None]  # fmt: skip
    if cond_ids is not None:
        cond_timesteps = sched.timesteps[cond_ids.cpu()].to(device)
        latent = sched.add_noise(latent, cond_noise, cond_timesteps, t_dim=2)
    else:
        cond_timesteps = torch.zeros_like(timesteps)
    if mask is not None:
        noisy_latents = noisy_latents * mask.float()
        targets = targets * mask.float()
        latent = latent * mask.float()
    return {"timesteps": timesteps[None], "noisy_latents": noisy_latents, "targets": targets,
            "latent": latent, "cond_timesteps": cond_timesteps[None], "grid_id": grid_id}  # fmt: skip


def lerobot_loss(model: Any, holder: Any, ep: Episode, amask: Tensor) -> Tensor:
    """One episode through LeRobot's ``training_loss_from_streams`` (batch 1) with ``ep``'s
    draws: its noising, ``forward_train`` and ``_flow_matching_loss``."""
    _, modeling = lerobot_lingbot()
    lat = ep.latents.permute(1, 0, 2, 3)[None]  # (1, C, F, h, w)
    act = ep.actions.permute(1, 0, 2)[None, ..., None]  # (1, 30, F, 4, 1)
    am = amask.view(1, -1, 1, 1, 1).expand_as(act)
    ld = _lerobot_stream(lat, ep.lat_ids, ep.lat_noise.permute(1, 0, 2, 3)[None],
                         ep.cond_ids if ep.cond else None,
                         ep.cond_noise.permute(1, 0, 2, 3)[None] if ep.cond else None,
                         holder._train_sched_latent, None, action_mode=False)  # fmt: skip
    ad = _lerobot_stream(act, ep.act_ids, ep.act_noise.permute(1, 0, 2)[None, ..., None], None,
                         None, holder._train_sched_action, am, action_mode=True)  # fmt: skip
    ld["text_emb"] = ep.text[None]
    ad["text_emb"] = ep.text[None]
    ad["actions_mask"] = am
    input_dict = {"latent_dict": ld, "action_dict": ad, "chunk_size": ep.chunk,
                  "window_size": ep.window}  # fmt: skip
    pred = model(input_dict, train_mode=True)
    latent_loss, action_loss = modeling.LingBotVAPolicy._flow_matching_loss(
        holder, input_dict, pred
    )
    return latent_loss + action_loss


def loss_holder(patch_size: tuple[int, int, int]) -> Any:
    """What ``_flow_matching_loss`` reads from its policy: the config's patch size and the two
    training schedulers (the frozen VAE and text encoder are not part of the step)."""
    lat, act = schedulers()
    return types.SimpleNamespace(config=types.SimpleNamespace(patch_size=patch_size),
                                 _train_sched_latent=lat, _train_sched_action=act)  # fmt: skip


# -- the lean forward: one or K episodes in one sequence ----------------------------------------
class _Masks:
    """The masks the swapped attention ops read: set once per step (or per episode), before
    the blocks run; under ``torch.compile`` the assignment is traced, not guarded."""

    self_mask: Any = None
    cross_mask: Any = None
    self_attend: Any = None
    cross_attend: Any = None


MASKS = _Masks()


class SelfAttention(torch.nn.Module):
    """Replaces a ``WanAttention``'s ``attn_op`` (``(1, S, H, D)`` in and out); its projections,
    norms and RoPE stay LeRobot's. The call runs outside a compiled block (a graph break, as
    LeRobot's own ``FlexAttnFunc`` runs): the masks are read from `MASKS`, never guarded on,
    and attention is its own compiled function (`flex`)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return _attend(q, k, v, cross=False)


class CrossAttention(torch.nn.Module):
    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return _attend(q, k, v, cross=True)


@torch._dynamo.disable
def _attend(q: Tensor, k: Tensor, v: Tensor, cross: bool) -> Tensor:
    fn, mask = ((MASKS.cross_attend, MASKS.cross_mask) if cross else
                (MASKS.self_attend, MASKS.self_mask))  # fmt: skip
    return fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask).transpose(1, 2)


def swap_attention(model: Any) -> None:
    """Every block's self- and cross-attention op through `MASKS` (the modules' weights and
    ``forward`` untouched)."""
    for blk in model.blocks:
        inner = getattr(blk, "_checkpoint_wrapped_module", blk)
        inner.attn1.attn_op = SelfAttention()
        inner.attn2.attn_op = CrossAttention()


def flex(q: Tensor, k: Tensor, v: Tensor, mask: Any) -> Tensor:
    """FlexAttention over ``(B, H, S, D)``; compiled when called eagerly (its fast path),
    traced as is inside a compiled block; on the CPU (no Flex backward there) `dense_flex`."""
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type != "cuda":
        return dense_flex(q, k, v, block_mask=mask)
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=mask)
    return _compiled_flex()(q, k, v, block_mask=mask)


def dense_flex(q: Tensor, k: Tensor, v: Tensor, block_mask: Any = None, **_: Any) -> Tensor:
    """FlexAttention's result from its ``mask_mod`` evaluated densely (the CPU smoke runs, where
    Flex has no backward; also stands in for LeRobot's ``FlexAttnFunc.flex_attn`` there). Rows
    with no key give 0, as Flex does, with finite gradients."""
    qi = torch.arange(q.shape[-2], device=q.device)[:, None]
    ki = torch.arange(k.shape[-2], device=q.device)[None]
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    keep = block_mask.mask_mod(zero, zero, qi, ki) if block_mask is not None else None
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if keep is None:
        return (s.softmax(-1) @ v.float()).to(q.dtype)
    live = keep.any(-1, keepdim=True)
    p = s.masked_fill(~(keep | ~live), float("-inf")).softmax(-1) * live
    return (p @ v.float()).to(q.dtype)


def _flex_call(q: Tensor, k: Tensor, v: Tensor, block_mask: Any) -> Tensor:
    # its own code object: dynamo's cache (and its recompile limit) is per code object, and
    # LeRobot's FlexAttnFunc compiles flex_attention itself
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask)


def _build_call(mod: Any, q_len: int, kv_len: int, device: torch.device) -> Any:
    # its own code object: LeRobot's compiled create_block_mask recompiles per window until
    # the limit marks create_block_mask's code to run eager, which would take this one along
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mod, 1, 1, q_len, kv_len, device=device)


_COMPILED: dict[str, Any] = {}


def _compiled_flex() -> Any:
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(_flex_call, dynamic=True)
    return _COMPILED["flex"]


def block_mask(mod: Any, q_len: int, kv_len: int, device: torch.device) -> Any:
    """A FlexAttention ``BlockMask`` of ``mod`` (compiled on a GPU, one graph for all lengths)."""
    if device.type != "cuda":
        return _build_call(mod, q_len, kv_len, device)
    if "mask" not in _COMPILED:
        _COMPILED["mask"] = torch.compile(_build_call, dynamic=True)
    return _COMPILED["mask"](mod, q_len, kv_len, device)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Any) -> Tensor:
    """SDPA's default dispatch; ``mask`` None or a boolean ``(S_q, S_kv)`` keep-mask."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@dataclass
class Layout:
    """Where K episodes' tokens sit in one sequence of ``T`` tokens (host-built, then moved).

    For episodes of F = [2, 1] frames, 1 token a latent frame and 1 action a frame (72 -> 4
    tokens a frame), T = 8 (pad 2)::

        position  0  1  2  3  4  5  6  7  8  9 10 11 | 12 ..
        copy      nl nl cl cl na na ca ca nl cl na ca | pad
        doc       0  0  0  0  0  0  0  0  1  1  1  1  | -1
    """

    T: int
    doc: Tensor  # (T,) episode, -1 pad
    fid: Tensor  # (T,) chunk-level frame id, -1 pad
    nid: Tensor  # (T,) 0 noisy, 1 clean, -1 pad
    grid: Tensor  # (1, 3, T) RoPE (f, h, w)
    lat_pos: Tensor  # (N_lat,) positions of latent tokens: per episode noisy then clean
    act_pos: Tensor  # (N_act,)
    row: Tensor  # (T,) conditioning row of each token (pad: 0)
    nl_pos: Tensor  # positions of noisy latent tokens (the latent loss)
    na_pos: Tensor  # positions of noisy action tokens (the action loss)
    window: Tensor  # (K,) window per episode
    text_doc: Tensor  # (text_slots,) episode of each text row, -1 pad


def layout(eps: list[Episode], hw: tuple[int, int], T: int | None = None,
           text_slots: int | None = None, pad_to: int = 128) -> Layout:  # fmt: skip
    """The `Layout` of ``eps`` in order: ``T`` a static budget (None: the sum rounded up to
    ``pad_to``, as LeRobot pads), ``text_slots`` the text rows (None: 512 a doc)."""
    tpf = (hw[0] // 2) * (hw[1] // 2)
    apf = ACTIONS_PER_FRAME
    n = sum(ep.frames * 2 * (tpf + apf) for ep in eps)
    T = T if T is not None else -(-n // pad_to) * pad_to
    if n > T:
        raise ValueError(f"{len(eps)} episodes hold {n} tokens > budget {T}")
    doc, fid, nid = (torch.full((T,), -1, dtype=torch.int64) for _ in range(3))
    row = torch.zeros(T, dtype=torch.int64)
    grid = torch.zeros(3, T)
    lat_pos, act_pos, nl_pos, na_pos = [], [], [], []
    pos, lat_rows, act_rows = 0, 0, 0
    n_lat_rows = sum(2 * ep.frames for ep in eps)
    for k, ep in enumerate(eps):
        f = ep.frames
        fr = torch.arange(f)
        lat_f = (fr // ep.chunk * 2).repeat_interleave(tpf)
        act_f = (fr // ep.chunk * 2 + 1).repeat_interleave(apf)
        h, w = hw[0] // 2, hw[1] // 2
        lat_grid = torch.stack([fr.repeat_interleave(tpf).float(),
                                torch.arange(h).repeat_interleave(w).repeat(f).float(),
                                torch.arange(w).repeat(h * f).float()])  # fmt: skip
        off = (torch.ones(apf).cumsum(0) / (apf + 1)).repeat(f)
        act_grid = torch.stack([fr.repeat_interleave(apf).float() + off,
                                torch.full((f * apf,), -1.0), torch.full((f * apf,), -1.0)])  # fmt: skip
        for copy in (0, 1):  # noisy, clean latents
            s = slice(pos, pos + f * tpf)
            doc[s], fid[s], nid[s], grid[:, s] = k, lat_f, copy, lat_grid
            row[s] = lat_rows + copy * f + fr.repeat_interleave(tpf)
            lat_pos.append(torch.arange(s.start, s.stop))
            (nl_pos.append(lat_pos[-1]) if copy == 0 else None)
            pos = s.stop
        for copy in (0, 1):
            s = slice(pos, pos + f * apf)
            doc[s], fid[s], nid[s], grid[:, s] = k, act_f, copy, act_grid
            row[s] = n_lat_rows + act_rows + copy * f + fr.repeat_interleave(apf)
            act_pos.append(torch.arange(s.start, s.stop))
            (na_pos.append(act_pos[-1]) if copy == 0 else None)
            pos = s.stop
        lat_rows += 2 * f
        act_rows += 2 * f
    slots = text_slots if text_slots is not None else TEXT_LEN * len(eps)
    text_doc = torch.full((slots,), -1, dtype=torch.int64)
    text_doc[: TEXT_LEN * len(eps)] = torch.arange(len(eps)).repeat_interleave(TEXT_LEN)
    return Layout(T, doc, fid, nid, grid[None], torch.cat(lat_pos), torch.cat(act_pos), row,
                  torch.cat(nl_pos), torch.cat(na_pos),
                  torch.tensor([ep.window for ep in eps]), text_doc)  # fmt: skip


def layout_to(lay: Layout, device: torch.device) -> Layout:
    return Layout(lay.T, *(getattr(lay, f).to(device, non_blocking=True)
                           for f in list(Layout.__dataclass_fields__)[1:]))  # fmt: skip


def lingbot_mask_mod(doc: Tensor, fid: Tensor, nid: Tensor, window: Tensor) -> Any:
    """LeRobot's training mask over packed ids: clean -> clean at or before its chunk, noisy ->
    clean strictly before, noisy -> noisy within the chunk; the episode's window on the
    chunk-level ids; nothing across episodes, nothing for padding. The rule is LeRobot's
    ``FlexAttnFunc._get_mask_mod`` with ``seq_ids`` = doc and the window looked up per doc."""

    def lingbot_va(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        dq, dk = doc[q], doc[kv]
        fq, fk, nq, nk = fid[q], fid[kv], nid[q], nid[kv]
        rule = (((nq == 1) & (nk == 1) & (fk <= fq)) | ((nq == 0) & (nk == 1) & (fk < fq))
                | ((nq == 0) & (nk == 0) & (fk == fq)))  # fmt: skip
        near = (fq - fk).abs() <= window[dq.clamp(min=0)]
        return (dq == dk) & (dq >= 0) & rule & near

    return lingbot_va


def text_mask_mod(doc: Tensor, text_doc: Tensor) -> Any:
    def own_text(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (doc[q] == text_doc[kv]) & (doc[q] >= 0)

    return own_text


def dense_lingbot_mask(lay: Layout) -> Tensor:
    """The ``(T, T)`` keep-mask of `lingbot_mask_mod` (the reference; SDPA's mask)."""
    q = torch.arange(lay.T, device=lay.doc.device)
    mod = lingbot_mask_mod(lay.doc, lay.fid, lay.nid, lay.window)
    return mod(None, None, q[:, None], q[None, :])


@dataclass
class StepInputs:
    """A pack's (or one episode's) model inputs on the device, noised from the draws."""

    lat_tokens: Tensor  # (N_lat, C*4) patchified latents, noisy then clean per episode
    act_tokens: Tensor  # (N_act, 30)
    lat_t: Tensor  # (R_lat,) timesteps of latent rows (per episode: F noisy, F clean)
    act_t: Tensor  # (R_act,)
    text: Tensor  # (1, text_slots, text_dim)
    lat_target: Tensor  # (N_nl, C*4)
    act_target: Tensor  # (N_na, 30)
    lat_w: Tensor  # (N_nl,) per-token loss weight (frame weight / frame size / F / K)
    act_w: Tensor  # (N_na,)
    amask: Tensor  # (30,)


def _patchify(x_FChw: Tensor) -> Tensor:
    """``(F, C, h, w)`` -> ``(F * h/2 * w/2, 4C)`` in LeRobot's order (tokens f h w; features
    c p1 p2 p3 for the input, as its ``_input_embed`` rearranges)."""
    f, c, h, w = x_FChw.shape
    x = x_FChw.reshape(f, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(f * (h // 2) * (w // 2), c * 4)


def _target_tokens(x_FChw: Tensor) -> Tensor:
    """Targets in the order ``proj_out`` predicts (features p1 p2 p3 c, ``data_seq_to_patch``)."""
    f, c, h, w = x_FChw.shape
    x = x_FChw.reshape(f, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(f * (h // 2) * (w // 2), 4 * c)


def noise_inputs(eps: list[Episode], holder: Any, amask: Tensor, text_slots: int,
                 num_docs: int | None = None) -> StepInputs:  # fmt: skip
    """LeRobot's noising (``scheduler.add_noise``: ``(1 - s) x + s n`` in the data's dtype),
    every episode's frames at once, and the per-token loss weights that reproduce its loss:
    per frame ``sum / (elements + 1e-6)``, the mean over the episode's frames, then over the
    ``num_docs`` episodes of the step (the trainer's accumulation mean)."""
    sl, sa = holder._train_sched_latent, holder._train_sched_action
    dev = eps[0].latents.device
    k = num_docs or len(eps)
    x = torch.cat([ep.latents for ep in eps])
    n = torch.cat([ep.lat_noise for ep in eps])
    ids = torch.cat([ep.lat_ids for ep in eps])
    sig = sl.sigmas[ids.cpu()].to(dev, x.dtype)[:, None, None, None]
    noisy = (1 - sig) * x + sig * n
    target = n - x
    cond_sig = torch.cat([sl.sigmas[ep.cond_ids.cpu()] if ep.cond else torch.zeros(ep.frames)
                          for ep in eps]).to(dev, x.dtype)[:, None, None, None]  # fmt: skip
    cn = torch.cat([ep.cond_noise if ep.cond else torch.zeros_like(ep.cond_noise) for ep in eps])
    clean = torch.where(cond_sig > 0, (1 - cond_sig) * x + cond_sig * cn, x)
    a = torch.cat([ep.actions for ep in eps])
    an = torch.cat([ep.act_noise for ep in eps])
    aid = torch.cat([ep.act_ids for ep in eps])
    asig = sa.sigmas[aid.cpu()].to(dev, a.dtype)[:, None, None]
    m = amask.float()[None, :, None]
    a_noisy = ((1 - asig) * a + asig * an) * m
    a_target = (an - a) * m
    a_clean = a * m
    lat_tokens, act_tokens, lt, at = [], [], [], []
    lat_w, act_w = [], []
    lw = sl.training_weight(sl.timesteps[ids.cpu()].to(dev))
    aw = sa.training_weight(sa.timesteps[aid.cpu()].to(dev))
    tpf = (x.shape[-2] // 2) * (x.shape[-1] // 2)
    feat = x.shape[1] * x.shape[2] * x.shape[3]
    start = 0
    for ep in eps:
        f = ep.frames
        s = slice(start, start + f)
        lat_tokens += [_patchify(noisy[s]), _patchify(clean[s])]
        act_tokens += [a_noisy[s].permute(0, 2, 1).reshape(f * ACTIONS_PER_FRAME, -1),
                       a_clean[s].permute(0, 2, 1).reshape(f * ACTIONS_PER_FRAME, -1)]  # fmt: skip
        t_lat = sl.timesteps[ep.lat_ids.cpu()].to(dev)
        t_cond = sl.timesteps[ep.cond_ids.cpu()].to(dev) if ep.cond else torch.zeros(f, device=dev)
        lt += [t_lat, t_cond]
        at += [sa.timesteps[ep.act_ids.cpu()].to(dev), torch.zeros(f, device=dev)]
        lat_w.append((lw[s] / (feat + 1e-6) / f / k).repeat_interleave(tpf))
        mask_count = float(amask.float().sum()) * ACTIONS_PER_FRAME
        act_w.append((aw[s] / (mask_count + 1e-6) / f / k).repeat_interleave(ACTIONS_PER_FRAME))
        start += f
    text = torch.zeros(1, text_slots, eps[0].text.shape[1], device=dev, dtype=eps[0].text.dtype)
    text[0, : TEXT_LEN * len(eps)] = torch.cat([ep.text for ep in eps])
    return StepInputs(
        torch.cat(lat_tokens), torch.cat(act_tokens), torch.cat(lt), torch.cat(at), text,
        _target_tokens(target), a_target.permute(0, 2, 1).reshape(-1, a.shape[1]),
        torch.cat(lat_w), torch.cat(act_w), amask,
    )  # fmt: skip


def conditioning(model: Any, inp: StepInputs, lay: Layout) -> tuple[Tensor, Tensor]:
    """The timestep MLPs once per frame row (LeRobot runs them on every token), gathered to
    tokens: ``temb (1, T, d)``, ``timestep_proj (1, T, 6, d)``."""
    dtype = torch.bfloat16
    te_l, tp_l = model.condition_embedder(inp.lat_t[None], dtype=dtype)
    te_a, tp_a = model.condition_embedder_action(inp.act_t[None], dtype=dtype)
    temb = torch.cat([te_l, te_a], 1)[:, lay.row]
    proj = torch.cat([tp_l, tp_a], 1)[:, lay.row].unflatten(2, (6, -1))
    return temb, proj


def lean_loss(model: Any, inp: StepInputs, lay: Layout, run_blocks: Any) -> Tensor:
    """LeRobot's ``forward_train`` math over `Layout` ``lay`` and its loss (see
    `noise_inputs`); ``run_blocks(x, text, proj, rope)`` runs the blocks (compiled,
    checkpointed: the caller's choice); the masks are in `MASKS`."""
    d = model.patch_embedding_mlp.out_features
    x = torch.zeros(1, lay.T, d, device=inp.lat_tokens.device, dtype=torch.bfloat16)
    x[0, lay.lat_pos] = model.patch_embedding_mlp(inp.lat_tokens.to(torch.bfloat16))
    x[0, lay.act_pos] = model.action_embedder(inp.act_tokens.to(torch.bfloat16))
    text = model.condition_embedder.text_embedder(inp.text)
    rope = model.rope(lay.grid)[:, :, None]
    temb, proj = conditioning(model, inp, lay)
    x = run_blocks(x, text, proj, rope)
    pos = torch.cat([lay.nl_pos, lay.na_pos])
    sst = model.scale_shift_table[None] + temb[:, pos, None]
    shift, scale = sst[:, :, 0], sst[:, :, 1]
    h = (model.norm_out(x[:, pos].float()) * (1.0 + scale) + shift).type_as(x)[0]
    n = lay.nl_pos.shape[0]
    lat = model.proj_out(h[:n]).float()
    act = model.action_proj_out(h[n:]).float()
    lat_se = (lat - inp.lat_target.float()).pow(2).sum(-1)
    act_se = ((act - inp.act_target.float()).pow(2) * inp.amask.float()).sum(-1)
    return (lat_se * inp.lat_w).sum() + (act_se * inp.act_w).sum()


class LeanLoss(torch.nn.Module):
    """`lean_loss` as a module's ``forward``: the root FSDP2 unit (its hooks gather the
    parameters outside the blocks before the embedders and heads run)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    @property
    def blocks(self) -> Any:
        return self.model.blocks

    def forward(self, inp: StepInputs, lay: Layout, run_blocks: Any) -> Tensor:
        return lean_loss(self.model, inp, lay, run_blocks)


def blocks_runner(model: Any, checkpointing: bool, compiled_step: Any = None) -> Any:
    """``run_blocks`` for `lean_loss`: every block through ``compiled_step(block, x, ...)``
    (None: the block itself), under non-reentrant checkpointing when asked."""
    from torch.utils.checkpoint import checkpoint

    step = compiled_step or block_step

    def run(x: Tensor, text: Tensor, proj: Tensor, rope: Tensor) -> Tensor:
        for blk in model.blocks:
            if checkpointing and torch.is_grad_enabled():
                x = checkpoint(step, blk, x, text, proj, rope, use_reentrant=False)
            else:
                x = step(blk, x, text, proj, rope)
        return x

    return run


def block_step(blk: Any, x: Tensor, text: Tensor, proj: Tensor, rope: Tensor) -> Tensor:
    """One LeRobot block, unmodified (its attention ops read the masks from `MASKS`; the
    backward's recompute runs before the next masks are set)."""
    return blk(x, text, proj, rope, update_cache=False)


def tokens_of(eps: list[Episode], hw: tuple[int, int]) -> int:
    """Model tokens (both copies of both streams) of ``eps``: 72 a frame at 8 x 16."""
    tpf = (hw[0] // 2) * (hw[1] // 2)
    return sum(ep.frames * 2 * (tpf + ACTIONS_PER_FRAME) for ep in eps)


def latent_tokens_of(eps: list[Episode], hw: tuple[int, int]) -> int:
    """Latent tokens, one copy (the notes' 4.6K-10.7K an episode)."""
    return sum(ep.frames * (hw[0] // 2) * (hw[1] // 2) for ep in eps)


def mask_pairs(ep: Episode, hw: tuple[int, int]) -> int:
    """Self-attention (q, k) pairs LeRobot's mask keeps in one episode, counted over groups of
    tokens that share (copy, stream, frame): (4F)^2 group pairs, not (72F)^2 token pairs."""
    tpf = (hw[0] // 2) * (hw[1] // 2)
    f = ep.frames
    fr = torch.arange(f)
    cid = torch.cat([fr // ep.chunk * 2] * 2 + [fr // ep.chunk * 2 + 1] * 2)
    nid = torch.cat([torch.zeros(f), torch.ones(f), torch.zeros(f), torch.ones(f)]).long()
    cnt = torch.cat([torch.full((2 * f,), tpf), torch.full((2 * f,), ACTIONS_PER_FRAME)]).double()
    fq, fk, nq, nk = cid[:, None], cid[None], nid[:, None], nid[None]
    rule = (((nq == 1) & (nk == 1) & (fk <= fq)) | ((nq == 0) & (nk == 1) & (fk < fq))
            | ((nq == 0) & (nk == 0) & (fk == fq)))  # fmt: skip
    keep = rule & ((fq - fk).abs() <= ep.window)
    return int((cnt[:, None] * cnt[None] * keep).sum().item())


def useful_shapes(eps: list[Episode], hw: tuple[int, int]) -> list[dict[str, int]]:
    """Per episode what `benchmarks.harness.flops.lingbot_flops` counts."""
    tpf = (hw[0] // 2) * (hw[1] // 2)
    return [{"frames": ep.frames, "tokens_per_frame": tpf, "pairs": mask_pairs(ep, hw)}
            for ep in eps]  # fmt: skip


def rng_state() -> Any:
    return torch.get_rng_state()


def ceil_to(n: int, m: int) -> int:
    return int(math.ceil(n / m) * m)
