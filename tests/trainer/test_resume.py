"""python -m trainer.train --resume: a run stopped by a real signal, resumed (twice), ends with
the result of the run that was never interrupted (issue 19)."""
import json
import os
import signal
import subprocess

import numpy as np
import pyarrow.parquet as pq
import pytest

from commands import in_process
from processes import signal_when
from trainer_data import SCHEMA_PATH, assert_same_result, generated

def command(*args) -> subprocess.CompletedProcess:
    """``python -m trainer.train args`` in this process (the runs interrupted by a signal are
    real children: :func:`interrupt`)."""
    return in_process("trainer.train", *args)


def interrupt(args, after: bytes, signum=signal.SIGINT) -> tuple[int, str]:
    """Start ``trainer.train args``, send ``signum`` once its stderr shows ``after``; the exit
    code and the whole stderr."""
    code, stdout, stderr = signal_when(["-m", "trainer.train", *args], after, signum)
    assert stdout == b""
    return code, stderr


@pytest.fixture(scope="module")
def files(schema, raw_small, tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    pq.write_table(raw_small.slice(0, 1000), base / "train-0.parquet")
    pq.write_table(raw_small.slice(1000), base / "train-1.parquet")
    pq.write_table(generated(schema, 600, seed=12).drop_columns(["p_click", "p_conversion"]),
                   base / "eval.parquet")
    (base / "trainer.yaml").write_text("embedding: {dim: 4}\nlog_every: 5\n")
    return base


def train_args(files, out):
    # 2,000 samples in 2 files, 20 steps a pass, up to 3 passes; evaluated every 7 steps and
    # after every pass, stops after 2 evaluations without a better AUC, keeps the best
    return ["--schema", SCHEMA_PATH, "--train-data", files / "train-*.parquet", "--eval-data",
            files / "eval.parquet", "--config", files / "trainer.yaml", "--hidden", "8",
            "--batch-size", "100", "--epochs", "3", "--eval-every", "7", "--patience", "2",
            "--seed", "3", "--out", out]


def assert_same_model(got, want, step: int) -> None:
    """Two checkpoints' (step, dense weights, rows by table) as ``stored_model`` or
    ``ray_checkpoint`` read them: both at ``step``, equal to float rounding (ids, update counts
    and last steps exactly)."""
    got_step, dense, rows = got
    expected_step, expected_dense, expected_rows = want
    assert got_step == expected_step == step
    for a, b in zip(dense, expected_dense, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert rows.keys() == expected_rows.keys()
    for table in rows:
        np.testing.assert_array_equal(rows[table]["ids"], expected_rows[table]["ids"])
        for key in ("values", "state"):
            np.testing.assert_allclose(rows[table][key], expected_rows[table][key], rtol=1e-5,
                                       atol=1e-7, err_msg=f"{table} {key}")
        for key in ("update_counts", "last_steps"):
            np.testing.assert_array_equal(rows[table][key], expected_rows[table][key])


def stored_model(run):
    """Dense weights and store rows (sorted by id) of a run's checkpoint."""
    from trainer import Trainer

    trainer = Trainer.restore(run / "checkpoint")
    dense = [v.numpy() for v in trainer.network.variables]
    rows = {}
    for table, store in trainer.stores.items():
        table_rows = store.to_numpy()
        order = np.argsort(table_rows["ids"])
        rows[table] = {k: table_rows[k][order] for k in ("ids", "values", "state",
                                                          "update_counts", "last_steps")}
    return trainer.step, dense, rows


def test_an_interrupted_run_resumes_to_the_uninterrupted_result(files, tmp_path):
    straight = command(*train_args(files, tmp_path / "straight"), "--no-progress")
    assert straight.returncode == 0, straight.stderr
    expected = json.loads(straight.stdout)
    assert expected["steps"] > 21  # the interrupts below come before the end

    run = tmp_path / "run"
    args = train_args(files, run)
    # first interrupt: once the first evaluation (step 7) is on the console
    code, stderr = interrupt(args, b"eval after epoch 1 (step 7)")
    assert code == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert "continue the run where it stopped with the same command plus --resume: " \
           "python -m trainer.train --schema" in last and last.endswith(f"--out {run} --resume")
    first = json.loads((run / "interrupted.json").read_text())
    assert first["step"] >= 7 and first["checkpoint"] == "latest"
    assert sorted(os.listdir(run)) == ["checkpoint", "eval", "interrupted.json", "latest",
                                       "train"]

    # second interrupt, in the resumed run: once it has evaluated again
    code, stderr = interrupt([*args, "--resume"], b"eval after epoch 2")
    assert code == 130, stderr
    second = json.loads((run / "interrupted.json").read_text())
    assert second["step"] > first["step"]
    assert stderr.strip().splitlines()[-1].endswith(f"--out {run} --resume")  # said once

    resumed = command(*args, "--resume", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads(resumed.stdout)
    assert sorted(os.listdir(tmp_path)) == ["run", "straight"]  # no temporary directory
    assert sorted(os.listdir(run)) == ["checkpoint", "eval", "result.json", "train"]

    assert_same_result(result, expected, run)

    assert_same_model(stored_model(run), stored_model(tmp_path / "straight"),
                      expected["checkpoint_step"])

    # the run is finished now: nothing to resume
    again = command(*args, "--resume")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert again.stderr.strip() == (
        f"python -m trainer.train: error: --out {run}: the run there finished (result.json, "
        "no interrupted.json); --resume continues an interrupted run only. Start a new run in "
        "another directory, or replace this one with --overwrite")


def test_resume_refuses_what_it_cannot_continue(files, tmp_path):
    run = tmp_path / "run"
    args = train_args(files, run)
    out = command(*args, "--resume", "--overwrite")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().endswith(
        "error: --resume continues the run in --out and --overwrite replaces it; pass one of "
        "them")

    out = command(*args, "--resume")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"python -m trainer.train: error: --out {run}: no interrupted run to resume (no "
        "interrupted.json in it); run without --resume to start one")
    assert not run.exists()

    # an interrupted run (stopped by SIGTERM this time) and a command that differs from it
    code, stderr = interrupt(args, b"eval after epoch 1 (step 7)", signal.SIGTERM)
    assert code == 143, stderr
    before = sorted(p.name for p in run.iterdir())
    changed = [a if a != "100" else "50" for a in map(str, args)]  # --batch-size 50
    changed[changed.index("--hidden") + 1] = "16"
    out = command(*changed, "--train-data", files / "train-0.parquet", "--resume")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        f"python -m trainer.train: error: --out {run}: this command is not the interrupted "
        "run's: --config (or --compute, --batch-size, --seed) differs; --hidden "
        '{"hidden": [8]} then, {"hidden": [16]} now; --train-data [train-0.parquet (' +
        f"{os.path.getsize(files / 'train-0.parquet'):,} bytes), train-1.parquet "
        f"({os.path.getsize(files / 'train-1.parquet'):,} bytes)] then, [train-0.parquet "
        f"({os.path.getsize(files / 'train-0.parquet'):,} bytes)] now. Resume with the same "
        "arguments plus --resume (the files unchanged), or start a new run in another "
        "directory")
    assert sorted(p.name for p in run.iterdir()) == before

    out = command(*args)  # without --resume: refused as any other run
    assert out.returncode == 2 and "the directory is not empty" in out.stderr


RAY = ["--workers", "2", "--shards", "2"]


def ray_checkpoint(run):
    """Dense weights and every table's rows (sorted by id, all shards) of a Ray run's
    checkpoint, read from its files."""
    import native

    checkpoint = run / "checkpoint"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    with np.load(checkpoint / "dense.npz") as npz:
        dense = [npz[k] for k in sorted(npz.files) if k.startswith("model/")]
    rows = {}
    for table in manifest["tables"]:
        parts = [native.EmbeddingStore.load(checkpoint / d / table).to_numpy()
                 for d in manifest["shard_dirs"]]
        joined = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        order = np.argsort(joined["ids"])
        rows[table] = {k: joined[k][order] for k in ("ids", "values", "state",
                                                     "update_counts", "last_steps")}
    return manifest["step"], dense, rows


def test_an_interrupted_ray_run_resumes_to_the_uninterrupted_result(cluster, files, tmp_path):
    """The same for --workers 2 --shards 2: a real SIGINT to the command once it evaluated
    (in the middle of its first pass): the pipeline drains, RUN/latest (every shard and the
    workers at one step) and interrupted.json are put in place, exit 130 with one line saying
    how to go on; then the same command plus --resume (here in this process, on the test's Ray
    cluster, as the uninterrupted run) ends with the uninterrupted run's result, checkpoint
    and evaluations. A command that differs is refused."""
    from compression import cli
    from trainer import train

    expected = train.run([*train_args(files, tmp_path / "straight"), *RAY, "--no-progress"])
    assert expected["steps"] > 12 and len(expected["evaluations"]) > 2

    run = tmp_path / "run"
    args = [*map(str, train_args(files, run)), *RAY]
    # the command starts a Ray cluster of its own, as a user's first run does (the online
    # tests' commands join the test's cluster with --ray-address)
    code, stderr = interrupt(args, b"eval after epoch 1 (step 7)")
    assert code == 130, stderr
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    state = json.loads((run / "interrupted.json").read_text())
    assert last.startswith(f"SIGINT: stopped after step {state['step']:,} (") and \
        f"checkpoint written to {run / 'checkpoint'} (the best evaluation so far" in last and \
        f"where training stopped is in {run / 'latest'})" in last, last
    assert "Continue the run where it stopped with the same command plus --resume: " \
           "python -m trainer.train --schema" in last and last.endswith(
               f"--out {run} --workers 2 --shards 2 --resume")
    assert state["signal"] == "SIGINT" and state["distributed"] == {"workers": 2, "shards": 2}
    assert 7 <= state["step"] < expected["steps"] and state["checkpoint"] == "latest"
    assert sorted(os.listdir(run)) == ["checkpoint", "interrupted.json", "latest", "train"]
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".old-" in p]
    manifest = json.loads((run / "latest" / "manifest.json").read_text())
    assert manifest["step"] == state["step"] and manifest["samples"] == state["samples"]

    before = sorted(p.name for p in run.iterdir())
    for changed, said in (([*args[:-4], "--workers", "1", "--shards", "2"],
                           "--workers 2 --shards 2 then, --workers 1 --shards 2 now"),
                          (args[:-4], "--workers 2 --shards 2 then, in process now")):
        with pytest.raises(cli.UsageError, match=f"not the interrupted run's: --workers/"
                                                 f"--shards: {said}. Resume with the same"):
            train.run([*changed, "--resume"])
    assert sorted(p.name for p in run.iterdir()) == before

    result = train.run([*args, "--resume", "--no-progress"])
    assert sorted(os.listdir(run)) == ["checkpoint", "result.json", "train"]
    assert sorted(os.listdir(tmp_path)) == ["run", "straight"]
    assert_same_result(result, expected, run)

    assert_same_model(ray_checkpoint(run), ray_checkpoint(tmp_path / "straight"),
                      expected["checkpoint_step"])
