"""A worker under a flood of silent connections: how long a new caller waits (issue #33 item 6).

One worker (``--data-listen off``) runs with a hard open-file limit of 1024, the common default.
``--connections`` TCP connections (default 1100) are opened to its gRPC port and held, sending
nothing, for ``--seconds`` (default 90; ``--quick``: 20). Every 2 s a new client connects and
calls ``Info``, retrying every 50 ms until it is answered; the wait is recorded with the
worker's open descriptors. Record ``flood_new_caller_wait_s``: the longest wait (target: 2 s),
with every probe's wait in the detail. Nothing here is part of the tests
(``tests/test_preauth.py`` checks the same without timing).

Usage::

    python bench/flood.py [--quick] [--connections 1100] [--seconds 90] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import _common as c

LIMIT = 1024
note = c.note("flood")


def run(opts: argparse.Namespace) -> list[dict[str, Any]]:
    from jaxdist.core.transport.client import WorkerClient

    records: list[dict[str, Any]] = []
    seconds = opts.seconds if opts.seconds is not None else (20.0 if opts.quick else 90.0)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))

    proc = subprocess.Popen([sys.executable, "-m", "jaxdist.worker", "--listen", "127.0.0.1:0",
                             "--data-listen", "off", "--weights-root", tempfile.mkdtemp()],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=limit)
    flood: list[socket.socket] = []
    probes: list[tuple[float, float, int]] = []
    try:
        assert proc.stdout is not None
        line = ""
        while "listening on" not in line:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("the worker exited before listening")
        address = line.split("listening on ")[1].split()[0]
        host, port = address.rsplit(":", 1)
        for _ in range(opts.connections):
            try:
                flood.append(socket.create_connection((host, int(port)), timeout=10))
            except OSError:
                break  # the kernel's backlog is full
        note(f"{len(flood)} silent connections held for {seconds:g} s")
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            t0 = time.monotonic()
            client = WorkerClient(address, timeout=60)
            while True:
                try:
                    client.info(timeout=30)
                    break
                except Exception:  # noqa: BLE001 - not in yet: try again
                    time.sleep(0.05)
            probes.append((round(t0 - start, 1), round(time.monotonic() - t0, 3),
                           len(os.listdir(f"/proc/{proc.pid}/fd"))))
            client.close()
            time.sleep(2.0)
    finally:
        for s in flood:
            s.close()
        proc.kill()
        proc.wait()
    worst = max(w for _, w, _ in probes)
    c.emit(c.record("flood_new_caller_wait_s", worst, "s", "", None, None, "<= 2 s", worst <= 2,
                    connections=len(flood), seconds=seconds,
                    probes=[{"at_s": t, "wait_s": w, "worker_fds": n} for t, w, n in probes]),
           records)
    return records


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connections", type=int, default=1100, help="silent connections held")
    p.add_argument("--seconds", type=float, default=None,
                   help="how long they are held (default 90; --quick: 20)")


if __name__ == "__main__":
    raise SystemExit(c.cli(__doc__ or "", run, add_args))
