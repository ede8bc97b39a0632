"""The training protocol shared by packed diffusers adapters and their unpacked references.

Both sides of `packing verify` are `FlowMatchingAdapter`s around the SAME diffusers
transformer (parameter names ``transformer.*``); they draw the same per-episode timesteps and
noise from ``(seed, step, episode_index)`` and differ only in how the velocity is computed:

    packed     PackedAdapter.velocity: K episodes in one call, document masks, per-episode adaLN
    reference  EpisodeReference.velocity: the unmodified model's forward, one episode a call

A model family (`wan`, `ltx`) subclasses the two: its packed forward over (T, D) tokens and its
blocks' step, and the one-episode call of its own ``forward``. What every family shares lives
here: streams, noise and timesteps, the loss, processors in and out, the two document masks,
gradient checkpointing, ``compile_blocks`` and ``reference()``.

``forward(batch)`` returns the per-token flow-matching loss ``{latents: (T,)}`` (fp32, 0 on
padding, unreduced: reduce it with `packing.train._losses`), ``predict(batch)`` the per-token
velocity ``{latents: (T, ph*pw*C)}``. Text comes from a ``"text"`` stream of per-episode
text-encoder outputs ``(L_k, D_txt)``, or, with ``text_encoder=``, from the episodes' ``task``
strings (the encoder is called, never trained). With ``text_mask="text_mask"`` a second stream
holds each text row's tokenizer mask (1 real, 0 padding) for models that take one (LTX).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, NamedTuple, Self

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from packing._validate import check_bool, check_int_tuple, check_real
from packing.attention import AttentionMask, Backend, prepare_attention
from packing.data import PackedBatch, Stream, StreamLayout, layout_from_lengths
from packing.integrations.diffusers._processor import (
    QKV,
    Rotate,
    install_processors,
    uninstall_processors,
)
from packing.integrations.diffusers._streams import (
    drop_masked_rows,
    pack_text_embeddings,
    patchify,
)
from packing.train import (
    batch_rng_keys,
    broadcast_to_tokens,
    episode_timesteps,
    flow_matching_inputs,
    packed_noise,
    step_doc_ids,
)

__all__ = [
    "EpisodeReference",
    "FlowMatchingAdapter",
    "PackedAdapter",
    "TextEncoder",
    "per_token_timesteps",
    "toy_text_encoder",
]

TextEncoder = Callable[[Sequence[str]], Sequence[Tensor]]
TIMESTEP_SCALE = 1000.0  # diffusers' schedulers give the transformer t in [0, 1000]


class FlowMatchingAdapter(nn.Module):
    """Rectified-flow training of a diffusers video transformer on `PackedBatch` es.

    ``latent_hw`` (latent height, width) declares the streams for `PackedCollator`;
    ``timestep_shift`` is Wan's shift of the sampled t (1.0: none). A family passes its
    ``patch_hw`` (the spatial patch a token covers) and ``text_dim`` (the text-encoder width
    its model reads); subclasses implement `velocity`.
    """

    transformer: Any  # the diffusers model (its attributes are typed by diffusers, not here)

    def __init__(
        self,
        transformer: nn.Module,
        *,
        patch_hw: tuple[int, int],
        text_dim: int,
        latent_hw: tuple[int, int] | None = None,
        latents: str = "latents",
        text: str = "text",
        text_mask: str | None = None,
        text_encoder: TextEncoder | None = None,
        timestep_shift: float = 1.0,
    ) -> None:
        super().__init__()
        if latent_hw is not None:
            latent_hw = check_int_tuple("latent_hw", latent_hw, length=2)  # type: ignore[assignment]
        for name, value in (("latents", latents), ("text", text), ("text_mask", text_mask)):
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"{name}={value!r} must be a stream name (a non-empty str)")
        if text_encoder is not None and not callable(text_encoder):
            raise TypeError(f"text_encoder={text_encoder!r} must be a function tasks -> embeddings")
        check_real("timestep_shift", timestep_shift, above=0, hint="1.0: no shift")
        self.transformer = transformer
        self.patch_hw, self.text_dim = patch_hw, text_dim
        self.latent_hw = latent_hw
        self.latents_stream, self.text_stream, self.text_mask_stream = latents, text, text_mask
        self.text_encoder = text_encoder
        self.timestep_shift = timestep_shift

    def options(self) -> dict[str, Any]:
        """The stream and flow-matching options, to build the other side with the same ones."""
        return dict(
            latent_hw=self.latent_hw,
            latents=self.latents_stream,
            text=self.text_stream,
            text_mask=self.text_mask_stream,
            text_encoder=self.text_encoder,
            timestep_shift=self.timestep_shift,
        )

    # -- streams and inputs ----------------------------------------------------------------
    @property
    def in_channels(self) -> int:
        return int(self.transformer.config.in_channels)

    @property
    def streams(self) -> list[Stream]:
        """Streams for `PackedCollator`: latent frames ``(C, H, W)``, then the text (and its
        mask) if it is data."""
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
        text = [lat, Stream(self.text_stream, step_shape=(self.text_dim,))]
        if self.text_mask_stream is not None:
            text.append(Stream(self.text_mask_stream, step_shape=()))
        return text

    def text_inputs(
        self, batch: PackedBatch, device: torch.device
    ) -> tuple[Tensor, StreamLayout, Tensor | None]:
        """The K episodes' text embeddings ``(T_txt, D_txt)``, their layout and, with a
        ``text_mask`` stream, the tokenizer mask ``(T_txt,)`` (else None: every row is real)."""
        if self.text_stream in batch.layouts:
            text = batch.streams[self.text_stream].to(device)
            mask = None
            if self.text_mask_stream is not None:
                if self.text_mask_stream not in batch.streams:
                    raise KeyError(
                        f"the batch has no {self.text_mask_stream!r} stream; give each episode "
                        "its tokenizer mask (L,) next to its text, or build without text_mask="
                    )
                words, marks = (batch.layout(n) for n in (self.text_stream, self.text_mask_stream))
                if marks.lengths_K != words.lengths_K:
                    raise ValueError(
                        f"stream {self.text_mask_stream!r} has {list(marks.lengths_K)} rows per "
                        f"episode but {self.text_stream!r} has {list(words.lengths_K)}; the "
                        "mask needs one entry per text row (the tokenizer's attention_mask)"
                    )
                mask = batch.streams[self.text_mask_stream].to(device)
            return text, batch.layout(self.text_stream).to(device), mask
        k = batch.layout(self.latents_stream).num_docs
        if self.text_encoder is None or "task" not in batch.per_episode:
            raise KeyError(
                f"the batch has no {self.text_stream!r} stream of text-encoder outputs (L, "
                f"{self.text_dim}) per episode; add it to the episodes, or build the adapter "
                "with text_encoder= and give each episode its 'task' string"
            )
        embeddings = [e.to(device) for e in self.text_encoder(list(batch.per_episode["task"])[:k])]
        return (*pack_text_embeddings(embeddings), None)

    def flow_inputs(self, batch: PackedBatch) -> dict[str, Any]:
        """Per-episode ``t_K`` and the noised latents / velocity targets ``(S, C, H, W)``."""
        seed, step = batch_rng_keys(batch)
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
        text_mask_T: Tensor | None = None,
    ) -> Tensor:
        """The predicted velocity ``(S, C, H, W)`` of K packed episodes; ``timestep_K`` in
        diffusers' units (``1000 * t``), one per episode; ``text_mask_T`` the tokenizer mask
        of the text rows (None: all real)."""
        raise NotImplementedError

    def _run(self, batch: PackedBatch) -> tuple[Tensor, Tensor]:
        dev = next(self.transformer.parameters()).device
        inp = self.flow_inputs(batch)
        text, text_lay, text_mask = self.text_inputs(batch, dev)
        lat_lay = batch.layout(self.latents_stream).to(dev)
        t_K = TIMESTEP_SCALE * inp["t_K"]
        return self.velocity(inp["xt"], t_K, text, lat_lay, text_lay, text_mask), inp["target"]

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


class FamilyParts(NamedTuple):
    """What a model family hands `PackedAdapter`: the attention module class whose processors
    are swapped, its q/k/v projection helper and RoPE rotation (`processor.PackedAttnProcessor`),
    its block step ``block_forward(block, x, ...)``, and ``check(model, options) -> options``,
    which refuses what the family cannot pack and adds its ``patch_hw``/``text_dim``."""

    attention_cls: type
    qkv: QKV
    rotate: Rotate
    block_forward: Callable[..., Tensor]
    check: Callable[[Any, dict[str, Any]], dict[str, Any]]


class PackedAdapter(FlowMatchingAdapter):
    """The packed side: a loaded model, its attention processors swapped, K episodes a call.

    A family returns its `FamilyParts` from `family_parts`, sets ``model_cls`` and
    ``reference_cls`` and writes `rope_rows` and `packed_forward` (with `run_blocks`); the
    constructor, `prepare` and `velocity` are the same for every family, and a family's own
    ``__init__`` takes only its own options.
    ``attention`` is the `packing.attention._packed` backend (``auto``: FA4 varlen / Flex / SDPA);
    ``document_mask=False`` lets episodes see each other: the broken model verify must fail.
    The model is held as ``self.transformer``, unchanged but for its attention processors
    (`uninstall` puts them back); save it with ``packed.transformer.save_pretrained``.
    """

    model_cls: ClassVar[type]  # the diffusers model class this family packs
    reference_cls: ClassVar[type[FlowMatchingAdapter]]

    @classmethod
    def family_parts(cls) -> FamilyParts:
        """The family's parts (a method, so they may be defined below the class)."""
        raise NotImplementedError

    def __init__(
        self,
        transformer: nn.Module,
        *,
        attention: Backend = "auto",
        document_mask: bool = True,
        **options: Any,
    ) -> None:
        parts = self.family_parts()
        super().__init__(transformer, **parts.check(transformer, options))
        self.attention_backend = attention
        self.document_mask = document_mask
        self._block_forward = self._block_fn = parts.block_forward
        self.document_mask = check_bool("document_mask", document_mask)
        install_processors(transformer, parts.attention_cls, parts.qkv, parts.rotate)
        self.installed = True

    def uninstall(self) -> nn.Module:
        """Put the model's own attention processors back; returns the model. The adapter is
        then refused (its packed calls need the processors): ``install(model)`` again."""
        uninstall_processors(self.transformer)
        self.installed = False
        return self.transformer

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def compile_blocks(self, **compile_options: Any) -> Self:
        """``torch.compile`` the packed block step (one compiled function for every block, its
        weights graph inputs); per-step host work (`prepare`, noise, layouts) stays eager.
        Give packs static shapes (``Stream(budget=...)``, ``max_docs``) so it compiles once."""
        self._block_fn = torch.compile(self._block_forward, **compile_options)
        return self

    def reference(self) -> FlowMatchingAdapter:
        """The unpacked baseline for `packing verify`: a copy of the model, unmodified, run one
        episode at a time, with this adapter's streams and flow-matching options."""
        model = copy.deepcopy(self.transformer)
        uninstall_processors(model)
        return self.reference_cls(model, **self.options())

    def prepare(
        self, latent_layout: StreamLayout, text_layout: StreamLayout, dtype: torch.dtype
    ) -> dict[str, Any]:
        """What every block reads, built once per step outside ``torch.compile``:
        ``self_mask``, ``cross_mask`` (`masks`) and ``rope`` (the family's `rope_rows` at each
        token's doc-local (t, h, w))."""
        if latent_layout.thw_T3 is None:
            raise ValueError(
                f"stream {self.latents_stream!r} must be a grid stream (Stream(grid=...))"
            )
        self_mask, cross_mask = self.masks(latent_layout, text_layout, dtype)
        thw_T3 = latent_layout.thw_T3.to(next(self.transformer.parameters()).device)
        return {"self_mask": self_mask, "cross_mask": cross_mask, "rope": self.rope_rows(thw_T3)}

    def rope_rows(self, thw_T3: Tensor) -> Any:
        """The family's RoPE for tokens at doc-local ``(t, h, w)`` ``(T, 3)``, as its rotation
        takes it (e.g. a ``(cos, sin)`` pair)."""
        raise NotImplementedError

    def masks(
        self, latent_layout: StreamLayout, text_layout: StreamLayout, dtype: torch.dtype
    ) -> tuple[AttentionMask, AttentionMask]:
        """The self- and cross-attention masks of one step (latent doc k -> text doc k)."""
        q_lay = latent_layout if self.document_mask else _one_document(latent_layout)
        kv_lay = text_layout if self.document_mask else _one_document(text_layout)
        p = next(self.transformer.parameters())
        head_dim = int(self.transformer.config.attention_head_dim)
        kw: dict[str, Any] = dict(device=p.device, dtype=dtype, head_dim=head_dim)
        be = self.attention_backend
        return prepare_attention(q_lay, None, None, be, **kw), prepare_attention(
            q_lay, kv_lay, None, be, **kw
        )

    def velocity(
        self,
        xt_SCHW: Tensor,
        timestep_K: Tensor,
        text_TD: Tensor,
        latent_layout: StreamLayout,
        text_layout: StreamLayout,
        text_mask_T: Tensor | None = None,
    ) -> Tensor:
        """Every family's packed velocity: a padded prompt's masked rows are dropped (so the
        cross-attention mask sees real rows only), the latents cast to the model's dtype, the
        step's `prepare` built once for every block, then the family's `packed_forward`.

        ``timestep`` is ``(K,)``, one per episode, or ``(T,)``, one per latent token (T =
        ``latent_layout.padded_len``, token order (s, h, w) as `patchify`): Wan 2.2 TI2V's
        clean first frame is ``t = 0`` on the first frame's tokens, as the pipeline's
        ``expand_timesteps`` builds it (`per_token_timesteps`)::

            episodes of 2 and 1 frames, 2 tokens a frame, t = [700, 300], padded to 8
            timestep (K,)  [700, 300]
            timestep (T,)  [0, 0, 700, 700, 0, 0, 0, 0]       clean first frames, padding 0

        Any other shape is refused. Rows of padding steps are 0 in the output (a loss over
        the whole output never trains on padding)."""
        if not self.installed:
            raise ValueError(
                f"this {type(self).__name__} was uninstalled: the model's own processors are "
                "back and cannot run a packed step; install(model) again for a new adapter"
            )
        per_token = _timestep_kind(timestep_K, latent_layout) == "per_token"
        if text_mask_T is not None:
            text_TD, text_layout = drop_masked_rows(text_TD, text_layout, text_mask_T)
        x_in = xt_SCHW.to(self.transformer.dtype)
        prep = self.prepare(latent_layout, text_layout, attention_dtype(x_in))
        ids_T = latent_layout.doc_ids_T.to(x_in.device)
        out = self.packed_forward(x_in, prep, ids_T, timestep_K, text_TD, per_token)
        # Padding steps would otherwise hold the model's output on pad latents: zero them.
        real_S = torch.arange(out.shape[0], device=out.device) < sum(latent_layout.steps_K)
        return torch.where(real_S[:, None, None, None], out, 0)

    def packed_forward(
        self, x_in: Tensor, prep: dict[str, Any], ids_T: Tensor, timestep: Tensor,
        text_TD: Tensor, per_token: bool = False,
    ) -> Tensor:  # fmt: skip
        """The family's forward over packed tokens: ``x_in`` the latents ``(S, C, H, W)`` in the model's
        dtype, `prepare`'s output, each latent token's doc id, timesteps in diffusers' units
        (``(K,)``, or ``(T,)`` with ``per_token``) and the real text rows ``(T_txt, D_txt)``
        -> velocity ``(S, C, H, W)``."""
        raise NotImplementedError

    def run_blocks(self, blocks: nn.ModuleList, x: Tensor, *args: Any) -> Tensor:
        """``x = block_forward(block, x, *args)`` for every block; honours the model's
        ``enable_gradient_checkpointing()``."""
        for block in blocks:
            if torch.is_grad_enabled() and self.transformer.gradient_checkpointing:
                x = checkpoint(self._block_fn, block, x, *args, use_reentrant=False)
            else:
                x = self._block_fn(block, x, *args)
        return x


def _timestep_kind(timestep: Any, layout: StreamLayout) -> str:
    """ "per_episode" for a ``(K,)`` timestep, "per_token" for ``(T,)``; anything else refused
    (a per-token timestep read as K per-episode values ran episodes at the wrong t)."""
    if not isinstance(timestep, Tensor) or not timestep.dtype.is_floating_point:
        raise TypeError(
            f"timestep_K must be a float tensor in diffusers' units (1000 * t), got "
            f"{type(timestep).__name__}"
            + (f" of dtype {timestep.dtype}" if isinstance(timestep, Tensor) else "")
        )
    k, t = layout.num_docs, layout.padded_len
    if timestep.dim() == 1 and timestep.shape[0] == k:
        return "per_episode"
    if timestep.dim() == 1 and timestep.shape[0] == t:
        return "per_token"
    raise ValueError(
        f"timestep has shape {tuple(timestep.shape)}; pass ({k},), one per episode, or ({t},), "
        "one per latent token of the pack (packing.integrations.diffusers.per_token_timesteps)"
    )


def per_token_timesteps(
    timestep_K: Tensor, latent_layout: StreamLayout, *, clean_first_frame: bool = True
) -> Tensor:
    """Per-token timesteps ``(T,)`` of a pack from one per episode ``(K,)``.

    ``clean_first_frame``: each episode's first latent frame gets ``t = 0`` (Wan 2.2 TI2V's
    image conditioning: the pipeline's ``expand_timesteps`` multiplies ``t`` by a mask that is
    0 on the first frame), the other frames the episode's ``t``; padding tokens 0::

        steps_K [2, 1], 2 tokens a frame, t_K [700, 300], padded to 8 tokens
        ->  [0, 0, 700, 700, 0, 0, 0, 0]
    """
    check_bool("clean_first_frame", clean_first_frame)
    _timestep_kind(timestep_K, latent_layout)
    if timestep_K.shape[0] != latent_layout.num_docs:
        raise ValueError(
            f"timestep_K has {timestep_K.shape[0]} entries for {latent_layout.num_docs} episodes"
        )
    dev = timestep_K.device
    ids_T = latent_layout.doc_ids_T.to(dev)
    t_T = broadcast_to_tokens(timestep_K, ids_T)
    if not clean_first_frame:
        return t_T
    # The first frame's tokens: episode-local positions below tokens_per_step (no host sync).
    pos_T = latent_layout.position_ids_T.to(dev)
    first = (pos_T < latent_layout.tokens_per_step) & (ids_T >= 0)
    return torch.where(first, 0.0, t_T).to(timestep_K.dtype)


def _one_document(lay: StreamLayout) -> StreamLayout:
    """All real tokens as ONE document: the broken mask of ``document_mask=False``."""
    n = lay.num_tokens
    return layout_from_lengths([n] if n else [], [n] if n else [], lay.padded_len).to(
        lay.doc_ids_T.device
    )


def attention_dtype(x: Tensor) -> torch.dtype:
    """The dtype q/k/v will have: autocast's when it is on for the device."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class EpisodeReference(FlowMatchingAdapter):
    """The unpacked side: the unmodified model's ``forward``, one episode per call.

    A family implements `episode`: one episode's noised latents ``(F, C, H, W)``, timestep
    ``(1,)``, text ``(1, L, D_txt)`` and tokenizer mask ``(1, L)`` (None: all real) in, its
    velocity ``(F, C, H, W)`` out, through the model's own ``forward``.
    """

    def episode(
        self, xt_FCHW: Tensor, timestep_1: Tensor, text_1LD: Tensor, mask_1L: Tensor | None
    ) -> Tensor:
        raise NotImplementedError

    def velocity(
        self,
        xt_SCHW: Tensor,
        timestep_K: Tensor,
        text_TD: Tensor,
        latent_layout: StreamLayout,
        text_layout: StreamLayout,
        text_mask_T: Tensor | None = None,
    ) -> Tensor:
        per_token = _timestep_kind(timestep_K, latent_layout) == "per_token"
        out = torch.zeros_like(xt_SCHW)
        tps = latent_layout.tokens_per_step
        for k, frames, words in _episode_slices(latent_layout, text_layout):
            mask = None if text_mask_T is None else text_mask_T[None, words]
            # Per token: the model's own (1, seq_len) timestep, as the TI2V pipeline passes it.
            t = (
                timestep_K[None, frames.start * tps : frames.stop * tps]
                if per_token
                else timestep_K[k : k + 1]
            )
            pred = self.episode(xt_SCHW[frames], t, text_TD[None, words], mask)
            out[frames] = pred.to(out.dtype)
        return out


def _episode_slices(
    latent_layout: StreamLayout, text_layout: StreamLayout
) -> Iterator[tuple[int, slice, slice]]:
    """``(k, frames of episode k, text rows of episode k)`` for each episode of a pack."""
    s0 = c0 = 0
    for k, (f, n) in enumerate(zip(latent_layout.steps_K, text_layout.lengths_K, strict=True)):
        yield k, slice(s0, s0 + f), slice(c0, c0 + n)
        s0, c0 = s0 + f, c0 + n


def toy_text_encoder(text_dim: int = 24, seed: int = 0) -> TextEncoder:
    """A stand-in for a text encoder (umT5, T5) in tests: byte tokens of the task
    (`packing.model._dit.text_tokens`) looked up in a fixed seeded table, ``(len + 1, text_dim)``
    per task. Deterministic, not trained."""
    from packing.model import text_tokens

    table = torch.randn(257, text_dim, generator=torch.Generator().manual_seed(seed))

    def encode(tasks: Sequence[str]) -> list[Tensor]:
        return [table[text_tokens(t)] for t in tasks]

    return encode
