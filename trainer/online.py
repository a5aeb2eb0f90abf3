"""Online learning: train continuously from a Kafka topic, checkpoint with offsets, export deltas.

    python -m trainer.online --schema S --bootstrap-servers HOST:PORT --topic samples \\
        --group ctr-online --run-dir run/ [--export-dir export/ --export-every 10]

The loop, and why it is crash-exact:

1. A reader thread consumes up to a batch of messages, decodes them in bulk (malformed ones
   are set aside as dead letters), compresses the samples into trees and cuts them into
   TreeBatches. One such *unit* carries the consumer positions after its last message.
2. The main thread trains every batch of a unit (store lookups, TensorFlow step, store
   updates). Only then do the unit's positions become the *trained* positions, and its dead
   letters are sent to ``TOPIC.dlq``.
3. Every ``--checkpoint-every`` seconds, between units, it writes a checkpoint (dense weights,
   stores, step, the trained positions and the offset ranges trained since the previous
   checkpoint) atomically, once the dead letters sent so far are delivered, and only after
   that commits the same offsets to Kafka.
4. On start it restores the latest checkpoint and seeks every partition to its offsets.

So after a crash at any moment the restored model has trained exactly the messages before the
checkpoint's offsets, and training resumes right after them: nothing lost, nothing twice.
A malformed message's dead letter is written once when the run meets no crash (units polled
but not trained when it stops are read, and dead-lettered, by the next run); after a crash,
those of the units trained since the last checkpoint are written again.
With ``--workers W --shards S`` the same command trains on Ray, with the same guarantee
(:mod:`trainer.distributed.online`). Both are one loop (:mod:`trainer.online_loop`) over an
engine: this process's (:mod:`trainer.online_process`) or Ray's; this module parses the flags
into :class:`~trainer.online_loop.OnlineOptions` and turns what the engines refuse into usage
errors.
SIGTERM (or Ctrl-C) finishes the current unit, checkpoints, commits and exits 0; one that comes
while the command starts (TensorFlow, the broker, the model, Ray and its actors) ends it with
exit 0 and nothing trained. A checkpoint is written only when something changed since the
previous one (a trained batch or new offsets): an idle run does not rewrite the same checkpoint
every ``--checkpoint-every`` s.

``--idle-exit S`` stops the run (checkpoint, commit, exit 0) once the topic has been idle for S
seconds, where *idle* means: partitions are assigned, the broker answers, and the consumer has
nothing to read. Time without partitions (joining the group, a rebalance) and time while the
broker cannot be reached is not idle: an empty poll cannot tell "no new messages" from "no
broker", so whenever polls come back empty the reader asks the partitions' leaders for their
offsets (at most every ``PROBE_EVERY`` s); an unanswered request restarts the idle clock, and
the trainer keeps retrying, however long the outage lasts. Just before it stops, the loop
asks once more, so a run never gives up while the broker is away.

On an object store (``--run-dir s3://bucket/online``, ``gs://``...): the run works in a local copy
of the run directory (downloaded at start: the published checkpoints, so a restart resumes from
the store) and publishes it whole after every checkpoint, before the checkpoint's offsets are
committed, and once more at the end (final ``status.json``, TensorBoard logs): its files under a
hidden generation, ``_MANIFEST.json`` written last (:mod:`compression.fs`), so the store holds the
previous checkpoint or the new one, never a mix. ``--export-dir`` and ``--init-from`` may be on a
store too (see :func:`trainer.serving.export_increment`).

Progressive validation: every training step's probabilities are computed with the weights and
rows *before* that step's update, so each sample is scored by a model that has not trained on
it yet. Their AUC and log loss (of the model's first head), over the whole run and over the
window since the previous console line, go to the console, ``status.json``, the final summary
and TensorBoard (``pv/*``): the online counterpart of a held-out evaluation, at no extra cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import textwrap

import schemas
from compression import cli, fs, kafka
from compression.messages import DEFAULT_MAX_MESSAGE_BYTES
from compression.signal_points import signal_point
from trainer.config import EXPORT_FORMATS, ConfigError, TrainConfig
from trainer.kafka_source import DEFAULT_UNIT_BATCHES
from trainer.metrics import DelayHistogram  # noqa: F401 - importable from here as before
from trainer.online_loop import (DEFAULT_READER_NICE, PROBE_EVERY, PROBE_TIMEOUT,  # noqa: F401
                                 STEP_LOG, OnlineOptions, OnlineStats, OnlineUsageError,
                                 metric_text, run_online)
from trainer.online_process import OnlineTrainer, Unit, default_unit_samples  # noqa: F401
from trainer.online_report import STATUS_FILE, TENSORBOARD_DIR
from trainer.ray_address import check_ray_address
from trainer.runs import MODEL_NAMES, load_tensorflow

PROG = "python -m trainer.online"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=textwrap.fill(
            "Train continuously from a Kafka topic of samples with crash-exact "
            "recovery: checkpoints hold the consumed offsets, which are committed to "
            "Kafka only after the checkpoint is durable."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=cli.epilog(
            f"{PROG} --schema schemas/examples/taobao_like.yaml --bootstrap-servers "
            "localhost:9092 --topic samples --group ctr-online --run-dir runs/online "
            "--export-dir export/ --export-every 10",
            notes="SIGINT and SIGTERM stop a run cleanly: the last unit is trained, a checkpoint "
                  "written, its offsets committed, and the command exits 0; starting it again "
                  "with the same --run-dir resumes from that checkpoint.",
            exit_codes=cli.SERVICE_EXIT_CODES))
    cli.add_debug_flag(parser)
    parser.add_argument("--schema", required=True, help="schema YAML")
    parser.add_argument("--bootstrap-servers", required=True, help="Kafka HOST:PORT[,...]")
    parser.add_argument("--topic", required=True, help="topic of samples")
    parser.add_argument("--format", choices=["json", "trees"], default="json",
                        help="json: one raw sample per message; trees: Arrow IPC tree batches "
                             "from pipelines.stream_compress (default json)")
    parser.add_argument("--group", required=True, help="consumer group id")
    parser.add_argument("--run-dir", required=True,
                        help="checkpoints and TensorBoard logs; restored from on start. On "
                             "an object store (s3://...): a local working copy published "
                             "there after every checkpoint")
    parser.add_argument("--config", help="trainer YAML (see trainer/examples/mlp.yaml)")
    parser.add_argument("--model", choices=sorted(MODEL_NAMES),
                        help="built-in model for a new run (default mlp)")
    parser.add_argument("--init-from", metavar="RUN_DIR",
                        help="start a new run from the model a trainer.train run kept (in "
                             "process or on Ray): its dense weights, every embedding row with "
                             "its optimizer state and counters, the entry filters' state, its "
                             "step and config; what the batch run saw counts as seen. Ignored "
                             "once --run-dir holds a checkpoint of its own")
    parser.add_argument("--export-dir", help="write store deltas and dense weights here "
                                             "(a local directory or s3://..., gs://...)")
    parser.add_argument("--export-format", choices=EXPORT_FORMATS, default=None,
                        help="how --export-dir writes every embedding table (overrides the "
                             "config's and the checkpoint's per-table export_format): float32 "
                             "(default), float16, int8 or int4; training stays float32")
    parser.add_argument("--export-every", type=float, default=10.0,
                        help="seconds between exports (default 10)")
    parser.add_argument("--checkpoint-every", type=float, default=30.0,
                        help="seconds between checkpoints (default 30)")
    parser.add_argument("--expire-every", type=int, metavar="N",
                        help="run the config's expiry (idle steps/seconds or its "
                             "module:function) every N steps instead of its every_steps")
    parser.add_argument("--report-every", type=float, default=10.0,
                        help="seconds between console lines and TensorBoard points "
                             "(samples/s, lag, store rows, delay; default 10)")
    parser.add_argument("--max-samples", type=int,
                        help="stop (checkpoint, commit, exit 0) after this many samples")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve Prometheus metrics on http://HOST:PORT/metrics (0: a free "
                             "port; the address goes to the log and to status.json)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address of the metrics endpoint (default 127.0.0.1)")
    parser.add_argument("--idle-exit", type=float, metavar="S",
                        help="stop (checkpoint, commit, exit 0) after S idle seconds: seconds "
                             "in which partitions were assigned, the broker answered and there "
                             "was nothing to read. Joining the group, a rebalance and a broker "
                             "outage are not idle: the trainer keeps retrying through them")
    parser.add_argument("--reader-nice", type=int, default=DEFAULT_READER_NICE, metavar="N",
                        help="lower the priority of the thread that consumes, decodes and "
                             "batches by N (0-19) so the training step keeps the cores "
                             f"(default {DEFAULT_READER_NICE}; 0 to leave it)")
    parser.add_argument("--unit-samples", type=int, metavar="N",
                        help="samples polled, compressed into trees and trained as one unit "
                             "when the topic has them (more of a user's samples share one "
                             f"tree; default {DEFAULT_UNIT_BATCHES} batches; with --workers W, "
                             "each worker polls its share: 1/W of it)")
    parser.add_argument("--dead-letter-topic",
                        help="topic for malformed messages (default: TOPIC.dlq)")
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                        help="larger messages go to the dead-letter topic "
                             f"(default {DEFAULT_MAX_MESSAGE_BYTES})")
    parser.add_argument("--memory-budget", metavar="SIZE",
                        help="keep about SIZE (e.g. 2GiB, 512MiB or bytes) of embedding rows "
                             "in memory, the rest on local disk (--tier-dir): the whole "
                             "model's budget, split over the tables in proportion to their "
                             "bytes a row (and over --shards), instead of the config's or the "
                             "checkpoint's budgets")
    parser.add_argument("--tier-dir", metavar="DIR",
                        help="with --memory-budget: a directory on local disk for the rows "
                             "beyond it (default: the config's tier_dir, else a temporary "
                             "directory removed at exit)")
    ray = parser.add_argument_group("online learning on Ray (see the README)")
    ray.add_argument("--workers", type=int, metavar="W",
                     help="online workers (Ray actors), each reading its share of the topic's "
                          "partitions; with --shards, the embedding tables are sharded over S "
                          "store actors (default: one process, no Ray)")
    ray.add_argument("--shards", type=int, metavar="S", help="store shards (Ray actors)")
    ray.add_argument("--ray-address", metavar="HOST:PORT",
                     help="a running Ray cluster's head (default with --workers/--shards: a "
                          "local cluster started for the run)")
    ray.add_argument("--step-log", action="store_true",
                     help="append which messages every step trained to RUN_DIR/steps.jsonl "
                          "at each checkpoint, on Ray and in one process alike (a "
                          "single-process replay of it gives the same model)")
    kafka.add_options(parser, clients="consumer and the dead-letter producer")
    return parser


def parse_options(argv=None) -> tuple[argparse.ArgumentParser, OnlineOptions]:
    """The parser and the options ``argv`` gives (argparse's own errors exit 2 here)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(OnlineOptions)}
    values["kafka_options"] = dict(values["kafka_options"])  # -X pairs, the last one wins
    return parser, OnlineOptions(**values)


def run(argv=None) -> dict:
    parser, options = parse_options(argv)
    try:
        options.check()
    except OnlineUsageError as e:
        parser.error(str(e))
    signal_point("args.parsed")
    for name in ("workers", "shards"):
        if getattr(options, name) is not None and getattr(options, name) < 1:
            parser.error(f"--{name}: expected at least 1, got {getattr(options, name)}")
    if options.ray_address:  # before TensorFlow is imported: an address where nothing answers
        try:
            check_ray_address(options.ray_address)
        except (ConnectionError, ValueError) as e:
            parser.error(str(e))
    if options.on_ray and not fs.is_local(options.run_dir):
        parser.error(f"--run-dir {options.run_dir}: on an object store only without --workers/"
                     "--shards for now; give the Ray run a local or shared --run-dir")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        if fs.is_local(options.run_dir):
            summary = _run(options, options.run_dir)
        else:
            fs.check_bucket(options.run_dir)  # a working copy of the published run, published
            with fs.working_copy(options.run_dir) as local:  # at each checkpoint
                summary = _run(options, local, publish_to=options.run_dir.rstrip("/"))
    except OnlineUsageError as e:
        parser.error(str(e))
    except kafka.BrokerUnreachable as e:  # at start only: once running, the run retries
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    return print_summary(summary, options.topic)


def _run(options: OnlineOptions, run_dir: str, publish_to: str | None = None) -> dict:
    """The run, in the local run directory ``run_dir`` (a working copy of ``publish_to``)."""
    load_tensorflow(options.debug)
    from trainer.checkpoints import CheckpointManager
    from trainer.models import MODELS

    signal_point("tensorflow.loaded")
    kafka.check_reachable(kafka.consumer_settings(options.bootstrap_servers, options.group,
                                                  dict(options.kafka_options)),
                          kafka.DEFAULT_BROKER_TIMEOUT if options.broker_timeout is None
                          else options.broker_timeout)
    signal_point("broker.reached")
    if options.on_ray:
        from trainer.distributed.online import run_on_ray

        try:
            schema = schemas.load(options.schema)
            config = TrainConfig.load(options.config) if options.config else TrainConfig()
        except (schemas.SchemaError, ConfigError) as e:
            raise OnlineUsageError(str(e)) from None
        signal_point("config.loaded")
        return run_on_ray(options, schema, config, MODELS[options.model or "mlp"]())
    from trainer.kafka_source import KafkaSampleSource
    from trainer.online_process import restore_process_trainer

    checkpoints = CheckpointManager(run_dir, publish_to=publish_to)
    latest = checkpoints.latest()
    try:
        schema = schemas.load(options.schema)
        trainer, offsets = restore_process_trainer(options, schema, latest, MODELS)
    except (schemas.SchemaError, ConfigError) as e:
        raise OnlineUsageError(str(e)) from None
    signal_point("config.loaded")
    source = KafkaSampleSource(schema, options.bootstrap_servers, options.topic, options.group,
                               format=options.format, start_offsets=offsets,
                               dlq_topic=options.dead_letter_topic,
                               config=dict(options.kafka_options),
                               max_message_bytes=options.max_message_bytes)
    try:  # a signal before the loop runs ends the command here (exit 0, nothing trained)
        online = OnlineTrainer(
            schema, trainer, source, checkpoints, checkpoint_every=options.checkpoint_every,
            export_dir=options.export_dir, export_every=options.export_every,
            max_samples=options.max_samples, idle_exit=options.idle_exit,
            status_path=os.path.join(run_dir, STATUS_FILE),
            log_dir=os.path.join(run_dir, TENSORBOARD_DIR), report_every=options.report_every,
            reader_nice=options.reader_nice, unit_samples=options.unit_samples,
            calibrate=latest is None and not options.init_from,
            step_log=os.path.join(run_dir, STEP_LOG) if options.step_log else None)
        summary = run_online(online, options.metrics_host, options.metrics_port)
        checkpoints.publish()  # on a store: the final status and logs too
    finally:
        source.close()
    return summary


def print_summary(summary: dict, topic: str) -> dict:
    """The run's result line and its summary as one JSON line (what scripts read)."""
    delay = {k: "n/a" if v is None else f"{v:.2f}" for k, v in summary["delay_s"].items()}
    rate, pv = summary["rate"], summary["pv"]
    rate_text = ("steady, after start-up" if rate["over"] == "steady"
                 else "over the whole run, start-up included")
    where = (f" on {summary['workers']} workers x {summary['shards']} shards"
             if summary["engine"] == "ray" else "")
    print(f"trained {summary['samples']:,} samples from {topic!r}{where} "
          f"({rate['samples_per_sec']:,.0f} samples/s {rate_text}), "
          f"progressive validation AUC {metric_text(pv['auc'])} "
          f"logloss {metric_text(pv['logloss'])}, "
          f"{summary['dead_letters']} dead letters, {summary['checkpoints']} checkpoints, "
          f"{summary['exports']} exports (arrival-to-export delay p50 {delay['p50']} s, "
          f"p99 {delay['p99']} s), {summary['store_rows']:,} store rows", flush=True)
    print(json.dumps(summary, sort_keys=True), flush=True)
    return summary


def main(argv=None) -> int:
    return cli.run_command(PROG, lambda a: run(a) and 0, argv, service=True)


if __name__ == "__main__":
    sys.exit(main())
