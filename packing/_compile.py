"""The ``torch.compile`` state packing keeps in a process, all of it, and how to inspect it.

Nothing else in packing holds compiled functions or touches dynamo's configuration.

**`call_compiled(fn, ...)`** calls a compiled function with dynamo's recompile limit made an
error for that one call: it sets ``torch._dynamo.config.recompile_limit`` (raised to
``graph_limit`` if given, never lowered) and ``fail_on_recompile_limit_hit=True``, calls, and
restores both, also when the call raises. Nothing is cached.

**`FLEX_KERNELS`** (a `ShapeKernels`) holds the compiled FlexAttention of `packing.attention`:

- *cached*: at most two compiled functions, ``torch.compile(flex_attention, dynamic=False)``
  (static) and ``dynamic=True``, each made on first use; dynamo keeps one graph per shape
  inside the static one;
- *keyed by*: the call's ``(q tokens, kv tokens)``. The first ``static_shapes`` (4) distinct
  shapes a process runs get the static kernel; a later new shape gets the dynamic one, with a
  warning (once). The FLASH backend always runs static (torch 2.11 cannot compile it with
  dynamic shapes);
- *inspect*: ``FLEX_KERNELS.shapes`` (the shapes holding a static slot, in order seen);
- *reset*: ``FLEX_KERNELS.reset()`` forgets them and drops both compiled functions;
  ``reset(static_shapes=64)`` also changes the number of slots (a benchmark that sweeps
  shapes). ``torch._dynamo.reset()`` clears dynamo's own caches.

Why four static slots: on the H200 the dynamic kernel was 1.41x slower (fwd+bwd, 37 short
episodes in 48K tokens) than the static one on the same mask, and dynamo's automatic dynamic
(``dynamic=None``) would have switched *every* later call, the training shape's too, to it
after one new length (an eval budget, say). A packed run with one token budget has one shape;
the unpacked reference of `packing verify` has one per episode length.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FLEX_GRAPH_LIMIT", "FLEX_KERNELS", "ShapeKernels", "call_compiled"]

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
            self._compiled[static] = torch.compile(self._load(), dynamic=not static)
        return self._compiled[static]


def _flex_attention() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


FLEX_KERNELS = ShapeKernels(
    _flex_attention,
    static_shapes=4,
    name="packing.attention: FlexAttention",
    fix="Give every pack one shape (PackedCollator(token_budget=...)) to keep the static kernels",
)
