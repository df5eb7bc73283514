"""The proxy's stats report its host cost per thread role: numbered threads of one kind add up under one
name, and a thread's CPU time shows there while it lives."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from streambox.api_proxy.snapshot import _per_thread_role, _process_usage

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def _spin(seconds: float, spun: threading.Semaphore, done: threading.Event) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    spun.release()
    done.wait()  # stays alive (and listed) until the test has read it


def test_numbered_threads_of_one_kind_are_one_role_with_their_cpu_time():
    spun, done = threading.Semaphore(0), threading.Event()
    workers = [threading.Thread(target=_spin, args=(0.05, spun, done), name=f"worker_{i}") for i in (1, 2)]
    for w in workers:
        w.start()
    try:
        for _ in workers:
            assert spun.acquire(timeout=10)
        cpu, runs = _per_thread_role()
        assert cpu["worker_N"] >= 0.09 and runs["worker_N"] >= 2  # two threads, 50 ms of CPU each
        assert "worker_1" not in cpu and cpu["MainThread"] > 0
    finally:
        done.set()
        for w in workers:
            w.join()
    usage = _process_usage()
    assert usage["cpu_user_s"] + usage["cpu_system_s"] >= 0.09
