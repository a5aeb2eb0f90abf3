"""The TensorFlow side of a step: pooling per node, the DenseNet, losses and gradients.

Structured and flat compute run the same DenseNet with the same variables; they differ only in
what the feed holds (nodes of each layer, or everything expanded to the leaves) and in what
``Inputs.expand`` does (a gather through the indicators, or nothing).
"""

from __future__ import annotations

import copy

import numpy as np
import tensorflow as tf

import native
from compression import LayerBatch, TreeBatch
from trainer.config import DenseConfig
from trainer.feed import FeedBuilder, Layout


def sorted_segment_sum(values, segments, num_segments):
    """``unsorted_segment_sum`` for non-decreasing ``segments``: TensorFlow's sorted kernel is
    several times faster on CPU when many rows go to few segments (measured here: 150k x 18
    values into 5,000 lists, 4.6 ms against 25 ms)."""
    summed = tf.math.segment_sum(values, segments)
    return tf.pad(summed, [[0, num_segments - tf.shape(summed)[0]], [0, 0]])


@tf.custom_gradient
def take(x, index):
    """XDL's take: ``x[index]`` for a non-decreasing ``index`` (an indicator in tree order);
    its gradient sums the rows back per node with the sorted segment sum."""
    def grad(dy):
        return sorted_segment_sum(dy, index, tf.shape(x)[0]), None
    return tf.gather(x, index), grad


def _row_slices(grad, rows):
    """A rows tensor's gradient as ``(values, indices)``: one gradient row per gathered row,
    not yet summed per row. TensorFlow's sum (``unsorted_segment_sum``, what converting the
    gathers' IndexedSlices to a dense tensor runs) took ~10% of a training step; the trainer sums
    them with ``native.scatter_add_rows`` instead (see :func:`sum_row_slices`)."""
    if grad is None:  # no feature reads these rows
        return tf.zeros([0, rows.shape[1]], rows.dtype), tf.zeros([0], tf.int32)
    if isinstance(grad, tf.IndexedSlices):
        return grad.values, tf.cast(grad.indices, tf.int32)
    return grad, tf.range(tf.shape(grad)[0], dtype=tf.int32)  # a dense gradient: row i is row i


def sum_row_slices(row_slices: dict, rows: dict) -> dict:
    """``{dim: float32[rows, dim]}``: the slices of :func:`_row_slices` summed per row."""
    return {d: native.scatter_add_rows(values.numpy(), indices.numpy(), rows[d].shape[0])
            for d, (values, indices) in row_slices.items()}


class Inputs:
    """What a DenseNet's ``forward`` receives, per layer of the tree.

    ``concat(l)`` is layer l's input to the first dense layer on its nodes ``[size_l, d_l]``:
    the pooled embeddings and dense features in the layout's canonical order (``order(l)``).
    ``feature(name)`` is one feature on its layer's nodes (pooled embedding or dense values).
    ``expand(x, l)`` gathers rows of layer l to the leaves (XDL's take with the indicator);
    ``expand_to(x, l, k)`` gathers them to the nodes of a lower layer k. In flat compute every
    layer's nodes are the leaves already and both are the identity (``flat`` is True).
    ``sequence(name)`` is an ``ids`` feature's unpooled embeddings as a RaggedTensor
    ``[size_l, None, dim]`` (for attention).
    """

    def __init__(self, layout: Layout, feed: dict, flat: bool, training: bool = False):
        self.layout = layout
        self.training = training  # True in a training step (dropout on), False otherwise
        self.schema = layout.schema
        self.flat = flat
        self.levels = layout.levels
        self.label_names = tuple(self.schema.labels)
        self._feed = feed
        self._ids, self._lists, self._concat = {}, {}, {}

    @property
    def num_leaves(self):
        return tf.shape(self._feed["labels"][self.label_names[0]])[0]

    def size(self, level: int):
        return self._feed["sizes"][level]

    def order(self, level: int) -> list[str]:
        names = [n for b in self.layout.layer_blocks(level) for n in b.ids + b.lists]
        return names + list(self.layout.dense.get(level, ()))

    def _rows_at(self, block, positions):
        """The rows at ``positions`` of ``rows[dim]``; a multi-hash block's positions have a
        last axis of 2 (an id's two component rows), combined here element-wise, so both rows
        get the gradient."""
        emb = tf.gather(self._feed["rows"][str(block.dim)], positions)
        if block.combine is None:
            return emb
        first, second = emb[..., 0, :], emb[..., 1, :]
        # product: the remainder row is a multiplicative correction around 1, q * (1 + r), so
        # a fresh table (rows near 0) starts as its Q hashed rows and learns at an ordinary
        # row's speed; q * r of two rows near 0 starts at ~1e-4 with gradients as small
        return first * (1.0 + second) if block.combine == "product" else first + second

    def _block_ids(self, block):
        """[size, n_ids, dim]: one gather for all id features of the block."""
        if block.key not in self._ids:
            self._ids[block.key] = self._rows_at(block, self._feed["ids"][block.key])
        return self._ids[block.key]

    def _block_lists(self, block):
        """[size, n_lists, dim]: every list of the block pooled by one sorted segment sum."""
        if block.key not in self._lists:
            size, n = self.size(block.level), len(block.lists)
            emb = self._rows_at(block, self._feed["values"][block.key])
            pooled = sorted_segment_sum(emb, self._feed["segments"][block.key], n * size)
            pooled = pooled * self._feed["scale"][block.key][:, None]
            pooled = tf.reshape(pooled, [n, size, block.dim])
            self._lists[block.key] = tf.transpose(pooled, [1, 0, 2])
        return self._lists[block.key]

    def concat(self, level: int):
        if level not in self._concat:
            parts = []
            for block in self.layout.layer_blocks(level):
                size = self.size(level)
                if block.ids:
                    parts.append(tf.reshape(self._block_ids(block),
                                            [size, len(block.ids) * block.dim]))
                if block.lists:
                    parts.append(tf.reshape(self._block_lists(block),
                                            [size, len(block.lists) * block.dim]))
            if level in self.layout.dense:
                parts.append(self._feed["dense"][str(level)])
            self._concat[level] = parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)
        return self._concat[level]

    def feature(self, name: str):
        level = self.schema.layer_index(name)
        for block in self.layout.layer_blocks(level):
            if name in block.ids:
                return self._block_ids(block)[:, block.ids.index(name), :]
            if name in block.lists:
                return self._block_lists(block)[:, block.lists.index(name), :]
        start = 0
        for n in self.layout.dense[level]:
            width = self.schema.feature(n).dim
            if n == name:
                return self._feed["dense"][str(level)][:, start:start + width]
            start += width
        raise KeyError(name)

    def layer(self, level: int) -> list:
        return [self.feature(n) for n in self.order(level)]

    def expand(self, x, level: int):
        if self.flat or level == self.levels - 1:
            return x
        index = self._feed["ancestors"][str(level)]
        # A layer with one node per leaf (nothing shared) has the identity as its sorted,
        # onto indicator: skip the gather and its gradient's segment sum.
        return tf.cond(tf.shape(x)[0] == tf.shape(index)[0], lambda: tf.identity(x),
                       lambda: take(x, index))

    def ancestor_index(self, level: int, of_level: int):
        """Per node of layer ``of_level``: its ancestor's index in layer ``level`` (None when
        that is the identity: flat compute, or the same layer)."""
        if self.flat or level == of_level:
            return None
        if of_level == self.levels - 1:
            return self._feed["ancestors"][str(level)]
        index = self._feed["parents"][str(of_level)]
        for below in range(of_level - 1, level, -1):
            index = tf.gather(self._feed["parents"][str(below)], index)
        return index

    def expand_to(self, x, level: int, to_level: int):
        index = self.ancestor_index(level, to_level)
        return x if index is None else take(x, index)

    def sequence(self, name: str) -> tf.RaggedTensor:
        level = self.schema.layer_index(name)
        block = next(b for b in self.layout.layer_blocks(level) if name in b.lists)
        start = 0
        for other in block.lists[:block.lists.index(name)]:
            start += self._feed["splits"][other][-1]
        splits = self._feed["splits"][name]
        values = self._feed["values"][block.key][start:start + splits[-1]]
        emb = self._rows_at(block, values)
        return tf.RaggedTensor.from_row_splits(emb, splits, validate=False)


def feed_signature(layout: Layout, structured: bool) -> dict:
    """The ``tf.TensorSpec`` structure of a feed; every node count is ``None`` so that one trace
    serves every batch."""
    f32, i32 = tf.float32, tf.int32
    schema = layout.schema
    spec = {
        "rows": {str(d): tf.TensorSpec([None, d], f32) for d in layout.row_dims},
        # a multi-hash block's positions have a last axis of 2 (an id's two component rows)
        "ids": {b.key: tf.TensorSpec([None, len(b.ids)] + ([2] if b.combine else []), i32)
                for b in layout.blocks if b.ids},
        "values": {b.key: tf.TensorSpec([None] + ([2] if b.combine else []), i32)
                   for b in layout.blocks if b.lists},
        "segments": {b.key: tf.TensorSpec([None], i32) for b in layout.blocks if b.lists},
        "scale": {b.key: tf.TensorSpec([None], f32) for b in layout.blocks if b.lists},
        "splits": {n: tf.TensorSpec([None], i32) for b in layout.blocks for n in b.lists},
        "dense": {str(l): tf.TensorSpec([None, layout.dense_width(l)], f32)
                  for l in layout.dense},
        "sizes": tf.TensorSpec([layout.levels], i32),
        "labels": {name: tf.TensorSpec([None], f32) for name in schema.labels},
    }
    if structured:
        spec["ancestors"] = {str(l): tf.TensorSpec([None], i32) for l in range(layout.levels - 1)}
        spec["parents"] = {str(l): tf.TensorSpec([None], i32) for l in range(1, layout.levels)}
    return spec


class _ZeroStore:
    """Stands in for a store when building variables: every id reads as a zero row."""

    def __init__(self, dim):
        self.dim = dim

    def lookup_unique(self, ids, train):
        return (np.zeros(1, np.int64), np.zeros(len(ids), np.int64),
                np.zeros((1, self.dim), np.float32))

    def contains(self, ids):
        return np.zeros(len(ids), bool)


def dummy_feed(layout: Layout, structured: bool) -> dict:
    """A one-sample feed (one node per layer, one value per list) to build the variables."""
    layers = []
    for level, layer in enumerate(layout.schema.layers):
        features = {}
        for f in layer.features:
            if f.kind == "id":
                features[f.name] = np.zeros(1, np.int64)
            elif f.kind == "ids":
                features[f.name] = (np.zeros(1, np.int64), np.array([0, 1], np.int32))
            else:
                features[f.name] = np.zeros((1, f.dim), np.float32)
        parent = None if level == 0 else np.zeros(1, np.int32)
        layers.append(LayerBatch(layer.name, 1, parent, features))
    batch = TreeBatch(layers, {name: np.zeros(1, np.float32) for name in layout.schema.labels})
    layout = copy.copy(layout)  # zeros need no dense statistics
    layout.dense_configs = {n: DenseConfig("none", False) for n in layout.dense_configs}
    builder = FeedBuilder(layout, structured)
    stores = {t: _ZeroStore(layout.dims[t]) for t in layout.tables}
    return builder.lookup(builder.prepare(batch), stores, train=False).feed


class FlatCall:
    """Calls a ``tf.function`` of one feed argument through its concrete function's flat-input
    entry point. A ``tf.function`` call binds and checks its arguments against the signature in
    Python first: measured here, 1.9 ms per call with the 18 tensors of a feed (a step takes
    25-40 ms, on the training thread), against 0.2 ms for the flat call. The feed builder makes
    every feed of the signature's structure and dtypes; the structure is still checked here."""

    def __init__(self, function):
        self.function = function
        self._concrete = None
        self._specs = tf.nest.flatten(function.input_signature[0])

    def trace(self):
        """Trace the function now instead of in its first call (see ``Trainer.trace``)."""
        if self._concrete is None:
            self._concrete = self.function.get_concrete_function()
            if not hasattr(self._concrete, "_call_flat"):  # another TensorFlow: the slow path
                self._concrete = False

    def __call__(self, feed):
        self.trace()
        if self._concrete is False:
            return self.function(feed)
        tf.nest.assert_same_structure(feed, self.function.input_signature[0])
        flat = [tf.convert_to_tensor(x, spec.dtype)
                for x, spec in zip(tf.nest.flatten(feed), self._specs)]
        return self._concrete._call_flat(flat, self._concrete.captured_inputs)


class Network:
    """The DenseNet, its Keras optimizer and the compiled step functions of one compute mode.

    ``train_step(feed)``: the step of the in-process trainer (the dense update inside it);
    ``train_rows_step``: the same without touching the dense weights; ``predict_step``;
    ``gradients(feed)``: the loss, the dense gradients (zeros for a variable the loss does not
    reach), the rows' gradient slices and the probabilities, applying nothing (a distributed
    worker sums the dense gradients over workers, then calls ``apply_dense(grads)``)."""

    def __init__(self, layout: Layout, model, dense_optimizer, structured: bool):
        self.layout = layout
        self.model = model
        self.optimizer = dense_optimizer
        self.structured = structured
        self.signature = feed_signature(layout, structured)
        # Build every variable eagerly, in a fixed order, before anything is traced.
        self._forward(dummy_feed(layout, structured))
        self.variables = list(model.trainable_variables)
        self.optimizer.build(self.variables)
        self._compile()

    def _compile(self) -> None:
        """The step functions (traced lazily, in their first call)."""
        signature = [self.signature]
        self.predict_step = FlatCall(tf.function(self.predict_outputs, input_signature=signature))
        if self.optimizer is None:  # a serving twin: predictions only
            return
        self.train_step = FlatCall(tf.function(self._train_step, input_signature=signature))
        # A step that trains the rows only (the dense weights and their optimizer untouched):
        # the passes after ``TrainConfig.dense_epochs``.
        self.train_rows_step = FlatCall(tf.function(self._train_rows_step,
                                                     input_signature=signature))
        self.gradients = FlatCall(tf.function(self._gradients, input_signature=signature))
        # through the flat entry point too: a worker calls it every step with one array per
        # variable, and the binding of a plain tf.function call cost more than the update
        self.apply_dense = FlatCall(tf.function(self._apply_dense, input_signature=[
            [tf.TensorSpec(v.shape, v.dtype) for v in self.variables]]))

    def structured_twin(self) -> "Network":
        """This network in structured compute: the same model and variables, predictions only
        (what a serving export traces, whatever mode training ran in)."""
        if self.structured:
            return self
        twin = copy.copy(self)
        twin.structured, twin.optimizer = True, None
        twin.signature = feed_signature(self.layout, True)
        twin._compile()
        return twin

    def outputs(self, feed) -> dict:
        """The model's outputs (logits per head) on ``feed``, eagerly, not training."""
        return self._forward(feed)

    def _forward(self, feed, training: bool = False):
        return self.model.forward(Inputs(self.layout, feed, flat=not self.structured,
                                         training=training))

    def loss_and_grads(self, feed, dense_too: bool = True):
        rows = feed["rows"]
        with tf.GradientTape() as tape:
            tape.watch(list(rows.values()))
            outputs = self._forward(feed, training=True)
            loss = self.model.loss(outputs, feed["labels"])
        dims = list(rows)
        variables = self.variables if dense_too else []
        grads = tape.gradient(loss, variables + [rows[d] for d in dims])
        dense = grads[:len(variables)]
        row_grads = {}
        for d, g in zip(dims, grads[len(variables):]):
            row_grads[d] = _row_slices(g, rows[d])
        return loss, outputs, dense, row_grads

    def _train_step(self, feed):
        loss, outputs, dense, row_grads = self.loss_and_grads(feed)
        self.optimizer.apply_gradients(zip(dense, self.variables))
        return loss, row_grads, self.model.probabilities(outputs)

    def _train_rows_step(self, feed):
        loss, outputs, _, row_grads = self.loss_and_grads(feed, dense_too=False)
        return loss, row_grads, self.model.probabilities(outputs)

    def _gradients(self, feed):
        loss, outputs, dense, row_grads = self.loss_and_grads(feed)
        dense = [tf.zeros_like(v) if g is None else g for g, v in zip(dense, self.variables)]
        return loss, dense, row_grads, self.model.probabilities(outputs)

    def _apply_dense(self, grads):
        self.optimizer.apply_gradients(zip(grads, self.variables))
        return tf.constant(0)

    def predict_outputs(self, feed):
        outputs = self._forward(feed)
        return self.model.loss(outputs, feed["labels"]), self.model.probabilities(outputs)
