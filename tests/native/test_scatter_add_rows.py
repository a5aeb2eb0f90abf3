"""native.scatter_add_rows: per-row sums of a gather's gradient rows, and its bad-input errors."""

import numpy as np
import pytest

import native


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dim, n, rows", [(18, 50000, 20000), (3, 7, 2), (64, 1000, 1000)])
def test_sums_every_row_like_numpy_add_at(index_dtype, dim, n, rows):
    rng = np.random.default_rng(dim + n)
    values = rng.standard_normal((n, dim)).astype(np.float32)
    index = (rng.zipf(1.3, n) % rows).astype(index_dtype)
    expected = np.zeros((rows, dim), np.float32)
    np.add.at(expected, index, values)  # adds in index order too, so the sums are the same
    out = native.scatter_add_rows(values, index, rows)
    assert out.dtype == np.float32 and out.shape == (rows, dim)
    np.testing.assert_array_equal(out, expected)


def test_rows_never_indexed_are_zero_and_empty_inputs_work():
    out = native.scatter_add_rows(np.ones((2, 4), np.float32), np.array([3, 3], np.int32), 5)
    np.testing.assert_array_equal(out[3], np.full(4, 2.0, np.float32))
    assert not np.delete(out, 3, axis=0).any()
    empty = native.scatter_add_rows(np.zeros((0, 4), np.float32), np.zeros(0, np.int32), 3)
    np.testing.assert_array_equal(empty, np.zeros((3, 4), np.float32))
    assert native.scatter_add_rows(np.zeros((0, 4), np.float32), np.zeros(0, np.int64),
                                   0).shape == (0, 4)


def test_non_contiguous_inputs_are_summed_as_their_values():
    values = np.arange(40, dtype=np.float32).reshape(10, 4)[::2]  # a strided view
    index = np.array([0, 1, 0, 1, 0, 9, 9, 9, 9, 9], np.int64)[:5]
    expected = np.zeros((2, 4), np.float32)
    np.add.at(expected, index, values)
    np.testing.assert_array_equal(native.scatter_add_rows(values, index, 2), expected)


@pytest.mark.parametrize("bad, message", [(-1, "index\\[1\\] = -1 is outside \\[0, 4\\)"),
                                          (4, "index\\[1\\] = 4 is outside \\[0, 4\\)")])
def test_an_index_out_of_range_is_named_in_the_error(bad, message):
    with pytest.raises(native.InvalidInputError, match=message):
        native.scatter_add_rows(np.ones((3, 2), np.float32), np.array([0, bad, 1], np.int32), 4)


@pytest.mark.parametrize("values, index, rows, error, message", [
    (np.ones((2, 2), np.float64), np.zeros(2, np.int32), 1, native.InvalidDtypeError, "float32"),
    (np.ones(4, np.float32), np.zeros(4, np.int32), 1, native.InvalidInputError, "2-D"),
    (np.ones((2, 2), np.float32), np.zeros(2, np.uint32), 1, native.InvalidDtypeError, "int32"),
    (np.ones((2, 2), np.float32), np.zeros(3, np.int32), 1, native.InvalidInputError, "shape"),
    (np.ones((2, 2), np.float32), np.zeros((2, 1), np.int32), 1, native.InvalidInputError,
     "shape"),
    (np.ones((2, 2), np.float32), np.zeros(2, np.int32), -1, native.InvalidInputError, ">= 0"),
    (np.ones((2, 2), np.float32), np.zeros(2, np.int32), 1.5, native.InvalidInputError, "int"),
])
def test_bad_arguments_get_clear_errors(values, index, rows, error, message):
    with pytest.raises(error, match=message):
        native.scatter_add_rows(values, index, rows)
