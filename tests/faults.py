"""Fault injection for the failure tests: a worker process frozen with SIGSTOP."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator


def _all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (``T`` in ``/proc``)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return bool(states) and all(s in ("T", "t") for s in states)


@contextlib.contextmanager
def frozen(process: subprocess.Popen[str], timeout: float = 30.0) -> Iterator[None]:
    """Stop ``process`` (SIGSTOP) and return once every one of its threads has stopped; let it
    go on (SIGCONT) on exit.

    ``kill`` returns before the target's threads have stopped: each stops when it next passes
    through the kernel, which on a loaded machine can be after the test's next frame has been
    taken in. Waiting for the stopped state rules that out.
    """
    process.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout
        while not _all_stopped(process.pid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {process.pid} did not stop within {timeout}s")
            time.sleep(0.005)  # no event for another process's state: poll /proc
        yield
    finally:
        process.send_signal(signal.SIGCONT)
