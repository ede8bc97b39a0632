"""`packing verify`: train the same episodes packed and unpacked and prove nothing changed.

Two copies of one model (``deepcopy`` of the same initial weights) take ``steps`` AdamW steps
on the same episodes::

    unpacked   one episode per micro-step, gradient accumulation     (the baseline)
               step s:  [e0] [e1] [e2] [e3] [e4]  -> optimizer.step()
    packed     K episodes per micro-step, planned under a token budget
               step s:  [e0 e3 e4 ....] [e1 e2 ..]  -> optimizer.step()

Both reduce the model's per-token losses with the same `packing.train._losses.LossNormalizer`
(global denominator over the micro-steps of a step), and both give the model the same
``batch.extras["seed"]`` / ``["step"]``, so per-episode noise and timesteps are identical.
After every step the harness compares, with ``rel(a, b) = max|a - b| / max|b|`` (b = unpacked):

- the step's loss;
- every parameter's gradient (relative difference, and cosine similarity);
- after the last step, the parameters (all of them as one vector; the worst tensor is shown).

A leak check (`packing.verify._leak.find_leaks`) on the first pack proves no episode sees another.
The run passes only if every number is within `Tolerances.for_dtype` (fp32: loss 1e-6,
gradients 1e-5, parameters 1e-5; bf16/fp16: loss 5e-3, gradient cosine >= 0.999).

This module is the harness; the measurements and gates are in `packing.verify._report`, the
command (options, model factory, dataset) in `packing.verify._command`.
"""

from __future__ import annotations

import copy
import math
import platform
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from packing.attention._compile import call_compiled
from packing.data._layout import PackedBatch
from packing.train._losses import LossNormalizer, reduce_loss
from packing.verify._leak import LeakReport, find_leaks
from packing.verify._report import (
    GradDiff,
    StepComparison,
    Tolerances,
    VerifyReport,
    both_diverged_at,
    grad_badness,
    judge,
    nonfinite_tensors,
    parameter_difference,
    params_diverged,
    record_grad_diffs,
    relative_difference,
    source_sha1,
)

__all__ = ["compare_packed_unpacked"]


Episode = Mapping[str, Any]
Collate = Callable[[Sequence[Episode]], PackedBatch]


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
    _check_packs(packs, len(episodes))
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    autocast = None if dtype == torch.float32 else dtype

    # Collate once; the data are the same every step, only extras["step"] (the noise) changes.
    singles = [collate_unpacked([ep]) for ep in episodes]
    packed = [collate_packed([episodes[i] for i in p]) for p in packs]
    runs = _Runs.build(model, reference, dev, compile=compile, lr=lr, adam_eps=adam_eps)

    records: list[StepComparison] = []
    worst: dict[str, GradDiff] = {}
    failures: list[str] = []
    diverged = ""
    for s in range(steps):
        bu = [_with_step(b, seed, s, dev) for b in singles]
        bp = [_with_step(b, seed, s, dev) for b in packed]
        record = _step_both(runs, bu, bp, s, seed, reduction, autocast, dev, normalise, say)
        records.append(record)
        if not (math.isfinite(record.loss_unpacked) or math.isfinite(record.loss_packed)):
            # Both runs blew up the same way: that says nothing about packing, and every
            # difference from here on would be nan - nan.
            diverged = both_diverged_at(s, record.loss_unpacked, record.loss_packed)
            break
        failures += record_grad_diffs(worst, *runs.grads(), s, tol)
        runs.optimizer_step()

    grads = sorted(worst.values(), key=lambda g: grad_badness(g, tol), reverse=True)
    params_u, params_p = runs.parameters()
    param_rel, param_worst, param_worst_rel = parameter_difference(params_u, params_p)
    diverged = diverged or _diverged_at_end(params_u, params_p, len(records), failures)
    leak = None
    if leak_check and not diverged:
        leak, impossible = _leak_check_of_first_pack(runs.model_p, packed, seed, autocast, dev, say)
        failures += impossible
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


def _diverged_at_end(
    params_u: Mapping[str, torch.Tensor],
    params_p: Mapping[str, torch.Tensor],
    steps: int,
    failures: list[str],
) -> str:
    """The divergence verdict when both runs end with non-finite parameters ("" otherwise);
    non-finite parameters in one run only are appended to ``failures``."""
    nonfinite = {"unpacked": nonfinite_tensors(params_u), "packed": nonfinite_tensors(params_p)}
    diverged = params_diverged(steps, nonfinite["unpacked"], nonfinite["packed"])
    for run in ("packed", "unpacked"):
        if nonfinite[run] and not diverged:
            failures.append(
                f"{len(nonfinite[run])} parameter tensors are non-finite in the {run} run only "
                f"(e.g. {nonfinite[run][0]})"
            )
    return diverged


def _check_packs(packs: Sequence[Sequence[int]], n: int) -> None:
    flat = sorted(i for p in packs for i in p)
    if flat != list(range(n)):
        raise ValueError(
            f"packs must hold every episode position 0..{n - 1} exactly once, got "
            f"{[list(p) for p in packs]}"
        )


@dataclass(frozen=True)
class _Runs:
    """The two sides: ``u`` unpacked (the baseline), ``p`` packed; each a model, what is
    called (the model or its ``torch.compile`` wrapper) and an AdamW optimizer."""

    model_u: nn.Module
    model_p: nn.Module
    call_u: nn.Module
    call_p: nn.Module
    opt_u: torch.optim.Optimizer
    opt_p: torch.optim.Optimizer

    @classmethod
    def build(
        cls,
        model: nn.Module,
        reference: nn.Module | None,
        dev: torch.device,
        *,
        compile: bool,
        lr: float,
        adam_eps: float,
    ) -> _Runs:
        """Two models from the same weights: ``reference`` unpacked and ``model`` packed, or
        ``model`` unpacked and a deep copy of it packed."""
        if reference is None:
            model_u = model.to(dev)
            model_p = copy.deepcopy(model_u)
        else:
            model_u, model_p = reference.to(dev), model.to(dev)
            _check_same_parameters(model_p, model_u)
        model_u.train()
        model_p.train()
        call_u: nn.Module = torch.compile(model_u, dynamic=True) if compile else model_u  # type: ignore[assignment]
        call_p: nn.Module = torch.compile(model_p, dynamic=False) if compile else model_p  # type: ignore[assignment]
        return cls(
            model_u=model_u,
            model_p=model_p,
            call_u=call_u,
            call_p=call_p,
            opt_u=torch.optim.AdamW(model_u.parameters(), lr=lr, eps=adam_eps),
            opt_p=torch.optim.AdamW(model_p.parameters(), lr=lr, eps=adam_eps),
        )

    def grads(self) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None]]:
        """(unpacked, packed) gradients by the unpacked model's parameter names."""
        params_p = dict(self.model_p.named_parameters())
        grads_u = {n: p.grad for n, p in self.model_u.named_parameters()}
        return grads_u, {n: params_p[n].grad for n in grads_u}

    def parameters(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(unpacked, packed) parameters, detached, each by its own model's names."""
        return (
            {n: p.detach() for n, p in self.model_u.named_parameters()},
            {n: p.detach() for n, p in self.model_p.named_parameters()},
        )

    def optimizer_step(self) -> None:
        for opt in (self.opt_u, self.opt_p):
            opt.step()
            opt.zero_grad(set_to_none=True)


def _step_both(
    runs: _Runs,
    bu: Sequence[PackedBatch],
    bp: Sequence[PackedBatch],
    step: int,
    seed: int,
    reduction: str,
    autocast: torch.dtype | None,
    dev: torch.device,
    normalise: str,
    say: Callable[[str], None],
) -> StepComparison:
    """One optimizer step's forward/backward, unpacked then packed; gradients left in
    ``.grad``. Both halves start from the same global RNG state: anything that does not
    depend on packing draws the same numbers, so a difference can only come from packing."""
    torch.manual_seed(seed * 1_000_003 + step)
    with warnings.catch_warnings():
        # One episode per micro-step has one shape per episode length by design; the
        # library's "give every pack one shape" advice is for packed runs.
        warnings.filterwarnings("ignore", message=r"packing\.attention: FlexAttention has")
        loss_u, sec_u = _train_step(
            runs.call_u, bu, reduction=reduction, autocast=autocast, device=dev
        )
    say(f"step {step}: unpacked, {len(bu)} micro-steps, loss {loss_u:.8g}, {sec_u:.1f} s")
    torch.manual_seed(seed * 1_000_003 + step)
    loss_p, sec_p = _train_step(
        runs.call_p, bp, reduction=reduction, autocast=autocast, device=dev,
        normalise=normalise,
    )  # fmt: skip
    say(f"step {step}: packed, {len(bp)} micro-steps, loss {loss_p:.8g}, {sec_p:.1f} s")
    return StepComparison(
        step=step,
        loss_unpacked=loss_u,
        loss_packed=loss_p,
        loss_rel=relative_difference(
            torch.tensor([loss_p], dtype=torch.float64), torch.tensor([loss_u], dtype=torch.float64)
        ),
        micro_steps_unpacked=len(bu),
        micro_steps_packed=len(bp),
        seconds_unpacked=sec_u,
        seconds_packed=sec_p,
    )


def _leak_check_of_first_pack(
    model: nn.Module,
    packs: Sequence[PackedBatch],
    seed: int,
    autocast: torch.dtype | None,
    dev: torch.device,
    say: Callable[[str], None],
) -> tuple[LeakReport | None, list[str]]:
    """(the leak report of the first pack of >= 2 episodes, [] ) or (None, [why not])."""
    multi = [b for b in packs if b.num_docs >= 2]
    if not multi:
        return None, ["leak check impossible: no pack holds >= 2 episodes; lower the budget"]
    model.eval()
    say(f"leak check on a pack of {multi[0].num_docs} episodes")
    return _leak_check(model, _with_step(multi[0], seed, 0, dev), autocast, dev), []


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
        "packing_src_sha1": source_sha1(),
        "command": _command_line(),
    }
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
        # with the model's head dim this says which kernel `auto` ran (FA4 varlen or Flex)
        env["flash_attn_4"] = _fa4_version()
    return env


def _command_line() -> str:
    """How this process was started: ``python -m packing verify ...`` for the CLI (whose
    argv[0] is the package's ``__main__.py``), else argv as given."""
    head, *rest = sys.argv or [""]
    if head.endswith("__main__.py"):
        head = "python -m packing"
    return " ".join([head, *rest])


def _fa4_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from packing.attention._packed import fa4_available

    if not fa4_available():
        return "not importable"
    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return "importable (version unknown)"
