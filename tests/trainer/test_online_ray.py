"""Online learning on Ray against a real broker and a real local Ray cluster: 2 workers x 2
shards started from a batch run equal a single process replaying the same steps from it
(expiry included), every message trains exactly once, the driver reports as a single process
does (status.json, Prometheus metrics, TensorBoard), the serving export follows the shards, and
a SIGKILL of a worker, of a shard or of the driver loses and repeats nothing."""

import ast
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pyarrow as pa
import pytest
import yaml
from confluent_kafka import Consumer, TopicPartition

import compression
import native
import schemas
from compression.messages import DeadLetter, decode_json_samples
from trainer.checkpoints import CheckpointManager, dense_name
from trainer.distributed.manifest import read_manifest

ray = pytest.importorskip("ray")

SCHEMA = {"name": "online_ray_test", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"},
                                                   {"name": "age", "kind": "id"}]},
    {"name": "sample", "key": ["sid"], "features": [
        {"name": "sid", "kind": "id"},
        {"name": "price", "kind": "dense", "dim": 1}]}]}  # resolved on the first step
CONFIG = {"batch_size": 200, "seed": 3, "threads": 1,
          "embedding": {"dim": 4, "optimizer": {"name": "adagrad", "lr": 0.1},
                        "initializer": {"name": "normal", "stddev": 0.01}}}
PARTITIONS = 4
BATCH_SIDS = 10**6  # sample ids of the batch run a test starts from: above every online one


def sample(sid: int) -> tuple[bytes, bytes, None, None, int]:
    """A message whose sample id ``sid`` is its own feature: its row counts its trainings."""
    uid = sid % 37
    value = {"uid": uid, "age": uid % 5, "sid": sid, "price": [float(sid % 13) * 2.5],
             "click": float((sid * 7 + uid) % 5 == 0)}
    return str(uid).encode(), json.dumps(value).encode(), None, None, uid % PARTITIONS


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("online_ray")
    (root / "schema.yaml").write_text(yaml.safe_dump(SCHEMA))
    (root / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    return str(root / "schema.yaml"), str(root / "config.yaml")


@pytest.fixture(scope="module")
def ray_address(cluster):
    """The module's cluster, which the runs under test join (in this process or a child)."""
    return ray.get_runtime_context().gcs_address


def command(files, broker, topic, group, run_dir, ray_address, *extra, workers=2,
            shards=2, config=True) -> list[str]:
    """``config``: False with ``--init-from`` (the batch run's config is taken)."""
    schema_path, config_path = files
    return ["--schema", schema_path, *(["--config", config_path] if config else []),
            "--bootstrap-servers", broker.bootstrap, "--topic", topic, "--group", group,
            "--run-dir", run_dir, "--workers", str(workers), "--shards", str(shards),
            "--ray-address", ray_address, "--step-log", *extra]


def batch_run(run_dir, sids, shards=None, config=None) -> str:
    """A batch run (``RUN_DIR/checkpoint``, as ``trainer.train`` keeps it) that trained the
    samples ``sids`` in batches of 200 with ``config`` (default CONFIG): in process, or with
    ``shards`` on the module's Ray cluster (1 worker). What ``--init-from`` starts from, so
    the Ray run and its replay train its model: an MLP with tanh, not ReLU, so that their float
    rounding (two workers' gradients summed, not one union batch's) stays float rounding: with
    ReLU, a hidden unit's input within ~1e-7 of zero has opposite signs in the two now and then,
    Adam turns that step's gradient difference into a ~1e-4 weight difference, and over a few
    hundred steps the gap outgrows the tolerance."""
    from trainer import Trainer, models
    from trainer.config import TrainConfig
    from trainer.distributed import DistributedTrainer

    schema = schemas.from_dict(SCHEMA)
    config = TrainConfig.from_dict(config or CONFIG)
    table, _ = decode_json_samples([sample(s)[1] for s in sids], schema)
    if shards:
        with DistributedTrainer(schema, models.MLP(activation="tanh"), config, workers=1,
                                shards=shards) as trainer:
            trainer.fit(table, shuffle=False)
            trainer.save(os.path.join(run_dir, "checkpoint"))
        return run_dir
    trainer = Trainer(schema, models.MLP(activation="tanh"), config)
    for batch in compression.iter_batches(compression.build_trees(table, schema), schema,
                                          CONFIG["batch_size"]):
        trainer.train_batch(batch)
    trainer.save(os.path.join(run_dir, "checkpoint"))
    return run_dir


class Messages:
    """What the test produced: (partition, offset) -> message value."""

    def __init__(self):
        self.by_offset: dict[tuple[int, int], bytes] = {}
        self.lock = threading.Lock()

    def produce(self, broker, topic, sids, messages=None) -> None:
        messages = messages or [sample(s) for s in sids]
        offsets = broker.produce(topic, messages)
        with self.lock:
            for (_, value, _, _, partition), offset in zip(messages, offsets):
                self.by_offset[partition, offset] = value

    def __len__(self):
        return len(self.by_offset)


def unit_batches(messages: Messages, ranges: dict, batch_size: int) -> list:
    """The batches a worker cut from its unit of ``ranges``: its messages in partition, then
    offset order (malformed ones dropped), compressed at once, in batches of ``batch_size``."""
    schema = schemas.from_dict(SCHEMA)
    values = [messages.by_offset[int(p), offset]
              for p, (first, end) in sorted(ranges.items(), key=lambda r: int(r[0]))
              for offset in range(first, end)]
    table, _ = decode_json_samples(values, schema)
    return list(compression.iter_batches(compression.build_trees(table, schema), schema,
                                         batch_size))


def replay(run_dir, messages: Messages, init_from=None, expire_every=None):
    """A single-process Trainer that trained, step by step, the union batches the step log
    of ``run_dir`` records (every worker's batch side by side, in worker order: the
    ``batch``-th batch of its unit, whose ranges the step of its last batch records), from the
    batch run ``init_from`` (else a new model with CONFIG), its expiry every ``expire_every``
    steps when given (``--expire-every``)."""
    from trainer.distributed.worker import worker_batch_size
    from trainer import Trainer, models
    from trainer.config import TrainConfig

    schema = schemas.from_dict(SCHEMA)
    single = (Trainer.restore_run(init_from) if init_from else
              Trainer(schema, models.MLP(), TrainConfig.from_dict(CONFIG)))
    calibrate = init_from is None  # a new run shifts its output bias on its first step
    if expire_every is not None:
        single.config = single.config.with_expire_every(expire_every)
    first_step, first_samples = single.step, single.samples
    trained = []
    with open(os.path.join(run_dir, "steps.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    # the union is what is checked: steps in which both workers trained
    assert any(all(w["samples"] for w in step["workers"]) for step in steps)
    # per step and worker, the batch it trained: a unit's batches are trained by successive
    # steps of its worker, the last one's step records the unit's ranges (a restart, which
    # may change the workers, comes after a checkpoint: when no unit was partly trained)
    trained_batches: dict = {}
    pending: dict = {}  # worker -> [(step number, index, batches)] of its unit not ended yet
    for number, step in enumerate(steps):
        workers = len(step["workers"])
        assert all(w < workers for w in pending), "the workers changed in a unit"
        for w, entry in enumerate(step["workers"]):
            if entry["batch"] is not None:
                pending.setdefault(w, []).append((number, *entry["batch"]))
                assert entry["batch"][0] == len(pending[w]) - 1
            if entry["ranges"]:
                size = worker_batch_size(single.config.batch_size, w, workers)
                batches = unit_batches(messages, entry["ranges"], size)
                unit = pending.pop(w, [])
                assert [m for *_, m in unit] == [len(batches)] * len(unit)
                for (at, _, _), batch in zip(unit, batches):
                    trained_batches[at, w] = batch
    assert not pending, "a unit not ended at the last step"
    for number, step in enumerate(steps):
        assert step["step"] == first_step + number + 1
        trained += [(int(p), offset) for worker in step["workers"]
                    for p, (first, end) in worker["ranges"].items()
                    for offset in range(first, end)]
        batches = [trained_batches[number, w] for w in range(len(step["workers"]))
                   if (number, w) in trained_batches]
        assert [b.num_leaves for b in batches] == [w["samples"] for w in step["workers"]
                                                   if w["samples"]]
        union = compression.TreeBatch.concat(batches)
        if calibrate:
            calibrate = False
            single.resolve_dense(union)
            single.calibrate_output(union)
        single.train_batch(union)
    # units of several batches: the runs below poll units larger than a worker's batch
    assert any(w["batch"] is not None and w["batch"][1] > 1
               for step in steps for w in step["workers"]), "no unit of several batches"
    return single, trained, first_samples


def checkpointed_rows(model_dir: str, table: str) -> dict:
    """A table's rows over every shard of a distributed checkpoint, by id."""
    manifest = read_manifest(model_dir)
    parts = [native.EmbeddingStore.load(os.path.join(model_dir, d, table)).to_numpy()
             for d in manifest["shard_dirs"]]
    rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.argsort(rows["ids"])
    return {k: v[order] for k, v in rows.items()}


def assert_equals_replay(run_dir, messages: Messages, total: int, broker, topic, group,
                         malformed: int = 0, init_from=None, expire_every=None):
    """Returns the single-process replay (see :func:`replay`)."""
    latest = CheckpointManager(run_dir).latest()
    model_dir = os.path.join(latest.path, "model")
    manifest = read_manifest(model_dir)
    single, trained, before = replay(run_dir, messages, init_from, expire_every)
    # every message produced trained once, in exactly one step of the model's lineage
    assert len(trained) == len(set(trained)) == total + malformed == len(messages)
    assert set(trained) == set(messages.by_offset)
    assert manifest["step"] == single.step
    assert manifest["samples"] == single.samples == before + total
    offsets = manifest["online"]["offsets"]
    assert offsets == {str(p): 1 + max(o for q, o in messages.by_offset if q == p)
                       for p in range(PARTITIONS)}
    # count per key: every sample's own id has a row, updated exactly once (those of the
    # batch run started from: once, by it)
    rows = checkpointed_rows(model_dir, "sid")
    online = rows["ids"] < BATCH_SIDS
    assert rows["ids"][online].tolist() == list(range(total))
    assert set(rows["update_counts"].tolist()) == {1}
    assert len(rows["ids"]) - total == (before if init_from else 0)
    # the model equals the single-process replay: rows, optimizer state, counters, dense
    for table, store in single.stores.items():
        got = checkpointed_rows(model_dir, table)
        want = store.to_numpy()
        order = np.argsort(want["ids"])
        want = {k: v[order] for k, v in want.items()}
        np.testing.assert_array_equal(got["ids"], want["ids"], err_msg=table)
        for key in ("values", "state"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{table} {key}")
        for key in ("update_counts", "last_steps"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{table} {key}")
    assert manifest["config"]["dense"] == single.config.to_dict()["dense"]
    with np.load(os.path.join(model_dir, "dense.npz")) as dense:
        want = single.dense_arrays()
        assert sorted(dense.files) == sorted(want)
        for name in want:
            np.testing.assert_allclose(dense[name], want[name], rtol=1e-5, atol=1e-7,
                                       err_msg=name)
    # Kafka's committed offsets are the checkpoint's
    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group})
    committed = consumer.committed([TopicPartition(topic, p) for p in range(PARTITIONS)],
                                   timeout=10)
    consumer.close()
    assert {str(tp.partition): tp.offset for tp in committed} == offsets
    return single


def scrape(url: str) -> dict:
    """A Prometheus endpoint's samples, by name."""
    with urllib.request.urlopen(url, timeout=30) as response:
        return {line.split(" ")[0]: float(line.split(" ")[1])
                for line in response.read().decode().splitlines()
                if line and not line.startswith("#")}


def scalars(log_dir: str) -> dict:
    """TensorBoard scalars of ``log_dir``'s event files: tag -> [(step, value), ...]."""
    import tensorflow as tf

    out: dict = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                out.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor))))
    return out


def test_two_workers_two_shards_from_a_batch_run_equal_a_replay_and_serve_every_step(
        kafka_broker, files, ray_address, tmp_path):
    """A 2 x 2 run initialised from a single-process batch run (its one store per table
    resharded into 2 shards) equals the replay from the same model, with dead letters, expiry
    every step (``--expire-every 1``: the rows of users a step did not train are removed) and
    the driver's reports: status.json, /metrics while it runs and TensorBoard scalars,
    aggregated over the workers and the shards. The workers read units of 2-3 batches
    (``--unit-samples 500``: 250 samples a worker, batches of 100), so every export (due after
    every step) and checkpoint waits for their units to drain. Its serving export, a version
    published whenever a unit boundary allows, holds the final model."""
    from trainer import online
    from trainer.serving import Predictor, one_node_per_sample, published_versions, \
        request_table

    # the batch run's config is the online run's (--init-from): its expiry is due every 1000
    # steps, so the batch run's 2 steps expire nothing; --expire-every 1 reschedules it
    expiring = {**CONFIG, "tables": {"uid": {"expire": {"every_steps": 1000,
                                                        "max_idle_steps": 0}}}}
    batch = batch_run(str(tmp_path / "batch"), range(BATCH_SIDS, BATCH_SIDS + 400),
                      config=expiring)
    topic = kafka_broker.create_topic(partitions=PARTITIONS)
    messages = Messages()
    messages.produce(kafka_broker, topic, range(2000))
    # malformed messages on a partition of each worker, the last ones after every good one
    bad = [(b"k", b"not json %d" % i, None, None, 1 + i % 2) for i in range(120)]
    messages.produce(kafka_broker, topic, None, bad)
    run_dir, export_dir = str(tmp_path / "run"), str(tmp_path / "export")
    scraped: list = []

    def scrape_while_it_trains():
        """/metrics once status.json shows a trained step (the run then lives on for at
        least --idle-exit s after its last message)."""
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not done.is_set():
            try:
                with open(os.path.join(run_dir, "status.json")) as f:
                    status = json.load(f)
            except FileNotFoundError:
                status = None
            if status is not None and status["samples"] > 0:
                scraped.append(scrape(status["metrics_url"]))
                return
            time.sleep(0.05)

    done = threading.Event()
    scraper = threading.Thread(target=scrape_while_it_trains, daemon=True)
    scraper.start()
    try:
        summary = online.run(command(
            files, kafka_broker, topic, "g-ray", run_dir, ray_address,
            "--idle-exit", "2", "--checkpoint-every", "0.5", "--expire-every", "1",
            "--metrics-port", "0", "--report-every", "0.2", "--init-from", batch,
            "--export-dir", export_dir, "--export-every", "0", "--unit-samples", "500",
            config=False))
    finally:
        done.set()
        scraper.join()
    assert summary["samples"] == 2000 and summary["messages"] == 2000 + len(bad)
    assert summary["assignment"] == [[0, 2], [1, 3]]
    assert summary["pv"]["samples"] == 2000
    # each worker sent what it read to the dead-letter topic and went on
    assert summary["dead_letters"] == len(bad)
    # each exactly once, its record naming its partition and offset
    letters = [DeadLetter.from_message(m.value(), m.headers(), m.key())
               for m in kafka_broker.consume_all(f"{topic}.dlq", idle_seconds=1.0)]
    assert sorted((d.partition, d.offset, d.value) for d in letters) == sorted(
        (p, o, value) for (p, o), value in messages.by_offset.items()
        if value.startswith(b"not json"))
    assert {d.partition for d in letters} == {1, 2}
    single = assert_equals_replay(run_dir, messages, 2000, kafka_broker, topic, "g-ray",
                                  len(bad), init_from=batch, expire_every=1)
    # the shards expired what one process expires on the same steps (rows compared above)
    assert summary["expired"] == single.store_stats()["expired"] > 0
    # the Prometheus endpoint reported the run while it trained, summed over the actors
    assert len(scraped) == 1, "status.json never showed a trained step"
    metrics = scraped[0]
    assert 0 < metrics["prefixrec_online_samples_total"] <= 2000
    assert metrics["prefixrec_online_store_rows"] > 0 and "prefixrec_online_pv_auc" in metrics
    assert metrics["prefixrec_online_broker_reachable"] == 1.0
    # the final status.json is the summary
    with open(os.path.join(run_dir, "status.json")) as f:
        status = json.load(f)
    assert status["metrics_url"] == summary["metrics_url"] and status["metrics_url"]
    for key in ("samples", "messages", "dead_letters", "steps", "pv", "expired", "store_rows",
                "checkpoints", "offsets", "workers", "shards", "assignment", "exports",
                "delay_s"):
        assert status[key] == summary[key], key
    assert status["assigned"] == [0, 1, 2, 3] and status["lag"] == 0
    assert status["broker_reachable"] is True and status["idle_s"] >= 0
    # TensorBoard: the single process's tags, from the driver; the last point is the end
    points = scalars(os.path.join(run_dir, "online"))
    assert {"samples_per_sec", "waited_for_input", "lag_messages", "dead_letters",
            "store/rows", "store/admitted", "store/rejected", "store/expired", "pv/auc",
            "pv/logloss"} <= set(points)
    assert points["store/expired"][-1] == (summary["steps"], summary["expired"])
    assert points["dead_letters"][-1][1] == len(bad)
    # --export-every 0: after every step of the run at which no unit was partly trained (the
    # batch run's 2 came before), the first a full export, each later one a version of every
    # shard's deltas
    steps = summary["steps"] - 2
    exports = summary["exports"]
    assert 2 <= exports < steps  # units of several batches drained before each export
    assert published_versions(export_dir) == list(range(1, exports))
    delay = summary["delay_s"]
    assert 0 < delay["p50"] <= delay["p99"]
    predictor = Predictor(export_dir)
    assert predictor.shards == 2
    predictor.update()
    assert predictor.version == exports - 1 and predictor.dense_step == summary["steps"]
    # serving holds the run's final model: every shard's rows, the dense weights
    model_dir = os.path.join(CheckpointManager(run_dir).latest().path, "model")
    for table, store in predictor.stores.items():
        for i, served in enumerate(store.shards):
            got = served.to_numpy()
            want = native.EmbeddingStore.load(
                os.path.join(model_dir, f"shard-{i:04d}", table)).to_numpy()
            got_order, want_order = np.argsort(got["ids"]), np.argsort(want["ids"])
            np.testing.assert_array_equal(got["ids"][got_order], want["ids"][want_order])
            np.testing.assert_array_equal(got["values"][got_order],
                                          want["values"][want_order], err_msg=table)
    with np.load(os.path.join(model_dir, "dense.npz")) as dense:
        for i, variable in enumerate(predictor.model.variables_):
            np.testing.assert_array_equal(variable.numpy(), dense[dense_name("model", i)])
    # and it predicts what the replay's model predicts
    rows = [json.loads(sample(s)[1]) for s in range(0, 2000, 40)]
    schema = schemas.from_dict(SCHEMA)
    want = single.predict([one_node_per_sample(request_table(rows, schema), schema)])
    np.testing.assert_allclose(predictor.predict(rows), want, rtol=1e-4, atol=1e-6)


def test_flags_without_a_meaning_on_ray_are_refused_with_the_reason(kafka_broker, files,
                                                                      tmp_path, capsys):
    """Before any actor starts: --unit-samples below 1 and --expire-every with no expiry in
    the config."""
    from trainer import online

    argv = command(files, kafka_broker, "t-refused", "g-refused", str(tmp_path / "run"),
                   "auto")
    for flag, reason in ((["--unit-samples", "0"], "--unit-samples: expected at least 1"),
                         (["--expire-every", "5"], "no table has an expiry to schedule")):
        with pytest.raises(SystemExit) as exit:
            online.run([*argv, *flag])
        assert exit.value.code == 2 and reason in capsys.readouterr().err, flag


class Streaming:
    """A thread producing chunks of new sample ids until :meth:`stop` (each chunk delivered
    before the next one starts). With ``run_dir``, a chunk is produced only while the run's
    latest checkpoint trails the messages produced by at most ``ahead`` samples (``base``:
    the samples the run started with): the data grows with the run's steps, not with the
    wall time. On a loaded machine the time-paced stream had produced 12,800-36,700 samples by
    the time the kills were done, and the run's float-rounding distance to its replay (the
    union batch's sums are ordered otherwise than the workers') had hundreds of steps to flip
    a ReLU and grow past the comparison's tolerance."""

    def __init__(self, messages: Messages, broker, topic, first: int, chunk=100, pause=0.2,
                 run_dir=None, base=0, ahead=600):
        self.next = first
        self._stop = threading.Event()

        def trails() -> bool:
            state = latest_state(run_dir)
            return state is not None and state["samples"] - base >= self.next - ahead

        def stream():
            while not self._stop.is_set():
                if run_dir is not None and not trails():
                    self._stop.wait(0.05)
                    continue
                messages.produce(broker, topic, range(self.next, self.next + chunk))
                self.next += chunk
                self._stop.wait(pause)

        self._thread = threading.Thread(target=stream, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        """Stop; the next sample id."""
        self._stop.set()
        self._thread.join()
        return self.next


def latest_state(run_dir) -> dict | None:
    """The state of the checkpoint LATEST names, read without a CheckpointManager (whose
    constructor removes temporary directories: the running writer's among them)."""
    directory = os.path.join(run_dir, "checkpoints")
    try:
        with open(os.path.join(directory, "LATEST")) as f:
            name = f.read().strip()
        with open(os.path.join(directory, name, "state.json")) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):  # none yet, or pruned meanwhile
        return None


def wait_for_checkpoint(process, run_dir, condition, timeout=180) -> dict:
    """The state of the first checkpoint that meets ``condition``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the run ended before the checkpoint awaited"
        state = latest_state(run_dir)
        if state is not None and condition(state):
            return state
        time.sleep(0.05)
    raise TimeoutError("no checkpoint of the kind awaited")


ROLLED_BACK = r"rolled back to the checkpoint of step (\d+)"


def wait_for_log(process, log_path, find, timeout=180):
    """The first value ``find(the run's log so far)`` returns that is not None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the run ended before the log line awaited"
        found = find(log_path.read_text())
        if found is not None:
            return found
        time.sleep(0.05)
    raise TimeoutError("no log line of the kind awaited")


def actor_pids(process, log_path, rollbacks: int) -> dict:
    """The actors' process ids, once the run rolled back ``rollbacks`` times (it logs them
    at start and after every rollback)."""
    def find(text):
        logged = re.findall(r"actor processes (\{.*\})", text)
        return ast.literal_eval(logged[rollbacks]) if len(logged) > rollbacks else None
    return wait_for_log(process, log_path, find)


def test_sigkills_of_a_worker_a_shard_and_the_driver_lose_and_repeat_nothing(
        kafka_broker, files, ray_address, tmp_path):
    """One run, started from a Ray batch run of 1 worker x 3 shards (resharded into 2): a
    worker's process killed (the driver rolls every actor back to the last checkpoint and goes
    on), then a shard's, then the driver's; the rerun, with 1 worker and 3 shards (resharded
    again), takes every partition's offset from the checkpoint (not the batch run's model:
    --init-from is ignored) and SIGTERM ends it cleanly."""
    batch = batch_run(str(tmp_path / "batch"), range(BATCH_SIDS, BATCH_SIDS + 400), shards=3)
    kept = read_manifest(os.path.join(batch, "checkpoint"))
    batch_steps, batch_samples = kept["step"], kept["samples"]
    assert (kept["shards"], batch_samples) == (3, 400)
    topic = kafka_broker.create_topic(partitions=PARTITIONS)
    messages = Messages()
    messages.produce(kafka_broker, topic, range(1000))
    run_dir = str(tmp_path / "run")
    argv = [sys.executable, "-m", "trainer.online",
            *command(files, kafka_broker, topic, "g-kill", run_dir, ray_address,
                     "--checkpoint-every", "0.5", "--report-every", "0.05",
                     "--unit-samples", "700", "--init-from", batch, config=False)]
    log_path = tmp_path / "killed.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=log)
        try:
            first = wait_for_checkpoint(process, run_dir,
                                        lambda s: s["step"] > batch_steps)["step"]
            producer = Streaming(messages, kafka_broker, topic, 1000,  # while it trains on
                                     run_dir=run_dir, base=batch_samples)
            try:
                # a worker, then a shard, each killed once the run trained past its latest
                # checkpoint (as reported): the run rolls every actor back to it, trains on
                for rollback, (kind, index) in enumerate([("workers", 0), ("shards", 1)]):
                    pids = actor_pids(process, log_path, rollback)
                    step = wait_for_checkpoint(process, run_dir, lambda s: True)["step"]
                    wait_for_log(process, log_path, lambda text: any(  # since the rollback
                        int(k) > step for k in re.findall(r"samples/s\), step (\d+)",
                                                          text[text.rfind("actor processes"):]))
                        or None)
                    os.kill(pids[kind][index], signal.SIGKILL)
                actor_pids(process, log_path, 2)
                rolled_back_to = int(re.findall(ROLLED_BACK, log_path.read_text())[-1])
                killed_at = wait_for_checkpoint(
                    process, run_dir, lambda s: s["step"] > max(first, rolled_back_to) + 2)["step"]
                process.send_signal(signal.SIGKILL)  # no chance to checkpoint or commit
                process.wait()
            finally:
                total = producer.stop()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    # the checkpoint the restart finds is the kill's or a later one it wrote meanwhile
    restored = CheckpointManager(run_dir).latest()
    assert restored.step >= killed_at
    # read now: the restarted run prunes old checkpoints
    restored_samples = read_manifest(os.path.join(restored.path, "model"))["samples"]
    assert len(re.findall(ROLLED_BACK, log_path.read_text())) == 2
    messages.produce(kafka_broker, topic, range(total, total + 100))  # after the kill
    total += 100
    # the restart, with another assignment (every partition on one worker) and resharded,
    # trains the rest; SIGTERM then finishes the step, checkpoints, commits, exit 0
    argv = [sys.executable, "-m", "trainer.online",
            *command(files, kafka_broker, topic, "g-kill", run_dir, ray_address,
                     "--checkpoint-every", "0.3", "--init-from", batch, workers=1, shards=3,
                     config=False)]
    with open(tmp_path / "restarted.log", "w") as log:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            wait_for_checkpoint(process, run_dir,
                                lambda s: s["samples"] == batch_samples + total)
            process.send_signal(signal.SIGTERM)
            stdout, _ = process.communicate(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 0, (tmp_path / "restarted.log").read_text()[-3000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["samples"] == batch_samples + total - restored_samples
    assert summary["assignment"] == [list(range(PARTITIONS))] and summary["shards"] == 3
    assert f"--init-from {batch} ignored" in (tmp_path / "restarted.log").read_text()
    assert_equals_replay(run_dir, messages, total, kafka_broker, topic, "g-kill",
                         init_from=batch)


def test_a_worker_takes_the_first_batch_that_arrives_and_reports_dead_letters(
        kafka_broker, files):
    """The dense statistics wait for the first batch of any worker: a worker asked before
    anything arrived answers nothing and takes the batch that arrives later; a poll of
    malformed messages only is reported with its offsets (no Ray: the actor class in
    process)."""
    from trainer import models
    from trainer.config import TrainConfig
    from trainer.distributed.online_worker import OnlineWorker
    from trainer.distributed.worker import resolve_dense, unresolved_dense

    schema, config = schemas.from_dict(SCHEMA), TrainConfig.from_dict(CONFIG)
    topic = kafka_broker.create_topic(partitions=1)
    worker = OnlineWorker(0, 1, 1, schema.to_dict(), models.MLP().spec(), config.to_dict())
    worker.open({"bootstrap_servers": kafka_broker.bootstrap, "topic": topic, "group": "g-w",
                 "options": {}, "dlq_topic": None, "max_message_bytes": 1 << 20}, [0], {},
                poll_timeout=0.2)
    try:
        names = unresolved_dense(schema, config)
        assert worker.first_dense_sample(names) == (None, None)  # nothing produced yet
        kafka_broker.produce(topic, [(b"k", b"{", None, None, 0)] * 3)

        def next_round():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                sample, consumed = worker.first_dense_sample(names)
                if sample is not None or consumed is not None:
                    return sample, consumed
            raise TimeoutError("nothing arrived")

        assert next_round() == (None, {"ranges": {0: [0, 3]}, "messages": 3, "dead": 3})
        kafka_broker.produce(topic, [sample(s)[:4] + (0,) for s in range(50)])
        found, consumed = next_round()
        assert consumed is None and len(found["price"][0]) == 50
        worker.set_config(resolve_dense(schema, config, [found]).to_dict())
        meta, request = worker.next_step()  # the batch held for the first step
        assert meta["n"] == 50
        rows = {table: np.zeros((len(ids), CONFIG["embedding"]["dim"]), np.float32)
                for table, ids in request.items()}  # what the shard would send
        result = worker.train_step(rows)[0]
        assert result["n"] == 50
        assert result["consumed"] == {"ranges": {0: [3, 53]}, "messages": 50, "dead": 0}
    finally:
        worker.close_source()


def test_a_worker_reopened_at_its_trained_offsets_dead_letters_each_message_once(
        kafka_broker, files):
    """A worker's reader polls units ahead of the steps; when the driver opens its partitions
    again at the trained offsets (partitions dealt anew at a checkpoint; the end of a run and
    its restart alike) the units held are dropped and read again: every malformed message
    still reaches the dead-letter topic exactly once, its record naming its partition and
    offset (no Ray: the actor class in process, driven as the driver drives it)."""
    from trainer import models
    from trainer.config import TrainConfig
    from trainer.distributed.online_worker import OnlineWorker
    from trainer.distributed.worker import resolve_dense, unresolved_dense

    schema, config = schemas.from_dict(SCHEMA), TrainConfig.from_dict(CONFIG)
    topic = kafka_broker.create_topic(partitions=2)
    produced = []
    for s in range(600):  # a malformed message after every 12th sample, on both partitions
        produced.append(sample(s)[:4] + (s % 2,))
        if s % 12 == 11:
            produced.append((b"bad", b"not json %d" % s, None, None, s % 2))
    # and 120 in a row on partition 1: a poll may hold malformed messages only
    produced += [(b"bad", b"not json run %d" % i, None, None, 1) for i in range(120)]
    offsets = kafka_broker.produce(topic, produced)
    malformed = sorted((m[4], o) for m, o in zip(produced, offsets) if m[0] == b"bad")
    ends = {p: 1 + max(o for m, o in zip(produced, offsets) if m[4] == p) for p in (0, 1)}
    spec = {"bootstrap_servers": kafka_broker.bootstrap, "topic": topic, "group": "g-dlq",
            "options": {}, "dlq_topic": None, "max_message_bytes": 1 << 20}
    worker = OnlineWorker(0, 1, 1, schema.to_dict(), models.MLP().spec(), config.to_dict())
    trained, reported = {}, 0  # partition -> next offset trained; dead letters reported

    def record(consumed):
        nonlocal reported
        if consumed is not None:
            reported += consumed["dead"]
            for p, (_, end) in consumed["ranges"].items():
                trained[p] = max(trained.get(p, 0), end)

    def held_dead_letters():
        """Once the reader has filled the queue: the malformed messages it holds untrained."""
        deadline = time.monotonic() + 60
        while not worker._items.full():
            assert time.monotonic() < deadline, "the reader did not poll ahead"
            time.sleep(0.01)
        return sum(unit.report()["dead"] for unit in list(worker._items.queue))

    def step(request):
        rows = {t: np.zeros((len(ids), CONFIG["embedding"]["dim"]), np.float32)
                for t, ids in request.items()}
        result, _, (_, _, request) = worker.train_step(rows)
        record(result["consumed"])
        return result, request

    worker.open(spec, [0, 1], {}, poll_timeout=0.2, unit_samples=100)
    try:
        names = unresolved_dense(schema, config)
        deadline = time.monotonic() + 60
        while True:
            found, consumed = worker.first_dense_sample(names)
            record(consumed)
            if found is not None:
                break
            assert time.monotonic() < deadline, "nothing arrived"
        worker.set_config(resolve_dense(schema, config, [found]).to_dict())
        _, request = worker.next_step()
        result, request = step(request)
        assert held_dead_letters() > 0
        # as before a checkpoint: no new unit, the current one trained to its end
        worker.drain(True)
        while result["n"] or result["consumed"] is not None:
            result, request = step(request)
        assert trained and held_dead_letters() > 0  # polled, not trained: dropped now
        worker.open(spec, [0, 1], trained, poll_timeout=0.2, unit_samples=100)
        _, request = worker.next_step()
        deadline = time.monotonic() + 120
        while trained != ends:
            assert time.monotonic() < deadline, f"trained {trained} of {ends}"
            _, request = step(request)
        assert worker.flush_dead_letters(10)
    finally:
        worker.close_source()
    letters = [DeadLetter.from_message(m.value(), m.headers(), m.key())
               for m in kafka_broker.consume_all(f"{topic}.dlq", idle_seconds=1.0)]
    assert reported == len(malformed)
    assert sorted((d.partition, d.offset) for d in letters) == malformed  # each once
    assert {d.topic for d in letters} == {topic}


def test_a_worker_reads_tree_messages_in_units_of_about_its_samples(kafka_broker, files):
    """``--format trees`` on Ray: a worker's unit is as many tree messages as hold about its
    share of ``--unit-samples`` (one message at first, then as the samples per message so
    far suggest), cut into the batches a replay of the unit's offset ranges makes, and every
    sample is trained once (no Ray: the actor class in process)."""
    from trainer import models
    from trainer.config import TrainConfig
    from trainer.distributed.online_worker import OnlineWorker
    from trainer.distributed.worker import resolve_dense, unresolved_dense

    schema, config = schemas.from_dict(SCHEMA), TrainConfig.from_dict(CONFIG)
    table, _ = decode_json_samples([sample(s)[1] for s in range(1200)], schema)
    trees = compression.build_trees(table, schema)
    # one message per user (as pipelines.stream_compress writes a window), partition uid % 2
    by_offset, produced = {}, {0: 0, 1: 0}
    messages = []
    for i, uid in enumerate(trees.column("uid").to_pylist()):
        value = compression.encode_trees(trees.slice(i, 1))
        partition = uid % 2
        messages.append((str(uid).encode(), value, None, None, partition))
        by_offset[partition, produced[partition]] = value
        produced[partition] += 1
    topic = kafka_broker.create_topic(partitions=2)
    kafka_broker.produce(topic, messages)
    worker = OnlineWorker(0, 1, 1, schema.to_dict(), models.MLP().spec(), config.to_dict())
    worker.open({"bootstrap_servers": kafka_broker.bootstrap, "topic": topic, "group": "g-t",
                 "options": {}, "dlq_topic": None, "max_message_bytes": 1 << 20,
                 "format": "trees"}, [0, 1], {}, poll_timeout=0.2, unit_samples=300)
    try:
        names = unresolved_dense(schema, config)
        deadline = time.monotonic() + 60
        while (found := worker.first_dense_sample(names)[0]) is None:
            assert time.monotonic() < deadline, "nothing arrived"
        worker.set_config(resolve_dense(schema, config, [found]).to_dict())
        meta, request = worker.next_step()
        units, sizes, trained = [], [], 0
        while trained < 1200:
            rows = {t: np.zeros((len(ids), CONFIG["embedding"]["dim"]), np.float32)
                    for t, ids in request.items()}
            result, _, (_, _, request) = worker.train_step(rows)
            trained += result["n"]
            sizes.append(result["n"])
            if result["consumed"] is not None:
                units.append((result["consumed"]["ranges"], sizes))
                assert len(result["arrivals_ms"]) == sum(sizes)
                sizes = []
        assert trained == 1200 and not sizes
        decode = compression.TreeMessageDecoder(schema.tree_arrow_schema(), schema.name)
        ends = {0: 0, 1: 0}
        for ranges, sizes in units:
            values = []
            for p, (first, end) in sorted(ranges.items()):
                assert first == ends[p]  # contiguous: no message skipped or read twice
                ends[p] = end
                values += [by_offset[p, o] for o in range(first, end)]
            replayed = compression.iter_batches(
                pa.concat_tables([decode(v) for v in values]), schema, 200)
            assert [b.num_leaves for b in replayed] == sizes
        assert ends == produced
        assert len(units[0][0]) == 1 and sum(e - f for f, e in units[0][0].values()) == 1
        assert len(units) < len(messages) / 2  # later units hold many messages
    finally:
        worker.close_source()


def test_a_new_run_shifts_every_workers_output_bias_by_the_first_union_batch(kafka_broker,
                                                                            files):
    """A new Ray run starts, as a single process does, at the first step's label rate: every
    worker's outputs on its first batch (rows looked up without admitting any) make the union
    batch's, and each worker shifts its bias by what ``Trainer.calibrate_output`` finds on
    that union batch (no Ray: the actor classes in process, the driver's gathering as it
    does it)."""
    from trainer import Trainer, models
    from trainer.config import TrainConfig
    from trainer.distributed.online import union_outputs
    from trainer.distributed.online_worker import OnlineWorker
    from trainer.distributed.shard import Shard, table_specs
    from trainer.distributed.worker import resolve_dense, unresolved_dense

    schema, config = schemas.from_dict(SCHEMA), TrainConfig.from_dict(CONFIG)
    topic = kafka_broker.create_topic(partitions=PARTITIONS)
    kafka_broker.produce(topic, [sample(s) for s in range(400)])
    spec = {"bootstrap_servers": kafka_broker.bootstrap, "topic": topic, "group": "g-c",
            "options": {}, "dlq_topic": None, "max_message_bytes": 1 << 20}
    workers = [OnlineWorker(w, 2, 1, schema.to_dict(), models.MLP().spec(), config.to_dict())
               for w in range(2)]
    shard = Shard(0, 1, table_specs(config, workers[0].core.tables, 1))
    try:
        for w, worker in enumerate(workers):
            worker.open(spec, [p for p in range(PARTITIONS) if p % 2 == w], {}, 0.2)
        names, found = unresolved_dense(schema, config), []
        for worker in workers:
            deadline = time.monotonic() + 60
            while (first := worker.first_dense_sample(names)[0]) is None:
                assert time.monotonic() < deadline, "nothing arrived"
            found.append(first)
        resolved = resolve_dense(schema, config, found)
        first_batches = [worker._held.batches[0] for worker in workers]
        single = Trainer(schema, models.MLP(), resolved)
        single.set_dense_arrays(workers[0].core.dense_arrays())
        requests = []
        for worker in workers:
            worker.set_config(resolved.to_dict())
            requests.append(worker.next_step()[1])
        rows = shard.lookup(False, *requests)
        outputs, labels = union_outputs([worker.calibration_outputs(r)
                                         for worker, r in zip(workers, rows)])
        assert all(table["rows"] == 0 for table in shard.stats().values())  # none admitted
        shifted = [worker.shift_output_biases(outputs, labels) for worker in workers]
        expected = single.calibrate_output(compression.TreeBatch.concat(first_batches))
        assert shifted[0] == shifted[1] and set(shifted[0]) == set(expected) == {"click"}
        (rate, shift), (want_rate, want_shift) = shifted[0]["click"], expected["click"]
        assert rate == pytest.approx(want_rate) and abs(shift) > 0.5
        assert shift == pytest.approx(want_shift, rel=1e-4)
        after = [w.core.dense_arrays() for w in workers]
        reference = single.dense_arrays()
        for name, value in reference.items():
            np.testing.assert_array_equal(after[0][name], after[1][name])
            np.testing.assert_allclose(after[0][name], value, rtol=1e-4, atol=1e-6)
        # and the model now predicts the union batch's rate on it
        again, _ = union_outputs([w.calibration_outputs(r) for w, r in zip(workers, rows)])
        probability = workers[0].core.model.probabilities(again)["click"]
        assert float(np.mean(probability)) == pytest.approx(rate, rel=1e-3)
    finally:
        for worker in workers:
            worker.close_source()


def test_partitions_added_to_the_topic_mid_run_are_dealt_and_trained_once(
        s3_bucket, files, ray_address, tmp_path, monkeypatch):
    """A 2-partition topic grows to 4 while a new 2 x 1 run trains it: at its next checkpoint
    the driver deals the new partitions (the i-th to worker i % 2), every message is trained
    once and the model equals the replay of its steps (from a new model: the replay shifts
    its output bias on the first union batch as the run did). Tansu has no CreatePartitions:
    its topics live in the S3 bucket here, and the broker is stopped, the topic's partition
    count raised in its stored metadata and the broker restarted on the same port (the run
    rides the outage as it rides any)."""
    import contextlib

    import boto3

    from kafka_broker import KafkaBroker, group_settings_for_tansu
    from pipelines import local_broker

    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")  # the S3 server is plain http
    bucket = s3_bucket.removeprefix("s3://")
    port = local_broker.free_port()

    def start(stack):
        bootstrap, process, log = stack.enter_context(
            local_broker.tansu(port, storage=f"s3://{bucket}/"))
        broker = KafkaBroker(bootstrap, process, log)
        broker.admin.list_topics(timeout=30)
        return broker

    def sample_on(sid, partitions):
        key, value, _, _, _ = sample(sid)
        return key, value, None, None, (sid % 37) % partitions

    messages, group = Messages(), "g-added"
    run_dir = str(tmp_path / "run")
    with group_settings_for_tansu(), contextlib.ExitStack() as outer:
        first = contextlib.ExitStack()
        broker = start(first)
        topic = broker.create_topic(partitions=2)
        messages.produce(broker, topic, None, [sample_on(s, 2) for s in range(600)])
        argv = [sys.executable, "-m", "trainer.online",
                *command(files, broker, topic, group, run_dir, ray_address,
                         "--checkpoint-every", "0.3", "--unit-samples", "500", shards=1)]
        log_path = tmp_path / "added.log"
        log = outer.enter_context(open(log_path, "w"))
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
        outer.callback(lambda: process.poll() is None and (process.kill(), process.wait()))
        # generous: the waits are on conditions, and on a loaded host Ray's actors (niced)
        # took 2 minutes to start beside two busy loops
        wait_for_checkpoint(process, run_dir, lambda s: s["samples"] == 600, timeout=600)
        first.close()  # the broker stops; the topic grows in its storage
        s3 = boto3.client("s3")
        key = "clusters/tansu_cluster/meta.json"
        meta = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        assert meta["topics"][topic]["topic"]["num_partitions"] == 2
        meta["topics"][topic]["topic"]["num_partitions"] = PARTITIONS
        s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(meta).encode())
        broker = start(outer)
        messages.produce(broker, topic, None, [sample_on(s, PARTITIONS)
                                               for s in range(600, 1200)])
        wait_for_checkpoint(process, run_dir, lambda s: s["samples"] == 1200, timeout=600)
        process.send_signal(signal.SIGTERM)
        stdout, _ = process.communicate(timeout=300)
        assert process.returncode == 0, log_path.read_text()[-3000:]
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert summary["assignment"] == [[0, 2], [1, 3]]
        assert f"partitions [2, 3] were added to topic {topic!r}" in log_path.read_text()
        assert all(messages.by_offset.get((p, 0)) for p in (2, 3))
        assert_equals_replay(run_dir, messages, 1200, broker, topic, group)
