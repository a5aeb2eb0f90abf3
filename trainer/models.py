"""Dense networks for the trainer: the paper's MLP, DIN-style target attention, ESMM, and the
cross models DCN-v2 and DeepFM.

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

from trainer.recurrent import GRU

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

    def output_biases(self, outputs) -> dict:
        """``{output name: bias variable}``: the bias added last to each output's logit, in the
        order of ``outputs`` (the dict ``forward`` returned), for calibrating a fresh model to
        its data's rates (``Trainer.calibrate_output``); {} when there is none to shift. The
        built-in one-tower models shift their tower's output layer."""
        tower = getattr(self, "tower", None)
        if tower is None or getattr(tower, "out", None) is None or len(outputs) != 1:
            return {}
        return {next(iter(outputs)): tower.out.bias}

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
    """SplitDense(hidden[0]) -> activation -> Dense(hidden[1:]) -> Dense(1): one logit per leaf;
    with ``dropout`` > 0, dropout after every hidden layer in training steps."""

    def __init__(self, hidden, activation, dropout: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: expected a rate in [0, 1), got {dropout!r}")
        self.hidden, self.activation_name, self.dropout = hidden, activation, dropout
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
            self.drop = keras.layers.Dropout(self.dropout) if self.dropout else None
        h = self.activation(self.first(inputs, extra))
        for layer in self.rest + [None]:
            if self.drop is not None:
                h = self.drop(h, training=inputs.training)
            if layer is not None:
                h = layer(h)
        return self.out(h)[:, 0]


class MLP(DenseNet):
    """The XDL paper's model: every feature's pooled embedding (dim 18, sum pooling in the default
    config) concatenated, then 200-80-1. ``label`` defaults to the schema's first label."""

    def __init__(self, hidden=(200, 80), activation="relu", label: str | None = None,
                 dropout: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.hidden = tuple(hidden)
        self.activation_name = activation
        self.label = label
        self.dropout = dropout
        self.tower = _Tower(self.hidden, activation, dropout)

    def forward(self, inputs):
        return {self.label or inputs.label_names[0]: self.tower(inputs)}

    def spec(self):
        return {"name": "mlp", "hidden": list(self.hidden), "activation": self.activation_name,
                "label": self.label, "dropout": self.dropout}


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

    def output_biases(self, outputs) -> dict:
        return {"ctr": self.ctr.out.bias, "cvr": self.cvr.out.bias}

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


def _glorot():
    # A new initializer per weight: each draws its own seed from Keras' seeded generator.
    return keras.initializers.GlorotUniform()


def _widths(xs) -> list:
    return [int(x.shape[-1]) for x in xs]


def _split_matmul(inputs, xs, kernel):
    """``sum_l expand(x_l kernel_l, l)``: ``x0 kernel`` of the leaves' concatenated input, each
    layer's share computed on its own nodes (``kernel_l`` are kernel's rows of layer l)."""
    out, start = None, 0
    for level, x in enumerate(xs):
        width = int(x.shape[-1])
        part = inputs.expand(tf.matmul(x, kernel[start:start + width]), level)
        out = part if out is None else out + part
        start += width
    return out


class DCN(DenseNet):
    """DCN-v2 (Wang et al., WWW 2021): a low-rank cross network in parallel with the MLP tower.

    ``x0`` is a leaf's whole input (every layer's ``concat``, root first: pooled embeddings and
    dense features). Cross layer k computes ``x_{k+1} = x0 * (U_k (V_k^T x_k) + b_k) + x_k``, the
    paper's low-rank form of ``W_k = U_k V_k^T`` (U, V: d x ``rank``); the logit is
    ``w^T x_L`` plus the deep tower's logit (the paper's parallel structure, one output layer
    over ``[x_L, h]``). ``hidden``/``activation`` are the tower's, as MLP.

    Structured compute runs on the nodes whatever is linear in ``x0`` (split by layer and
    gathered, as SplitDense): the first layer's ``V_0^T x0``, and the output of the last layer,
    ``w^T x_L = z . (U_{L-1}^T diag(w) x0) + (w * b_{L-1}) . x0 + w^T x_{L-1}`` with
    ``z = V_{L-1}^T x_{L-1}`` (one matmul per layer's nodes, ``2 rank + 1`` columns, one gather).
    The leaves then run ``2 (L - 1)`` rank-r products of width ``d = len(x0)`` (flat: ``2 L`` of
    them and ``w^T x_L``); with one cross layer nothing of it runs per leaf but a dot product of
    ``rank`` numbers. Flat compute runs the formula as written, so the structured == flat tests
    check this algebra too. Unlike the MLP, layers 1.. of the cross network need ``x0`` itself
    on the leaves ([leaves, d]): measured on taobao_like with trainer/examples/mlp.yaml, a step
    of the defaults costs about 1.7-1.9x the MLP's (one cross layer: about 1.3x).

    The cross terms are polynomials of degree ``cross_layers + 1`` in ``x0``: give dense features
    a transform (``dense: {price: {transform: log1p}}``), raw values in the thousands make them
    overflow.
    """

    def __init__(self, hidden=(200, 80), cross_layers: int = 2, rank: int = 32,
                 activation="relu", label: str | None = None, **kwargs):
        super().__init__(**kwargs)
        for name, value in (("cross_layers", cross_layers), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DCN {name}: expected a positive integer, got {value!r}")
        self.hidden = tuple(hidden)
        self.cross_layers, self.rank = cross_layers, rank
        self.activation_name, self.label = activation, label
        self.tower = _Tower(self.hidden, activation)
        self.cross_v = None

    def _build_cross(self, width: int):
        # Made at the first call, after the trainer seeded Keras; one fixed order.
        self.cross_v, self.cross_u, self.cross_b = [], [], []
        for k in range(self.cross_layers):
            self.cross_v.append(self.add_weight(shape=(width, self.rank), name=f"cross_v_{k}",
                                                initializer=_glorot()))
            self.cross_u.append(self.add_weight(shape=(self.rank, width), name=f"cross_u_{k}",
                                                initializer=_glorot()))
            self.cross_b.append(self.add_weight(shape=(width,), name=f"cross_b_{k}",
                                                initializer="zeros"))
        self.cross_out = self.add_weight(shape=(width, 1), name="cross_out",
                                         initializer=_glorot())

    def forward(self, inputs):
        xs = [inputs.concat(level) for level in range(inputs.levels)]
        if self.cross_v is None:
            self._build_cross(sum(_widths(xs)))
        cross = self._cross_flat(xs) if inputs.flat else self._cross_structured(inputs, xs)
        return {self.label or inputs.label_names[0]: self.tower(inputs) + cross}

    def _cross_flat(self, xs):
        x0 = tf.concat(xs, axis=1) if len(xs) > 1 else xs[0]
        x = x0
        for v, u, b in zip(self.cross_v, self.cross_u, self.cross_b):
            x = x0 * (tf.matmul(tf.matmul(x, v), u) + b) + x
        return tf.matmul(x, self.cross_out)[:, 0]

    def _cross_structured(self, inputs, xs):
        r, last = self.rank, self.cross_layers - 1
        w = self.cross_out[:, 0]
        fold = w[:, None] * tf.transpose(self.cross_u[last])       # [d, r]
        # x0 . (w * b) + (with one layer, where x_{L-1} = x0) x0 . w
        constant = w * (self.cross_b[last] + (1.0 if last == 0 else 0.0))
        per_node = _split_matmul(inputs, xs, tf.concat(
            [self.cross_v[0], fold, constant[:, None]], axis=1))    # [leaves, 2r + 1]
        z, a, c = per_node[:, :r], per_node[:, r:2 * r], per_node[:, 2 * r]
        if last == 0:
            return tf.reduce_sum(z * a, axis=1) + c
        x0 = tf.concat([inputs.expand(x, level) for level, x in enumerate(xs)], axis=1)
        # x_1 = x0 * (z U_0 + b_0 + 1): the bias rides in the matmul as a row against a column
        # of ones, so the leaves run one elementwise pass over [leaves, d] here, not three.
        z = tf.pad(z, [[0, 0], [0, 1]], constant_values=1.0)
        x = x0 * tf.matmul(z, tf.concat([self.cross_u[0], (self.cross_b[0] + 1.0)[None, :]],
                                        axis=0))
        for k in range(1, last):
            x = x0 * (tf.matmul(tf.matmul(x, self.cross_v[k]), self.cross_u[k])
                      + self.cross_b[k]) + x
        # V_{L-1}^T x_{L-1} and w^T x_{L-1} in one matmul
        y = tf.matmul(x, tf.concat([self.cross_v[last], self.cross_out], axis=1))
        return tf.reduce_sum(y[:, :r] * a, axis=1) + c + y[:, r]

    def spec(self):
        return {"name": "dcn", "hidden": list(self.hidden), "cross_layers": self.cross_layers,
                "rank": self.rank, "activation": self.activation_name, "label": self.label}


class DeepFM(DenseNet):
    """DeepFM (Guo et al., IJCAI 2017): linear part + FM second-order part + the MLP tower,
    summed into one logit, all over the same pooled embeddings.

    The FM fields are the ``id`` and ``ids`` features (an ``ids`` list is one field: its pooled
    embedding, as the config pools it); ``FM = 0.5 * sum_k ((sum_f v_f)_k^2 - sum_f v_f,k^2)``,
    so every field needs one embedding dimension (a ValueError at construction of the Trainer
    otherwise). The linear part is ``w^T x0 + b`` over the leaf's whole input (pooled
    embeddings and dense features), a linear layer over the embeddings rather than the paper's
    per-id scalar weights (those would need a table of dimension 1 per feature); the tower's
    output bias is the bias. ``hidden``/``activation`` are the tower's, as MLP.

    Structured compute sums per node of each layer ``s_l = sum_{f in l} v_f`` and
    ``q_l = sum_{f in l} |v_f|^2`` next to that layer's share of the linear part, gathers them to
    the leaves in one gather per layer, and the leaves compute
    ``0.5 |sum_l s_l|^2 - 0.5 sum_l q_l`` (d + 1 numbers per leaf and layer). Flat compute runs
    the textbook formula over the stacked fields.
    """

    def __init__(self, hidden=(200, 80), activation="relu", label: str | None = None,
                 **kwargs):
        super().__init__(**kwargs)
        self.hidden = tuple(hidden)
        self.activation_name, self.label = activation, label
        self.tower = _Tower(self.hidden, activation)
        self.linear = None

    @staticmethod
    def field_dim(layout) -> int:
        """The one embedding dimension of the FM fields (0 without any id/ids feature)."""
        dims = sorted({b.dim for b in layout.blocks})
        if len(dims) > 1:
            by_dim = {}
            for table, dim in sorted(layout.dims.items()):
                by_dim.setdefault(dim, []).append(table)
            found = "; ".join(f"dim {d}: {', '.join(t)}" for d, t in sorted(by_dim.items()))
            raise ValueError(f"DeepFM: the FM term needs one embedding dimension for every "
                             f"id/ids feature, the tables have several ({found}); give every "
                             "table the same dim (embedding.dim, tables.<table>.dim)")
        return dims[0] if dims else 0

    def forward(self, inputs):
        dim = self.field_dim(inputs.layout)
        xs = [inputs.concat(level) for level in range(inputs.levels)]
        # canonical order: one dimension, so each layer's fields are its first columns
        fields = [sum(len(b.ids) + len(b.lists) for b in inputs.layout.layer_blocks(level))
                  for level in range(inputs.levels)]
        if self.linear is None:  # made at the first call, after the trainer seeded Keras
            self.linear = self.add_weight(shape=(sum(_widths(xs)), 1), name="linear",
                                          initializer="zeros")
        if inputs.flat:
            x0 = tf.concat(xs, axis=1) if len(xs) > 1 else xs[0]
            logit = tf.matmul(x0, self.linear)[:, 0]
            if dim:
                v = tf.concat([tf.reshape(x[:, :n * dim], [-1, n, dim])
                               for x, n in zip(xs, fields) if n], axis=1)   # [leaves, F, d]
                s, q = tf.reduce_sum(v, axis=1), tf.reduce_sum(v * v, axis=1)
                logit += 0.5 * tf.reduce_sum(s * s - q, axis=1)
        else:
            total, start = None, 0
            for level, (x, n) in enumerate(zip(xs, fields)):
                width = int(x.shape[-1])
                part = tf.matmul(x, self.linear[start:start + width])      # [nodes, 1]
                start += width
                if dim:
                    e = x[:, :n * dim]
                    s = (tf.reduce_sum(tf.reshape(e, [-1, n, dim]), axis=1) if n
                         else tf.zeros([tf.shape(x)[0], dim], x.dtype))
                    q = tf.reduce_sum(e * e, axis=1, keepdims=True)
                    part = tf.concat([s, part - 0.5 * q], axis=1)          # [nodes, d + 1]
                part = inputs.expand(part, level)
                total = part if total is None else total + part
            s = total[:, :dim]
            logit = total[:, dim] + 0.5 * tf.reduce_sum(s * s, axis=1)
        return {self.label or inputs.label_names[0]: self.tower(inputs) + logit}

    def spec(self):
        return {"name": "deepfm", "hidden": list(self.hidden),
                "activation": self.activation_name, "label": self.label}


class _Outputs(dict):
    """A forward pass's logits per head, with the auxiliary loss of the same pass (what the
    model's ``loss`` adds; 0 when the pass computed none)."""

    aux_loss = 0.0


class DIEN(DenseNet):
    """Deep Interest Evolution Network (Zhou et al., AAAI 2019), then the MLP.

    The ``behaviour`` feature is an ordered sequence (the schema declares it ``sequence``;
    oldest first, cut to its ``max_length`` most recent items by the feed) of an upper layer,
    e.g. the user's ``clicked_cats``; ``query`` is an id of a lower layer, e.g. the ad's
    ``cate_id``, best in the same table as the behaviours. Three stages, each computed on the
    nodes of the layer it depends on:

    * **interest extractor**, once per node of the behaviour's layer (per user, not per
      sample): a GRU of ``gru_units`` over the behaviours' embeddings, and its **auxiliary
      loss**: each state ``h_t`` must tell the next behaviour ``e_{t+1}`` from a negative, the
      behaviour half a sequence away (``(t + 1 + len // 2) mod len``, so the same negatives
      per user node and per leaf; a negative with the positive's embedding is skipped), by a
      small MLP (``aux_hidden``) on ``[h_t, e]``. Its loss is the mean over a sequence's pairs,
      averaged over the leaves (each user node weighs its samples), times ``aux_weight``;
    * **interest evolution**, once per node of the query's layer (per ad): attention scores
      ``softmax_t(h_t W q)`` over the sequence's items, and an AUGRU of ``gru_units`` over the
      interest states whose update gate is scaled by the score; its last state is the evolved
      interest;
    * the **MLP** per leaf, the evolved interest joining the query layer's inputs of the first
      dense layer (as DIN's interest vector).

    Flat compute runs the same on every leaf (each leaf's copy of the user's sequence).
    """

    def __init__(self, behaviour: str = "clicked_cats", query: str = "cate_id",
                 hidden=(200, 80), gru_units: int = 36, aux_hidden=(36,),
                 aux_weight: float = 1.0, activation="relu", label: str | None = None,
                 **kwargs):
        super().__init__(**kwargs)
        if isinstance(gru_units, bool) or not isinstance(gru_units, int) or gru_units < 1:
            raise ValueError(f"DIEN gru_units: expected a positive integer, got {gru_units!r}")
        if isinstance(aux_weight, bool) or not isinstance(aux_weight, (int, float)) or not (
                aux_weight >= 0):
            raise ValueError(f"DIEN aux_weight: expected a number >= 0, got {aux_weight!r}")
        self.behaviour, self.query = behaviour, query
        self.hidden, self.aux_hidden = tuple(hidden), tuple(aux_hidden)
        self.gru_units, self.aux_weight = gru_units, float(aux_weight)
        self.activation_name, self.label = activation, label
        self.extractor = self.attention_kernel = None
        self.tower = _Tower(self.hidden, activation)

    def check(self, schema):
        """Raise ValueError unless the schema has the behaviour sequence and the query."""
        for role, name, kind in (("behaviour", self.behaviour, "ids"),
                                 ("query", self.query, "id")):
            if name not in schema._by_name or schema.feature(name).kind != kind:
                raise ValueError(f"DIEN {role}={name!r}: the schema needs an {kind!r} feature of "
                                 f"that name; pass DIEN({role}=<feature>)")
        if schema.feature(self.behaviour).sequence is None:
            raise ValueError(f"DIEN behaviour={self.behaviour!r}: the schema must declare it an "
                             f"ordered sequence (`{{name: {self.behaviour}, kind: ids, sequence: "
                             "true}`, optionally with max_length and time): DIEN reads the "
                             "order of the behaviours")
        if schema.layer_index(self.behaviour) > schema.layer_index(self.query):
            raise ValueError(f"DIEN: behaviour {self.behaviour!r} must be on the query's layer "
                             f"or above it, not below {self.query!r}")

    def forward(self, inputs):
        first = self.extractor is None
        if first:  # made at the first call, after the trainer seeded Keras; one fixed order
            self.extractor, self.evolver = GRU(self.gru_units), GRU(self.gru_units)
            self.aux = [keras.layers.Dense(u, activation="sigmoid")
                        for u in self.aux_hidden] + [keras.layers.Dense(1)]
        schema = inputs.schema
        b_level, q_level = schema.layer_index(self.behaviour), schema.layer_index(self.query)
        sequence = inputs.sequence(self.behaviour)           # [nodes of b_level, None, dim]
        lengths = tf.cast(sequence.row_lengths(), tf.int32)
        x = sequence.to_tensor()
        # at least one step, so that every sequence has a last state (zeros when empty)
        x = tf.pad(x, [[0, 0], [0, tf.maximum(1 - tf.shape(x)[1], 0)], [0, 0]])
        mask = tf.sequence_mask(lengths, tf.shape(x)[1])
        states = self.extractor(x, mask)                     # once per b_level node
        # (the first call builds the auxiliary network's variables, whatever the mode)
        aux_loss = (self._auxiliary_loss(inputs, b_level, x, lengths, mask, states)
                    if (inputs.training or first) and self.aux_weight else 0.0)
        index = inputs.ancestor_index(b_level, q_level)
        if index is not None:                                # to the query's nodes
            states, mask = tf.gather(states, index), tf.gather(mask, index)
        query = inputs.feature(self.query)                   # [nodes of q_level, dim]
        if self.attention_kernel is None:
            self.attention_kernel = self.add_weight(
                shape=(self.gru_units, int(query.shape[-1])), name="attention",
                initializer=keras.initializers.GlorotUniform())
        scores = tf.einsum("ntk,kd,nd->nt", states, self.attention_kernel, query)
        scores = tf.where(mask, scores, tf.fill(tf.shape(scores), -1e9))
        weights = tf.nn.softmax(scores, axis=1) * tf.cast(mask, scores.dtype)
        interest = self.evolver(states, mask, attention=weights)[:, -1, :]   # per q node
        outputs = _Outputs({self.label or inputs.label_names[0]:
                            self.tower(inputs, extra={q_level: [interest]})})
        outputs.aux_loss = aux_loss
        return outputs

    def _auxiliary_loss(self, inputs, b_level, x, lengths, mask, states):
        """The next-behaviour loss per node of the behaviour's layer, averaged over the leaves
        (a node weighs as many times as it has leaves: flat compute's mean)."""
        steps = tf.shape(x)[1]
        h = states[:, :-1, :]                                 # h_t, t < steps - 1
        positive = x[:, 1:, :]                                # e_{t+1}
        valid = mask[:, 1:]
        t = tf.range(1, steps)[None, :]
        length = tf.maximum(lengths, 1)[:, None]
        negative = tf.gather(x, (t + length // 2) % length, batch_dims=1)
        distinct = tf.reduce_any(tf.not_equal(negative, positive), axis=2)
        valid_f = tf.cast(valid, x.dtype)
        negative_f = tf.cast(valid & distinct, x.dtype)

        def logit(e):
            out = tf.concat([h, e], axis=2)
            for layer in self.aux:
                out = layer(out)
            return out[:, :, 0]

        loss = (valid_f * tf.nn.sigmoid_cross_entropy_with_logits(
                    labels=tf.ones_like(valid_f), logits=logit(positive))
                + negative_f * tf.nn.sigmoid_cross_entropy_with_logits(
                    labels=tf.zeros_like(valid_f), logits=logit(negative)))
        pairs = tf.cast(tf.maximum(lengths - 1, 1), x.dtype)
        per_node = tf.reduce_sum(loss, axis=1) / pairs
        leaves = tf.cast(inputs.num_leaves, x.dtype)
        index = inputs.ancestor_index(b_level, inputs.levels - 1)
        if index is None:
            return tf.reduce_sum(per_node) / leaves
        counts = tf.math.unsorted_segment_sum(tf.ones_like(index, x.dtype), index,
                                              tf.shape(per_node)[0])
        return tf.reduce_sum(per_node * counts) / leaves

    def loss(self, outputs, labels):
        """The click log loss plus ``aux_weight`` times the auxiliary loss of the forward
        pass that gave ``outputs`` (none outside training)."""
        return (super().loss(outputs, labels)
                + self.aux_weight * getattr(outputs, "aux_loss", 0.0))

    def spec(self):
        return {"name": "dien", "behaviour": self.behaviour, "query": self.query,
                "hidden": list(self.hidden), "gru_units": self.gru_units,
                "aux_hidden": list(self.aux_hidden), "aux_weight": self.aux_weight,
                "activation": self.activation_name, "label": self.label}


MODELS = {"mlp": MLP, "din": DIN, "esmm": ESMM, "dcn": DCN, "deepfm": DeepFM, "dien": DIEN}


def from_spec(spec: dict) -> DenseNet:
    """The built-in model a ``spec()`` describes."""
    spec = dict(spec)
    name = spec.pop("name")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; built-in models are {', '.join(MODELS)}")
    return MODELS[name](**spec)
