"""Decode one fixed-shape numeric parquet column straight from its pages, into numpy.

pyarrow rebuilds every nesting level of a column like lerobot's ``latents`` (a list of lists of
lists of float16, ``Array3D(48, 8, 16)``): it decodes a repetition and a definition level per
float16 value, then gathers the dictionary-encoded values one by one (~80 MB/s on one core).
A fixed-shape feature needs neither: with no nulls the levels carry no information, so this
module skips them and decodes only the values, each page straight into its place in one
output array, in a few vectorised passes::

    column chunk   [dictionary page: PLAIN values] [data page] [data page] ...
    data page v1   [4-byte len | rep levels] [4-byte len | def levels] [values]
    values         PLAIN: the raw little-endian values
                   RLE_DICTIONARY: 1 byte bit width, then runs of indices into the dictionary,
                   each bit-packed (8 indices per bit-width bytes) or one repeated value

Anything else (nulls, data page v2 with compressed levels, another encoding or codec, a
count that does not match ``rows * prod(shape)``) raises `Unsupported` saying why
(`read_fixed_column` returns ``None``), and the caller reads the column with pyarrow and says
so: this path is an optimisation, never the only way to read a file.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = [
    "ColumnChunks",
    "Unsupported",
    "decode_fixed_column",
    "fixed_shape",
    "read_fixed_column",
]

_CODECS = {"SNAPPY": "snappy", "ZSTD": "zstd", "GZIP": "gzip", "BROTLI": "brotli"}
_PLAIN_DTYPES = {"FLOAT": np.float32, "DOUBLE": np.float64, "INT32": np.int32, "INT64": np.int64}
_PLAIN, _PLAIN_DICTIONARY, _RLE_DICTIONARY = 0, 2, 8
_DATA_PAGE, _DICTIONARY_PAGE = 0, 2


class Unsupported(Exception):
    """A page this decoder does not handle (the message says why): the caller falls back to
    pyarrow, and says so."""


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
    raise Unsupported(f"thrift type {kind}")


# -- values ---------------------------------------------------------------------------------
def _unpack(data: np.ndarray, offset: int, runs: int, groups: int, stride: int, bw: int,
            out: np.ndarray) -> None:  # fmt: skip
    """Little-endian bit-packed unsigned ints of ``bw`` <= 24 bits into ``out`` (uint32,
    ``runs * groups * 8``): ``runs`` runs ``stride`` bytes apart from ``offset``, each holding
    ``groups`` groups of 8 values in ``bw`` bytes.

    No byte is copied first: value ``j`` of every group starts at bit ``j * bw`` of it, so it
    is the little-endian uint32 at byte ``j * bw // 8`` shifted right by ``j * bw % 8`` (at
    most 7 + 24 bits, inside the 32 read) and masked. Those uint32s are an unaligned strided
    view of ``data``, one per ``j``: 8 shifts over ``runs * groups`` values and one mask over
    all of them. The last group's view reads up to 3 bytes past its end (``bw=15``: bytes 13
    to 16 for ``j=7``); the caller leaves them in ``data``.
    """
    if runs * groups * 8 <= _SMALL:  # a short page: two numpy calls, not sixteen
        packed: np.ndarray = np.ndarray((runs, groups * bw), dtype=np.uint8, buffer=data,
                                        offset=offset, strides=(stride, 1))  # fmt: skip
        bits = np.unpackbits(packed, bitorder="little").reshape(-1, bw)
        np.matmul(bits, _WEIGHTS[:bw], out=out)
        return
    out3 = out.reshape(runs, groups, 8)
    for j in range(8):
        byte, shift = divmod(j * bw, 8)
        src: np.ndarray = np.ndarray((runs, groups), dtype="<u4", buffer=data, offset=offset + byte,
                         strides=(stride, bw))  # fmt: skip
        np.right_shift(src, shift, out=out3[:, :, j])
    np.bitwise_and(out, np.uint32((1 << bw) - 1), out=out)


_SMALL = 4096  # values: below this, `_unpack` goes bit by bit (fewer, larger numpy calls)
_WEIGHTS = (1 << np.arange(24)).astype(np.uint32)  # bit i of a value is worth 2**i


def _overrun(bw: int) -> int:
    """Bytes `_unpack` reads past the end of the last group: the last value's uint32 ends at
    byte ``7 * bw // 8 + 4`` of a ``bw``-byte group."""
    return max(0, 7 * bw // 8 + 4 - bw)


def _hybrid(data: np.ndarray, bw: int, count: int) -> np.ndarray:
    """RLE / bit-packed hybrid indices, ``count`` of them, as uint32.

    Arrow's writer emits, for values that do not repeat, bit-packed runs of one size (63
    groups of 8, a 1-byte header): when the stream starts with k such runs, their headers are
    checked in one numpy comparison and all their values unpacked in place (`_unpack`); the
    rest is parsed run by run.
    """
    head, hlen = _varint(memoryview(data[:10]), 0)
    if head & 1:
        groups = head >> 1
        per_run, stride = groups * 8, hlen + groups * bw
        k = min(count // per_run, len(data) // stride)
        if k and k * stride + _overrun(bw) > len(data):
            k -= 1  # the last run's overrun would leave the page: parse it with the rest
        if k:
            runs = data[: k * stride].reshape(k, stride)
            if (runs[:, :hlen] == data[:hlen]).all():
                out = np.empty(max(count, k * per_run), dtype=np.uint32)
                _unpack(data, hlen, k, groups, stride, bw, out[: k * per_run])
                if k * per_run < count:
                    rest = _hybrid_runs(data[k * stride :], bw, count - k * per_run)
                    out[k * per_run :] = rest
                return out[:count]
    return _hybrid_runs(data, bw, count)


def _hybrid_runs(data: np.ndarray, bw: int, count: int) -> np.ndarray:
    """The hybrid stream run by run: headers in Python, the bit-packed runs' bytes joined
    (whole groups, so alignment holds, and zero bytes for `_unpack`'s overrun) and unpacked in
    one pass."""
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
    if total < count or pos > n:
        raise Unsupported("page ends before its values")
    packed = None
    if spans:
        joined = np.concatenate([*(data[a:b] for a, b in spans), np.zeros(4, np.uint8)])
        ngroups = (len(joined) - 4) // bw
        packed = np.empty(ngroups * 8, dtype=np.uint32)
        _unpack(joined, 0, 1, ngroups, 0, bw, packed)
        if len(pieces) == len(spans):  # bit-packed runs only
            return packed[:count]
    out = np.empty(total, dtype=np.uint32)
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


def _page_values(page: np.ndarray, head: dict[int, Any], table: torch.Tensor | None,
                 levels: int, out: np.ndarray) -> int:  # fmt: skip
    """Decode one data page v1 into the front of ``out``; the number of values written.

    ``table`` is the column chunk's dictionary as a tensor; a dictionary page's indices go
    through ``torch.index_select``, which takes int32 indices as they are (numpy's ``take``
    widens them to int64 first, ~1.5x slower here) and writes straight into ``out``.
    """
    header = head.get(5)
    if header is None:  # data page v2 (or another page type): leave it to pyarrow
        raise Unsupported("data page v2")
    count, encoding = header[1], header[2]
    if count > len(out):
        raise Unsupported(f"a page of {count} values past the {len(out)} expected")
    pos = 0
    for _ in range(levels):  # repetition and/or definition levels, each length-prefixed
        pos += 4 + int.from_bytes(page[pos : pos + 4].tobytes(), "little")
    if encoding == _PLAIN:
        nbytes = count * out.itemsize
        if pos + nbytes > len(page):
            raise Unsupported("page ends before its values")
        out[:count] = page[pos : pos + nbytes].view(out.dtype)
        return count
    if encoding in (_RLE_DICTIONARY, _PLAIN_DICTIONARY) and table is not None:
        bw = int(page[pos])
        if bw > 24:
            raise Unsupported(f"dictionary indices of bit width {bw}")
        target = torch.from_numpy(out[:count])
        if bw == 0:  # a one-entry dictionary
            target.copy_(table[:1].expand(count))
        else:
            idx = torch.from_numpy(_hybrid(page[pos + 1 :], bw, count).view(np.int32))
            torch.index_select(table, 0, idx, out=target)
        return count
    raise Unsupported(f"encoding {encoding}")


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
    """`decode_fixed_column`, or ``None`` where this decoder does not apply."""
    try:
        return decode_fixed_column(source, metadata, row_groups, column, dtype, per_row)
    except Unsupported:
        return None


def decode_fixed_column(
    source: Any, metadata: Any, row_groups: list[int], column: int, dtype: Any, per_row: int
) -> np.ndarray:
    """Values of leaf ``column`` over ``row_groups`` as one flat, writable numpy array of
    ``dtype``, each page decoded straight into its place in it; `Unsupported` (saying why)
    where this decoder does not apply (see the module docstring).

    ``source`` is a pyarrow buffer of the whole file (e.g. ``pa.memory_map(path).read_buffer()``,
    zero-copy), ``metadata`` its ``FileMetaData``, ``per_row`` the values per row
    (``prod(shape)``). A reader of many episodes keeps `ColumnChunks` and calls its
    ``decode`` (reading pyarrow's metadata objects costs more than a small episode's pages).
    """
    chunks = ColumnChunks(metadata, column)
    return chunks.decode(np.frombuffer(source, dtype=np.uint8), row_groups, dtype, per_row)


class ColumnChunks:
    """Where leaf ``column``'s chunk lies in each row group, read once from the footer."""

    def __init__(self, metadata: Any, column: int) -> None:
        desc = metadata.schema.column(column)
        self.levels = int(desc.max_repetition_level > 0) + int(desc.max_definition_level > 0)
        # per row group: (first byte, byte count, codec or None, rows, why not decodable)
        self.groups: list[tuple[int, int, Any, int, str | None]] = []
        # per row group: the value of a flat integer column whose statistics say min == max
        # (every value lies in [min, max], so each is that one), else None: such a column
        # (lerobot's episode_index and task_index, one row group per episode) needs no page
        self.constant: list[int | None] = []
        flat_int = desc.max_repetition_level == 0 and desc.physical_type in ("INT32", "INT64")
        for g in range(metadata.num_row_groups):
            cc = metadata.row_group(g).column(column)
            codec, why = cc.compression, None
            if codec != "UNCOMPRESSED" and codec not in _CODECS:
                why = f"codec {codec}"
            stats = cc.statistics
            if stats is None or not stats.has_null_count or stats.null_count:
                why = why or "nulls, or no null count in the statistics"
            start = cc.dictionary_page_offset or cc.data_page_offset
            if cc.dictionary_page_offset is not None:
                start = min(start, cc.data_page_offset)
            rows = metadata.row_group(g).num_rows
            self.groups.append((start, cc.total_compressed_size, _codec(codec), rows, why))
            same = flat_int and why is None and stats.has_min_max and stats.min == stats.max
            self.constant.append(int(stats.min) if same else None)
        # per row group: its pages' (header, body start, body size), once a decode has read
        # them all: a small episode's read otherwise spends ~15% of its time in Thrift
        self.pages: dict[int, list[tuple[dict[int, Any], int, int]]] = {}

    def decode(self, file: np.ndarray, row_groups: list[int], dtype: Any, per_row: int
               ) -> np.ndarray:  # fmt: skip
        """`decode_fixed_column` over ``file``, the whole file's bytes."""
        constant = [self.constant[g] for g in row_groups]
        if per_row == 1 and None not in constant:  # from the footer: no page is read
            counts = [self.groups[g][3] for g in row_groups]
            return np.repeat(np.array(constant, dtype=dtype), counts)
        out = np.empty(sum(self.groups[g][3] for g in row_groups) * per_row, dtype=dtype)
        at = 0
        try:
            for g in row_groups:
                start, nbytes, codec, rows, why = self.groups[g]
                if why is not None:
                    raise Unsupported(why)
                chunk = file[start : start + nbytes]
                end = at + rows * per_row
                table = None
                for head, body, size in self._headers(g, chunk):
                    if at >= end:
                        break
                    if head[1] not in (_DATA_PAGE, _DICTIONARY_PAGE):
                        raise Unsupported("data page v2")  # levels kept outside the values
                    raw = chunk[body : body + size]
                    if codec is not None:
                        raw = np.frombuffer(codec.decompress(raw, head[2]), dtype=np.uint8)
                    if head[1] == _DICTIONARY_PAGE:
                        n = head[7][1]
                        # a writable copy (a few KB to 128 KB): torch wants one
                        table = torch.from_numpy(raw[: n * out.itemsize].view(dtype).copy())
                        continue
                    at += _page_values(raw, head, table, self.levels, out[at:end])
                if at != end:
                    raise Unsupported(f"{at} values where rows * per_row is {end}")
        except Unsupported:
            raise
        except (KeyError, IndexError, ValueError, TypeError, RuntimeError, OSError) as e:
            # pyarrow's errors (a corrupt page) are ValueError/OSError subclasses, torch's
            # index_select out of range an IndexError; numpy's short buffer a TypeError
            raise Unsupported(f"{type(e).__name__}: {e}") from e
        return out

    def _headers(self, g: int, chunk: np.ndarray) -> Iterator[tuple[dict[int, Any], int, int]]:
        """Row group ``g``'s pages in ``chunk`` as (header, body start, body size): parsed
        from the Thrift headers the first time, as far as the caller reads, and kept once
        they have all been read (the page layout of a file does not change)."""
        known = self.pages.get(g)
        if known is not None:
            yield from known
            return
        view, pos, seen = memoryview(chunk), 0, []
        while pos < len(chunk):
            head, body = _struct(view, pos)
            seen.append((head, body, head[3]))
            yield seen[-1]
            pos = body + head[3]
        self.pages[g] = seen


def _codec(name: str) -> Any:
    """pyarrow's codec object for a parquet codec name (``None``: uncompressed or unknown);
    its ``decompress`` is ~2x faster than ``pa.decompress``, which looks the codec up."""
    if name not in _CODECS:
        return None
    import pyarrow as pa

    return pa.Codec(_CODECS[name])
