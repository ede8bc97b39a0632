"""Host work of the served LingBot-VA: a pack's index tensors, and the feedback passes.

`step_layout` turns the members of a pack (each robot's `ChunkPlan`: the slots LeRobot's
cache would write and attend) into the `StepBuffers` tensors; `feedback_rounds` prefills
the feedback LeRobot's ``_compute_kv_cache`` feeds back, one chunk of every joining robot a
round (a rebuilt session replays its chunks in order), each round a keyframes call then an
executed-actions call (which attends the keyframes just written, as LeRobot's does).
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from packing._lazy import require
from packing.integrations.lingbot_va._serve_cache import CallPlan, Session
from packing.integrations.lingbot_va._serve_packs import LingShape
from packing.integrations.lingbot_va._serve_request import Phase
from packing.serve.protocol import Spans

__all__ = ["feedback_rounds", "step_layout"]


def rope(packs: Any, kind: str, chunk: int) -> Tensor:
    """LeRobot's RoPE frequencies of a chunk's tokens, ``(n, head_dim / 2, 2)`` (cached)."""
    key = (kind, chunk)
    cache = packs.__dict__.setdefault("_rope", {})
    if key not in cache:
        utils = require("lerobot.policies.lingbot_va.utils", extra="lingbot")
        cfg, p, (H, W) = packs.cfg, packs.model.patch_size, packs.hw
        F_, st = cfg.frame_chunk_size, chunk * cfg.frame_chunk_size
        if kind == "video":
            grid = utils.get_mesh_id(F_ // p[0], H // p[1], W // p[2], 0, 1, st)
        else:
            grid = utils.get_mesh_id(F_, cfg.action_per_frame, 1, 1, 1, st, action=True)
        with torch.no_grad():
            freqs = packs.model.rope(grid[None].to(packs.device))[0].cpu()
        cache[key] = torch.view_as_real(freqs).float()
    return cache[key]


class _Call:
    """A call's host index tensors, filled doc by doc."""

    def __init__(self, packs: Any, Qv: int, Qa: int) -> None:
        Q, P = Qv + Qa, packs.pools.k[0].shape[0]
        self.packs, self.Qv = packs, Qv
        self.doc_Q = torch.full((Q,), -1, dtype=torch.int64)
        self.tdoc_Q = torch.full((Q,), -1, dtype=torch.int64)
        self.wrow_Q = packs.base_scratch + torch.arange(Q)  # padding writes scratch rows
        self.kdoc_P = torch.full((P,), -1, dtype=torch.int64)
        self.freqs_Q = torch.zeros(Q, packs.model.attention_head_dim // 2, 2)
        self.docs = 0

    def doc(self, q0: int, s: Session, row: int, plan: CallPlan, freqs: Tensor) -> None:
        """Queries ``q0 ..`` as a doc over guidance row ``row`` of session ``s``."""
        n, cap, d = plan.slots.numel(), self.packs.geo.capacity, self.docs
        base = s.regions[row] * cap
        self.doc_Q[q0 : q0 + n] = d
        self.tdoc_Q[q0 : q0 + n] = s.text[row]
        self.wrow_Q[q0 : q0 + n] = base + plan.slots
        self.kdoc_P[base + plan.attend.nonzero().squeeze(-1)] = d
        self.freqs_Q[q0 : q0 + n] = freqs
        self.docs += 1

    def host(self) -> dict[str, Tensor]:
        return {k: getattr(self, k) for k in ("doc_Q", "tdoc_Q", "wrow_Q", "kdoc_P", "freqs_Q")}


def step_layout(
    packs: Any, shape: LingShape, phases: list[Phase] | Any, step_K: Tensor
) -> tuple[dict[str, Tensor], list[Spans]]:
    """The `StepBuffers` host tensors of ``phases`` in ``shape`` and each one's spans."""
    g, R, N = packs.geo, shape.requests, packs.max_steps
    Rv, Ra = shape.video, shape.action
    Qv, Qa = Rv * g.cv * g.L, Ra * g.ca * g.A
    i64: dict[str, Any] = dict(dtype=torch.int64)
    h: dict[str, Tensor] = {
        "slot_v": torch.full((Rv * g.L,), -1, **i64), "slot_a": torch.full((Ra * g.A,), -1, **i64),
        "gslot_v": torch.full((Rv * g.L,), R, **i64), "gslot_a": torch.full((Ra * g.A,), R, **i64),
        "cq_v": torch.zeros(Rv * g.L, **i64), "uq_v": torch.zeros(Rv * g.L, **i64),
        "cq_a": torch.zeros(Ra * g.A, **i64), "uq_a": torch.zeros(Ra * g.A, **i64),
        "src_v": torch.zeros(Qv, **i64), "src_a": torch.zeros(Qa, **i64),
        "tslot_Q": torch.full((Qv + Qa,), R, **i64), "rslot_Q": torch.full((Qv + Qa,), R, **i64),
        "guide_K": torch.zeros(R + 1),
        "t_table": torch.zeros(R, N), "dt_table": torch.zeros(R, N), "step_K": step_K,
    }  # fmt: skip
    call, iv, ia = _Call(packs, Qv, Qa), 0, 0
    spans: list[Spans] = [((0, 0), (0, 0))] * len(phases)
    # video members first: their queries come first (doc ids in query order)
    order = sorted(range(len(phases)), key=lambda k: phases[k].kind != "video")
    for k in order:
        p = phases[k]
        s: Session = packs.sessions[p.session]
        assert s.plan is not None
        video = p.kind == "video"
        n, rows, tag = (g.L, g.cv, "v") if video else (g.A, g.ca, "a")
        i = iv if video else ia
        r0 = i * n
        fixed = (g.tpf if video else packs.cfg.action_per_frame) if p.index == 0 else 0
        h[f"slot_{tag}"][r0 + fixed : r0 + n] = k  # frame 0 of chunk 0 is the condition
        h[f"gslot_{tag}"][r0 : r0 + n] = k
        ts, dts = (packs.video_t, packs.video_dt) if video else (packs.action_t, packs.action_dt)
        h["t_table"][k, : len(ts)] = torch.stack(ts).float()
        h["dt_table"][k, : len(dts)] = torch.stack(dts).float()
        h["guide_K"][k] = packs.guide_v if video else packs.guide_a
        q_off = 0 if video else Qv
        plan = s.plan.video if video else s.plan.action
        freqs = rope(packs, p.kind, p.index)
        for d in range(rows):
            q0 = (i * rows + d) * n
            h[f"src_{tag}"][q0 : q0 + n] = r0 + torch.arange(n)
            h["tslot_Q"][q_off + q0 + fixed : q_off + q0 + n] = k
            h["rslot_Q"][q_off + q0 : q_off + q0 + n] = k
            call.doc(q_off + q0, s, d, plan, freqs)
        h[f"cq_{tag}"][r0 : r0 + n] = i * rows * n + torch.arange(n)
        h[f"uq_{tag}"][r0 : r0 + n] = (i * rows + rows - 1) * n + torch.arange(n)
        spans[k] = ((r0, n), (0, 0)) if video else ((0, 0), (r0, n))  # type: ignore[assignment]
        iv, ia = iv + video, ia + (not video)
    h.update({f"call.{k}": v for k, v in call.host().items()})
    return h, spans


def feedback_rounds(packs: Any, members: list[Any]) -> None:
    """Prefill the joining members' feedback, one chunk of each a round (module docstring)."""
    g, F_ = packs.geo, packs.cfg.frame_chunk_size
    todo = [(m.record, m.request.chunk, list(m.record.plan.feedback)) for m in members]
    while any(fb for _, _, fb in todo):
        now = [(s, r, fb.pop(0)) for s, r, fb in todo if fb]
        Qv = packs.fb_docs * g.L
        lat, act = _Call(packs, Qv, packs.fb_docs * g.A), _Call(packs, Qv, packs.fb_docs * g.A)
        tok_v, tok_a = torch.zeros_like(packs.fb_tok_v, device="cpu"), torch.zeros_like(
            packs.fb_tok_a, device="cpu")  # fmt: skip
        i = 0
        for s, r, (j, fl, fa) in now:
            frames = r.frames[j * F_ : (j + 1) * F_].float()
            x_v = packs._patchify(rearrange(frames, "f c h w -> 1 c f h w"))
            x_a = r.actions[j * F_ : (j + 1) * F_].reshape(g.A, g.action_dim).float()
            x_a = x_a * packs.used  # LeRobot zeroes the unused channels before the call
            for d in range(g.cv):
                tok_v[i * g.L : (i + 1) * g.L], tok_a[i * g.A : (i + 1) * g.A] = x_v, x_a
                lat.doc(i * g.L, s, d, fl, rope(packs, "video", j))
                act.doc(Qv + i * g.A, s, d, fa, rope(packs, "action", j))
                i += 1
        packs.fb_tok_v.copy_(tok_v)
        packs.fb_tok_a.copy_(tok_a)
        for call in (lat, act):
            packs.fb.load(call.host(), **packs.mask_args)
            bad = packs._run_feedback()
            if bool(bad.any()):  # admission work, not a step: it waits for the call (a sync)
                docs = set(call.doc_Q[bad.cpu()].tolist()) - {-1}
                raise FloatingPointError(
                    f"the feedback of docs {sorted(docs)} went non-finite inside the model"
                )
        packs.cache_stats["feedback_chunks"] += len(now)
