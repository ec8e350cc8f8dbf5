"""Before authentication nothing is held (issue #15 item 3, issue #33 item 6), on a real worker
process.

The worker runs with a hard open-file limit of 1024, the common default. 1100 TCP connections
that never speak HTTP/2 must not keep anyone out:

* silent ones wait in the kernel (``TCP_DEFER_ACCEPT`` on gRPC's listening socket) and hold no
  descriptor of the worker, so a new caller, which speaks first, is served while they are held;
* ones that send a byte and then nothing are accepted, held at most the connection bound (the
  limit less a reserve) and closed when their handshake times out; an established caller keeps
  being served meanwhile, and a new caller is served once they are closed.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time

import pytest

from jaxdist.core.openfiles import FD_RESERVE
from jaxdist.core.transport.client import WorkerClient

LIMIT = 1024
FLOOD = 1100


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def worker(tmp_path):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))

    proc = subprocess.Popen([sys.executable, "-m", "jaxdist.worker", "--listen", "127.0.0.1:0",
                             "--data-listen", "off", "--weights-root", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=limit)
    assert proc.stdout is not None
    line = ""
    while "listening on" not in line:
        line = proc.stdout.readline()
        assert line, "the worker exited before listening"
    yield proc, line.split("listening on ")[1].split()[0]
    proc.kill()
    proc.wait()


def _flood(address: str, first: bytes = b"") -> list[socket.socket]:
    host, port = address.rsplit(":", 1)
    flood = []
    for _ in range(FLOOD):
        try:
            s = socket.create_connection((host, int(port)), timeout=10)
        except OSError:
            break  # the kernel's backlog is full: the flood is at its bound
        flood.append(s)
        if first:
            try:
                s.sendall(first)
            except OSError:
                pass  # closed by the worker already (over its bound)
    return flood


def _settled_fds(pid: int) -> int:
    """The worker's descriptor count once it stops changing (a bounded wait)."""
    seen, deadline = -1, time.monotonic() + 60
    while time.monotonic() < deadline and (n := _fds(pid)) != seen:
        seen = n
        time.sleep(0.5)
    return seen


def test_silent_connections_hold_nothing_and_keep_no_new_caller_out(worker):
    proc, address = worker
    established = WorkerClient(address, timeout=30)
    established.info()
    before = _fds(proc.pid)
    flood = _flood(address)
    try:
        assert len(flood) == FLOOD
        assert _settled_fds(proc.pid) <= before + 8, "the silent connections took descriptors"
        # A new caller is served at its first try, while the whole flood is held open.
        fresh = WorkerClient(address, timeout=30)
        assert fresh.info().address
        assert established.info().address
        fresh.close()
    finally:
        for s in flood:
            s.close()


@pytest.mark.slow  # the same bound as above, for clients that send a byte first (the fallback)
def test_connections_that_stall_after_a_byte_are_bounded_and_closed(worker):
    proc, address = worker
    established = WorkerClient(address, timeout=30)
    established.info()
    flood = _flood(address, first=b"P")
    try:
        seen = _settled_fds(proc.pid)
        assert seen <= LIMIT - FD_RESERVE + 64, f"{seen} descriptors held"
        assert established.info().address  # the caller that was in keeps being served
        # The flood stays open: the worker closes what never finished its handshake (2 s),
        # then a new caller gets in.
        fresh = WorkerClient(address, timeout=60)
        deadline = time.monotonic() + 120
        while True:
            try:
                fresh.info()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert _fds(proc.pid) <= LIMIT - FD_RESERVE + 64  # still bounded
    finally:
        for s in flood:
            s.close()
