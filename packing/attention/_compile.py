"""The ``torch.compile`` state packing keeps in a process, all of it, and how to inspect it.

Nothing else in packing holds compiled functions or touches dynamo's configuration.

**`call_compiled(fn, ...)`** calls a compiled function with dynamo's recompile limit made an
error for that one call: it sets ``torch._dynamo.config.recompile_limit`` (raised to
``graph_limit`` if given, never lowered) and ``fail_on_recompile_limit_hit=True``, calls, and
restores both, also when the call raises. Nothing is cached.

**`FLEX_KERNELS`** (a `ShapeKernels`) holds the compiled FlexAttention of `packing.attention._packed`:

- *cached*: at most two compiled functions, ``torch.compile(flex_attention, dynamic=False)``
  (static) and ``dynamic=True``, each made on first use; dynamo keeps one graph per shape
  inside the static one;
- *keyed by*: the call's ``(q tokens, kv tokens)``. The first ``static_shapes`` (4) distinct
  shapes a process runs get the static kernel; a later new shape gets the dynamic one, with a
  warning (once). The FLASH backend always runs static (torch 2.11 cannot compile it with
  dynamic shapes, and inductor's FLASH template still says "TODO(dynamic shapes)" in 2.15);
- *inspect*: ``FLEX_KERNELS.shapes`` (the shapes holding a static slot, in order seen);
- *reset*: ``FLEX_KERNELS.reset()`` forgets them and drops both compiled functions;
  ``reset(static_shapes=64)`` also changes the number of slots (a benchmark that sweeps
  shapes). ``torch._dynamo.reset()`` clears dynamo's own caches.

Why four static slots: on the H200 the dynamic kernel was 1.41x slower (fwd+bwd, 37 short
episodes in 48K tokens) than the static one on the same mask, and dynamo's automatic dynamic
(``dynamic=None``) would have switched *every* later call, the training shape's too, to it
after one new length (an eval budget, say). A packed run with one token budget has one shape;
the unpacked reference of `packing verify` has one per episode length.

**`BLOCK_MASK_GRAPHS`** (a `GraphedBlockTables`) is ``make_block_mask(compile="cuda_graph")``:

- *cached*: per ``(device, doc dtype, T_q, T_kv, rule, q_block, kv_block, self-attention)``,
  static doc-id inputs, a CUDA graph of the compiled tile tables and its one flat int32
  output, captured on the first call of that key (which compiles, warms up and syncs);
- *a call*: copy the doc ids in, replay, clone the flat output (three launches, no sync); the
  eight tables are views of that clone, so they are the caller's and no later call touches
  them;
- *inspect*: ``BLOCK_MASK_GRAPHS.keys``; *reset*: ``BLOCK_MASK_GRAPHS.reset()`` drops the
  graphs and their memory pools (tens of MB each at 64K tokens, ~16x more at 256K).

**Torch internals read here**, the same in every release of the range pyproject.toml allows
(read in the source of 2.11.0, 2.12.0, 2.13.0, 2.14.1 and 2.15.0; tests/test_versions.py
checks them on both ends CI runs): ``torch._dynamo.config.recompile_limit`` and
``fail_on_recompile_limit_hit``, and the exception dynamo raises then,
``torch._dynamo.exc.FailOnRecompileLimitHit`` (matched by name, wherever it lives). A torch
outside ``TESTED_TORCH`` gets one warning at the first compile (`check_torch_version`): these
names may have moved, and `call_compiled` would then fail or miss the limit.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = [
    "BLOCK_MASK_GRAPHS",
    "FLEX_GRAPH_LIMIT",
    "FLEX_KERNELS",
    "TESTED_TORCH",
    "GraphedBlockTables",
    "ShapeKernels",
    "call_compiled",
    "check_torch_version",
]

# (major, minor) of the oldest and the newest torch CI runs the suite on (constraints.txt,
# constraints-newest.txt); pyproject.toml's torch range is exactly this (tests/test_versions.py).
TESTED_TORCH = ((2, 11), (2, 15))


def _torch_minor(version: str) -> tuple[int, int]:
    """``"2.15.0+cu132"`` -> ``(2, 15)``; ``"2.16.0a0+git1234"`` -> ``(2, 16)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@functools.cache
def check_torch_version(version: str | None = None) -> bool:
    """Warn once when torch is outside ``TESTED_TORCH``; True when inside.

    pip keeps a plain install inside (pyproject.toml caps torch), but a source build, a nightly
    or ``--no-deps`` gets past it, and the dynamo internals this module reads are only known to
    hold inside the range. Called at the first compile, not per call.
    """
    version = torch.__version__ if version is None else version
    got, (lo, hi) = _torch_minor(version), TESTED_TORCH
    if lo <= got <= hi:
        return True
    warnings.warn(
        f"torch {version} is outside the range packing is tested on "
        f"({lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}, docs/compatibility.md): the compiled paths "
        "rely on torch._dynamo.config.recompile_limit and fail_on_recompile_limit_hit; if "
        "a compiled call fails oddly, install a torch inside the range",
        stacklevel=3,
    )
    return False


# Graphs the shared compiled FlexAttention may hold in one process. Each (mask_mod kind, grad
# mode, autocast, dtype, static/dynamic shape) is one graph: a model with a self- and a
# cross-attention mask, trained and evaluated with and without autocast, already needs 8,
# dynamo's default limit for a function. Past this limit `call_compiled` raises.
FLEX_GRAPH_LIMIT = 64


def call_compiled(
    fn: Callable[..., Any], *args: Any, graph_limit: int | None = None, **kwargs: Any
) -> Any:
    """Call a ``torch.compile``-d function, failing loudly instead of falling back to eager.

    Past ``torch._dynamo.config.recompile_limit`` dynamo silently runs the function eagerly;
    for FlexAttention that means materialising the T x T scores (tens of GiB at 64K tokens)
    and a backward torch itself flags as possibly wrong. Seen on an H200 in `packing verify`.
    ``graph_limit`` raises the limit for this call (never lowers it).
    """
    cfg = torch._dynamo.config
    saved = (cfg.recompile_limit, cfg.fail_on_recompile_limit_hit)
    limit = saved[0] if graph_limit is None else max(saved[0], graph_limit)
    # Set and restore by hand: `cfg.patch(...)` cost 40 us a call on a 2-core VM, this 13.
    cfg.recompile_limit, cfg.fail_on_recompile_limit_hit = limit, True
    try:
        return fn(*args, **kwargs)
    except Exception as err:
        if type(err).__name__ != "FailOnRecompileLimitHit":
            raise
        name = getattr(fn, "__name__", repr(fn))
        raise RuntimeError(
            f"a compiled function ({name}) hit its recompile limit ({limit} graphs): past "
            "it torch would have run it eagerly (for attention: dense T x T scores). Give every "
            "pack one shape (PackedCollator(token_budget=..., max_docs=...)) and keep the "
            "number of mask kinds small, or raise torch._dynamo.config.recompile_limit if "
            "the shapes really vary (TORCH_LOGS=recompiles says why it recompiled)"
        ) from err
    finally:
        cfg.recompile_limit, cfg.fail_on_recompile_limit_hit = saved


class ShapeKernels:
    """A function compiled twice, static and dynamic; the first ``static_shapes`` distinct
    shapes get the static one (the contract is in this module's docstring).

    ``load`` returns the function to compile (imported on first use); ``name`` and ``fix``
    make the warning given when a shape first falls back to the dynamic kernel.
    """

    def __init__(
        self, load: Callable[[], Callable[..., Any]], *, static_shapes: int, name: str, fix: str
    ) -> None:
        self._load, self._name, self._fix = load, name, fix
        self.static_shapes = static_shapes
        self._shapes: dict[tuple[int, ...], None] = {}  # an ordered set
        self._compiled: dict[bool, Callable[..., Any]] = {}
        self._warned = False

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes holding a static slot, in the order they were first seen."""
        return tuple(self._shapes)

    def reset(self, static_shapes: int | None = None) -> None:
        """Forget the shapes and drop the compiled functions (optionally resize the slots)."""
        if static_shapes is not None:
            self.static_shapes = static_shapes
        self._shapes.clear()
        self._compiled.clear()
        self._warned = False

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more shapes to get static kernels (an engine that warms up a
        known set of pack shapes, each with its own attention shapes, before serving)."""
        self.static_shapes = max(self.static_shapes, len(self._shapes) + n)

    def is_static(self, shape: tuple[int, ...]) -> bool:
        """Give ``shape`` a static kernel if it has one or a slot is free."""
        if shape in self._shapes or len(self._shapes) < self.static_shapes:
            self._shapes[shape] = None
            return True
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{self._name} has static kernels for {self.static_shapes} sequence shapes; "
                f"shape {shape} and later new ones use one dynamic-shape kernel, which is "
                f"slower (1.4x on an H200). {self._fix}",
                stacklevel=5,
            )
        return False

    def get(self, shape: tuple[int, ...], *, always_static: bool = False) -> Callable[..., Any]:
        """The compiled function for ``shape`` (``always_static``: never the dynamic one)."""
        static = always_static or self.is_static(shape)
        if static not in self._compiled:
            check_torch_version()
            self._compiled[static] = torch.compile(self._load(), dynamic=not static)
        return self._compiled[static]


def _flex_attention() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


FLEX_KERNELS = ShapeKernels(
    _flex_attention,
    static_shapes=4,
    name="packing.attention._packed: FlexAttention",
    fix="Give every pack one shape (PackedCollator(token_budget=...)) to keep the static kernels",
)


class GraphedBlockTables:
    """The compiled block-mask tables, captured in one CUDA graph per shape (contract in this
    module's docstring). Called like ``packing.attention._block_tables.block_tables``."""

    def __init__(self) -> None:
        self._graphs: dict[tuple[Any, ...], _Graphed] = {}

    @property
    def keys(self) -> tuple[tuple[Any, ...], ...]:
        return tuple(self._graphs)

    def reset(self) -> None:
        self._graphs.clear()

    def __call__(
        self,
        q_doc_T: torch.Tensor,
        kv_doc_T: torch.Tensor,
        rule: Callable[..., Any],
        q_block: int,
        kv_block: int,
        self_attention: bool,
    ) -> Any:
        from packing.attention._block_tables import BlockTables

        if q_doc_T.device.type != "cuda":
            raise ValueError(
                f"make_block_mask(compile='cuda_graph') needs CUDA doc ids, got {q_doc_T.device}; "
                "use compile=True (any device) or compile=False"
            )
        key = (q_doc_T.device, q_doc_T.dtype, q_doc_T.shape[0], kv_doc_T.shape[0], rule,
               q_block, kv_block, self_attention)  # fmt: skip
        with torch.cuda.device(q_doc_T.device):  # capture and replay on the ids' GPU
            g = self._graphs.get(key)
            if g is None:
                g = self._graphs[key] = _Graphed.capture(
                    q_doc_T, kv_doc_T, rule, q_block, kv_block, self_attention
                )
            g.q_in.copy_(q_doc_T)
            if g.kv_in is not g.q_in:
                g.kv_in.copy_(kv_doc_T)
            g.graph.replay()
            flat = g.flat_out.clone()
        out, start = [], 0
        for shape in g.shapes:
            n = math.prod(shape)
            out.append(flat[start : start + n].view(shape))
            start += n
        return BlockTables(*out)


class _Graphed(NamedTuple):
    q_in: torch.Tensor
    kv_in: torch.Tensor
    graph: torch.cuda.CUDAGraph
    flat_out: torch.Tensor
    shapes: tuple[tuple[int, ...], ...]

    @staticmethod
    def capture(
        q_doc_T: torch.Tensor,
        kv_doc_T: torch.Tensor,
        rule: Callable[..., Any],
        bq: int,
        bkv: int,
        self_attention: bool,
    ) -> _Graphed:
        """Compile and warm up on a side stream, then capture (torch's documented recipe)."""
        q_in = q_doc_T.clone()
        kv_in = q_in if self_attention else kv_doc_T.clone()
        R, C = -(-q_in.shape[0] // bq), -(-kv_in.shape[0] // bkv)
        shapes = ((1, 1, R), (1, 1, R, C)) * 2 + ((1, 1, C), (1, 1, C, R)) * 2
        fn = _compiled_flat_tables()
        args = (q_in, kv_in, rule, bq, bkv, self_attention)
        side = torch.cuda.Stream(q_in.device)
        side.wait_stream(torch.cuda.current_stream(q_in.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*args)
        torch.cuda.current_stream(q_in.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            flat_out = fn(*args)
        return _Graphed(q_in, kv_in, graph, flat_out, shapes)


@functools.cache
def _compiled_flat_tables() -> Callable[..., torch.Tensor]:
    from packing.attention._block_tables import block_tables

    def flat_tables(*args: Any) -> torch.Tensor:
        return torch.cat([t.flatten() for t in block_tables(*args)])

    check_torch_version()
    return torch.compile(flat_tables, dynamic=False, fullgraph=True)


BLOCK_MASK_GRAPHS = GraphedBlockTables()
