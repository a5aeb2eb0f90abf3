"""The ``python -m`` commands as their users expect (issue 19): the output policy (refuse a
non-empty output, ``--overwrite`` replaces it whole, a failure leaves nothing), interrupts of
``trainer.train``, one error path (one line, exit code 2, the traceback only under
``--debug``), quiet start-up and a ``--help`` without TensorFlow.

Each command runs in a child process where the process is what is checked (signals, the
start-up lines native code writes to file descriptor 2, what a command imports) and for every
command that does not load TensorFlow; ``trainer.train`` and ``trainer.evaluate`` run in this
process (``train``, through the same ``main``) where only their results, files and messages
are checked: a child loading TensorFlow costs 4-5 CPU-s before it starts (tests/support/
commands.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from commands import in_child, in_process
from processes import signal_when
from sample_data import taobao_table

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = str(ROOT / "schemas" / "examples" / "taobao_like.yaml")
COMMANDS = ("compression.compress", "compression.inspect", "pipelines.compress",
            "pipelines.generate", "pipelines.replay", "pipelines.stream_compress",
            "pipelines.local_broker", "trainer.train", "trainer.evaluate", "trainer.online")
TF_NOISE = ("absl::InitializeLog", "oneDNN", "cpu_feature_guard", "TF_ENABLE_ONEDNN_OPTS")


def command(module: str, *args) -> subprocess.CompletedProcess:
    """``python -m module args`` in a child process."""
    return in_child(module, *args)


def train(module: str, *args) -> subprocess.CompletedProcess:
    """``trainer.train`` or ``trainer.evaluate`` in this process."""
    assert module in ("trainer.train", "trainer.evaluate")
    return in_process(module, *args)


def one_error_line(out: subprocess.CompletedProcess, module: str, after_progress=False) -> str:
    """The command failed with exit code 2 and printed one error line, without a traceback;
    only that line, unless the job had started (``after_progress``: its progress lines
    first)."""
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 or after_progress, out.stderr
    assert lines[-1].startswith(f"python -m {module}: error: ")
    assert not any("error" in line for line in lines[:-1]), out.stderr
    return lines[-1]


def entries(directory: Path) -> list[str]:
    """Everything below a directory, relative paths, sorted."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("data")
    table = taobao_table(600, seed=1)
    pq.write_table(table, base / "raw.parquet")
    pq.write_table(table.slice(0, 0), base / "zero_rows.parquet")
    (base / "zero_bytes.parquet").write_bytes(b"")
    click = table.column("click").to_pylist()
    click[7] = 3.0  # out of [0, 1]: a bad row
    bad = table.set_column(table.schema.get_field_index("click"), "click",
                           pa.array(click, pa.float32()))
    pq.write_table(bad, base / "bad_row.parquet")
    return base


# -- output policy ------------------------------------------------------------------------------

def test_compression_compress_refuses_a_non_empty_output_and_overwrite_replaces_it(data,
                                                                                   tmp_path):
    out = tmp_path / "trees"
    first = command("compression.compress", "--schema", SCHEMA, "--input",
                    data / "raw.parquet", "--output", out)
    assert first.returncode == 0, first.stderr
    assert entries(out) == ["_stats.json", "part-00000.parquet"]
    (out / "notes.txt").write_text("mine")

    again = command("compression.compress", "--schema", SCHEMA, "--input",
                    data / "raw.parquet", "--output", out, "--roots-per-file", "7")
    assert one_error_line(again, "compression.compress") == (
        f"python -m compression.compress: error: --output {out}: the directory is not empty "
        "(3 entries); pass --overwrite to replace it whole, or choose another directory")
    assert entries(out) == ["_stats.json", "notes.txt", "part-00000.parquet"]

    replaced = command("compression.compress", "--schema", SCHEMA, "--input",
                       data / "raw.parquet", "--output", out, "--roots-per-file", "7",
                       "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    names = entries(out)
    assert "notes.txt" not in names and len(names) > 2  # replaced whole, several files now
    inspected = command("compression.inspect", out, "--json")
    assert json.loads(inspected.stdout)["samples"] == 600  # not old + new
    assert entries(tmp_path) == ["trees"] + [f"trees/{n}" for n in names]  # no temp dirs


def test_compression_compress_failure_leaves_no_output(data, tmp_path):
    (tmp_path / "in").mkdir()
    pq.write_table(taobao_table(100), tmp_path / "in" / "a.parquet")
    pq.write_table(taobao_table(100).drop_columns(["gender"]), tmp_path / "in" / "b.parquet")
    out = command("compression.compress", "--schema", SCHEMA, "--input", tmp_path / "in",
                  "--output", tmp_path / "trees")
    assert "b.parquet: missing column(s) 'gender'" in one_error_line(out,
                                                                      "compression.compress")
    assert entries(tmp_path) == ["in", "in/a.parquet", "in/b.parquet"]


def test_pipelines_compress_output_policy(data, tmp_path):
    out = tmp_path / "trees"
    failed = command("pipelines.compress", "--schema", SCHEMA, "--input", data / "bad_row.parquet",
                     "--input", data / "raw.parquet", "--output", out, "--shards", "2")
    line = one_error_line(failed, "pipelines.compress", after_progress=True)
    assert line == (f"python -m pipelines.compress: error: 1 rows failed validation, more than "
                    f"--max-bad-rows 0 (the first: {data / 'bad_row.parquet'}: label 'click' "
                    "row 8: value out of range, labels must be in [0, 1]); their reasons are in "
                    f"{out}.dead_letter/ (fix the data, or raise --max-bad-rows to drop them)")
    # nothing that looks like output: no part file, no temporary directory; the reasons beside
    assert sorted(os.listdir(tmp_path)) == ["trees.dead_letter"]
    reasons = [json.loads(line) for f in (tmp_path / "trees.dead_letter").iterdir()
               for line in f.read_text().splitlines()]
    assert [(r["row"], r["reason"]) for r in reasons] == [
        (8, "label 'click' row 8: value out of range, labels must be in [0, 1]")]  # 1-based

    done = command("pipelines.compress", "--schema", SCHEMA, "--input", data / "raw.parquet",
                   "--output", out, "--shards", "3")
    assert done.returncode == 0, done.stderr
    assert "apitools" not in done.stderr
    assert sorted(os.listdir(tmp_path)) == ["trees"]  # the failed run's reasons went with it
    assert entries(out) == ["_stats.json"] + [f"part-0000{i}-of-00003.parquet" for i in range(3)]

    refused = command("pipelines.compress", "--schema", SCHEMA, "--input", data / "raw.parquet",
                      "--output", out, "--shards", "2")
    assert "the directory is not empty (4 entries); pass --overwrite" in one_error_line(
        refused, "pipelines.compress")
    assert len(os.listdir(out)) == 4

    overwritten = command("pipelines.compress", "--schema", SCHEMA, "--input",
                          data / "raw.parquet", "--output", out, "--shards", "2", "--overwrite")
    assert overwritten.returncode == 0, overwritten.stderr
    assert entries(out) == ["_stats.json"] + [f"part-0000{i}-of-00002.parquet" for i in range(2)]
    assert json.loads((out / "_stats.json").read_text())["samples"] == 600


def test_trainer_train_output_policy(data, tmp_path):
    run = tmp_path / "run"
    train = ("trainer.train", "--schema", SCHEMA, "--train-data", data / "raw.parquet",
             "--batch-size", "200", "--no-progress", "--out", run)
    first = command(*train)
    assert first.returncode == 0, first.stderr
    assert entries(run)[:3] == ["checkpoint", "checkpoint/dense.npz", "checkpoint/stores"]
    assert "result.json" in os.listdir(run)
    for noise in TF_NOISE:  # quiet by default
        assert noise not in first.stderr
    (run / "train" / "old-run.tfevents").write_text("another run's events")
    before = entries(run)

    refused = in_process(*train)
    assert one_error_line(refused, "trainer.train") == (
        f"python -m trainer.train: error: --out {run}: the directory is not empty (3 entries); "
        "pass --overwrite to replace it whole, or choose another directory")
    assert entries(run) == before

    replaced = in_process(*train, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert "train/old-run.tfevents" not in entries(run)  # replaced whole
    assert json.loads((run / "result.json").read_text())["run_dir"] == str(run)
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no temporary directory left

    # a failure midway (a bad row in the eval data, found at the first evaluation): no run dir
    failed = in_process("trainer.train", "--schema", SCHEMA, "--train-data",
                        data / "raw.parquet", "--eval-data", data / "bad_row.parquet",
                        "--batch-size", "200", "--no-progress", "--out", tmp_path / "failed")
    line = one_error_line(failed, "trainer.train")
    assert "bad_row.parquet" in line and "label 'click' row 8" in line
    assert sorted(os.listdir(tmp_path)) == ["run"]


# -- interrupts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_training_with_a_checkpoint(data, tmp_path, signum, code):
    run = tmp_path / "run"
    # the progress bar appears once training has started (signal handlers in place)
    returncode, stdout, stderr = signal_when(
        ["-m", "trainer.train", "--schema", SCHEMA, "--train-data", data / "raw.parquet",
         "--batch-size", "100", "--epochs", "1000000", "--out", run], b"train:", signum)
    assert returncode == code, stderr
    assert "Traceback" not in stderr
    name = signal.Signals(signum).name
    assert f"{name}: finishing the current step, then writing a checkpoint" in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"{name}: stopped after step ")
    assert f"checkpoint written to {run}/checkpoint. Score it with python -m trainer.evaluate " \
           f"--run {run} --data DATA" in last
    assert stdout == b""
    state = json.loads((run / "interrupted.json").read_text())
    assert state["signal"] == name and state["step"] >= 1
    assert json.loads((run / "checkpoint" / "trainer.json").read_text())["step"] == state["step"]
    assert sorted(os.listdir(tmp_path)) == ["run"]

    if signum == signal.SIGINT:  # the checkpoint is usable
        scored = command("trainer.evaluate", "--run", run, "--data", data / "raw.parquet",
                         "--no-progress")
        assert scored.returncode == 0, scored.stderr
        result = json.loads(scored.stdout)
        assert result["step"] == state["step"] and result["samples"] == 600
        for noise in TF_NOISE:
            assert noise not in scored.stderr


# -- one error path -----------------------------------------------------------------------------

def test_bad_inputs_give_one_line_and_exit_code_2(data, tmp_path):
    zero_bytes, zero_rows = data / "zero_bytes.parquet", data / "zero_rows.parquet"
    arrow_message = "Parquet file size is 0 bytes"

    line = one_error_line(command("compression.compress", "--schema", SCHEMA, "--input",
                                  zero_bytes, "--output", tmp_path / "a"),
                          "compression.compress")
    assert f"{zero_bytes}: cannot read the file as parquet: " in line and arrow_message in line

    line = one_error_line(command("compression.inspect", data / "raw.parquet", "--schema",
                                  SCHEMA), "compression.inspect")
    assert line == (f"python -m compression.inspect: error: {data / 'raw.parquet'}: not a tree "
                    "file of schema 'taobao_like' (no 'ad' column): it looks like raw samples; "
                    "compress it first with python -m compression.compress (or "
                    "pipelines.compress) and inspect the output")

    line = one_error_line(command("pipelines.compress", "--schema", SCHEMA, "--input",
                                  zero_rows, "--output", tmp_path / "b"), "pipelines.compress")
    assert line == (f"python -m pipelines.compress: error: --input '{zero_rows}': the 1 input "
                    "file(s) hold no samples; nothing to do")

    line = one_error_line(train("trainer.train", "--schema", SCHEMA, "--train-data",
                                data / "raw.parquet", "--eval-data", tmp_path / "nope*.parquet",
                                "--out", tmp_path / "c"), "trainer.train")
    assert line == (f"python -m trainer.train: error: --eval-data: no input files match "
                    f"'{tmp_path / 'nope*.parquet'}'")

    line = one_error_line(train("trainer.train", "--schema", SCHEMA, "--train-data",
                                zero_rows, "--out", tmp_path / "d"), "trainer.train")
    assert "hold no samples" in line

    # a run directory for trainer.evaluate: a checkpoint written by an interrupted run would do,
    # a missing one is the usage error
    out = train("trainer.evaluate", "--run", tmp_path / "e", "--data", zero_bytes)
    assert out.returncode == 2 and "no checkpoint in" in out.stderr
    assert "Traceback" not in out.stderr
    assert sorted(os.listdir(tmp_path)) == []  # nothing written by any of them

    out = train("trainer.train", "--schema", SCHEMA, "--train-data", data / "raw.parquet",
                "--epochs", "-1", "--out", tmp_path / "f")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "argument --epochs: expected a number >= 1, got -1" in out.stderr


def test_trainer_evaluate_checks_its_data_before_work(data, tmp_path):
    run = tmp_path / "run"
    trained = train("trainer.train", "--schema", SCHEMA, "--train-data", data / "raw.parquet",
                    "--batch-size", "300", "--no-progress", "--out", run)
    assert trained.returncode == 0, trained.stderr
    line = one_error_line(train("trainer.evaluate", "--run", run, "--data",
                                data / "zero_bytes.parquet"), "trainer.evaluate")
    assert f"{data / 'zero_bytes.parquet'}: cannot read the file as parquet" in line
    assert "Parquet file size is 0 bytes" in line


def test_debug_adds_the_traceback(data, tmp_path):
    out = command("compression.compress", "--schema", SCHEMA, "--input",
                  data / "zero_bytes.parquet", "--output", tmp_path / "a", "--debug")
    assert out.returncode == 2
    assert "Traceback" in out.stderr and "RawDataError" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        "python -m compression.compress: error: ")


# -- help and start-up --------------------------------------------------------------------------

@pytest.mark.parametrize("module", COMMANDS)
def test_help_shows_an_example_and_the_exit_codes(module):
    out = command(module, "--help")
    assert out.returncode == 0
    assert "examples:\n  python -m " + module in out.stdout
    assert "exit status: 0 done; 2 usage or input error" in out.stdout
    assert "--debug" in out.stdout
    assert out.stderr == ""  # no TensorFlow start-up lines, no Beam apitools warning


@pytest.mark.parametrize("module", ["trainer.train", "trainer.evaluate", "trainer.online"])
def test_trainer_help_does_not_import_tensorflow(module):
    code = ("import runpy, sys\n"
            f"sys.argv = [{module!r}, '--help']\n"
            "try:\n"
            f"    runpy.run_module({module!r}, run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules), "
            "file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == "[]"


def test_model_names_listed_without_tensorflow_are_the_built_in_models():
    from trainer import models
    from trainer.runs import MODEL_NAMES

    assert MODEL_NAMES == tuple(sorted(models.MODELS))


def test_a_bad_csv_cell_names_the_column_and_the_line(tmp_path):
    (tmp_path / "tiny.yaml").write_text(
        "name: tiny\nlabels: [click]\nlayers:\n"
        "  - {name: user, key: [uid], features: [{name: uid, kind: id}, {name: hist, kind: ids}]}\n"
        "  - {name: ad, key: [aid], features: [{name: aid, kind: id}]}\n")
    (tmp_path / "raw.csv").write_text("uid,hist,aid,click\n1,2|3,5,0\n2,,ten,1\n")
    out = command("compression.compress", "--schema", tmp_path / "tiny.yaml", "--input",
                  tmp_path / "raw.csv", "--output", tmp_path / "trees")
    assert one_error_line(out, "compression.compress") == (
        f"python -m compression.compress: error: {tmp_path / 'raw.csv'}: column 'aid' line 3: "
        "invalid value 'ten', expected an integer (CSV conversion error to int64: invalid "
        "value 'ten')")
    assert not (tmp_path / "trees").exists()


TINY_AGE = ("name: tiny\nlabels: [click]\nlayers:\n"
            "  - {name: user, key: [uid], features: [{name: age, kind: id}, {name: uid, kind: id},"
            " {name: hist, kind: ids}]}\n"
            "  - {name: ad, key: [aid], features: [{name: aid, kind: id}]}\n")


def test_a_bad_csv_list_cell_names_the_column_and_the_line(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY_AGE)
    (tmp_path / "raw.csv").write_text("age,uid,hist,aid,click\n1,1,2|3,5,0\n2,2,4|x7|5,6,1\n")
    out = command("compression.compress", "--schema", tmp_path / "tiny.yaml", "--input",
                  tmp_path / "raw.csv", "--output", tmp_path / "trees")
    assert one_error_line(out, "compression.compress") == (
        f"python -m compression.compress: error: {tmp_path / 'raw.csv'}: column 'hist' line 3: "
        "invalid value 'x7' in the list '4|x7|5', expected '|'-separated integers")


def test_nulls_in_a_key_and_another_column_are_both_reported(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY_AGE)
    (tmp_path / "raw.csv").write_text(
        "age,uid,hist,aid,click\n1,1,2|3,5,0\n,2,4,6,1\n4,,5,7,0\n5,3,6,8,1\n")
    out = command("compression.compress", "--schema", tmp_path / "tiny.yaml", "--input",
                  tmp_path / "raw.csv", "--output", tmp_path / "trees")
    assert one_error_line(out, "compression.compress") == (
        f"python -m compression.compress: error: {tmp_path / 'raw.csv'}: key column 'uid' line "
        "4: null value; every row needs a key; also column 'age' line 3: null value; fill "
        "missing values (e.g. id 0, an empty list) before compressing")

    # the Beam job: the same rows in its dead letters, numbered as the file's lines
    done = command("pipelines.compress", "--schema", tmp_path / "tiny.yaml", "--input",
                   tmp_path / "raw.csv", "--output", tmp_path / "trees", "--max-bad-rows", "2")
    assert done.returncode == 0, done.stderr
    reasons = sorted((json.loads(line)["row"], json.loads(line)["reason"])
                     for f in (tmp_path / "trees" / "_dead_letter").iterdir()
                     for line in f.read_text().splitlines())
    assert reasons == [
        (3, "column 'age' line 3: null value; fill missing values (e.g. id 0, an empty list) "
            "before compressing"),
        (4, "key column 'uid' line 4: null value; every row needs a key")]
    assert json.loads((tmp_path / "trees" / "_stats.json").read_text())["samples"] == 2


def test_an_interrupted_beam_job_leaves_no_output(tmp_path):
    """SIGINT once the job has read its input: exit 130 and no output, no temporary directory
    (or, had the job finished first, a complete output; either way nothing half-written)."""
    pq.write_table(taobao_table(100_000, seed=5), tmp_path / "raw.parquet")
    out = tmp_path / "trees"
    returncode, _, stderr = signal_when(
        ["-m", "pipelines.compress", "--schema", SCHEMA, "--input", tmp_path / "raw.parquet",
         "--output", out, "--shards", "2", "--chunk-rows", "5000"], b"read ")
    assert "Traceback" not in stderr
    if returncode == 130:
        assert stderr.strip().splitlines()[-1] == (
            "python -m pipelines.compress: interrupted")
        assert sorted(os.listdir(tmp_path)) == ["raw.parquet"]
    else:
        assert returncode == 0, stderr
        assert sorted(os.listdir(tmp_path)) == ["raw.parquet", "trees"]
        assert json.loads((out / "_stats.json").read_text())["samples"] == 100_000


def test_overwrite_never_replaces_a_directory_holding_an_input(data, tmp_path):
    (tmp_path / "dir").mkdir()
    raw = tmp_path / "dir" / "raw.parquet"
    raw.write_bytes((data / "raw.parquet").read_bytes())
    for module, args in (("compression.compress", ["--input", raw, "--output"]),
                         ("pipelines.compress", ["--input", raw, "--output"]),
                         ("trainer.train", ["--train-data", raw, "--out"])):
        run = train if module == "trainer.train" else command
        out = run(module, "--schema", SCHEMA, *args, tmp_path / "dir", "--overwrite")
        assert one_error_line(out, module).endswith(
            f"{tmp_path / 'dir'}: holds the input {raw}, which writing the output there would "
            "replace; choose another directory")
        assert entries(tmp_path) == ["dir", "dir/raw.parquet"]


# -- small things users notice (issue 19, point 6) ----------------------------------------------

def bar_states(stderr: str, desc: str) -> list[str]:
    """The states a tqdm bar drew on a non-terminal stderr, in order (split at carriage
    returns and newlines)."""
    return [part.strip() for line in stderr.split("\n") for part in line.split("\r")
            if part.strip().startswith(f"{desc}:")]


@pytest.fixture(scope="module")
def short_run(data, tmp_path_factory):
    """A run of 6 steps (600 tree samples, batch 200, 2 epochs), fewer than log_every (20), with
    the progress bar on: (tree file, run directory, result, stderr)."""
    import compression
    import schemas

    base = tmp_path_factory.mktemp("short_run")
    trees = base / "trees.parquet"
    compression.write_trees(compression.build_trees(pq.read_table(data / "raw.parquet"),
                                                    schemas.load(SCHEMA)), str(trees),
                            row_group_rows=16)  # several row groups
    run = base / "run"
    out = train("trainer.train", "--schema", SCHEMA, "--train-data", trees, "--batch-size",
                "200", "--epochs", "2", "--out", run)
    assert out.returncode == 0, out.stderr
    return trees, run, json.loads(out.stdout), out.stderr


def test_train_progress_bar_has_a_total_for_tree_files(short_run):
    _, _, result, stderr = short_run
    assert result["samples"] == 1200 and result["steps"] == 6
    states = bar_states(stderr, "train")
    assert states and all("/1.20k [" in s for s in states), states  # 600 samples x 2 epochs
    assert states[-1].startswith("train: 100%|") and " 1.20k/1.20k [" in states[-1]


def test_without_eval_data_auc_is_none(short_run):
    _, run, result, stderr = short_run
    assert result["auc"] is None and result["logloss"] is None and result["eval_samples"] == 0
    assert result["train_auc"] > 0.5  # it learned its own training data (planted signal)
    assert stderr.strip().splitlines()[-1].startswith(f"train AUC {result['train_auc']:.4f} | ")
    assert json.loads((run / "result.json").read_text())["auc"] is None


def event_accumulator(directory: Path):
    """TensorBoard's own reader of a directory's event files, loaded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator(str(directory)).Reload()


def test_a_run_shorter_than_log_every_writes_its_last_step_scalars(short_run):
    _, run, result, _ = short_run
    events = event_accumulator(run / "train")
    for tag in ("loss", "samples_per_sec", "store/rows"):
        assert [e.step for e in events.Tensors(tag)] == [result["steps"]]  # step 6 only


def test_tensorboard_reads_the_run_scalars(short_run):
    """What ``tensorboard --logdir RUN_DIR`` shows: scalars-plugin tags with float values."""
    from tensorboard.util import tensor_util

    _, run, result, _ = short_run
    events = event_accumulator(run / "train")
    tags = {"loss", "auc", "samples_per_sec", "store/rows", "store/admitted", "store/rejected",
            "store/expired"}
    assert set(events.PluginTagToContent("scalars")) == tags
    assert set(events.Tags()["tensors"]) == tags
    rows = tensor_util.make_ndarray(events.Tensors("store/rows")[-1].tensor_proto)
    assert rows.shape == () and float(rows) == result["store_rows"]
    loss = tensor_util.make_ndarray(events.Tensors("loss")[-1].tensor_proto)
    assert float(loss) == pytest.approx(result["loss"], rel=1e-6)


def test_trainer_evaluate_prints_a_summary_line(short_run):
    trees, run, result, _ = short_run
    out = train("trainer.evaluate", "--run", run, "--data", trees)
    assert out.returncode == 0, out.stderr
    evaluation = json.loads(out.stdout)
    assert evaluation["samples"] == 600 and evaluation["step"] == result["steps"]
    assert out.stderr.strip().splitlines()[-1] == (
        f"eval AUC {evaluation['auc']:.4f} | logloss {evaluation['logloss']:.5f} | 600 samples | "
        f"{evaluation['samples_per_sec']:,.0f} samples/s | checkpoint step 6")
    assert bar_states(out.stderr, "eval")[-1].startswith("eval: 100%|")  # a total here too
    assert set(event_accumulator(run / "eval").PluginTagToContent("scalars")) == {
        "auc", "logloss", "loss"}


def test_train_progress_bar_ends_cleanly_when_training_stops_early(data, short_run, tmp_path):
    """Eval labels of one class: every eval AUC is undefined, never better than the first, so
    --patience 1 stops after epoch 2 of 4; the bar's total (4 x 600) becomes what it counted."""
    trees = short_run[0]
    table = pq.read_table(data / "raw.parquet")
    column = table.schema.get_field_index("click")
    pq.write_table(table.set_column(column, "click", pa.array([0.0] * table.num_rows,
                                                               pa.float32())),
                   tmp_path / "no_clicks.parquet")
    out = train("trainer.train", "--schema", SCHEMA, "--train-data", trees, "--eval-data",
                tmp_path / "no_clicks.parquet", "--batch-size", "200", "--epochs", "4",
                "--patience", "1", "--out", tmp_path / "run")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["stopped_early"] and result["samples"] == 1200 and result["auc"] is None
    states = bar_states(out.stderr, "train")
    assert states[-1].startswith("train: 100%|") and " 1.20k/1.20k [" in states[-1], states
    assert states[0].startswith("train:   0%|") and " 0.00/2.40k [" in states[0], states
    assert all("/2.40k [" in s or " 1.20k/1.20k [" in s for s in states), states
    assert out.stderr.strip().splitlines()[-1].startswith("eval AUC n/a (epoch 1, kept) | ")


def test_model_and_epochs_have_help_text():
    out = command("trainer.train", "--help")
    text = " ".join(out.stdout.split())
    assert "--model {dcn,deepfm,dien,din,esmm,mlp} the dense network (default mlp" in text
    assert "--epochs EPOCHS passes over the training data at most; default 1" in text


@pytest.mark.parametrize("module", ["pipelines.generate", "pipelines.replay",
                                    "pipelines.stream_compress", "pipelines.local_broker",
                                    "trainer.online"])
def test_every_other_help_shows_an_example(module):
    out = command(module, "--help")
    assert out.returncode == 0, out.stderr
    assert f"\nexamples:\n  python -m {module} --" in out.stdout


# -- malformed input files: one clear line, never a signal (issue 30) --------------------------

def _bad_files(base: Path, data: Path) -> dict[str, Path]:
    """Malformed raw and tree files, by case name. Each must be refused (exit 2) in one line
    naming it by every command that reads it."""
    rows = taobao_table(3, seed=1).to_pylist()
    line = json.dumps(rows[0]).encode()
    header = ",".join(rows[0]).encode()

    def with_value(column: str, raw: bytes) -> bytes:  # a JSON line whose column holds raw
        return json.dumps({**rows[0], column: "@"}).encode().replace(b'"@"', raw)

    def csv_line(row):
        return ",".join("|".join(map(str, v)) if isinstance(v, list) else str(v)
                        for v in row.values()).encode()

    raw = (data / "raw.parquet").read_bytes()
    files = {
        "empty.jsonl": b"",
        "empty.csv": b"",
        "empty.parquet": b"",
        "header_only.csv": header + b"\n",
        "binary.jsonl": bytes(range(256)) * 8,
        "binary.csv": bytes(range(255, -1, -1)) * 8,
        "binary.parquet": b"PAR1" + bytes(range(256)) * 4 + b"PAR1",
        "truncated.parquet": raw[:len(raw) // 2],
        "truncated_tail.parquet": raw[:-7],
        "null.jsonl": b"null\nnull\n",
        "deep.jsonl": b"[" * 100_000 + b"\n",
        "deep_field.jsonl": line + b"\n" + b'{"user_id": ' + b"[" * 100_000 + b"\n",
        "huge.jsonl": with_value("user_id", b"9" * 400) + b"\n",
        "huge_float.jsonl": with_value("click", b"1e999") + b"\n",
        "huge.csv": header + b"\n" + csv_line({**rows[0], "user_id": 10 ** 30}) + b"\n",
        "nul.jsonl": line + b"\n" + line[:20] + b"\x00" + line[20:] + b"\n",
        "nul.csv": header + b"\n" + csv_line(rows[0]).replace(b",", b",\x00", 1) + b"\n",
        "latin1.jsonl": with_value("pid", b'"241_\xe9"') + b"\n",
        "latin1.csv": header + b"\n" + csv_line({**rows[0], "pid": "@"}).replace(
            b"@", b"241_\xe9") + b"\n",
        "utf16.jsonl": line.decode().encode("utf-16") + b"\n",
    }
    paths = {}
    for name, content in files.items():
        (base / name).write_bytes(content)
        paths[name] = base / name
    for name in ("dir.jsonl", "dir.parquet"):
        (base / name).mkdir()
        paths[name] = base / name
    unreadable = base / "unreadable.jsonl"
    if os.geteuid() == 0:  # root reads any file: a path whose read fails with EIO instead
        unreadable.symlink_to("/proc/self/mem")
    else:
        unreadable.write_bytes(line + b"\n")
        unreadable.chmod(0)
    paths["unreadable.jsonl"] = unreadable
    return paths


# where the refusal must also point inside the file
_WHERE = {"null.jsonl": "line 1", "deep.jsonl": "line 1", "deep_field.jsonl": "line 2",
          "huge.jsonl": "line 1", "huge_float.jsonl": "line 1", "nul.jsonl": "line 2",
          "latin1.jsonl": "line 1", "latin1.csv": "byte offset", "binary.jsonl": "line 1",
          "huge.csv": "line 2", "nul.csv": "line 2", "binary.csv": "byte offset"}


def _sweep(module: str, cases: list[dict], base: Path) -> dict[str, dict]:
    """Run the command on every case in one child process (tests/support/sweep.py)."""
    spec = base / f"{module}.cases.json"
    spec.write_text(json.dumps(cases))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "sweep.py"), module,
                          str(spec)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    started = [line[6:] for line in out.stdout.splitlines() if line.startswith("start ")]
    assert out.returncode == 0, (f"{module} died (exit {out.returncode}) on {started[-1:]}: "
                                 f"{out.stderr[-2000:]}")
    return {r["name"]: r for r in map(json.loads, (line for line in out.stdout.splitlines()
                                                   if line.startswith("{")))}


@pytest.fixture(scope="module")
def bad_files(data, tmp_path_factory) -> dict[str, Path]:
    return _bad_files(tmp_path_factory.mktemp("bad_files"), data)


@pytest.mark.parametrize("module", ["compression.compress", "pipelines.compress",
                                    "trainer.train", "trainer.evaluate", "compression.inspect"])
def test_every_malformed_file_is_refused_in_one_line(module, bad_files, short_run, tmp_path):
    """Each command that reads input files, on each malformed file: exit 2, one line naming
    the file (and the line or byte offset where there is one), no traceback, no output left."""
    _, run, _, _ = short_run
    cases = []
    for name, path in bad_files.items():
        out = tmp_path / f"out-{name}"
        argv = {"compression.compress": ["--schema", SCHEMA, "--input", path, "--output", out],
                "pipelines.compress": ["--schema", SCHEMA, "--input", path, "--output", out],
                "trainer.train": ["--schema", SCHEMA, "--train-data", path, "--out", out,
                                  "--batch-size", "100"],
                "trainer.evaluate": ["--run", run, "--data", path],
                "compression.inspect": [path]}[module]
        cases.append({"name": name, "argv": list(map(str, argv))})
    results = _sweep(module, cases, tmp_path)
    assert sorted(results) == sorted(bad_files)
    wrong = []
    for name, path in bad_files.items():
        result = results[name]
        lines = result["stderr"].strip().splitlines() or [""]
        where = _WHERE.get(name, "") if module != "compression.inspect" else ""
        if not (result["code"] == 2 and "Traceback" not in result["stderr"]
                and lines[-1].startswith(f"python -m {module}: error: ")
                and str(path) in lines[-1] and where in lines[-1]):
            wrong.append((name, result["code"], result["stderr"][-600:]))
    assert wrong == [], "\n".join(map(str, wrong))
    # nothing that looks like output: only the Beam job's rejected rows, beside their output
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".cases.json"))
    assert [n for n in left if not n.endswith(".dead_letter")] == [], left


def test_replay_refuses_every_malformed_file_and_sends_nothing(bad_files, kafka_broker,
                                                               tmp_path):
    """pipelines.replay validates a chunk before sending it: a malformed file is refused in one
    line naming it (exit 2) and none of its samples reaches the topic."""
    topic = kafka_broker.create_topic()
    cases = [{"name": name, "argv": ["--schema", SCHEMA, "--input", str(path),
                                     "--bootstrap-servers", kafka_broker.bootstrap,
                                     "--topic", topic, "--no-progress"]}
             for name, path in bad_files.items()]
    results = _sweep("pipelines.replay", cases, tmp_path)
    wrong = [(name, r["code"], r["stderr"][-600:]) for name, r in results.items()
             if not (r["code"] == 2 and "Traceback" not in r["stderr"]
                     and str(bad_files[name]) in r["stderr"].strip().splitlines()[-1]
                     and _WHERE.get(name, "") in r["stderr"])]
    assert sorted(results) == sorted(bad_files) and wrong == [], "\n".join(map(str, wrong))
    assert kafka_broker.consume_all(topic, idle_seconds=2.0) == []
