"""Online learning feeds a serving copy: deltas (upserts and tombstones) keep a follower
Predictor's rows equal to the trainer's, with entry filters and expiry at work."""

import json
import os

import numpy as np

import schemas
from trainer import models
from trainer.checkpoints import CheckpointManager
from trainer.config import TrainConfig
from trainer.kafka_source import KafkaSampleSource, group_id
from trainer.online import OnlineTrainer
from trainer.serving import Predictor
from trainer.trainer import Trainer

SCHEMA = schemas.from_dict({"name": "serve_test", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"}]},
    {"name": "sample", "key": ["item"], "features": [{"name": "item", "kind": "id"}]}]})


def _rows(store):
    rows = store.to_numpy()
    order = np.argsort(rows["ids"])
    return {key: value[order] for key, value in rows.items()}


def test_follower_rows_equal_the_trainers_after_every_export(kafka_broker, tmp_path):
    topic = kafka_broker.create_topic()
    # items 0-39 are seen many times early on, items 1000+ once each (below min_count), and
    # nothing after the first half sees items 0-19 again, so they go idle and expire
    messages = []
    for i in range(1200):
        item = i % 40 if i < 600 else (20 + i % 20 if i % 3 else 1000 + i)
        value = {"uid": i % 13, "item": item, "click": float(i % 7 == 0)}
        messages.append((str(i % 13).encode(), json.dumps(value).encode()))
    kafka_broker.produce(topic, messages)
    config = TrainConfig.from_dict({
        "batch_size": 100, "seed": 5, "threads": 1,
        "embedding": {"dim": 4, "optimizer": {"name": "sgd", "lr": 0.1},
                      "filter": {"name": "counter", "min_count": 2},
                      "expire": {"every_steps": 1, "max_idle_steps": 3}}})
    trainer = Trainer(SCHEMA, models.MLP(hidden=(8,)), config)
    source = KafkaSampleSource(SCHEMA, kafka_broker.bootstrap, topic, group_id())
    export_dir = str(tmp_path / "export")
    compared = []
    follower = {}

    def check(online):
        if "predictor" not in follower:
            follower["predictor"] = Predictor(export_dir)  # the first export is a full one
        else:
            follower["predictor"].update()
        for table, store in online.trainer.stores.items():
            mine, theirs = _rows(store), _rows(follower["predictor"].stores[table])
            assert mine.keys() == theirs.keys()
            for key in mine:
                assert np.array_equal(mine[key], theirs[key]), (table, key)
        compared.append(len(online.trainer.stores["item"]))
        if online.reader_thread_id is not None and "reader_nice" not in follower:
            # the reader thread runs at a lower priority than the training (main) thread
            follower["reader_nice"] = (os.getpriority(os.PRIO_PROCESS, online.reader_thread_id)
                                       - os.getpriority(os.PRIO_PROCESS, 0))

    online = OnlineTrainer(SCHEMA, trainer, source, CheckpointManager(str(tmp_path / "run")),
                           checkpoint_every=1000, export_dir=export_dir, export_every=0.0,
                           idle_exit=4, poll_timeout=0.05, on_export=check, reader_nice=5,
                           unit_samples=100)  # one batch a unit: the test relies on the order
    try:
        summary = online.run()
    finally:
        source.close()
    assert summary["samples"] == 1200
    assert len(compared) >= 3  # several exports, each followed exactly
    assert follower["reader_nice"] == 5
    item_rows = set(_rows(trainer.stores["item"])["ids"].tolist())
    assert not item_rows & {1000 + i for i in range(1200)}  # seen once: never admitted
    assert not item_rows & set(range(20))                 # idle: expired, tombstoned
    assert set(range(20, 40)) <= item_rows
    stats = trainer.stores["item"].stats()
    assert stats.rejected > 0 and stats.expired >= 20


def test_a_unit_holds_up_to_unit_samples_and_trains_them_as_several_batches(kafka_broker,
                                                                            tmp_path):
    topic = kafka_broker.create_topic()
    kafka_broker.produce(topic, [(str(i % 7).encode(), json.dumps(
        {"uid": i % 7, "item": i % 50, "click": float(i % 5 == 0)}).encode())
        for i in range(1000)])
    config = TrainConfig.from_dict({"batch_size": 100, "seed": 1, "threads": 1,
                                    "embedding": {"dim": 4}})
    trainer = Trainer(SCHEMA, models.MLP(hidden=(8,)), config)
    source = KafkaSampleSource(SCHEMA, kafka_broker.bootstrap, topic, group_id())
    sizes = []
    online = OnlineTrainer(SCHEMA, trainer, source, CheckpointManager(str(tmp_path / "run")),
                           checkpoint_every=1000, idle_exit=3, poll_timeout=0.5,
                           unit_samples=400)
    train = online._train
    online._train = lambda unit: (sizes.append((unit.samples, len(unit.batches))),
                                  train(unit))
    try:
        summary = online.run()
    finally:
        source.close()
    assert summary["samples"] == 1000 and sum(s for s, _ in sizes) == 1000
    assert summary["units"] == len(sizes)
    assert max(s for s, _ in sizes) <= 400
    # a preloaded topic fills units: most of them hold several batches (one tree per user)
    assert sum(1 for s, b in sizes if b >= 3) >= 1
    assert trainer.step == sum(b for _, b in sizes)
