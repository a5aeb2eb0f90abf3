"""The service's fast paths give what the slow ones gave: /v1/predict's answer written without a
loop over the samples (trainer.serve.predictions_json) and the model called on its flat inputs
(trainer.live.FlatPredict)."""

import numpy as np
import pytest

from trainer.serve import predictions_json


@pytest.mark.parametrize("heads", [["click"], ["click", "buy 100%s", "ü\"x"]])
def test_answer_bytes_are_json_responses(heads):
    from starlette.responses import JSONResponse

    rng = np.random.default_rng(3)
    probabilities = rng.random((257, len(heads))).astype(np.float32)
    probabilities[:3, 0] = [0.0, 1.0, 1e-30]
    model = {"lineage": "l-1", "version": 4, "step": 9, "newest_sample_time": 1.5e9,
             "freshness_lag_s": None}
    expected = JSONResponse({"predictions": [dict(zip(heads, map(float, row)))
                                             for row in probabilities], "model": model}).body
    assert predictions_json(heads, probabilities, model) == expected


def test_a_probability_that_is_no_json_number_takes_the_slow_path():
    assert predictions_json(["click"], np.array([[0.5], [np.nan]], np.float32), {}) is None


def test_flat_predict_answers_as_the_structured_call(tmp_path):
    import tensorflow as tf

    from trainer.live import FlatPredict

    class Model(tf.Module):
        def __init__(self):
            self.w = tf.Variable([[2.0], [3.0]])

        @tf.function(input_signature=[{"dense": tf.TensorSpec([None, 2], tf.float32),
                                       "ids": {"a": tf.TensorSpec([None], tf.int32)}}])
        def predict(self, feed):
            return {"click": tf.sigmoid(tf.matmul(feed["dense"], self.w)[:, 0]
                                        + tf.cast(feed["ids"]["a"], tf.float32))}

    tf.saved_model.save(Model(), str(tmp_path / "m"))
    function = tf.saved_model.load(str(tmp_path / "m")).predict.concrete_functions[0]
    call = FlatPredict(function)
    assert call.flat
    feed = {"dense": np.array([[0.1, 0.2], [0.3, -0.4]], np.float32),
            "ids": {"a": np.array([1, -2], np.int32)}}
    got = call(feed)["click"].numpy()
    want = function(tf.nest.map_structure(tf.convert_to_tensor, feed))["click"].numpy()
    np.testing.assert_array_equal(got, want)
    with pytest.raises((ValueError, TypeError)):  # another structure is refused, not misread
        call({"dense": feed["dense"], "ids": {"b": feed["ids"]["a"]}})
