"""Shared pieces of the ``jaxdist`` subcommands: progress display, cluster and credential
options."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from jaxdist.core.defaults import HEARTBEAT_TIMEOUT_S
from jaxdist.core.errors import JaxdistError

if TYPE_CHECKING:  # gRPC is imported only by the verbs that dial workers
    from jaxdist.coordinator.cluster import Cluster
    from jaxdist.core.transport.security import ClientAuth

__all__ = ["ProgressBar", "add_auth_args", "add_cluster_args", "auth_files", "client_auth_of",
           "open_cluster"]


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


def add_auth_args(p: argparse.ArgumentParser) -> None:
    """``--token-file``, ``--tls-cert``, ``--tls-key``, ``--tls-ca``: what the workers require.

    Every subcommand that dials workers takes them; see ``SECURITY.md``."""
    g = p.add_argument_group(
        "credentials", "what the workers require (their --token-file and TLS options); "
        "workers spawned with --local are started with the same files")
    g.add_argument("--token-file", default=None, metavar="FILE",
                   help="send this file's token as 'authorization: Bearer <token>'")
    g.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="client certificate, for workers that require mutual TLS")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    g.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="connect with TLS and verify the workers' certificates against this CA")


def auth_files(opts: argparse.Namespace) -> dict[str, Any]:
    """The credential options as keyword arguments (``token_file=``, ``tls_cert=``, ...)."""
    return {"token_file": opts.token_file, "tls_cert": opts.tls_cert, "tls_key": opts.tls_key,
            "tls_ca": opts.tls_ca}


def client_auth_of(opts: argparse.Namespace) -> ClientAuth:
    """The metadata and channel credentials the credential options ask for."""
    from jaxdist.core.transport.security import client_auth  # noqa: PLC0415

    return client_auth(**auth_files(opts))


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """``--workers`` / ``--local``, the worker-side options that go with them, and the
    credential options."""
    p.add_argument("--workers", default="", metavar="HOST:PORT,...",
                   help="comma-separated addresses of running workers")
    p.add_argument("--local", type=int, default=None, metavar="N",
                   help="spawn N local workers (the default, with N=2, when --workers is absent)")
    p.add_argument("--spares", default="", metavar="HOST:PORT,...|N",
                   help="spare workers: when a worker dies mid-generation its stages move to a "
                        "spare and generation goes on (addresses with --workers; a count with "
                        "--local)")
    p.add_argument("--stages", type=int, default=None, metavar="N",
                   help="pipeline stages (default: one per worker)")
    p.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S, metavar="S",
                   help="declare a silent worker dead after S seconds (default %(default)s)")
    add_auth_args(p)


@contextlib.contextmanager
def open_cluster(opts: argparse.Namespace, weights_roots: Sequence[str]) -> Iterator[Cluster]:
    """Connect to ``--workers``, or spawn ``--local`` workers whose roots hold the model."""
    from jaxdist.coordinator.cluster import Cluster  # noqa: PLC0415

    if opts.workers and opts.local is not None:
        raise JaxdistError("give either --workers or --local, not both")
    if opts.local is not None and opts.local < 1:
        raise JaxdistError(f"--local {opts.local}: expected a number of workers >= 1")
    spares = getattr(opts, "spares", "")
    if opts.workers:
        addresses = [a.strip() for a in opts.workers.split(",") if a.strip()]
        check_addresses("--workers", addresses)
        if not re.fullmatch(r"[0-9]+", spares, re.ASCII):
            check_addresses("--spares", [a.strip() for a in spares.split(",") if a.strip()])
        n = len(addresses)
        print(f"connecting to {n} worker{'s' if n != 1 else ''}", file=sys.stderr)
        if re.fullmatch(r"[0-9]+", spares, re.ASCII):
            raise JaxdistError(f"--spares {spares}: with --workers, give the spares' addresses "
                               f"(HOST:PORT,...); a count is for --local")
        auth = client_auth_of(opts)
        cluster = Cluster.connect(addresses, heartbeat_timeout=opts.heartbeat_timeout,
                                  metadata=auth.metadata, credentials=auth.credentials,
                                  spares=[a.strip() for a in spares.split(",") if a.strip()])
    else:
        if spares and not re.fullmatch(r"[0-9]{1,3}", spares, re.ASCII):
            raise JaxdistError(f"--spares {spares!r}: with --local, give a number of spare "
                               f"workers to spawn")
        n, n_spares = opts.local or 2, int(spares or 0)
        print(f"spawning {n} local workers" + (f" and {n_spares} spares" if n_spares else ""),
              file=sys.stderr)
        cluster = Cluster.local(n, weights_roots=[os.fspath(r) for r in weights_roots],
                                heartbeat_timeout=opts.heartbeat_timeout, spares=n_spares,
                                **auth_files(opts))
    try:
        yield cluster
    finally:
        cluster.close()


def check_addresses(flag: str, addresses: Sequence[str]) -> None:
    """Refuse an address that is not ``HOST:PORT`` (gRPC would dial port 443 for a bare host)."""
    for a in addresses:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise JaxdistError(f"{flag}: {a!r} is not HOST:PORT (a worker's address needs its "
                               f"port, e.g. {host or a}:50051)")


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KB"``."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"
