"""The memory model of sharded training (stated in `packing.train._budget`), without torch.

`MemoryModel.max_tokens` answers ``packing budget``, which must answer in well under a second:
this module imports only the standard library and `packing._validate` (numpy), never torch.
`packing.train` re-exports `MemoryModel` and `Probe`; fitting and probing stay there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from packing._validate import check_bool, check_int, check_real

__all__ = ["ACCUM_BYTES", "STATE_BYTES", "MemoryModel", "Probe"]

STATE_BYTES = 16.0  # fp32 parameter + fp32 gradient + AdamW exp_avg + exp_avg_sq
# FSDP2's unsharded gradient accumulator between no-sync micro-steps, in the reduce dtype
# (torch 2.11 `FSDPParam.to_accumulated_grad_if_needed`; fp32 with MixedPrecisionPolicy(
# reduce_dtype=torch.float32)). Seen on two H200s: 85.1 GB measured for 2 no-sync micro-steps
# of 65,536 tokens at 5.0 B parameters, 63.9 GB predicted without this term, 83.8 with it.
ACCUM_BYTES = 4.0


@dataclass(frozen=True)
class Probe:
    """One measurement: ``tokens`` per GPU at ``depth`` blocks, ``params`` in the model."""

    depth: int
    tokens: int
    params: int
    world: int
    peak_bytes: float

    def __post_init__(self) -> None:
        check_int("depth", self.depth, min=1)
        check_int("tokens", self.tokens, min=1)
        check_int("params", self.params, min=1)
        check_int("world", self.world, min=1, hint="ranks")
        check_real("peak_bytes", self.peak_bytes, min=0, hint="bytes (0 on a CPU smoke run)")


@dataclass(frozen=True)
class MemoryModel:
    """``peak = STATE_BYTES * params / world + fixed + tokens * (per_token + per_token_block
    * depth) [+ ACCUM_BYTES * params if accumulate]``; bytes."""

    fixed: float
    per_token: float
    per_token_block: float
    state_bytes: float = STATE_BYTES
    accum_bytes: float = ACCUM_BYTES

    def __post_init__(self) -> None:
        for name in ("fixed", "per_token", "per_token_block"):  # fitted: any sign
            check_real(name, getattr(self, name), hint="bytes, a least-squares fit")
        for name in ("state_bytes", "accum_bytes"):
            check_real(name, getattr(self, name), min=0, hint="bytes")

    def peak(
        self, tokens: int, params: int, depth: int, world: int, *, accumulate: bool = False
    ) -> float:
        """Predicted peak bytes; ``accumulate``: several micro-steps a step, synced on the
        last only (the unsharded gradient accumulator is alive)."""
        check_int("tokens", tokens, min=0)
        _check_sizes(params, depth, world, accumulate)
        act = tokens * (self.per_token + self.per_token_block * depth)
        return self._fixed_part(params, world, accumulate) + act

    def max_tokens(
        self,
        capacity: float,
        params: int,
        depth: int,
        world: int,
        *,
        multiple: int = 1024,
        accumulate: bool = False,
    ) -> int:
        """Largest pack (a multiple of ``multiple``) whose predicted peak fits ``capacity``
        bytes; 0 when the sharded states alone do not fit."""
        check_real("capacity", capacity, min=0, hint="bytes")
        _check_sizes(params, depth, world, accumulate)
        check_int("multiple", multiple, min=1, hint="tokens")
        free = capacity - self._fixed_part(params, world, accumulate)
        per = self.per_token + self.per_token_block * depth
        if free <= 0 or per <= 0:
            return 0
        return int(free / per) // multiple * multiple

    def _fixed_part(self, params: int, world: int, accumulate: bool) -> float:
        accum = self.accum_bytes * params if accumulate else 0.0
        return self.state_bytes * params / world + self.fixed + accum

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["per_token_mb"] = self.per_token / 1e6
        d["per_token_block_kb"] = self.per_token_block / 1e3
        return d


def _check_sizes(params: Any, depth: Any, world: Any, accumulate: Any) -> None:
    check_int("params", params, min=0)
    check_int("depth", depth, min=1)
    check_int("world", world, min=1, hint="ranks")
    check_bool("accumulate", accumulate)
