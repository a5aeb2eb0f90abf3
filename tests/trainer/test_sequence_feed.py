"""Sequence features in the feed: ordered by their time column, cut to their most recent
``max_length`` items, the time column not embedded; the same per node and per leaf."""
import numpy as np
import pytest

import schemas
from trainer import TrainConfig
from trainer.config import ConfigError
from trainer.feed import Layout, order_sequences

SCHEMA = schemas.from_dict({"name": "t", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [
        {"name": "uid", "kind": "id"},
        {"name": "hist", "kind": "ids", "sequence": {"max_length": 2, "time": "hist_t"}},
        {"name": "hist_t", "kind": "ids"},
        {"name": "recent", "kind": "ids", "sequence": {"max_length": 3}},
        {"name": "bag", "kind": "ids"}]},
    {"name": "ad", "key": ["aid"], "features": [{"name": "aid", "kind": "id"}]}]})


def _lists(rows):
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
    values = np.array([v for r in rows for v in r], np.int64)
    return values, offsets


def _rows(pair):
    values, offsets = pair
    return [list(values[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]


def test_order_by_time_then_keep_the_most_recent():
    arrays = {"hist": _lists([[10, 11, 12], [], [20], [30, 31, 32, 33]]),
              "hist_t": _lists([[5, 1, 3], [], [7], [2, 2, 1, 9]]),
              "recent": _lists([[1, 2, 3, 4, 5], [6], [], [7, 8, 9]]),
              "bag": _lists([[1, 2, 3, 4, 5], [], [], []])}
    out = order_sequences(arrays, SCHEMA)
    # by time (ties keep their order), then the last two
    assert _rows(out["hist"]) == [[12, 10], [], [20], [31, 33]]
    assert out["hist"][1].dtype == np.int32
    assert _rows(out["recent"]) == [[3, 4, 5], [6], [], [7, 8, 9]]
    assert out["bag"] is arrays["bag"]   # not a sequence: untouched
    assert _rows(arrays["recent"])[0] == [1, 2, 3, 4, 5]   # the input is not changed


def test_a_time_column_of_another_length_is_an_error():
    arrays = {"hist": _lists([[10, 11], [12]]), "hist_t": _lists([[1], [2, 3]]),
              "recent": _lists([[], []]), "bag": _lists([[], []])}
    with pytest.raises(ValueError, match="sequence 'hist': row 0 has 2 items but its time "
                                         "column 'hist_t' has 1 times; give one time per item"):
        order_sequences(arrays, SCHEMA)


def test_the_time_column_has_no_table_and_no_input():
    config = TrainConfig()
    tables = config.check(SCHEMA)
    assert "hist_t" not in tables and all("hist_t" not in names for names in tables.values())
    layout = Layout(SCHEMA, tables, {t: 4 for t in tables}, {}, {})
    assert [b.lists for b in layout.layer_blocks(0)] == [("hist", "recent", "bag")]
    with pytest.raises(ConfigError, match="features.hist_t: 'hist_t' is a sequence's time "
                                          "column and has no embedding table"):
        TrainConfig.from_dict({"features": {"hist_t": {"pooling": "sum"}}}).check(SCHEMA)
