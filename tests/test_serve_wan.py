"""packing.serve.VideoEngine with a packed diffusers Wan (issue 26, build item 4): the host
pack, bad input, and the proof that each request packed with others at mixed lengths and
mixed steps equals the same request run alone through the UNMODIFIED WanTransformer3DModel."""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("diffusers")

from packing.integrations.diffusers import ServedWan, install
from packing.integrations.diffusers.testing import reference_generate, tiny_wan
from packing.serve import FlowScheduler, VideoEngine, VideoRequest, VideoShape

HW = (4, 6)  # a (2, 3) token grid: 6 tokens a frame
C, D_TXT = 48, 24  # tiny Wan 2.2: 48 latent channels, text width 24


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, 2 busy cores


def _models(document_mask: bool = True):
    """The unmodified model (for the reference) and a packed copy with the same weights."""
    torch.manual_seed(0)
    model = tiny_wan("2.2")
    packed = install(copy.deepcopy(model), latent_hw=HW, document_mask=document_mask)
    return model, ServedWan(packed)


def _request(g: torch.Generator, context: int, frames: int, words: int, **kw) -> VideoRequest:
    return VideoRequest(
        text=torch.randn(words, D_TXT, generator=g),
        context=torch.randn(context, C, *HW, generator=g),
        frames=frames,
        **kw,
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def test_the_host_pack_matches_the_docstring_picture():
    _, served = _models()
    g = torch.Generator().manual_seed(0)
    engine = VideoEngine(served, [VideoShape(frames=6, text=8, requests=3)], max_steps=4)
    for ctx, frames, words in ((1, 2, 3), (0, 1, 2), (0, 2, 1)):
        engine.submit(_request(g, ctx, frames, words, steps=4))
    engine.step()
    b = engine.packs.buffers[engine.shape]  # type: ignore[index]
    tpf = 6
    assert b.pack.doc_T[::tpf].tolist() == [0, 0, 0, 1, 2, 2] and b.pack.doc_T.shape == (36,)
    assert b.slot_S.tolist() == [-1, 0, 0, 1, 2, 2]
    assert b.pack.text_doc_X.tolist() == [0, 0, 0, 1, 1, 2, -1, -1]
    assert b.pack.thw_T3[::tpf, 0].tolist() == [0, 1, 2, 0, 0, 1]  # frame place in its request
    assert b.pack.thw_T3[:tpf, 1:].tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]


def test_requests_and_engine_reject_bad_input():
    z = torch.zeros
    with pytest.raises(ValueError, match=r"VideoRequest.text must be a \(L, D_txt\) tensor"):
        VideoRequest(text=z(D_TXT), context=z(0, C, *HW), frames=1)
    with pytest.raises(ValueError, match=r"VideoRequest.context must be a \(F_c, C, H, W\)"):
        VideoRequest(text=z(2, D_TXT), context=z(C, *HW), frames=1)
    with pytest.raises(ValueError, match=r"VideoRequest\.frames=0"):
        VideoRequest(text=z(2, D_TXT), context=z(0, C, *HW), frames=0)
    with pytest.raises(ValueError, match=r"VideoRequest\.text has no rows"):
        VideoRequest(text=z(0, D_TXT), context=z(0, C, *HW), frames=1)
    with pytest.raises(ValueError, match=r"VideoShape\.text=0"):
        VideoShape(frames=2, text=0, requests=1)
    with pytest.raises(TypeError, match="ServedWan takes a PackedWan"):
        ServedWan(tiny_wan("2.2"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must be a VideoModel; PackedWan has no .*ServedWan"):
        VideoEngine(
            install(tiny_wan("2.2"), latent_hw=HW), [VideoShape(frames=2, text=2, requests=1)]
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"latent_hw=\(4, 5\) is not divisible by the patch"):
        ServedWan(install(tiny_wan("2.2"), latent_hw=HW), latent_hw=(4, 5))
    _, served = _models()
    engine = VideoEngine(served, [VideoShape(frames=3, text=4, requests=1)], max_steps=4)
    with pytest.raises(ValueError, match=r"the model takes \(C, H, W\) = \(48, 4, 6\)"):
        engine.submit(VideoRequest(text=z(2, D_TXT), context=z(0, C, 4, 4), frames=1))
    with pytest.raises(ValueError, match="the model reads text width 24"):
        engine.submit(VideoRequest(text=z(2, 8), context=z(0, C, *HW), frames=1))
    with pytest.raises(ValueError, match="max_steps=4"):
        engine.submit(VideoRequest(text=z(2, D_TXT), context=z(0, C, *HW), frames=1, steps=5))
    with pytest.raises(ValueError, match="more than the largest VideoShape"):
        engine.submit(VideoRequest(text=z(2, D_TXT), context=z(1, C, *HW), frames=3, steps=4))
    with pytest.raises(TypeError, match="submit takes a VideoRequest"):
        engine.submit("a request")  # type: ignore[arg-type]
    served.packed.uninstall()
    with pytest.raises(ValueError, match=r"uninstalled; install\(model\) again"):
        ServedWan(served.packed)


def _serve(served: ServedWan, reqs: list[VideoRequest], when: list[int], sch: FlowScheduler):
    """Submit request i at engine tick ``when[i]``; results by request index, plus what the
    packs held (the most distinct steps at once, requests that joined a running pack)."""
    shapes = [VideoShape(frames=6, text=10, requests=2), VideoShape(frames=14, text=24, requests=4)]
    engine = VideoEngine(served, shapes, scheduler=sch, max_steps=6)
    ids: dict[int, int] = {}
    out, tick, distinct, joined, used = {}, 0, 0, 0, set()
    while len(out) < len(reqs):
        for i, w in enumerate(when):
            if i not in ids and w <= tick:
                ids[i] = engine.submit(reqs[i])
        out.update({r.request_id: r for r in engine.step()})  # idle: a no-op, time passes
        steps = [s for _, s in engine.last_pack]
        distinct = max(distinct, len(set(steps)))
        joined += engine.active > 0 and 0 in steps and len(set(steps)) > 1
        used.add(engine.shape)
        tick += 1
    return {i: out[rid] for i, rid in ids.items()}, distinct, joined, used


@pytest.mark.parametrize("seed", [1, 2])
def test_packed_wan_equals_each_request_alone_through_the_unmodified_model(seed):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    model, served = _models()
    sch = FlowScheduler(solver=("euler", "multistep2")[seed % 2], shift=3.0)
    reqs = [
        _request(g, rng.choice([0, 0, 1, 2]), rng.randint(1, 3), rng.randint(1, 6),
                 seed=seed * 10 + i, steps=rng.randint(2, 6))
        for i in range(6)
    ]  # fmt: skip
    when = [0, 0, 1, 2, 4, 5]
    results, distinct, joined, used = _serve(served, reqs, when, sch)
    # Guards: the interesting situations happened.
    assert distinct >= 3 and joined >= 1 and len(used) == 2
    assert any(r.context.shape[0] for r in reqs) and not all(r.context.shape[0] for r in reqs)
    for i, r in enumerate(reqs):
        want = reference_generate(model, r, sch)
        assert results[i].latents.shape == (r.frames, C, *HW)
        assert _rel(results[i].latents, want) <= 1e-5, (i, _rel(results[i].latents, want))


def test_the_proof_fails_without_the_document_mask():
    g = torch.Generator().manual_seed(1)
    model, served = _models(document_mask=False)
    sch = FlowScheduler()
    reqs = [_request(g, i % 2, 2, 3 + i, seed=i, steps=3) for i in range(3)]
    results, *_ = _serve(served, reqs, [0, 0, 1], sch)
    errors = [_rel(results[i].latents, reference_generate(model, r, sch)) for i, r in
              enumerate(reqs)]  # fmt: skip
    assert min(errors) > 1e-3, errors


def test_context_frames_stay_clean_and_condition_the_generated_ones():
    """A context frame is never updated (its tokens run at t = 0, TI2V's clean first frame)
    and it reaches the generated frames: without it the same request gives another result."""
    model, served = _models()
    g = torch.Generator().manual_seed(5)
    r = _request(g, 1, 2, 3, seed=3, steps=3)
    engine = VideoEngine(served, [VideoShape(frames=3, text=3, requests=1)], max_steps=3)
    engine.submit(r)
    (got,) = engine.run()
    assert torch.equal(engine.packs.buffers[engine.shape].x_S[0], r.context[0])  # type: ignore[index]
    assert _rel(got.latents, reference_generate(model, r, FlowScheduler())) <= 1e-5
    no_ctx = VideoRequest(text=r.text, context=r.context[:0], frames=2, seed=3, steps=3)
    assert _rel(got.latents, reference_generate(model, no_ctx, FlowScheduler())) > 1e-3
