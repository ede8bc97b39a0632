"""The openpi wire format: msgpack, with numpy arrays as openpi-client packs them.

A message is one binary websocket frame holding one msgpack map (str keys). An array inside
it is the map openpi's ``msgpack_numpy.pack_array`` writes, with bytes keys::

    {b"__ndarray__": True, b"data": <raw C-order bytes>, b"dtype": "<f4", b"shape": [2, 8, 4, 8]}
    {b"__npgeneric__": True, b"data": 3, b"dtype": "<i8"}          a numpy scalar

Decoding never trusts a header: msgpack runs with ``raw=False`` and no ext types, an array's
dtype must be in `DTYPES` (no object, void or big-endian arrays, so nothing can smuggle a
pickle), its shape a list of non-negative ints whose product times the item size is exactly
the byte count, its size at most ``max_array_bytes``, and a float array must be finite. Any
violation is one `WireError` line naming the key and the fix.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from packing.server._extra import serve_extra

__all__ = ["DTYPES", "WireError", "decode", "encode"]

# Little-endian (or byte-sized) dtypes a robot sends: images, latents, states, ids.
DTYPES = frozenset({"|b1", "|u1", "|i1", "<u2", "<i2", "<i4", "<i8", "<u4", "<f2", "<f4", "<f8"})
MAX_DIMS = 8


def _msgpack() -> Any:
    return serve_extra("msgpack")


class WireError(ValueError):
    """A message that is not valid openpi msgpack (one line; the server replies with it)."""


def encode(message: dict[str, Any]) -> bytes:
    """``message`` as openpi's ``msgpack_numpy.packb`` writes it (numpy arrays and scalars)."""
    return _msgpack().packb(message, default=_pack_array, use_bin_type=True)  # type: ignore[no-any-return]


def _pack_array(obj: Any) -> Any:
    if isinstance(obj, np.ndarray | np.generic) and obj.dtype.kind in "VOc":
        raise WireError(f"cannot send a {obj.dtype} array: openpi's format has no object arrays")
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return {b"__ndarray__": True, b"data": a.tobytes(), b"dtype": a.dtype.str,
                b"shape": list(a.shape)}  # fmt: skip
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send a {type(obj).__name__} (send numpy arrays, numbers, str)")


def decode(data: bytes | str, *, max_array_bytes: int) -> dict[str, Any]:
    """One message, every array checked against its header (see the module docstring)."""
    if isinstance(data, str):
        raise WireError("got a text frame; send one binary msgpack frame per message")
    try:
        out = _msgpack().unpackb(
            data,
            raw=False,
            strict_map_key=True,
            object_hook=lambda m: _unpack_array(m, max_array_bytes),
            ext_hook=_no_ext,
        )
    except WireError:
        raise
    except Exception as e:  # msgpack's own errors on garbage: one line, no traceback
        raise WireError(f"the message is not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(out, dict) or not all(isinstance(k, str) for k in out):
        raise WireError("a message must be one msgpack map with str keys (an observation dict)")
    for key, value in out.items():
        _check_value(key, value)
    return out


def _no_ext(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack ext type {code} is not accepted; send plain msgpack")


def _unpack_array(m: dict[Any, Any], max_bytes: int) -> Any:
    if b"__ndarray__" in m:
        if set(m) != {b"__ndarray__", b"data", b"dtype", b"shape"}:
            raise WireError(f"an array map has keys {sorted(map(repr, m))}; openpi sends "
                            "__ndarray__, data, dtype, shape")  # fmt: skip
        dtype, shape, raw = _dtype(m[b"dtype"]), m[b"shape"], m[b"data"]
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
        ):
            raise WireError(f"array shape {shape!r}: give at most {MAX_DIMS} non-negative ints")
        if not isinstance(raw, bytes):
            raise WireError(f"array data is a {type(raw).__name__}; send the raw bytes")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > max_bytes:
            raise WireError(f"array of shape {shape} {dtype.str} is {nbytes:,} bytes > the "
                            f"server's max_array_bytes={max_bytes:,}; send a smaller one")  # fmt: skip
        if nbytes != len(raw):
            raise WireError(f"array header says shape {shape} {dtype.str} ({nbytes:,} bytes) but "
                            f"{len(raw):,} bytes follow; the header must match the data")  # fmt: skip
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    if b"__npgeneric__" in m:
        dtype, value = _dtype(m.get(b"dtype")), m.get(b"data")
        if not isinstance(value, bool | int | float) or set(m) != {
            b"__npgeneric__",
            b"data",
            b"dtype",
        }:
            raise WireError("a numpy scalar map needs __npgeneric__, dtype and a number as data")
        try:
            return dtype.type(value)
        except (OverflowError, ValueError) as e:
            raise WireError(f"numpy scalar {value!r} does not fit {dtype.str}: {e}") from None
    return m


def _dtype(name: Any) -> np.dtype[Any]:
    if not isinstance(name, str) or name not in DTYPES:
        raise WireError(f"array dtype {name!r} is not accepted; use one of {sorted(DTYPES)}")
    return np.dtype(name)


def _check_value(path: str, value: Any) -> None:
    """Only plain msgpack values and arrays; every float array finite."""
    if isinstance(value, np.ndarray | np.generic):
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise WireError(f"{path!r} holds NaN or inf; send finite values")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_value(f"{path}.{k}", v)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_value(f"{path}[{i}]", v)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise WireError(f"{path!r} is {value}; send finite values")
    elif not (value is None or isinstance(value, bool | int | str | bytes)):
        raise WireError(f"{path!r} is a {type(value).__name__}, not a msgpack value")
