"""``python -m benchmarks.fuzz``: coverage-guided fuzzing of every parser of outside bytes.

Each target (benchmarks/fuzz/targets.py) runs under atheris + libFuzzer in its own process
(benchmarks/fuzz/worker.py), on a working corpus seeded from the kept corpus
(tests/fuzz_corpus/<target>/), with a per-input timeout and an rss limit; the time budget is
split over the targets, at most --jobs at once. A worker stopped by a finding is restarted on
the rest of its time. Prints a table: executions, exec/s, coverage, corpus, findings.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

from compression import cli

PROG = "python -m benchmarks.fuzz"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET_NAMES = ("json_decoder", "request_envelope", "csv_file", "parquet_file", "jsonl_file",
                "tree_parquet", "tree_ipc", "store_snapshot", "store_delta", "store_rebase",
                "quantized_snapshot", "quantized_delta", "checkpoint", "schema_yaml",
                "config_yaml", "serve_request")
NATIVE_TARGETS = ("json_decoder", "request_envelope", "store_snapshot", "store_delta",
                  "store_rebase", "quantized_snapshot", "quantized_delta")
ASAN_DIR = os.path.join("build", "fuzz-asan")
ASAN_SHARE = 0.3  # of a native target's time, run under ASan + UBSan
ARTIFACT_KINDS = ("crash", "timeout", "oom", "leak", "slow-unit")
STATUS = re.compile(r"^#(\d+)\s+(\w+)\s+(.*)$")


@dataclass
class TargetRun:
    name: str
    budget: float
    asan: bool
    executions: int = 0
    seconds: float = 0.0
    cov: int = 0
    ft: int = 0
    corpus: int = 0
    runs: int = 0
    findings: list[str] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    existing: set = field(default_factory=set)
    signatures: list[str] = field(default_factory=list)

    def row(self) -> dict:
        return {"target": self.name, "asan": self.asan, "executions": self.executions,
                "seconds": round(self.seconds, 1),
                "exec_per_sec": round(self.executions / self.seconds) if self.seconds else 0,
                "cov": self.cov, "ft": self.ft, "corpus": self.corpus, "runs": self.runs,
                "findings": self.findings, "signatures": self.signatures}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=cli._wrap(
            "Fuzz every parser of outside bytes with atheris (libFuzzer): raw CSV, "
                    "Parquet and JSON lines files, tree Parquet files and Arrow IPC tree "
                    "messages, Kafka JSON sample messages (the native decoder), prediction "
                    "request bodies (the native envelope scanner), store "
                    "snapshots and deltas, quantized export snapshots and deltas, trainer "
                    "checkpoints, schema and config YAML, and "
                    "HTTP requests to the prediction service. "
                    "A finding is any outcome but a result or a clean refusal (a ValueError "
                    "naming the file): another exception, a crash, a sanitizer report, a "
                    "timeout, too much memory, or an accepted input that contradicts itself."),
        epilog=cli.epilog(
            f"{PROG} --seconds 60",
            f"{PROG} --seconds 600 --jobs 2",
            f"{PROG} --seconds 30 --target json_decoder --target store_delta",
            f"{PROG} --make-seeds",
            notes="The native targets (json_decoder, request_envelope, store_snapshot, "
                  "store_delta, store_rebase) are fuzzed "
                  "with coverage on the in-place build for 70% of their time, then libFuzzer "
                  "runs on the grown corpus under AddressSanitizer + UndefinedBehaviorSanitizer "
                  "for the rest: every corpus input is replayed sanitized, then mutated without "
                  "coverage guidance (gcc's libasan, preloaded with libubsan, takes atheris' "
                  f"coverage hooks). The sanitized build goes to {ASAN_DIR}, made the way "
                  "`make test-asan` makes its copy when missing or older than the C++ sources "
                  "(about 90 s); --no-asan skips that part. Working corpora, artifacts and "
                  "logs go to --work-dir/<target>/; a finding already reported (its exception "
                  "and place, in artifacts/signatures.txt) does not stop a later run. Copy a "
                  "finding's input to tests/fuzz_corpus/<target>/finding-<what> once it is "
                  "fixed, so `make test` replays it."))
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="total wall-clock budget, split over the targets (default 60)")
    parser.add_argument("--target", action="append", choices=TARGET_NAMES, metavar="NAME",
                        help=f"fuzz only this target (repeatable): {', '.join(TARGET_NAMES)}")
    parser.add_argument("--jobs", type=int, default=2, help="targets fuzzed at once (default 2)")
    parser.add_argument("--no-asan", dest="asan", action="store_false",
                        help="fuzz the native targets on the in-place build only, without the "
                             "sanitized part")
    parser.add_argument("--timeout", type=int, default=10,
                        help="seconds one input may take before it is a finding (default 10)")
    parser.add_argument("--rss-limit-mb", type=int, default=2560,
                        help="memory limit of a worker; past it the input is a finding "
                             "(default 2560; the checkpoint target holds TensorFlow)")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="restarts of a target after findings, while time is left (default 5)")
    parser.add_argument("--corpus", default=os.path.join(ROOT, "tests", "fuzz_corpus"),
                        help="the kept corpus, one directory per target "
                             "(default tests/fuzz_corpus)")
    parser.add_argument("--work-dir", default=os.path.join(ROOT, "build", "fuzz"),
                        help="working corpora, artifacts and logs (default build/fuzz)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line")
    parser.add_argument("--make-seeds", action="store_true",
                        help="(re)write the seed-* files of the kept corpus and exit")
    cli.add_debug_flag(parser)
    return parser


def _main(argv) -> int:
    args = _parser().parse_args(argv)
    if args.make_seeds:
        from benchmarks.fuzz import seeds

        counts = seeds.write_seeds(args.corpus, only=args.target)
        print(json.dumps({"seeds": counts, "corpus": args.corpus}))
        return 0
    if args.seconds <= 0 or args.jobs < 1:
        raise cli.UsageError("--seconds and --jobs must be positive")
    try:
        import atheris  # noqa: F401
    except ImportError:
        raise cli.UsageError("atheris is not installed; run `make fuzz` (or pip install -r "
                             "requirements-fuzz.txt)") from None
    names = list(dict.fromkeys(args.target or TARGET_NAMES))
    asan_site = None
    if args.asan and any(n in NATIVE_TARGETS for n in names):
        asan_site = ensure_asan_build()
    budget = args.seconds * min(args.jobs, len(names)) / len(names)
    runs = []
    for n in names:
        if asan_site is not None and n in NATIVE_TARGETS:
            # gcc's libasan brings its own __sanitizer_cov_* symbols, which take atheris'
            # coverage away: fuzz with coverage on the plain build first, then run libFuzzer
            # on the grown corpus under the sanitizers (every corpus input is replayed there
            # first, then mutated without coverage guidance)
            runs += [TargetRun(n, budget * (1 - ASAN_SHARE), False),
                     TargetRun(n, budget * ASAN_SHARE, True)]
        else:
            runs.append(TargetRun(n, budget, False))
    started = time.monotonic()
    schedule(runs, args, asan_site)
    wall = time.monotonic() - started
    if args.json:
        print(json.dumps({"wall_seconds": round(wall, 1), "targets": [r.row() for r in runs]}))
    else:
        print(report(runs, wall))
    return 0


def schedule(runs: list[TargetRun], args, asan_site: str | None) -> None:
    """Run every target's worker, at most ``args.jobs`` at once, each for its budget
    (restarted after a finding while its budget lasts)."""
    waiting = list(runs)
    active: dict[int, tuple[TargetRun, subprocess.Popen, float, float, object]] = {}
    while waiting or active:
        busy = {r.name for r, *_ in active.values()}
        while len(active) < args.jobs:
            ready = [r for r in waiting if r.name not in busy]  # one run per corpus at a time
            if not ready:
                break
            run = ready[0]
            waiting.remove(run)
            busy.add(run.name)
            start = time.monotonic()
            proc, log = start_worker(run, run.budget - run.seconds, args, asan_site)
            active[proc.pid] = (run, proc, start, run.budget - run.seconds, log)
        time.sleep(0.2)
        for pid, (run, proc, start, budget, log) in list(active.items()):
            elapsed = time.monotonic() - start
            if proc.poll() is None and elapsed > budget + 120:  # libFuzzer did not stop: stop it
                proc.kill()
            if proc.poll() is None:
                continue
            log.close()
            del active[pid]
            found = collect(run, elapsed)
            left = run.budget - run.seconds
            if found and left > 5 and run.runs <= args.max_restarts:
                waiting.append(run)


def start_worker(run: TargetRun, seconds: float, args, asan_site: str | None):
    base = os.path.join(args.work_dir, run.name)
    corpus = os.path.join(base, "corpus")
    artifacts = os.path.join(base, "artifacts")
    os.makedirs(corpus, exist_ok=True)
    os.makedirs(artifacts, exist_ok=True)
    kept = os.path.join(args.corpus, run.name)
    if os.path.isdir(kept):
        for name in os.listdir(kept):
            if not os.path.exists(os.path.join(corpus, name)):
                shutil.copy(os.path.join(kept, name), os.path.join(corpus, name))
    from benchmarks.fuzz.targets import TARGETS

    flags = [f"-max_total_time={max(1, int(seconds))}", f"-timeout={args.timeout}",
             f"-rss_limit_mb={args.rss_limit_mb}", f"-max_len={TARGETS[run.name].max_len}",
             f"-artifact_prefix={artifacts}{os.sep}", "-print_final_stats=1", corpus]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    cwd = ROOT
    if run.asan:
        env.update(LD_PRELOAD=" ".join(sanitizer_libraries()), PREFIXREC_SANITIZED="1",
                   ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:"
                                "quarantine_size_mb=16",
                   UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p))
        cwd = asan_site  # `python -m` puts the working directory first: its native/ wins
    run.runs += 1
    log_path = os.path.join(base, f"log-{'asan-' if run.asan else ''}{run.runs}.txt")
    run.existing = set(_artifacts(base))
    run.logs.append(log_path)
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.fuzz.worker", run.name, *flags],
                            cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, log


def collect(run: TargetRun, elapsed: float) -> bool:
    """Add a finished worker's numbers to ``run``; True if it stopped on a finding."""
    with open(run.logs[-1], errors="replace") as f:
        text = f.read()
    executions = 0
    for line in text.splitlines():
        match = STATUS.match(line)
        if match:
            executions = max(executions, int(match.group(1)))
            stats = dict(re.findall(r"(\w+): (\d+)", match.group(3)))
            run.cov = max(run.cov, int(stats.get("cov", 0)))
            run.ft = max(run.ft, int(stats.get("ft", 0)))
    stat = re.search(r"stat::number_of_executed_units: (\d+)", text)
    if stat:
        executions = max(executions, int(stat.group(1)))
    run.executions += executions
    run.seconds += elapsed
    base = os.path.dirname(run.logs[-1])
    run.corpus = len(os.listdir(os.path.join(base, "corpus")))
    new = [p for p in _artifacts(base) if p not in run.existing]
    run.findings += new
    run.signatures += re.findall(r"^fuzz worker: new finding (.*)$", text, re.M)
    if new and not re.search(r"^fuzz worker: new finding", text, re.M):
        kind = "timeout" if "-timeout" in text and "ALARM" in text else (
            "out of memory" if "out-of-memory" in text else
            "sanitizer report" if "Sanitizer" in text else "crash")
        run.signatures.append(f"{kind} (see {run.logs[-1]})")
    # a worker that reported a new finding stopped on it, even when its input's file was
    # there already (a finding seen before under another signature) or the worker died on
    # the way out before libFuzzer wrote its report (a process holding TensorFlow takes
    # seconds to end; SIGALRM was seen to kill it meanwhile, exit status 142)
    return bool(new) or "Test unit written to" in text or bool(
        re.search(r"^fuzz worker: new finding", text, re.M))


def _artifacts(base: str) -> list[str]:
    return sorted(p for kind in ARTIFACT_KINDS
                  for p in glob.glob(os.path.join(base, "artifacts", f"{kind}-*")))


def report(runs: list[TargetRun], wall: float) -> str:
    lines = [f"{'target':<15} {'asan':>4} {'execs':>9} {'exec/s':>7} {'cov':>6} {'ft':>6} "
             f"{'corpus':>6} {'runs':>4} findings"]
    for r in runs:
        row = r.row()
        lines.append(f"{r.name:<15} {'yes' if r.asan else 'no':>4} {r.executions:>9} "
                     f"{row['exec_per_sec']:>7} {r.cov:>6} {r.ft:>6} {r.corpus:>6} {r.runs:>4} "
                     f"{len(r.findings)}")
    lines.append(f"wall time {wall:.0f} s")
    for r in runs:
        for path in r.findings:
            lines.append(f"finding {r.name}: {path}")
        for sig in r.signatures:
            lines.append(f"  {r.name}: {sig}")
    return "\n".join(lines)


# -- the sanitized build -----------------------------------------------------------------------

def sanitizer_libraries() -> list[str]:
    return [subprocess.run(["gcc", f"-print-file-name={lib}"], capture_output=True, text=True,
                           check=True).stdout.strip() for lib in ("libasan.so", "libubsan.so")]


def ensure_asan_build() -> str:
    """The site directory of an ASan + UBSan build of native/ (``PREFIXREC_SANITIZE=1``, as
    ``make test-asan`` builds it), rebuilt when a native source is newer than it."""
    asan = os.path.join(ROOT, ASAN_DIR)
    site = os.path.join(asan, "site")
    built = glob.glob(os.path.join(site, "native", "_store*.so"))
    sources = [p for pattern in ("native/src/**/*.cc", "native/src/**/*.h", "native/include/**/*.h",
                                 "native_build.py")
               for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)]
    newest = max(os.path.getmtime(p) for p in sources)
    if built and os.path.getmtime(built[0]) >= newest:
        for path in glob.glob(os.path.join(ROOT, "native", "*.py")):  # the facade: no rebuild
            shutil.copy(path, os.path.join(site, "native"))
        return site
    print(f"{PROG}: building the sanitized native module into {ASAN_DIR} (about 90 s)...",
          file=sys.stderr, flush=True)
    shutil.rmtree(asan, ignore_errors=True)
    src = os.path.join(asan, "src")
    os.makedirs(os.path.join(src, "native"))
    for name in ("setup.py", "pyproject.toml", "native_build.py", "MANIFEST.in",
                 "requirements.txt", "requirements-test.txt"):
        shutil.copy(os.path.join(ROOT, name), src)
    for name in ("include", "src"):
        shutil.copytree(os.path.join(ROOT, "native", name), os.path.join(src, "native", name))
    for path in glob.glob(os.path.join(ROOT, "native", "*.py")) + \
            glob.glob(os.path.join(ROOT, "native", "*.pyi")):
        shutil.copy(path, os.path.join(src, "native"))
    wheel = os.path.join(asan, "wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check",
                    "--no-deps", "-w", wheel, src], check=True,
                   env=dict(os.environ, PREFIXREC_SANITIZE="1"))
    import zipfile

    with zipfile.ZipFile(glob.glob(os.path.join(wheel, "prefixrec-*.whl"))[0]) as whl:
        whl.extractall(site)
    return site


def main(argv=None) -> int:
    return cli.run_command(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
