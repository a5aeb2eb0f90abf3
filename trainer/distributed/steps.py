"""The synchronous step on Ray and its one scheduler, for batch passes and online runs.

A step is two hops on its critical path: every worker's ``train_step`` (on the rows its
shards looked up), then every shard's ``step`` (apply the step's row gradients and, unless
the pipeline drains, look the workers' next batches up in the same call). The dense update
travels between the workers: each worker applies the others' messages (``apply_dense``), or,
deferred, at the start of its next ``train_step``.

:class:`StepScheduler` submits these calls step after step. Ray runs an actor's calls in the
order one caller submitted them, so a shard applies step k before it looks up step k+1, in the
same call. A batch pass (:meth:`DistributedTrainer.fit`) keeps two steps in flight and ends
with its data; an online run (``OnlineDistributedTrainer.online_steps``) keeps one in flight
(whether it may pause depends on the results of the step before) and defers the dense update
to the next ``train_step``; both drain the pipeline before a pause.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray

from trainer import fitting


def refs(value, n: int) -> list:
    """``num_returns=n`` gives a single ref for n == 1, a list otherwise."""
    return [value] if n == 1 else list(value)


def lookup(shards: list, request_refs, train: bool) -> list:
    """Every shard's rows for every worker: ``[shard][worker]`` refs. ``request_refs``:
    ``[worker][shard]`` refs of the workers' requests."""
    W = len(request_refs)
    return [refs(shard.lookup.options(num_returns=W).remote(
        train, *[request_refs[w][s] for w in range(W)]), W)
        for s, shard in enumerate(shards)]


def next_batches(workers: list, shards: int, stream: str, dense_refs=None) -> list:
    """Every worker takes its next batch of ``stream``: per worker, its metadata's ref and its
    requests to the ``shards`` shards."""
    dense_refs = list(dense_refs or [])
    return [refs(w.next_step.options(num_returns=shards + 1).remote(
        stream, len(dense_refs), *dense_refs), shards + 1) for w in workers]


def submit_step(workers: list, shards: list, step: int, mean: bool, rows, lookup_next: bool,
                *, row_l2_scale: float, dense: bool, dense_before=None,
                apply_dense: bool = True) -> dict:
    """Submit training step ``step``: every worker's ``train_step`` on ``rows``
    (``[shard][worker]`` refs), a dense update of every worker right after it (it runs while
    the shards work), and every shard's ``step``: apply this step's row gradients and, with
    ``lookup_next``, look the workers' next batches up. ``dense``: whether the step trains the
    dense network. Returns the refs: ``results`` (per worker), ``applied`` (rows expired, per
    shard), ``dense_applied``, ``messages`` (``[worker][shard]``: gradients and next
    requests), ``next_rows`` (``[shard][worker]``; None without ``lookup_next``) and
    ``dense`` (per worker, its dense message).

    Without ``apply_dense`` the dense update is left to the caller (``dense_applied`` is
    empty): it passes ``dense`` as the next step's ``dense_before``, and each worker applies
    it at the start of that step's ``train_step``, which saves an actor call per worker and
    step."""
    W, S = len(workers), len(shards)
    dense_args = [] if dense_before is None else list(dense_before)
    outs = [refs(worker.train_step.options(num_returns=S + 2).remote(
        *[None if v == w else dense_args[v] for v in range(len(dense_args))],
        *[rows[s][w] for s in range(S)], dense_messages=len(dense_args),
        dense=dense), S + 2)
        for w, worker in enumerate(workers)]
    dense_applied = ([worker.apply_dense.remote(
        *[None if v == w else outs[v][1] for v in range(W)])
        for w, worker in enumerate(workers)]
        if dense_messages(dense, W) and apply_dense else [])
    messages = [o[2:] for o in outs]
    applied, next_rows = [], [] if lookup_next else None
    for s, shard in enumerate(shards):
        to_shard = [messages[w][s] for w in range(W)]
        if lookup_next:
            out = refs(shard.step.options(num_returns=W + 1).remote(
                step, mean, row_l2_scale, W, True, *to_shard), W + 1)
            applied.append(out[0])
            next_rows.append(out[1:])
        else:
            applied.append(shard.step.remote(step, mean, row_l2_scale, W, False, *to_shard))
    return {"results": [o[0] for o in outs], "applied": applied,
            "dense_applied": dense_applied, "messages": messages, "next_rows": next_rows,
            "dense": [o[1] for o in outs]}


def dense_messages(dense: bool, workers: int) -> bool:
    """Whether a step's dense update travels between workers and needs its ``apply_dense``
    call: with several workers in a pass that trains the dense weights (a lone worker applies
    its update in its ``train_step``)."""
    return dense and workers > 1


def count_bytes(counts, results) -> None:
    """Add the bytes a step moved between actors (array payloads, not Ray's framing) to
    ``counts``: ids out and rows back, row gradients to the shards, dense gradients to every
    worker."""
    W = len(results)
    metas = [r.get("meta", {}) for r in results]
    request = sum(m.get("request_bytes", 0) for m in metas)
    rows = sum(m.get("rows_bytes", 0) for m in metas)
    grads = sum(r.get("grad_bytes", 0) for r in results)
    dense = sum(r.get("dense_bytes", 0) for r in results)
    counts["worker_sent"] += request + grads + dense * (W - 1)
    counts["worker_received"] += rows + dense * (W - 1)
    counts["shard_received"] += request + grads
    counts["shard_sent"] += rows


def account(trainer, results) -> fitting.Step:
    """The trainer's counters (``losses``, ``samples``, ``ids_fed``, ``leaf_ids``, ``bytes``)
    after a step with the workers' ``results``, and the step as the fit loop sees it."""
    trained = [r for r in results if r["n"]]
    n = sum(r["n"] for r in trained)
    loss = sum(r["loss"] * r["n"] for r in trained) / n
    trainer.losses.append(loss)
    trainer.samples += n
    trainer.ids_fed += sum(r.get("ids_fed", 0) for r in results)
    trainer.leaf_ids += sum(r.get("leaf_ids", 0) for r in results)
    count_bytes(trainer.bytes, results)
    return fitting.Step(loss, n, len(trained),
                        [(r["probabilities"], r["labels"]) for r in trained], (loss,),
                        pausable=False)


@dataclass
class ScheduledStep:
    """One step the scheduler ran."""

    results: list               # every worker's step results, in worker order
    paused: bool                # the pipeline is drained: nothing of a later step has run
    step: fitting.Step | None   # the trained step (counted), or None: no worker had a sample


@dataclass
class _Pending:
    calls: dict                 # submit_step's refs
    paused: bool
    dense: list | None          # the dense messages the next train_step applies (deferred)


class StepScheduler:
    """Runs the pipelined synchronous steps of one trainer's actors (``workers``, ``shards``)
    and keeps its ``step`` and ``expired`` counters and the others :func:`account` keeps.

    ``pass_end``: a batch pass, which ends at the first step in which no worker had a sample
    (that step changes nothing and is not yielded); the step after the one being read is
    submitted before its results are read (two steps in flight). Otherwise a stream (online
    learning): one step in flight, steps without a sample are yielded (not counted) and the
    steps go on for ever, and a step's dense update is deferred to the next ``train_step``
    unless the step pauses."""

    def __init__(self, trainer, workers: list, shards: list, *, mean: bool, dense: bool,
                 pass_end: bool):
        self.trainer = trainer
        self.workers, self.shards = workers, shards
        self.mean, self.dense, self.pass_end = mean, dense, pass_end

    def _submit(self, step: int, rows, pause, dense_before) -> _Pending:
        paused = bool(pause(step))
        # a stream's dense update is applied by the next step's train_step (one call per
        # worker and step, not two), except before a pause: then by its own apply_dense
        defer = (not self.pass_end and dense_messages(self.dense, len(self.workers))
                 and not paused)
        calls = submit_step(self.workers, self.shards, step, self.mean, rows, not paused,
                            row_l2_scale=self.trainer.row_l2_scale, dense=self.dense,
                            dense_before=dense_before, apply_dense=not defer)
        return _Pending(calls, paused, calls["dense"] if defer else None)

    def run(self, rows, pause):
        """The steps from the first one on ``rows`` (``[shard][worker]`` refs of the looked up
        batches), one :class:`ScheduledStep` each. ``pause(k)`` is asked before step ``k`` is
        submitted: whether the caller will evaluate, checkpoint or stop after it. Then the
        pipeline drains: that step is submitted without looking the next one up, and it is
        yielded ``paused``, with nothing of the next step run (its batches are taken but not
        looked up or trained)."""
        t = self.trainer
        current = self._submit(t.step + 1, rows, pause, None)
        while True:
            following = None
            if self.pass_end and not current.paused:
                following = self._submit(t.step + 2, current.calls["next_rows"], pause,
                                         current.dense)
            calls = current.calls
            results = ray.get(calls["results"])
            step = None
            if any(r["n"] for r in results):
                t.expired += sum(ray.get(calls["applied"]))
                t.step += 1
                step = account(t, results)
                step.pausable = current.paused
            else:  # the shards skipped it: no step
                outstanding = [current] + ([following] if following else [])
                ray.get([ref for c in outstanding for ref in c.calls["results"]
                         + c.calls["applied"] + c.calls["dense_applied"]])
                if self.pass_end:
                    return
            if current.paused:
                ray.get(calls["dense_applied"])
            yield ScheduledStep(results, current.paused, step)
            if following is not None:
                current = following
                continue
            rows = (lookup(self.shards, calls["messages"], True) if current.paused
                    else calls["next_rows"])
            current = self._submit(t.step + 1, rows, pause, current.dense)
