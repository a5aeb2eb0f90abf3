"""Metrics of predicted probabilities: exact AUC, log loss, and a streaming AUC for progress."""

from __future__ import annotations

import numpy as np

_EPS = 1e-7


def auc(scores, labels) -> float:
    """Exact area under the ROC curve (rank-sum, ties get their average rank); NaN with one
    class. Labels are positive when > 0.5."""
    scores = np.asarray(scores, np.float64).ravel()
    positive = np.asarray(labels).ravel() > 0.5
    pos = int(positive.sum())
    neg = len(positive) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ordered = scores[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], len(ordered)]
    ranks = np.empty(len(ordered))
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return float((ranks[positive].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def logloss(probabilities, labels) -> float:
    p = np.clip(np.asarray(probabilities, np.float64).ravel(), _EPS, 1 - _EPS)
    y = np.asarray(labels, np.float64).ravel()
    if len(y) == 0:
        return float("nan")
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


class StreamingAUC:
    """AUC over everything added so far from a histogram of ``bins`` probability buckets:
    constant memory, accurate to about 1/bins (for the progress bar and TensorBoard)."""

    def __init__(self, bins: int = 10_000):
        self.bins = bins
        self.pos = np.zeros(bins, np.int64)
        self.neg = np.zeros(bins, np.int64)

    def add(self, probabilities, labels) -> None:
        bucket = np.clip((np.asarray(probabilities) * self.bins).astype(np.int64), 0,
                         self.bins - 1)
        positive = np.asarray(labels) > 0.5
        self.pos += np.bincount(bucket[positive], minlength=self.bins)
        self.neg += np.bincount(bucket[~positive], minlength=self.bins)

    def result(self) -> float:
        pos, neg = self.pos.sum(), self.neg.sum()
        if pos == 0 or neg == 0:
            return float("nan")
        # negatives below each bucket, plus half of the ties within it
        below = np.cumsum(self.neg) - self.neg
        return float((self.pos * (below + 0.5 * self.neg)).sum() / (pos * neg))

    def reset(self) -> None:
        self.pos[:] = 0
        self.neg[:] = 0


def evaluation(probabilities: dict, labels: dict, loss_sum: float, n: int,
               seconds: float) -> dict:
    """An evaluation's dict: ``{"samples", "loss", "seconds", "samples_per_sec", "auc",
    "logloss", "auc/<label>", "logloss/<label>", ...}`` from every head's joined
    ``probabilities`` and ``labels`` (arrays per label) and the summed loss of ``n`` samples;
    ``auc`` and ``logloss`` are the first head's."""
    out = {"samples": n, "loss": loss_sum / max(n, 1), "seconds": seconds,
           "samples_per_sec": n / max(seconds, 1e-9)}
    for i, (name, p) in enumerate(probabilities.items()):
        out[f"auc/{name}"] = auc(p, labels[name])
        out[f"logloss/{name}"] = logloss(p, labels[name])
        if i == 0:
            out["auc"], out["logloss"] = out[f"auc/{name}"], out[f"logloss/{name}"]
    return out


class ProgressiveValidation:
    """AUC and log loss of predictions made before the samples were trained on: a streaming
    AUC (constant memory, within ~1/10,000) and the mean log loss."""

    def __init__(self):
        self.auc = StreamingAUC()
        self.logloss_sum = 0.0
        self.samples = 0

    def add(self, probabilities: np.ndarray, labels: np.ndarray) -> None:
        n = len(labels)
        if n:
            self.auc.add(probabilities, labels)
            self.logloss_sum += logloss(probabilities, labels) * n
            self.samples += n

    def result(self) -> dict:
        """``{"auc", "logloss", "samples"}``; AUC None while only one class was seen, both None
        before any sample."""
        value = self.auc.result() if self.samples else float("nan")
        return {"auc": None if np.isnan(value) else round(value, 6),
                "logloss": (round(self.logloss_sum / self.samples, 6) if self.samples
                            else None),
                "samples": self.samples}

    def reset(self) -> None:
        self.auc.reset()
        self.logloss_sum = 0.0
        self.samples = 0
