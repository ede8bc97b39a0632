"""Decode one fixed-shape numeric parquet column straight from its pages, into numpy.

pyarrow rebuilds every nesting level of a column like lerobot's ``latents`` (a list of lists of
lists of float16, ``Array3D(48, 8, 16)``): it decodes a repetition and a definition level per
float16 value, then gathers the dictionary-encoded values one by one (~80 MB/s on one core).
A fixed-shape feature needs neither: with no nulls the levels carry no information, so this
module skips them and decodes only the values, in a few vectorised numpy passes per page::

    column chunk   [dictionary page: PLAIN values] [data page] [data page] ...
    data page v1   [4-byte len | rep levels] [4-byte len | def levels] [values]
    values         PLAIN: the raw little-endian values
                   RLE_DICTIONARY: 1 byte bit width, then runs of indices into the dictionary,
                   each bit-packed (8 indices per bit-width bytes) or one repeated value

Anything else (nulls, data page v2 with compressed levels, another encoding or codec, a
count that does not match ``rows * prod(shape)``) returns ``None``, and the caller reads the
column with pyarrow: this path is an optimisation, never the only way to read a file.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

__all__ = ["fixed_shape", "read_fixed_column"]

_CODECS = {"SNAPPY": "snappy", "ZSTD": "zstd", "GZIP": "gzip", "BROTLI": "brotli"}
_PLAIN_DTYPES = {"FLOAT": np.float32, "DOUBLE": np.float64, "INT32": np.int32, "INT64": np.int64}
_PLAIN, _PLAIN_DICTIONARY, _RLE_DICTIONARY = 0, 2, 8
_DATA_PAGE, _DICTIONARY_PAGE = 0, 2


class _Unsupported(Exception):
    """A page this decoder does not handle: the caller falls back to pyarrow."""


# -- Thrift compact protocol: just enough to read a PageHeader ------------------------------
def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if b < 0x80:
            return out, pos
        shift += 7


def _struct(buf: memoryview, pos: int) -> tuple[dict[int, Any], int]:
    """One Thrift struct: {field id: int, bool, or nested dict}; other types are skipped."""
    fields: dict[int, Any] = {}
    last = 0
    while True:
        head = buf[pos]
        pos += 1
        if head == 0:
            return fields, pos
        kind, delta = head & 0x0F, head >> 4
        if delta:
            fid = last + delta
        else:
            z, pos = _varint(buf, pos)
            fid = (z >> 1) ^ -(z & 1)
        last = fid
        fields[fid], pos = _value(buf, pos, kind)


def _value(buf: memoryview, pos: int, kind: int) -> tuple[Any, int]:
    if kind in (1, 2):  # booleans live in the type nibble
        return kind == 1, pos
    if kind == 3:
        return buf[pos], pos + 1
    if kind in (4, 5, 6):  # zigzag varints
        z, pos = _varint(buf, pos)
        return (z >> 1) ^ -(z & 1), pos
    if kind == 7:
        return None, pos + 8
    if kind == 8:
        n, pos = _varint(buf, pos)
        return None, pos + n
    if kind in (9, 10):  # list / set: skipped
        head = buf[pos]
        pos += 1
        size, elem = head >> 4, head & 0x0F
        if size == 15:
            size, pos = _varint(buf, pos)
        for _ in range(size):
            _, pos = _value(buf, pos, 3 if elem in (1, 2) else elem)
        return None, pos
    if kind == 12:
        return _struct(buf, pos)
    raise _Unsupported(f"thrift type {kind}")


# -- values ---------------------------------------------------------------------------------
def _unpack(groups: np.ndarray, bw: int) -> np.ndarray:
    """Little-endian bit-packed unsigned ints of ``bw`` <= 16 bits, ``groups`` shaped
    ``(..., bw)``: each row holds 8 values.

    Each row is copied into a 16-byte slot (the one copy), read as two uint64 words, and value
    ``j`` is bits ``[j * bw, (j + 1) * bw)`` of the 128: a shift of one word, or of both where
    it straddles them. Slot bytes past ``bw`` are never unmasked, so they stay uninitialised.
    """
    n = math.prod(groups.shape[:-1])
    slots = np.empty((*groups.shape[:-1], 16), dtype=np.uint8)
    slots[..., :bw] = groups
    words = slots.reshape(n, 16).view("<u8")
    w0, w1 = words[:, 0], words[:, 1]
    out = np.empty((n, 8), dtype=np.uint32)
    mask = np.uint64((1 << bw) - 1)
    for j in range(8):
        s = j * bw
        if s + bw <= 64:
            out[:, j] = (w0 >> np.uint64(s)) & mask
        elif s >= 64:
            out[:, j] = (w1 >> np.uint64(s - 64)) & mask
        else:
            out[:, j] = ((w0 >> np.uint64(s)) | (w1 << np.uint64(64 - s))) & mask
    return out.reshape(-1)


def _hybrid(data: np.ndarray, bw: int, count: int) -> np.ndarray:
    """RLE / bit-packed hybrid indices, ``count`` of them.

    Arrow's writer emits, for values that do not repeat, bit-packed runs of one size (63
    groups of 8): when the stream starts with k such runs, their headers are checked in one
    numpy comparison and their bytes unpacked as one block; the rest is parsed run by run.
    """
    head, hlen = _varint(memoryview(data[:10]), 0)
    if head & 1:
        per_run = (head >> 1) * 8
        stride = hlen + (head >> 1) * bw
        k = min(count // per_run, len(data) // stride)
        if k:
            runs = data[: k * stride].reshape(k, stride)
            if (runs[:, :hlen] == data[:hlen]).all():
                first = _unpack(runs[:, hlen:].reshape(k, -1, bw), bw)
                if k * per_run >= count:
                    return first[:count]
                rest = _hybrid_runs(data[k * stride :], bw, count - k * per_run)
                return np.concatenate([first, rest])
    return _hybrid_runs(data, bw, count)


def _hybrid_runs(data: np.ndarray, bw: int, count: int) -> np.ndarray:
    """The hybrid stream run by run: headers in Python, the bit-packed runs' bytes joined
    (whole groups, so alignment holds) and unpacked in one pass."""
    buf = memoryview(data)
    pos, n = 0, len(data)
    width = (bw + 7) // 8
    spans: list[tuple[int, int]] = []  # bit-packed byte ranges
    pieces: list[tuple[int, int, int]] = []  # (kind 0 packed / 1 repeat, count, value)
    total = 0
    while total < count and pos < n:
        head, pos = _varint(buf, pos)
        if head & 1:
            groups = head >> 1
            spans.append((pos, pos + groups * bw))
            pieces.append((0, groups * 8, 0))
            pos += groups * bw
            total += groups * 8
        else:
            run = head >> 1
            value = int.from_bytes(buf[pos : pos + width], "little")
            pieces.append((1, run, value))
            pos += width
            total += run
    if total < count:
        raise _Unsupported("page ends before its values")
    if all(kind == 0 for kind, _, _ in pieces):
        packed = np.concatenate([data[a:b] for a, b in spans]) if spans else data[:0]
        return _unpack(packed.reshape(-1, bw), bw)[:count]
    out = np.empty(total, dtype=np.uint32)
    joined = np.concatenate([data[a:b] for a, b in spans]) if spans else None
    packed = None if joined is None else _unpack(joined.reshape(-1, bw), bw)
    at = taken = 0
    for kind, c, value in pieces:
        if kind == 0:
            assert packed is not None
            out[at : at + c] = packed[taken : taken + c]
            taken += c
        else:
            out[at : at + c] = value
        at += c
    return out[:count]


def _gather(dictionary: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``dictionary[indices]``; torch's ``index_select`` takes int32 indices as they are
    (numpy widens them to int64 first) and is ~1.5x faster here."""
    table = torch.from_numpy(np.array(dictionary))  # a writable copy: a few KB
    return torch.index_select(table, 0, torch.from_numpy(indices.view(np.int32))).numpy()


def _page_values(
    page: np.ndarray, head: dict[int, Any], dictionary: np.ndarray | None, levels: int, dtype: Any
) -> np.ndarray:
    header = head.get(5)
    if header is None:  # data page v2 (or another page type): leave it to pyarrow
        raise _Unsupported("not a data page v1")
    count, encoding = header[1], header[2]
    pos = 0
    for _ in range(levels):  # repetition and/or definition levels, each length-prefixed
        pos += 4 + int.from_bytes(page[pos : pos + 4].tobytes(), "little")
    if encoding == _PLAIN:
        return page[pos:].view(dtype)[:count]
    if encoding in (_RLE_DICTIONARY, _PLAIN_DICTIONARY) and dictionary is not None:
        bw = int(page[pos])
        if bw == 0:  # a one-entry dictionary
            return np.repeat(dictionary[:1], count)
        if bw > 16:
            raise _Unsupported(f"bit width {bw}")
        return _gather(dictionary, _hybrid(page[pos + 1 :], bw, count))
    raise _Unsupported(f"encoding {encoding}")


def fixed_shape(field: Any) -> tuple[int, ...] | None:
    """The per-row shape that an Arrow schema field guarantees, or ``None``.

    Only two kinds of field promise that every row has one shape: nested fixed-size lists
    (``fixed_size_list<float>[14]`` -> ``(14,)``) and ``datasets``' ArrayND extension types
    (``Array3D(48, 8, 16)``, stored as plain lists but validated on write; the shape is in the
    field's extension metadata). A plain list may be ragged, and its rows could add up to the
    right count in the wrong shapes, so it is left to pyarrow.
    """
    import json

    import pyarrow as pa

    if isinstance(field.type, pa.ExtensionType):  # `datasets` imported: its type is registered
        ext = field.type
        ok = ext.extension_name.startswith("datasets.features.features.Array")
        return tuple(int(d) for d in ext.shape) if ok and hasattr(ext, "shape") else None
    meta = field.metadata or {}
    name = meta.get(b"ARROW:extension:name", b"")
    if name.startswith(b"datasets.features.features.Array") and b"ARROW:extension:metadata" in meta:
        shape = json.loads(meta[b"ARROW:extension:metadata"])[0]
        return tuple(int(d) for d in shape)
    dims: list[int] = []
    t = field.type
    while hasattr(t, "list_size"):  # FixedSizeListType
        dims.append(int(t.list_size))
        t = t.value_type
    return tuple(dims) if dims else None


def read_fixed_column(
    source: Any, metadata: Any, row_groups: list[int], column: int, dtype: Any, per_row: int
) -> np.ndarray | None:
    """Values of leaf ``column`` over ``row_groups`` as a flat numpy array of ``dtype``, or
    ``None`` where this decoder does not apply (see the module docstring).

    ``source`` is a pyarrow buffer of the whole file (e.g. ``pa.memory_map(path).read_buffer()``,
    zero-copy), ``metadata`` its ``FileMetaData``, ``per_row`` the values per row
    (``prod(shape)``).
    """
    import pyarrow as pa

    desc = metadata.schema.column(column)
    levels = int(desc.max_repetition_level > 0) + int(desc.max_definition_level > 0)
    file = np.frombuffer(source, dtype=np.uint8)
    out = []
    try:
        for g in row_groups:
            cc = metadata.row_group(g).column(column)
            codec = cc.compression
            if codec != "UNCOMPRESSED" and codec not in _CODECS:
                return None
            stats = cc.statistics
            if stats is None or not stats.has_null_count or stats.null_count:
                return None
            start = cc.dictionary_page_offset or cc.data_page_offset
            if cc.dictionary_page_offset is not None:
                start = min(start, cc.data_page_offset)
            chunk = file[start : start + cc.total_compressed_size]
            want = metadata.row_group(g).num_rows * per_row
            got, dictionary, pos = 0, None, 0
            while got < want and pos < len(chunk):
                head, body = _struct(memoryview(chunk), pos)
                if head[1] not in (_DATA_PAGE, _DICTIONARY_PAGE):
                    return None  # v2 data pages keep their levels uncompressed: pyarrow
                size = head[3]
                raw = chunk[body : body + size]
                if codec != "UNCOMPRESSED":
                    raw = np.frombuffer(
                        pa.decompress(raw, decompressed_size=head[2], codec=_CODECS[codec]),
                        dtype=np.uint8,
                    )
                pos = body + size
                if head[1] == _DICTIONARY_PAGE:
                    dictionary = raw.view(dtype)[: head[7][1]]
                    continue
                values = _page_values(raw, head, dictionary, levels, dtype)
                out.append(values)
                got += len(values)
            if got != want:
                return None
    except (_Unsupported, KeyError, IndexError, ValueError, OSError):
        return None  # pyarrow's errors (a corrupt page) are ValueError/OSError subclasses
    return np.concatenate(out) if len(out) != 1 else out[0]
