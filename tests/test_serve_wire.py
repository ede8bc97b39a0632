"""The wire and the observation adapters alone (no sockets): random bytes and random headers
only ever give one WireError line, never another error and never an array that disagrees
with its bytes; adapters and ServerConfig refuse bad values by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("msgpack", reason="needs packing[serve]")
from serve_robots import ADAPTER, observation

from packing.server import DiTAdapter, ServerConfig, WanAdapter
from packing.server._wire import DTYPES, WireError, decode, encode

LIMIT = 2**20


@given(st.binary(max_size=256))
def test_random_bytes_are_a_wire_error_or_a_checked_map(data):
    try:
        out = decode(data, max_array_bytes=LIMIT)
    except WireError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(out, dict) and all(isinstance(k, str) for k in out)


@given(
    dtype=st.sampled_from([*sorted(DTYPES), "|O", ">f4", "<c8", "|V4", "float32", 7]),
    shape=st.lists(st.integers(-3, 6), max_size=4) | st.just("x"),
    nbytes=st.integers(0, 200),
)
def test_an_array_is_decoded_only_when_its_header_matches_its_bytes(dtype, shape, nbytes):
    arr = {b"__ndarray__": True, b"data": b"\x00" * nbytes, b"dtype": dtype, b"shape": shape}
    try:
        a = decode(encode({"a": arr}), max_array_bytes=LIMIT)["a"]
    except WireError:
        ok = (dtype in DTYPES and isinstance(shape, list) and all(n >= 0 for n in shape)
              and int(np.prod(shape)) * np.dtype(dtype).itemsize == nbytes)  # fmt: skip
        assert not ok
        return
    assert a.dtype.str == dtype and list(a.shape) == shape and a.nbytes == nbytes


def test_round_trip_is_openpi_msgpack_numpy():
    """encode writes the maps openpi's msgpack_numpy.pack_array writes (bytes keys)."""
    import msgpack

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    raw = msgpack.unpackb(encode({"x": x, "n": np.int64(3)}), raw=False)
    assert raw["x"] == {b"__ndarray__": True, b"data": x.tobytes(), b"dtype": "<f4",
                        b"shape": [2, 3]}  # fmt: skip
    assert raw["n"] == {b"__npgeneric__": True, b"data": 3, b"dtype": "<i8"}
    back = decode(encode({"x": x, "n": np.int64(3)}), max_array_bytes=LIMIT)
    np.testing.assert_array_equal(back["x"], x)
    assert back["n"] == 3 and isinstance(back["n"], np.int64)


def test_size_limit_and_non_finite_values_name_the_key():
    big = np.zeros((LIMIT // 4 + 1,), np.float32)
    with pytest.raises(WireError, match="max_array_bytes"):
        decode(encode({"context": big}), max_array_bytes=LIMIT)
    for bad in ({"context": np.array([1.0, np.inf])}, {"nested": {"x": [float("nan")]}}):
        with pytest.raises(WireError, match=r"NaN or inf|is nan"):
            decode(encode(bad), max_array_bytes=LIMIT)


def test_adapters_refuse_bad_observations_by_key():
    obs = observation(1)
    with pytest.raises(ValueError, match="exactly one of 'context'"):
        ADAPTER.request({"prompt": "x"}, "s")
    with pytest.raises(ValueError, match="no image encoder"):
        ADAPTER.request({"images": np.zeros((1, 2, 2, 3), np.uint8)}, "s")
    with pytest.raises(TypeError, match=r"observation\['steps'\]"):
        ADAPTER.request({**obs, "steps": 2.5}, "s")
    with pytest.raises(TypeError, match="prompt"):
        ADAPTER.request({**obs, "prompt": 3}, "s")
    with pytest.raises(ValueError, match="no text encoder"):
        WanAdapter().request({"context": obs["context"]}, "s")
    with pytest.raises(TypeError, match=r"DiTAdapter\.actions"):
        DiTAdapter(actions=2.0)


def test_an_image_encoder_makes_the_context():
    seen = []

    def encoder(images: np.ndarray) -> torch.Tensor:
        seen.append(images.shape)
        return torch.ones(images.shape[0], 8, 4, 8)

    r = DiTAdapter(encoder=encoder).request({"images": np.zeros((3, 16, 16, 3), np.uint8)}, "7/0")
    assert seen == [(3, 16, 16, 3)] and r.context.shape == (3, 8, 4, 8) and r.session == "7/0"


def test_server_config_is_checked():
    for bad, match in (({"port": 70000}, "port"), ({"max_queue": 0}, "max_queue"),
                       ({"deadline_s": 0}, "deadline_s"), ({"api_key": ""}, "api_key"),
                       ({"host": "robots.lan"}, "needs an API key")):  # fmt: skip
        with pytest.raises((TypeError, ValueError), match=match):
            ServerConfig(**bad)
    assert ServerConfig(host="::1").api_key is None  # loopback needs none


def test_packing_serve_builds_a_preset_from_a_checkpoint_and_parses_shapes(tmp_path):
    """The CLI's engine: the preset's weights from a state_dict file (read weights_only),
    shapes from --shape, and one-line refusals for a bad shape or a checkpoint with a factory."""
    from packing.cli import _serve as _serve_command
    from packing.cli import build_parser
    from packing.model import DiT, DiTConfig

    torch.manual_seed(3)
    trained = DiT(DiTConfig.tiny())
    torch.save(trained.state_dict(), tmp_path / "dit.pt")
    args = build_parser().parse_args(["serve", "--checkpoint", str(tmp_path / "dit.pt"),
                                      "--shape", "10,32,2", "--shape", "20,64,4"])  # fmt: skip
    engine, adapter = _serve_command._build(args, "cpu")
    for a, b in zip(engine.model.state_dict().values(), trained.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert [(s.frames, s.actions, s.requests) for s in engine.shapes] == [(10, 32, 2), (20, 64, 4)]
    assert adapter.actions == 16
    with pytest.raises(SystemExit):  # the shared parser refuses the form, in one line
        build_parser().parse_args(["serve", "--shape", "1,2"])
    argv = ["serve", "--model", "m:f", "--checkpoint", str(tmp_path / "dit.pt")]
    with pytest.raises(ValueError, match="a factory loads its own"):
        _serve_command._build(build_parser().parse_args(argv), "cpu")
