"""compression.fs: paths, globs, errors and manifest publishing, locally and on a real S3
server (moto's server mode, the ``s3_bucket`` fixture)."""

import json
import os
import subprocess
import sys

import pyarrow.fs as pafs
import pytest

from compression import cli, fs
from s3_server import moto_s3_server


def test_path_helpers_keep_uris_and_local_paths_apart():
    assert fs.scheme("s3://b/k") == "s3" and fs.scheme("/tmp/x") is None
    assert fs.scheme("file:///tmp/x") is None and fs.local_path("file:///tmp/x") == "/tmp/x"
    assert fs.join("s3://b/dir/", "a", "b.parquet") == "s3://b/dir/a/b.parquet"
    assert fs.join("/tmp", "a") == "/tmp/a"
    assert fs.dirname("s3://b/dir/x") == "s3://b/dir" and fs.dirname("s3://b") == "s3://b"
    assert fs.basename("gs://b/dir/x.parquet") == "x.parquet"


def test_gs_and_hdfs_resolve_through_the_same_layer_without_the_network():
    filesystem, inner = fs.resolve("gs://bucket/logs/x.parquet")
    assert isinstance(filesystem, pafs.GcsFileSystem) and inner == "bucket/logs/x.parquet"
    # no JVM or libhdfs on this machine: the error says what the client needs
    with pytest.raises(fs.StorageError, match=r"^hdfs://127\.0\.0\.1:9/x: cannot load the HDFS "
                                              r"client; .*JAVA_HOME, HADOOP_HOME"):
        fs.resolve("hdfs://127.0.0.1:9/x")


def test_hdfs_paths_keep_their_name_node_and_fail_in_one_line():
    assert fs.scheme("hdfs://nn:8020/logs/x.parquet") == "hdfs"
    assert fs.join("hdfs://nn:8020/logs", "day=1", "x.parquet") == \
        "hdfs://nn:8020/logs/day=1/x.parquet"
    assert fs.dirname("hdfs://nn:8020/logs/x.parquet") == "hdfs://nn:8020/logs"
    assert fs.basename("hdfs://nn:8020/logs/x.parquet") == "x.parquet"
    for call in (lambda: fs.expand("hdfs://nn:8020/logs/*.parquet"),
                 lambda: fs.write_bytes("hdfs://nn:8020/out/x", b"x")):
        with pytest.raises(fs.StorageError, match=r"^hdfs://nn:8020/[a-z/*.]+: cannot load the "
                                                  r"HDFS client; [^\n]*CLASSPATH") as e:
            call()
        assert "\n" not in str(e.value)


def test_gs_without_credentials_fails_fast_in_one_line(monkeypatch, tmp_path):
    """No network: refused before any request when the environment says this is not a Google
    Cloud machine; otherwise the client's own failure to get a token (its metadata server on
    an unreachable loopback port), within the retry limit, as one line."""
    import time

    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))  # no gcloud login
    monkeypatch.setenv("NO_GCE_CHECK", "true")
    with pytest.raises(fs.StorageError, match=r"^gs://bucket/logs/\*\.parquet: no GCS "
                                              r"credentials: set GOOGLE_APPLICATION_CREDENTIALS"):
        fs.expand("gs://bucket/logs/*.parquet")
    monkeypatch.delenv("NO_GCE_CHECK")
    monkeypatch.setenv("GCE_METADATA_ROOT", "127.0.0.1:1")
    monkeypatch.setattr(fs, "GCS_RETRY_SECONDS", 1.0)
    started = time.monotonic()
    with pytest.raises(fs.StorageError) as e:
        fs.read_bytes("gs://bucket/model/export.json")
    assert str(e.value).startswith("gs://bucket/model/export.json: no usable credentials for "
                                   "the store; set GOOGLE_APPLICATION_CREDENTIALS")
    assert "\n" not in str(e.value) and time.monotonic() - started < 10


def test_local_expand_is_the_globs_of_before(tmp_path):
    for name in ["b.parquet", "a.parquet", "_stats.json", ".hidden.parquet", "c.csv", "d.txt"]:
        (tmp_path / name).write_text("x")
    assert fs.expand(str(tmp_path), (".parquet", ".csv")) == [
        str(tmp_path / n) for n in ["a.parquet", "b.parquet", "c.csv"]]
    assert fs.expand(str(tmp_path / "*.parquet")) == [
        str(tmp_path / n) for n in ["a.parquet", "b.parquet"]]
    with pytest.raises(FileNotFoundError, match="no input files match"):
        fs.expand(str(tmp_path / "none*"))


def test_read_write_list_delete_on_s3(s3_bucket):
    path = fs.join(s3_bucket, "dir", "x.json")
    assert not fs.exists(path)
    fs.write_text(path, '{"a": 1}')
    assert fs.exists(path) and fs.isdir(fs.join(s3_bucket, "dir"))
    assert json.loads(fs.read_text(path)) == {"a": 1} and fs.size(path) == 8
    fs.write_bytes(fs.join(s3_bucket, "dir", "sub", "y"), b"yy")
    assert fs.list_files(fs.join(s3_bucket, "dir")) == [f"{s3_bucket}/dir/sub/y", path]
    fs.delete_tree(fs.join(s3_bucket, "dir"))
    assert fs.list_files(s3_bucket) == [] and not fs.exists(path)


def test_s3_globs_match_like_local_globs(s3_bucket, tmp_path):
    names = ["2024-05-01/part-0.parquet", "2024-05-01/part-1.parquet", "2024-05-02/part-0.parquet",
             "2024-05-02/_SUCCESS", "2024-05-02/.part-2.parquet", "2024-06-01/part-0.csv",
             "2024-05-01/deeper/part-9.parquet", "top.parquet"]
    for name in names:
        fs.write_bytes(fs.join(s3_bucket, "logs", name), b"x")
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    patterns = ["2024-05-*/part-*.parquet", "2024-0?-0[12]/*.*", "*/part-0.*", "2024-05-01",
                "2024-05-02/.part-*", "top.parquet", "2024-05-01/part-1.parquet"]
    for pattern in patterns:
        remote = fs.expand(f"{s3_bucket}/logs/{pattern}", (".parquet", ".csv"))
        local = fs.expand(str(tmp_path / pattern), (".parquet", ".csv"))
        assert [p[len(s3_bucket) + 6:] for p in remote] == \
            [os.path.relpath(p, tmp_path) for p in local], pattern
    assert fs.expand(f"{s3_bucket}/logs/2024-05-*/part-*.parquet") == [
        f"{s3_bucket}/logs/{n}" for n in names[:3]]
    with pytest.raises(fs.NoSuchPath) as err:
        fs.expand(f"{s3_bucket}/logs/2023-*/*.parquet")
    assert str(err.value) == f"no input files match '{s3_bucket}/logs/2023-*/*.parquet'"
    assert isinstance(err.value, FileNotFoundError)
    with pytest.raises(fs.StorageError, match="a glob in the bucket name is not supported"):
        fs.expand("s3://logs-*/x.parquet")


def test_store_errors_are_one_line_naming_the_path(s3_bucket):
    missing = "s3://no-such-bucket-here/logs/*.parquet"
    with pytest.raises(fs.StorageError) as err:
        fs.expand(missing)
    assert str(err.value) == (f"{missing}: the bucket 'no-such-bucket-here' does not exist; "
                              "create it or fix the path")
    with pytest.raises(fs.StorageError, match="the bucket 'no-such-bucket-here' does not exist"):
        fs.write_bytes("s3://no-such-bucket-here/x", b"1")
    key, secret = os.environ.pop("AWS_ACCESS_KEY_ID"), os.environ.pop("AWS_SECRET_ACCESS_KEY")
    try:
        with pytest.raises(fs.StorageError) as err:
            fs.expand(f"{s3_bucket}/*.parquet")
        assert str(err.value) == (f"{s3_bucket}/*.parquet: no S3 credentials: set "
                                  "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) "
                                  "in the environment")
    finally:
        os.environ.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
    assert secret not in str(err.value)


def test_refused_credentials_and_permissions_on_a_server_that_checks_them():
    """moto with authentication on (after its first four requests: the readiness probe, a
    bucket, a user and its key): unknown keys are refused, a user without a policy is denied."""
    import boto3

    with moto_s3_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "4"}) as server, \
            server.environment():
        bucket = server.create_bucket("locked")
        iam = boto3.client("iam")
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        with pytest.raises(fs.StorageError) as err:
            fs.expand(f"{bucket}/*.parquet")
        assert str(err.value).startswith(f"{bucket}/*.parquet: the store refused the "
                                         "credentials; set AWS_ACCESS_KEY_ID")
        with pytest.raises(fs.StorageError) as err:  # a HEAD's 403 has no body to tell why
            fs.exists(f"{bucket}/x.parquet")
        assert str(err.value).startswith(f"{bucket}/x.parquet: access refused to look it up: "
                                         "the credentials are not allowed, or not valid")
        os.environ.update(AWS_ACCESS_KEY_ID=key["AccessKeyId"],
                          AWS_SECRET_ACCESS_KEY=key["SecretAccessKey"])
        with pytest.raises(fs.StorageError) as err:
            fs.write_bytes(f"{bucket}/x.parquet", b"1")
        assert str(err.value) == (f"{bucket}/x.parquet: permission refused to write it; give "
                                  "these credentials access to it, or use others")
        assert key["SecretAccessKey"] not in str(err.value)


def _publish(directory, files, overwrite=False):
    staged = cli.StagedOutput(directory, overwrite)
    assert isinstance(staged, fs.StagedObjectOutput)
    for name, data in files.items():
        fs.write_bytes(fs.join(staged.tmp, name), data)
    return staged


def test_a_manifest_written_last_publishes_a_directory_all_or_nothing(s3_bucket):
    out = fs.join(s3_bucket, "trees")
    first = _publish(out, {"part-0.parquet": b"0", "part-1.parquet": b"1",
                           "_stats.json": b"{}", "_dead_letter/a.jsonl": b"bad"})
    with pytest.raises(fs.NoSuchPath):  # staged, not published: readers see nothing
        fs.expand(out)
    first.commit()
    files = fs.expand(out, (".parquet",))
    assert [fs.basename(f) for f in files] == ["part-0.parquet", "part-1.parquet"]
    assert fs.expand(fs.join(out, "*-1.parquet")) == [files[1]]
    assert fs.read_bytes(fs.resolve_published(fs.join(out, "_stats.json"))) == b"{}"
    assert fs.read_bytes(fs.resolve_published(fs.join(out, "_dead_letter", "a.jsonl"))) == b"bad"
    assert fs.expand(fs.join(out, "_stats.json")) == [fs.join(out, first.generation,
                                                              "_stats.json")]
    # a second output into the same directory is refused without --overwrite
    with pytest.raises(cli.OutputExistsError, match="pass --overwrite"):
        cli.StagedOutput(out)
    # a writer that dies before its manifest: the old output stays whole, its files hidden
    crashed = _publish(out, {"part-0.parquet": b"new"}, overwrite=True)
    assert [fs.read_bytes(f) for f in fs.expand(out)] == [b"0", b"1"]
    # the next publish replaces the output and removes the old and the crashed generations
    second = _publish(out, {"part-0.parquet": b"2"}, overwrite=True)
    second.commit()
    assert [fs.read_bytes(f) for f in fs.expand(out)] == [b"2"]
    left = {f[len(out) + 1:].split("/")[0] for f in fs.list_files(out)}
    assert left == {fs.MANIFEST, second.generation}
    assert crashed.generation not in left and first.generation not in left
    # a discarded output leaves nothing
    third = _publish(out, {"part-0.parquet": b"3"}, overwrite=True)
    third.discard()
    assert {f[len(out) + 1:].split("/")[0] for f in fs.list_files(out)} == left


def test_leftovers_of_a_dead_writer_do_not_block_a_new_output(s3_bucket):
    out = fs.join(s3_bucket, "trees")
    _publish(out, {"part-0.parquet": b"0"})  # never committed
    staged = _publish(out, {"part-0.parquet": b"1"})  # no --overwrite needed
    staged.commit()
    assert [fs.read_bytes(f) for f in fs.expand(out)] == [b"1"]
    assert len({f.split("/")[4] for f in fs.list_files(out)}) == 2  # manifest + generation


def test_a_command_prints_a_store_error_as_one_line(s3_server):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
           **s3_server.env()}
    result = subprocess.run([sys.executable, "-m", "compression.inspect",
                             "s3://no-such-bucket-here/trees"], capture_output=True, text=True,
                            env=env)
    assert result.returncode == 2
    assert result.stderr == ("python -m compression.inspect: error: s3://no-such-bucket-here/"
                             "trees: the bucket 'no-such-bucket-here' does not exist; create "
                             "it or fix the path\n")
