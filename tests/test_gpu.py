"""packing.attention._packed and the reference DiT on CUDA: every backend against one SDPA per episode.

Skipped without a GPU. Run on the H200 with
``python -m pytest tests/test_gpu.py -q -p no:cacheprovider`` (flash-attn-4 on PYTHONPATH to
cover ``flex_flash`` and the FA4 ``varlen`` kernel; see /work/shared/gpu-recipes.md).

bf16 kernels are compared with an fp32 per-episode reference: forward max relative error
< 2e-2, gradient cosine >= 0.999 per tensor. fp32 flex is compared at 1e-4.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from reference import per_episode, rel

from packing.attention import (
    InnerMask,
    causal,
    fa4_available,
    frame_causal,
    packed_attention,
    prepare_attention,
)
from packing.data import StreamLayout, layout_from_lengths

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

H, D = 4, 128
DEV = "cuda"
LENGTHS = [232, 1, 129, 700, 33]  # ragged, with a one-token episode
PAD = 1280 - sum(LENGTHS)
KV_LENGTHS = [7, 3, 11, 40, 1]
KV_PADS = {"self": 0, "cross": 128 - sum(KV_LENGTHS), "cross_full_keys": 0}


def lay(lengths: list[int], pad: int) -> StreamLayout:
    return layout_from_lengths(lengths, lengths, sum(lengths) + pad).to(DEV)


def qkv(tq: int, tkv: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    shapes = ((tq, H, D), (tkv, H, D), (tkv, H, D))
    return tuple(
        torch.randn(s, generator=g, device=DEV, dtype=torch.float32).to(dtype).requires_grad_()
        for s in shapes
    )


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def backends(inner: InnerMask | None) -> list[str]:
    out = ["sdpa", "flex"]
    if fa4_available():
        out.append("flex_flash")
    if inner is None:
        out.append("varlen")
    return out


CASES: list[tuple[str, InnerMask | None]] = [
    ("document", None),
    ("causal", causal()),
    ("frame_causal", frame_causal(32)),
]


def check(
    backend: str,
    inner: InnerMask | None,
    side: str,
    dtype: torch.dtype,
    pad: int = PAD,
) -> dict[str, Any]:
    """``side``: self, cross (padded keys) or cross_full_keys (no padding key, so varlen's
    padding queries join the last episode's sequence)."""
    cross = side != "self"
    q_lay = lay(LENGTHS, pad)
    kv_lay = lay(KV_LENGTHS, KV_PADS[side]) if cross else q_lay
    if cross and inner is not None:
        inner = frame_causal(32, 1)
    q, k, v = qkv(q_lay.padded_len, kv_lay.padded_len, dtype)
    mask = prepare_attention(
        q_lay, kv_lay if cross else None, inner, backend, device=DEV, dtype=dtype
    )
    assert mask.backend == backend
    out = packed_attention(q, k, v, mask)
    # The loss weight covers the padding rows too: their output is a constant 0, so the
    # gradient reaching them must go nowhere (the reference's padding rows are 0 as well).
    w = torch.randn(out.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    got = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    ref = per_episode(q.float(), k.float(), v.float(), q_lay, kv_lay, inner)
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    r = q_lay.doc_ids_T >= 0
    assert torch.isfinite(out).all(), "non-finite output (padding rows?)"
    if pad:
        assert out[~r].abs().max() == 0, "padding queries must read exactly 0"
    return {
        "fwd": rel(out[r], ref[r]),
        "cos": min(cosine(a, b) for a, b in zip(got, want, strict=True)),
        "finite_grads": all(torch.isfinite(g).all() for g in got),
    }


@pytest.mark.parametrize(("name", "inner"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("side", list(KV_PADS))
@pytest.mark.parametrize("backend", ["sdpa", "flex", "flex_flash", "varlen"])
def test_bf16_backends_match_per_episode_sdpa(
    backend: str, side: str, name: str, inner: InnerMask | None
) -> None:
    if backend not in backends(inner):
        pytest.skip(f"{backend} does not take {name} masks here (or flash-attn-4 is missing)")
    res = check(backend, inner, side, torch.bfloat16)
    assert res["finite_grads"]
    assert res["fwd"] < 2e-2, res
    assert res["cos"] >= 0.999, res


@pytest.mark.parametrize(("name", "inner"), CASES, ids=[c[0] for c in CASES])
def test_fp32_flex_matches_per_episode_sdpa(name: str, inner: InnerMask | None) -> None:
    for side in KV_PADS:
        res = check("flex", inner, side, torch.float32)
        assert res["fwd"] < 1e-4 and res["cos"] > 0.99999, (side, res)


@pytest.mark.parametrize("backend", ["flex", "flex_flash", "varlen"])
def test_a_full_pack_and_a_mostly_empty_one_match_per_episode(backend: str) -> None:
    # No padding at all, and a tail 4x the real tokens: the varlen tail attends to one key.
    if backend not in backends(None):
        pytest.skip("flash-attn-4 is missing")
    for pad in (0, 4 * sum(LENGTHS)):
        res = check(backend, None, "self", torch.bfloat16, pad=pad)
        assert res["finite_grads"] and res["fwd"] < 2e-2 and res["cos"] >= 0.999, (pad, res)


def test_auto_picks_the_fastest_valid_kernel_and_says_why() -> None:
    q_lay = lay(LENGTHS, PAD)
    doc = prepare_attention(q_lay, device=DEV, dtype=torch.bfloat16)
    inner = prepare_attention(q_lay, inner=causal(), device=DEV, dtype=torch.bfloat16)
    fp32 = prepare_attention(q_lay, device=DEV, dtype=torch.float32)
    if fa4_available():
        assert (doc.backend, doc.kernel) == ("varlen", "fa4")
        assert inner.backend == "flex_flash"
    else:
        assert doc.backend == "flex" and "not installed" in doc.reason
        assert inner.backend == "flex"
    assert fp32.backend == "flex"


def test_varlen_refuses_fp32_at_call_time() -> None:
    q_lay = lay(LENGTHS, PAD)
    mask = prepare_attention(q_lay, backend="varlen", device=DEV)  # dtype not given
    q, k, v = qkv(q_lay.padded_len, q_lay.padded_len, torch.float32)
    with pytest.raises(ValueError, match=r"bf16/fp16 only.*float32"):
        packed_attention(q, k, v, mask)


def test_flex_does_not_recompile_when_the_layout_changes_at_a_fixed_length() -> None:
    from torch._dynamo.utils import counters

    q, k, v = (t.detach() for t in qkv(1024, 1024, torch.bfloat16))
    for lengths in ([1000], [500, 500]):  # warm up: both closures compiled once at most
        packed_attention(
            q, k, v, prepare_attention(lay(lengths, 1024 - sum(lengths)), backend="flex")
        )
    before = counters["stats"]["unique_graphs"]
    for lengths in ([232, 1, 129, 600], [17, 900], [3, 3, 3, 3, 1000]):
        mask = prepare_attention(lay(lengths, 1024 - sum(lengths)), backend="flex")
        packed_attention(q, k, v, mask)
    assert counters["stats"]["unique_graphs"] == before


def test_pool_block_mask_from_host_ids_never_waits_for_the_device_and_attends_right() -> None:
    """make_pool_block_mask(host ids, device='cuda'): no host sync while a kernel runs (the
    tables go through pinned memory), the tables those of create_block_mask on the GPU, and
    compiled flex over it equals the rule by hand."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from packing.attention import make_pool_block_mask

    g = torch.Generator().manual_seed(0)
    q_doc = torch.arange(6).repeat_interleave(128)
    kv_doc = torch.randint(-1, 6, (4096 // 64,), generator=g).repeat_interleave(64)
    torch.cuda._sleep(10**6)  # a queued kernel: a sync would wait for it
    torch.cuda.set_sync_debug_mode("error")
    try:
        bm = make_pool_block_mask(q_doc, kv_doc, device=DEV)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    q_dev, kv_dev = q_doc.to(DEV), kv_doc.to(DEV)

    def same_doc(b: Any, h: Any, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return (q_dev[i] == kv_dev[j]) & (q_dev[i] >= 0)

    want = create_block_mask(same_doc, None, None, q_doc.shape[0], kv_doc.shape[0], device=DEV)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(bm, name), getattr(want, name)), name
    q, k, v = (torch.randn(1, H, n, D, device=DEV) for n in (768, 4096, 4096))
    out = torch.compile(flex_attention)(q, k, v, block_mask=bm)
    allowed = (q_dev[:, None] == kv_dev[None, :]) & (q_dev[:, None] >= 0)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("inner", [None, causal()], ids=["document", "causal"])
def test_cuda_graph_block_mask_equals_eager_without_syncs_or_aliasing(
    inner: InnerMask | None,
) -> None:
    """make_block_mask(compile='cuda_graph'): the same tables as the eager builder on every
    layout of one length, no host sync after the capture, and a mask built earlier is not
    overwritten by the next build (the replay writes into the graph's own buffer)."""
    from packing.attention import make_block_mask
    from packing.attention._compile import BLOCK_MASK_GRAPHS

    BLOCK_MASK_GRAPHS.reset()
    layouts = ([1000, 24], [232, 1, 129, 600], [17, 900], [3, 3, 3, 3, 1000], [1024])
    docs = [lay(lens, 1024 - sum(lens)).doc_ids_T for lens in layouts]
    make_block_mask(docs[0], inner=inner, compile="cuda_graph")  # capture (syncs)
    built = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for doc in docs:
            built.append(make_block_mask(doc, inner=inner, compile="cuda_graph"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(BLOCK_MASK_GRAPHS.keys) == 1
    for doc, got in zip(docs, built, strict=True):  # read after every build has run
        want = make_block_mask(doc, inner=inner)
        for g, w in zip(got.as_tuple()[2:10], want.as_tuple()[2:10], strict=True):
            assert torch.equal(g, w)


# -- the reference model on the GPU ---------------------------------------------------------------
def _episodes() -> list[dict[str, Any]]:
    out = []
    for i, (f, a) in enumerate([(9, 9), (2, 2), (5, 5)]):
        g = torch.Generator().manual_seed(i)
        out.append(
            {
                "latents": torch.randn(f, 48, 8, 16, generator=g).half(),
                "action": torch.randn(a, 14, generator=g),
                "task": ["pick", "place the cup", ""][i],
                "episode_index": 10 + i,
            }
        )
    return out


@pytest.mark.parametrize("frame_causal_", [False, True], ids=["document", "frame_causal"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_model_packed_equals_per_episode_on_cuda(frame_causal_: bool, autocast: bool) -> None:
    from packing.data import PackedCollator
    from packing.model import DiT, DiTConfig

    torch.manual_seed(0)
    cfg = DiTConfig.tiny(dim=256, heads=2, frame_causal=frame_causal_)  # head dim 128
    m = DiT(cfg).to(DEV)
    col = PackedCollator(m.streams)
    eps = _episodes()

    def run(batch: Any) -> dict[str, torch.Tensor]:
        batch.extras.update(seed=0, step=1)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return m(batch.to(DEV))

    packed = col(eps)
    out = run(packed)
    mask = m.prepare(_with_keys(packed))["self_mask"]
    tol = 5e-3 if autocast else 1e-4
    for k, ep in enumerate(eps):
        alone = run(col([ep]))
        for s in ("latents", "action"):
            cu = packed.layout(s).cu_seqlens_K1
            n = int(cu[k + 1] - cu[k])
            a = out[s][int(cu[k]) : int(cu[k + 1])].detach().sum()
            b = alone[s][:n].detach().sum()
            assert abs(float(a - b)) / abs(float(b)) < tol, (k, s, mask.backend)


def _with_keys(batch: Any) -> Any:
    batch = batch.to(DEV)
    batch.extras.update(seed=0, step=1)
    return batch


def test_model_with_a_static_max_docs_matches_without() -> None:
    # max_docs pads cu_seqlens of the video/action layouts with empty documents while the text
    # (packed by the model from the task strings) has none: varlen must pair them anyway.
    from packing.data import PackedCollator
    from packing.model import DiT, DiTConfig

    torch.manual_seed(0)
    m = DiT(DiTConfig.tiny(dim=256, heads=2)).to(DEV)
    eps = _episodes()
    outs = []
    for kw in ({}, {"max_docs": 6}):
        batch = _with_keys(PackedCollator(m.streams, **kw)(eps))
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            outs.append(m(batch))
    for s in ("latents", "action"):
        assert torch.isfinite(outs[1][s]).all()
        torch.testing.assert_close(outs[1][s], outs[0][s], rtol=1e-2, atol=1e-3)


# -- packing.serve: no step waits for the device, and a NaN stays with its request --------------
def _serve_model(cls: type | None = None) -> Any:
    from packing.model import DiT, DiTConfig

    torch.manual_seed(0)
    cfg = DiTConfig.tiny(latent_channels=8, latent_hw=(4, 8), action_dim=6, attention="sdpa")
    return (cls or DiT)(cfg).eval().to(DEV)


def _serve_request(i: int, steps: int = 3) -> Any:
    from packing.serve import Request

    ctx = torch.randn(i % 3, 8, 4, 8, generator=torch.Generator().manual_seed(i))
    return Request(context=ctx, frames=1, actions=3, seed=i, steps=steps)


def _host_never_waited(fn: Any) -> bool:
    """Queue ~1 s of GPU sleep, run ``fn`` on the host, and tell whether the sleep was still
    running when ``fn`` returned: False if ``fn`` waited for the device in any way, a sync, a
    read of a device value, or a copy the driver makes wait for the stream (which
    ``set_sync_debug_mode`` does not see). The event is recorded right after the sleep, so
    work ``fn`` itself queues (a copy still in flight) cannot look like "never waited"."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # cycles: about a second on an H200
    slept = torch.cuda.Event()
    slept.record()
    fn()
    busy = not slept.query()
    torch.cuda.synchronize()
    return busy


def test_the_wait_check_sees_a_wait() -> None:
    """The check against its controls. A wait it must see: reading a value the stream has
    not produced yet (``.cpu()`` of a tensor queued after the sleep must wait for the sleep:
    a data dependency, on every driver), and a stream sync. No wait: a non-blocking copy
    from pinned memory. (A "non-blocking" copy from pageable memory is NOT a control: CUDA
    says it "might be synchronous"; on the H200 a 256 KiB one did not wait, staged by the
    driver. The engines pin every copy so that they never depend on the driver's choice.)"""
    produced = torch.zeros(1 << 16, device=DEV)
    pinned = torch.randn(1 << 16).pin_memory()

    def read_back() -> None:
        produced.add_(1.0)  # queued after the sleep
        produced.cpu()

    assert not _host_never_waited(read_back)  # the control: the host waited for the sleep
    assert not _host_never_waited(torch.cuda.current_stream().synchronize)
    assert _host_never_waited(lambda: pinned.to(DEV, non_blocking=True))


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_steps_and_admissions_never_wait_for_the_device(graphs: bool) -> None:
    from packing.serve import Engine, EngineConfig, PackShape

    shape = PackShape(frames=12, actions=16, requests=4)
    config = EngineConfig(shapes=(shape,), cuda_graphs=graphs, max_steps=4, attention="sdpa")
    engine, out = Engine(_serve_model(), config), list[Any]()
    for checked in (False, True):  # the same arrivals twice: the first captures the graph and
        for i in range(6):  # fills the pinned-memory cache, the second is checked
            engine.submit(_serve_request(i, steps=2 + i % 3))  # admission at every step
            if not checked:
                out.extend(engine.step())
                continue
            torch.cuda.set_sync_debug_mode("error")
            try:
                assert _host_never_waited(lambda: out.extend(engine.step())), f"step {i} waited"
            finally:
                torch.cuda.set_sync_debug_mode(0)
        out.extend(engine.run())
    assert sorted(r.request_id for r in out) == list(range(12))
    assert all(r.error is None for r in out)


@pytest.mark.parametrize("graphs", [False, True])
def test_a_nan_velocity_on_cuda_fails_only_its_request(graphs: bool) -> None:
    from packing.model import DiT
    from packing.serve import Engine, EngineConfig, PackShape

    class NaNSlot2(DiT):  # captured once under graphs: slot 2 is NaN at every call
        def velocity(self, tokens, t_R, row_J, pack):  # type: ignore[override]
            out = super().velocity(tokens, t_R, row_J, pack)
            hit = (row_J[pack.latents_dest_T] == 2)[:, None]
            out["latents"] = torch.where(hit, float("nan"), out["latents"])
            return out

    shape = PackShape(frames=12, actions=16, requests=4)
    cfg = dict(shapes=(shape,), max_steps=4, attention="sdpa")
    engine = Engine(_serve_model(NaNSlot2), EngineConfig(cuda_graphs=graphs, **cfg))
    reqs = [_serve_request(i, steps=3) for i in range(3)]  # the last one, in slot 2, fails
    ids = [engine.submit(r) for r in reqs]
    got = {r.request_id: r for r in engine.run()}
    assert sorted(got) == ids
    assert got[ids[2]].error is not None and "non-finite state at step 1" in got[ids[2]].error
    for i in (0, 1):
        alone = Engine(_serve_model(), EngineConfig(**cfg))
        alone.submit(reqs[i])
        (want,) = alone.run()
        assert got[ids[i]].error is None
        torch.testing.assert_close(got[ids[i]].latents, want.latents, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", ["flex", "flex_flash"])
def test_cached_engines_one_after_another_over_compiled_blocks(attention: str) -> None:
    """benchmarks/serving/robots.py's step_costs at a small size, the sequence that crashed
    on the H200 (illegal memory access at the second engine, 40b14ba): one bf16 model whose
    blocks are compiled (dynamic=False), cached CUDA-graph engines for 1, 2 and 4 requests
    built one after another (each kept alive while the next is built), each warmed with
    sessions that then end. The pool's keys (N + J) and the pack's queries (J = 80 n) are
    not multiples of the 128-token tile, as at 5B widths; every result must equal the
    request alone through an eager uncached engine."""
    from packing.model import DiT, DiTConfig
    from packing.serve import ContextCache, Engine, EngineConfig, FlowScheduler, PackShape, Request

    if attention == "flex_flash" and not fa4_available():
        pytest.skip("flash-attn-4 is not installed")
    torch.manual_seed(0)
    cfg = DiTConfig.tiny(dim=128, heads=2, ffn_dim=256, latent_channels=8, latent_hw=(8, 16),
                         action_dim=6, frame_causal=True)  # fmt: skip  # 32 tokens a frame
    model = DiT(cfg).to(DEV, torch.bfloat16).eval()
    eager = DiT(cfg).to(DEV, torch.bfloat16).eval()
    eager.load_state_dict(model.state_dict())
    for block in model.blocks:
        block.compile(dynamic=False)
    sched = FlowScheduler(solver="multistep2", shift=5.0)

    def frames(n: int, seed: int) -> torch.Tensor:
        return torch.randn(n, 8, 8, 16, generator=torch.Generator().manual_seed(seed))

    engines = []  # kept: robots.py's previous engine is alive while the next is built
    for n in (1, 2, 4):
        shape = PackShape(frames=2 * n, actions=16 * n, requests=n)
        engine = Engine(model, EngineConfig(
            shapes=(shape,), max_steps=3, cuda_graphs=True, scheduler=sched, attention=attention,
            context_cache=ContextCache(pages=16, page_frames=4)))  # fmt: skip
        for k in range(n):  # warm-up: sessions with a longer context, then ended
            engine.submit(Request(context=frames(8, 100 + k), frames=2, actions=16, steps=3,
                                  session=f"warm {k}"))  # fmt: skip
        engine.run()
        for k in range(n):
            engine.end_session(f"warm {k}")
        reqs = [Request(context=frames(5, k), frames=2, actions=16, steps=3, seed=k,
                        task=f"robot {k}", session=f"cost {k}") for k in range(n)]  # fmt: skip
        ids = [engine.submit(r) for r in reqs]
        got = {r.request_id: r for r in engine.run()}
        torch.cuda.synchronize()  # a fault in this engine surfaces here, not in the next
        engines.append(engine)
        for rid, r in zip(ids, reqs, strict=True):
            alone = Engine(eager, EngineConfig(
                shapes=(PackShape(frames=7, actions=16, requests=1),), max_steps=3,
                scheduler=sched, attention=attention))  # fmt: skip
            alone.submit(r)
            (want,) = alone.run()
            assert got[rid].error is None, got[rid].error
            for a, b in ((got[rid].latents, want.latents), (got[rid].action, want.action)):
                assert rel(a, b) < 2e-2, (n, rid, rel(a, b))


# -- LeRobot's LingBot-VA served on CUDA (issue 42): eager, and every step a CUDA graph -------
# fp32 on the GPU: a pack's attention runs over the pool in another summation order than
# LeRobot's SDPA over one robot's cache (and 2 + 1 video and 3 action steps compound it), so
# 1e-4, not the CPU's 1e-5 (fp32's ulp at 1 is 1.2e-7). bf16: LeRobot rounds its latents to
# bf16 (eps 7.8e-3) at every Euler step, the engine keeps fp32 state: on the CPU the proof in
# bf16 measured 0.083 (latents) and 0.022 (actions) where a planted mistake gives 0.31 in
# fp32 and 7.3 in bf16; 0.2 is a first bound for the H200 session to confirm or tighten.
LINGBOT_TOL = {"float32": 1e-4, "bfloat16": 0.2}


def _lingbot_ready() -> None:
    pytest.importorskip("lerobot.policies.lingbot_va")
    pytest.importorskip("transformers")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("graphs", [False, True])
def test_lingbot_served_robots_equal_lerobot_alone_on_cuda(graphs: bool, dtype: str) -> None:
    """The CPU proof (robots joining mid-run at different chunks, a changed keyframe, the
    cache window evicting) on the GPU, LeRobot alone on the same GPU with the same noise."""
    _lingbot_ready()
    from packing.integrations.lingbot_va._serve_proof import prove_serving

    r = prove_serving(device=DEV, dtype=dtype, cuda_graphs=graphs, tolerance=LINGBOT_TOL[dtype])
    assert r.ok, r
    assert r.chunks >= 13 and r.max_pack >= 3 and r.mixed_steps and r.evicted > 0


def test_lingbot_planted_mistake_fails_on_cuda_graphs() -> None:
    _lingbot_ready()
    from packing.integrations.lingbot_va._serve_proof import prove_serving

    r = prove_serving("no_document_mask", device=DEV, cuda_graphs=True, tolerance=1e-4)
    assert not r.ok and max(r.latents, r.actions) > 1e-3, r


def _lingbot_engine(graphs: bool, robots: int = 3) -> Any:
    from packing.integrations.lingbot_va._serve import LingBotVAEngine
    from packing.integrations.lingbot_va._serve_packs import LingShape
    from packing.integrations.lingbot_va.testing import tiny_serving_policy

    # longer loops than the proof's: steps that admit nothing (steady state) in between
    policy = tiny_serving_policy(device=DEV, num_inference_steps=6,
                                 action_num_inference_steps=8).to(DEV)  # fmt: skip
    engine = LingBotVAEngine(policy, robots=robots, shapes=[LingShape(video=2, action=2)],
                             cuda_graphs=graphs)  # fmt: skip
    engine.warm_up()
    return engine


def _chunk(session: str, k: int, frames: torch.Tensor) -> Any:
    from packing.integrations.lingbot_va._serve_request import ChunkRequest
    from packing.integrations.lingbot_va.testing import toy_text_embeddings

    text = toy_text_embeddings(16)
    return ChunkRequest(session=session, frames=frames[: max(1, 2 * k)], actions=None,
                        prompt=text(session[:1]), negative=text(""), seed=k)  # fmt: skip


@pytest.mark.parametrize("graphs", [False, True])
def test_lingbot_steady_steps_never_wait_for_the_device(graphs: bool) -> None:
    """Three robots, two chunks each, joining at engine steps 0, 2 and 4; every step that
    admits nothing and leaves work behind (steady state: the model call, the solver update,
    the flags' copy) must not wait for the device. Admission may (its feedback check reads
    the call's flags back). Run twice: the first fills the pinned-memory cache."""
    _lingbot_ready()
    engine = _lingbot_engine(graphs)
    checked = 0
    for round_ in ("warm", "checked"):
        frames = {f"{n}-{round_}": torch.randn(5, 48, 8, 16, generator=torch.Generator()
                                               .manual_seed(i)) for i, n in enumerate("abc")}  # fmt: skip
        start = dict(zip(frames, (0, 2, 4), strict=True))
        nxt, ids, t0 = dict.fromkeys(frames, 0), {}, engine.clock
        while any(k < 2 for k in nxt.values()):
            for n in frames:
                if n not in ids.values() and nxt[n] < 2 and engine.clock - t0 >= start[n]:
                    ids[engine.submit(_chunk(n, nxt[n], frames[n]))] = n
            # private, read only: a step admits when a phase waits or a member left, and
            # waits for every flag when it leaves nothing to run
            steady = (not engine.waiting and not engine._left
                      and any(m.request.steps - m.step > 1 for m in engine._members))  # fmt: skip
            out: list[Any] = []
            if round_ == "checked" and steady:
                torch.cuda.set_sync_debug_mode("error")
                try:
                    assert _host_never_waited(lambda out=out: out.extend(engine.step()))
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                checked += 1
            else:
                out = engine.step()
            for res in out:
                assert res.error is None, res.error
                nxt[ids.pop(res.request_id)] += 1
        for n in frames:
            engine.end_session(n)  # the pool's regions, for the next round's robots
    assert checked >= 6 and engine.captures_after_warm_up == 0, (checked, engine.warm_stats)


@pytest.mark.parametrize("graphs", [False, True])
def test_lingbot_non_finite_feedback_fails_its_robot_on_cuda(graphs: bool) -> None:
    """Robot b's chunk 1 feeds back a keyframe that overflows inside the model: its feedback
    call's keys go non-finite and b fails, a does not. Under CUDA graphs the flags come from
    the replayed call (a static buffer: a captured call returned nothing before)."""
    _lingbot_ready()
    engine = _lingbot_engine(graphs, robots=2)
    frames = {n: torch.randn(3, 48, 8, 16, generator=torch.Generator().manual_seed(i))
              for i, n in enumerate("ab")}  # fmt: skip
    frames["b"][1] = 1e30  # finite in float32, inf once multiplied
    for k in (0, 1):
        ids = {engine.submit(_chunk(n, k, frames[n])): n for n in "ab"}
        res = {ids[r.request_id]: r for r in engine.run()}
        assert res["a"].error is None, res["a"].error
        assert (res["b"].error is None) == (k == 0), res["b"].error
    assert "feedback" in str(res["b"].error) and "non-finite" in str(res["b"].error)


def test_lingbot_policy_encoders_on_cuda_keep_each_robots_vae_cache() -> None:
    """`LingBotVAAdapter.from_policy`'s encoders with the VAE on the GPU: two robots'
    messages interleaved, each robot's latents those of LeRobot encoding it alone (the CPU
    test holds them equal; here the same kernels on the same inputs, 1e-5)."""
    _lingbot_ready()
    import numpy as np
    from lerobot.policies.lingbot_va.utils import WanVAEStreamingWrapper

    from packing.integrations.lingbot_va import PolicyEncoders
    from packing.integrations.lingbot_va.testing import tiny_frozen_modules, tiny_serving_policy

    policy = tiny_frozen_modules(tiny_serving_policy(device=DEV).to(DEV))
    policy._frozen["vae"].to(DEV)
    policy._frozen["text_encoder"].to(DEV)
    cams, H, W = list(policy.config.obs_cam_keys), policy.config.height, policy.config.width
    msgs = {s: [{k: np.random.default_rng(i).integers(0, 256, (n, H, W, 3), dtype=np.uint8)
                 for k in cams} for n in (1, 4, 8)] for i, s in enumerate("ab")}  # fmt: skip
    enc = PolicyEncoders(policy)
    got = {s: [] for s in "ab"}
    for i in range(3):
        for s in "ab":
            got[s].append(enc(s, msgs[s][i]))
    for s in "ab":
        policy._frozen["streaming_vae"] = WanVAEStreamingWrapper(policy._frozen["vae"])
        for i, m in enumerate(msgs[s]):
            raw = [{k: torch.from_numpy(v[j]).permute(2, 0, 1)[None].float() / 255
                    for k, v in m.items()} for j in range(m[cams[0]].shape[0])]  # fmt: skip
            want = policy._encode_frames(raw)[0].transpose(0, 1)
            assert want.is_cuda and (got[s][i] - want).abs().max().item() <= 1e-5, (s, i)
