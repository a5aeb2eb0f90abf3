"""The locust user of ``python -m benchmarks.serving --concurrency``: one keep-alive HTTP client
(geventhttpclient) posting ranking requests back to back, no wait between them, taking the
bodies in turn from the file named by ``PREFIXREC_BENCH_BODIES`` (one JSON body a line), to
the path ``PREFIXREC_BENCH_PATH`` (default ``/v1/predict``; a face's, ``--face``). When
the run stops, every request's latency (ms, as locust measured it, unrounded), the non-200
answers and the run's seconds go to the JSON file named by ``PREFIXREC_BENCH_TIMES``.

Run by the benchmark as ``locust -f benchmarks/serving_locustfile.py --headless ...`` in its own
process; never imported by the project (locust patches the standard library with gevent).
"""

import itertools
import json
import os
import random
import time

from locust import FastHttpUser, constant, events, task

with open(os.environ["PREFIXREC_BENCH_BODIES"], "rb") as f:
    BODIES = [line.rstrip(b"\n") for line in f if line.strip()]
PATH = os.environ.get("PREFIXREC_BENCH_PATH", "/v1/predict")
TIMES = {"ms": [], "non_200": 0, "started": None, "stopped": None}


@events.test_start.add_listener
def _started(**_):
    TIMES["started"] = time.perf_counter()


@events.request.add_listener
def _answered(response_time, exception=None, response=None, **_):
    if exception is not None or response is None or response.status_code != 200:
        TIMES["non_200"] += 1
    TIMES["ms"].append(response_time)


@events.test_stop.add_listener
def _stopped(**_):
    TIMES["stopped"] = time.perf_counter()
    with open(os.environ["PREFIXREC_BENCH_TIMES"], "w") as out:
        json.dump({"ms": TIMES["ms"], "non_200": TIMES["non_200"],
                   "seconds": TIMES["stopped"] - TIMES["started"]}, out)


class RankingClient(FastHttpUser):
    wait_time = constant(0)

    def on_start(self):
        at = random.randrange(len(BODIES))  # the clients do not send the same body at once
        self.bodies = itertools.cycle(BODIES[at:] + BODIES[:at])

    @task
    def rank(self):
        self.client.post(PATH, data=next(self.bodies),
                         headers={"Content-Type": "application/json"}, name="rank")
