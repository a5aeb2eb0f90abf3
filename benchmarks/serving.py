"""Benchmark of the prediction service (``python -m trainer.serve``), every number against a
baseline measured in the same run:

    python -m benchmarks.serving [--tiny]
    python -m benchmarks.serving --concurrency 1,8,32 --seconds 20 [--face oip]
    python -m benchmarks.serving --concurrency 32 --versions-every 1 --seconds 20
    python -m benchmarks.serving --ranking-vs-flat --candidates 500 --seconds 20

1. freshness: a producer sends ``--rate`` taobao_like samples/s to a local Tansu broker,
   ``trainer.online`` trains them with ``--export-every`` and the service follows its export;
   a client asks the service every 20 ms. A sample's freshness is the time from its arrival
   (its Kafka timestamp) to the first answer computed on a version that includes it
   (``newest_sample_time`` of the answering version >= its arrival). Target p99 <= 3 s.
2. latency under load: HTTP clients in separate processes (keep-alive connections) send
   requests of 1 and of 100 samples for ``--seconds`` s, alternating phases without updates and
   with a new version (20k samples' deltas + dense weights) published every second; p50/p99 of
   both, in the same run. Target: p99 with updates within 1.5x of p99 without.
3. throughput: samples/s of the service at 100 samples a request against the in-process
   ``Predictor`` on the same samples (the bound).
4. structured serving: one user x 500 candidates per request as a ranking request (the user's
   part once) against the same 500 samples flat, alternating requests from one client:
   candidates/s and p50/p99 of both, and a 1-candidate ranking request's p50 (what any
   request costs); target >= 2x. ``--ranking-vs-flat`` runs this part alone (``--candidates``,
   ``--seconds``) on a model trained on 30k samples.
5. reload memory: the served model's largest table grown to ``--reload-rows`` rows, then a
   new full export of the same model (a new lineage) with 1% and with every row changed, and
   one of another model: the service process's peak RSS while it takes the new export in
   (``VmHWM`` after ``/proc/self/clear_refs``) above its RSS before, against the memory the
   served model itself holds. A rebase should cost the changed rows, a whole load the model.
6. concurrency (``--concurrency 1,8,32``, run alone): locust clients (headless, in a process of
   their own: ``benchmarks/serving_locustfile.py``) send 1 user x ``--load-candidates``
   candidates ranking requests for ``--seconds`` s at each concurrency, to the service with
   batching (its defaults) and without (``--max-batch-samples 0``): candidates/s against the
   in-process ``LiveModel.predict_tree`` on the same requests one after another (target >= 0.8x
   at 32 clients), p50/p99 (target p99 <= 4x the 1-client p50), non-200 answers. With
   ``--face tfserving-rest`` or ``--face oip`` the same samples go to that face instead
   (TF Serving REST ``instances``, Open Inference Protocol JSON tensors; ``--face samples``:
   the service's own ``{"samples": [...]}``, their native like): flat samples, the user's
   features in each, against the in-process ``LiveModel.predict`` of the same rows.
   With ``--versions-every 1``: the service with batching only, each concurrency in
   alternating phases (``--rounds`` of each) without new versions and with one (of
   ``--version-samples`` samples) published every second: p99 of both, target with <= 1.5x
   without.
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml")
CONFIG = os.path.join(ROOT, "trainer", "examples", "mlp.yaml")


# -- the service as a child process ---------------------------------------------------------

class Service:
    def __init__(self, export_dir: str, *args: str):
        self.child = subprocess.Popen(
            [sys.executable, "-m", "trainer.serve", "--export-dir", export_dir, "--port", "0",
             *args], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        self.lines = []
        for line in self.child.stderr:
            self.lines.append(line)
            match = re.search(r"on http://([0-9.]+):(\d+)", line)
            if match:
                self.host, self.port = match.group(1), int(match.group(2))
                break
        else:
            raise RuntimeError("the service did not start:\n" + "".join(self.lines))
        threading.Thread(target=lambda: self.lines.extend(self.child.stderr),
                         daemon=True).start()

    def model(self) -> dict:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        conn.request("GET", "/v1/model")
        info = json.loads(conn.getresponse().read())
        conn.close()
        return info

    def wait_for(self, condition, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            info = self.model()
            if condition(info):
                return info
            if time.monotonic() > deadline:
                raise RuntimeError(f"service: condition not reached: {info}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.child.send_signal(signal.SIGTERM)
        self.child.wait(60)


def post(conn: http.client.HTTPConnection, body: bytes) -> dict:
    conn.request("POST", "/v1/predict", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {data[:300]!r}")
    return json.loads(data)


def _load_worker(host, port, body, seconds, threads, out):
    """One load-generator process (spawned: no TensorFlow): ``threads`` keep-alive clients
    sending ``body`` back to back for ``seconds``; puts the latencies."""
    latencies, lock = [], threading.Lock()
    deadline = time.monotonic() + seconds

    def client():
        conn = http.client.HTTPConnection(host, port, timeout=60)
        mine = []
        while time.monotonic() < deadline:
            started = time.perf_counter()
            post(conn, body)
            mine.append(time.perf_counter() - started)
        with lock:
            latencies.extend(mine)

    workers = [threading.Thread(target=client) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out.put(latencies)


def load(service: Service, body: bytes, seconds: float, processes: int, threads: int) -> dict:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    workers = [context.Process(target=_load_worker, args=(service.host, service.port, body,
                                                          seconds, threads, out))
               for _ in range(processes)]
    for w in workers:
        w.start()
    latencies = np.concatenate([out.get() for _ in workers])
    for w in workers:
        w.join()
    return {"requests": len(latencies), "requests_per_sec": len(latencies) / seconds,
            "p50_ms": float(np.percentile(latencies, 50) * 1e3),
            "p99_ms": float(np.percentile(latencies, 99) * 1e3)}


def post_raw(conn: http.client.HTTPConnection, body: bytes) -> bytes:
    """``body`` posted to /v1/predict; the answer's bytes, read whole but not parsed (as a
    load generator reads them: the client's JSON parser is not the service's cost)."""
    conn.request("POST", "/v1/predict", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {data[:300]!r}")
    return data


def ranking_vs_flat(service: Service, schema, candidates: int, seconds: float,
                    users: int = 8, seed: int = 6) -> dict:
    """1 user x ``candidates`` candidates as one ranking request (the user's features once)
    against the same samples flat (the user's features in each), ``users`` users' requests
    in turn, from one keep-alive client, alternating a ranking and a flat request for
    ``seconds``: candidates/s of each (candidates over the seconds spent in its requests),
    p50/p99, and the ratios; and a ranking request of one candidate among them (what any
    request costs: HTTP, JSON, one model call). Both answers of every user are checked equal
    first."""
    user_names = [f.name for f in schema.layers[0].features]
    pool = _samples(schema, users * (1 + candidates), seed=seed)
    pairs = []
    for k in range(users):
        chunk = pool[k * (1 + candidates):(k + 1) * (1 + candidates)]
        root = {n: chunk[0][n] for n in user_names}
        rest = [{n: v for n, v in c.items() if n not in user_names} for c in chunk[1:]]
        pairs.append((json.dumps({"root": root, "candidates": rest}).encode(),
                      json.dumps({"samples": [{**root, **c} for c in rest]}).encode(),
                      json.dumps({"root": root, "candidates": rest[:1]}).encode()))
    conn = http.client.HTTPConnection(service.host, service.port, timeout=60)
    try:
        for tree, flat, _ in pairs:
            a = np.array([p["click"] for p in post(conn, tree)["predictions"]])
            b = np.array([p["click"] for p in post(conn, flat)["predictions"]])
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        times = {"tree": [], "flat": [], "one": []}
        deadline = time.monotonic() + seconds
        k = 0
        while time.monotonic() < deadline or not times["flat"]:
            tree, flat, one = pairs[k % users]
            # which goes first alternates too
            for name, body in ((("tree", tree), ("flat", flat)) if k % 2 == 0 else
                               (("flat", flat), ("tree", tree))) + (("one", one),):
                started = time.perf_counter()
                post_raw(conn, body)
                times[name].append(time.perf_counter() - started)
            k += 1
    finally:
        conn.close()
    one = np.array(times.pop("one"))
    out = {"candidates": candidates, "users": users, "seconds": seconds,
           "one_candidate_p50_ms": float(np.percentile(one, 50) * 1e3)}
    for name, t in times.items():
        t = np.array(t)
        out[name] = {"requests": len(t), "candidates_per_sec": candidates * len(t) / t.sum(),
                     "p50_ms": float(np.percentile(t, 50) * 1e3),
                     "p99_ms": float(np.percentile(t, 99) * 1e3)}
    out["speedup"] = out["tree"]["candidates_per_sec"] / out["flat"]["candidates_per_sec"]
    out["speedup_p50"] = out["flat"]["p50_ms"] / out["tree"]["p50_ms"]
    return out


def _print_ranking_vs_flat(s: dict) -> None:
    print(f"  1 user x {s['candidates']} candidates over HTTP, one client, ranking and flat "
          f"requests alternating ({s['users']} users, {s['seconds']} s): ranking "
          f"{s['tree']['candidates_per_sec']:,.0f} candidates/s (p50 {s['tree']['p50_ms']:.1f} "
          f"ms, p99 {s['tree']['p99_ms']:.1f}), flat {s['flat']['candidates_per_sec']:,.0f} "
          f"(p50 {s['flat']['p50_ms']:.1f} ms, p99 {s['flat']['p99_ms']:.1f}): "
          f"{s['speedup']:.2f}x candidates/s, {s['speedup_p50']:.2f}x at p50 (target >= 2x); "
          f"a ranking request of 1 candidate p50 {s['one_candidate_p50_ms']:.1f} ms")


def ranking_mode(args, schema, work: str) -> dict:
    """``--ranking-vs-flat``: the service (its defaults) over a model trained on 30k samples,
    :func:`ranking_vs_flat` for ``--seconds`` at ``--candidates`` candidates."""
    from trainer.serving import export_increment

    export = os.path.join(work, "export")
    export_increment(_trained(schema, 5_000 if args.tiny else 30_000, seed=1), export)
    service = Service(export)
    try:
        ranking_vs_flat(service, schema, args.candidates, min(1.0, args.seconds))  # warm
        return ranking_vs_flat(service, schema, args.candidates, args.seconds)
    finally:
        service.stop()


# -- concurrency: locust against the service, the in-process LiveModel as the bound ----------

LOCUSTFILE = os.path.join(ROOT, "benchmarks", "serving_locustfile.py")


def locust_load(service: Service, bodies: str, users: int, seconds: float, work: str,
                path: str = "/v1/predict") -> dict:
    """``users`` locust clients (one process of its own, headless, keep-alive, no wait) for
    ``seconds``, posting to ``path``: requests/s, p50/p99 of every request's latency and the
    non-200 answers."""
    times = os.path.join(work, f"locust-{users}.json")
    command = [os.path.join(os.path.dirname(sys.executable), "locust"), "-f", LOCUSTFILE,
               "--headless", "--users", str(users), "--spawn-rate", str(users * 100),
               "--run-time", f"{max(1, round(seconds))}s", "--host",
               f"http://{service.host}:{service.port}", "--only-summary", "--loglevel",
               "WARNING", "--stop-timeout", "30"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={
        **os.environ, "PREFIXREC_BENCH_BODIES": bodies, "PREFIXREC_BENCH_TIMES": times,
        "PREFIXREC_BENCH_PATH": path})
    if not os.path.exists(times):
        raise RuntimeError(f"locust ended without a report (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    with open(times) as f:
        report = json.load(f)
    os.remove(times)
    ms = np.array(report["ms"])
    if not len(ms):
        raise RuntimeError(f"locust sent nothing:\n{done.stderr[-3000:]}")
    return {"users": users, "requests": len(ms), "non_200": report["non_200"],
            "requests_per_sec": len(ms) / report["seconds"],
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


# what each face's request of the concurrency part is: its path and its body
FACE_PATHS = {"own": "/v1/predict", "samples": "/v1/predict",
              "tfserving-rest": "/v1/models/prefixrec:predict",
              "oip": "/v2/models/prefixrec/infer"}


def _face_body(face: str, schema, root: dict, candidates: list[dict]) -> dict:
    """A ranking request as ``face`` sends it: the service's own tree, or flat samples (the
    faces have no tree form) as TF Serving instances or OIP tensors (trainer/faces/)."""
    if face == "own":
        return {"root": root, "candidates": candidates}
    rows = [{**root, **c} for c in candidates]
    if face == "samples":  # the service's own JSON, flat: the faces' like
        return {"samples": rows}
    if face == "tfserving-rest":
        return {"instances": rows}
    tensors = []
    for f in schema.features:
        values = [r[f.name] for r in rows]
        datatype = "BYTES" if f.dtype == "string" else "INT64"
        if f.kind == "id":
            tensors.append({"name": f.name, "shape": [len(rows)], "datatype": datatype,
                            "data": values})
        elif f.kind == "dense":
            tensors.append({"name": f.name, "shape": [len(rows), f.dim], "datatype": "FP32",
                            "data": values})
        else:  # a ragged pair: all samples' values, each sample's count
            flat = [v for value in values for v in value]
            tensors += [{"name": f.name, "shape": [len(flat)], "datatype": datatype,
                         "data": flat},
                        {"name": f.name + "/row_lengths", "shape": [len(rows)],
                         "datatype": "INT64", "data": [len(v) for v in values]}]
    return {"inputs": tensors}


def concurrency(args, schema, work: str) -> dict:
    """1 user x ``--candidates`` candidates ranking requests from 1, 8, 32... locust clients
    against the service with batching (its defaults) and without (``--max-batch-samples
    0``), and the in-process ``LiveModel.predict_tree`` scoring the same requests one after
    another in one thread (the bound)."""
    from trainer.live import LiveModel
    from trainer.serving import export_increment

    levels = [int(c) for c in args.concurrency.split(",")]
    export = os.path.join(work, "export")
    trainer = _trained(schema, 5_000 if args.tiny else 30_000, seed=1)
    export_increment(trainer, export)
    users = [f.name for f in schema.layers[0].features]
    pool = _samples(schema, 32 * (1 + args.load_candidates), seed=7)
    requests = []
    for k in range(32):  # 32 users, each with its own candidates
        chunk = pool[k * (1 + args.load_candidates):(k + 1) * (1 + args.load_candidates)]
        requests.append(({n: chunk[0][n] for n in users},
                         [{n: v for n, v in s.items() if n not in users} for s in chunk[1:]]))
    bodies = os.path.join(work, "bodies.jsonl")
    with open(bodies, "w") as f:
        for root, candidates in requests:
            f.write(json.dumps(_face_body(args.face, schema, root, candidates)) + "\n")

    live = LiveModel(export)

    def bound(root, candidates):  # the same work in process: trees, or flat rows (faces)
        if args.face == "own":
            return live.predict_tree(root, candidates)
        return live.predict([{**root, **c} for c in candidates])

    try:  # the bound: the same requests scored one after another in one thread
        for root, candidates in requests[:4]:
            bound(root, candidates)
        started, done = time.perf_counter(), 0
        while time.perf_counter() - started < args.seconds:
            for root, candidates in requests:
                bound(root, candidates)
                done += len(candidates)
        in_process = done / (time.perf_counter() - started)
    finally:
        live.close()

    result = {"candidates": args.load_candidates, "seconds": args.seconds, "face": args.face,
              "in_process_candidates_per_sec": in_process, "modes": {}}
    if args.versions_every:
        result["versions"] = _under_versions(args, schema, trainer, export, bodies, levels,
                                             work)
        return result
    modes = {"batching": [], "no_batching": ["--max-batch-samples", "0"]}
    for mode, flags in modes.items():
        service = Service(export, *flags)
        try:
            locust_load(service, bodies, 1, 1, work, FACE_PATHS[args.face])  # warm
            runs = {}
            for users in levels:
                r = locust_load(service, bodies, users, args.seconds, work,
                                FACE_PATHS[args.face])
                r["candidates_per_sec"] = r["requests_per_sec"] * args.load_candidates
                r["vs_in_process"] = r["candidates_per_sec"] / in_process
                runs[str(users)] = r
            metrics = _scrape_batches(service)
        finally:
            service.stop()
        first = runs[str(levels[0])]
        for r in runs.values():
            r["p99_vs_1_client_p50"] = r["p99_ms"] / first["p50_ms"] if first["p50_ms"] \
                else float("nan")
        result["modes"][mode] = {"flags": flags, "runs": runs, **metrics}
    return result


def _under_versions(args, schema, trainer, export: str, bodies: str, levels: list[int],
                    work: str) -> dict:
    """The service with batching (its defaults) at each concurrency, in phases without new
    versions and with one published every ``--versions-every`` s (``--rounds`` of each,
    alternating): p50/p99 of both and their ratio. The versions (``--version-samples``
    samples trained into each, published by ``export_increment`` as the online trainer
    publishes them) are made before the clock starts, then copied into the served export
    directory one a period, each version's files before its manifest."""
    served = os.path.join(work, "served")
    shutil.copytree(export, served)
    every = args.versions_every
    count = len(levels) * args.rounds * int(np.ceil(args.seconds / every) + 1)
    _publish_versions(trainer, schema, export, count, args.version_samples, seed=100)
    service = Service(served, "--poll-interval", "0.1")
    published = 0
    out = {"every_s": every, "version_samples": args.version_samples, "runs": {}}
    try:
        locust_load(service, bodies, 1, 1, work, FACE_PATHS[args.face])  # warm
        for users in levels:
            phases = {"none": [], "updates": []}
            for _ in range(args.rounds):
                phases["none"].append(locust_load(service, bodies, users, args.seconds, work,
                                                  FACE_PATHS[args.face]))
                stop = threading.Event()

                def publish():
                    nonlocal published
                    while not stop.is_set() and published < count:
                        published += 1
                        _copy_version(export, served, published)
                        stop.wait(every)

                publisher = threading.Thread(target=publish)
                publisher.start()
                try:
                    phases["updates"].append(locust_load(service, bodies, users, args.seconds,
                                                         work, FACE_PATHS[args.face]))
                finally:
                    stop.set()
                    publisher.join()
            run = {}
            for name, got in phases.items():
                run[name] = {"requests": sum(r["requests"] for r in got),
                             "non_200": sum(r["non_200"] for r in got),
                             "candidates_per_sec": float(np.mean(
                                 [r["requests_per_sec"] for r in got])) * args.load_candidates,
                             "p50_ms": float(np.median([r["p50_ms"] for r in got])),
                             "p99_ms": float(np.max([r["p99_ms"] for r in got])),
                             "p99_ms_rounds": [r["p99_ms"] for r in got]}
            run["p99_ratio"] = run["updates"]["p99_ms"] / run["none"]["p99_ms"]
            out["runs"][str(users)] = run
        info = service.wait_for(lambda i: i["model"]["version"] == published)
        out["published"] = published
        out["versions_applied"] = info["versions_applied"]
        out["failed_applies"] = info["failed_applies"]
        out["apply_seconds"] = _scrape_applies(service)
    finally:
        service.stop()
    return out


def _scrape_applies(service: Service) -> dict:
    """The mean and the largest bucket bound of the service's version applies (/metrics)."""
    conn = http.client.HTTPConnection(service.host, service.port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    found = dict(re.findall(r"^(prefixrec_serve_delta_apply_seconds_(?:sum|count)) (\S+)$",
                            text, re.M))
    count = float(found.get("prefixrec_serve_delta_apply_seconds_count", 0))
    return {"count": count, "mean": float(found.get(
        "prefixrec_serve_delta_apply_seconds_sum", 0)) / count if count else None}


def _print_versions(v: dict, candidates: int) -> None:
    print(f"    with batching, phases without and with a version ({v['version_samples']:,} "
          f"samples) published every {v['every_s']} s: {v['versions_applied']} applied, "
          f"{v['failed_applies']} refused, apply mean "
          + (f"{v['apply_seconds']['mean'] * 1e3:.0f} ms" if v["apply_seconds"]["mean"]
             else "-"))
    for users, r in v["runs"].items():
        none, upd = r["none"], r["updates"]
        print(f"      {users:>3} clients: without {none['candidates_per_sec']:,.0f} candidates/s "
              f"p50 {none['p50_ms']:.1f} p99 {none['p99_ms']:.1f} ms; with "
              f"{upd['candidates_per_sec']:,.0f} p50 {upd['p50_ms']:.1f} p99 "
              f"{upd['p99_ms']:.1f} ms: p99 ratio {r['p99_ratio']:.2f} (target <= 1.5); "
              f"non-200 {none['non_200'] + upd['non_200']}")


def _scrape_batches(service: Service) -> dict:
    """Requests per model call over the whole service run, from its /metrics."""
    conn = http.client.HTTPConnection(service.host, service.port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    found = dict(re.findall(r"^(prefixrec_serve_batch_requests_(?:sum|count)) (\S+)$", text,
                            re.M))
    calls = float(found.get("prefixrec_serve_batch_requests_count", 0))
    return {"model_calls": calls, "requests_per_call": float(
        found.get("prefixrec_serve_batch_requests_sum", 0)) / calls if calls else None}


def _print_concurrency(c: dict) -> None:
    face = c.get("face", "own")
    print(f"  1 user x {c['candidates']} candidates, locust clients, {c['seconds']} s each"
          + ("" if face == "own" else f", face {face} (flat samples)") + "; in-process "
          + ("LiveModel.predict_tree" if face == "own" else "LiveModel.predict")
          + " one after another: "
          f"{c['in_process_candidates_per_sec']:,.0f} candidates/s")
    if "versions" in c:
        _print_versions(c["versions"], c["candidates"])
    for mode, m in c["modes"].items():
        per_call = m["requests_per_call"]
        print(f"    {mode} ({' '.join(m['flags']) or 'defaults'}; "
              + (f"{per_call:.1f} requests a model call" if per_call else "per-request calls")
              + ")")
        for users, r in m["runs"].items():
            print(f"      {users:>3} clients: {r['candidates_per_sec']:,.0f} candidates/s "
                  f"({r['vs_in_process']:.2f}x in-process, target >= 0.8 at 32), p50 "
                  f"{r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms "
                  f"({r['p99_vs_1_client_p50']:.1f}x the 1-client p50, target <= 4), "
                  f"non-200 {r['non_200']}")


# -- data and model ---------------------------------------------------------------------------

def _samples(schema, n: int, seed: int) -> list[dict]:
    """Raw samples as the service takes them (the schema's JSON format, labels left out)."""
    import pyarrow as pa

    from pipelines.generate import generate_tables
    from pipelines.replay import json_lines

    table = pa.concat_tables(generate_tables(schema, n, seed=seed))
    rows = [json.loads(line) for line in json_lines(table, schema).to_pylist()]
    for row in rows:
        for label in schema.labels:
            row.pop(label, None)
    return rows


def _trained(schema, samples: int, seed: int):
    import pyarrow as pa

    import compression
    from pipelines.generate import generate_tables
    from trainer import models
    from trainer.config import TrainConfig
    from trainer.trainer import Trainer

    trainer = Trainer(schema, models.MLP(), TrainConfig.load(CONFIG))
    trainer.fit(compression.build_trees(pa.concat_tables(
        generate_tables(schema, samples, seed=seed)), schema), epochs=1, progress=False)
    return trainer


def _publish_versions(trainer, schema, export: str, count: int, per_version: int, seed: int):
    """``count`` versions, each ``per_version`` new samples trained, published to ``export``."""
    import pyarrow as pa

    import compression
    from pipelines.generate import generate_tables
    from trainer.serving import export_increment

    for k in range(count):
        trees = compression.build_trees(pa.concat_tables(
            generate_tables(schema, per_version, seed=seed + k)), schema)
        for batch in compression.iter_batches(trees, schema, 5000):
            trainer.train_batch(batch)
        export_increment(trainer, export)


def _copy_version(source: str, target: str, version: int) -> None:
    from trainer.serving import version_path

    shutil.copytree(version_path(source, version), version_path(target, version))
    shutil.copy(f"{version_path(source, version)}.json", f"{version_path(target, version)}.json")


# -- 1. freshness -----------------------------------------------------------------------------

def freshness(schema, rate: float, seconds: float, export_every: float, work: str,
              bootstrap: str | None = None) -> dict:
    import pyarrow as pa
    from confluent_kafka import Producer

    from benchmarks.online import create_topic
    from pipelines import local_broker
    from pipelines.generate import generate_tables
    from pipelines.replay import json_lines, message_keys

    n = int(rate * seconds)
    table = pa.concat_tables(generate_tables(schema, n, seed=11))
    messages = list(zip(message_keys(table, schema).to_pylist(),
                        json_lines(table, schema).to_pylist()))
    export = os.path.join(work, "fresh-export")
    os.makedirs(export)
    broker = (contextlib.nullcontext((bootstrap, None, None)) if bootstrap
              else local_broker.tansu())
    with broker as (bootstrap, _, _):
        topic = create_topic(bootstrap, 1)
        trainer = subprocess.Popen(
            [sys.executable, "-m", "trainer.online", "--schema", SCHEMA, "--config", CONFIG,
             "--bootstrap-servers", bootstrap, "--topic", topic, "--group", "bench-serving",
             "--run-dir", os.path.join(work, "fresh-run"), "--export-dir", export,
             "--export-every", str(export_every), "--checkpoint-every", "600",
             "--unit-samples", str(max(1000, int(rate * export_every / 4))),
             "--report-every", "600"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # a first export (the trainer's first unit) for the service to start from
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        warm = int(rate)  # one second's worth before the clock starts
        for key, value in messages[:warm]:
            producer.produce(topic, value=value, key=key)
        producer.flush(30)
        deadline = time.monotonic() + 180
        while not os.path.exists(os.path.join(export, "export.json")):
            if trainer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("trainer.online exported nothing:\n"
                                   + trainer.stderr.read()[-3000:])
            time.sleep(0.1)
        service = Service(export, "--poll-interval", "0.05")
        answers, stop = [], threading.Event()
        probe = json.dumps({"samples": _samples(schema, 1, 99)}).encode()

        def ask():
            conn = http.client.HTTPConnection(service.host, service.port, timeout=60)
            while not stop.is_set():
                try:
                    model = post(conn, probe)["model"]
                except RuntimeError as e:
                    raise RuntimeError(f"{e}; the service said:\n" + "".join(service.lines))
                answers.append((time.time(), model["newest_sample_time"]))
                stop.wait(0.02)

        asker = threading.Thread(target=ask)
        asker.start()
        arrivals = np.empty(n - warm)
        started = time.monotonic()
        for i, (key, value) in enumerate(messages[warm:]):
            producer.produce(topic, value=value, key=key)
            arrivals[i] = time.time()
            if i % 200 == 0:
                producer.poll(0)
                ahead = i / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        producer.flush(30)
        sent_for = time.monotonic() - started
        # the last sample answered for, or the trainer gone
        deadline = time.monotonic() + 60
        while (not answers or (answers[-1][1] or 0) < arrivals[-1] - 0.05) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        asker.join()
        info = service.model()
        trainer.send_signal(signal.SIGTERM)  # stops cleanly: checkpoint, commit, exit 0
        trainer.wait(120)
        service.stop()
    times = np.array([t for t, _ in answers])
    newest = np.maximum.accumulate(np.array([v or 0.0 for _, v in answers]))
    # Kafka stamps the message at produce(): its timestamp is within ms of our clock reading;
    # the newest sample a version holds is compared with a small allowance for that
    first = np.searchsorted(newest, arrivals - 0.005)
    covered = first < len(times)
    delay = times[first[covered]] - arrivals[covered]
    steady = delay[int(len(delay) * 0.1):]  # after the first tenth (the trainer warming up)
    return {"rate": rate, "seconds": seconds, "sent_rate": (n - warm) / sent_for,
            "samples": int(covered.sum()), "export_every": export_every,
            "p50_s": float(np.percentile(steady, 50)), "p99_s": float(np.percentile(steady, 99)),
            "max_s": float(steady.max()), "versions": info["versions_applied"]}


# -- 2-4 --------------------------------------------------------------------------------------

def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reload_child(served: str, replacement: str, mode: str) -> None:
    """In a fresh process: serve ``served``, then replace it by ``replacement`` and take it
    in (``mode`` "full": as if it were another model, loaded whole); prints RSS figures."""
    from trainer import runs

    runs.load_tensorflow()
    from trainer.live import LiveModel

    if mode == "full":
        LiveModel._rebase = lambda self, current: None  # measure the whole-load path
    before = _status_kb("VmRSS")
    live = LiveModel(served)
    assert live.ready, live.problem
    loaded = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak RSS (VmHWM) from here
    old = served + ".old"
    os.rename(served, old)
    os.rename(replacement, served)
    started = time.perf_counter()
    live.poll()
    seconds = time.perf_counter() - started
    assert live.ready and live.reloads == 1, live.problem
    print(json.dumps({"model_kb": loaded - before, "rss_kb": loaded,
                      "peak_kb": _status_kb("VmHWM"), "seconds": seconds,
                      "reload": live.last_reload}))


def reload_memory(trainer, work: str, rows: int) -> dict:
    """Section 5 of the module docstring."""
    import native
    from trainer.serving import export

    base = os.path.join(work, "reload-base")
    export(trainer, base, step=trainer.step, stores=trainer.stores)
    with open(os.path.join(base, "export.json")) as f:
        meta = json.load(f)
    table = max(meta["tables"], key=lambda t: len(trainer.stores[t]))
    path = os.path.join(base, "stores", table)
    store = native.EmbeddingStore.load(path)
    rng = np.random.default_rng(9)
    ids = np.unique(rng.integers(1 << 40, 1 << 41, rows))
    for start in range(0, len(ids), 200_000):
        chunk = ids[start:start + 200_000]
        store.lookup(chunk, train=True)
        store.lookup(chunk, train=True)  # past any entry filter
        store.apply_gradients(chunk, rng.normal(size=(len(chunk), store.dim)).astype(
            np.float32), 1)
    store.save(path)

    def variant(name: str, fraction: float, other_model: bool = False) -> str:
        target = os.path.join(work, name)
        shutil.copytree(base, target)
        changed = native.EmbeddingStore.load(os.path.join(target, "stores", table))
        pick = ids[rng.random(len(ids)) < fraction]
        for start in range(0, len(pick), 200_000):
            chunk = pick[start:start + 200_000]
            changed.apply_gradients(chunk, rng.normal(size=(len(chunk), changed.dim)).astype(
                np.float32), 2)
        changed.save(os.path.join(target, "stores", table))
        with open(os.path.join(target, "export.json"), "w") as f:
            json.dump({**meta, "lineage": f"bench-{name}", **(
                {"model": {**meta["model"], "note": "another model"}} if other_model else {})},
                f)
        return target

    out = {"table": table, "rows": len(store)}
    for name, fraction, mode in (("rebase-1pct", 0.01, "rebase"), ("rebase-all", 1.0, "rebase"),
                                 ("whole", 0.01, "full")):
        served = os.path.join(work, f"served-{name}")
        shutil.copytree(base, served)
        replacement = variant(name, fraction)
        child = subprocess.run([sys.executable, "-m", "benchmarks.serving", "--reload-child",
                                served, replacement, mode], capture_output=True, text=True,
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
        if child.returncode != 0:
            raise RuntimeError(f"reload child failed: {child.stderr[-2000:]}")
        got = json.loads(child.stdout.strip().splitlines()[-1])
        got["extra_kb"] = got["peak_kb"] - got["rss_kb"]
        got["extra_over_model"] = got["extra_kb"] / got["model_kb"]
        out[name] = got
        shutil.rmtree(served + ".old", ignore_errors=True)
        shutil.rmtree(served, ignore_errors=True)
    return out


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CI size: seconds, not minutes")
    parser.add_argument("--rate", type=float, default=20_000, help="freshness: samples/s")
    parser.add_argument("--fresh-seconds", type=float, default=30, help="freshness duration")
    parser.add_argument("--export-every", type=float, default=1.0,
                        help="the online trainer's --export-every in the freshness phase")
    parser.add_argument("--seconds", type=float, default=5, help="each load phase")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the phases")
    parser.add_argument("--clients", type=int, default=4, help="HTTP clients (2 processes)")
    parser.add_argument("--candidates", type=int, default=500)
    parser.add_argument("--bootstrap-servers", help="use this broker instead of Tansu")
    parser.add_argument("--reload-rows", type=int, default=2_000_000,
                        help="reload memory: rows of the largest table")
    parser.add_argument("--only", choices=["reload"], help="run only this part")
    parser.add_argument("--concurrency",
                        help="run only the load-generator part: locust clients at these "
                             "concurrencies (e.g. 1,8,32), the service with and without "
                             "batching, against the in-process LiveModel")
    parser.add_argument("--load-candidates", type=int, default=100,
                        help="--concurrency: candidates per ranking request (default 100)")
    parser.add_argument("--face", choices=sorted(FACE_PATHS), default="own",
                        help="--concurrency: the protocol the clients speak (default own: "
                             "/v1/predict ranking requests; samples: /v1/predict flat samples; "
                             "tfserving-rest, oip: flat samples to that face)")
    parser.add_argument("--versions-every", type=float,
                        help="--concurrency: the service with batching only, each concurrency "
                             "in phases without and with a new version published every this "
                             "many seconds (alternating, --rounds of each): p99 of both")
    parser.add_argument("--version-samples", type=int, default=20_000,
                        help="--versions-every: samples trained into each version")
    parser.add_argument("--ranking-vs-flat", action="store_true",
                        help="run only the ranking-vs-flat part: 1 user x --candidates "
                             "candidates as one ranking request against the same samples flat, "
                             "over HTTP for --seconds")
    parser.add_argument("--reload-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reload_child:
        _reload_child(*args.reload_child)
        return {}
    if args.tiny:
        args.rate, args.fresh_seconds, args.seconds, args.rounds = 2000, 2, 0.5, 1
        args.candidates, args.reload_rows, args.version_samples = 50, 20_000, 1_000

    import schemas
    from benchmarks.compression import machine
    from trainer import runs

    runs.load_tensorflow()
    from trainer.serving import Predictor, export_increment

    schema = schemas.load(SCHEMA)
    work = tempfile.mkdtemp(prefix="bench-serving-")
    result = {"benchmark": "serving", "machine": machine(), "clients": args.clients}
    try:
        if args.concurrency:
            result["concurrency"] = concurrency(args, schema, work)
            _print_concurrency(result["concurrency"])
            print(json.dumps(result))
            return result
        if args.ranking_vs_flat:
            result["ranking_vs_flat"] = ranking_mode(args, schema, work)
            _print_ranking_vs_flat(result["ranking_vs_flat"])
            print(json.dumps(result))
            return result
        if args.only == "reload":
            result["reload"] = reload_memory(_trained(schema, 5_000, seed=1), work,
                                             args.reload_rows)
            _print_reload(result["reload"])
            print(json.dumps(result))
            return result
        fresh = freshness(schema, args.rate, args.fresh_seconds, args.export_every, work,
                          args.bootstrap_servers)
        result["freshness"] = fresh

        trainer = _trained(schema, 5_000 if args.tiny else 100_000, seed=1)
        source, served = os.path.join(work, "source"), os.path.join(work, "served")
        export_increment(trainer, source)
        shutil.copytree(source, served)
        per_phase = int(np.ceil(args.seconds))  # a version a second
        sizes = (1, 100)
        count = len(sizes) * args.rounds * per_phase
        _publish_versions(trainer, schema, source, count,
                          1_000 if args.tiny else 20_000, seed=100)
        pool = _samples(schema, 1000, seed=5)
        service = Service(served, "--poll-interval", "0.1")
        published = 0
        try:
            latency = {}
            for size in sizes:
                body = json.dumps({"samples": pool[:size]}).encode()
                load(service, body, min(args.seconds, 1.0), 1, 1)  # warm
                phases = {"none": [], "updates": []}
                for _ in range(args.rounds):
                    phases["none"].append(load(service, body, args.seconds, 2,
                                               args.clients // 2))
                    stop = threading.Event()

                    def publish():
                        nonlocal published
                        while not stop.is_set() and published < count:
                            published += 1
                            _copy_version(source, served, published)
                            stop.wait(1.0)

                    publisher = threading.Thread(target=publish)
                    publisher.start()
                    phases["updates"].append(load(service, body, args.seconds, 2,
                                                  args.clients // 2))
                    stop.set()
                    publisher.join()
                latency[size] = {k: {"requests_per_sec": float(np.mean(
                    [p["requests_per_sec"] for p in v])), "p50_ms": float(np.median(
                        [p["p50_ms"] for p in v])), "p99_ms": float(np.max(
                            [p["p99_ms"] for p in v]))} for k, v in phases.items()}
                latency[size]["p99_ratio"] = (latency[size]["updates"]["p99_ms"]
                                              / latency[size]["none"]["p99_ms"])
            info = service.wait_for(lambda i: i["model"]["version"] == published)
            result["latency"] = {str(k): v for k, v in latency.items()}
            result["versions_applied"] = info["versions_applied"]
            result["failed_applies"] = info["failed_applies"]

            # 3. throughput against the in-process Predictor (one thread, 100 a call)
            predictor = Predictor(source)
            predictor.update()
            import pyarrow as pa

            batches = [pool[i:i + 100] for i in range(0, len(pool), 100)]
            tables = [pa.Table.from_pylist(b) for b in batches]
            predictor.predict(tables[0])
            started, done = time.perf_counter(), 0
            while time.perf_counter() - started < args.seconds:
                for table in tables:
                    predictor.predict(table)
                    done += table.num_rows
            in_process = done / (time.perf_counter() - started)
            served_rate = latency[100]["none"]["requests_per_sec"] * 100
            result["throughput"] = {"service_samples_per_sec": served_rate,
                                    "predictor_samples_per_sec": in_process,
                                    "ratio": served_rate / in_process}

            # 4. one user x N candidates: a ranking request against the same samples flat
            structured = ranking_vs_flat(service, schema, args.candidates,
                                         1.0 if args.tiny else args.seconds * 2)
            result["structured"] = structured
        finally:
            service.stop()
        result["reload"] = reload_memory(trainer, work, args.reload_rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    f = result["freshness"]
    print(f"prediction service, taobao_like, paper's MLP, {os.cpu_count()} cpus")
    print(f"  freshness (arrival in Kafka -> an answer on a version holding it), "
          f"{f['sent_rate']:,.0f} samples/s, exports every {f['export_every']} s: "
          f"p50 {f['p50_s']:.2f} s, p99 {f['p99_s']:.2f} s (target <= 3 s)")
    for size, phases in result["latency"].items():
        none, upd = phases["none"], phases["updates"]
        print(f"  {size:>3} samples/request, {args.clients} clients: no updates "
              f"{none['requests_per_sec']:,.0f} req/s p50 {none['p50_ms']:.1f} ms p99 "
              f"{none['p99_ms']:.1f} ms; a version a second {upd['requests_per_sec']:,.0f} "
              f"req/s p50 {upd['p50_ms']:.1f} ms p99 {upd['p99_ms']:.1f} ms: p99 ratio "
              f"{phases['p99_ratio']:.2f} (target <= 1.5)")
    t = result["throughput"]
    print(f"  throughput at 100 samples/request {t['service_samples_per_sec']:,.0f} samples/s "
          f"vs in-process Predictor {t['predictor_samples_per_sec']:,.0f}: {t['ratio']:.2f}")
    _print_ranking_vs_flat(result["structured"])
    _print_reload(result["reload"])
    print(json.dumps(result))
    return result


def _print_reload(r: dict) -> None:
    print(f"  reload memory, table {r['table']} of {r['rows']:,} rows (served model "
          f"{r['rebase-1pct']['model_kb'] / 1024:,.0f} MiB):")
    for name, what in (("rebase-1pct", "same model, 1% of rows changed (rebase)"),
                       ("rebase-all", "same model, every row changed (rebase)"),
                       ("whole", "another model (loaded whole)")):
        x = r[name]
        print(f"    {what}: peak +{x['extra_kb'] / 1024:,.0f} MiB = "
              f"{x['extra_over_model']:.2f}x the model, {x['seconds']:.2f} s")


if __name__ == "__main__":
    run()
