"""Direct page decoding of fixed-shape parquet columns equals pyarrow's, or declines.

`packing._parquet_pages.read_fixed_column` skips the repetition/definition levels and decodes
only the values of a column with no nulls; every case here is checked bit for bit against
pyarrow reading the same file, and the cases it does not handle must return None (the caller
then reads with pyarrow), never wrong values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from packing._parquet_pages import read_fixed_column

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
    from packing._parquet_pages import fixed_shape

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
    from packing._parquet_pages import fixed_shape

    ext = datasets_features.Array3DExtensionType((48, 8, 16), "float16")
    assert fixed_shape(pa.field("latents", ext)) == (48, 8, 16)
