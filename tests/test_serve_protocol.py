"""The engine's per-model protocol, as its specification: a small model written here, outside
`packing.serve`, served through `packing.serve.protocol` and `Engine.from_packs` only.

The model is a per-token MLP velocity over video tokens and action tokens, with one summary
per request (the mean of its tokens' features plus its task embedding) added to each of its
tokens: the only way its tokens see each other, and a way a leak across requests would show.
Its `ToyPacks` owns one set of static buffers per `ToyShape` and takes each request's solver
update (the public `FlowScheduler`, here its 2nd-order multistep) at the request's own step. Every request served packed, with
others joining mid-run at other lengths and step counts, must equal the same request run
alone by a plain loop (`alone`), to 1e-6 in fp32 on the CPU; two broken implementations (rows
laid out one off, a summary pooled over the whole pack) must not; and a request whose state
goes non-finite (or whose model call raises) fails alone.

    pack   video rows  v v v v | v v | v v v v v v | . .     slot_v  0 0 0 0 1 1 2 2 2 2 2 2 -1 -1
           action rows a a a | a a a a | a a | .              slot_a  0 0 0 1 1 1 1 2 2 -1
           request     0 (step 3/4)   1 (step 0/2)   2 (step 5/6)
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from packing.serve import Engine, FlowScheduler, Result
from packing.serve.protocol import (
    Packs,
    Spans,
    Steps,
    check_request_tensor,
    check_seed,
    host_copy,
    quarantine,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # a tiny model, 2 busy cores

VIDEO, ACTION, HIDDEN = 4, 3, 8  # a video token's features, an action's, the MLP's width
TPF = 2  # video tokens per frame
MAX_STEPS = 8
TOL = dict(rtol=1e-6, atol=1e-6)


# -- the model's request, shape and velocity ------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ToyRequest:
    """One chunk: ``frames`` video frames (``TPF`` tokens each) and ``actions`` actions to
    generate from noise keyed by ``seed``, conditioned on ``task`` ``(HIDDEN,)``."""

    task: Tensor
    frames: int
    actions: int
    seed: int = 0
    steps: int = 4

    def __post_init__(self) -> None:
        check_request_tensor("ToyRequest", "task", self.task)
        if tuple(self.task.shape) != (HIDDEN,):
            raise ValueError(f"ToyRequest.task is {tuple(self.task.shape)}; pass ({HIDDEN},)")
        for name in ("frames", "actions", "steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ToyRequest.{name}={v!r}; pass an int >= 1")
        object.__setattr__(self, "seed", check_seed("ToyRequest.seed", self.seed))

    def noise(self) -> tuple[Tensor, Tensor]:
        """Its initial video and action rows, fp32 CPU (the same in any pack)."""
        g = torch.Generator().manual_seed(self.seed)
        return (torch.randn(self.frames * TPF, VIDEO, generator=g),
                torch.randn(self.actions, ACTION, generator=g))  # fmt: skip


@dataclass(frozen=True)
class ToyShape:
    """A static pack: ``video`` and ``action`` rows, at most ``requests`` requests."""

    video: int
    action: int
    requests: int

    def fits(self, requests: Sequence[ToyRequest]) -> bool:
        return (len(requests) <= self.requests
                and sum(r.frames * TPF for r in requests) <= self.video
                and sum(r.actions for r in requests) <= self.action)  # fmt: skip


class ToyVelocity(nn.Module):
    """Each token's velocity from its own features and time, plus its request's summary.

    ``slot_v``/``slot_a``: each row's request in ``[0, R]`` (R: padding, a bucket of its
    own); ``task_R`` ``(R + 1, HIDDEN)``. Pure tensor work (no host sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.video_in, self.action_in = nn.Linear(VIDEO + 1, HIDDEN), nn.Linear(ACTION + 1, HIDDEN)
        self.task = nn.Linear(HIDDEN, HIDDEN)
        self.video_out, self.action_out = nn.Linear(HIDDEN, VIDEO), nn.Linear(HIDDEN, ACTION)

    def forward(self, x_v: Tensor, x_a: Tensor, t_v: Tensor, t_a: Tensor, slot_v: Tensor,
                slot_a: Tensor, task_R: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
        h_v = self.video_in(torch.cat([x_v, t_v[:, None]], 1))
        h_a = self.action_in(torch.cat([x_a, t_a[:, None]], 1))
        summary = self.summary(h_v, h_a, slot_v, slot_a, task_R.shape[0]) + self.task(task_R)
        v_v = self.video_out(F.gelu(h_v + summary[slot_v]))
        v_a = self.action_out(F.gelu(h_a + summary[slot_a]))
        return v_v, v_a

    def summary(self, h_v: Tensor, h_a: Tensor, slot_v: Tensor, slot_a: Tensor,
                buckets: int) -> Tensor:  # fmt: skip
        """The mean of each request's rows, ``(buckets, HIDDEN)``: a request's own only."""
        total = h_v.new_zeros(buckets, HIDDEN).index_add_(0, slot_v, h_v).index_add_(0, slot_a, h_a)
        count = h_v.new_zeros(buckets).index_add_(0, slot_v, torch.ones_like(h_v[:, 0]))
        count = count.index_add_(0, slot_a, torch.ones_like(h_a[:, 0]))
        return total / count.clamp(min=1)[:, None]


# -- the protocol, implemented -----------------------------------------------------------
class ToyBuffers:
    """One `ToyShape`'s static tensors: the state (two groups, video and action rows, each
    ``(x, v_prev)``), each row's request slot (-1: padding), the tasks and the engine's
    schedule tables. Allocated once; a new composition is written in with ``copy_``."""

    def __init__(self, shape: ToyShape, max_steps: int, device: torch.device) -> None:
        R, f32 = shape.requests, dict(dtype=torch.float32, device=device)
        self.x_v, self.x_a = (
            torch.zeros(shape.video, VIDEO, **f32),
            torch.zeros(shape.action, ACTION, **f32),
        )
        self.vp_v, self.vp_a = torch.zeros_like(self.x_v), torch.zeros_like(self.x_a)
        self.slot_v = torch.full((shape.video,), -1, dtype=torch.int64, device=device)
        self.slot_a = torch.full((shape.action,), -1, dtype=torch.int64, device=device)
        self.task_R = torch.zeros(R + 1, HIDDEN, **f32)  # row R: padding's (zeros)
        self.t_table = torch.zeros(R, max_steps, **f32)
        self.coef = torch.zeros(R, max_steps, 2, **f32)
        self.step_K = torch.zeros(R, dtype=torch.int64, device=device)
        self.bad_K = torch.zeros(R, dtype=torch.bool, device=device)

    def state(self) -> tuple[Tensor, ...]:
        """What a step changes (`Steps` restores it around a graph's warm-up runs)."""
        return (self.x_v, self.vp_v, self.x_a, self.vp_a, self.step_K)


def toy_step(model: ToyVelocity, b: ToyBuffers) -> None:
    """One model call over the pack, then each request's update ``x += a v + b v_prev`` with
    its own (a, b) at its own step; padding rows stay as they are. No host sync."""
    R, N = b.t_table.shape
    n_K = b.step_K.clamp(max=N - 1)
    t_R = torch.cat([b.t_table.gather(1, n_K[:, None])[:, 0], b.t_table.new_zeros(1)])
    ab_R2 = torch.cat([b.coef.gather(1, n_K[:, None, None].expand(R, 1, 2))[:, 0],
                       b.coef.new_zeros(1, 2)])  # fmt: skip
    sv, sa = torch.where(b.slot_v >= 0, b.slot_v, R), torch.where(b.slot_a >= 0, b.slot_a, R)
    v_v, v_a = model(b.x_v, b.x_a, t_R[sv], t_R[sa], sv, sa, b.task_R)
    # Both updates computed before either is written: a model that raises leaves the state.
    new = [(x, vp, torch.where((slot >= 0)[:, None], x + ab_R2[s, :1] * v + ab_R2[s, 1:] * vp, x),
            torch.where((slot >= 0)[:, None], v, vp))
           for x, vp, v, slot, s in ((b.x_v, b.vp_v, v_v, b.slot_v, sv),
                                     (b.x_a, b.vp_a, v_a, b.slot_a, sa))]  # fmt: skip
    for x, vp, x_new, vp_new in new:
        x.copy_(x_new)
        vp.copy_(vp_new)
    quarantine(b.bad_K, ((b.x_v, b.slot_v), (b.vp_v, b.slot_v), (b.x_a, b.slot_a),
                         (b.vp_a, b.slot_a)))  # fmt: skip
    b.step_K.add_(1)


class ToyPacks(Packs[ToyRequest, ToyShape]):
    """`ToyVelocity` behind the engine's protocol: two state groups (video rows, action rows),
    each request's rows contiguous in each, requests in slot order."""

    def __init__(self, model: ToyVelocity, shapes: Sequence[ToyShape]) -> None:
        self.model, self.device, self.max_steps = model, torch.device("cpu"), MAX_STEPS
        self.shapes = sorted(shapes, key=lambda s: (s.video, s.action, s.requests))
        self.buffers = {s: ToyBuffers(s, MAX_STEPS, self.device) for s in self.shapes}
        self.steps = Steps(cuda_graphs=False)

    def check(self, request: ToyRequest) -> ToyRequest:
        if not isinstance(request, ToyRequest):
            raise TypeError(f"submit takes a ToyRequest, got {type(request).__name__}")
        if request.steps > self.max_steps:
            raise ValueError(f"ToyRequest.steps={request.steps} > max_steps={self.max_steps}")
        if not self.shapes[-1].fits([request]):
            raise ValueError("ToyRequest is larger than the largest ToyShape; add a shape")
        return replace(request, task=host_copy(request.task))

    def fresh(self, request: ToyRequest) -> tuple[Tensor, ...]:
        return request.noise()

    def layout(self, shape: ToyShape, requests: Sequence[ToyRequest],
               tables: tuple[Tensor, ...]) -> list[Spans]:  # fmt: skip
        slot_v, slot_a = torch.full((shape.video,), -1), torch.full((shape.action,), -1)
        task_R = torch.zeros(shape.requests + 1, HIDDEN)
        spans: list[Spans] = []
        v0 = a0 = 0
        for k, r in enumerate(requests):
            n_v, n_a = r.frames * TPF, r.actions
            slot_v[v0 : v0 + n_v], slot_a[a0 : a0 + n_a], task_R[k] = k, k, r.task
            spans.append(((v0, n_v), (a0, n_a)))
            v0, a0 = v0 + n_v, a0 + n_a
        b = self.buffers[shape]
        t_table, coef, step_K = tables
        for dst, src in ((b.slot_v, slot_v), (b.slot_a, slot_a), (b.task_R, task_R),
                         (b.t_table, t_table), (b.coef, coef), (b.step_K, step_K)):  # fmt: skip
            dst.copy_(src)
        return spans

    def state(self, shape: ToyShape) -> tuple[tuple[Tensor, Tensor], ...]:
        b = self.buffers[shape]
        return (b.x_v, b.vp_v), (b.x_a, b.vp_a)

    def step(self, shape: ToyShape) -> None:
        b = self.buffers[shape]
        self.steps.run(shape, lambda: toy_step(self.model, b), b)

    def flags(self, shape: ToyShape) -> Tensor:
        return self.buffers[shape].bad_K

    def result(self, shape: ToyShape, request: ToyRequest, spans: Spans) -> tuple[Tensor, Tensor]:
        b = self.buffers[shape]
        (v0, n_v), (a0, n_a) = spans
        return b.x_v[v0 : v0 + n_v].clone(), b.x_a[a0 : a0 + n_a].clone()


# -- the reference: one request alone, a plain loop ----------------------------------------
def alone(model: ToyVelocity, r: ToyRequest, scheduler: FlowScheduler) -> tuple[Tensor, Tensor]:
    """``r`` denoised alone: its noise, the scheduler's times and coefficients, one call per
    step over its own tokens (slot 0; bucket 1 is an empty padding bucket)."""
    x_v, x_a = r.noise()
    vp_v, vp_a = torch.zeros_like(x_v), torch.zeros_like(x_a)
    sv, sa = torch.zeros(len(x_v), dtype=torch.int64), torch.zeros(len(x_a), dtype=torch.int64)
    task_R = torch.stack([r.task, torch.zeros(HIDDEN)])
    sigmas = torch.tensor(scheduler.sigmas(r.steps)[: r.steps], dtype=torch.float64).float()
    coefs = torch.tensor(scheduler.coefficients(r.steps), dtype=torch.float64).float()
    with torch.no_grad():
        for t, (a, b) in zip(sigmas, coefs, strict=True):
            v_v, v_a = model(x_v, x_a, t.expand(len(x_v)), t.expand(len(x_a)), sv, sa, task_R)
            x_v, vp_v = x_v + a * v_v + b * vp_v, v_v
            x_a, vp_a = x_a + a * v_a + b * vp_a, v_a
    return x_v, x_a


# -- serving --------------------------------------------------------------------------------
SHAPES = (ToyShape(video=8, action=8, requests=2), ToyShape(video=24, action=24, requests=4))
SCHEDULER = FlowScheduler(solver="multistep2", shift=3.0)
MARK = 1234.5  # a task value the faulty models below fail on


def _model(cls: type[ToyVelocity] = ToyVelocity) -> ToyVelocity:
    torch.manual_seed(0)
    return cls().eval()


def _requests() -> list[ToyRequest]:
    """Ragged sizes and step counts: (frames, actions, steps) per request."""
    sizes = [(2, 3, 4), (1, 5, 2), (3, 2, 6), (1, 1, 3), (2, 4, 5), (4, 1, 1)]
    g = torch.Generator().manual_seed(1)
    return [ToyRequest(task=torch.randn(HIDDEN, generator=g), frames=f, actions=a, seed=10 + i,
                       steps=n) for i, (f, a, n) in enumerate(sizes)]  # fmt: skip


def serve(packs: ToyPacks, requests: list[ToyRequest]) -> tuple[dict[int, Result], dict[str, bool]]:
    """Submit two requests, then one more after each engine step (joining a running pack);
    step until done. Returns the results by request index and what occurred."""
    engine = Engine.from_packs(packs, scheduler=SCHEDULER)
    ids = [engine.submit(r) for r in requests[:2]]
    seen = {"mixed_steps": False, "joined_running": False, "shapes": set()}
    out: list[Result] = []
    queue = list(requests[2:])
    while engine.active or engine.waiting or queue:
        if queue and engine.clock >= 1:
            seen["joined_running"] |= engine.active > 0
            ids.append(engine.submit(queue.pop(0)))
        out += engine.step()
        seen["mixed_steps"] |= len({s for _, s in engine.last_pack}) > 1
        seen["shapes"].add(engine.shape)
    out += engine.run()
    by_id = {r.request_id: r for r in out}
    assert sorted(by_id) == sorted(ids)  # every request comes back exactly once
    return {i: by_id[rid] for i, rid in enumerate(ids)}, {
        "mixed_steps": seen["mixed_steps"], "joined_running": seen["joined_running"],
        "two_shapes": len(seen["shapes"]) == 2,
    }  # fmt: skip


def _errors(
    model: ToyVelocity, requests: list[ToyRequest], results: dict[int, Result]
) -> list[float]:
    """``max |packed - alone|`` per request."""
    errs = []
    for i, r in enumerate(requests):
        want_v, want_a = alone(model, r, SCHEDULER)
        got = results[i]
        assert got.error is None, got.error
        assert got.latents.shape == want_v.shape and got.action.shape == want_a.shape
        errs.append(
            max((got.latents - want_v).abs().max().item(), (got.action - want_a).abs().max().item())
        )
    return errs


def test_each_request_served_packed_equals_it_run_alone():
    model, requests = _model(), _requests()
    results, seen = serve(ToyPacks(model, SHAPES), requests)
    # not vacuous: requests at different steps shared a call, joined a running pack, and
    # the pack changed shape
    assert seen == {"mixed_steps": True, "joined_running": True, "two_shapes": True}
    for i, r in enumerate(requests):
        want_v, want_a = alone(model, r, SCHEDULER)
        assert results[i].error is None, results[i].error
        torch.testing.assert_close(results[i].latents, want_v, **TOL)
        torch.testing.assert_close(results[i].action, want_a, **TOL)


class OffByOne(ToyPacks):
    """Broken: the rows it reports for each request are one row after the rows it wrote its
    slots at, so the engine writes a request's noise where its neighbour's step runs."""

    def layout(self, shape: ToyShape, requests: Sequence[ToyRequest],
               tables: tuple[Tensor, ...]) -> list[Spans]:  # fmt: skip
        spans = super().layout(shape, requests, tables)
        return [((v0 + 1, n_v), action) for (v0, n_v), action in spans]


class Leaky(ToyVelocity):
    """Broken: the summary pools every request's rows together (no per-request bucket)."""

    def summary(self, h_v: Tensor, h_a: Tensor, slot_v: Tensor, slot_a: Tensor,
                buckets: int) -> Tensor:  # fmt: skip
        real_v, real_a = slot_v < buckets - 1, slot_a < buckets - 1
        return super().summary(h_v, h_a, torch.where(real_v, 0, slot_v),
                               torch.where(real_a, 0, slot_a), buckets).clone()  # fmt: skip


@pytest.mark.parametrize("broken", ["rows one off", "summary across requests"])
def test_a_broken_implementation_fails_the_equality(broken):
    leaky = broken == "summary across requests"
    model, requests = _model(Leaky if leaky else ToyVelocity), _requests()
    results, _ = serve((ToyPacks if leaky else OffByOne)(model, SHAPES), requests)
    errors = _errors(model, requests, results)
    assert max(errors) > 1e-3, errors  # the equality above would fail, by far
    if leaky:  # alone the leaky model is exact again: what breaks is packing, not the model
        engine = Engine.from_packs(ToyPacks(model, SHAPES), scheduler=SCHEDULER)
        engine.submit(requests[0])
        (got,) = engine.run()
        torch.testing.assert_close(got.latents, alone(model, requests[0], SCHEDULER)[0], **TOL)


class NonFinite(ToyVelocity):
    """Faulty: the velocity of a request whose task starts with ``MARK`` is inf."""

    def forward(self, x_v, x_a, t_v, t_a, slot_v, slot_a, task_R):  # type: ignore[override]
        v_v, v_a = super().forward(x_v, x_a, t_v, t_a, slot_v, slot_a, task_R)
        hit = task_R[:, 0] == MARK
        return (torch.where(hit[slot_v][:, None], torch.inf, v_v),
                torch.where(hit[slot_a][:, None], torch.inf, v_a))  # fmt: skip


class Raises(ToyVelocity):
    """Faulty: the call raises when a request whose task starts with ``MARK`` is in it."""

    def forward(self, x_v, x_a, t_v, t_a, slot_v, slot_a, task_R):  # type: ignore[override]
        if bool((task_R[:, 0] == MARK).any()):  # a host check: this model is a test's fault
            raise RuntimeError("the marked request")
        return super().forward(x_v, x_a, t_v, t_a, slot_v, slot_a, task_R)


@pytest.mark.parametrize("faulty", [NonFinite, Raises])
def test_one_requests_fault_fails_only_that_request(faulty):
    requests = _requests()
    marked = requests[2].task.clone()
    marked[0] = MARK
    requests[2] = replace(requests[2], task=marked)
    results, _ = serve(ToyPacks(_model(faulty), SHAPES), requests)
    error = results[2].error
    assert error is not None and ("non-finite" if faulty is NonFinite else "raised") in error
    good = _model()  # the same weights: the faulty model is this one on every other request
    others = [i for i in range(len(requests)) if i != 2]
    errors = _errors(
        good, [requests[i] for i in others], {j: results[i] for j, i in enumerate(others)}
    )
    assert max(errors) <= 1e-6, errors


def test_this_model_is_served_through_public_names_only():
    """Nothing above imports a private module of packing: the protocol is enough."""
    tree = ast.parse(Path(__file__).read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    packing = {m for m in modules if m.split(".")[0] == "packing"}
    assert packing == {"packing.serve", "packing.serve.protocol"}


def test_the_engine_refuses_what_the_protocol_does_not_allow():
    packs = ToyPacks(_model(), SHAPES)
    with pytest.raises(
        TypeError, match=r"Engine.from_packs takes packs=, a packing.serve.protocol"
    ):
        Engine.from_packs(_model())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"scheduler='euler' must be a FlowScheduler"):
        Engine.from_packs(packs, scheduler="euler")  # type: ignore[arg-type]
    packs.max_steps = 0
    with pytest.raises(ValueError, match=r"ToyPacks.max_steps=0; set an int in \[1, "):
        Engine.from_packs(packs)


def test_a_request_checked_with_more_steps_than_the_tables_hold_is_refused_at_submit():
    class Unchecked(ToyPacks):
        def check(self, request: ToyRequest) -> ToyRequest:  # forgets the steps check
            return replace(request, task=host_copy(request.task))

    engine = Engine.from_packs(Unchecked(_model(), SHAPES))
    r = replace(_requests()[0], steps=MAX_STEPS + 1)
    with pytest.raises(ValueError, match=r"Unchecked.check returned a ToyRequest with steps=9"):
        engine.submit(r)
    assert engine.waiting == 0
