"""`EngineConfig`: the static packs, the schedule tables' width, CUDA graphs, the attention
backend and the context cache of an `Engine` serving the reference DiT (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

from packing._validate import check_bool, check_choice, check_int, check_sequence
from packing.attention import Backend
from packing.serve._cache import ContextCache
from packing.serve._limits import MAX_STEPS
from packing.serve._pack import PackShape
from packing.serve._schedulers import FlowScheduler, check_scheduler

__all__ = ["EngineConfig"]


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """``shapes``: the static packs (a few token budgets); ``max_steps``: the most denoising
    steps a request may ask for (the width of the schedule tables); ``cuda_graphs``: capture
    each shape's step in a CUDA graph (CUDA only); ``attention``: the backend (``auto``: sdpa
    on CPU, FlexAttention on CUDA); ``context_cache``: compute each request's clean context
    once into a paged K/V pool and run only the generated tokens at every step (frame-causal
    models only; `ContextCache`; ``None``: every step runs the whole pack)."""

    shapes: tuple[PackShape, ...]
    scheduler: FlowScheduler = field(default_factory=FlowScheduler)
    max_steps: int = 50
    cuda_graphs: bool = False
    attention: Backend = "auto"
    context_cache: ContextCache | None = None

    def __post_init__(self) -> None:
        shapes = tuple(check_sequence("EngineConfig.shapes", self.shapes))
        if not shapes or not all(isinstance(s, PackShape) for s in shapes):
            raise ValueError(f"EngineConfig.shapes={self.shapes!r}; give one or more PackShape")
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(
            self,
            "max_steps",
            check_int("EngineConfig.max_steps", self.max_steps, min=1, max=MAX_STEPS),
        )
        check_scheduler("EngineConfig.scheduler", self.scheduler)
        object.__setattr__(
            self, "cuda_graphs", check_bool("EngineConfig.cuda_graphs", self.cuda_graphs)
        )
        check_choice("EngineConfig.attention", self.attention, get_args(Backend))
        if self.context_cache is not None and not isinstance(self.context_cache, ContextCache):
            raise TypeError(
                f"EngineConfig.context_cache must be a ContextCache or None, got "
                f"{type(self.context_cache).__name__}"
            )
