"""What `packing verify` measures, judges and prints: differences, tolerances, the report.

Relative difference of a tensor, ``b`` the reference (the unpacked run)::

    rel(a, b) = max|a - b| / max|b|        a = [1.0, -4.0, 2.2], b = [1.0, -4.0, 2.0] -> 0.05

One scale per tensor, so a tiny element of ``b`` cannot blow the ratio up the way an
elementwise relative error would. The gates (`record_grad_diffs`, `parameter_difference`,
`judge` and the divergence verdicts) turn the measurements into failures against
`Tolerances`; the single-process and the distributed harness share them.
``VerifyReport.format()`` is the printed table, ``to_json()`` the machine-readable report.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from packing._validate import check_real
from packing.verify._leak import LeakReport

__all__ = [
    "NO_MULTI_EPISODE_PACK",
    "GradDiff",
    "StepComparison",
    "Tolerances",
    "VerifyReport",
    "both_diverged_at",
    "build_report",
    "cosine_similarity",
    "grad_badness",
    "judge",
    "nonfinite_tensors",
    "parameter_difference",
    "params_diverged",
    "record_grad_diffs",
    "relative_difference",
    "source_sha1",
]


# -- metrics -----------------------------------------------------------------------------------
def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` in float64; 0 when both are all zero, inf when only b is.

    ``b`` is the reference (the unpacked run). One scale for the whole tensor, so a tiny
    element of ``b`` does not blow the ratio up the way an elementwise relative error would.
    """
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    a64, b64 = a.detach().double(), b.detach().double()
    num = float((a64 - b64).abs().max()) if a.numel() else 0.0
    den = float(b64.abs().max()) if b.numel() else 0.0
    if math.isnan(num):
        return math.inf
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of the flattened tensors in float64; 1 when both are zero, 0 when one is."""
    a64, b64 = a.detach().double().flatten(), b.detach().double().flatten()
    na, nb = float(a64.norm()), float(b64.norm())
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0 or math.isnan(na) or math.isnan(nb):
        return 0.0
    return float(a64 @ b64) / (na * nb)


def source_sha1() -> str:
    """sha1 (12 hex digits) of the installed ``packing`` package's ``*.py`` files, names and
    bytes: which library code produced a report or a benchmark JSON, also where a copied tree's
    git HEAD is stale or absent (``benchmarks/harness/provenance.py`` records a hash of the whole tree)."""
    h = hashlib.sha1()
    root = Path(__file__).resolve().parent
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


@dataclass(frozen=True, kw_only=True)
class Tolerances:
    """Pass limits. ``None`` means the quantity is reported but not gated.

    fp32 is exact up to summation order, so everything is gated by relative difference. In
    bf16 a single rounding flip moves a small gradient element by its own size, so gradients
    are gated by direction (cosine) and parameters after AdamW (which normalises each
    element's step to about ``lr``, whatever the gradient's size) are only reported.
    """

    loss_rel: float
    grad_rel: float | None = None
    grad_cos: float | None = None
    param_rel: float | None = None

    def __post_init__(self) -> None:
        check_real("loss_rel", self.loss_rel, min=0.0)
        for name in ("grad_rel", "grad_cos", "param_rel"):
            if getattr(self, name) is not None:
                check_real(name, getattr(self, name), min=0.0)
        if self.grad_rel is None and self.grad_cos is None:
            raise ValueError("gate gradients by grad_rel or grad_cos (or both)")

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> Tolerances:
        if dtype == torch.float32:
            return cls(loss_rel=1e-6, grad_rel=1e-5, param_rel=1e-5)
        if dtype in (torch.bfloat16, torch.float16):
            return cls(loss_rel=5e-3, grad_cos=0.999)
        raise ValueError(f"no tolerances for dtype {dtype}; use float32 or bfloat16")


# -- records -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StepComparison:
    """One optimizer step of both runs: their losses, micro-steps and wall time."""

    step: int
    loss_unpacked: float
    loss_packed: float
    loss_rel: float
    micro_steps_unpacked: int
    micro_steps_packed: int
    seconds_unpacked: float
    seconds_packed: float


@dataclass(frozen=True, kw_only=True)
class GradDiff:
    """The worst, over steps, of one parameter's gradient difference."""

    name: str
    shape: tuple[int, ...]
    rel: float
    cos: float
    max_abs: float
    step: int


@dataclass(kw_only=True)
class VerifyReport:
    """Everything `packing verify` measured; ``passed`` is the exit status."""

    config: dict[str, Any]
    tolerances: Tolerances
    steps: list[StepComparison]
    grads: list[GradDiff]  # every parameter, worst first
    param_rel: float  # all parameters as one vector (gated)
    param_worst: str  # the tensor with the largest per-tensor relative difference
    param_worst_rel: float  # its per-tensor value (reported)
    episodes: int
    tokens: int  # real tokens of one step (primary stream)
    padded_tokens_unpacked: int
    padded_tokens_packed: int
    packs: int
    pack_sizes: list[int]
    leak: LeakReport | None
    failures: list[str] = field(default_factory=list)
    # Both runs went non-finite: no verdict on packing (the CLI exits 2, not 1).
    diverged: bool = False
    param_worst_scale: float | None = None  # max|b| of the worst tensor (unpacked run)
    environment: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def loss_rel(self) -> float:
        """The definition applied to the vector of per-step losses."""
        a = torch.tensor([s.loss_packed for s in self.steps], dtype=torch.float64)
        b = torch.tensor([s.loss_unpacked for s in self.steps], dtype=torch.float64)
        return relative_difference(a, b)

    @property
    def efficiency_packed(self) -> float:
        return self.tokens / max(self.padded_tokens_packed, 1)

    @property
    def efficiency_unpacked(self) -> float:
        return self.tokens / max(self.padded_tokens_unpacked, 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "diverged": self.diverged,
            "failures": self.failures,
            "config": self.config,
            "tolerances": asdict(self.tolerances),
            "loss_rel": self.loss_rel,
            "grad_rel_max": max((g.rel for g in self.grads), default=0.0),
            "grad_cos_min": min((g.cos for g in self.grads), default=1.0),
            "param_rel": self.param_rel,
            "param_worst": self.param_worst,
            "param_worst_rel": self.param_worst_rel,
            "param_worst_scale": self.param_worst_scale,
            "steps": [asdict(s) for s in self.steps],
            "grads": [asdict(g) for g in self.grads],
            "episodes": self.episodes,
            "tokens": self.tokens,
            "padded_tokens_unpacked": self.padded_tokens_unpacked,
            "padded_tokens_packed": self.padded_tokens_packed,
            "efficiency_unpacked": self.efficiency_unpacked,
            "efficiency_packed": self.efficiency_packed,
            "packs": self.packs,
            "pack_sizes": self.pack_sizes,
            "leak": None if self.leak is None else self.leak.to_dict(),
            "environment": self.environment,
        }

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, default=_json_default)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    def format(self, worst: int = 5) -> str:
        """The printed report: header, per-step table, worst gradients, summary, verdict."""
        parts = [self._header(), self._step_table(), self._grad_table(worst), self._summary()]
        return "\n\n".join([*parts, self._verdict()])

    def _header(self) -> str:
        cfg = self.config
        out = [
            f"packing verify: {self.episodes} episodes, {len(self.steps)} AdamW steps, "
            f"{cfg.get('dtype')} on {cfg.get('device')}, reduction={cfg.get('reduction')}, "
            f"mask={cfg.get('mask')}{'' if cfg.get('document_mask', True) else ' (NO document mask)'}",
            f"model: {cfg.get('model')}   data: {cfg.get('dataset')}",
        ]
        if cfg.get("reference"):
            out.append(f"unpacked side: {cfg['reference']}")
        return "\n".join(out)

    def _step_table(self) -> str:
        out = [
            "| step | loss unpacked | loss packed | rel diff | micro-steps u/p | s/step u | s/step p |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for s in self.steps:
            out.append(
                f"| {s.step} | {s.loss_unpacked:.9g} | {s.loss_packed:.9g} | {s.loss_rel:.2e} | "
                f"{s.micro_steps_unpacked}/{s.micro_steps_packed} | {s.seconds_unpacked:.3f} | "
                f"{s.seconds_packed:.3f} |"
            )
        return "\n".join(out)

    def _grad_table(self, worst: int) -> str:
        out = [
            f"worst {min(worst, len(self.grads))} of {len(self.grads)} parameter gradients:",
            "| parameter | shape | rel diff | cosine | max abs diff | step |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for g in self.grads[:worst]:
            out.append(
                f"| {g.name} | {tuple(g.shape)} | {g.rel:.2e} | {g.cos:.7f} | {g.max_abs:.2e} | "
                f"{g.step} |"
            )
        return "\n".join(out)

    def _gate(self, value: float, limit: float | None, le: bool = True) -> str:
        if limit is None:
            return f"{value:.2e} (reported, not gated)"
        ok = value <= limit if le else value >= limit
        # A nan is never "ok" (nan <= limit is False); diverged runs get no verdict.
        verdict = "n/a (diverged)" if self.diverged else "ok" if ok else "FAIL"
        return f"{value:.2e} {'<=' if le else '>='} {limit:g}  {verdict}"

    def _summary(self) -> str:
        tol, gate = self.tolerances, self._gate
        rel = max((g.rel for g in self.grads), default=0.0)
        cos = min((g.cos for g in self.grads), default=1.0)
        su = statistics.median(s.seconds_unpacked for s in self.steps) if self.steps else 0.0
        sp = statistics.median(s.seconds_packed for s in self.steps) if self.steps else 0.0
        cos_line = (
            gate(cos, tol.grad_cos, le=False).replace(f"{cos:.2e}", f"{cos:.7f}", 1)
            if tol.grad_cos is not None
            else f"{cos:.7f} (reported, not gated)"
        )
        out = [
            "summary:",
            f"  max rel loss diff        {gate(self.loss_rel, tol.loss_rel)}",
            f"  max rel gradient diff    {gate(rel, tol.grad_rel)}",
            f"  min gradient cosine      {cos_line}",
            f"  rel param diff after {len(self.steps)}  {gate(self.param_rel, tol.param_rel)}"
            f"  (all parameters; worst tensor {self.param_worst} {self.param_worst_rel:.2e}"
            f"{self._worst_tensor_note()})",
            f"  tokens per step          {self.tokens:,} real; padded {self.padded_tokens_unpacked:,}"
            f" unpacked ({self.efficiency_unpacked:.1%}) vs {self.padded_tokens_packed:,} packed"
            f" ({self.efficiency_packed:.1%})",
            f"  micro-steps per step     {self.episodes} unpacked vs {self.packs} packed "
            f"(episodes per pack {self.pack_sizes})",
            f"  median time per step     {su:.3f} s unpacked vs {sp:.3f} s packed "
            f"(first step includes warm-up)",
        ]
        if self.leak is not None:
            out.append("  " + self.leak.summary().replace("\n", "\n  "))
        return "\n".join(out)

    def _worst_tensor_note(self) -> str:
        """A worst tensor above the limit on its own, and why, only when that is the reason:
        the run passed AND the tensor's magnitude is that of one started at 0 (max|b| within
        10 x steps x lr), where AdamW's per-element step on rounding noise dominates."""
        limit = self.tolerances.param_rel
        if limit is None or not self.param_worst_rel > limit:
            return ""
        lr, scale = self.config.get("lr"), self.param_worst_scale
        near_zero = (
            isinstance(lr, int | float) and scale is not None
            and scale <= 10 * max(len(self.steps), 1) * lr
        )  # fmt: skip
        if not (self.passed and near_zero):
            return f", above {limit:g} on its own" + (
                "" if scale is None else f"; its max|b| is {scale:.2e}"
            )
        return (
            f", above {limit:g} on its own: expected, its max|b| {scale:.2e} is that of a "
            "tensor started at 0 (~ steps x lr), so AdamW's per-element step on rounding noise "
            "dominates; only all parameters together are gated, the gradients per tensor"
        )

    def _verdict(self) -> str:
        if self.passed:
            return "PASS: packed training matches unpacked within tolerance"
        if self.diverged:
            return "DIVERGED (no verdict on packing): " + "; ".join(self.failures)
        return "FAIL: " + "; ".join(self.failures) + "\n" + NEXT_STEPS


# What a user reads after a FAIL: where the symptom tables are, and what to change first.
NEXT_STEPS = (
    "next: match the failure to the symptom tables in docs/verify.md#what-verify-catches-each-"
    "is-a-test and docs/porting.md (a named leak: the document mask; a loss that differs "
    "without a leak: per-episode noise, positions reset per episode, one loss normaliser per "
    "step); fix that in your model or loop and run packing verify again"
)


def _json_default(o: Any) -> Any:
    if isinstance(o, torch.dtype):
        return str(o).removeprefix("torch.")
    if isinstance(o, Path):
        return str(o)
    return repr(o)


def grad_badness(g: GradDiff, tol: Tolerances) -> float:
    """How close to (or past) its limit a gradient is; ranks the 'worst five'."""
    if tol.grad_rel is not None:
        return g.rel / tol.grad_rel
    assert tol.grad_cos is not None
    return (1.0 - g.cos) / max(1.0 - tol.grad_cos, 1e-12)


# -- the gates, shared with the distributed run (packing.verify._distributed) ------------------------
def record_grad_diffs(
    worst: dict[str, GradDiff],
    grads_u: Mapping[str, torch.Tensor | None],
    grads_p: Mapping[str, torch.Tensor | None],
    step: int,
    tol: Tolerances,
) -> list[str]:
    """Fold one step's gradients into ``worst`` (per parameter, worst over steps); returns
    the failures found (a gradient in one run only)."""
    failures = []
    for name, gu in grads_u.items():
        gp = grads_p[name]
        if gu is None and gp is None:
            continue
        if gu is None or gp is None:
            failures.append(
                f"parameter {name} has a gradient only in the "
                f"{'packed' if gu is None else 'unpacked'} run (step {step})"
            )
            continue
        d = GradDiff(
            name=name,
            shape=tuple(gu.shape),
            rel=relative_difference(gp, gu),
            cos=cosine_similarity(gp, gu),
            max_abs=float((gp.double() - gu.double()).abs().max()) if gu.numel() else 0.0,
            step=step,
        )
        prev = worst.get(name)
        if prev is None or grad_badness(d, tol) > grad_badness(prev, tol):
            worst[name] = d
    return failures


def parameter_difference(
    params_u: Mapping[str, torch.Tensor], params_p: Mapping[str, torch.Tensor]
) -> tuple[float, str, float]:
    """(all parameters as one vector: max|a - b| / max|b|, worst tensor, its own ratio).

    Per tensor, one that starts at zero (a LayerNorm bias) has max|b| ~ steps * lr, so its
    own ratio measures AdamW's per-element normalisation of rounding noise, not packing;
    it is reported (worst tensor) but the per-tensor gate is on the gradients.
    """
    num = den = 0.0
    param_worst, param_worst_rel = "", 0.0
    for name, pu in params_u.items():
        a, b = params_p[name].double(), pu.double()
        if not b.numel():
            continue
        # max() would skip a nan (nan > x is False), printing "ok" beside nan parameters.
        num = max(num, float((a - b).abs().max().nan_to_num(math.inf)))
        den = max(den, float(b.abs().max().nan_to_num(math.inf)))
        r = relative_difference(a, b)
        if r > param_worst_rel or not param_worst:
            param_worst, param_worst_rel = name, r
    param_rel = (0.0 if num == 0.0 else math.inf) if den == 0.0 else num / den
    if not math.isfinite(den):
        param_rel = math.inf
    return param_rel, param_worst, param_worst_rel


def judge(
    records: Sequence[StepComparison],
    grads: Sequence[GradDiff],
    param_rel: float,
    param_worst: str,
    leak: LeakReport | None,
    tol: Tolerances,
    steps: int,
) -> list[str]:
    """The failures of a run against ``tol``: losses, gradients, parameters, leaks."""
    failures = []
    loss_rel = relative_difference(
        torch.tensor([r.loss_packed for r in records], dtype=torch.float64),
        torch.tensor([r.loss_unpacked for r in records], dtype=torch.float64),
    )
    if not loss_rel <= tol.loss_rel:
        failures.append(f"loss differs: rel {loss_rel:.2e} > {tol.loss_rel:g}")
    if tol.grad_rel is not None:
        bad = [g for g in grads if not g.rel <= tol.grad_rel]
        if bad:
            failures.append(
                f"{len(bad)} gradients differ: worst {bad[0].name} rel {bad[0].rel:.2e} > "
                f"{tol.grad_rel:g}"
            )
    if tol.grad_cos is not None:
        bad = [g for g in grads if not g.cos >= tol.grad_cos]
        if bad:
            worst_cos = min(bad, key=lambda g: g.cos)
            failures.append(
                f"{len(bad)} gradients point elsewhere: worst {worst_cos.name} cosine "
                f"{worst_cos.cos:.6f} < {tol.grad_cos:g}"
            )
    if tol.param_rel is not None and not param_rel <= tol.param_rel:
        failures.append(
            f"parameters after {steps} steps differ: rel {param_rel:.2e} > {tol.param_rel:g} "
            f"(worst tensor {param_worst})"
        )
    if leak is not None and not leak.ok:
        failures.append(f"episodes leak into each other: pairs (i <- j) {leak.pairs[:6]}")
    return failures


def both_diverged_at(step: int, loss_u: float, loss_p: float) -> str:
    """The verdict when both runs' loss is non-finite at ``step``: no verdict on packing."""
    return (
        f"both runs diverged: the loss is {loss_u} unpacked and {loss_p} packed at step "
        f"{step}; the model or optimiser produced non-finite values, which says nothing "
        "about packing: check the model's initialisation, lower --lr or raise --adam-eps"
    )


def params_diverged(steps: int, nonfinite_u: Sequence[str], nonfinite_p: Sequence[str]) -> str:
    """The verdict when both runs end with non-finite parameters ("" when they do not)."""
    if not (nonfinite_u and nonfinite_p):
        return ""
    return (
        f"both runs diverged: after {steps} AdamW step(s) parameters are non-finite "
        f"in both ({len(nonfinite_u)} tensors unpacked, e.g. {nonfinite_u[0]}); the model or "
        "optimiser produced non-finite values, which says nothing about packing: lower --lr "
        "or raise --adam-eps (0 divides 0 by 0)"
    )


def nonfinite_tensors(params: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the (non-empty) tensors holding a nan or an inf."""
    return [n for n, t in params.items() if t.numel() and not bool(torch.isfinite(t).all())]


NO_MULTI_EPISODE_PACK = (
    "leak check impossible: no pack holds >= 2 episodes; raise --token-budget (or pass fewer, "
    "longer packs) so that at least one pack holds two episodes"
)


def divergence(
    records: Sequence[StepComparison],
    params_u: Mapping[str, torch.Tensor],
    params_p: Mapping[str, torch.Tensor],
    failures: list[str],
) -> str:
    """The divergence verdict ("" when there is none): both runs' loss non-finite at a step,
    or both runs' parameters non-finite at the end. Non-finite parameters in one run only are
    a packing failure, appended to ``failures``."""
    for r in records:
        if not (math.isfinite(r.loss_unpacked) or math.isfinite(r.loss_packed)):
            return both_diverged_at(r.step, r.loss_unpacked, r.loss_packed)
    nonfinite = {"unpacked": nonfinite_tensors(params_u), "packed": nonfinite_tensors(params_p)}
    diverged = params_diverged(len(records), nonfinite["unpacked"], nonfinite["packed"])
    for run in ("packed", "unpacked"):
        if nonfinite[run] and not diverged:
            failures.append(
                f"{len(nonfinite[run])} parameter tensors are non-finite in the {run} run only "
                f"(e.g. {nonfinite[run][0]})"
            )
    return diverged


def build_report(
    *,
    config: dict[str, Any],
    tolerances: Tolerances,
    steps: Any,
    params_u: Mapping[str, torch.Tensor],
    params_p: Mapping[str, torch.Tensor],
    leak_check: Any,
    counts: Mapping[str, Any],
    environment: dict[str, str],
    planned_steps: int,
) -> VerifyReport:
    """The one report of both harnesses, from what the loop measured (``steps``: records, the
    worst gradient per parameter, failures) and the final parameters of both runs.

    ``leak_check()`` -> (LeakReport or None, failures) runs only when neither run diverged.
    A divergence of both runs replaces every failure: nan compared with nan says nothing
    about packing.
    """
    tol = tolerances
    failures = list(steps.failures)
    grads = sorted(steps.worst.values(), key=lambda g: grad_badness(g, tol), reverse=True)
    param_rel, param_worst, param_worst_rel = parameter_difference(params_u, params_p)
    worst = params_u.get(param_worst)
    scale = None if worst is None or not worst.numel() else float(worst.abs().max())
    diverged = divergence(steps.records, params_u, params_p, failures)
    leak = None
    if leak_check is not None and not diverged:
        leak, impossible = leak_check()
        failures += impossible
    failures += judge(steps.records, grads, param_rel, param_worst, leak, tol, planned_steps)
    if diverged:
        failures = [diverged]
    return VerifyReport(
        config=config,
        tolerances=tol,
        steps=steps.records,
        grads=grads,
        param_rel=param_rel,
        param_worst=param_worst,
        param_worst_rel=param_worst_rel,
        param_worst_scale=scale,
        leak=leak,
        failures=failures,
        diverged=bool(diverged),
        environment=environment,
        **counts,
    )
