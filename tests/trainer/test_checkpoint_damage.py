"""Damage every byte of a trainer checkpoint: each single-byte flip and each truncation of each
of its files (state.json, trainer.json, dense.npz, every store snapshot) is refused with
CheckpointDamagedError naming the file, and the trainer being restored into keeps its weights.

Every byte of every file is tried with ``Trainer.load`` into a live trainer (a damaged file is
found before anything is built or assigned, so each try takes well under a millisecond);
``Trainer.restore``, which builds a new trainer first when the damage is in a store file, is
tried on a strided sample of each file's bytes.
"""
import json
import os

import numpy as np
import pyarrow as pa
import pytest

import compression
import schemas
from trainer import models
from trainer.checkpoints import CheckpointDamagedError, CheckpointManager
from trainer.config import TrainConfig
from trainer.trainer import Trainer

SCHEMA = {"name": "damage_test", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"}]},
    {"name": "sample", "key": ["sid"], "features": [{"name": "sid", "kind": "id"}]}]}
CONFIG = {"batch_size": 40, "seed": 7, "threads": 1,
          "embedding": {"dim": 2, "optimizer": {"name": "adagrad", "lr": 0.3}}}


def batches(schema, first, n):
    rows = [{"uid": sid % 11, "sid": sid, "click": float(sid % 3 == 0)}
            for sid in range(first, first + n)]
    table = pa.Table.from_pylist(rows).cast(schema.raw_arrow_schema())
    return list(compression.iter_batches(compression.build_trees(table, schema), schema,
                                         CONFIG["batch_size"]))


def trained(schema, first):
    trainer = Trainer(schema, models.MLP(hidden=(3,)), TrainConfig.from_dict(CONFIG))
    for batch in batches(schema, first, 80):
        trainer.train_batch(batch)
    return trainer


def fingerprint(trainer):
    """What a refused restore must not change: dense weights, optimizer state, rows, counters."""
    dense = [np.asarray(v.numpy()).tobytes() for v in trainer.network.variables]
    dense += [np.asarray(v.numpy()).tobytes() for v in trainer.network.optimizer.variables]
    rows = {}
    for table, store in trainer.stores.items():
        data = store.to_numpy()
        order = np.argsort(data["ids"])
        rows[table] = [data[k][order].tobytes() for k in ("ids", "values", "state")]
    return dense, rows, trainer.step, trainer.samples, trainer.config


def quick_fingerprint(trainer):
    """The parts a load changes last (after every check and every weight): the same objects
    and counters mean the load stopped before assigning anything."""
    return ({t: id(s) for t, s in trainer.stores.items()}, trainer.step, trainer.samples,
            id(trainer.config))


def damaged(data: bytes, stride: int = 1):
    """``(what, bytes)``: bytes flipped (xor 0xFF) and truncations to 0 .. len - 1 bytes."""
    for i in range(0, len(data), stride):
        yield f"byte {i} of {len(data)} flipped", data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
    for n in range(0, len(data), stride):
        yield f"truncated to {n} of {len(data)} bytes", data[:n]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An online-style checkpoint (CheckpointManager + Trainer.save) of a small trainer."""
    schema = schemas.from_dict(SCHEMA)
    trainer = trained(schema, 0)
    run_dir = str(tmp_path_factory.mktemp("damage") / "run")
    saved = CheckpointManager(run_dir).save(
        lambda d: trainer.save(os.path.join(d, "model")), {"step": trainer.step,
                                                           "offsets": {"0": 80}})
    files = sorted(os.path.relpath(os.path.join(d, n), saved.path)
                   for d, _, names in os.walk(saved.path) for n in names)
    assert files == ["model/dense.npz", "model/stores/sid/store.snapshot",
                     "model/stores/uid/store.snapshot", "model/trainer.json", "state.json"]
    return schema, trainer, run_dir, saved.path, files


def restore_into(target, run_dir):
    """The restart of an online run: find the latest checkpoint, load it into ``target``."""
    latest = CheckpointManager(run_dir).latest()
    target.load(os.path.join(latest.path, "model"))


def test_the_intact_checkpoint_restores_exactly(checkpoint):
    schema, trainer, run_dir, path, _ = checkpoint
    other = trained(schema, 1000)
    assert fingerprint(other) != fingerprint(trainer)
    restore_into(other, run_dir)
    assert fingerprint(other)[:4] == fingerprint(trainer)[:4]
    assert fingerprint(Trainer.restore(os.path.join(path, "model")))[:4] == \
        fingerprint(trainer)[:4]


@pytest.mark.parametrize("name", ["state.json", "model/trainer.json", "model/dense.npz",
                                  "model/stores/uid/store.snapshot",
                                  "model/stores/sid/store.snapshot"])
def test_every_damaged_byte_is_refused_and_the_live_trainer_keeps_its_weights(checkpoint, name):
    schema, _, run_dir, path, _ = checkpoint
    target = trained(schema, 1000)
    before, quick = fingerprint(target), quick_fingerprint(target)
    file = os.path.join(path, name)
    with open(file, "rb") as f:
        data = f.read()
    try:
        for attempt, (what, blob) in enumerate(damaged(data)):
            with open(file, "wb") as f:
                f.write(blob)
            with pytest.raises(CheckpointDamagedError) as error:
                restore_into(target, run_dir)
            assert file in str(error.value), (what, str(error.value))
            # every weight and row compared on a sample of the tries (reading them back from
            # TensorFlow takes longer than the try)
            assert quick_fingerprint(target) == quick, what
            if attempt % 50 == 0:
                assert fingerprint(target) == before, what
        assert fingerprint(target) == before
    finally:
        with open(file, "wb") as f:
            f.write(data)
    restore_into(target, run_dir)  # the intact file loads again
    assert fingerprint(target) != before


def test_restore_refuses_a_sample_of_damaged_bytes_of_every_file(checkpoint):
    _, _, run_dir, path, files = checkpoint
    for name in files:
        file = os.path.join(path, name)
        with open(file, "rb") as f:
            data = f.read()
        try:
            for what, blob in damaged(data, stride=max(1, len(data) // 3)):
                with open(file, "wb") as f:
                    f.write(blob)
                with pytest.raises(CheckpointDamagedError) as error:
                    latest = CheckpointManager(run_dir).latest()
                    Trainer.restore(os.path.join(latest.path, "model"))
                assert file in str(error.value), (name, what, str(error.value))
        finally:
            with open(file, "wb") as f:
                f.write(data)


def test_checkpoints_from_before_checksums_still_restore(checkpoint, tmp_path):
    schema, trainer, _, path, _ = checkpoint
    old = tmp_path / "old"
    trainer.save(old)
    with open(old / "trainer.json") as f:
        state = json.load(f)
    state["version"] = 2
    del state["checksum"], state["checksums"]
    with open(old / "trainer.json", "w") as f:
        json.dump(state, f, indent=1)
    assert fingerprint(Trainer.restore(old))[:4] == fingerprint(trainer)[:4]
    # without its checksum, a damaged dense.npz is still refused when it cannot be read whole
    data = (old / "dense.npz").read_bytes()
    (old / "dense.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointDamagedError, match=r"dense\.npz: damaged checkpoint file"):
        Trainer.restore(old)
    # and a state.json without a checksum (written before them) is read as it is
    run_dir = tmp_path / "run"
    manager = CheckpointManager(str(run_dir))
    saved = manager.save(lambda d: os.makedirs(os.path.join(d, "model")), {"step": 3})
    with open(os.path.join(saved.path, "state.json"), "w") as f:
        json.dump({"step": 3, "offsets": {"0": 5}}, f)
    assert CheckpointManager(str(run_dir)).latest().state == {"step": 3, "offsets": {"0": 5}}


@pytest.mark.parametrize("change", [
    {"variables": 5}, {"step": "3"}, {"samples": -1}, {"config": []},
    {"config": {"embedding": [1]}}, {"checksums": {}}, {"schema": None},
    {"config": {"batch_size": "many"}},
])
def test_a_sealed_trainer_json_with_wrong_fields_is_refused_naming_it(checkpoint, tmp_path,
                                                                      change):
    """Found by fuzzing (tests/fuzz_corpus/checkpoint): a trainer.json with a valid checksum
    but fields of the wrong type raised TypeError/KeyError from the middle of Trainer.load."""
    from trainer.checkpoints import CHECKSUM_KEY, sealed

    schema, _, _, path, _ = checkpoint
    copy = tmp_path / "model"
    import shutil

    shutil.copytree(os.path.join(path, "model"), copy)
    with open(copy / "trainer.json") as f:
        state = json.load(f)
    state.pop(CHECKSUM_KEY)
    state.update(change)
    (copy / "trainer.json").write_text(json.dumps(sealed(state)))
    target = trained(schema, 1000)
    quick = quick_fingerprint(target)
    with pytest.raises(CheckpointDamagedError) as error:
        target.load(copy)
    assert str(copy / "trainer.json") in str(error.value)
    assert quick_fingerprint(target) == quick
