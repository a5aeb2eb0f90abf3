"""Dense networks for the trainer: the paper's MLP, DIN-style target attention and ESMM.

A DenseNet is a Keras layer with a ``forward(inputs)`` method that receives a
:class:`trainer.network.Inputs` (per-layer features and an ``expand`` helper) and returns a dict
of logits per leaf. Write the per-layer part on ``inputs.concat(l)`` / ``inputs.feature(name)`` and
``expand`` it to the leaves; the trainer runs it structured (per node) or flat (on leaves)::

    class MyNet(trainer.models.DenseNet):
        def __init__(self):
            super().__init__()
            self.first = trainer.models.SplitDense(64)
            self.out = keras.layers.Dense(1)

        def forward(self, inputs):
            h = tf.nn.relu(self.first(inputs))       # x W = sum_l expand(x_l W_l, l)
            return {inputs.label_names[0]: self.out(h)[:, 0]}
"""

from __future__ import annotations

import keras
import tensorflow as tf

_EPS = 1e-7


class DenseNet(keras.layers.Layer):
    """Base class: subclasses implement ``forward``; ``loss`` and ``probabilities`` default to
    one sigmoid head per output, named after the label it predicts."""

    def forward(self, inputs) -> dict:
        raise NotImplementedError

    def loss(self, outputs: dict, labels: dict):
        """Mean binary cross-entropy over the leaves, summed over the heads."""
        total = 0.0
        for name, logits in outputs.items():
            total += tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                labels=labels[name], logits=logits))
        return total

    def probabilities(self, outputs: dict) -> dict:
        return {name: tf.sigmoid(logits) for name, logits in outputs.items()}

    def spec(self) -> dict:
        """Name and arguments that rebuild this model (checkpoints store them)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be rebuilt from a checkpoint; "
                                  "pass model= to Trainer.restore")


class SplitDense(keras.layers.Layer):
    """The first dense layer, split by tree layer: ``x W + b = sum_l expand(x_l W_l, l) + b``.

    Each ``x_l W_l`` runs on layer l's nodes before the gather to the leaves. In flat compute it
    is one matmul of the concatenated leaf inputs with ``concat_l W_l`` (the same variables).
    ``extra[l]`` are more inputs of layer l's nodes appended after its features (e.g. DIN's
    interest vector).
    """

    def __init__(self, units: int, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.kernels = None

    def __call__(self, inputs, extra: dict | None = None):
        xs = []
        for level in range(inputs.levels):
            more = list((extra or {}).get(level, []))
            xs.append(tf.concat([inputs.concat(level)] + more, axis=1) if more
                      else inputs.concat(level))
        if self.kernels is None:
            init = keras.initializers.GlorotUniform()
            fan_in = sum(int(x.shape[-1]) for x in xs)
            # One Glorot draw for the whole [sum d_l, units] kernel, cut into per-layer parts,
            # so the initialisation does not depend on how the inputs split into layers.
            full = init((fan_in, self.units))
            self.kernels, start = [], 0
            for level, x in enumerate(xs):
                width = int(x.shape[-1])
                self.kernels.append(self.add_weight(
                    shape=(width, self.units), name=f"kernel_{level}",
                    initializer=_constant(full[start:start + width])))
                start += width
            self.bias = self.add_weight(shape=(self.units,), name="bias", initializer="zeros")
            self.built = True
        if inputs.flat:
            return tf.matmul(tf.concat(xs, axis=1),
                             tf.concat([k.value for k in self.kernels], axis=0)) + self.bias
        h = None
        for level, (x, kernel) in enumerate(zip(xs, self.kernels)):
            part = inputs.expand(tf.matmul(x, kernel), level)
            h = part if h is None else h + part
        return h + self.bias


def _constant(value):
    value = tf.convert_to_tensor(value)
    return lambda shape, dtype=None: tf.cast(value, dtype or value.dtype)


class _Tower(keras.layers.Layer):
    """SplitDense(hidden[0]) -> activation -> Dense(hidden[1:]) -> Dense(1): one logit per leaf."""

    def __init__(self, hidden, activation, **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.activation_name = hidden, activation
        self.activation = keras.activations.get(activation)
        self.first = None

    def __call__(self, inputs, extra=None):
        if self.first is None:
            # Layers made here, after the trainer seeded Keras: Keras draws an unseeded
            # initializer's seed when the layer is constructed.
            self.first = SplitDense(self.hidden[0])
            self.rest = [keras.layers.Dense(u, activation=self.activation_name)
                         for u in self.hidden[1:]]
            self.out = keras.layers.Dense(1)
        h = self.activation(self.first(inputs, extra))
        for layer in self.rest:
            h = layer(h)
        return self.out(h)[:, 0]


class MLP(DenseNet):
    """The XDL paper's model: every feature's pooled embedding (dim 18, sum pooling in the default
    config) concatenated, then 200-80-1. ``label`` defaults to the schema's first label."""

    def __init__(self, hidden=(200, 80), activation="relu", label: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.hidden = tuple(hidden)
        self.activation_name = activation
        self.label = label
        self.tower = _Tower(self.hidden, activation)

    def forward(self, inputs):
        return {self.label or inputs.label_names[0]: self.tower(inputs)}

    def spec(self):
        return {"name": "mlp", "hidden": list(self.hidden), "activation": self.activation_name,
                "label": self.label}


class DIN(DenseNet):
    """Deep Interest Network style target attention, then the MLP.

    The ``query`` id feature (e.g. the ad's ``cate_id``) attends over the ``behaviour`` ids list
    of an upper layer (e.g. the user's ``clicked_cats``): per (query node, behaviour item) pair a
    small MLP scores ``[k, q, k*q, k-q]``; the interest vector is the score-weighted sum of the
    items (no softmax, as DIN). It is computed once per node of the query's layer (per ad, not
    per sample) and joins that layer's inputs of the first dense layer. Query and behaviour
    should share a table (``features: {clicked_cats: {table: cate}, cate_id: {table: cate}}``)
    so that they live in one embedding space.
    """

    def __init__(self, behaviour: str = "clicked_cats", query: str = "cate_id",
                 hidden=(200, 80), attention_hidden=(36,), activation="relu",
                 label: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.behaviour, self.query = behaviour, query
        self.hidden, self.attention_hidden = tuple(hidden), tuple(attention_hidden)
        self.activation_name, self.label = activation, label
        self.attention = None
        self.tower = _Tower(self.hidden, activation)

    def check(self, schema):
        """Raise ValueError unless the schema has the behaviour and query features."""
        for role, name, kind in (("behaviour", self.behaviour, "ids"),
                                 ("query", self.query, "id")):
            if name not in schema._by_name or schema.feature(name).kind != kind:
                raise ValueError(f"DIN {role}={name!r}: the schema needs an {kind!r} feature of "
                                 f"that name; pass DIN({role}=<feature>)")
        if schema.layer_index(self.behaviour) > schema.layer_index(self.query):
            raise ValueError(f"DIN: behaviour {self.behaviour!r} must be on the query's layer or "
                             f"above it, not below {self.query!r}")

    def forward(self, inputs):
        b_level = inputs.schema.layer_index(self.behaviour)
        q_level = inputs.schema.layer_index(self.query)
        sequence = inputs.sequence(self.behaviour)          # [nodes of b_level, None, dim]
        index = inputs.ancestor_index(b_level, q_level)
        if index is not None:
            sequence = tf.gather(sequence, index)            # [nodes of q_level, None, dim]
        keys = sequence.values
        pair_node = sequence.value_rowids()
        query = inputs.feature(self.query)
        q = tf.gather(query, pair_node)
        score = tf.concat([keys, q, keys * q, keys - q], axis=1)
        if self.attention is None:  # made at the first call, after the trainer seeded Keras
            self.attention = [keras.layers.Dense(u, activation="sigmoid")
                              for u in self.attention_hidden] + [keras.layers.Dense(1)]
        for layer in self.attention:
            score = layer(score)
        interest = tf.math.unsorted_segment_sum(score * keys, pair_node, tf.shape(query)[0])
        logits = self.tower(inputs, extra={q_level: [interest]})
        return {self.label or inputs.label_names[0]: logits}

    def spec(self):
        return {"name": "din", "behaviour": self.behaviour, "query": self.query,
                "hidden": list(self.hidden), "attention_hidden": list(self.attention_hidden),
                "activation": self.activation_name, "label": self.label}


class ESMM(DenseNet):
    """Entire Space Multi-task Model: a CTR tower and a CVR tower over shared embeddings;
    pCTCVR = pCTR * pCVR. The loss is the CTR log loss on ``click`` plus the CTCVR log loss on
    ``conversion`` (which must be click AND convert), both over all samples."""

    def __init__(self, hidden=(200, 80), activation="relu", click: str = "click",
                 conversion: str = "conversion", **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.activation_name = tuple(hidden), activation
        self.click, self.conversion = click, conversion
        self.ctr = _Tower(self.hidden, activation)
        self.cvr = _Tower(self.hidden, activation)

    def check(self, schema):
        for name in (self.click, self.conversion):
            if name not in schema.labels:
                raise ValueError(f"ESMM: the schema has no label {name!r} (labels are "
                                 f"{', '.join(schema.labels)}); pass ESMM(click=..., "
                                 "conversion=...)")

    def forward(self, inputs):
        return {"ctr": self.ctr(inputs), "cvr": self.cvr(inputs)}

    def loss(self, outputs, labels):
        ctr_loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
            labels=labels[self.click], logits=outputs["ctr"]))
        # log pCTCVR = log sigmoid(ctr) + log sigmoid(cvr): stable for large logits.
        log_p = tf.math.log_sigmoid(outputs["ctr"]) + tf.math.log_sigmoid(outputs["cvr"])
        p = tf.exp(log_p)
        log_not_p = tf.math.log(tf.maximum(1.0 - p, _EPS))
        y = labels[self.conversion]
        ctcvr_loss = -tf.reduce_mean(y * log_p + (1.0 - y) * log_not_p)
        return ctr_loss + ctcvr_loss

    def probabilities(self, outputs):
        p_ctr = tf.sigmoid(outputs["ctr"])
        return {self.click: p_ctr, self.conversion: p_ctr * tf.sigmoid(outputs["cvr"])}

    def spec(self):
        return {"name": "esmm", "hidden": list(self.hidden), "activation": self.activation_name,
                "click": self.click, "conversion": self.conversion}


MODELS = {"mlp": MLP, "din": DIN, "esmm": ESMM}


def from_spec(spec: dict) -> DenseNet:
    """The built-in model a ``spec()`` describes."""
    spec = dict(spec)
    name = spec.pop("name")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; built-in models are {', '.join(MODELS)}")
    return MODELS[name](**spec)
