"""`packing verify`: train the same episodes packed and unpacked and prove nothing changed.

Two copies of one model (``deepcopy`` of the same initial weights) take ``steps`` AdamW steps
on the same episodes::

    unpacked   one episode per micro-step, gradient accumulation     (the baseline)
               step s:  [e0] [e1] [e2] [e3] [e4]  -> optimizer.step()
    packed     K episodes per micro-step, planned under a token budget
               step s:  [e0 e3 e4 ....] [e1 e2 ..]  -> optimizer.step()

Both reduce the model's per-token losses with the same `packing.losses.LossNormalizer`
(global denominator over the micro-steps of a step), and both give the model the same
``batch.extras["seed"]`` / ``["step"]``, so per-episode noise and timesteps are identical.
After every step the harness compares, with ``rel(a, b) = max|a - b| / max|b|`` (b = unpacked):

- the step's loss;
- every parameter's gradient (relative difference, and cosine similarity);
- after the last step, the parameters (all of them as one vector; the worst tensor is shown).

A leak check (`packing.leak.find_leaks`) on the first pack proves no episode sees another.
The run passes only if every number is within `Tolerances.for_dtype` (fp32: loss 1e-6,
gradients 1e-5, parameters 1e-5; bf16/fp16: loss 5e-3, gradient cosine >= 0.999).
"""

from __future__ import annotations

import copy
import importlib
import math
import platform
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from packing._compile import call_compiled
from packing.layout import PackedBatch
from packing.leak import LeakReport, find_leaks
from packing.losses import LossNormalizer, reduce_loss
from packing.verify_report import (
    GradDiff,
    StepRecord,
    Tolerances,
    VerifyReport,
    cosine_similarity,
    grad_badness,
    relative_difference,
)

__all__ = [
    "GradDiff",
    "StepRecord",
    "Tolerances",
    "VerifyConfig",
    "VerifyReport",
    "compare_packed_unpacked",
    "cosine_similarity",
    "default_token_budget",
    "relative_difference",
    "run_verify",
]

Episode = Mapping[str, Any]
Collate = Callable[[Sequence[Episode]], PackedBatch]
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# -- the harness ---------------------------------------------------------------------------------
def _with_step(batch: PackedBatch, seed: int, step: int, device: torch.device) -> PackedBatch:
    """The batch on ``device`` with the RNG keys both runs share in ``extras``.

    Episode identities travel as host ints (``batch.episode_ids``), so the model's
    per-episode draws never read a device tensor back.
    """
    moved = batch.to(device)
    return replace(moved, extras={**moved.extras, "seed": seed, "step": step})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loss_mask(model: nn.Module, batch: PackedBatch, stream: str) -> torch.Tensor | None:
    fn = getattr(model, "loss_mask", None)
    return None if fn is None else fn(batch, stream)


def _train_step(
    model: nn.Module,
    batches: Sequence[PackedBatch],
    *,
    reduction: str,
    autocast: torch.dtype | None,
    device: torch.device,
    normalise: str = "global",
) -> tuple[float, float]:
    """One optimizer step's forward/backward over ``batches``; returns (loss, seconds).

    The gradients are left in ``.grad`` for comparison; the caller steps the optimizer.
    ``normalise="global"`` is the library's exact reduction; ``"per-micro-step"`` is the
    common mistake (each micro-step's own mean, then averaged), kept to prove it is caught.
    """
    _sync(device)
    t0 = time.perf_counter()
    streams = list(batches[0].layouts)
    norms = {}
    for s in streams:
        masks = [_loss_mask(model, b, s) for b in batches]
        norms[s] = LossNormalizer.for_step([b.layout(s) for b in batches], reduction, masks)  # type: ignore[arg-type]
    total = torch.zeros((), dtype=torch.float64, device=device)
    for b in batches:
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            # With --compile, a model past dynamo's recompile limit would silently run eager.
            out = call_compiled(model, b)
        if not isinstance(out, Mapping) or not out:
            raise TypeError(
                f"{type(model).__name__}.forward(batch) must return a dict {{stream: per-token "
                f"loss (T,)}}, got {type(out).__name__}; see docs/verify.md (model protocol)"
            )
        loss = torch.zeros((), dtype=torch.float32, device=device)
        for k, v in out.items():
            lay = b.token_layout(
                k, v.shape[0], f"the model's loss {k!r}", fix="key per-token losses by stream name"
            )
            mask = _loss_mask(model, b, k)
            if normalise == "global":
                loss = loss + norms[k](v, lay, mask)
            else:  # the mistake: this pack's own mean, then an average over micro-steps
                loss = loss + reduce_loss(v, lay, reduction, mask) / len(batches)  # type: ignore[arg-type]
        loss.backward()
        total += loss.detach().double()
    _sync(device)
    return float(total), time.perf_counter() - t0


def compare_packed_unpacked(
    model: nn.Module,
    episodes: Sequence[Episode],
    *,
    collate_unpacked: Collate,
    collate_packed: Collate,
    packs: Sequence[Sequence[int]],
    steps: int = 3,
    reduction: str = "episode",
    seed: int = 0,
    lr: float = 1e-4,
    adam_eps: float = 1e-6,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    compile: bool = False,
    tolerances: Tolerances | None = None,
    leak_check: bool = True,
    normalise: str = "global",
    config: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
    reference: nn.Module | None = None,
) -> VerifyReport:
    """The core of `packing verify` on any packed model and any list of episodes.

    ``reference``: the module the unpacked run trains instead of a copy of ``model`` -- e.g.
    the unmodified upstream model called one episode at a time (a diffusers adapter's
    ``model.reference()``). It must hold the same parameters under the same names, with the
    same values; ``model`` itself then trains packed (no copy is made).

    ``collate_unpacked([ep])`` makes the one-episode batches of the baseline,
    ``collate_packed([eps...])`` the packs; ``packs`` lists the episode positions of each pack
    (every episode exactly once). ``model`` is deep-copied for the packed run, so both start
    from the same weights. ``dtype`` float32 runs the model as is; bf16/fp16 run it under
    ``torch.autocast`` with fp32 weights (the usual mixed-precision training set-up).

    Why ``adam_eps=1e-6`` (not torch's 1e-8): AdamW steps each element by about
    ``lr * g / (|g| + eps)``. Some gradients are exactly 0 in exact arithmetic -- the key bias
    of attention (softmax ignores a constant added to a row of scores) -- and in fp32 are
    rounding noise of ~1e-9 that differs with summation order. With eps=1e-8 AdamW turns that
    noise into a step of a sizeable fraction of ``lr`` with a random sign, so two *unpacked*
    runs that only sum in another order already differ by ~1e-3 in those parameters (measured
    on the test model). eps=1e-6 keeps rounding noise below eps; a real packing mistake still
    moves parameters by O(lr) and fails by orders of magnitude. ``lr=1e-4`` is a typical DiT
    fine-tuning rate.

    ``progress`` receives one line per finished half-step and for the leak check (the CLI
    prints them to stderr, so a run cut short, e.g. by a long ``--compile``, shows how far
    it got).
    """
    say = progress or (lambda _line: None)
    dev = torch.device(device)
    tol = tolerances or Tolerances.for_dtype(dtype)
    flat = sorted(i for p in packs for i in p)
    if flat != list(range(len(episodes))):
        raise ValueError(
            f"packs must hold every episode position 0..{len(episodes) - 1} exactly once, got "
            f"{[list(p) for p in packs]}"
        )
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    autocast = None if dtype == torch.float32 else dtype

    # Collate once; the data are the same every step, only extras["step"] (the noise) changes.
    singles = [collate_unpacked([ep]) for ep in episodes]
    packed = [collate_packed([episodes[i] for i in p]) for p in packs]

    if reference is None:
        model_u = model.to(dev)
        model_p = copy.deepcopy(model_u)
    else:
        model_u, model_p = reference.to(dev), model.to(dev)
        _check_same_parameters(model_p, model_u)
    model_u.train()
    model_p.train()
    run_u: nn.Module = torch.compile(model_u, dynamic=True) if compile else model_u  # type: ignore[assignment]
    run_p: nn.Module = torch.compile(model_p, dynamic=False) if compile else model_p  # type: ignore[assignment]
    opt_u = torch.optim.AdamW(model_u.parameters(), lr=lr, eps=adam_eps)
    opt_p = torch.optim.AdamW(model_p.parameters(), lr=lr, eps=adam_eps)
    params_u = dict(model_u.named_parameters())
    params_p = dict(model_p.named_parameters())

    records: list[StepRecord] = []
    worst: dict[str, GradDiff] = {}
    failures: list[str] = []
    diverged = ""
    for s in range(steps):
        bu = [_with_step(b, seed, s, dev) for b in singles]
        bp = [_with_step(b, seed, s, dev) for b in packed]
        # Same global RNG state for both halves: anything that does not depend on packing
        # draws the same numbers, so a difference can only come from packing.
        torch.manual_seed(seed * 1_000_003 + s)
        with warnings.catch_warnings():
            # One episode per micro-step has one shape per episode length by design; the
            # library's "give every pack one shape" advice is for packed runs.
            warnings.filterwarnings("ignore", message=r"packing\.attention: FlexAttention has")
            loss_u, sec_u = _train_step(
                run_u, bu, reduction=reduction, autocast=autocast, device=dev
            )
        say(f"step {s}: unpacked, {len(bu)} micro-steps, loss {loss_u:.8g}, {sec_u:.1f} s")
        torch.manual_seed(seed * 1_000_003 + s)
        loss_p, sec_p = _train_step(
            run_p, bp, reduction=reduction, autocast=autocast, device=dev,
            normalise=normalise,
        )  # fmt: skip
        say(f"step {s}: packed, {len(bp)} micro-steps, loss {loss_p:.8g}, {sec_p:.1f} s")
        b_loss = torch.tensor([loss_u], dtype=torch.float64)
        records.append(
            StepRecord(
                step=s,
                loss_unpacked=loss_u,
                loss_packed=loss_p,
                loss_rel=relative_difference(torch.tensor([loss_p], dtype=torch.float64), b_loss),
                micro_steps_unpacked=len(bu),
                micro_steps_packed=len(bp),
                seconds_unpacked=sec_u,
                seconds_packed=sec_p,
            )
        )
        if not (math.isfinite(loss_u) or math.isfinite(loss_p)):
            # Both runs blew up the same way: that says nothing about packing, and every
            # difference from here on would be nan - nan.
            diverged = both_diverged_at(s, loss_u, loss_p)
            break
        grads_u = {n: p.grad for n, p in params_u.items()}
        failures += record_grad_diffs(
            worst, grads_u, {n: params_p[n].grad for n in grads_u}, s, tol
        )
        opt_u.step()
        opt_p.step()
        opt_u.zero_grad(set_to_none=True)
        opt_p.zero_grad(set_to_none=True)

    grads = sorted(worst.values(), key=lambda g: grad_badness(g, tol), reverse=True)
    param_rel, param_worst, param_worst_rel = parameter_difference(
        {n: p.detach() for n, p in params_u.items()},
        {n: params_p[n].detach() for n in params_u},
    )
    nonfinite = {
        "unpacked": nonfinite_tensors({n: p.detach() for n, p in params_u.items()}),
        "packed": nonfinite_tensors({n: p.detach() for n, p in params_p.items()}),
    }
    diverged = diverged or params_diverged(len(records), nonfinite["unpacked"], nonfinite["packed"])
    for run in ("packed", "unpacked"):
        if nonfinite[run] and not diverged:
            failures.append(
                f"{len(nonfinite[run])} parameter tensors are non-finite in the {run} run only "
                f"(e.g. {nonfinite[run][0]})"
            )

    leak = None
    if leak_check and not diverged:
        multi = [b for b in packed if b.num_docs >= 2]
        if not multi:
            failures.append("leak check impossible: no pack holds >= 2 episodes; lower the budget")
        else:
            model_p.eval()
            say(f"leak check on a pack of {multi[0].num_docs} episodes")
            leak = _leak_check(model_p, _with_step(multi[0], seed, 0, dev), autocast, dev)

    failures += judge(records, grads, param_rel, param_worst, leak, tol, steps)
    if diverged:  # no verdict on packing: every difference above compares nan with nan
        failures = [diverged]

    primary = singles[0].primary
    return VerifyReport(
        config=dict(config or {}),
        tolerances=tol,
        steps=records,
        grads=grads,
        param_rel=param_rel,
        param_worst=param_worst,
        param_worst_rel=param_worst_rel,
        episodes=len(episodes),
        tokens=sum(b.layout(primary).num_tokens for b in singles),
        padded_tokens_unpacked=sum(b.layout(primary).padded_len for b in singles),
        padded_tokens_packed=sum(b.layout(primary).padded_len for b in packed),
        packs=len(packed),
        pack_sizes=[len(p) for p in packs],
        leak=leak,
        failures=failures,
        diverged=bool(diverged),
        environment=_environment(dev),
    )


# -- the gates, shared with the distributed run (packing.verify_dist) ------------------------------
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
    records: Sequence[StepRecord],
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


def _check_same_parameters(packed: nn.Module, reference: nn.Module) -> None:
    """The packed model and its reference must start from the same weights, name by name."""
    p, r = dict(packed.named_parameters()), dict(reference.named_parameters())
    if p.keys() != r.keys():
        only_p, only_r = sorted(p.keys() - r.keys()), sorted(r.keys() - p.keys())
        raise ValueError(
            f"the reference's parameters are not the packed model's: only packed {only_p[:4]}, "
            f"only reference {only_r[:4]}; build the reference from the same model"
        )
    for name, value in p.items():
        if value.shape != r[name].shape or not torch.equal(value.detach(), r[name].detach()):
            raise ValueError(
                f"parameter {name} differs between the packed model and the reference; both "
                "must start from the same weights (copy the model before packing it)"
            )


def _leak_check(
    model: nn.Module, batch: PackedBatch, autocast: torch.dtype | None, dev: torch.device
) -> LeakReport:
    """Leak check of one pack: the model's ``predict`` if it has one, else its losses."""
    fn = getattr(model, "predict", None) or model

    def outputs(b: PackedBatch) -> Mapping[str, torch.Tensor]:
        with torch.autocast(dev.type, dtype=autocast, enabled=autocast is not None):
            return fn(b)

    # On CPU the check is bit-exact in any dtype (masked keys contribute an exact 0), and
    # CPU kernels are deterministic already (the switch would only recompile a compiled
    # model). On GPU it runs with torch's deterministic algorithms (FA4's backward has an
    # atomic dQ otherwise), and a leak must also exceed 10x the run-to-run noise measured on
    # two clean runs (0 when the kernels are deterministic).
    cpu = dev.type == "cpu"
    return find_leaks(outputs, batch, noise_floor=None if cpu else 10.0, deterministic=not cpu)


def _environment(dev: torch.device) -> dict[str, str]:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": str(torch.get_num_threads()),
        "device": str(dev),
    }
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
        # with the model's head dim this says which kernel `auto` ran (FA4 varlen or Flex)
        env["flash_attn_4"] = _fa4_version()
    return env


def _fa4_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from packing.attention import fa4_available

    if not fa4_available():
        return "not importable"
    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return "importable (version unknown)"


# -- the command ---------------------------------------------------------------------------------
DEFAULT_MODEL = "packing.model:tiny_reference_model"


@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    """The options of ``packing verify`` (``packing verify --help`` says the same)."""

    device: str = "cpu"
    dtype: str = "float32"
    compile: bool = False
    steps: int = 3
    episodes: int | None = None  # None: every episode of the dataset
    token_budget: int | None = None  # None: about a third of the step's tokens, >= the longest
    mask: str = "document"
    document_mask: bool = True
    reduction: str = "episode"
    dataset: str | None = None  # None: the embedded default dataset
    model: str | None = None  # "module:factory"; None: the tiny reference model
    reference: str | None = None  # "module:factory(model)"; None: model.reference() or a copy
    seed: int = 0
    lr: float = 1e-4
    adam_eps: float = 1e-6
    leak_check: bool = True
    loss_normaliser: str = "global"
    # {model stream: dataset feature}, e.g. {"latents": "observation.latent"}; streams not
    # listed read the feature of their own name (the reference model also looks by shape).
    features: Mapping[str, str] = field(default_factory=dict)
    # distributed (packing.verify_dist): W ranks, FSDP2, the distributed sampler
    nproc: int = 1
    checkpointing: str = "full"
    blocks: str = "blocks"
    noise_key: str = "episode"
    fsdp_autocast: bool = False  # bf16: fp32 sharded parameters + autocast, not bf16 params

    def __post_init__(self) -> None:
        check_device(self.device)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; choose one of {sorted(_DTYPES)}")
        if self.mask not in ("document", "frame-causal"):
            raise ValueError(f"mask={self.mask!r}; choose 'document' or 'frame-causal'")
        if self.reduction not in ("token", "frame", "episode"):
            raise ValueError(f"reduction={self.reduction!r}; choose token, frame or episode")
        if self.loss_normaliser not in ("global", "per-micro-step", "per-rank"):
            raise ValueError(
                f"loss_normaliser={self.loss_normaliser!r}; choose 'global', 'per-micro-step' "
                "or 'per-rank'"
            )
        if self.nproc < 1:
            raise ValueError(f"nproc={self.nproc} must be >= 1")
        if self.checkpointing not in ("full", "ops", "none"):
            raise ValueError(f"checkpointing={self.checkpointing!r}; choose full, ops or none")
        if self.noise_key not in ("episode", "rank"):
            raise ValueError(f"noise_key={self.noise_key!r}; choose 'episode' or 'rank'")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        if self.episodes is not None and self.episodes < 2:
            raise ValueError(f"episodes={self.episodes}: packing needs at least 2 episodes")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"token_budget={self.token_budget} must be >= 1")
        for flag, spec in (("model", self.model), ("reference", self.reference)):
            if spec is not None and spec.count(":") != 1:
                raise ValueError(
                    f"{flag}={spec!r}: expected 'module:factory', e.g. 'my_models:build' for a "
                    "function build() in my_models.py on the Python path"
                )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


class ModelFactoryError(RuntimeError):
    """The ``--model`` (or ``--reference``) factory raised; the message names the factory and
    the error."""


def check_device(device: str) -> torch.device:
    """``device`` as a torch device that exists here, or a ValueError naming the fix."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"--device {device!r} is not a torch device; use cpu, cuda or cuda:N"
        ) from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(
                f"--device {device}: torch sees no CUDA GPU (torch {torch.__version__}, {build}); "
                "run on a machine with a GPU and a CUDA build of torch, or use --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible "
                f"(cuda:0..cuda:{torch.cuda.device_count() - 1}); pick one of them"
            )
    elif dev.type != "cpu" and not _backend_available(dev):
        raise ValueError(f"--device {device}: {dev.type} is not available here; use cpu or cuda")
    return dev


def _backend_available(dev: torch.device) -> bool:
    module = getattr(torch, dev.type, None)
    is_available = getattr(module, "is_available", None)
    return bool(is_available()) if callable(is_available) else False


def load_factory(spec: str, flag: str = "--model") -> Callable[..., nn.Module]:
    """``"module:factory"`` -> the factory callable, with an error that names what is missing."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(
            f"{flag} {spec}: cannot import module {module_name!r} ({e}); put its directory on "
            "PYTHONPATH or install it"
        ) from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise AttributeError(
            f"{flag} {spec}: module {module_name!r} has no callable {attr!r}; expected a "
            "function that returns a model (see docs/verify.md)"
        )
    return factory  # type: ignore[no-any-return]


def build_model(config: VerifyConfig, sizes: Mapping[str, Any] | None = None) -> nn.Module:
    """Call the factory with the options it must honour; refuse options it cannot take.

    ``mask`` and ``document_mask`` are passed only when they differ from the default, so a
    user's ``factory()`` without parameters works for the plain run, and asking it for
    ``--mask frame-causal`` is an error rather than a silently ignored flag. ``sizes`` (the
    reference model's ``latent_shape``/``action_dim``, from the dataset) go to the factory
    as they are.
    """
    import inspect

    spec = config.model or DEFAULT_MODEL
    factory = load_factory(spec)
    kwargs: dict[str, Any] = dict(sizes or {})
    if config.mask != "document":
        kwargs["mask"] = config.mask
    if not config.document_mask:
        kwargs["document_mask"] = False
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [k for k in kwargs if k not in params and not takes_any]
    if missing:
        flags = {"mask": f"--mask {config.mask}", "document_mask": "--no-document-mask"}
        raise TypeError(
            f"--model {spec}: the factory takes no {missing} parameter, so "
            f"{', '.join(flags[k] for k in missing)} cannot be applied; add the parameter to the "
            "factory or drop the flag"
        )
    try:
        model = factory(**kwargs)
    except Exception as e:
        raise ModelFactoryError(
            f"--model {spec}: the factory raised {type(e).__name__}: {' '.join(str(e).split())}; "
            "fix the factory (run it in Python to debug), then run verify again"
        ) from e
    if not isinstance(model, nn.Module):
        raise TypeError(f"--model {spec} returned {type(model).__name__}, expected nn.Module")
    streams = getattr(model, "streams", None)
    if not streams:
        raise AttributeError(
            f"--model {spec}: the model has no `streams` attribute; declare the streams it "
            "reads, primary first, e.g. streams = [Stream('latents', grid=(4, 8)), "
            "Stream('action')] (see docs/verify.md)"
        )
    return model


def build_reference(config: VerifyConfig, model: nn.Module) -> tuple[nn.Module | None, str]:
    """The unpacked side: ``--reference`` factory called with the packed model, else the
    model's own ``reference()`` (e.g. an unmodified upstream model run one episode at a time),
    else None (a copy of the packed model runs one episode per micro-step)."""
    if config.reference is not None:
        factory = load_factory(config.reference, "--reference")
        try:
            ref = factory(model)
        except Exception as e:
            raise ModelFactoryError(
                f"--reference {config.reference}: the factory raised {type(e).__name__}: "
                f"{' '.join(str(e).split())}; fix the factory (run it in Python to debug), "
                "then run verify again"
            ) from e
        where = config.reference
    elif callable(getattr(model, "reference", None)):
        ref = model.reference()  # type: ignore[operator]
        where = f"{type(model).__name__}.reference()"
    else:
        return None, "a copy of the model"
    if not isinstance(ref, nn.Module):
        raise TypeError(f"the reference ({where}) is {type(ref).__name__}, expected nn.Module")
    return ref, where


def default_token_budget(lengths: Sequence[int]) -> int:
    """About a third of one step's tokens (so ~3 packs of several episodes), never below the
    longest episode, rounded up to a multiple of 128 (of 8 below 512 tokens)::

        lengths [160, 64, 288, 96]        (608 tokens)   -> max(203, 288)  -> 288
        lengths [160, ..., 288] x 12 eps  (2,016 tokens) -> max(672, 288)  -> 768
        lengths [5, 2, 9, 3, 7]           (26 tokens)    -> max(9, 9)      -> 16
    """
    want = max(-(-sum(lengths) // 3), max(lengths))
    multiple = 128 if want >= 512 else 8
    return -(-want // multiple) * multiple


# LeRobot's writer adds these to every dataset; they are bookkeeping, never a model stream.
_LEROBOT_DEFAULT_FEATURES = ("timestamp", "frame_index", "episode_index", "index", "task_index")


def dataset_features(config: VerifyConfig) -> tuple[Path, str, dict[str, dict[str, Any]]]:
    """(root, how the report names it, ``meta/info.json`` features) of the dataset to verify on."""
    from packing.lerobot import _check_root, _load_info

    if config.dataset is None:
        from packing.default_dataset import default_dataset_root

        root, where = default_dataset_root(), "embedded default dataset"
    else:
        root = Path(config.dataset).expanduser()
        where = str(config.dataset)
        _check_root(root)
    return root, where, dict(_load_info(root)["features"])


def reference_streams(
    features: Mapping[str, Mapping[str, Any]], given: Mapping[str, str], where: str
) -> tuple[dict[str, str], dict[str, Any]]:
    """Which features feed the reference DiT, and its sizes from their shapes::

        features {"observation.latent": float16 (16, 8, 16), "action": float32 (7,), ...}
        -> ({"latents": "observation.latent", "action": "action"},
            {"latent_shape": (16, 8, 16), "action_dim": 7})

    ``given`` (``--feature STREAM=FEATURE``) wins; otherwise a stream takes the feature of its
    own name, else the only numeric feature of the right rank (3-D latents, 1-D action);
    anything ambiguous is an error that lists the candidates.
    """

    def numeric(spec: Mapping[str, Any]) -> bool:
        try:
            return np.dtype(spec.get("dtype")).kind == "f"
        except TypeError:
            return False

    def pick(stream: str, rank: int, example: str) -> str:
        if stream in given:
            return given[stream]
        if stream in features:
            return stream
        found = [
            name
            for name, spec in features.items()
            if name not in _LEROBOT_DEFAULT_FEATURES
            and numeric(spec)
            and len(spec.get("shape", ())) == rank
        ]
        if len(found) == 1:
            return found[0]
        shapes = {n: tuple(s.get("shape", ())) for n, s in features.items()}
        raise ValueError(
            f"{where}: cannot tell which feature is the reference model's {stream!r} stream "
            f"({rank}-D float, e.g. {example}): {'candidates ' + str(found) if found else 'none'} "
            f"among {shapes}; pass --feature {stream}=FEATURE"
        )

    mapping = {
        "latents": pick("latents", 3, "(C, H, W) latents"),
        "action": pick("action", 1, "(action_dim,)"),
    }
    sizes: dict[str, Any] = {}
    for stream, feature in mapping.items():
        if feature not in features:
            raise ValueError(
                f"--feature {stream}={feature}: {where} has no feature {feature!r}; its "
                f"features are {sorted(features)}"
            )
        shape = tuple(int(s) for s in features[feature].get("shape", ()))
        rank = 3 if stream == "latents" else 1
        if len(shape) != rank or not numeric(features[feature]):
            raise ValueError(
                f"feature {feature!r} of {where} is {features[feature].get('dtype')} {shape}; "
                f"the reference model's {stream!r} stream needs a {rank}-D float feature"
            )
        sizes["latent_shape" if stream == "latents" else "action_dim"] = (
            shape if stream == "latents" else shape[0]
        )
    return mapping, sizes


def load_episodes(
    config: VerifyConfig, keys: Sequence[str], mapping: Mapping[str, str] | None = None
) -> tuple[list[dict[str, Any]], str]:
    """The first ``config.episodes`` episodes through `LeRobotEpisodes` (the user's path).

    ``mapping`` ``{stream: feature}`` renames features to the model's stream names (with
    their ``_loss_mask``), so ``observation.latent`` reaches the model as ``latents``.
    """
    from packing.lerobot import LeRobotEpisodes

    root, where, features = dataset_features(config)
    mapping = {k: (mapping or {}).get(k, config.features.get(k, k)) for k in keys}
    unknown = sorted(set(config.features) - set(keys))
    if unknown:
        raise ValueError(
            f"--feature {unknown[0]}=...: the model has no stream {unknown[0]!r}; its streams "
            f"are {list(keys)}"
        )
    for stream, feature in mapping.items():
        if feature not in features:
            hint = "" if stream != feature else f"; map it with --feature {stream}=FEATURE"
            raise ValueError(
                f"the model's stream {stream!r} reads feature {feature!r}, which {where} does "
                f"not have (features: {sorted(features)}){hint}"
            )
    feats = list(mapping.values())
    if len(set(feats)) != len(feats):
        raise ValueError(f"two streams read the same feature: {mapping}; map each to its own")
    ds = LeRobotEpisodes(root, keys=feats)
    n = len(ds) if config.episodes is None else config.episodes
    if n > len(ds):
        raise ValueError(f"--episodes {n} > {len(ds)} episodes in {where}")
    renames = {f: s for s, f in mapping.items() if f != s}
    renames |= {f"{f}_loss_mask": f"{s}_loss_mask" for f, s in list(renames.items())}
    return [{renames.get(k, k): v for k, v in ds[i].items()} for i in range(n)], where


def model_and_episodes(
    config: VerifyConfig,
) -> tuple[nn.Module, list[dict[str, Any]], str, dict[str, str]]:
    """(model, episodes, where the data came from, {stream: feature}) for a verify run.

    The reference model (no ``config.model``) is sized from the dataset: its latent shape
    and action width come from the features `reference_streams` picks. Seed torch first:
    the model is initialised here.
    """
    mapping: dict[str, str] = dict(config.features)
    sizes: dict[str, Any] = {}
    if config.model is None:
        _, where, features = dataset_features(config)
        mapping, sizes = reference_streams(features, config.features, where)
    model = build_model(config, sizes)
    names = [s.name for s in model.streams]  # type: ignore[union-attr]
    episodes, where = load_episodes(config, names, mapping)
    return model, episodes, where, mapping


def run_verify(config: VerifyConfig, progress: Callable[[str], None] | None = None) -> VerifyReport:
    """``packing verify``: load data and model, plan packs, compare, check leaks.

    The reference model (no ``config.model``) is sized from the dataset: its latent shape
    and action width come from the features `reference_streams` picks.
    """
    from packing.collate import PackedCollator, Stream
    from packing.plan import plan_packs

    torch.manual_seed(config.seed)
    model, episodes, where, mapping = model_and_episodes(config)
    reference, reference_name = build_reference(config, model)
    streams: list[Stream] = list(model.streams)  # type: ignore[arg-type]

    # One-episode batches pad to a multiple of 128 tokens when every stream's step fits it; a
    # grid of 15 tokens would pad to lcm(128, 15) = 1,920 (3% real), so such streams use 8.
    multiple = 128 if all(128 % s.tokens_per_step == 0 for s in streams) else 8
    unpacked = PackedCollator(streams, pad_to_multiple=multiple)
    lengths = [unpacked([ep]).layout(streams[0].name).num_tokens for ep in episodes]
    tps = streams[0].tokens_per_step  # the budget holds whole steps of the primary stream
    budget = config.token_budget or -(-default_token_budget(lengths) // tps) * tps
    if max(lengths) > budget:
        worst = max(range(len(lengths)), key=lambda i: lengths[i])
        raise ValueError(
            f"episode {episodes[worst].get('episode_index', worst)} has {lengths[worst]:,} "
            f"tokens > --token-budget {budget:,}; raise the budget"
        )
    packs = plan_packs(lengths, budget).packs
    packed = PackedCollator(streams, token_budget=budget)
    info = {
        **asdict(config),
        "features": {s.name: mapping.get(s.name, s.name) for s in streams},
        "model": config.model or DEFAULT_MODEL,
        "dataset": where,
        "token_budget": budget,
        "reference": reference_name,
    }
    return compare_packed_unpacked(
        model,
        episodes,
        collate_unpacked=unpacked,
        collate_packed=packed,
        packs=packs,
        steps=config.steps,
        reduction=config.reduction,
        seed=config.seed,
        lr=config.lr,
        adam_eps=config.adam_eps,
        device=config.device,
        dtype=config.torch_dtype,
        compile=config.compile,
        leak_check=config.leak_check,
        normalise=config.loss_normaliser,
        config=info,
        progress=progress,
        reference=reference,
    )
