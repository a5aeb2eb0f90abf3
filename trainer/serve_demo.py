"""The deployment path end to end, on this machine (``make serve-demo``):

    batch run (trainer.train --export-dir) -> online learning from Kafka initialised from it
    (trainer.online --init-from) -> the prediction service following its exports
    (trainer.serve), with a few ranking requests printed with the version that answered and
    its freshness lag.

Every step is the real command in its own process (a local Tansu broker, generated
taobao_like samples); this module only starts them, streams samples and asks the service.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml")
CONFIG = os.path.join(ROOT, "trainer", "examples", "mlp.yaml")
PROG = "python -m trainer.serve_demo"


def _run(step: str, argv: list[str], log: str) -> None:
    print(f"== {step}", flush=True)
    with open(log, "w") as out:
        code = subprocess.call([sys.executable, *argv], cwd=ROOT, stdout=out,
                               stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"{PROG}: {step} failed (exit {code}); see {log}")


def _start(argv: list[str], log: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


def _wait_for_line(path: str, pattern: str, child: subprocess.Popen, timeout: float = 180):
    """The first match of ``pattern`` in the log ``path`` of ``child`` (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            match = re.search(pattern, f.read())
        if match:
            return match
        if child.poll() is not None:
            raise SystemExit(f"{PROG}: {' '.join(child.args[1:3])} exited; see {path}")
        time.sleep(0.2)
    raise SystemExit(f"{PROG}: nothing like {pattern!r} in {path} within {timeout:.0f} s")


def _status(path: str) -> dict:
    """trainer.online's status.json ({} before the first)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _get(conn, method: str, path: str, body=None):
    conn.request(method, path, None if body is None else json.dumps(body).encode(),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    return response.status, (json.loads(data) if data[:1] in (b"{", b"[") else data.decode())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_out/serve", help="working directory (replaced)")
    parser.add_argument("--samples", type=int, default=120_000,
                        help="generated samples: half for the batch run, half streamed")
    parser.add_argument("--rate", type=float, default=3_000, help="stream samples/s")
    parser.add_argument("--port", type=int, default=8500, help="the service's port")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    path = lambda *p: os.path.join(out, *p)  # noqa: E731
    children = []
    try:
        _run("generating samples (batch days and the live stream)",
             ["-m", "pipelines.generate", "--schema", SCHEMA, "--samples",
              str(args.samples), "--shards", "2", "--out",
              path("raw"), "--seed", "5", "--no-progress"], path("generate.log"))
        _run("batch run: trainer.train --export-dir",
             ["-m", "trainer.train", "--schema", SCHEMA, "--config", CONFIG, "--train-data",
              path("raw", "part-00000.parquet"), "--out", path("batch-run"), "--export-dir",
              path("export"), "--no-progress"], path("train.log"))
        with open(path("train.log")) as f:
            print("   " + f.read().strip().splitlines()[-1][:300], flush=True)

        broker = _start(["-m", "pipelines.local_broker", "--port", "0"], path("broker.log"))
        children.append(broker)
        bootstrap = _wait_for_line(path("broker.log"), r"at (127\.0\.0\.1:\d+)", broker).group(1)
        service = _start(["-m", "trainer.serve", "--export-dir", path("export"), "--port",
                          str(args.port), "--poll-interval", "0.1"], path("serve.log"))
        children.append(service)
        host, port = _wait_for_line(path("serve.log"), r"on http://([0-9.]+):(\d+)",
                                    service).groups()
        print(f"== the service answers on http://{host}:{port} from the batch export", flush=True)
        online = _start(["-m", "trainer.online", "--schema", SCHEMA, "--bootstrap-servers",
                         bootstrap, "--topic", "samples", "--group", "demo", "--run-dir",
                         path("online-run"), "--init-from", path("batch-run"), "--export-dir",
                         path("export"), "--export-every", "1", "--checkpoint-every", "10",
                         "--metrics-port", "0", "--report-every", "5",
                         "-X", "session.timeout.ms=6000", "-X", "heartbeat.interval.ms=500"],
                        path("online.log"))
        children.append(online)
        _wait_for_line(path("online.log"), r"metrics on http", online)  # up; joins as the
        status_path = path("online-run", "status.json")                  # topic appears
        import pyarrow.parquet as pq

        streamed = pq.ParquetFile(path("raw", "part-00001.parquet")).metadata.num_rows
        replay = _start(["-m", "pipelines.replay", "--schema", SCHEMA, "--input",
                         path("raw", "part-00001.parquet"), "--bootstrap-servers", bootstrap,
                         "--topic", "samples", "--rate", str(args.rate), "--no-progress"],
                        path("replay.log"))
        children.append(replay)
        print(f"== streaming {streamed:,} samples at {args.rate:,.0f}/s into Kafka; "
              "trainer.online (initialised from the batch run) publishes a version a second",
              flush=True)

        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        user = {"user_id": 7, "cms_segid": 0, "cms_group_id": 3, "gender": 1, "age_level": 3,
                "pvalue_level": 2, "shopping_level": 3, "occupation": 0, "city_level": 2,
                "clicked_items": [101, 202], "clicked_cats": [5], "clicked_brands": [77]}
        candidates = [{"ad_id": 1000 + i, "campaign_id": 10 + i, "customer_id": 20 + i,
                       "cate_id": 5, "brand_id": 77 + i, "price": [19.9 + i],
                       "creative_id": 5000 + i, "pid": "430548_1007", "hour": 20,
                       "weekday": 3, "position": 1} for i in range(3)]
        print(f"{'time':>6}  {'lineage':>8}  {'version':>7}  {'step':>6}  {'lag (s)':>7}  "
              "click probability of 3 candidates for user 7", flush=True)
        started, last = time.monotonic(), None

        # until the whole stream is trained and the service answers on the trainer's newest
        # step (the version published after its last unit)
        while time.monotonic() - started < 300:
            status = _status(status_path)
            if (replay.poll() is not None and status.get("samples", 0) >= streamed
                    and last is not None and last[2] >= status.get("steps", 0)):
                break
            status, answer = _get(conn, "POST", "/v1/predict",
                                  {"root": user, "candidates": candidates})
            if status == 200:
                m = answer["model"]
                lag = "-" if m["freshness_lag_s"] is None else f"{m['freshness_lag_s']:.2f}"
                key = (m["lineage"], m["version"], m["step"])
                if key != last:
                    probabilities = " ".join(f"{p['click']:.4f}" for p in answer["predictions"])
                    print(f"{time.monotonic() - started:6.1f}  {m['lineage'][:8]:>8}  "
                          f"{m['version']:>7}  {m['step']:>6}  {lag:>7}  {probabilities}",
                          flush=True)
                    last = key
            time.sleep(0.25)
        status, ready = _get(conn, "GET", "/readyz")
        _, metrics = _get(conn, "GET", "/metrics")
        shown = [line for line in metrics.splitlines() if line.startswith((
            "prefixrec_serve_model_version", "prefixrec_serve_freshness_lag_seconds",
            "prefixrec_serve_versions_applied_total", "prefixrec_serve_failed_applies_total",
            "prefixrec_serve_requests_total"))]
        print(f"== /readyz: {status} {ready.strip()}; from /metrics:", flush=True)
        for line in shown:
            print("   " + line, flush=True)
        with open(path("online-run", "status.json")) as f:
            summary = json.load(f)
        auc = summary["pv"]["auc"]
        print(f"== trainer.online: {summary['samples']:,} samples trained, progressive "
              f"validation AUC {'n/a' if auc is None else f'{auc:.4f}'}, "
              f"{summary['exports']} exports, metrics at {summary['metrics_url']}", flush=True)
    finally:
        for child in reversed(children):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in reversed(children):
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
    print(f"== stopped; logs and run directories in {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
