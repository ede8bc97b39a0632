"""Direct page decoding of fixed-shape parquet columns equals pyarrow's, or declines.

`packing.datasets._parquet_pages.read_fixed_column` skips the repetition/definition levels and decodes
only the values of a column with no nulls; every case here is checked bit for bit against
pyarrow reading the same file, and the cases it does not handle must return None (the caller
then reads with pyarrow), never wrong values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from packing.datasets._parquet_pages import read_fixed_column

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def nested(values: np.ndarray, shape: tuple[int, ...]) -> object:
    """Rows of ``shape`` as nested variable-size lists, the way `datasets` stores ArrayND."""
    array = pa.array(values.reshape(-1))
    for dim in reversed(shape):
        offsets = np.arange(0, len(array) + 1, dim, dtype=np.int32)
        array = pa.ListArray.from_arrays(pa.array(offsets), array)
    return array


def write(path: Path, columns: dict[str, object], rows_per_group: int, **options) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=rows_per_group, **options)
    return path


def direct(path: Path, name: str, dtype, per_row: int, groups=None):
    pf = pq.ParquetFile(path)
    md = pf.metadata
    leaf = next(i for i in range(md.num_columns) if md.schema.column(i).path.startswith(name))
    buffer = pa.memory_map(str(path), "r").read_buffer()
    groups = list(range(md.num_row_groups)) if groups is None else groups
    return read_fixed_column(buffer, md, groups, leaf, dtype, per_row)


def expected(path: Path, name: str, groups=None) -> np.ndarray:
    pf = pq.ParquetFile(path)
    groups = list(range(pf.num_row_groups)) if groups is None else groups
    col = pf.read_row_groups(groups, columns=[name]).column(0).combine_chunks()
    while pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type):
        col = col.flatten()
    return col.to_numpy()


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("compression", ["snappy", "zstd", "none"])
@pytest.mark.parametrize("dictionary", [True, False])
def test_float16_latents_equal_pyarrow(tmp_path: Path, compression: str, dictionary: bool) -> None:
    rng = np.random.default_rng(0)
    shape = (6, 2, 4)
    values = rng.standard_normal((23, *shape)).astype(np.float16)
    path = write(tmp_path / "x.parquet", {"latents": nested(values, shape)}, 7,
                 compression=compression, use_dictionary=dictionary)  # fmt: skip
    got = direct(path, "latents", np.float16, 48)
    assert got is not None and same_bits(got, expected(path, "latents"))
    some = direct(path, "latents", np.float16, 48, groups=[1, 2])  # rows 7..20
    assert some is not None and same_bits(some, expected(path, "latents", [1, 2]))


@pytest.mark.parametrize(
    "dtype", [np.float16, np.float32, np.float64, np.int32, np.int64], ids=lambda d: d.__name__
)
@pytest.mark.parametrize("distinct", [1, 2, 200, 5000])
def test_dictionary_bit_widths_and_repeated_runs(tmp_path: Path, dtype, distinct: int) -> None:
    # Few distinct values give narrow indices and long repeated (RLE) runs between
    # bit-packed ones: the mixed path; 5000 distinct values give 13-bit indices.
    rng = np.random.default_rng(distinct)
    pool = rng.standard_normal(distinct).astype(dtype) if dtype in (np.float16, np.float32,
           np.float64) else rng.integers(-1000, 1000, distinct).astype(dtype)  # fmt: skip
    idx = rng.integers(0, distinct, 3000)
    idx[500:1400] = idx[500]  # a long run of one value
    values = pool[idx]
    path = write(tmp_path / "x.parquet", {"a": nested(values, (10,))}, 120)
    got = direct(path, "a", dtype, 10)
    assert got is not None and same_bits(got, expected(path, "a"))


@pytest.mark.parametrize("dtype", [np.float32, np.int64], ids=lambda d: d.__name__)
@pytest.mark.parametrize("rows", [1, 63, 505, 2001, 14_000])
def test_wide_indices_and_page_ends(tmp_path: Path, dtype, rows: int) -> None:
    # Row counts around Arrow's 504-value runs, and small data pages, end pages on partial and
    # exact runs, where the unpacker (4 bytes read per value) must not read past the page.
    # 14,000 rows (70,000 distinct values) need 17-bit indices: read by pyarrow before.
    rng = np.random.default_rng(rows)
    values = (rng.permutation(rows * 6) - 3 * rows).astype(dtype)
    values[rows * 5 :] = values[rng.integers(0, rows * 5, rows)]  # repeats too
    # Pages of < 4,096 values are unpacked bit by bit, larger ones by strided shifts: both.
    for compression, page_bytes in [("none", 1500), ("snappy", 1500), ("snappy", None)]:
        path = write(tmp_path / f"{compression}{page_bytes}.parquet", {"a": nested(values, (6,))},
                     rows, compression=compression, data_page_size=page_bytes)  # fmt: skip
        got = direct(path, "a", dtype, 6)
        assert got is not None and same_bits(got, expected(path, "a"))
    if rows == 14_000:  # against a vacuous pass: the indices really were wider than 16 bits
        assert _max_bit_width(path) == 16 + 1


def _max_bit_width(path: Path) -> int:
    from packing.datasets._parquet_pages import _struct

    md = pq.ParquetFile(path).metadata
    file = np.frombuffer(pa.memory_map(str(path), "r").read_buffer(), dtype=np.uint8)
    widths = [0]
    for g in range(md.num_row_groups):
        cc = md.row_group(g).column(0)
        start = min(o for o in (cc.dictionary_page_offset, cc.data_page_offset) if o is not None)
        chunk, pos = file[start : start + cc.total_compressed_size], 0
        while pos < len(chunk):
            head, body = _struct(memoryview(chunk), pos)
            raw = chunk[body : body + head[3]]
            if cc.compression != "UNCOMPRESSED":
                raw = np.frombuffer(pa.decompress(raw, head[2], codec="snappy"), dtype=np.uint8)
            pos = body + head[3]
            if head[1] == 0:
                at = 0
                for _ in range(2):  # repetition and definition levels
                    at += 4 + int.from_bytes(raw[at : at + 4].tobytes(), "little")
                widths.append(int(raw[at]))
    return max(widths)


@pytest.mark.parametrize("compression", ["none", "snappy"])
def test_one_reader_reused_over_row_groups_in_any_order(tmp_path: Path, compression: str) -> None:
    # A reader keeps each row group's page layout once it has read it (as LeRobotEpisodes
    # does for a file's episodes): later decodes, of any row groups in any order, must still
    # equal pyarrow, and the layout kept must be each group's own.
    from packing.datasets._parquet_pages import ColumnChunks

    rng = np.random.default_rng(3)
    values = rng.standard_normal((90, 5, 4)).astype(np.float16)
    path = write(tmp_path / "x.parquet", {"a": nested(values, (5, 4))}, 20,
                 compression=compression, data_page_size=300)  # fmt: skip
    md = pq.ParquetFile(path).metadata
    file = np.frombuffer(pa.memory_map(str(path), "r").read_buffer(), dtype=np.uint8)
    chunks = ColumnChunks(md, 0)
    for groups in ([0, 1, 2, 3, 4], [2, 1], [4], [3, 0], [0, 1, 2, 3, 4], [1]):
        got = chunks.decode(file, groups, np.float16, 20)
        assert same_bits(got, expected(path, "a", groups)), groups
    assert sorted(chunks.pages) == [0, 1, 2, 3, 4]
    assert min(len(p) for p in chunks.pages.values()) > 2  # a dictionary and >= 2 data pages


@pytest.mark.parametrize("dtype", [np.int32, np.int64], ids=lambda d: d.__name__)
def test_constant_integer_columns_come_from_the_statistics(tmp_path: Path, dtype) -> None:
    # lerobot's episode_index: one value per row group. Where min == max the values are
    # taken from the footer, elsewhere from the pages; both must equal pyarrow.
    from packing.datasets._parquet_pages import ColumnChunks

    values = np.repeat(np.array([7, 3, 3, 9], dtype=dtype), 10)
    values[35] = -2  # the last row group is not constant
    path = write(tmp_path / "x.parquet", {"e": pa.array(values)}, 10)
    md = pq.ParquetFile(path).metadata
    file = np.frombuffer(pa.memory_map(str(path), "r").read_buffer(), dtype=np.uint8)
    chunks = ColumnChunks(md, 0)
    assert chunks.constant == [7, 3, 3, None]
    for groups in ([0], [1, 2], [2, 0], [3]):
        got = chunks.decode(file, groups, dtype, 1)
        assert same_bits(got, expected(path, "e", groups)), groups
    assert sorted(chunks.pages) == [3]  # the constant groups' pages were never read
    got = chunks.decode(file, [0, 1, 2, 3], dtype, 1)  # one group not constant: all pages
    assert same_bits(got, expected(path, "e", [0, 1, 2, 3]))


def test_one_wrong_bit_is_seen(tmp_path: Path) -> None:
    # Against a vacuous comparison: flipping one bit of one packed index changes the decode.
    rng = np.random.default_rng(1)
    values = rng.standard_normal(600 * 8).astype(np.float16)
    path = write(tmp_path / "x.parquet", {"a": nested(values, (8,))}, 600, compression="none")
    good = direct(path, "a", np.float16, 8)
    assert good is not None and same_bits(good, expected(path, "a"))
    raw = bytearray(path.read_bytes())
    md = pq.ParquetFile(path).metadata.row_group(0).column(0)
    at = (
        md.data_page_offset
        + (md.total_compressed_size - (md.data_page_offset - md.dictionary_page_offset)) // 2
    )
    raw[at] ^= 0x10
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(bytes(raw))
    got = direct(bad, "a", np.float16, 8)
    assert got is None or not same_bits(got, good)


def test_columns_it_does_not_handle_return_none(tmp_path: Path) -> None:
    values = np.arange(60, dtype=np.float32)
    # Data page v2 keeps levels outside the compressed values: declined, read by pyarrow.
    v2 = write(tmp_path / "v2.parquet", {"a": nested(values, (6,))}, 5,
               data_page_version="2.0")  # fmt: skip
    assert direct(v2, "a", np.float32, 6) is None
    # A null row: the count of values no longer matches rows * per_row.
    with_null = pa.array([[1.0, 2.0], None, [3.0, 4.0]], type=pa.list_(pa.float32()))
    nulls = write(tmp_path / "n.parquet", {"a": with_null}, 3)
    assert direct(nulls, "a", np.float32, 2) is None
    # A ragged column: the same.
    ragged = pa.array([[1.0, 2.0], [3.0], [4.0, 5.0]], type=pa.list_(pa.float32()))
    path = write(tmp_path / "r.parquet", {"a": ragged}, 3)
    assert direct(path, "a", np.float32, 2) is None


def test_only_schemas_that_guarantee_a_shape_are_decoded_directly() -> None:
    from packing.datasets._parquet_pages import fixed_shape

    ext = pa.field("latents", pa.list_(pa.list_(pa.float16())), metadata={
        b"ARROW:extension:name": b"datasets.features.features.Array2DExtensionType",
        b"ARROW:extension:metadata": b'[[4, 3], "float16"]'})  # fmt: skip
    assert fixed_shape(ext) == (4, 3)
    fixed = pa.field("action", pa.list_(pa.list_(pa.float32(), 7), 2))
    assert fixed_shape(fixed) == (2, 7)
    # a plain list may be ragged: rows of 3 and 1 values add up to 2 rows of 2
    assert fixed_shape(pa.field("a", pa.list_(pa.float32()))) is None
    assert fixed_shape(pa.field("t", pa.float32())) is None


def test_registered_datasets_extension_type_gives_its_shape() -> None:
    datasets_features = pytest.importorskip("datasets.features.features")
    from packing.datasets._parquet_pages import fixed_shape

    ext = datasets_features.Array3DExtensionType((48, 8, 16), "float16")
    assert fixed_shape(pa.field("latents", ext)) == (48, 8, 16)
