"""A real Dask cluster for tests: a scheduler and worker processes on loopback.

    with local_dask_cluster(workers=2) as cluster:   # started in the caller's environment
        job.run([..., "--runner=apache_beam.runners.dask.dask_runner.DaskRunner",
                 f"--dask_client_address={cluster.scheduler_address}"])

The workers are separate processes (``processes=True``) with one thread each, started with a
copy of this process's environment at that moment: start the cluster inside the environment
its jobs need (e.g. an S3 server's ``AWS_*`` variables).
"""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def local_dask_cluster(workers: int = 2, timeout: float = 60.0) -> Iterator:
    """A ``distributed.LocalCluster`` of ``workers`` worker processes on 127.0.0.1, every
    worker connected before it is handed out; closed at the end."""
    from distributed import Client, LocalCluster

    # The scheduler serves HTTP (health, metrics) even without a dashboard, on port 8787
    # unless told otherwise: a free port instead, so clusters of parallel tests never clash.
    cluster = LocalCluster(n_workers=workers, processes=True, threads_per_worker=1,
                           host="127.0.0.1", dashboard_address="127.0.0.1:0")
    try:
        with Client(cluster) as client:
            client.wait_for_workers(workers, timeout=timeout)
        yield cluster
    finally:
        cluster.close()
