"""LeRobot's LingBot-VA served to many robots at once: `ServedLingBotVA`, the engine's Packs.

``engine = LingBotVAEngine(policy, robots=16)`` (packs: `phase_shapes`, or ``shapes=``);
``engine.submit(ChunkRequest(...))``; ``engine.step()`` -> `Result` s (``latents``
``(F, C, H, W)`` as ``_infer`` returns them, ``action`` ``(steps, n_used)`` as
``predict_action_chunk`` does: the used channels, chunk 0 without its conditioning frame). A chunk runs as two phases of the engine (`Packs.then`)::

    admission   the session's slots replayed (`_serve_cache`); its text, then the feedback
                LeRobot's _compute_kv_cache would feed (keyframes, executed actions) prefilled
    video       len(timesteps) steps (20 + 1 by default; the last writes the predicted keys)
                with the unconditional row in the pack when guidance needs it
    action      50 steps, the unconditional row only when action guidance needs it (the last
                LeRobot call, whose keys are never read, is not run)

Exact against LeRobot's ``predict_action_chunk`` run for each robot alone with the same noise
(tests/test_lingbot_serve.py, ``packing verify --inference --model lingbot_va``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from packing._lazy import require
from packing._validate import check_bool, check_choice, check_int
from packing.attention import Backend, resolve_backend
from packing.integrations.lingbot_va._serve_cache import (
    CallPlan,
    ChunkPlan,
    RegionPool,
    Session,
    TextPool,
    repeated,
)  # fmt: skip
from packing.integrations.lingbot_va._serve_packs import (
    Geometry,
    LingShape,
    StepBuffers,
    check_shapes,
    lingbot_step,
    phase_shapes,
    query_tokens,
    shape_order,
)  # fmt: skip
from packing.integrations.lingbot_va._serve_request import (
    ChunkRequest,
    Phase,
    chunk_index,
    draw_noise,
    tensor_digest,
)  # fmt: skip
from packing.integrations.lingbot_va._serve_step import CallBuffers, Pools, forward_call
from packing.serve import Engine, FlowScheduler
from packing.serve.protocol import Packs, Spans, Steps

__all__ = ["LingBotVAEngine", "ServedLingBotVA"]

# flash-attn-4's kernels ("varlen", "flex_flash") take no mask rule over a pool's slots
_ATTENTION: tuple[Backend, ...] = ("auto", "sdpa", "flex")


class ServedLingBotVA(Packs[Phase, LingShape]):
    """LeRobot's ``LingBotVAPolicy`` behind the engine's per-model protocol.

    ``robots``: sessions the pool holds at once (each one region per guidance row);
    ``shapes``: the static packs (None: `phase_shapes`); ``check_history=False`` trusts a
    session's cache without comparing the request's history (the negative control: a changed
    keyframe is then served from a stale cache); ``document_mask=False`` lets robots see each
    other (must fail);
    ``attention``: ``"auto"`` (dense SDPA on the CPU, FlexAttention on CUDA), ``"sdpa"`` or
    ``"flex"`` (on the CPU: eager, forward only, the CUDA path's masks checked there)."""

    def __init__(self, policy: Any, *, robots: int, shapes: Sequence[LingShape] | None = None,
                 cuda_graphs: bool = False, check_history: bool = True,
                 document_mask: bool = True, attention: str = "auto") -> None:  # fmt: skip
        cfg, model = policy.config, policy.transformer
        self.policy, self.cfg, self.model = policy, cfg, model
        self.check_history = check_bool("check_history", check_history)
        self.document_mask = check_bool("document_mask", document_mask)
        robots = check_int("robots", robots, min=1, max=4096)
        shapes = check_shapes(phase_shapes(robots) if shapes is None else shapes)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs a CUDA model; use False on the CPU")
        self.hw = tuple(policy._latent_hw)
        self.geo = _geometry(cfg, self.hw)
        self.text_len = int(cfg.max_sequence_length)
        self.video_t, self.video_dt = _video_schedule(cfg)
        self.action_t, self.action_dt = _action_schedule(cfg)
        self.max_steps = max(len(self.video_t), len(self.action_t))
        self.guide_v = float(cfg.guidance_scale) if cfg.guidance_scale > 1 else 0.0
        self.guide_a = float(cfg.action_guidance_scale) if cfg.action_guidance_scale > 1 else 0.0
        used = torch.zeros(cfg.action_dim, dtype=torch.bool)
        used[list(cfg.used_action_channel_ids)] = True
        self.used = used
        self.used_ids = torch.tensor(list(cfg.used_action_channel_ids), device=self.device)
        g = self.geo
        self.shapes = shape_order(shapes, g)
        big = self.shapes[-1]
        self.fb_docs = big.video * g.cv  # a feedback call: every video robot's rows at once
        scratch = max([s.video * g.cv * g.L + s.action * g.ca * g.A for s in self.shapes]
                      + [self.fb_docs * (g.L + g.A)])  # fmt: skip
        self.regions = RegionPool(robots * g.cv)
        self.base_scratch = robots * g.cv * g.capacity
        rows = self.base_scratch + scratch
        self.pools = Pools(model, rows=rows, text_slots=2 * robots, text_len=self.text_len,
                           device=self.device, dtype=self.dtype)  # fmt: skip
        self.text = TextPool(2 * robots)
        half = model.attention_head_dim // 2
        self.buffers = {s: StepBuffers(s, g, max_steps=self.max_steps, pool_rows=rows,
                                       half_dim=half, used=used, device=self.device)
                        for s in self.shapes}  # fmt: skip
        self.fb = CallBuffers(self.fb_docs * g.L, self.fb_docs * g.A, rows, half, self.device)
        self.fb_tok_v = torch.zeros(self.fb_docs * g.L, g.features, device=self.device)
        self.fb_tok_a = torch.zeros(self.fb_docs * g.A, g.action_dim, device=self.device)
        self.fb_t = torch.zeros(self.fb_docs * (g.L + g.A), device=self.device)
        self.fb_bad = torch.zeros(
            self.fb_docs * (g.L + g.A), dtype=torch.bool, device=self.device
        )  # a feedback call's non-finite queries
        choice = check_choice("attention", attention, _ATTENTION)
        backend = resolve_backend(choice, device=self.device, dtype=self.dtype,
                                  head_dim=model.attention_head_dim, inner=None)  # fmt: skip
        # "auto" picks flash-attn-4's varlen kernel for a document-only bf16 mask, which needs
        # each doc's keys as one run; a doc's pool keys are a region's slots, with holes.
        self.backend = "flex" if backend == "varlen" else backend
        self.mask_args: dict[str, Any] = dict(tkey_X=self.pools.tkey_X, backend=self.backend,
                              document_mask=self.document_mask)  # fmt: skip
        for cb in [self.fb, *(b.call for b in self.buffers.values())]:
            cb.load({}, **self.mask_args)  # the empty composition's masks (warm-up runs it)
        self.sessions: dict[str, Session] = {}
        self.steps = Steps(cuda_graphs)
        self.cache_stats = {"feedback_chunks": 0, "rebuilds": 0, "text_fills": 0,
                            "steps_in_video_packs": 0, "steps_in_action_packs": 0,
                            "steps_in_mixed_packs": 0, "query_tokens_computed": 0,
                            "query_tokens_filled": 0}  # fmt: skip
        self._filled: dict[LingShape, int] = {}  # a shape's robots' query tokens, at layout

    # -- requests -----------------------------------------------------------------------
    def check(self, r: ChunkRequest) -> Phase:  # type: ignore[override]
        if not isinstance(r, ChunkRequest):
            raise TypeError(f"submit takes a ChunkRequest, got {type(r).__name__}")
        g, cfg = self.geo, self.cfg
        frame = (48, *self.hw)
        if tuple(r.frames.shape[1:]) != frame:
            raise ValueError(
                f"ChunkRequest.frames for session {r.session!r} are {tuple(r.frames.shape[1:])} "
                f"latent frames, the model takes (C, H, W) = {frame}; encode every camera the "
                f"config names ({list(cfg.obs_cam_keys)}) at {cfg.height}x{cfg.width}"
            )
        if r.actions is not None and r.actions.shape[1:] != (cfg.action_per_frame, cfg.action_dim):
            raise ValueError(
                f"ChunkRequest.actions are (., {', '.join(map(str, r.actions.shape[1:]))}), the "
                f"model's are (k F, action_per_frame={cfg.action_per_frame}, "
                f"action_dim={cfg.action_dim}); send the executed chunks in model space"
            )
        for name, t in (("prompt", r.prompt), ("negative", r.negative)):
            if t is None:
                if name == "negative" and g.cv == 2:
                    raise ValueError(
                        "ChunkRequest.negative is None but the config's guidance needs the "
                        "unconditional rows; pass the text encoder's output for the empty prompt"
                    )
                continue
            if tuple(t.shape) != (self.text_len, cfg.text_dim):
                raise ValueError(
                    f"ChunkRequest.{name} is {tuple(t.shape)}, the model reads "
                    f"(max_sequence_length={self.text_len}, text_dim={cfg.text_dim}); pad the "
                    "text encoder's output to max_sequence_length as LeRobot does"
                )
        k = chunk_index(r, cfg.frame_chunk_size)
        if r.actions is None:
            r = replace(r, actions=self.executed(r.session, k))
        if (k + 1) * cfg.frame_chunk_size > cfg.rope_max_seq_len:
            raise ValueError(
                f"chunk {k} of session {r.session!r} reaches latent frame "
                f"{(k + 1) * cfg.frame_chunk_size} > rope_max_seq_len={cfg.rope_max_seq_len}; "
                "end the episode"
            )
        noise = draw_noise(r.seed, (1, 48, cfg.frame_chunk_size, *self.hw),
                           (1, cfg.action_dim, cfg.frame_chunk_size, cfg.action_per_frame, 1))  # fmt: skip
        return Phase(chunk=r.copied(), index=k, kind="video", steps=len(self.video_t), noise=noise)

    def executed(self, session: str, chunks: int) -> Tensor:
        """The first ``chunks`` chunks ``session`` was served, model space ``(k F, apf, A)``:
        what LeRobot feeds back as executed."""
        s = self.sessions.get(session)
        done = [] if s is None else s.executed
        if len(done) < chunks:
            raise ValueError(
                f"session {session!r} asks for chunk {chunks} with the executed actions left "
                f"out, but it was served {len(done)} chunks; send ChunkRequest.actions, or "
                "start the episode at chunk 0"
            )
        g = self.geo
        empty = torch.zeros(0, self.cfg.action_per_frame, g.action_dim)
        return torch.cat([empty, *(a.cpu() for a in done[:chunks])])

    def fits(self, shape: LingShape, phases: Sequence[Phase]) -> bool:
        return shape.fits(phases)

    def member(self, rid: int, p: Phase) -> Any:
        """The session's record, its slots replayed for this chunk (host only)."""
        if p.kind == "action":
            return self.sessions[p.session]
        s = self.sessions.get(p.session)
        if s is not None and s.busy:
            raise ValueError(
                f"session {p.session!r} already has a chunk in flight; wait for its result "
                "before asking for the next"
            )
        if s is None:
            regions = self.regions.claim(self.geo.cv, p.session, len(self.sessions))
            s = self.sessions[p.session] = Session(p.session, regions, self.geo.capacity)
        s.busy, s.rid = True, rid
        try:
            s.plan = self._plan(s, p)
        except Exception:
            s.busy, s.dirty = False, True
            raise
        return s

    def _plan(self, s: Session, p: Phase) -> ChunkPlan:
        r, g, F_ = p.chunk, self.geo, self.cfg.frame_chunk_size
        prefix = tensor_digest(r.frames[0], r.prompt, r.negative)
        acts = r.actions
        assert acts is not None  # check() filled it in
        digests = [tensor_digest(r.frames[j * F_ : (j + 1) * F_], acts[j * F_ : (j + 1) * F_])
                   for j in range(p.index)]  # fmt: skip
        stale = s.prefix != prefix or s.absorbed != digests[: len(s.absorbed)]
        # Rebuilt from the request's history when the cache is not a prefix of it: a failed
        # chunk, a new session, a repeated chunk, or (unless the check is off) a change.
        if s.dirty or not s.text or p.index <= len(s.absorbed) or (self.check_history and stale):
            if s.absorbed or s.predicted is not None:
                self.cache_stats["rebuilds"] += 1
            s.reset(prefix)
            self._claim_text(s, r)
        feedback = []
        for j in range(len(s.absorbed), p.index):
            if s.predicted != j:  # a prediction we did not run: its slots only
                self._predict(s)
            s.alloc.clear_pred()
            fl = s.alloc.alloc(g.L, keep=True, pred=False)
            fa = s.alloc.alloc(g.A, keep=True, pred=False)
            feedback.append((j, CallPlan(*fl), CallPlan(*fa)))
            s.absorbed.append(digests[j])
            s.predicted = None
        video, action = self._predict(s)
        s.predicted = p.index
        return ChunkPlan(p.index, feedback, video, action)

    def _predict(self, s: Session) -> tuple[CallPlan, CallPlan]:
        """A chunk's video loop then its action loop (LeRobot's calls: all of them)."""
        video = repeated(s.alloc, self.geo.L, len(self.video_t))
        return video, repeated(s.alloc, self.geo.A, len(self.action_t) + 1)

    def _claim_text(self, s: Session, r: ChunkRequest) -> None:
        for slot in s.text:
            self.text.release(slot)
        s.text = []
        for t in (r.prompt, r.negative)[: self.geo.cv]:
            assert t is not None
            slot, new = self.text.claim(tensor_digest(t))
            if new:
                self.pools.fill_text(self.model, slot, t.to(self.device))
                self.cache_stats["text_fills"] += 1
            s.text.append(slot)

    def fresh(self, p: Phase) -> tuple[Tensor, ...]:
        g = self.geo
        lat, act = p.noise
        if p.kind == "video":
            lat = lat.clone()
            if p.index == 0:
                lat[:, :, 0] = p.chunk.frames[0]  # LeRobot's latent_cond
            return self._patchify(lat), torch.zeros(0, g.action_dim)
        a = rearrange(act, "b c f h w -> b (f h w) c")[0].clone()
        if p.index == 0:
            a[: self.cfg.action_per_frame] = 0  # LeRobot's action_cond (frame 0)
        return torch.zeros(0, g.features), a

    def _patchify(self, lat: Tensor) -> Tensor:
        p = self.model.patch_size
        return rearrange(lat, "b c (f p1) (h p2) (w p3) -> (b f h w) (c p1 p2 p3)",
                         p1=p[0], p2=p[1], p3=p[2])  # fmt: skip

    def _unpatchify(self, x: Tensor) -> Tensor:
        p, (H, W) = self.model.patch_size, self.hw
        return rearrange(x, "(f h w) (c p1 p2 p3) -> (f p1) c (h p2) (w p3)", h=H // p[1],
                         w=W // p[2], p1=p[0], p2=p[1], p3=p[2])  # fmt: skip

    # -- layout -------------------------------------------------------------------------
    def layout(self, shape: LingShape, phases: Sequence[Phase],
               tables: tuple[Tensor, ...]) -> list[Spans]:  # fmt: skip
        from packing.integrations.lingbot_va._serve_layout import step_layout

        host, spans = step_layout(self, shape, phases, tables[2])
        self._filled[shape] = self._tokens(sum(p.kind == "video" for p in phases),
                                           sum(p.kind == "action" for p in phases))  # fmt: skip
        b = self.buffers[shape]
        b.load({k: v for k, v in host.items() if not k.startswith("call.")})
        b.call.load({k[5:]: v for k, v in host.items() if k.startswith("call.")}, **self.mask_args)
        return spans

    def state(self, shape: LingShape) -> tuple[tuple[Tensor, Tensor], ...]:
        b = self.buffers[shape]
        return (b.x_v, b.vp_v), (b.x_a, b.vp_a)

    def step(self, shape: LingShape) -> None:
        kind = "video_packs" if shape.action == 0 else "action_packs" if shape.video == 0 else (
            "mixed_packs")  # fmt: skip
        self.cache_stats[f"steps_in_{kind}"] += 1
        self.cache_stats["query_tokens_computed"] += self._tokens(shape.video, shape.action)
        self.cache_stats["query_tokens_filled"] += self._filled[shape]
        self._step(shape)

    def _tokens(self, video: int, action: int) -> int:
        return query_tokens(self.geo, video, action)

    def _step(self, shape: LingShape) -> None:
        b = self.buffers[shape]

        def fn() -> None:
            lingbot_step(self.model, b, self.pools)

        self.steps.run(shape, fn, b)

    def flags(self, shape: LingShape) -> Tensor:
        return self.buffers[shape].bad_K

    def result(self, shape: LingShape, p: Phase, spans: Spans) -> tuple[Tensor, Tensor]:
        b, g = self.buffers[shape], self.geo
        if p.kind == "video":
            (v0, n), _ = spans
            return self._unpatchify(b.x_v[v0 : v0 + n].clone()), torch.zeros(0, device=b.x_v.device)
        _, (a0, n) = spans
        act = (b.x_a[a0 : a0 + n] * b.used_A).reshape(self.cfg.frame_chunk_size, -1, g.action_dim)
        s, F_, hist = self.sessions[p.session], self.cfg.frame_chunk_size, p.chunk.actions
        assert hist is not None  # check() filled it in
        # what the session executed: its history, then this chunk (LeRobot's assumption)
        s.executed = [hist[j * F_ : (j + 1) * F_] for j in range(p.index)] + [act.clone()]
        used = act.index_select(-1, self.used_ids)  # a device index: no copy from the host
        if p.index == 0:  # frame 0 is the conditioning frame: LeRobot drops its actions
            used = used[1:]
        assert p.latents is not None
        return p.latents, used.reshape(-1, used.shape[-1])

    def then(self, p: Phase, latents: Tensor, actions: Tensor) -> Phase | None:
        if p.kind == "action":
            return None
        return Phase(chunk=p.chunk, index=p.index, kind="action", steps=len(self.action_t),
                     noise=p.noise, latents=latents)  # fmt: skip

    def warm_keys(self) -> list[tuple[str, Callable[[], None]]]:
        keys = [(f"pack {s.video} video + {s.action} action robots", partial(self._step, s))
                for s in self.shapes]  # fmt: skip
        return [*keys, ("feedback pass", self._warm_feedback)]

    # -- the cache's hooks --------------------------------------------------------------
    def joined(self, shape: LingShape, members: Sequence[Any], first: int) -> list[tuple[Any, str]]:
        from packing.integrations.lingbot_va._serve_layout import feedback_rounds

        todo = [m for m in members[first:] if m.request.kind == "video" and m.saved is None]
        try:
            feedback_rounds(self, todo)
            return []
        except Exception:
            failed = []
            for m in todo:
                try:
                    feedback_rounds(self, [m])
                except Exception as err:
                    failed.append(
                        (m, f"prefilling its feedback raised {type(err).__name__}: {err}")
                    )
            return failed

    def _warm_feedback(self) -> None:
        self._run_feedback()

    def _run_feedback(self) -> Tensor:
        """One feedback call; the queries whose keys went non-finite (``fb_bad``: a static
        buffer, so a replayed graph writes it as the eager call does)."""

        def fn() -> None:
            bad = forward_call(self.model, self.fb, self.pools, self.fb_tok_v, self.fb_tok_a,
                               self.fb_t)[2]  # fmt: skip
            self.fb_bad.copy_(bad)

        self.steps.run("feedback", fn, _Stateless())
        return self.fb_bad

    def left(self, m: Any, *, finished: bool) -> None:
        s = self.sessions.get(m.request.session)
        if s is None:
            return
        if not finished:
            self._failed(s)
        elif m.request.kind == "action":
            s.busy, s.plan = False, None
        if s.ending and not s.busy:
            self.end_session(s.key)

    def _failed(self, s: Session) -> None:
        """Its chunk failed: not executed, and the cache is rebuilt from the next request."""
        s.busy, s.dirty = False, True
        if s.plan is not None:
            del s.executed[s.plan.index :]

    def sweep(self, live: set[int]) -> None:
        """After a failed model call: the sessions whose chunk is in no pack any more."""
        for s in list(self.sessions.values()):
            if s.busy and s.rid not in live:
                self._failed(s)
                if s.ending:
                    self.end_session(s.key)

    def end_session(self, session: str) -> None:
        """Free the session's regions and text slots (after its chunk in flight, if any)."""
        s = self.sessions.get(session)
        if s is None:
            return
        if s.busy:
            s.ending = True
            return
        del self.sessions[session]
        self.regions.release(s.regions)
        for slot in s.text:
            self.text.release(slot)

    @property
    def stats(self) -> dict[str, int]:
        ev = sum(s.alloc.evicted for s in self.sessions.values())
        return {**self.cache_stats, "sessions": len(self.sessions), "evicted_slots": ev}


class _Stateless:
    """A feedback pass's holder for `Steps`: it changes no state a graph's warm-up must
    restore (it writes the pool, the same values again)."""

    def state(self) -> tuple[Tensor, ...]:
        return ()


class LingBotVAEngine(Engine):
    """`Engine` serving LeRobot's LingBot-VA (`ServedLingBotVA`): submit `ChunkRequest` s."""

    def __init__(self, policy: Any, *, robots: int, shapes: Sequence[LingShape] | None = None,
                 **options: Any) -> None:  # fmt: skip
        require("lerobot.policies.lingbot_va", extra="lingbot")
        packs = ServedLingBotVA(policy, robots=robots, shapes=shapes, **options)
        self.model, self.config = policy, None
        self._serve(packs, FlowScheduler(), packs.max_steps)


def _geometry(cfg: Any, hw: tuple[int, int]) -> Geometry:
    p = tuple(cfg.patch_size)
    if p[0] != 1 or hw[0] % p[1] or hw[1] % p[2] or cfg.in_channels != 48:
        raise ValueError(
            f"the served LingBot-VA takes patch_size (1, ph, pw) dividing the latent frame "
            f"{hw} and 48 latent channels (LeRobot's _infer draws 48); got {p}, {cfg.in_channels}"
        )
    tpf = (hw[0] // p[1]) * (hw[1] // p[2])
    F_, apf = cfg.frame_chunk_size, cfg.action_per_frame
    L, A = F_ * tpf, F_ * apf
    cfg_rows = 2 if (cfg.guidance_scale > 1 or cfg.action_guidance_scale > 1) else 1
    return Geometry(L=L, A=A, tpf=tpf, features=48 * math.prod(p), action_dim=cfg.action_dim,
                    cv=cfg_rows, ca=2 if cfg.action_guidance_scale > 1 else 1,
                    capacity=(cfg.attn_window // 2) * L + (cfg.attn_window // 2) * A)  # fmt: skip


def _scheduler(shift: float, steps: int) -> Any:
    utils = require("lerobot.policies.lingbot_va.utils", extra="lingbot")
    s = utils.FlowMatchScheduler(shift=shift, sigma_min=0.0, extra_one_step=True)
    s.set_timesteps(steps)
    return s


def _dt(s: Any, t: Tensor) -> Tensor:
    """``FlowMatchScheduler.step``'s ``sigma_ - sigma`` at ``t``."""
    i = torch.argmin((s.timesteps - t).abs())
    sigma = s.sigmas[i]
    nxt = 0 if i + 1 >= len(s.timesteps) else s.sigmas[i + 1]
    return (nxt - sigma).float().reshape(())


def _video_schedule(cfg: Any) -> tuple[list[Tensor], list[Tensor]]:
    """``_infer``'s video loop: each call's t and its update's dt (0: no update)."""
    s = _scheduler(cfg.snr_shift, cfg.num_inference_steps)
    ts = F.pad(s.timesteps, (0, 1), mode="constant", value=0)
    if cfg.video_exec_step != -1:
        ts = ts[: cfg.video_exec_step]
    out = []
    for i, t in enumerate(ts):
        update = i != len(ts) - 1 or cfg.video_exec_step != -1
        out.append(_dt(s, t) if update else torch.zeros(()))
    return list(ts), out


def _action_schedule(cfg: Any) -> tuple[list[Tensor], list[Tensor]]:
    """``_infer``'s action loop without its last call (t = 0, no update, keys never read)."""
    s = _scheduler(cfg.action_snr_shift, cfg.action_num_inference_steps)
    ts = F.pad(s.timesteps, (0, 1), mode="constant", value=0)[:-1]
    return list(ts), [_dt(s, t) for t in ts]
