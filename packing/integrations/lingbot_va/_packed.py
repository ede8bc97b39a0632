"""`PackedLingBotVA`: LeRobot's LingBot-VA transformer trains K whole episodes in one sequence.

One packed step, for the pack's K episodes (legend: `_tokens`)::

    latents (S, C, H, W), actions (S, apf, n_used), text (X, D_txt)     the collated pack
      -> per-episode draws (seed, step, episode)                         `_draws`
      -> noisy / clean copies, targets, per-frame timesteps              `_inputs`
      -> LeRobot's own embedders (_input_embed, rope, condition_embedder[_action])
      -> joint sequence [noisy lat | clean lat | noisy act | clean act] per episode
      -> LeRobot's blocks, attention through `packing.attention` with
         document & lingbot_va_mask (self) and the cross document mask (text)
      -> LeRobot's head (scale_shift_table, norm_out, proj_out, action_proj_out)
      -> per-token losses {"latents": (T_lat,), "actions": (T_act,)}   `_loss`

The transformer runs unmodified: the same parameters under the same names, its own modules
called in ``forward_train``'s order; only the attention op (`_attention`) and the layout of
the sequence differ. Like ``forward_train``, the four input copies are rounded to bfloat16
first (a no-op for a bf16 model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from packing._validate import check_choice, check_optional_int
from packing.attention import Backend, prepare_attention
from packing.data import PackedBatch, PackedCollator, Stream, StreamLayout
from packing.integrations.lingbot_va import _checks
from packing.integrations.lingbot_va._attention import (
    MaskSlot,
    restore_attention_ops,
    swap_attention_ops,
)
from packing.integrations.lingbot_va._draws import EpisodeDraws, draw_episode
from packing.integrations.lingbot_va._inputs import StreamInputs, stream_inputs
from packing.integrations.lingbot_va._loss import per_token_losses
from packing.integrations.lingbot_va._mask import lingbot_va_mask
from packing.integrations.lingbot_va._tokens import DualStreamTokens, dual_stream_tokens
from packing.train import LossNormalizer, batch_rng_keys

__all__ = ["PackedLingBotVA", "install"]


def install(policy_or_transformer: nn.Module, **options: Any) -> PackedLingBotVA:
    """Pack LeRobot's ``LingBotVAPolicy`` (or its ``WanTransformer3DModel``):
    ``packed = install(policy, latent_hw=(8, 8))``. Options: see `PackedLingBotVA`."""
    return PackedLingBotVA(policy_or_transformer, **options)


class PackedLingBotVA(nn.Module):
    """LeRobot's LingBot-VA, trained on packs of whole episodes.

    Args:
        policy_or_transformer: a ``LingBotVAPolicy`` built with ``attn_mode="flex"`` (its
            config gives the schedulers, ``action_per_frame`` and the used action channels),
            or its ``transformer`` (then ``config`` defaults to ``LingBotVAConfig()``'s values).
        latent_hw: the latent frame's ``(H, W)`` (cut into the model's patches).
        chunk_sizes, windows: inclusive ranges of the per-episode ``chunk_size`` and
            ``window_size`` draws (LeRobot's: 1-4 and 4-64).
        noisy_cond_prob: probability of the noisy-condition branch (LeRobot's: 0.5).
        backend: the attention backend (`packing.attention.prepare_attention`).

    Episodes (what the collator takes): ``latents`` ``(F, C, H, W)``, ``actions``
    ``(F, action_per_frame, n_used)`` (the used channels, in ``used_action_channel_ids``
    order), ``text`` ``(L, text_dim)``, ``episode_index``. ``forward(batch)`` returns the
    per-token losses; `loss` reduces them.
    """

    def __init__(
        self,
        policy_or_transformer: nn.Module,
        *,
        latent_hw: tuple[int, int],
        config: Any = None,
        chunk_sizes: tuple[int, int] = (1, 4),
        windows: tuple[int, int] = (4, 64),
        noisy_cond_prob: float = 0.5,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        transformer, cfg = _checks.model_and_config(policy_or_transformer, config)
        self.transformer = transformer
        # The policy (for reference()), unregistered: its only trainable part is the transformer.
        is_policy = policy_or_transformer is not transformer
        self._policy: tuple[nn.Module, ...] = (policy_or_transformer,) if is_policy else ()
        self._ablation: str | None = None  # testing.py's negative controls
        self.config = cfg
        self.latent_hw = _checks.latent_hw(latent_hw, cfg.patch_size)
        self.chunk_sizes = _checks.draw_range("chunk_sizes", chunk_sizes, 1, 64)
        self.windows = _checks.draw_range("windows", windows, 0, 1 << 20)
        self.noisy_cond_prob = _checks.probability("noisy_cond_prob", noisy_cond_prob)
        self.backend: Backend = check_choice(  # type: ignore[assignment]
            "backend", backend, ("auto", "flex", "flex_flash", "sdpa", "varlen")
        )
        self.action_per_frame = int(cfg.action_per_frame)
        self.used_channels = tuple(int(c) for c in cfg.used_action_channel_ids)
        self.schedulers = _checks.schedulers(cfg)
        ph, pw = int(cfg.patch_size[1]), int(cfg.patch_size[2])
        h, w = self.latent_hw
        self.streams = (
            Stream("latents", grid=(h // ph, w // pw), step_shape=(int(cfg.in_channels), h, w)),
            Stream(
                "actions",
                tokens_per_step=self.action_per_frame,
                step_shape=(self.action_per_frame, len(self.used_channels)),
            ),
            Stream("text", step_shape=(int(cfg.text_dim),)),
        )
        self._slot = MaskSlot()
        self._lerobot_ops = swap_attention_ops(self._blocks(), self._slot)

    @property
    def blocks(self) -> nn.ModuleList:
        """The transformer's blocks (what `packing.train.shard_model` wraps, one FSDP2 unit
        and checkpoint each); a property, so ``state_dict`` keeps LeRobot's names alone."""
        return self._blocks()

    # -- data -------------------------------------------------------------------------------
    def collator(
        self,
        token_budget: int,
        *,
        max_docs: int | None = None,
        text_budget: int | None = None,
        pin_memory: bool = False,
    ) -> _checks.CheckedCollator:
        """The ``collate_fn``: K episodes -> one `PackedBatch` of static shapes.

        ``token_budget`` counts latent tokens of one copy (a multiple of a frame's tokens,
        ``(H/ph) * (W/pw)``); the actions get the same number of frames, the text
        ``text_budget`` rows (None: padded to a multiple of 128). Episodes are checked here
        (`packing.integrations.lingbot_va._checks.episode`), naming the episode and the fix.
        """
        lat, act, txt = self.streams
        frames = _checks.budget_frames(token_budget, lat.tokens_per_step)
        check_optional_int("text_budget", text_budget, min=1, hint="text rows of a pack")
        streams = [
            Stream(lat.name, grid=lat.grid, budget=token_budget, step_shape=lat.step_shape),
            Stream(
                act.name,
                tokens_per_step=act.tokens_per_step,
                budget=frames * act.tokens_per_step,
                step_shape=act.step_shape,
            ),
            Stream(txt.name, budget=text_budget, step_shape=txt.step_shape),
        ]
        inner = PackedCollator(streams, max_docs=max_docs, pin_memory=pin_memory)
        return _checks.CheckedCollator(inner, self.config.frame_chunk_size)

    # -- the step ---------------------------------------------------------------------------
    def forward(
        self,
        batch: PackedBatch,
        reduction: str | None = None,
        *,
        micro_batches: Sequence[PackedBatch] | None = None,
    ) -> Any:
        """Per-token losses ``{"latents": (T_lat,), "actions": (T_act,)}`` of a pack (its
        ``extras`` hold ``seed`` and ``step``), as `packing verify` takes them; with a
        ``reduction``, the loss to ``backward()`` (see `loss`; through ``forward`` so a
        DDP / Accelerate wrapper sees the call)."""
        if reduction is not None:
            red = _checks.reduction(reduction)
            return self._reduce(self._losses(batch), batch, red, micro_batches)
        return self._losses(batch)

    def _losses(self, batch: PackedBatch) -> dict[str, Tensor]:
        lat_lay = batch.layout("latents")
        frames_K = list(lat_lay.steps_K)
        draws = self.draws(batch)
        x_lat, x_act = batch["latents"], self._full_actions(batch["actions"])
        sched_lat, sched_act = self.schedulers
        lat = stream_inputs(x_lat, draws, frames_K, sched_lat, action=False)
        act = stream_inputs(
            x_act, draws, frames_K, sched_act, action=True, mask=self._channel_mask(x_act)
        )
        chunks, windows = [d.chunk_size for d in draws], [d.window_size for d in draws]
        if self._ablation == "one_chunk_window":  # a planted mistake (testing.py)
            chunks, windows = chunks[:1] * len(chunks), windows[:1] * len(windows)
        tok = dual_stream_tokens(batch, chunks, windows, action_per_frame=self.action_per_frame)
        pred_lat, pred_act = self._run(batch, tok, lat, act)
        return per_token_losses(
            pred_lat, pred_act, lat, act, self._channel_mask(x_act), len(self.used_channels), batch,
            patch=tuple(self.config.patch_size),
        )  # fmt: skip

    def draws(self, batch: PackedBatch) -> list[EpisodeDraws]:
        """Each episode's draws (LeRobot's, keyed by the batch's seed, step and episode)."""
        seed, step = batch_rng_keys(batch)
        lat = batch.layout("latents")
        C, H, W = batch["latents"].shape[1:]
        A = int(self.config.action_dim)
        apf = self.action_per_frame
        dev, dtype = batch["latents"].device, batch["latents"].dtype
        return [
            draw_episode(
                seed,
                step,
                e,
                latent_shape=(C, f, H, W),
                action_shape=(A, f, apf, 1),
                device=dev,
                dtype=dtype,
                noisy_cond_prob=self.noisy_cond_prob,
                chunk_sizes=self.chunk_sizes,
                windows=self.windows,
            )
            for e, f in zip(batch.episode_ids, lat.steps_K, strict=True)
        ]

    def loss(
        self,
        batch: PackedBatch,
        reduction: str = "episode",
        *,
        micro_batches: Sequence[PackedBatch] | None = None,
    ) -> Tensor:
        """The pack's loss to ``backward()``, reduced as ``reduction`` names (`REDUCTIONS`):
        ``"episode"`` as LingBot-VA's trainer (one episode a micro-step, accumulation),
        ``"frame"`` as LeRobot's batch ``.mean()``. ``micro_batches``: every micro-batch of
        this optimizer step on this rank (fetched first); the denominator then covers them
        and every rank (one all_reduce), so accumulation and data parallelism stay exact.
        None: this pack is the whole step."""
        return self(batch, _checks.reduction(reduction), micro_batches=micro_batches)  # type: ignore[no-any-return]

    @staticmethod
    def _reduce(
        losses: dict[str, Tensor],
        batch: PackedBatch,
        red: str,
        micro_batches: Sequence[PackedBatch] | None,
    ) -> Tensor:
        group = [batch] if micro_batches is None else _checks.micro_batches(micro_batches, batch)
        total = torch.zeros((), device=batch["latents"].device)
        for stream, per_token in losses.items():
            lays = [b.layout(stream) for b in group]
            norm = LossNormalizer.for_step(lays, red, device=per_token.device)  # type: ignore[arg-type]
            total = total + norm(per_token, batch.layout(stream))
        return total

    def uninstall(self) -> nn.Module:
        """Put LeRobot's attention ops back; returns the transformer."""
        restore_attention_ops(self._blocks(), self._lerobot_ops)
        return self.transformer

    def _reinstall(self) -> None:
        self._lerobot_ops = swap_attention_ops(self._blocks(), self._slot)

    def reference(self) -> nn.Module:
        """LeRobot's own training path, one episode a call (`packing verify`'s unpacked side):
        a copy of the policy whose ``training_loss_from_streams`` runs after
        ``torch.manual_seed`` of the episode's seed."""
        from packing.integrations.lingbot_va._reference import LeRobotReference

        return LeRobotReference(self)

    # -- internals --------------------------------------------------------------------------
    @property
    def _m(self) -> Any:
        """The transformer, typed loosely: its submodules are LeRobot's."""
        return self.transformer

    def _blocks(self) -> nn.ModuleList:
        return self._m.blocks  # type: ignore[no-any-return]

    def _full_actions(self, a: Tensor) -> Tensor:
        """``(S, apf, n_used)`` -> ``(S, apf, action_dim)``, used channels scattered in place."""
        full = a.new_zeros((*a.shape[:2], int(self.config.action_dim)))
        idx = torch.as_tensor(self.used_channels, device=a.device)
        return full.index_copy(2, idx, a)

    def _channel_mask(self, x_act: Tensor) -> Tensor:
        mask = torch.zeros(int(self.config.action_dim), dtype=x_act.dtype)
        mask[list(self.used_channels)] = 1.0
        return mask.to(x_act.device, non_blocking=True)

    def _run(
        self, batch: PackedBatch, tok: DualStreamTokens, lat: StreamInputs, act: StreamInputs
    ) -> tuple[Tensor, Tensor]:
        m: Any = self.transformer
        wdtype = m.patch_embedding_mlp.weight.dtype

        def rounded(x: Tensor) -> Tensor:  # forward_train's .to(torch.bfloat16)
            return x.to(torch.bfloat16).to(wdtype)

        def lat_tokens(x: Tensor) -> Tensor:
            return m._input_embed(rounded(x).permute(1, 0, 2, 3)[None], input_type="latent")[0]

        def act_tokens(x: Tensor) -> Tensor:
            return m._input_embed(
                rounded(x).permute(2, 0, 1)[None, ..., None], input_type="action"
            )[0]

        hidden = tok.join({
            "noisy_latents": lat_tokens(lat.noisy), "clean_latents": lat_tokens(lat.clean),
            "noisy_actions": act_tokens(act.noisy), "clean_actions": act_tokens(act.clean),
        })  # fmt: skip
        text = m._input_embed(batch["text"].to(wdtype)[None], input_type="text")
        rope = m.rope(tok.grid_J3.t()[None])[:, :, None]
        temb, proj = self._time(batch, tok, lat, act, hidden.dtype)
        self._set_masks(batch, tok, hidden.dtype)
        h = hidden[None]
        # The masks stay in the slot after the loop: activation checkpointing reruns the
        # blocks' forward during the backward, after this method has returned.
        for block in m.blocks:
            h = block(h, text, proj[None], rope, update_cache=False)
        table = m.scale_shift_table[None] + temb[None, :, None, ...]
        shift, scale = rearrange(table, "b l n c -> b n l c").chunk(2, dim=1)
        shift, scale = shift.squeeze(1), scale.squeeze(1)
        h = (m.norm_out(h.float()) * (1.0 + scale) + shift).type_as(h)[0]
        pred_lat = m.proj_out(tok.take(h, "noisy_latents"))
        pred_act = m.action_proj_out(tok.take(h, "noisy_actions"))
        return pred_lat, pred_act

    def _set_masks(self, batch: PackedBatch, tok: DualStreamTokens, dtype: torch.dtype) -> None:
        """This step's self mask (document & `lingbot_va_mask`) and cross mask (document),
        shared by every block; ``_ablation`` plants testing.py's mistakes."""
        joint, text = tok.layout, batch.layout("text")
        if self._ablation == "no_document_mask":  # every real token in one document
            joint, text = _one_document(joint), _one_document(text)
        rule = lingbot_va_mask(tok, window=self._ablation != "no_window")
        kw: dict[str, Any] = dict(dtype=dtype, head_dim=self._m.attention_head_dim)
        self._slot.self_mask = prepare_attention(
            joint, None, None, self.backend, mask_mod=rule, **kw
        )
        self._slot.cross_mask = prepare_attention(joint, text, None, self.backend, **kw)

    def _time(
        self,
        batch: PackedBatch,
        tok: DualStreamTokens,
        lat: StreamInputs,
        act: StreamInputs,
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]:
        """``temb (J, D)`` and ``timestep_proj (J, 6, D)``: LeRobot's condition embedders run
        on one row per step and copy (not per token: the same rows), gathered to tokens."""
        m: Any = self.transformer
        out: dict[str, tuple[Tensor, Tensor]] = {}
        for part, emb, t_S, stream in (
            ("noisy_latents", m.condition_embedder, lat.t_noisy_S, "latents"),
            ("clean_latents", m.condition_embedder, lat.t_clean_S, "latents"),
            ("noisy_actions", m.condition_embedder_action, act.t_noisy_S, "actions"),
            ("clean_actions", m.condition_embedder_action, act.t_clean_S, "actions"),
        ):
            temb, proj = emb(t_S[None], dtype=dtype)
            lay = batch.layout(stream)
            step_T = torch.arange(lay.padded_len, device=t_S.device) // lay.tokens_per_step
            out[part] = (temb[0].index_select(0, step_T), proj[0].index_select(0, step_T))
        temb = tok.join({k: v[0] for k, v in out.items()})
        proj = tok.join({k: v[1] for k, v in out.items()}).unflatten(1, (6, -1))
        return temb, proj


def _one_document(layout: StreamLayout) -> StreamLayout:
    """The layout with every real token in document 0 (the no-document-mask control)."""
    doc = layout.doc_ids_T
    n = layout.num_tokens
    return replace(
        layout, doc_ids_T=torch.where(doc >= 0, 0, -1).to(doc.dtype), lengths_K=(n,), steps_K=(n,)
    )
