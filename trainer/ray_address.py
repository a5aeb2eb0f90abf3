"""Whether a Ray cluster's address answers, checked without importing Ray or TensorFlow.

``python -m trainer.train --ray-address HOST:PORT`` calls :func:`check_ray_address` before it
imports TensorFlow (about 10 s here), so an address where nothing listens is reported at once;
:class:`trainer.distributed.DistributedTrainer` calls it too (``ray.init`` itself would retry
for a long time). This module imports the standard library only.
"""

from __future__ import annotations

import socket


def check_ray_address(address: str, timeout: float = 10.0) -> None:
    """Raise ConnectionError naming ``address`` when nothing answers there within
    ``timeout`` seconds, ValueError when it is not ``HOST:PORT``, ``ray://HOST:PORT``,
    ``auto`` or ``local``."""
    if address in ("auto", "local"):
        return
    target = address.split("://", 1)[-1]
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"Ray address {address!r}: expected HOST:PORT (the head node's GCS "
                         "port, 6379 by default), ray://HOST:PORT, or auto")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise ConnectionError(f"Ray address {address!r} does not answer ({e}; waited up to "
                              f"{timeout:g} s); start a cluster there with `ray start --head "
                              f"--port {port}` or omit the address for a local cluster") from None
