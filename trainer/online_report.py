"""What a running online-learning run reports: ``status.json``, Prometheus metrics, TensorBoard.

One place for both engines (in process, :mod:`trainer.online`; on Ray,
:mod:`trainer.distributed.online`), so the file, the metric names and the scalar tags are the
same whichever trains. A run object here is anything with ``snapshot`` (its latest summary
dict, or None) and ``timing_observers`` (a list of callables taking ``(what, seconds)``).
"""

from __future__ import annotations

import json
import os

STATUS_FILE = "status.json"
TENSORBOARD_DIR = "online"  # the scalars' directory under the run dir
STATUS_EVERY = 1.0  # seconds between rewrites of status.json (and of /metrics' values)


def write_status(path: str, summary: dict) -> None:
    """Replace the status file ``path`` with ``summary`` atomically (readers see the previous
    status or this one, never a part)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, sort_keys=True)
    os.replace(tmp, path)


def report_scalars(*, rate: float, dead_letters: int, store: dict, lag: int | None,
                   pv: dict, window: dict, waited: float | None) -> dict:
    """The TensorBoard scalars of a console report: samples/s and the share of the time spent
    waiting for input since the previous report (``waited``; None: not measured), dead
    letters, store counters, consumer lag (None: unknown, left out) and progressive
    validation (``pv``: the whole run, ``window``: since the previous report; a None value
    is left out)."""
    scalars = {"samples_per_sec": rate, "dead_letters": dead_letters,
               **{f"store/{k}": store.get(k, 0)
                  for k in ("rows", "admitted", "rejected", "expired")}}
    if waited is not None:
        scalars["waited_for_input"] = waited
    if lag is not None:
        scalars["lag_messages"] = lag
    for name, value in (("pv/auc", pv["auc"]), ("pv/logloss", pv["logloss"]),
                        ("pv/window_auc", window["auc"]),
                        ("pv/window_logloss", window["logloss"])):
        if value is not None:
            scalars[name] = value
    return scalars


def serve_metrics(run, host: str, port: int):
    """Prometheus metrics of ``run`` on ``http://host:port/metrics`` (a daemon thread);
    values come from the summary the run refreshes every second (its status.json), timings
    from every checkpoint and export. Returns the HTTP server (``.server_port``)."""
    from prometheus_client import CollectorRegistry, Histogram, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def family(kind, name, text, value):
        metric = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
            f"prefixrec_online_{name}", text)
        metric.add_metric([], float("nan") if value is None else float(value))
        return metric

    class Collector:
        def collect(self):
            s = run.snapshot
            if s is None:
                return
            pv, window = s["pv"], s["pv"].get("window") or {}
            delay = s["delay_s"]
            yield from (
                family("counter", "samples", "samples trained", s["samples"]),
                family("counter", "steps", "training steps", s["steps"]),
                family("gauge", "samples_per_second", "training rate (steady once measured)",
                       s["rate"]["samples_per_sec"]),
                family("gauge", "consumer_lag_messages", "messages behind the partitions' "
                       "ends at the latest report (NaN: unknown)", s["lag"]),
                family("gauge", "pv_auc", "progressive-validation AUC, whole run", pv["auc"]),
                family("gauge", "pv_logloss", "progressive-validation log loss, whole run",
                       pv["logloss"]),
                family("gauge", "pv_window_auc", "progressive-validation AUC since the "
                       "previous report", window.get("auc")),
                family("gauge", "pv_window_logloss", "progressive-validation log loss since "
                       "the previous report", window.get("logloss")),
                family("gauge", "store_rows", "embedding rows held", s["store_rows"]),
                family("counter", "store_admitted", "ids given a row", s["admitted"]),
                family("counter", "store_rejected", "sightings the entry filters turned "
                       "down", s["rejected"]),
                family("counter", "store_expired", "rows removed by expiry", s["expired"]),
                family("counter", "dead_letters", "messages sent to the dead-letter topic",
                       s["dead_letters"]),
                family("counter", "checkpoints", "checkpoints written", s["checkpoints"]),
                family("counter", "exports", "serving exports published", s["exports"]),
                family("gauge", "arrival_to_export_p50_seconds", "a sample's Kafka arrival "
                       "to the export holding it, median over the run", delay.get("p50")),
                family("gauge", "arrival_to_export_p99_seconds", "the same, 99th percentile",
                       delay.get("p99")),
                family("gauge", "broker_reachable", "1 while the broker answers",
                       s["broker_reachable"]))
            if s.get("tiers"):  # tables with a memory budget: per table, per tier
                from trainer.tiers import tier_metric_families

                yield from tier_metric_families("prefixrec_online", s["tiers"])

    registry = CollectorRegistry()
    registry.register(Collector())
    seconds = Histogram("prefixrec_online_write_seconds", "time to write a checkpoint or "
                        "publish an export", ["what"], registry=registry,
                        buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
    run.timing_observers.append(lambda what, s: seconds.labels(what).observe(s))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server
