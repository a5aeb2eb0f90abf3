"""trainer.faces.columns.samples_request: the columns of a face's request become the same
samples, whatever the values, as json.dumps of one object per sample would write them."""

import json

import pytest

from trainer.faces.columns import samples_request
from trainer.requests import BadRequest


def _rows(columns, n):
    names = list(columns)
    return [dict(zip(names, values)) for values in zip(*columns.values())] if names else \
        [{}] * n


@pytest.mark.parametrize("columns", [
    {"uid": [1, -2, 2 ** 63 - 1], "price": [[1.5], [0.1], [1e16]], "tags": [[], [7, 8], [9]]},
    {"pid": ["a\"b", "ü\\n", "%s%%"], "100%": [3, 4, 5], "mixed": [1, 2.5, -0.0]},
    # values the fast forms leave to json.dumps: kept as it writes them
    {"flag": [True, False, True], "none": [None, 1, "x"], "nested": [[[1]], [], [[2, 3]]],
     "big": [2 ** 70, 1, 2], "floats in lists": [[1, 2.5], [True], ["s"]]},
])
def test_body_holds_the_same_samples(columns):
    request = samples_request(columns, 3, 10)
    assert json.loads(request.body) == {"samples": _rows(columns, 3)}
    assert len(request) == 3
    for i, row in enumerate(_rows(columns, 3)):  # each sample's span is that sample
        assert json.loads(request.body[request.starts[i]:request.ends[i]]) == row


def test_no_columns_and_limits():
    request = samples_request({}, 2, 10)
    assert json.loads(request.body) == {"samples": [{}, {}]}
    with pytest.raises(BadRequest) as e:
        samples_request({"uid": [1, 2, 3]}, 3, 2)
    assert e.value.status == 413


def test_a_value_json_cannot_write_is_refused_as_json_dumps_refuses_it():
    with pytest.raises(ValueError, match="JSON compliant"):
        samples_request({"price": [[float("nan")], [1.0]]}, 2, 10)
