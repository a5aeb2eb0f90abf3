"""compression.cli in process: the error path's exit codes and the staged output."""

import os

import pyarrow as pa
import pytest

from compression import RawDataError, cli


def test_errors_map_to_one_line_and_an_exit_code(capsys):
    def fails(error):
        return cli.run_command("prog", lambda argv: (_ for _ in ()).throw(error), [])

    assert fails(RawDataError("f.csv: column 'x' line 3: bad")) == 2
    assert capsys.readouterr().err == "prog: error: f.csv: column 'x' line 3: bad\n"
    assert fails(FileNotFoundError(2, "No such file or directory", "x.yaml")) == 2
    assert capsys.readouterr().err == "prog: error: x.yaml: no such file or directory\n"
    assert fails(pa.ArrowInvalid("Parquet file size is 0 bytes")) == 2
    assert capsys.readouterr().err == (
        "prog: error: cannot read the input: Parquet file size is 0 bytes\n")
    assert fails(PermissionError(13, "Permission denied", "/out")) == 1
    assert capsys.readouterr().err == "prog: error: /out: Permission denied\n"
    assert fails(KeyError("x")) == 1
    assert "KeyError: 'x' (unexpected; rerun with --debug" in capsys.readouterr().err
    assert fails(KeyboardInterrupt()) == 130
    assert fails(cli.Terminated()) == 143
    assert capsys.readouterr().err.splitlines() == [
        "prog: interrupted", "prog: terminated"]


def test_a_service_stopped_by_a_signal_exits_0(capsys):
    def stopped(error):
        return cli.run_command("prog", lambda argv: (_ for _ in ()).throw(error), [],
                               service=True)

    assert stopped(KeyboardInterrupt()) == 0
    assert stopped(cli.Terminated()) == 0
    assert capsys.readouterr().err.splitlines() == [
        "prog: stopped by SIGINT", "prog: stopped by SIGTERM"]


def test_staged_output_commits_whole_or_leaves_nothing(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with cli.StagedOutput(str(target)) as staged:
            (open(os.path.join(staged.tmp, "part-0"), "w")).close()
            raise RuntimeError("midway")
    assert os.listdir(tmp_path) == []

    with cli.StagedOutput(str(target)) as staged:
        open(os.path.join(staged.tmp, "a"), "w").close()
        staged.commit()
    assert os.listdir(target) == ["a"]
    with pytest.raises(cli.OutputExistsError, match="not empty .1 entry.; pass --overwrite"):
        cli.StagedOutput(str(target))
    with cli.StagedOutput(str(target), overwrite=True) as staged:
        open(os.path.join(staged.tmp, "b"), "w").close()
        staged.commit()
    assert os.listdir(target) == ["b"] and sorted(os.listdir(tmp_path)) == ["out"]
    (tmp_path / "file").write_text("")
    with pytest.raises(cli.UsageError, match="exists and is not a directory"):
        cli.StagedOutput(str(tmp_path / "file"), overwrite=True)
