"""The field's floor for a CTR model, in numpy: hashed one-hot logistic regression.

Every id (and every item of an ``ids`` list) becomes the token (feature, value), hashed into
``2**bits`` weights; dense features are standardized and log1p-ed when heavy-tailed, as the
trainer does. Fitted by full-batch Adagrad on the mean log loss plus an L2 penalty, with the
penalty picked on the last fifth of the training rows (never on the test rows), with which
that model is kept. Tests train it
on the same split as the trainer, so a drop in the trainer's learning turns them red.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from schemas import Schema, stable_hash
from trainer.metrics import auc

_M = np.uint64(0x9E3779B97F4A7C15)


def _ids(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    values = column.to_pylist() if pa.types.is_string(column.type) or pa.types.is_large_string(
        column.type) else None
    if values is not None:
        return np.array([stable_hash(v) for v in values], np.int64)
    return np.asarray(column.to_numpy(zero_copy_only=False), np.int64)


class HashedLogisticRegression:
    def __init__(self, schema: Schema, bits: int = 16):
        self.schema = schema
        self.size = 1 << bits
        self.dense_stats: dict = {}

    # -- features --------------------------------------------------------------------------

    def _tokens(self, table: pa.Table):
        """(row, column) pairs of the one-hot part and the dense matrix."""
        n = table.num_rows
        rows, cols = [], []
        for j, f in enumerate(self.schema.features):
            if f.kind == "dense":
                continue
            column = table.column(f.name)
            if f.kind == "id":
                row, ids = np.arange(n), _ids(column)
            else:
                column = column.combine_chunks()
                lengths = np.diff(np.asarray(column.offsets))
                row, ids = np.repeat(np.arange(n), lengths), _ids(column.values)
            salt = np.uint64(stable_hash(f.name) & 0x7FFFFFFFFFFFFFFF)
            h = (ids.astype(np.uint64) ^ salt) * _M
            h ^= h >> np.uint64(29)
            rows.append(row)
            cols.append((h % np.uint64(self.size)).astype(np.int64))
        dense = []
        for f in self.schema.features:
            if f.kind != "dense":
                continue
            x = np.asarray(table.column(f.name).combine_chunks().flatten(), np.float64).reshape(n, -1)
            if f.name not in self.dense_stats:
                heavy = x.min() >= 0 and np.percentile(x, 99) > 10 * max(np.median(x), 1e-12)
                t = np.log1p(x) if heavy else x
                self.dense_stats[f.name] = (heavy, t.mean(0), t.std(0) + 1e-9)
            heavy, mu, sd = self.dense_stats[f.name]
            dense.append(((np.log1p(x) if heavy else x) - mu) / sd)
        dense = np.concatenate(dense, axis=1) if dense else np.zeros((n, 0))
        return np.concatenate(rows), np.concatenate(cols), dense

    # -- fitting ---------------------------------------------------------------------------

    @staticmethod
    def _fit(rows, cols, dense, y, size, l2, iterations, lr=0.5):
        n = len(y)
        w = np.zeros(size)
        v = np.zeros(dense.shape[1])
        b = np.log(max(y.mean(), 1e-6) / max(1 - y.mean(), 1e-6))
        acc_w, acc_v, acc_b = np.full(size, 1e-8), np.full(len(v), 1e-8), 1e-8
        for _ in range(iterations):
            z = np.bincount(rows, w[cols], minlength=n) + dense @ v + b
            g = (1.0 / (1.0 + np.exp(-z)) - y) / n
            gw = np.bincount(cols, g[rows], minlength=size) + l2 * w
            gv = dense.T @ g + l2 * v
            gb = g.sum()
            acc_w += gw * gw
            acc_v += gv * gv
            acc_b += gb * gb
            w -= lr * gw / np.sqrt(acc_w)
            v -= lr * gv / np.sqrt(acc_v)
            b -= lr * gb / np.sqrt(acc_b)
        return w, v, b

    def fit(self, table: pa.Table, label: str, l2_grid=(1e-3, 1e-2),
            iterations: int = 150) -> "HashedLogisticRegression":
        """Fit on the first four fifths of ``table`` with each penalty of ``l2_grid`` and keep
        the model that scores the best AUC on the last fifth."""
        y = np.asarray(table.column(label).to_numpy(zero_copy_only=False), np.float64)
        cut = table.num_rows * 4 // 5
        fit_part, check_part = table.slice(0, cut), table.slice(cut)
        parts = self._tokens(fit_part)
        check = self._tokens(check_part)
        best = None
        for l2 in l2_grid:
            w, v, b = self._fit(*parts, y[:cut], self.size, l2, iterations)
            self.w, self.v, self.b = w, v, b
            score = auc(self._score(*check, check_part.num_rows), y[cut:])
            if best is None or score > best[0]:
                best = (score, l2, w, v, b)
        _, self.l2, self.w, self.v, self.b = best
        return self

    def _score(self, rows, cols, dense, n):
        return np.bincount(rows, self.w[cols], minlength=n) + dense @ self.v + self.b

    def predict(self, table: pa.Table) -> np.ndarray:
        z = self._score(*self._tokens(table), table.num_rows)
        return 1.0 / (1.0 + np.exp(-z))
