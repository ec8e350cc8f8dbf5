"""Before authentication nothing is held (issue #15 item 3), on a real worker process.

The worker runs with a hard open-file limit of 1024, the common default. 1100 TCP connections
that never speak HTTP/2 must not take all its descriptors: the gRPC port holds at most the limit
less a reserve, an established caller keeps being served during the flood, the idle sockets are
closed once their handshake times out, and a new caller is served again after that.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time

import pytest

from jaxdist.core.transport.client import WorkerClient
from jaxdist.core.openfiles import FD_RESERVE

LIMIT = 1024


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


def test_idle_connections_cannot_take_the_workers_descriptors(worker):
    proc, address = worker
    host, port = address.rsplit(":", 1)
    established = WorkerClient(address, timeout=30)
    established.info()
    flood = []
    try:
        for _ in range(1100):
            try:
                flood.append(socket.create_connection((host, int(port)), timeout=10))
            except OSError:
                break  # the kernel's backlog is full: the flood is at its bound
        # Let the worker accept what it will (a bounded wait on the count settling).
        seen, deadline = -1, time.monotonic() + 60
        while time.monotonic() < deadline and (n := _fds(proc.pid)) != seen:
            seen = n
            time.sleep(0.5)
        assert seen <= LIMIT - FD_RESERVE + 64, f"{seen} descriptors held"
        assert established.info().address  # the caller that was in keeps being served
        # The flood stays open: the worker closes what never finished its handshake (5 s),
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
        assert _fds(proc.pid) <= LIMIT - FD_RESERVE + 64  # still bounded (the backlog refills it)
    finally:
        for s in flood:
            s.close()
