"""Shared pieces of the ``jaxdist`` subcommands: progress display, cluster options."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from jaxdist.coordinator import Cluster
from jaxdist.errors import JaxdistError

__all__ = ["ProgressBar", "add_cluster_args", "open_cluster"]


class ProgressBar:
    """A one-line progress display on stderr, for ``Cluster.deploy(progress=...)``."""

    def __init__(self, stream: Any = sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()

    def __call__(self, what: str, done: int, total: int) -> None:
        width = 24
        filled = int(width * done / max(total, 1))
        bar = "#" * filled + "-" * (width - filled)
        line = f"[{bar}] {done}/{total} {what} ({time.perf_counter() - self.t0:.1f}s)"
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if done >= total and total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()



def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """``--workers`` / ``--local`` and the worker-side options that go with them."""
    p.add_argument("--workers", default="", metavar="HOST:PORT,...",
                   help="comma-separated addresses of running workers")
    p.add_argument("--local", type=int, default=None, metavar="N",
                   help="spawn N local workers (the default, with N=2, when --workers is absent)")
    p.add_argument("--stages", type=int, default=None, metavar="N",
                   help="pipeline stages (default: one per worker)")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0, metavar="S",
                   help="declare a silent worker dead after S seconds (default %(default)s)")


@contextlib.contextmanager
def open_cluster(opts: argparse.Namespace, weights_roots: Sequence[str]) -> Iterator[Cluster]:
    """Connect to ``--workers``, or spawn ``--local`` workers whose roots hold the model."""
    if opts.workers and opts.local:
        raise JaxdistError("give either --workers or --local, not both")
    if opts.workers:
        cluster = Cluster.connect(opts.workers, heartbeat_timeout=opts.heartbeat_timeout)
    else:
        n = opts.local or 2
        print(f"spawning {n} local workers", file=sys.stderr)
        cluster = Cluster.local(n, weights_roots=[os.fspath(r) for r in weights_roots],
                                heartbeat_timeout=opts.heartbeat_timeout)
    try:
        yield cluster
    finally:
        cluster.close()


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KB"``."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"
