"""Benchmark of online learning from Kafka: end-to-end samples/s and arrival-to-export delay.

    python -m benchmarks.online --samples 200000
    python -m benchmarks.online --samples 200000 --workers 2 --shards 2   # on Ray

Against a local Tansu broker (or ``--bootstrap-servers``), with the paper's MLP on the
taobao_like schema (trainer/examples/mlp.yaml, batch 5000):
1. throughput: the topic is preloaded with ``--samples`` JSON samples, then the online trainer
   consumes, decodes, compresses, trains and updates the stores; samples/s is measured from the
   end of its first unit (after start-up and the group join);
2. delay: a producer sends ``--rate`` samples/s for ``--seconds`` while the trainer runs with
   ``--export-every``; the delay of a sample is from its message timestamp to the end of the
   export that holds its update (p50, p99).
Prints a table and a final JSON line. Targets (docs/architecture.md): at least 100k samples/s, p99
delay under 10 s with exports every 5 s.

With ``--workers W --shards S``, online learning on Ray instead (:mod:`benchmarks.online_ray`):
the single-process command, 1 worker x 1 shard and W x S on the same backlog, CPU-s per sample
of every process, and the per-step costs scaled on paper to 8, 32 and 128 workers; then the
delay phase above on W x S (``--export-dir``, every ``--export-every`` s): its arrival-to-export
p50 and p99.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import threading
import time

import pyarrow as pa

import schemas
from benchmarks.compression import cpu_seconds, machine
from pipelines import local_broker
from pipelines.generate import generate_tables
from pipelines.replay import json_lines, message_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml")
CONFIG = os.path.join(ROOT, "trainer", "examples", "mlp.yaml")


def _messages(schema, samples: int, seed: int):
    table = pa.concat_tables(generate_tables(schema, samples, seed=seed))
    return list(zip(message_keys(table, schema).to_pylist(),
                    json_lines(table, schema).to_pylist()))


def _tree_messages(schema, samples: int, seed: int):
    """The same samples as tree messages, as ``pipelines.stream_compress`` writes them: one
    Arrow IPC tree table per root key and window. At the target rate (100k samples/s) a 60 s
    window holds millions of samples, so the whole preload is one window here."""
    import compression

    table = pa.concat_tables(generate_tables(schema, samples, seed=seed))
    trees = compression.build_trees(table, schema)
    root_key = schema.layers[0].key[0]
    keys = trees.column(root_key).to_pylist()
    return [(str(key).encode(), compression.encode_trees(trees.slice(i, 1)))
            for i, key in enumerate(keys)]


def _produce(bootstrap: str, topic: str, messages, rate: float | None = None,
             stop: threading.Event | None = None) -> int:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20,
                         "queue.buffering.max.messages": 1_000_000})
    started = time.monotonic()
    sent = 0
    for key, value in messages:
        if stop is not None and stop.is_set():
            break
        while True:
            try:
                producer.produce(topic, value=value, key=key)
                break
            except BufferError:
                producer.poll(0.05)
        sent += 1
        if rate and sent % 200 == 0:
            ahead = sent / rate - (time.monotonic() - started)
            if ahead > 0:
                producer.poll(0)
                time.sleep(ahead)
    producer.flush(60)
    return sent


def _config(threads: int):
    from trainer.config import TrainConfig

    config = TrainConfig.load(CONFIG)
    return dataclasses.replace(config, threads=threads) if threads else config


def _train_alone(schema, messages, threads: int, unit_samples: int | None) -> dict:
    """The ceiling the end-to-end rate is measured against: the same samples decoded, compressed
    and prepared in memory first (in units of the size the online reader polls), then only
    lookup + step + update timed, on a fresh trainer."""
    import compression
    from trainer import models
    from trainer.online_process import default_unit_samples
    from trainer.trainer import Trainer

    trainer = Trainer(schema, models.MLP(), _config(threads))
    unit = unit_samples or default_unit_samples(trainer.config.batch_size)
    values = [value.encode() for _, value in messages]
    tables = [compression.decode_json_samples(values[start:start + unit], schema)[0]
              for start in range(0, len(values), unit)]
    samples, wall, _ = _time_steps(trainer, _prepare(trainer, schema, tables))
    return {"samples": samples, "samples_per_sec": samples / wall}


def _prepare(trainer, schema, tables: list) -> list:
    """The trainer's prepared batches of each unit's decoded samples, as the online reader
    makes them: trees built per unit, cut into batches, feed tensors made."""
    from trainer.units import as_trees, cut_batches

    prepared = []
    for table in tables:
        prepared += cut_batches(as_trees(table, schema, validate=False), schema,
                                trainer.config.batch_size, trainer.config.split_trees,
                                trainer.prepare)
    return prepared


def _time_steps(trainer, prepared: list) -> tuple[int, float, float]:
    """Train every prepared batch (the first one untimed: it traces the step); the samples
    timed, their wall seconds and this process's CPU seconds."""
    trainer.train_batch(prepared[0])
    cpu, started = cpu_seconds(), time.perf_counter()
    for p in prepared[1:]:
        trainer.train_batch(p)
    wall, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return sum(p.num_leaves for p in prepared[1:]), wall, cpu


def _online(schema, bootstrap, topic, run_dir, export_dir, export_every, threads: int,
            format="json", **kwargs):
    from trainer import models
    from trainer.checkpoints import CheckpointManager
    from trainer.kafka_source import KafkaSampleSource, group_id
    from trainer.online_process import OnlineTrainer
    from trainer.trainer import Trainer

    trainer = Trainer(schema, models.MLP(), _config(threads))
    source = KafkaSampleSource(schema, bootstrap, topic, group_id(), format=format,
                               config={"fetch.max.bytes": 64 << 20,
                                       **local_broker.CLIENT_OPTIONS})
    online = OnlineTrainer(schema, trainer, source, CheckpointManager(run_dir),
                           checkpoint_every=1e9, export_dir=export_dir,
                           export_every=export_every, **kwargs)
    try:
        return online.run()
    finally:
        source.close()


def _budget(schema, bootstrap: str, topic: str, messages: list, threads: int,
            unit_samples: int | None, broker_pid: int | None) -> dict:
    """CPU seconds per 100k samples of each stage of the online path, measured one stage at a
    time in this process (nothing else running in it): consume + decode through
    ``KafkaSampleSource.poll`` (with the broker's own CPU), decode alone (so consume is the
    difference), tree building + batching + feed tensors, and the trainer's lookup + step +
    update. At 100k samples/s a 2-core machine has 2.0 CPU seconds per 100k samples for all of
    them together."""
    from trainer import models
    from compression import decode_json_samples
    from trainer.kafka_source import KafkaSampleSource, group_id
    from trainer.online_process import default_unit_samples
    from trainer.trainer import Trainer

    trainer = Trainer(schema, models.MLP(), _config(threads))
    unit = unit_samples or default_unit_samples(trainer.config.batch_size)
    source = KafkaSampleSource(schema, bootstrap, topic, group_id(),
                               config={"fetch.max.bytes": 64 << 20,
                                       **local_broker.CLIENT_OPTIONS})
    try:
        while not source.poll(unit, 1.0).messages:  # the group join, not measured
            pass
        cpu, broker = cpu_seconds(), cpu_seconds(broker_pid) if broker_pid else 0.0
        tables, consumed = [], 0
        while consumed < len(messages):
            polled = source.poll(unit, 1.0)
            if not polled.messages:
                break
            tables.append(polled.samples)
            consumed += polled.num_samples
        consume_decode = cpu_seconds() - cpu
        broker = (cpu_seconds(broker_pid) - broker) if broker_pid else None
    finally:
        source.close()
    values = [value.encode() for _, value in messages[:consumed]]  # the same messages
    cpu = cpu_seconds()
    for start in range(0, len(values), unit):
        decode_json_samples(values[start:start + unit], schema)
    decode = cpu_seconds() - cpu
    cpu = cpu_seconds()
    prepared = _prepare(trainer, schema, tables)
    build = cpu_seconds() - cpu
    trained, wall, train = _time_steps(trainer, prepared)
    per = 100_000 / consumed
    stages = {"consume": (consume_decode - decode) * per, "decode": decode * per,
              "build_batch_prepare": build * per, "train": train * 100_000 / trained}
    if broker is not None:
        stages["broker"] = broker * per
    return {"samples": consumed, "cpu_s_per_100k": {k: round(v, 3) for k, v in stages.items()},
            "total_cpu_s_per_100k": round(sum(stages.values()), 3),
            "train_samples_per_sec": round(trained / wall, 1), "threads": threads}


def create_topic(bootstrap: str, partitions: int) -> str:
    import uuid

    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"bench-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})  # must outlive the future
    admin.create_topics([NewTopic(name, num_partitions=partitions,
                                  replication_factor=1)])[name].result(30)
    time.sleep(0.5)
    return name


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.online",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=500_000, help="throughput phase")
    parser.add_argument("--rate", type=float, default=20_000, help="delay phase samples/s")
    parser.add_argument("--seconds", type=float, default=30, help="delay phase duration")
    parser.add_argument("--export-every", type=float, default=5.0)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--bootstrap-servers", help="use this broker instead of Tansu")
    parser.add_argument("--reader-nice", type=int, default=None,
                        help="the online reader thread's --reader-nice (default: its default)")
    parser.add_argument("--unit-samples", type=int, default=None,
                        help="the online trainer's --unit-samples (default: its default)")
    parser.add_argument("--threads", type=int, default=0,
                        help="TensorFlow intra-op threads of the trainer (the config's "
                             "threads; default 0: mlp.yaml's value)")
    parser.add_argument("--budget", action="store_true",
                        help="also measure the CPU seconds per 100k samples of each stage "
                             "(consume, decode, build, train, the broker) one at a time: what "
                             "100k samples/s needs from 2 cores (2.0 CPU-s per 100k)")
    parser.add_argument("--trees", action="store_true",
                        help="also measure the throughput from a topic of tree messages (the "
                             "streaming job's output, --format trees) on the same samples")
    parser.add_argument("--workers", type=int, default=None,
                        help="compare online learning on Ray (W workers x --shards S, and 1 x 1) "
                             "with the single process instead")
    parser.add_argument("--shards", type=int, default=None)
    args = parser.parse_args(argv)
    if args.workers is not None or args.shards is not None:
        return _on_ray(args)
    options = {} if args.reader_nice is None else {"reader_nice": args.reader_nice}
    options["unit_samples"] = args.unit_samples
    options["threads"] = args.threads
    schema = schemas.load(SCHEMA)
    work = tempfile.mkdtemp(prefix="bench-online-")
    budget = None
    broker = (contextlib.nullcontext((args.bootstrap_servers, None, None))
              if args.bootstrap_servers else local_broker.tansu())
    try:
        with broker as (bootstrap, broker_process, _):
            messages = _messages(schema, args.samples, args.seed)
            topic = create_topic(bootstrap, args.partitions)
            _produce(bootstrap, topic, messages)
            if args.budget:
                budget = _budget(schema, bootstrap, topic, messages, args.threads,
                                 args.unit_samples,
                                 broker_process.pid if broker_process else None)
            throughput = _online(schema, bootstrap, topic, os.path.join(work, "run1"),
                                 os.path.join(work, "export1"), 1e9,
                                 max_samples=args.samples, idle_exit=10, **options)
            alone = _train_alone(schema, messages, args.threads, args.unit_samples)
            from_trees = None
            if args.trees:
                topic = create_topic(bootstrap, args.partitions)
                _produce(bootstrap, topic, _tree_messages(schema, args.samples, args.seed))
                from_trees = _online(schema, bootstrap, topic, os.path.join(work, "run3"),
                                     os.path.join(work, "export3"), 1e9, format="trees",
                                     max_samples=args.samples, idle_exit=10, **options)

            delay_samples = int(args.rate * args.seconds)
            delayed = _messages(schema, delay_samples, args.seed + 1)
            topic = create_topic(bootstrap, args.partitions)
            stop = threading.Event()
            producer = threading.Thread(target=_produce, args=(bootstrap, topic, delayed,
                                                               args.rate, stop))
            producer.start()
            try:
                delay = _online(schema, bootstrap, topic, os.path.join(work, "run2"),
                                os.path.join(work, "export2"), args.export_every,
                                max_samples=delay_samples, idle_exit=10, **options)
            finally:
                stop.set()
                producer.join()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {"benchmark": "online", "samples": throughput["samples"],
              "samples_per_sec": throughput["steady_samples_per_sec"],
              "samples_per_sec_with_startup": throughput["samples_per_sec"],
              "final_export_checkpoint_s": throughput["since_last_unit_s"],
              "busy_seconds": throughput["busy_seconds"],
              "trainer_waited_s": throughput["trainer_waited_s"],
              "train_alone_samples_per_sec": alone["samples_per_sec"],
              "delay_phase": {"rate": args.rate, "samples": delay["samples"],
                              "export_every": args.export_every,
                              "delay_p50_s": delay["delay_s"]["p50"],
                              "delay_p99_s": delay["delay_s"]["p99"],
                              "steady_delay_p50_s": delay["steady_delay_s"]["p50"],
                              "steady_delay_p99_s": delay["steady_delay_s"]["p99"],
                              "exports": delay["exports"],
                              "samples_per_sec": delay["steady_samples_per_sec"]},
              "machine": machine()}
    if budget is not None:
        result["budget"] = budget
    if from_trees is not None:
        result["trees"] = {"samples": from_trees["samples"],
                           "samples_per_sec": from_trees["steady_samples_per_sec"],
                           "samples_per_sec_with_startup": from_trees["samples_per_sec"],
                           "busy_seconds": from_trees["busy_seconds"]}
    print(f"online learning, taobao_like JSON samples, paper's MLP, {os.cpu_count()} cpus")
    print(f"  throughput   {result['samples_per_sec']:>12,.0f} samples/s (steady; "
          f"{throughput['samples_per_sec']:,.0f} with start-up)   target >= 100k")
    print(f"  trainer alone {alone['samples_per_sec']:>11,.0f} samples/s (the same samples "
          f"decoded, compressed and prepared in memory first; lookup + step + update only)")
    busy = ", ".join(f"{k} {v:.1f}" for k, v in throughput["busy_seconds"].items())
    print(f"  busy seconds (reader thread: poll_decode, compress_batch; trainer: the rest): "
          f"{busy}; the trainer waited {result['trainer_waited_s']:.2f} s for the reader")
    if budget is not None:
        stages = ", ".join(f"{k} {v:.2f}" for k, v in budget["cpu_s_per_100k"].items())
        print(f"  CPU-s per 100k samples, one stage at a time: {stages}; total "
              f"{budget['total_cpu_s_per_100k']:.2f} (2 cores at 100k samples/s: 2.00)")
    if from_trees is not None:
        print(f"  from trees   {result['trees']['samples_per_sec']:>12,.0f} samples/s (steady; "
              f"--format trees, the streaming job's tree messages)")
    print(f"  delay p50/p99 at {args.rate:,.0f} samples/s, exports every {args.export_every} s: "
          f"{delay['delay_s']['p50']} / {delay['delay_s']['p99']} s; arrived after the first "
          f"trained unit (steady state): {delay['steady_delay_s']['p50']} / "
          f"{delay['steady_delay_s']['p99']} s   target p99 < 10 s")
    print(json.dumps(result, sort_keys=True))
    return result


def _on_ray(args) -> dict:
    import yaml

    from benchmarks import online_ray

    workers, shards = args.workers or 1, args.shards or 1
    schema = schemas.load(SCHEMA)
    with open(CONFIG) as f:
        batch_size = yaml.safe_load(f)["batch_size"]
    work = tempfile.mkdtemp(prefix="bench-online-ray-")
    broker = (contextlib.nullcontext((args.bootstrap_servers, None, None))
              if args.bootstrap_servers else local_broker.tansu())
    try:
        with broker as (bootstrap, _, _):
            topic = create_topic(bootstrap, max(args.partitions, workers))
            _produce(bootstrap, topic, _messages(schema, args.samples, args.seed))
            result = online_ray.compare(bootstrap, topic, work, args.samples, workers, shards,
                                        batch_size)
            delay_samples = int(args.rate * args.seconds)
            topic = create_topic(bootstrap, max(args.partitions, workers))
            stop = threading.Event()
            producer = threading.Thread(target=_produce, args=(
                bootstrap, topic, _messages(schema, delay_samples, args.seed + 1), args.rate,
                stop))
            producer.start()
            try:
                delay = online_ray.export_delay(bootstrap, topic, work, delay_samples, workers,
                                                shards, args.export_every)
            finally:
                stop.set()
                producer.join()
            result["delay_phase"] = {"rate": args.rate, **delay}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"benchmark": "online_ray", "samples": args.samples, "workers": workers,
              "shards": shards, "batch_size": batch_size, **result, "machine": machine(),
              "load_average": os.getloadavg()}
    print(f"online learning on Ray, taobao_like JSON samples, paper's MLP, batch {batch_size}, "
          f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}")
    for name in dict.fromkeys(("single", "ray_1x1", f"ray_{workers}x{shards}")):
        steady = result[name]["steady"]
        print(f"  {name:<10} {steady['samples_per_sec']:>10,.0f} samples/s  "
              f"{steady['cpu_s_per_100k']:6.2f} CPU-s per 100k samples (driver "
              f"{steady['driver_cpu_s_per_100k']:.2f}; {steady['cpu_counted_by']})")
    window = result["same_samples"]
    print(f"  1 x 1 on Ray / single process, CPU-s per sample over the same samples "
          f"{window['from_samples']:,}-{window['to_samples']:,}: "
          f"{window['ray_1x1']['cpu_s_per_100k']:.2f} / {window['single']['cpu_s_per_100k']:.2f}"
          f" = {result['cpu_ratio_1x1_vs_single']:.2f} (target <= 1.3; each over its own "
          f"window: {result['cpu_ratio_1x1_vs_single_own_windows']:.2f})")
    delay = result["delay_phase"]
    print(f"  {workers} x {shards}, delay p50/p99 at {args.rate:,.0f} samples/s, exports every "
          f"{args.export_every} s ({delay['exports']} exports): {delay['delay_p50_s']} / "
          f"{delay['delay_p99_s']} s; arrived after the first step (steady state): "
          f"{delay['steady_delay_p50_s']} / {delay['steady_delay_p99_s']} s   target p99 < 10 s")
    paper = result["on_paper"]
    print(f"  on paper ({json.dumps(paper['inputs'])}):")
    for row in paper["rows"]:
        print(f"    {row['workers']:>4} workers x {row['shards']} shards: "
              f"{row['samples_per_sec']:>12,} samples/s (compute alone "
              f"{row['compute_bound_samples_per_sec']:,}), limited by {row['limited_by']}; "
              f"{row['network_bytes_per_sec_per_node'] / 1e6:,.0f} MB/s per node, "
              f"{row['network_bytes_per_sec_total'] / 1e9:,.1f} GB/s in all; 1B rows: "
              f"{row['shard_memory_gib_at_1b']} GiB per shard")
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    run()
