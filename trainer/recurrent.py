"""Recurrent cells over padded, masked sequences: the GRU and DIEN's attention-update-gate GRU.

Both run a batch of sequences ``x: float32[nodes, steps, dim]`` with a mask ``[nodes, steps]``
(True for an item, False for padding after the last one) as one ``tf.scan`` over the steps. A
padded step keeps the state unchanged, so the state at the last step is each sequence's state
after its own last item (zeros for an empty sequence). The input projections of every step are
one matmul before the scan; the scan does the recurrent part only.

The cells are the textbook GRU (Cho et al. 2014, with the reset gate applied to the recurrent
projection as cuDNN and Keras do)::

    u = sigmoid(x W_u + h U_u + b_u)              update gate
    r = sigmoid(x W_r + h U_r + b_r)              reset gate
    c = tanh(x W_c + r * (h U_c) + b_c)           candidate
    h' = (1 - u) * h + u * c

and AUGRU (Zhou et al., DIEN, AAAI 2019): the same with the update gate scaled by an attention
score per step, ``u = a_t * u``, so a step the attention ignores leaves the state as it was.
"""

from __future__ import annotations

import keras
import tensorflow as tf


class GRU(keras.layers.Layer):
    """A GRU of ``units`` over masked sequences; ``call(x, mask, attention=None)`` returns
    every step's state ``[nodes, steps, units]`` (a padded step repeats the state before it).
    With ``attention`` (``[nodes, steps]``, e.g. DIEN's scores) it is an AUGRU."""

    def __init__(self, units: int, **kwargs):
        super().__init__(**kwargs)
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise ValueError(f"GRU units: expected a positive integer, got {units!r}")
        self.units = units
        self.kernel = None

    def _build(self, dim: int):
        # A new initializer per weight: each draws its own seed from Keras' seeded generator.
        self.kernel = self.add_weight(shape=(dim, 3 * self.units), name="kernel",
                                      initializer=keras.initializers.GlorotUniform())
        self.recurrent = self.add_weight(shape=(self.units, 3 * self.units), name="recurrent",
                                         initializer=keras.initializers.Orthogonal())
        self.bias = self.add_weight(shape=(3 * self.units,), name="bias", initializer="zeros")

    def __call__(self, x, mask, attention=None):
        if self.kernel is None:
            self._build(int(x.shape[-1]))
        n = self.units
        # [steps, nodes, ...]: the scan runs over the first axis
        projected = tf.transpose(tf.einsum("ntd,dk->ntk", x, self.kernel) + self.bias,
                                 [1, 0, 2])
        steps = [projected, tf.transpose(tf.cast(mask, x.dtype))]
        if attention is not None:
            steps.append(tf.transpose(attention))
        recurrent = self.recurrent
        initial = tf.zeros([tf.shape(x)[0], n], x.dtype)

        def step(h, inputs):
            xw, keep = inputs[0], inputs[1][:, None]
            hu = tf.matmul(h, recurrent)
            u = tf.sigmoid(xw[:, :n] + hu[:, :n])
            r = tf.sigmoid(xw[:, n:2 * n] + hu[:, n:2 * n])
            c = tf.tanh(xw[:, 2 * n:] + r * hu[:, 2 * n:])
            if attention is not None:
                u = inputs[2][:, None] * u
            new = h + u * (c - h)   # (1 - u) h + u c
            return keep * new + (1.0 - keep) * h

        states = tf.scan(step, tuple(steps), initializer=initial)
        return tf.transpose(states, [1, 0, 2])
