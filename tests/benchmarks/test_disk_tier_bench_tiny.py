"""The disk tier engines' benchmark (`make bench-disk-tier`) end to end at a tiny size; the real
sizes are in RESULTS.md ("Disk tier engines")."""

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_disk_tier_benchmark_tiny(tmp_path):
    args = (f"--ids 60000 --memory 6000 --batch 2000 --batches 4 --fsync-batches 2 --rounds 1 "
            f"--row-bytes 148 --dir {tmp_path}")
    out = subprocess.run(["make", "-s", "--no-print-directory", "bench-disk-tier",
                          f"BENCH_DISK_TIER_ARGS={args}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    rows = [line.strip("|").split("|") for line in out.splitlines()
            if line.startswith("| 0 |")]
    runs = {(cells[1].strip(), cells[3].strip()): [float(c) for c in cells[4:]] for cells in rows}
    assert set(runs) == {(engine, fsync) for engine in ("slotfile", "lmdb")
                         for fsync in ("off", "on")}
    for (engine, _), figures in runs.items():
        load, miss_rate, get, put = figures[:4]
        assert load > 0 and get > 0 and put > 0 and 0 < miss_rate < 1
        after_expiry, after_reclaim = figures[6], figures[7]
        if engine == "slotfile":  # half the rows expired leave holes; Reclaim(0) removes all
            # (allocated blocks: the file's last 4 KiB block is whole, ~0.1% of ~4 MB here)
            assert after_expiry > 1.5 and 1.0 <= after_reclaim <= 1.01
