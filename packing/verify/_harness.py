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
import functools
import platform
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from packing.attention._compile import call_compiled
from packing.data import PackedBatch
from packing.train import LossNormalizer, local_denominator
from packing.verify._leak import LeakReport, find_leaks
from packing.verify._report import (
    NO_MULTI_EPISODE_PACK,
    GradDiff,
    StepComparison,
    Tolerances,
    VerifyReport,
    build_report,
    record_grad_diffs,
    relative_difference,
    source_sha1,
)

__all__ = [
    "RunOptions",
    "Side",
    "Steps",
    "batch_counts",
    "compare_batches",
    "compare_packed_unpacked",
    "environment",
    "leak_report",
    "run_steps",
    "with_step",
]


Episode = Mapping[str, Any]
Collate = Callable[[Sequence[Episode]], PackedBatch]


# -- the one loop both harnesses run ---------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How both sides train: what `compare_packed_unpacked`'s keywords and `VerifyConfig` say."""

    steps: int = 3
    reduction: str = "episode"
    seed: int = 0
    lr: float = 1e-4
    adam_eps: float = 1e-6
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    compile: bool = False
    leak_check: bool = True
    # "global" (exact), or a planted mistake: "per-micro-step" (each pack's own mean),
    # "per-rank" (each rank's own mean; the distributed run)
    normalise: str = "global"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        if self.normalise not in ("global", "per-micro-step", "per-rank"):
            raise ValueError(
                f"normalise={self.normalise!r}; choose 'global', 'per-micro-step' or 'per-rank'"
            )

    @property
    def autocast(self) -> torch.dtype | None:
        return None if self.dtype == torch.float32 else self.dtype


def with_step(batch: PackedBatch, seed: int, step: int, device: torch.device) -> PackedBatch:
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


def _normalisers(
    model: nn.Module, batches: Sequence[PackedBatch], reduction: str, how: str, dev: torch.device
) -> list[dict[str, LossNormalizer]]:
    """Each micro-step's normaliser per stream.

    ``global``: the step's denominator over every micro-step (and rank: one all_reduce when
    torch.distributed is initialised); ``local``: this process's micro-steps only (the
    unpacked ground truth on rank 0); the planted mistakes ``per-rank`` (a rank's own mean,
    which FSDP then averages) and ``per-micro-step`` (each pack's own mean, then averaged).
    """
    out: list[dict[str, LossNormalizer]] = [{} for _ in batches]
    for s in batches[0].layouts:
        lays = [b.layout(s) for b in batches]
        masks = [_loss_mask(model, b, s) for b in batches]
        red: Any = reduction
        if how == "global":
            norm = LossNormalizer.for_step(lays, red, masks, device=dev)
            norms = [norm] * len(batches)
        elif how in ("local", "per-rank"):
            d = local_denominator(lays, red, masks, device=dev)
            norms = [LossNormalizer(reduction=red, denominator=d)] * len(batches)
        else:  # per-micro-step: this pack's own mean, then an average over micro-steps
            norms = [
                LossNormalizer(
                    reduction=red,
                    denominator=local_denominator(lay, red, m, device=dev) * len(lays),
                )
                for lay, m in zip(lays, masks, strict=True)
            ]
        for i, n in enumerate(norms):
            out[i][s] = n
    return out


@dataclass(frozen=True)
class Side:
    """One way of training the same model: ``call`` (the model or its compiled/sharded
    wrapper) over micro-steps, normalised by ``normalise``, stepped by ``optimizer``.

    ``gradient_sync_last``: FSDP2 reduces gradients once, on the last micro-step.
    ``mean_over_ranks``: the reported loss is the mean of every rank's (FSDP averages).
    ``gather``: how the compared tensors are read (a collective under FSDP).
    """

    model: nn.Module
    call: Callable[[PackedBatch], Any]
    optimizer: torch.optim.Optimizer
    normalise: str
    autocast: torch.dtype | None
    gradient_sync_last: bool = False
    mean_over_ranks: bool = False
    gather: Callable[..., dict[str, Any]] | None = None

    def train_step(
        self, batches: Sequence[PackedBatch], reduction: str, dev: torch.device
    ) -> float:
        """One optimizer step's forward/backward over ``batches``; gradients left in .grad."""
        norms = _normalisers(self.model, batches, reduction, self.normalise, dev)
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for i, b in enumerate(batches):
            if self.gradient_sync_last:
                self.model.set_requires_gradient_sync(i == len(batches) - 1)  # type: ignore[operator]
            with torch.autocast(dev.type, dtype=self.autocast, enabled=self.autocast is not None):
                out = self.call(b)
            if not isinstance(out, Mapping) or not out:
                raise TypeError(
                    f"{type(self.model).__name__}.forward(batch) must return a dict {{stream: "
                    f"per-token loss (T,)}}, got {type(out).__name__}; see docs/verify.md "
                    "(model protocol)"
                )
            loss = torch.zeros((), dtype=torch.float32, device=dev)
            for k, v in out.items():
                lay = b.token_layout(
                    k, v.shape[0], f"the model's loss {k!r}", fix="key per-token losses by stream"
                )
                loss = loss + norms[i][k](v, lay, _loss_mask(self.model, b, k))
            loss.backward()
            total += loss.detach().double()
        if self.mean_over_ranks:
            torch.distributed.all_reduce(total)
            total /= torch.distributed.get_world_size()
        return float(total)

    def grads(self) -> dict[str, torch.Tensor | None]:
        if self.gather is not None:
            return self.gather(self.model, grads=True)
        return {n: p.grad for n, p in self.model.named_parameters()}

    def parameters(self) -> dict[str, torch.Tensor]:
        if self.gather is not None:
            return {n: t for n, t in self.gather(self.model).items() if t is not None}
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


@dataclass
class Steps:
    """What the loop measured: a record per step, the worst gradient per parameter, failures."""

    records: list[StepComparison]
    worst: dict[str, GradDiff]
    failures: list[str]


def run_steps(
    unpacked: Side | None,
    packed: Side,
    singles: Sequence[PackedBatch],
    packs: Sequence[PackedBatch],
    opts: RunOptions,
    tol: Tolerances,
    say: Callable[[str], None],
    *,
    noise_seed: int | None = None,
) -> Steps:
    """The comparison loop of both harnesses: every step, packed then unpacked, compared.

    Both halves start from the same global RNG state: anything that does not depend on
    packing draws the same numbers, so a difference can only come from packing. Under FSDP
    every rank runs the packed half (``packed.grads()`` is a collective) and only rank 0 the
    unpacked one (``unpacked`` is None elsewhere). ``noise_seed``: the packed run's RNG key
    (``--noise-key rank`` plants a rank-dependent one).
    """
    dev = opts.device
    out = Steps([], {}, [])
    for s in range(opts.steps):
        torch.manual_seed(opts.seed * 1_000_003 + s)
        bp = [with_step(b, opts.seed if noise_seed is None else noise_seed, s, dev) for b in packs]
        _sync(dev)
        t0 = time.perf_counter()
        loss_p = packed.train_step(bp, opts.reduction, dev)
        _sync(dev)
        sec_p = time.perf_counter() - t0
        grads_p = packed.grads()
        say(f"step {s}: packed, {len(bp)} micro-steps, loss {loss_p:.8g}, {sec_p:.1f} s")
        if unpacked is not None:
            torch.manual_seed(opts.seed * 1_000_003 + s)
            bu = [with_step(b, opts.seed, s, dev) for b in singles]
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                # One episode per micro-step has one shape per episode length by design; the
                # library's "give every pack one shape" advice is for packed runs.
                warnings.filterwarnings("ignore", message=r"packing\.attention: FlexAttention has")
                loss_u = unpacked.train_step(bu, opts.reduction, dev)
            _sync(dev)
            sec_u = time.perf_counter() - t0
            say(f"step {s}: unpacked, {len(bu)} micro-steps, loss {loss_u:.8g}, {sec_u:.1f} s")
            rel = relative_difference(
                torch.tensor([loss_p], dtype=torch.float64),
                torch.tensor([loss_u], dtype=torch.float64),
            )
            out.records.append(
                StepComparison(
                    step=s,
                    loss_unpacked=loss_u,
                    loss_packed=loss_p,
                    loss_rel=rel,
                    micro_steps_unpacked=len(bu),
                    micro_steps_packed=len(bp),
                    seconds_unpacked=sec_u,
                    seconds_packed=sec_p,
                )
            )
            out.failures += record_grad_diffs(out.worst, unpacked.grads(), grads_p, s, tol)
            unpacked.optimizer_step()
        packed.optimizer_step()
    return out


# -- the single-process harness --------------------------------------------------------------------
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
    opts = RunOptions(
        steps=steps,
        reduction=reduction,
        seed=seed,
        lr=lr,
        adam_eps=adam_eps,
        device=torch.device(device),
        dtype=dtype,
        compile=compile,
        leak_check=leak_check,
        normalise=normalise,
    )
    _check_packs(packs, len(episodes))
    # Collate once; the data are the same every step, only extras["step"] (the noise) changes.
    singles = [collate_unpacked([ep]) for ep in episodes]
    packed = [collate_packed([episodes[i] for i in p]) for p in packs]
    return compare_batches(
        model,
        reference,
        singles,
        packed,
        [list(p) for p in packs],
        opts,
        tolerances=tolerances,
        config=config,
        progress=progress,
    )


def compare_batches(
    model: nn.Module,
    reference: nn.Module | None,
    singles: Sequence[PackedBatch],
    packed: Sequence[PackedBatch],
    packs: Sequence[Sequence[int]],
    opts: RunOptions,
    *,
    tolerances: Tolerances | None = None,
    config: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> VerifyReport:
    """`compare_packed_unpacked` on batches already collated (``packing verify`` calls this)."""
    say = progress or (lambda _line: None)
    tol = tolerances or Tolerances.for_dtype(opts.dtype)
    side_u, side_p = _sides(model, reference, opts)
    steps = run_steps(side_u, side_p, singles, packed, opts, tol, say)

    def leak() -> tuple[LeakReport | None, list[str]]:
        return _leak_check_of_first_pack(side_p.model, packed, opts, say)

    return build_report(
        config=dict(config or {}),
        tolerances=tol,
        steps=steps,
        params_u=side_u.parameters(),
        params_p=side_p.parameters(),
        leak_check=leak if opts.leak_check else None,
        counts=batch_counts(singles, packs, sum(b.layout(b.primary).padded_len for b in packed)),
        environment=environment(opts.device),
        planned_steps=opts.steps,
    )


def _sides(model: nn.Module, reference: nn.Module | None, opts: RunOptions) -> tuple[Side, Side]:
    """Two models from the same weights: ``reference`` unpacked and ``model`` packed, or
    ``model`` unpacked and a deep copy of it packed."""
    dev = opts.device
    if reference is None:
        model_u = model.to(dev)
        model_p = copy.deepcopy(model_u)
    else:
        model_u, model_p = reference.to(dev), model.to(dev)
        _check_same_parameters(model_p, model_u)
    sides = []
    for m, dynamic, how in ((model_u, True, "global"), (model_p, False, opts.normalise)):
        m.train()
        call = torch.compile(m, dynamic=dynamic) if opts.compile else m
        sides.append(
            Side(
                model=m,
                # With --compile, a model past dynamo's recompile limit would silently run eager.
                call=functools.partial(call_compiled, call),
                optimizer=torch.optim.AdamW(m.parameters(), lr=opts.lr, eps=opts.adam_eps),
                normalise=how,
                autocast=opts.autocast,
            )
        )
    return sides[0], sides[1]


def _check_packs(packs: Sequence[Sequence[int]], n: int) -> None:
    flat = sorted(i for p in packs for i in p)
    if flat != list(range(n)):
        raise ValueError(
            f"packs must hold every episode position 0..{n - 1} exactly once, got "
            f"{[list(p) for p in packs]}"
        )


def _leak_check_of_first_pack(
    model: nn.Module, packs: Sequence[PackedBatch], opts: RunOptions, say: Callable[[str], None]
) -> tuple[LeakReport | None, list[str]]:
    """(the leak report of the first pack of >= 2 episodes, [] ) or (None, [why not])."""
    multi = [b for b in packs if b.num_docs >= 2]
    if not multi:
        return None, [NO_MULTI_EPISODE_PACK]
    model.eval()
    say(f"leak check on a pack of {multi[0].num_docs} episodes")
    batch = with_step(multi[0], opts.seed, 0, opts.device)
    return leak_report(model, batch, opts.autocast, opts.device), []


def batch_counts(
    singles: Sequence[PackedBatch], packs: Sequence[Sequence[int]], padded_tokens_packed: int
) -> dict[str, Any]:
    """The report's token and pack counts (primary stream) of one step."""
    primary = singles[0].primary
    return {
        "episodes": len(singles),
        "tokens": sum(b.layout(primary).num_tokens for b in singles),
        "padded_tokens_unpacked": sum(b.layout(primary).padded_len for b in singles),
        "padded_tokens_packed": padded_tokens_packed,
        "packs": len(packs),
        "pack_sizes": [len(p) for p in packs],
    }


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


def leak_report(
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


def environment(dev: torch.device) -> dict[str, str]:
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

    from packing.attention import fa4_available

    if not fa4_available():
        return "not importable"
    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return "importable (version unknown)"
