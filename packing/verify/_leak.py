"""Leak detector: perturb one episode of a pack and prove no other episode notices.

A packed model is correct only if episode ``i``'s outputs, and the gradients with respect to
episode ``i``'s inputs, depend on nothing but episode ``i``. ``find_leaks`` checks that directly:
for every document ``j`` of a pack (and the padding tail), it adds noise to ``j``'s rows of
each input stream, runs the function again, and compares every other document's rows,
bit for bit (fp32 on CPU is exact: a masked-out key contributes an exact ``0``).

Three episodes of lengths ``[2, 4, 3]`` padded to ``T = 12``, perturbing ``j = 1``::

    inputs      a a B B B B c c c . . .      (B: episode 1's rows, noised)
    doc_ids     0 0 1 1 1 1 2 2 2 -1 -1 -1
    outputs     = =  (free)  = = =  (free)   "=" must be bit-identical to the clean run

The gradient check backpropagates a fixed random projection of all outputs and compares
``d/d inputs`` on the rows of every ``i != j``; it catches leaks that only exist in a backward
pass (a wrong custom kernel) and leaks in the other direction (``j`` reads ``i``).

Use it in your own tests::

    report = find_leaks(model.predict, batch)      # or any fn(PackedBatch) -> {stream: (T, ...)}
    report.raise_if_leaking()
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from packing.data import PackedBatch, StreamLayout

__all__ = ["Leak", "LeakReport", "assert_no_leaks", "find_leaks"]

PADDING = -1  # the "source" of a leak from the padding tail


LeakKind = Literal["output", "gradient"]


@dataclass(frozen=True, kw_only=True)
class Leak:
    """Perturbing ``source`` (doc position in the pack, -1 = padding) changed ``target``."""

    source: int
    target: int
    input_stream: str
    output: str
    kind: LeakKind
    max_abs_diff: float

    def describe(self, episode_index: Sequence[int]) -> str:
        src = "padding" if self.source == PADDING else f"doc {self.source}"
        if self.source != PADDING:
            src += f" (episode {episode_index[self.source]})"
        what = (
            f"output {self.output!r}"
            if self.kind == "output"
            else f"gradient w.r.t. input {self.output!r}"
        )
        return (
            f"perturbing {src} in {self.input_stream!r} changed {what} of doc {self.target} "
            f"(episode {episode_index[self.target]}) by up to {self.max_abs_diff:.3g}"
        )


@dataclass(frozen=True, kw_only=True)
class LeakReport:
    """What ``find_leaks`` checked and every (source, target) pair that leaked."""

    leaks: tuple[Leak, ...]
    num_docs: int
    episode_index: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    perturbations: int
    comparisons: int
    gradients: bool
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.leaks

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """Distinct (target i, source j) pairs that leaked, in doc positions (j = -1: padding)."""
        return sorted({(lk.target, lk.source) for lk in self.leaks})

    def summary(self, limit: int = 8) -> str:
        head = (
            f"leak check: {self.num_docs} docs, inputs {list(self.inputs)}, outputs "
            f"{list(self.outputs)}, {self.perturbations} perturbations, {self.comparisons} "
            f"comparisons{' (+gradients)' if self.gradients else ''}: "
        )
        if self.ok:
            return head + "no leaks"
        lines = [head + f"{len(self.leaks)} LEAKS, pairs (i <- j) {self.pairs}"]
        lines += ["  " + lk.describe(self.episode_index) for lk in self.leaks[:limit]]
        if len(self.leaks) > limit:
            lines.append(f"  ... and {len(self.leaks) - limit} more")
        return "\n".join(lines)

    def raise_if_leaking(self) -> None:
        if not self.ok:
            raise AssertionError(
                self.summary()
                + "\nfix: every op that mixes tokens (attention, pooling, normalisation over the"
                " sequence, conv) must be restricted to one document; check the document mask"
            )

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "num_docs": self.num_docs,
            "episode_index": list(self.episode_index),
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "perturbations": self.perturbations,
            "comparisons": self.comparisons,
            "gradients": self.gradients,
            "pairs": [list(p) for p in self.pairs],
            "leaks": [
                {
                    "source": lk.source,
                    "target": lk.target,
                    "input_stream": lk.input_stream,
                    "output": lk.output,
                    "kind": lk.kind,
                    "max_abs_diff": lk.max_abs_diff,
                }
                for lk in self.leaks
            ],
            "notes": list(self.notes),
        }


def _step_rows(layout: StreamLayout) -> list[tuple[int, int]]:
    """Row ranges of each document in a stream's (step-level) data tensor."""
    bounds, start = [], 0
    for steps in layout.steps_K:
        bounds.append((start, start + steps))
        start += steps
    return bounds


def _with_streams(batch: PackedBatch, new: Mapping[str, torch.Tensor]) -> PackedBatch:
    return replace(batch, streams={**batch.streams, **new})


def _output_layout(
    batch: PackedBatch, key: str, value: torch.Tensor, output_layouts: Mapping[str, str]
) -> StreamLayout:
    return batch.token_layout(
        output_layouts.get(key, key),
        value.shape[0],
        f"output {key!r}",
        fix=f"pass output_layouts={{{key!r}: '<stream whose token layout it has>'}}",
    )


def _leak(source: int, target: int, stream: str, output: str, kind: LeakKind, diff: float) -> Leak:
    return Leak(
        source=source,
        target=target,
        input_stream=stream,
        output=output,
        kind=kind,
        max_abs_diff=diff,
    )


def _doc_rows(layout: StreamLayout, target: int) -> slice:
    start = sum(layout.lengths_K[:target])
    return slice(start, start + layout.lengths_K[target])


def _perturbed_run(
    run: Any,
    clean: dict[str, torch.Tensor],
    name: str,
    j: int,
    rows: list[tuple[int, int]],
    gen: torch.Generator,
    scale: float,
) -> Any:
    """The outputs with stream ``name``'s rows of document ``j`` (or the padding) moved by
    noise of ``scale`` times their spread; None when there is nothing to move."""
    x = clean[name]
    lo, hi = (rows[-1][1], x.shape[0]) if j == PADDING else rows[j]
    if hi <= lo:
        return None
    noise = torch.randn(x[lo:hi].shape, generator=gen).to(x.device, x.dtype)
    spread = x[lo:hi].float().std().nan_to_num(1.0).clamp_min(1e-3).item()
    xp = x.clone()
    xp[lo:hi] = x[lo:hi] + noise * scale * spread
    return run({**clean, name: xp})


def find_leaks(
    fn: Callable[[PackedBatch], Mapping[str, torch.Tensor]],
    batch: PackedBatch,
    *,
    inputs: Sequence[str] | None = None,
    output_layouts: Mapping[str, str] | None = None,
    gradients: bool = True,
    padding: bool = True,
    scale: float = 1.0,
    atol: float = 0.0,
    rtol: float = 0.0,
    noise_floor: float | None = None,
    deterministic: bool = True,
    seed: int = 0,
) -> LeakReport:
    """Perturb each document's inputs and report every other document whose outputs moved.

    ``fn(batch)`` returns per-token tensors keyed by stream name (``model.predict``, or a packed
    model's per-token losses), sequence axis first at that stream's token level; a key that is
    not a stream needs ``output_layouts={key: stream}``. ``inputs`` are the floating streams to
    perturb (default: all of them). ``fn`` must be deterministic (eval mode, per-episode noise
    from ``packing.train._conditioning``): it is run once more to check that first.

    ``atol=0, rtol=0`` demand bit-identical rows: right on CPU in any dtype (a masked-out key
    contributes an exact 0; nothing else depends on the other episode's values). Where kernels
    are not bitwise deterministic (atomic accumulation in a GPU backward), pass
    ``noise_floor=10``: the two clean runs measure the run-to-run noise of each output and
    gradient, and a change counts as a leak only above 10x that (still 0 when the kernels
    turn out deterministic), or above ``atol + rtol * max|clean value|`` if larger.

    ``deterministic`` runs ``fn`` and its backward under
    ``torch.use_deterministic_algorithms(True, warn_only=True)``, so kernels that have a
    deterministic mode use it (FA4's backward through `packing.attention._packed`, ``index_add``).
    Without it, on an H200, FA4's atomic dQ accumulation gave two identical clean runs and
    then a 1-ulp bf16 change in episode 0's gradient after perturbing episode 1: a leak by the
    letter, noise in fact. Returns a ``LeakReport``; ``report.raise_if_leaking()`` turns it
    into a test failure naming the episode pairs.
    """
    num_docs = batch.num_docs
    if num_docs < 2:
        raise ValueError(
            f"find_leaks needs a pack of >= 2 episodes, got {num_docs}; collate more episodes"
        )
    names = _input_streams(batch, inputs)
    gen = torch.Generator().manual_seed(seed)
    layouts, weights = _projection(fn, batch, output_layouts or {}, gen)
    run = _Runner(fn, batch, weights, gradients, deterministic)
    clean = {k: batch.streams[k].detach() for k in names}
    base = run(clean)
    tol, notes = _tolerances(base, run(clean), atol, rtol, noise_floor)

    input_rows = {k: _step_rows(batch.layout(k)) for k in names}
    sources = list(range(num_docs)) + ([PADDING] if padding else [])
    leaks: list[Leak] = []
    perturbations = comparisons = 0
    for name in names:
        for j in sources:
            moved = _perturbed_run(run, clean, name, j, input_rows[name], gen, scale)
            if moved is None:  # the stream has no padding rows
                continue
            found, compared = _compare_others(
                base, moved, j, name, num_docs, layouts, input_rows, tol
            )
            leaks += found
            perturbations, comparisons = perturbations + 1, comparisons + compared
    notes += ["padding was not perturbed"] * (not padding)
    notes += ["ran under torch.use_deterministic_algorithms(True, warn_only=True)"] * deterministic
    return LeakReport(
        leaks=tuple(leaks),
        num_docs=num_docs,
        episode_index=batch.episode_ids,
        inputs=tuple(names),
        outputs=tuple(layouts),
        perturbations=perturbations,
        comparisons=comparisons,
        gradients=gradients,
        notes=tuple(notes),
    )


def _projection(
    fn: Callable[[PackedBatch], Mapping[str, torch.Tensor]],
    batch: PackedBatch,
    output_layouts: Mapping[str, str],
    gen: torch.Generator,
) -> tuple[dict[str, StreamLayout], dict[str, torch.Tensor]]:
    """Each output's stream layout, and a fixed random projection of every output so that
    no two leaks cancel in the objective."""
    with torch.no_grad():
        probe = dict(fn(batch))
    if not probe:
        raise ValueError("fn returned no outputs")
    layouts = {k: _output_layout(batch, k, v, output_layouts) for k, v in probe.items()}
    weights = {
        k: torch.randn(v.shape, generator=gen).to(device=v.device, dtype=torch.float32)
        for k, v in probe.items()
    }
    return layouts, weights


def _input_streams(batch: PackedBatch, inputs: Sequence[str] | None) -> list[str]:
    """The floating streams to perturb: ``inputs``, checked, or every floating stream."""
    names = (
        list(inputs)
        if inputs is not None
        else [k for k, v in batch.streams.items() if v.is_floating_point()]
    )
    for name in names:
        if name not in batch.streams:
            raise KeyError(f"input {name!r} is not a stream; streams are {list(batch.streams)}")
        if not batch.streams[name].is_floating_point():
            raise ValueError(
                f"input stream {name!r} has dtype {batch.streams[name].dtype}; only floating "
                "streams can be perturbed (drop it from inputs=)"
            )
    if not names:
        raise ValueError("no floating input stream to perturb; pass inputs=[...]")
    return names


@dataclass(frozen=True)
class _Run:
    """One call of ``fn``: its outputs and the gradients of the projected objective with
    respect to each perturbed input stream (empty without ``gradients``)."""

    outputs: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]


@dataclass(frozen=True)
class _Runner:
    """Runs ``fn`` on ``batch`` with some input streams replaced; the objective of the
    gradient check is ``sum(output * weights)`` over every output that requires grad."""

    fn: Callable[[PackedBatch], Mapping[str, torch.Tensor]]
    batch: PackedBatch
    weights: Mapping[str, torch.Tensor]
    gradients: bool
    deterministic: bool

    def __call__(self, streams: Mapping[str, torch.Tensor]) -> _Run:
        leaf = {k: v.detach().clone().requires_grad_(self.gradients) for k, v in streams.items()}
        with torch.set_grad_enabled(self.gradients), _deterministic_algorithms(self.deterministic):
            out = dict(self.fn(_with_streams(self.batch, leaf)))
            grads: dict[str, torch.Tensor] = {}
            if self.gradients:
                objective = sum(
                    (o.float() * self.weights[k]).sum() for k, o in out.items() if o.requires_grad
                )
                if not isinstance(objective, torch.Tensor):
                    raise ValueError("no output of fn requires grad; pass gradients=False")
                got = torch.autograd.grad(objective, list(leaf.values()), allow_unused=True)
                grads = {
                    k: (torch.zeros_like(leaf[k]) if g is None else g.detach())
                    for k, g in zip(leaf, got, strict=True)
                }
        return _Run({k: v.detach() for k, v in out.items()}, grads)


# (kind, output or input name) -> the largest change that is not a leak
Tolerance = dict[tuple[str, str], float]


def _tolerances(
    base: _Run, again: _Run, atol: float, rtol: float, noise_floor: float | None
) -> tuple[Tolerance, list[str]]:
    """Per (kind, name) the change that counts as a leak, from two clean runs; raises if they
    differ by more than that (``fn`` is not deterministic). Returns (tolerances, notes)."""
    tol: Tolerance = {("output", k): atol + rtol * _maxabs(v) for k, v in base.outputs.items()}
    tol |= {("gradient", k): atol + rtol * _maxabs(v) for k, v in base.grads.items()}
    notes: list[str] = []
    if noise_floor is not None:
        for kind, clean, rerun in (
            ("output", base.outputs, again.outputs),
            ("gradient", base.grads, again.grads),
        ):
            for k in clean:
                floor = _maxdiff(clean[k], rerun[k])
                tol[kind, k] = max(tol[kind, k], noise_floor * floor)
                if floor:
                    notes.append(f"{kind} {k!r}: run-to-run noise {floor:.3g}")
    for k in base.outputs:
        if _maxdiff(base.outputs[k], again.outputs[k]) > tol["output", k]:
            raise ValueError(
                f"fn is not deterministic: output {k!r} differs between two identical calls; "
                "use eval mode (no dropout) and draw noise per episode from packing.train._conditioning"
                ", not from the global RNG (on GPU, pass atol/rtol for non-deterministic kernels)"
            )
    for k in base.grads:
        if _maxdiff(base.grads[k], again.grads[k]) > tol["gradient", k]:
            raise ValueError(
                f"gradient w.r.t. {k!r} differs between two identical calls; on GPU pass "
                "atol/rtol for kernels with atomic accumulation"
            )
    return tol, notes


def _compare_others(
    base: _Run,
    moved: _Run,
    source: int,
    stream: str,
    num_docs: int,
    layouts: Mapping[str, StreamLayout],
    input_rows: Mapping[str, list[tuple[int, int]]],
    tol: Tolerance,
) -> tuple[list[Leak], int]:
    """The leaks of perturbing document ``source`` of ``stream``: every other document whose
    output rows or input-gradient rows moved past ``tol``. Returns (leaks, comparisons)."""
    leaks: list[Leak] = []
    comparisons = 0
    for i in range(num_docs):
        if i == source:
            continue
        for k, lay in layouts.items():
            sl = _doc_rows(lay, i)
            comparisons += 1
            diff = _maxdiff(base.outputs[k][sl], moved.outputs[k][sl])
            if diff > tol["output", k]:
                leaks.append(_leak(source, i, stream, k, "output", diff))
        for g, gv in moved.grads.items():
            glo, ghi = input_rows[g][i]
            comparisons += 1
            diff = _maxdiff(base.grads[g][glo:ghi], gv[glo:ghi])
            if diff > tol["gradient", g]:
                leaks.append(_leak(source, i, stream, g, "gradient", diff))
    return leaks, comparisons


@contextmanager
def _deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Turn on torch's deterministic algorithms (warn-only) for the block, then restore."""
    if not enabled or torch.are_deterministic_algorithms_enabled():
        yield
        return
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            # warn_only's per-op notices ("... does not have a deterministic implementation",
            # cuBLAS's workspace hint): any nondeterminism left is measured by the two clean
            # runs (noise_floor), so the notices would only repeat on every call.
            warnings.filterwarnings("ignore", message=".*does not have a deterministic")
            warnings.filterwarnings("ignore", message="Deterministic behavior was enabled")
            yield
    finally:
        torch.use_deterministic_algorithms(False)


def _maxabs(t: torch.Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    if torch.equal(a, b):
        return 0.0
    d = (a.double() - b.double()).abs()
    # NaN where one side is NaN counts as an infinite change.
    return float(d.nan_to_num(nan=float("inf")).max())


def assert_no_leaks(
    fn: Callable[[PackedBatch], Mapping[str, torch.Tensor]], batch: PackedBatch, **kwargs: object
) -> LeakReport:
    """``find_leaks(...)`` then raise ``AssertionError`` naming the leaking pairs, if any."""
    report = find_leaks(fn, batch, **kwargs)  # type: ignore[arg-type]
    report.raise_if_leaking()
    return report
