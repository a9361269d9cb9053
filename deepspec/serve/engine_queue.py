"""The bounded FIFO queue in front of the one engine behind ``deepspec serve``.

The model is not thread-safe and decodes one request at a time (batch 1,
:class:`deepspec.serve.decoder.EngineDecoder`), so every generation runs on one worker thread, off the
server's event loop, taking the jobs in the order they were queued. At most ``max_queued`` jobs wait
behind the one being run; one more is refused with :class:`QueueFull` (the server answers 503 with
``Retry-After``, as SGLang's ``--max-queued-requests``), so that a burst cannot pile up unbounded work
and clients know when to come back. A job cancelled while it waits (its client went away) is dropped
without running and frees its place at once.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class QueueFull(Exception):
    """The queue holds ``max_queued`` waiting jobs already; ``retry_after_s`` (whole seconds, >= 1) estimates
    when a place frees (the mean run time of recent jobs)."""

    def __init__(self, num_waiting: int, retry_after_s: int) -> None:
        super().__init__(f"{num_waiting} requests are waiting for the engine")
        self.num_waiting = num_waiting
        self.retry_after_s = retry_after_s


class EngineQueue:
    """One worker thread running submitted jobs one at a time, in submission order.

    Args:
        max_queued: the most jobs that may wait behind the running one (an integer >= 1).

    Raises:
        ValueError: ``max_queued`` is not an integer >= 1.
    """

    RECENT = 16  # run times averaged for Retry-After

    def __init__(self, max_queued: int, *, name: str = "deepspec-engine") -> None:
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
            raise ValueError(f"max_queued_requests={max_queued!r}: expected an integer >= 1 (requests that may "
                             "wait for the engine behind the one it decodes)")
        self.max_queued = max_queued
        self._cond = threading.Condition()
        self._waiting: deque[tuple[Callable[[], Any], Future]] = deque()
        self._run_times_s: deque[float] = deque(maxlen=self.RECENT)
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        """Jobs queued and not started (cancelled ones excluded)."""
        with self._cond:
            self._drop_cancelled()
            return len(self._waiting)

    def submit(self, job: Callable[[], Any]) -> Future:
        """Queue ``job`` (called with no arguments on the worker thread); returns its future, whose result
        is the job's return value or exception. Cancelling the future before the job starts drops it.

        Raises:
            QueueFull: ``max_queued`` jobs are waiting already.
            RuntimeError: the queue was closed.
        """
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine queue is closed (the server is stopping)")
            self._drop_cancelled()
            if len(self._waiting) >= self.max_queued:
                recent = self._run_times_s
                raise QueueFull(len(self._waiting), max(1, math.ceil(sum(recent) / len(recent))) if recent else 1)
            future: Future = Future()
            self._waiting.append((job, future))
            self._cond.notify()
        return future

    def close(self) -> None:
        """Refuse new jobs and cancel the waiting ones; a running job finishes on its (daemon) thread."""
        with self._cond:
            self._closed = True
            for _, future in self._waiting:
                future.cancel()
            self._waiting.clear()
            self._cond.notify_all()

    def _drop_cancelled(self) -> None:
        if any(future.cancelled() for _, future in self._waiting):
            self._waiting = deque(item for item in self._waiting if not item[1].cancelled())

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                job, future = self._waiting.popleft()
            if not future.set_running_or_notify_cancel():  # cancelled while it waited
                continue
            started = time.monotonic()
            try:
                result = job()
            except BaseException as exc:  # handed to the waiting request, which answers for it
                future.set_exception(exc)
            else:
                future.set_result(result)
            with self._cond:
                self._run_times_s.append(time.monotonic() - started)
