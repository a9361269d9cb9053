"""The bounded FIFO queue in front of ``deepspec serve``'s engine (:class:`deepspec.serve.engine_queue.EngineQueue`).

Jobs block on an event, so every check is deterministic: one job runs at a time, the waiting ones run in
submission order, one past the bound is refused with :class:`QueueFull` (its ``retry_after_s`` the mean
run time of recent jobs, at least 1 s), a cancelled waiting job never runs and frees its place at once,
and an exception reaches the job's future.
"""

from __future__ import annotations

import threading
import time

import pytest

from deepspec.serve.engine_queue import EngineQueue, QueueFull


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_jobs_run_one_at_a_time_in_submission_order_and_the_bound_holds():
    queue = EngineQueue(3)
    gate = threading.Event()
    ran: list[int] = []
    running = [0]
    most_running = [0]

    def job(i: int):
        def run() -> int:
            running[0] += 1
            most_running[0] = max(most_running[0], running[0])
            if i == 0:
                gate.wait(30)
            ran.append(i)
            running[0] -= 1
            return i * 10
        return run

    futures = [queue.submit(job(0))]
    _wait_for(lambda: futures[0].running())  # the first job runs; three more may wait
    futures += [queue.submit(job(i)) for i in (1, 2, 3)]
    assert queue.num_waiting == 3
    with pytest.raises(QueueFull) as full:
        queue.submit(job(4))
    assert full.value.num_waiting == 3 and full.value.retry_after_s == 1  # no run time measured yet: 1 s
    gate.set()
    assert [f.result(timeout=30) for f in futures] == [0, 10, 20, 30]
    assert ran == [0, 1, 2, 3] and most_running[0] == 1
    queue.close()


def test_a_cancelled_waiting_job_never_runs_and_frees_its_place():
    queue = EngineQueue(1)
    gate = threading.Event()
    ran: list[str] = []
    first = queue.submit(lambda: (gate.wait(30), ran.append("first")))
    _wait_for(first.running)
    waiting = queue.submit(lambda: ran.append("cancelled"))
    with pytest.raises(QueueFull):
        queue.submit(lambda: ran.append("refused"))
    assert waiting.cancel() and queue.num_waiting == 0
    last = queue.submit(lambda: ran.append("last"))  # the cancelled job's place
    gate.set()
    last.result(timeout=30)
    assert ran == ["first", "last"]
    queue.close()


def test_retry_after_is_the_mean_recent_run_time_and_errors_reach_the_future():
    queue = EngineQueue(1)
    slow = queue.submit(lambda: time.sleep(1.2))
    slow.result(timeout=30)
    gate = threading.Event()

    def fail():
        gate.wait(30)
        raise ArithmeticError("boom")

    failing = queue.submit(fail)
    _wait_for(failing.running)
    queue.submit(lambda: None)
    with pytest.raises(QueueFull) as full:
        queue.submit(lambda: None)
    assert full.value.retry_after_s == 2  # ceil(1.2 s)
    gate.set()
    with pytest.raises(ArithmeticError, match="boom"):
        failing.result(timeout=30)
    queue.close()
    with pytest.raises(RuntimeError, match="closed"):
        queue.submit(lambda: None)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_the_bound_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=r"max_queued_requests=.*expected an integer >= 1"):
        EngineQueue(bad)
