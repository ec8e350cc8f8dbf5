"""Shared pieces of the ``jaxdist`` subcommands: cluster and credential options, and the
progress display (:mod:`jaxdist.cli.progress`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from jaxdist.cli.progress import ProgressBar
from jaxdist.core.defaults import HEARTBEAT_TIMEOUT_S
from jaxdist.core.errors import JaxdistError
from jaxdist.launch.ray import STRATEGIES

if TYPE_CHECKING:  # gRPC is imported only by the verbs that dial workers
    from jaxdist.coordinator.cluster import Cluster
    from jaxdist.core.transport.security import ClientAuth

__all__ = ["ProgressBar", "add_auth_args", "add_cluster_args", "add_device_args", "auth_files",
           "check_cluster_args", "client_args_of", "client_auth_of", "cluster_args_of",
           "device_args_of", "open_cluster", "parse_size", "parse_workers"]


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
    g.add_argument("--insecure-token", action="store_true",
                   help="send --token-file's token even in plaintext to workers whose address "
                        "is not loopback (refused without it: anyone on the path can read it; "
                        "use --tls-ca instead)")


def auth_files(opts: argparse.Namespace) -> dict[str, Any]:
    """The credential options as keyword arguments (``token_file=``, ``tls_cert=``, ...)."""
    return {"token_file": opts.token_file, "tls_cert": opts.tls_cert, "tls_key": opts.tls_key,
            "tls_ca": opts.tls_ca}


def client_auth_of(opts: argparse.Namespace) -> ClientAuth:
    """The metadata and channel credentials the credential options ask for."""
    from jaxdist.core.transport.security import client_auth  # noqa: PLC0415

    return client_auth(**auth_files(opts))


def client_args_of(opts: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``WorkerClient`` and ``Cluster`` the credential options ask
    for: ``metadata``, ``credentials`` and ``insecure_token``."""
    auth = client_auth_of(opts)
    return {"metadata": auth.metadata, "credentials": auth.credentials,
            "insecure_token": bool(getattr(opts, "insecure_token", False))}


def cluster_args_of(opts: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``Cluster`` the credential options ask for: ``auth`` (the
    files read, which also open the workers' data ports) and ``insecure_token``."""
    return {"auth": client_auth_of(opts),
            "insecure_token": bool(getattr(opts, "insecure_token", False))}


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
    add_device_args(p)
    add_ray_args(p)
    add_auth_args(p)


def add_device_args(p: argparse.ArgumentParser) -> None:
    """``--device`` and ``--gpu-memory-fraction``: the workers this command starts."""
    g = p.add_argument_group("device", "of the workers this command starts (--local, --ray); "
                             "running --workers chose theirs when they started")
    g.add_argument("--device", default=None, metavar="DIRECTIVE",
                   help="auto | cpu | cuda[:N] | rocm[:N] | tpu[:N] | metal, as jaxdist-worker "
                        "--device takes it (default: auto, a TPU or GPU when this machine has "
                        "one, else the cpu; with --ray, the bundle's). Several workers may "
                        "share one GPU")
    g.add_argument("--gpu-memory-fraction", default=None, metavar="F",
                   help="each worker preallocates this fraction of its GPU's memory, "
                        "0 < F <= 1 (default: each allocates what it needs: its weights, KV "
                        "cache and executables, shown by jaxdist status)")


def device_args_of(opts: argparse.Namespace) -> dict[str, Any]:
    """``device`` and ``gpu_memory_fraction`` for ``Cluster.local`` (or ``Cluster.ray``), from
    ``--device`` and ``--gpu-memory-fraction``, checked; only the options given, so a
    launcher's own default applies otherwise.

    With ``--local`` (or neither ``--workers`` nor ``--ray``) the directive is checked on this
    machine, where the workers will run (:func:`jaxdist.coordinator.spawn.check_device`).

    Raises:
        JaxdistError: either option beside ``--workers``: running workers chose theirs.
        DeviceError: a directive this machine cannot honour, naming the devices present; a
            fraction out of range, or one that the environment's ``XLA_PYTHON_CLIENT_*``
            variables contradict.
    """
    from jaxdist.core import config  # noqa: PLC0415 - it loads jax
    from jaxdist.core.errors import DeviceError  # noqa: PLC0415

    device, fraction = getattr(opts, "device", None), getattr(opts, "gpu_memory_fraction", None)
    if getattr(opts, "workers", ""):
        for flag, value in (("--device", device), ("--gpu-memory-fraction", fraction)):
            if value is not None:
                raise JaxdistError(f"{flag} {value}: it sets up the workers this command "
                                   f"starts (--local, --ray); running --workers chose theirs "
                                   f"when they started (jaxdist-worker {flag}; jaxdist status "
                                   f"shows their devices)")
        return {}
    args: dict[str, Any] = {}
    if fraction is not None:
        args["gpu_memory_fraction"] = config.check_gpu_memory_fraction(fraction)
    if getattr(opts, "ray", None) is not None:  # the bundle and the Ray nodes decide
        if device is not None:
            args["device"] = device
        return args
    from jaxdist.coordinator.spawn import check_device  # noqa: PLC0415

    if fraction is not None:  # a clash with the environment, said with the flag's name
        config.gpu_memory_env(args["gpu_memory_fraction"], config.inherited_environ())
    args["device"] = device or "auto"
    try:
        check_device(args["device"], gpu_memory_fraction=args.get("gpu_memory_fraction"))
    except DeviceError as exc:
        raise DeviceError(f"--device {args['device']}: {exc}") from None
    return args


def check_cluster_args(opts: argparse.Namespace) -> None:
    """Refuse cluster options that contradict each other, or that the workers this command
    would start cannot honour; called first, before a model is read or a worker started."""
    if opts.workers and opts.local is not None:
        raise JaxdistError("give either --workers or --local, not both")
    check_ray_args(opts)
    if opts.local is not None and opts.local < 1:
        raise JaxdistError(f"--local {opts.local}: expected a number of workers >= 1")
    device_args_of(opts)


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """``--ray [ADDRESS]`` and its options: the workers as Ray actors."""
    g = p.add_argument_group("Ray", "start the workers as Ray actors, one per resource bundle "
                             "of a placement group (pip install 'jaxdist[ray]')")
    g.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="start the workers on Ray: 'auto' or HOST:PORT joins a running Ray "
                        "cluster; without ADDRESS, the local Ray instance (started if none "
                        "runs). Instead of --workers and --local")
    g.add_argument("--ray-workers", type=int, default=None, metavar="N",
                   help="workers to start on Ray (default 2); --spares N starts N more")
    g.add_argument("--ray-resources", default="CPU=1", metavar="NAME=AMOUNT,...",
                   help="each worker's bundle, e.g. GPU=1, TPU=1 or CPU=4 (default "
                        "%(default)s); Ray shows a worker only its bundle's GPUs, so it sees "
                        "its GPU as cuda:0")
    g.add_argument("--ray-strategy", default="PACK", choices=STRATEGIES,
                   help="placement: PACK (few nodes) or STRICT_SPREAD (a node per worker); "
                        "default %(default)s")
    g.add_argument("--ray-timeout", type=float, default=60.0, metavar="S",
                   help="wait this long for Ray to place the workers (default %(default)s)")


@contextlib.contextmanager
def open_cluster(opts: argparse.Namespace, weights_roots: Sequence[str]) -> Iterator[Cluster]:
    """Connect to ``--workers``, or spawn ``--local`` workers whose roots hold the model."""
    from jaxdist.coordinator.cluster import Cluster  # noqa: PLC0415

    check_cluster_args(opts)
    spares = getattr(opts, "spares", "")
    if getattr(opts, "ray", None) is not None:
        cluster = ray_cluster(opts, weights_roots, spares)
    elif opts.workers:
        addresses = parse_workers(opts.workers)
        if not re.fullmatch(r"[0-9]+", spares, re.ASCII):
            check_addresses("--spares", [a.strip() for a in spares.split(",") if a.strip()])
        n = len(addresses)
        print(f"connecting to {n} worker{'s' if n != 1 else ''}", file=sys.stderr)
        if re.fullmatch(r"[0-9]+", spares, re.ASCII):
            raise JaxdistError(f"--spares {spares}: with --workers, give the spares' addresses "
                               f"(HOST:PORT,...); a count is for --local")
        cluster = Cluster.connect(addresses, heartbeat_timeout=opts.heartbeat_timeout,
                                  spares=[a.strip() for a in spares.split(",") if a.strip()],
                                  **cluster_args_of(opts))
    else:
        if spares and not re.fullmatch(r"[0-9]{1,3}", spares, re.ASCII):
            raise JaxdistError(f"--spares {spares!r}: with --local, give a number of spare "
                               f"workers to spawn")
        n, n_spares = opts.local or 2, int(spares or 0)
        print(f"spawning {n} local workers" + (f" and {n_spares} spares" if n_spares else ""),
              file=sys.stderr)
        cluster = Cluster.local(n, weights_roots=[os.fspath(r) for r in weights_roots],
                                heartbeat_timeout=opts.heartbeat_timeout, spares=n_spares,
                                **device_args_of(opts), **auth_files(opts))
    try:
        yield cluster
    finally:
        cluster.close()


def check_ray_args(opts: argparse.Namespace) -> None:
    """Refuse ``--ray`` beside ``--workers`` or ``--local``, and Ray options without it."""
    if getattr(opts, "ray", None) is None:
        if getattr(opts, "ray_workers", None) is not None:
            raise JaxdistError(f"--ray-workers {opts.ray_workers}: it is the number of workers "
                               f"to start on Ray; give --ray too")
        return
    for flag, given, what in (("--workers", opts.workers, "dials running workers"),
                              ("--local", opts.local is not None, "spawns workers here")):
        if given:
            raise JaxdistError(f"give either --ray or {flag}, not both (--ray starts the "
                               f"workers on Ray, {flag} {what})")
    if opts.ray_workers is not None and opts.ray_workers < 1:
        raise JaxdistError(f"--ray-workers {opts.ray_workers}: expected a number of workers "
                           f">= 1")


def parse_resources(text: str) -> dict[str, float]:
    """``--ray-resources GPU=1,CPU=4`` as ``{"GPU": 1.0, "CPU": 4.0}``."""
    bundle: dict[str, float] = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        name, sep, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not sep or not name.strip() or not value > 0:
            raise JaxdistError(f"--ray-resources: {item!r} is not NAME=AMOUNT with a positive "
                               f"amount (e.g. GPU=1,CPU=4)")
        bundle[name.strip()] = value
    if not bundle:
        raise JaxdistError(f"--ray-resources {text!r}: expected NAME=AMOUNT,... such as GPU=1")
    return bundle


def ray_cluster(opts: argparse.Namespace, weights_roots: Sequence[str], spares: str) -> Cluster:
    """``--ray``: start ``--ray-workers`` (and ``--spares N``) workers as Ray actors."""
    from jaxdist.coordinator.cluster import Cluster

    if spares and not re.fullmatch(r"[0-9]{1,3}", spares, re.ASCII):
        raise JaxdistError(f"--spares {spares!r}: with --ray, give a number of spare workers "
                           f"to start")
    bundle = parse_resources(opts.ray_resources)
    n, n_spares = opts.ray_workers or 2, int(spares or 0)
    print(f"starting {n} worker{'s' if n != 1 else ''}"
          + (f" and {n_spares} spare{'s' if n_spares != 1 else ''}" if n_spares else "")
          + f" on Ray ({opts.ray or 'local'}), each holding {bundle}, {opts.ray_strategy}",
          file=sys.stderr)
    return Cluster.ray(n, resources=bundle, spares=n_spares, strategy=opts.ray_strategy,
                       address=opts.ray or None, placement_timeout=opts.ray_timeout,
                       weights_roots=[os.fspath(r) for r in weights_roots],
                       heartbeat_timeout=opts.heartbeat_timeout,
                       insecure_token=bool(getattr(opts, "insecure_token", False)),
                       **device_args_of(opts), **auth_files(opts))


def parse_workers(text: str) -> list[str]:
    """The ``--workers`` addresses, each checked to be ``HOST:PORT``."""
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    check_addresses("--workers", addresses)
    return addresses


def check_addresses(flag: str, addresses: Sequence[str]) -> None:
    """Refuse an address that is not ``HOST:PORT`` (gRPC would dial port 443 for a bare host)."""
    for a in addresses:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise JaxdistError(f"{flag}: {a!r} is not HOST:PORT (a worker's address needs its "
                               f"port, e.g. {host or a}:50051)")


_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_size(text: str) -> int:
    """A byte count: ``1048576``, ``512M`` (10^6), ``1GiB`` (2^30), as the worker's ``SIZE``
    flags read it; for argparse."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([KMGT]i?)?B?\s*", text, re.ASCII | re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 1048576, 512M or "
                                         f"4GiB, found {text!r}")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").upper()]


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KB"``."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"
