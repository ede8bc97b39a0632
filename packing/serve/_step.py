"""One engine step over static buffers: one model call for the whole pack, then every
request's scheduler update, with no host-device sync, so it can be captured in a CUDA graph.

Each request sits at its own step ``n_k`` of its own schedule; the step reads its time and
solver coefficients from per-request tables (rows: requests, columns: steps)::

    step_K    [3, 0, 7]                    after admission: each request's own counter
    t_table   t_K = t_table[k, n_k]        coef   (a_K, b_K) = coef[k, n_k]
    tokens    x += a_K[slot] * v + b_K[slot] * v_prev    on generated tokens (slot >= 0)

Admission (`packing.serve._engine`) writes new index tensors and tables into the same buffers
between replays (``copy_``), which is why the buffers, not the step, hold all state. The
block mask is rebuilt inside the step from the static doc ids (`make_block_mask`'s tile
classification is pure tensor work), so a captured graph stays right for any composition.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from packing._validate import check_bool, check_choice, check_doc_ids
from packing.attention import AttentionMask, InnerMask, dense_mask, make_block_mask
from packing.model import DiT, KVCache, PackInputs
from packing.serve._device import pinned, quarantine
from packing.serve._pack import HostPack, PackShape
from packing.train import broadcast_to_tokens

__all__ = [
    "FLEX_KERNEL_OPTIONS", "Buffers", "GraphedStep", "Steps", "cross_mask", "masks_from_doc_ids",
    "run_step", "schedule", "velocity_update",
]  # fmt: skip

# FlexAttention's kernel options by backend, for every mask a served step builds. Inductor
# lowers a call with fewer than 128 queries to its decoding kernel (made for a few queries over
# a long cache: one block of all queries, the keys split across the SMs); a pack of one request's generated tokens (80 at 5B widths)
# has that few, and on an H200 the decoding kernel took 2.6 ms a call where the main kernel
# takes 0.083 ms (94.8 -> 18.9 ms a step, benchmarks/reports/2026-12-04_served_engine.md).
FLEX_KERNEL_OPTIONS: dict[str, dict[str, Any] | None] = {
    "flex": {"FORCE_USE_FLEX_ATTENTION": True},
    "flex_flash": {"BACKEND": "FLASH"},
    "sdpa": None,
}

_INDEX_FIELDS = (
    "doc_J", "row_J", "src_index_J", "latents_dest_T", "action_dest_T", "thw_J3", "text_X",
    "text_doc_X", "slot_v", "slot_a", "pos_J",
)  # fmt: skip


class Buffers:
    """The static device tensors of one `PackShape`: state (tokens, previous velocities,
    step counters), the pack's index tensors and the per-request schedule tables."""

    def __init__(
        self, shape: PackShape, model: DiT, *, max_steps: int, device: torch.device
    ) -> None:
        cfg = model.config
        T_v, T_a, R = shape.frames * cfg.tokens_per_frame, shape.actions, shape.requests
        J, X = T_v + T_a, R * cfg.text_len
        f32: dict[str, Any] = dict(dtype=torch.float32, device=device)
        i64: dict[str, Any] = dict(dtype=torch.int64, device=device)
        self.shape = shape
        self.x_v = torch.zeros(T_v, cfg.patch_features, **f32)
        self.x_a = torch.zeros(T_a, cfg.action_dim, **f32)
        self.vp_v, self.vp_a = torch.zeros_like(self.x_v), torch.zeros_like(self.x_a)
        self.step_K = torch.zeros(R, **i64)
        self.bad_K = torch.zeros(R, dtype=torch.bool, device=device)  # state not finite
        self.t_table = torch.zeros(R, max_steps, **f32)
        self.coef = torch.zeros(R, max_steps, 2, **f32)
        # The pack's index tensors (`packing.serve._pack.HostPack`), -1 until a pack loads.
        self.doc_J, self.row_J, self.src_index_J = (torch.full((J,), -1, **i64) for _ in range(3))
        self.latents_dest_T, self.slot_v = (
            torch.full((T_v,), -1, **i64),
            torch.full((T_v,), -1, **i64),
        )
        self.action_dest_T, self.slot_a = (
            torch.full((T_a,), -1, **i64),
            torch.full((T_a,), -1, **i64),
        )
        self.text_X, self.text_doc_X = torch.full((X,), -1, **i64), torch.full((X,), -1, **i64)
        self.thw_J3 = torch.zeros(J, 3, **i64)
        self.pos_J = torch.zeros(J, **i64)

    def state(self) -> tuple[Tensor, ...]:
        """What a step changes (saved around a graph's warm-up runs)."""
        return (self.x_v, self.x_a, self.vp_v, self.vp_a, self.step_K)

    def load(self, host: HostPack, t_table: Tensor, coef: Tensor, step_K: Tensor) -> None:
        """Copy a new composition in (host -> device from pinned memory: no sync)."""
        dev = self.x_v.device
        for name in _INDEX_FIELDS:
            getattr(self, name).copy_(pinned(getattr(host, name), dev), non_blocking=True)
        self.t_table.copy_(pinned(t_table, dev), non_blocking=True)
        self.coef.copy_(pinned(coef, dev), non_blocking=True)
        self.step_K.copy_(pinned(step_K, dev), non_blocking=True)


def masks_from_doc_ids(
    doc_J: Tensor,
    text_doc_X: Tensor,
    *,
    backend: str,
    inner: InnerMask | None,
    document_mask: bool,
) -> tuple[AttentionMask, AttentionMask]:
    """The self- and cross-attention masks of a packed step from doc ids alone (sync-free,
    static shapes, so a captured step stays right for any composition)::

        doc_J       0 0 1 1 1 -1        text_doc_X   0 0 1 -1
        self        a query attends the keys of its own doc (and ``inner``'s rule in it)
        cross       a query attends its own doc's text rows
        padding     (-1) a row with no key is never empty (no NaN); its output is not used

    ``backend`` is resolved already (`packing.attention.resolve_backend`): ``"sdpa"`` (a
    dense mask, CPU) or ``"flex"``/``"flex_flash"`` (a block mask, `FLEX_KERNEL_OPTIONS`).
    ``document_mask=False`` treats all real tokens as one document, the deliberately broken
    model a proof must catch."""
    check_doc_ids("doc_J", doc_J)
    check_doc_ids("text_doc_X", text_doc_X)
    check_choice("backend", backend, FLEX_KERNEL_OPTIONS)
    check_bool("document_mask", document_mask)
    if not document_mask:
        doc_J = torch.where(doc_J >= 0, 0, -1)
    J = doc_J.shape[0]
    if backend == "sdpa":
        dense = dense_mask(doc_J, None, inner)
        has_key = dense.any(dim=1)
        dense = dense | ~has_key[:, None]  # a row with no key would give NaN, then 0
        self_mask = AttentionMask(
            backend=backend, kernel=backend, reason="packing.serve step", q_len=J, kv_len=J,
            inner=inner, cross=False, dense_TT=dense, keep_T=has_key,
        )  # fmt: skip
    else:
        self_mask = AttentionMask(
            backend=backend, kernel=backend, reason="packing.serve step", q_len=J, kv_len=J,
            inner=inner, cross=False, block_mask=make_block_mask(doc_J, None, inner),
            kernel_options=FLEX_KERNEL_OPTIONS[backend],
        )  # fmt: skip
    return self_mask, cross_mask(doc_J, text_doc_X, backend=backend, document_mask=document_mask)


def cross_mask(
    doc_J: Tensor, text_doc_X: Tensor, *, backend: str, document_mask: bool
) -> AttentionMask:
    """The cross-attention mask of queries ``doc_J`` to the packed text ``text_doc_X``."""
    if not document_mask:
        doc_J = torch.where(doc_J >= 0, 0, -1)
        text_doc_X = torch.where(text_doc_X >= 0, 0, -1)
    J, X = doc_J.shape[0], text_doc_X.shape[0]
    common: dict[str, Any] = dict(
        backend=backend, kernel=backend, reason="packing.serve step", q_len=J, kv_len=X,
        inner=None, cross=True,
    )  # fmt: skip
    if backend == "sdpa":
        dense = dense_mask(doc_J, text_doc_X, None)
        has_key = dense.any(dim=1)
        return AttentionMask(**common, dense_TT=dense | ~has_key[:, None], keep_T=has_key)
    return AttentionMask(
        **common, block_mask=make_block_mask(doc_J, text_doc_X, None),
        kernel_options=FLEX_KERNEL_OPTIONS[backend],
    )  # fmt: skip


def run_step(
    model: DiT, b: Buffers, *, backend: str, inner: InnerMask | None, document_mask: bool
) -> None:
    """One denoising step of every request in the pack, in place on ``b``."""
    t_R, ab_K2 = schedule(b)
    self_mask, cross = masks_from_doc_ids(
        b.doc_J, b.text_doc_X, backend=backend, inner=inner, document_mask=document_mask
    )
    pack = PackInputs(b.src_index_J, b.latents_dest_T, b.action_dest_T, b.thw_J3, b.text_X,
                      self_mask, cross)  # fmt: skip
    velocity_update(model, b, t_R, ab_K2, pack)


def schedule(b: Buffers) -> tuple[Tensor, Tensor]:
    """Each request's time at its own step, ``t_R`` (R + 1 rows: row R is the clean context,
    t = 0), and its solver coefficients ``(R, 2)``."""
    R, N = b.t_table.shape
    n_K = b.step_K.clamp(max=N - 1)  # a finished request is removed on the host first
    t_K = b.t_table.gather(1, n_K[:, None])[:, 0]
    ab_K2 = b.coef.gather(1, n_K[:, None, None].expand(R, 1, 2))[:, 0]
    return torch.cat([t_K, t_K.new_zeros(1)]), ab_K2


def velocity_update(
    model: DiT,
    b: Buffers,
    t_R: Tensor,
    ab_K2: Tensor,
    pack: PackInputs,
    cache: Sequence[KVCache] | None = None,
) -> None:
    """The model call over the pack's tokens (``cache``: over a context cache's pool too,
    `packing.serve._cached_step`), then every request's solver update."""
    dtype = next(model.parameters()).dtype
    tokens = {"latents": b.x_v.to(dtype), "action": b.x_a.to(dtype)}
    # Without a cache, the plain 4-argument call: the engine's model protocol.
    if cache is None:
        v = model.velocity(tokens, t_R, b.row_J, pack)
    else:
        v = model.velocity(tokens, t_R, b.row_J, pack, cache)
    # Both streams' updates are computed before either is written: a model output that
    # raises here leaves the state as it was, so the engine can re-run the step.
    new_v = _update(b.x_v, b.vp_v, v["latents"].float(), ab_K2, b.slot_v)
    new_a = _update(b.x_a, b.vp_a, v["action"].float(), ab_K2, b.slot_a)
    for dst, src in zip((b.x_v, b.vp_v, b.x_a, b.vp_a), (*new_v, *new_a), strict=True):
        dst.copy_(src)
    quarantine(b.bad_K, ((b.x_v, b.slot_v), (b.vp_v, b.slot_v), (b.x_a, b.slot_a),
                         (b.vp_a, b.slot_a)))  # fmt: skip
    b.step_K.add_(1)


def _update(
    x_TD: Tensor, vp_TD: Tensor, v_TD: Tensor, ab_K2: Tensor, slot_T: Tensor
) -> tuple[Tensor, Tensor]:
    """The new ``(x, v_prev)``: ``x + a v + b v_prev`` on the rows of a request (slot >= 0);
    context and padding rows are left exactly as they are."""
    ab_T2 = broadcast_to_tokens(ab_K2, slot_T)
    new = x_TD + ab_T2[:, :1] * v_TD + ab_T2[:, 1:] * vp_TD
    return torch.where((slot_T >= 0)[:, None], new, x_TD), v_TD.expand_as(vp_TD)


class GraphedStep:
    """`run_step` on one `Buffers`, captured in a CUDA graph (torch's recipe: warm up on a
    side stream, capture, replay). The warm-up runs really step the state, so it is saved
    before and restored after; capturing itself runs nothing."""

    def __init__(self, fn: Callable[[], None], b: Any) -> None:  # b.state(): what fn changes
        saved = [t.clone() for t in b.state()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                for _ in range(2):  # the first call compiles and autotunes, the second settles
                    fn()
        finally:  # also when the model raises: the engine then re-runs the step, state intact
            torch.cuda.current_stream().wait_stream(side)
            for t, s in zip(b.state(), saved, strict=True):
                t.copy_(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            fn()

    def __call__(self) -> None:
        self.graph.replay()


class Steps:
    """Every step function an engine runs, by key (a pack shape, a prefill pass): called
    plainly, or captured once in a CUDA graph (``cuda_graphs``) and replayed.

    After `seal` (the engine's warm-up ran every key) a key never run is an error, not a
    silent compile and capture in service: ``captures`` counts the graphs captured and
    ``keys`` the keys run, so a server can say how many happened after its warm-up."""

    def __init__(self, cuda_graphs: bool) -> None:
        self.cuda_graphs = check_bool("cuda_graphs", cuda_graphs)
        self.graphs: dict[Any, GraphedStep] = {}
        self.keys: set[Any] = set()
        self.captures = 0
        self.sealed = False

    def run(self, key: Any, fn: Callable[[], None], holder: Any) -> None:
        """``fn()`` for ``key`` (hashable: a pack shape, ``"prefill"``); ``holder.state()``
        names the tensors ``fn`` changes (a captured graph's warm-up runs ``fn`` twice, then
        restores them). Under ``cuda_graphs`` the Python of ``fn`` runs only when its key is
        first met (warm-up and capture); later calls replay the graph, so everything ``fn``
        reads must be in static tensors, written with ``copy_`` between replays."""
        if key not in self.keys:
            if self.sealed:
                raise RuntimeError(
                    f"{key!r} was not warmed up: the engine's warm-up runs every pack shape and "
                    "prefill pass it can meet, so this one would compile and capture in "
                    "service; give the engine this shape when it is built"
                )
            self.keys.add(key)
        if not self.cuda_graphs:
            with torch.no_grad():
                fn()
            return
        g = self.graphs.get(key)
        if g is None:
            with torch.no_grad():
                g = self.graphs[key] = GraphedStep(fn, holder)
            self.captures += 1
        g()

    def seal(self) -> None:
        self.sealed = True
