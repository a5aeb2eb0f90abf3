"""Metrics of predicted probabilities (exact AUC, log loss, a streaming AUC for progress) and
of online runs (rates, arrival-to-export delays)."""

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


# The steady rate (from the end of the first unit to the end of the last) leaves start-up out
# (group join, tracing, the first poll). It says something about the run only when it covers
# several units and most of the run: over one or two units it is the speed of one poll's worth
# of training between two polls (a 100k-sample demo read "269,305 samples/s steady" from 0.19 s
# of a 5.8 s run that trained 17,176 samples/s). Below these, the headline is the whole run's.
STEADY_MIN_UNITS = 4      # units trained after the first one
STEADY_MIN_SHARE = 0.5    # of the run's seconds


def run_rates(samples: int, seconds: float, units: int, first_unit: float | None,
              last_unit: float | None, first_unit_samples: int) -> dict:
    """An online run's training rates: ``samples_per_sec`` over the whole run,
    ``steady_samples_per_sec`` from the end of its first unit (a poll's batches in process, a
    step on Ray; ``first_unit``/``last_unit``: monotonic times the first and latest ended)
    to the end of the latest, and ``rate``, the headline: the steady one when it covers
    enough of the run (``STEADY_MIN_UNITS``, ``STEADY_MIN_SHARE``), else the whole run's.

    A stopped run's final export and checkpoint are not in the steady rate (they are
    shut-down work: ~2 s that made a 500k-sample run read as 0.7x its rate); the periodic
    ones are."""
    steady = ((samples - first_unit_samples) / max(last_unit - first_unit, 1e-9)
              if first_unit is not None else 0.0)
    whole = samples / max(seconds, 1e-9)
    meaningful = (first_unit is not None and units - 1 >= STEADY_MIN_UNITS
                  and last_unit - first_unit >= STEADY_MIN_SHARE * seconds)
    return {"samples_per_sec": round(whole, 1), "steady_samples_per_sec": round(steady, 1),
            "rate": {"samples_per_sec": round(steady if meaningful else whole, 1),
                     "over": "steady" if meaningful else "whole run"}}


class DelayHistogram:
    """Arrival-to-export delays of every sample of a run in constant memory: 10 ms buckets up
    to 10 minutes (longer delays count in the last bucket), percentiles to within 10 ms."""

    BUCKET_MS = 10
    BUCKETS = 60_000

    def __init__(self):
        self.counts = np.zeros(self.BUCKETS, np.int64)

    def add(self, delays_ms: np.ndarray) -> None:
        buckets = np.clip(np.asarray(delays_ms) // self.BUCKET_MS, 0, self.BUCKETS - 1)
        self.counts += np.bincount(buckets.astype(np.int64), minlength=self.BUCKETS)

    def percentiles(self) -> dict:
        """``{"p50": s, "p99": s}`` (upper bucket edges, in seconds); None before any sample."""
        total = int(self.counts.sum())
        if total == 0:
            return {"p50": None, "p99": None}
        cumulative = np.cumsum(self.counts)
        return {name: float(np.searchsorted(cumulative, q * total) + 1) * self.BUCKET_MS / 1000
                for name, q in (("p50", 0.5), ("p99", 0.99))}
