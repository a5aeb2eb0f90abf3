"""Dynamic batching of the prediction service: requests that arrive together, one model call.

    batcher = Batcher(live.predict_decoded, max_samples=4096, max_delay=0.002)
    future = batcher.submit(decoded, len(decoded))   # a decoded request, from any face
    kind, probabilities, info = await asyncio.wrap_future(future)

One model call runs at a time, never on the event loop. A request that finds no call running
and nothing queued is scored at once in the worker thread that decoded it
(:meth:`Batcher.score_or_submit`); else it queues, and the scoring thread takes the queued
requests in their order, as many as fit in ``max_samples`` samples (a larger request alone),
and scores them in one call of ``score`` (which pins one version for all of them:
:meth:`trainer.live.LiveModel.predict_decoded`). A request waits for
nobody when nothing else is on its way: the thread takes what queued while the previous call
ran, and waits up to ``max_delay`` for more only while other requests are being decoded
(:meth:`Batcher.arriving`), never on a timer when the queue holds the only request there is.

Requests are decoded (and refused, each with its own answer) before they are queued, so a bad
request never reaches a batch. :meth:`compression.TreeBatch.concat` joins their trees into one
batch: the roots of ranking requests and the nodes of flat samples side by side in every layer,
each request's user part still one node computed once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time


class _Queued:
    __slots__ = ("item", "size", "future", "queued")

    def __init__(self, item, size: int):
        self.item, self.size = item, size
        self.future = concurrent.futures.Future()
        self.queued = time.perf_counter()


class Batcher:
    """The scoring thread and its queue. ``score(items) -> list`` answers a batch: per item
    its result, or an exception raised to that item's waiter only. ``observe(samples,
    requests, delays)``, if given, sees every call: its samples, its requests and each one's
    seconds in the queue."""

    def __init__(self, score, max_samples: int, max_delay: float, observe=None):
        self.score, self.max_samples, self.max_delay = score, max_samples, max_delay
        self.observe = observe
        self._queue: collections.deque[_Queued] = collections.deque()
        self._cond = threading.Condition()
        self._decoding = 0  # requests on their way to the queue
        self._closed = False
        self._busy = False  # a model call is running (in the scoring thread or a caller's)
        self._thread = None

    @property
    def queued(self) -> int:
        """Requests waiting for a model call."""
        return len(self._queue)

    def arriving(self) -> None:
        """A request is being decoded: the thread may wait (up to ``max_delay``) for it."""
        with self._cond:
            self._decoding += 1

    def gone(self) -> None:
        """A request counted by :meth:`arriving` will not be queued (refused)."""
        with self._cond:
            self._decoding -= 1
            self._cond.notify_all()

    def submit(self, item, size: int, arrived: bool = False) -> concurrent.futures.Future:
        """Queue a decoded request of ``size`` samples (``arrived``: it was counted by
        :meth:`arriving`); its future gets what ``score`` answers for it."""
        with self._cond:
            return self._queue_locked(item, size, arrived)

    def _queue_locked(self, item, size: int, arrived: bool) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("the batcher is closed")
        if arrived:
            self._decoding -= 1
        queued = _Queued(item, size)
        self._queue.append(queued)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="scoring", daemon=True)
            self._thread.start()
        self._cond.notify_all()
        return queued.future

    def score_or_submit(self, item, size: int, arrived: bool = False
                        ) -> concurrent.futures.Future:
        """As :meth:`submit`, but when no model call is running and nothing is queued the
        request is scored at once in the calling thread (a worker thread, never the event
        loop): a lone request pays no hand-over to the scoring thread. The future returned
        is then done. Still one model call at a time."""
        with self._cond:
            idle = not self._busy and not self._queue and not self._closed
            if not idle:
                return self._queue_locked(item, size, arrived)
            if arrived:
                self._decoding -= 1
            self._busy = True
        queued = _Queued(item, size)
        try:
            self._call([queued])
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        return queued.future

    def close(self) -> None:
        """Answer what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _take(self) -> list[_Queued] | None:
        with self._cond:
            while not self._queue or self._busy:  # one model call at a time
                if self._closed and not self._queue:
                    return None
                self._cond.wait()
            batch = [self._queue.popleft()]
            self._busy = True  # from here: no caller scores beside this call
            size = batch[0].size
            deadline = batch[0].queued + self.max_delay
            while True:
                while self._queue and size + self._queue[0].size <= self.max_samples:
                    size += self._queue[0].size
                    batch.append(self._queue.popleft())
                if self._queue or size >= self.max_samples or self._decoding <= 0:
                    break  # full, or nobody else on the way: no wait
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                self._call(batch)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _call(self, batch: list[_Queued]) -> None:
        """One model call for ``batch``; every request's future answered."""
        started = time.perf_counter()
        try:
            results = self.score([q.item for q in batch])
        except BaseException as e:  # noqa: BLE001 - every waiter gets the fault
            results = [e] * len(batch)
        if self.observe is not None:  # before the answers: a client sees its own call
            try:
                self.observe(sum(q.size for q in batch), len(batch),
                             [started - q.queued for q in batch])
            except Exception:  # noqa: BLE001 - metrics never stop the scoring
                pass
        for q, result in zip(batch, results):
            if isinstance(result, BaseException):
                q.future.set_exception(result)
            else:
                q.future.set_result(result)
