"""Issue 41, the serving side: what a request carries, what a server is built with, and how it
stops, each checked at its boundary, so that one robot's bad input changes nothing in another
robot's reply. One test per class of case; each failed before the fix."""

from __future__ import annotations

import http.client
import math
import re
import threading
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import MixModel

import packing.serve._request as request_module
import packing.serve._video_request as video_request_module
from packing.serve import (
    ContextCache,
    Engine,
    EngineConfig,
    PackShape,
    Request,
    VideoEngine,
    VideoRequest,
    VideoShape,
)
from packing.server import DiTAdapter, WanAdapter

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, 2 busy cores

FRAME = (8, 4, 8)  # the tiny DiT's latent (C, H, W), 6 action dims (tests/serve_robots.py)


def _dit() -> Any:
    from serve_robots import model

    return model()  # frame-causal, so the cached engine can serve it too


def _engine(cached: bool = False) -> Engine:
    cache = ContextCache(pages=16, page_frames=2) if cached else None
    shape = PackShape(frames=(1 if cached else 3) * 4, actions=4 * 4, requests=4)
    return Engine(_dit(), EngineConfig(shapes=(shape,), max_steps=4, context_cache=cache))


def _req(i: int, **kw: Any) -> Request:
    ctx = torch.randn(2, *FRAME, generator=torch.Generator().manual_seed(100 + i))
    return Request(context=kw.pop("context", ctx), frames=1, actions=4, seed=i, steps=3,
                   task=kw.pop("task", f"robot {i}"), **kw)  # fmt: skip


# -- a toy VideoModel (reference.MixModel): a NaN or inf still leaks, as in attention ------
def _video_engine() -> VideoEngine:
    return VideoEngine(MixModel(), [VideoShape(frames=12, text=12, requests=4)], max_steps=4)


def _video_req(i: int, **kw: Any) -> VideoRequest:
    g = torch.Generator().manual_seed(i)
    text, ctx = torch.randn(2, 3, generator=g), torch.randn(1, 2, 2, 2, generator=g)
    return VideoRequest(text=kw.pop("text", text), context=kw.pop("context", ctx), frames=2,
                        seed=i, steps=3, **kw)  # fmt: skip


# -- 1. every tensor a request carries: one check, finite in the dtype the engine computes in -
def _huge_f64(shape: tuple[int, ...]) -> torch.Tensor:
    t = torch.zeros(shape, dtype=torch.float64)
    t.view(-1)[-1] = 1e39  # finite in float64, inf in the engine's float32
    return t


def test_a_float64_value_beyond_float32_is_refused_naming_the_field_and_index():
    ctx = _huge_f64((2, *FRAME))
    with pytest.raises(ValueError, match=r"Request 'context' holds 1e\+39 at index \(1, 7, 3, 7\)"
                       r".*beyond float32's range"):  # fmt: skip
        Request(context=ctx, frames=1, actions=4)
    with pytest.raises(ValueError, match=r"VideoRequest 'text' holds 1e\+39 .*float32"):
        _video_req(0, text=_huge_f64((2, 3)))
    Request(context=ctx.clamp(max=3e38), frames=1, actions=4)  # the largest float32s pass


FIELDS = ["Request.context", "Request.committed_actions", "Request.keep_frames",
          "VideoRequest.text", "VideoRequest.context"]  # fmt: skip


def _build(field: str, value: Any) -> Any:
    if field == "Request.context":
        return _req(0, context=value)
    if field == "Request.committed_actions":
        return _req(0, committed_actions=value)
    if field == "Request.keep_frames":
        return _req(0, keep_frames=value)
    if field == "VideoRequest.text":
        return _video_req(0, text=value)
    return _video_req(0, context=value)


def _good(field: str) -> torch.Tensor:
    return {"Request.context": torch.zeros(2, *FRAME), "Request.committed_actions": torch.zeros(2, 6),
            "Request.keep_frames": torch.tensor([0, 1]), "VideoRequest.text": torch.zeros(2, 3),
            "VideoRequest.context": torch.zeros(1, 2, 2, 2)}[field]  # fmt: skip


# Bad kinds per field: every field gets the device, layout and dtype kinds; float fields the
# values too (NaN, +-inf, a float64 beyond float32's range); committed actions are float32 only.
KINDS = {
    "float": ["meta", "sparse", "complex", "int", "bool", "nan", "inf", "overflow"],
    "committed_actions": ["meta", "sparse", "complex", "int", "bool", "nan", "inf", "float64"],
    "keep_frames": ["meta", "sparse", "complex", "float", "bool"],
}


def _bad_tensor(good: torch.Tensor, kind: str, index: int, sign: float) -> torch.Tensor:
    if kind == "meta":
        return good.to("meta")
    if kind == "sparse":
        return good.to_sparse()
    dtype = {"complex": torch.complex64, "int": torch.int64, "bool": torch.bool,
             "float": torch.float64, "float64": torch.float64, "overflow": torch.float64}  # fmt: skip
    value = good.to(dtype.get(kind, good.dtype))
    if kind in ("nan", "inf", "overflow"):
        value.view(-1)[index] = {"nan": math.nan, "inf": sign * math.inf, "overflow": sign * 1e39}[
            kind
        ]
    return value


@settings(max_examples=150)
@given(field=st.sampled_from(FIELDS), data=st.data())
def test_every_field_a_request_carries_refuses_every_bad_tensor_naming_it(field, data):
    """Random bad devices, layouts, dtypes and values in every tensor field: always packing's
    own TypeError or ValueError naming the field, never an accepted request or torch's error."""
    key = field.split(".")[1]
    good = _good(field)
    kind = data.draw(st.sampled_from(KINDS.get(key, KINDS["float"])), label="kind")
    index = data.draw(st.integers(0, good.numel() - 1), label="index")
    sign = data.draw(st.sampled_from([1.0, -1.0]), label="sign")
    with pytest.raises((TypeError, ValueError)) as info:
        _build(field, _bad_tensor(good, kind, index, sign))
    assert key in str(info.value), info.value
    assert "packing" in info.traceback[-1].path.parts, info.traceback[-1].path  # our own error


def test_a_tensor_changed_after_construction_is_checked_again_at_submit():
    """A committed action or context turned NaN after the Request was built never enters a
    pack: ``submit`` checks the copy it keeps."""
    done = torch.zeros(2, 6)
    r = _req(0, committed_actions=done)
    done[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"'committed_actions' holds nan at index \(1, 2\)"):
        _engine().submit(r)
    v = _video_req(1)
    v.text[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"VideoRequest 'text' holds inf at index \(0, 0\)"):
        _video_engine().submit(v)


def test_submit_checks_finiteness_in_the_models_dtype():
    """A float32 value past bfloat16's range is inf in a bfloat16 model's input."""
    r = _req(0, context=torch.full((1, *FRAME), 3.4e38))
    with pytest.raises(ValueError, match=r"'context' holds 3\.4e\+38 .*beyond bfloat16's range"):
        request_module.submitted(r, compute=torch.bfloat16)
    request_module.submitted(r, compute=torch.float32)  # float32 holds it


def test_a_task_longer_than_the_model_reads_is_warned_about_not_cut_silently():
    engine = _engine()
    text_len = engine.model.config.text_len
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.submit(_req(0, task="x" * (text_len - 1)))  # exactly what it reads: no warning
    with pytest.warns(UserWarning, match=rf"longer than the {text_len - 1} UTF-8 bytes"):
        engine.submit(_req(1, task="é" * text_len))


# -- 2. the key property: one robot's bad input changes nothing in another's reply -----------
def _serve(make: Any, goods: list[Any], bads: list[Any]) -> tuple[list[Any], int]:
    """The good requests' results (in order) with the bad ones submitted between them, and
    how many bad ones ``submit`` refused."""
    engine, ids, refused = make(), [], 0
    for k, r in enumerate(goods):
        ids.append(engine.submit(r))
        if k == 1:
            for b in bads:
                try:
                    engine.submit(b)
                except (TypeError, ValueError):
                    refused += 1
    out = {r.request_id: r for r in engine.run()}
    return [out[i] for i in ids], refused


def _pack_cases(kind: str) -> tuple[Any, list[Any], list[Any]]:
    """The engine, three good requests and the bad ones: float64 tensors turned past
    float32's range after construction, so only ``submit``'s check stands in their way."""
    if kind == "video":
        bads = [_video_req(8, text=torch.zeros(2, 3, dtype=torch.float64)),
                _video_req(9, context=torch.zeros(1, 2, 2, 2, dtype=torch.float64))]  # fmt: skip
        bads[0].text[1, 2], bads[1].context[0, 1, 0, 1] = 1e39, -1e39
        return _video_engine, [_video_req(i) for i in range(3)], bads
    make = (lambda: _engine(cached=True)) if kind == "cached" else _engine
    bad = _req(8, context=torch.zeros(2, *FRAME, dtype=torch.float64))
    bad.context[1, 3, 2, 1] = 1e39
    return make, [_req(i) for i in range(3)], [bad]


def _unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: no check on the request's tensors (the code before issue 41)."""
    monkeypatch.setattr(request_module, "check_request_tensor", lambda *a, **k: a[2])
    monkeypatch.setattr(video_request_module, "check_request_tensor", lambda *a, **k: a[2])


@pytest.mark.parametrize("kind", ["engine", "cached", "video"])
def test_a_bad_request_packed_with_good_ones_changes_nothing_in_theirs(kind, monkeypatch):
    """Good requests with a bad one (a float64 value beyond float32's range) submitted among
    them: bit-identical to the same good requests served without it. The control: with the
    check removed the bad request enters the pack and the good ones fail or change."""
    make, goods, _ = _pack_cases(kind)
    alone, _ = _serve(make, goods, [])
    assert all(r.error is None for r in alone)
    make, goods, bads = _pack_cases(kind)  # fresh tensors: nothing shared with the run above
    packed, refused = _serve(make, goods, bads)
    assert refused == len(bads)
    for got, want in zip(packed, alone, strict=True):
        assert got.error is None, got.error
        assert torch.equal(got.latents, want.latents) and torch.equal(got.action, want.action)
    _unchecked(monkeypatch)
    make, goods, bads = _pack_cases(kind)
    harmed, refused = _serve(make, goods, bads)
    assert refused == 0  # the control reaches the pack
    assert any(h.error is not None or not torch.equal(h.latents, w.latents)
               for h, w in zip(harmed, alone, strict=True)), "the control harmed nobody"  # fmt: skip


# -- 3. adapters ----------------------------------------------------------------------------
def test_adapters_refuse_foreign_byte_order_and_non_numbers_naming_the_key():
    big = np.zeros((1, *FRAME), dtype=">f4")
    with pytest.raises(ValueError, match=r"observation\['context'\] is >f4, not in this "
                       r"machine's byte order; send <f4"):  # fmt: skip
        DiTAdapter().request({"context": big}, "s")
    with pytest.raises(TypeError, match=r"observation\['context'\] is a object array"):
        DiTAdapter().request({"context": np.array([None])}, "s")
    text = np.zeros((2, 3), dtype=">f8")
    with pytest.raises(ValueError, match=r"observation\['text'\] is >f8"):
        WanAdapter().request({"context": np.zeros((0, 2, 2, 2), "<f4"), "text": text}, "s")


@settings(max_examples=80)
@given(
    key=st.sampled_from(["DiT context", "Wan context", "Wan text"]),
    dtype=st.sampled_from([">f4", ">f8", ">i4", "<c8", "O", "<U3", "<M8[s]", "<f8 1e39"]),
)
def test_every_bad_observation_array_is_refused_naming_its_key(key, dtype):
    """Random bad arrays in every array key an adapter reads: foreign byte order, complex,
    objects, strings, dates, a float64 past float32's range. Always packing's one line
    naming the key, never torch's error and never an accepted request."""
    adapter = DiTAdapter() if key.startswith("DiT") else WanAdapter()
    name = key.split()[1]
    shape = {"DiT context": (1, *FRAME), "Wan context": (1, 2, 2, 2), "Wan text": (2, 3)}[key]
    if dtype == "<f8 1e39":
        bad = np.zeros(shape, "<f8")
        bad.reshape(-1)[-1] = 1e39
    elif dtype == "O":
        bad = np.empty(shape, dtype=object)
    else:
        bad = np.zeros(shape, dtype=np.dtype(dtype))
    obs: dict[str, Any] = {"context": np.zeros((0, *shape[1:]), np.float32)}
    if key.startswith("Wan"):
        obs["text"] = np.zeros((1, 3), np.float32)
    obs[name] = bad
    with pytest.raises((TypeError, ValueError)) as info:
        adapter.request(obs, "s")
    assert f"'{name}'" in str(info.value), info.value
    assert "packing" in info.traceback[-1].path.parts, info.traceback[-1].path


def test_wan_adapter_refuses_text_and_prompt_together():
    adapter = WanAdapter(text_encoder=lambda p: torch.ones(1, 3))
    obs = {"context": np.zeros((0, 2, 2, 2), np.float32), "text": np.zeros((1, 3), np.float32)}
    assert adapter.request(obs, "s").text.sum() == 0  # 'text' alone: used as sent
    with pytest.raises(ValueError, match=r"both 'text' \(ready embeddings\) and 'prompt'"):
        adapter.request({**obs, "prompt": "pick"}, "s")


# -- 4. the context cache's pool is bounded before it is allocated ---------------------------
def test_a_context_cache_pool_too_large_is_refused_with_its_bytes(monkeypatch):
    with pytest.raises(ValueError, match=r"ContextCache\.pages=16777216 must be <= 1048576"):
        ContextCache(pages=2**24)
    with pytest.raises(ValueError, match=r"pages=262,144 x ContextCache\.page_frames=8 = 2,097"):
        ContextCache(pages=2**18, page_frames=8)
    import packing.serve._device as device_module

    monkeypatch.setattr(device_module, "_free_bytes", lambda device: 2**30)  # 1 GiB free
    shape = PackShape(frames=2, actions=4, requests=1)
    config = EngineConfig(shapes=(shape,), max_steps=4, context_cache=ContextCache(pages=2**18))
    with pytest.raises(ValueError, match=r"the context cache's pool needs [\d.,]+ GiB on cpu, "
                       r"more than the 1\.00 GiB free; lower ContextCache\.pages"):  # fmt: skip
        Engine(_dit(), config)
    Engine(
        _dit(), EngineConfig(shapes=(shape,), max_steps=4, context_cache=ContextCache(pages=64))
    )  # a pool that fits


# -- 5. the server: its engines, its defaults, a bad robot among good ones, its shutdown ------
T = 20.0  # every client call's time limit


def _server_engine(cls: Any = None) -> Any:
    from serve_robots import GateEngine, engine

    base = engine()
    return (cls or GateEngine)(base.model, base.config)


def test_one_engine_object_serves_one_slot():
    from packing.server import PolicyServer

    e = _engine()
    for engines in ([e, e], [e] * 2, [_engine(), e, e]):
        with pytest.raises(ValueError, match=r"engine \d is engine \d again .*one engine per GPU"):
            PolicyServer(engines)
    PolicyServer([e, _engine()], DiTAdapter(steps=3))  # two engines: two slots


@pytest.mark.parametrize(
    ("adapter", "engine", "match"),
    [
        (DiTAdapter(steps=5), "dit", r"Request\.steps=5 > EngineConfig\.max_steps=4"),
        (DiTAdapter(frames=13, steps=3), "dit", r"needs 13 frames and 16 actions, more than"),
        (DiTAdapter(), "video", r"submit takes a VideoRequest, got Request"),
        (WanAdapter(frames=20, steps=3), "video", r"needs 20 frames and 1 text rows, more than"),
        (WanAdapter(), "dit", r"submit takes a packing\.serve\.Request, got VideoRequest"),
    ],
)
def test_a_server_whose_engine_refuses_its_default_request_does_not_start(adapter, engine, match):
    """``packing serve --steps 100 --max-steps 50`` started and answered every robot with an
    error; now the server is refused at construction, naming the engine and the fix."""
    from packing.server import PolicyServer

    e = _engine() if engine == "dit" else _video_engine()
    with pytest.raises(ValueError, match=r"engine 0 refuses the adapter's default request.*"
                       + match):  # fmt: skip
        PolicyServer(e, adapter)
    PolicyServer(e, DiTAdapter(steps=3) if engine == "dit" else WanAdapter(frames=2, steps=3))


def test_a_robots_bad_observation_changes_nothing_for_the_other_robots():
    """Four robots and one whose float64 context holds 1e39 (finite, past float32), over the
    wire: the bad robot gets one line naming the field, each good robot exactly its answer
    alone. Before, the 1e39 became inf in the pack and failed its pack-mates."""
    pytest.importorskip("websockets", reason="needs packing[serve]")
    from serve_robots import ADAPTER, assert_alone, observation, wait_until

    from packing.server import PolicyClient, PolicyServer, ServerConfig, ServerError

    e = _server_engine()  # its first model call waits for the gate: all of them in one pack
    srv = PolicyServer(e, ADAPTER, ServerConfig(port=0, drain_s=T))
    good = [observation(k) for k in range(4)]
    bad = observation(9)
    bad["context"] = bad["context"].astype(np.float64)
    bad["context"][1, 2, 3, 4] = 1e39
    out: dict[int, Any] = {}
    bad_done = threading.Event()

    def robot(k: int, obs: dict[str, Any]) -> None:
        try:
            with PolicyClient(*address, timeout_s=T) as c:
                out[k] = c.infer(obs)
        except ServerError as err:
            out[k] = err
        finally:
            if k == -1:
                bad_done.set()

    with srv.running() as address:
        threads = [threading.Thread(target=robot, args=(k, o))
                   for k, o in [(-1, bad), *enumerate(good)]]  # fmt: skip
        for t in threads:
            t.start()
        # The gate opens once every request is queued (the bad one too, if it got that far).
        wait_until(lambda: srv.summary()["queued"] == 5
                   or (bad_done.is_set() and srv.summary()["queued"] == 4), T)  # fmt: skip
        e.gate.set()
        for t in threads:
            t.join(2 * T)
    for k, obs in enumerate(good):
        assert not isinstance(out[k], ServerError), out[k]
        assert_alone(obs, out[k])
    assert isinstance(out[-1], ServerError), out[-1]
    assert "'context' holds 1e+39 at index (1, 2, 3, 4)" in str(out[-1])
    assert "beyond float32's range" in str(out[-1])


class _SlowReply(DiTAdapter):
    """An adapter whose reply is built only once ``release`` is set (a slow encoder of the
    reply); ``replying`` is set when it starts."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        object.__setattr__(self, "replying", threading.Event())
        object.__setattr__(self, "release", threading.Event())

    def reply(self, result: Any) -> dict[str, Any]:
        self.replying.set()
        assert self.release.wait(T)
        return super().reply(result)


def _healthz(address: tuple[str, int]) -> int:
    h = http.client.HTTPConnection(*address, timeout=T)
    h.request("GET", "/healthz")
    return h.getresponse().status


def test_shutdown_sends_the_reply_it_owes_and_healthz_says_draining():
    """`stop` while a reply is being built: ``/healthz`` answers 503 (the listener stays open
    while draining), a new robot is refused, and the reply still arrives, however long it
    takes within drain_s. Before, the server closed the connections 50 ms after the engine
    finished (the reply was lost) and closed the listener at once (connection refused)."""
    pytest.importorskip("websockets", reason="needs packing[serve]")
    from serve_robots import assert_alone, engine, observation, wait_until
    from websockets.exceptions import InvalidStatus

    from packing.server import PolicyClient, PolicyServer, ServerConfig

    adapter = _SlowReply(frames=1, actions=4, steps=4)
    srv = PolicyServer(engine(), adapter, ServerConfig(port=0, drain_s=T))
    out: list[Any] = []
    with srv.running() as address, PolicyClient(*address, timeout_s=T) as c:
        t = threading.Thread(target=lambda: out.append(c.infer(observation(1))))
        t.start()
        assert adapter.replying.wait(T)  # its result is in; the reply is being built
        srv.stop()
        wait_until(lambda: _healthz(address) == 503, T)  # draining, and answering so
        with pytest.raises(InvalidStatus, match="503"):
            PolicyClient(*address, timeout_s=T)  # no new robot while draining
        adapter.release.set()
        t.join(T)
    assert len(out) == 1
    assert_alone(observation(1), out[0])
    with pytest.raises(ConnectionRefusedError):
        _healthz(address)  # stopped: the listener is closed


def _serve_main(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    """``packing serve FLAGS`` in this process; a server that would start raises instead of
    serving forever (the test then fails, it does not hang)."""
    from packing.cli import main
    from packing.server import PolicyServer

    def started(self: Any) -> None:
        raise AssertionError(f"packing serve {' '.join(flags)} started a server")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(PolicyServer, "serve_forever", started)
        code = main(["serve", "--port", "0", *flags])
    return code, capsys.readouterr().err


def raising_factory(device: str) -> Any:
    """``packing serve --model test_serve_boundaries:raising_factory``: a factory that fails."""
    raise RuntimeError("the checkpoint server is down")


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--max-message-mb", "inf"], r"--max-message-mb: inf must be a finite number"),
        (["--max-message-mb", "1e-9"], r"--max-message-mb=0 must be >= 1"),
        (["--checkpoint", "{tmp}/missing.pt"], r"--checkpoint: \S+missing\.pt does not exist"),
        (
            ["--checkpoint", "{tmp}/garbage.pt"],
            r"--checkpoint \S+garbage\.pt: not a torch "
            r"state_dict file",
        ),
        (
            ["--checkpoint", "{tmp}/keys.pt"],
            r"--checkpoint \S+keys\.pt does not fit the "
            r"--model preset: .*Missing key",
        ),
        (
            ["--model", "test_serve_boundaries:raising_factory"],
            r"--model test_serve_boundaries:raising_factory: the factory raised RuntimeError: the "
            r"checkpoint server is down; fix the factory",
        ),
        (["--device", "bogus"], r"--device: 'bogus' is not a torch device; use cpu, cuda"),
        (["--device", "meta"], r"--device: 'meta' is not a torch device"),
        (["--steps", "100"], r"Request\.steps=100 > EngineConfig\.max_steps=50"),
        (["--shape", "2,16,1", "--frames", "4"], r"needs 4 frames and 16 actions, more than"),
        (["--drain-s", "1e300"], r"--drain-s: 1e300 must be a finite number in \[0, 3600\]"),
        (["--summary-every-s", "1e-6"], r"--summary-every-s: 1e-6 must be a finite number in "),
        (["--context-cache", "16777216"], r"--context-cache: 16777216 is above 1,048,576"),
        (
            ["--context-cache", "262144", "--page-frames", "8", "--mask", "frame-causal"],
            r"--context-cache=262,144 x --page-frames=8 = 2,097,152 frames, more than the "
            r"1,048,576 a pool may hold; lower --context-cache or --page-frames",
        ),
    ],
)
def test_packing_serve_refuses_bad_flags_with_one_line_and_exit_2(flags, match, tmp_path, capsys):
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    torch.save({"x": torch.zeros(1)}, tmp_path / "keys.pt")
    code, err = _serve_main(capsys, *[f.format(tmp=tmp_path) for f in flags])
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("packing serve: error: "), err
    assert re.search(match, lines[0]), lines[0]


def test_packing_serve_refuses_cuda_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    code, err = _serve_main(capsys, "--device", "cuda")
    assert code == 2 and "--device cuda: torch sees no CUDA GPU" in err, err
