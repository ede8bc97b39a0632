"""Flow-matching samplers as per-step coefficients, so a pack can update every token at once.

Convention (Wan, SD3, `packing.train.flow_matching_inputs`): ``t = 0`` is data, ``t = 1`` pure
noise, the model predicts the velocity ``v = dx/dt``. Sampling integrates ``dx/dt = v(x, t)``
from ``t = 1`` down to ``t = 0`` over the times ``sigma_0 = 1 > sigma_1 > ... > sigma_N = 0``,
``sigma_i = shift * s / (1 + (shift - 1) * s)`` with ``s = 1 - i / N`` (``shift = 1``: linear).

Every solver here is written as ``x_{i+1} = x_i + a_i * v_i + b_i * v_{i-1}`` with host-side
coefficients, ``h_i = sigma_{i+1} - sigma_i`` (< 0):

- ``"euler"``: ``a_i = h_i``, ``b_i = 0``.
- ``"multistep2"``: the variable-step two-step Adams-Bashforth method, 2nd order,
  ``x_{i+1} = x_i + h_i * v_i + h_i^2 / (2 h_{i-1}) * (v_i - v_{i-1})``, so
  ``a_i = h_i (1 + r_i / 2)`` and ``b_i = -h_i r_i / 2`` with ``r_i = h_i / h_{i-1}``;
  the first step (no ``v_{-1}``) is Euler. One model call a step, like UniPC's predictor.

A request's coefficients are a table indexed by its own step, so a pack whose requests sit at
different steps (and have different step counts) is updated by one gather and one fused
multiply-add per token (`packing.serve._step`). `reference_sample` is the scalar loop the
vectorised update is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from packing._validate import check_int, check_real
from packing.serve._limits import MAX_STEPS

__all__ = ["FlowScheduler", "check_scheduler", "reference_sample"]

Solver = Literal["euler", "multistep2"]


@dataclass(frozen=True, kw_only=True)
class FlowScheduler:
    """Sampling times and update coefficients of a flow-matching solver (plain data).

    ``FlowScheduler(solver="euler").sigmas(4) == [1.0, 0.75, 0.5, 0.25, 0.0]`` and its
    ``coefficients(4) == [(-0.25, 0.0)] * 4``; with ``shift=5`` (Wan's default for video) the
    times crowd toward the noise end.
    """

    solver: Solver = "euler"
    shift: float = 1.0

    def __post_init__(self) -> None:
        if self.solver not in ("euler", "multistep2"):
            raise ValueError(
                f"FlowScheduler.solver={self.solver!r}; use 'euler' or 'multistep2' (2nd-order "
                "Adams-Bashforth)"
            )
        check_real("FlowScheduler.shift", self.shift, above=0, hint="1.0: no shift")

    def sigmas(self, steps: int) -> list[float]:
        """The N + 1 times, from 1 (noise) down to 0 (data), in float64 on the host."""
        _check_steps(steps)
        k = float(self.shift)
        out = []
        for i in range(steps + 1):
            s = 1.0 - i / steps
            out.append(k * s / (1.0 + (k - 1.0) * s))
        return out

    def coefficients(self, steps: int) -> list[tuple[float, float]]:
        """``(a_i, b_i)`` of ``x_{i+1} = x_i + a_i v_i + b_i v_{i-1}``, one pair a step."""
        sig = self.sigmas(steps)
        h = [sig[i + 1] - sig[i] for i in range(steps)]
        out = [(h[0], 0.0)]
        for i in range(1, steps):
            if self.solver == "euler":
                out.append((h[i], 0.0))
            else:
                r = h[i] / h[i - 1]
                out.append((h[i] * (1.0 + r / 2.0), -h[i] * r / 2.0))
        return out


def check_scheduler(name: str, value: object) -> FlowScheduler:
    """``value`` if it is a `FlowScheduler`: a solver's name alone is not one."""
    if not isinstance(value, FlowScheduler):
        raise TypeError(
            f"{name}={value!r} must be a FlowScheduler, got {type(value).__name__}; pass "
            "FlowScheduler(solver='euler') or FlowScheduler(solver='multistep2', shift=5.0)"
        )
    return value


def reference_sample(
    velocity: Callable[[float, float], float], x: float, scheduler: FlowScheduler, steps: int
) -> float:
    """The scalar reference: integrate ``dx/dt = velocity(x, t)`` from 1 to 0, one float.

    Written from the textbook formulas, not from `FlowScheduler.coefficients`, so the two
    can check each other::

        euler:       x <- x + h v
        multistep2:  x <- x + h v + h^2 / (2 h_prev) (v - v_prev)    (Euler on the first step)
    """
    sig = scheduler.sigmas(steps)
    v_prev = h_prev = 0.0
    for i in range(steps):
        h = sig[i + 1] - sig[i]
        v = velocity(x, sig[i])
        if scheduler.solver == "euler" or i == 0:
            x = x + h * v
        else:
            x = x + h * v + h * h / (2.0 * h_prev) * (v - v_prev)
        v_prev, h_prev = v, h
    return x


def _check_steps(steps: int) -> None:
    check_int("steps", steps, min=1, max=MAX_STEPS, hint="denoising steps of a request")
