"""How a worker process is started: its command-line arguments and the line it prints when ready.

Every launcher (:mod:`jaxdist.coordinator.spawn` on loopback, :mod:`jaxdist.launch.ray` as Ray
actors) builds the ``jaxdist-worker`` arguments here and reads the worker's ready line here, so a
worker option is passed the same way whoever starts the worker.

Example:
    >>> worker_args("127.0.0.1:0", device="cpu", weights_roots=["/srv/models"])[:4]
    ['--listen', '127.0.0.1:0', '--device', 'cpu']
    >>> parse_ready("jaxdist-worker listening on 127.0.0.1:40123 device=cpu:0")
    ('127.0.0.1:40123', 'cpu:0')
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

__all__ = ["parse_ready", "worker_args"]

_READY = re.compile(r"^jaxdist-worker listening on (\S+) device=(\S+)$")
"""The first line a worker prints on stdout once it serves (``jaxdist.worker.__main__``)."""


def worker_args(listen: str, *, device: str = "auto", weights_roots: Sequence[str] = (),
                artifact_cache: str | None = None, compilation_cache: str | None = None,
                max_sessions: int = 64, log_level: str = "WARNING",
                token_file: str | os.PathLike[str] | None = None,
                tls_cert: str | os.PathLike[str] | None = None,
                tls_key: str | os.PathLike[str] | None = None,
                tls_ca: str | os.PathLike[str] | None = None,
                gpu_memory_fraction: float | None = None,
                extra_args: Sequence[str] = ()) -> list[str]:
    """The ``jaxdist-worker`` arguments for one worker (without the program itself).

    Args:
        listen: ``--listen HOST:PORT`` (port 0 picks a free port).
        device: ``--device``.
        weights_roots: one ``--weights-root`` each.
        artifact_cache: ``--artifact-cache``; ``None``: the worker's default.
        compilation_cache: ``--compilation-cache``; ``None``: the worker's default.
        max_sessions: ``--max-sessions``.
        log_level: ``--log-level``.
        token_file: ``--token-file``.
        tls_cert: ``--tls-cert``.
        tls_key: ``--tls-key``.
        tls_ca: ``--tls-ca``.
        gpu_memory_fraction: ``--gpu-memory-fraction``; ``None``: the worker's default (GPU
            memory allocated as needed).
        extra_args: appended as they are.
    """
    args = ["--listen", listen, "--device", device]
    if artifact_cache is not None:
        args += ["--artifact-cache", os.fspath(artifact_cache)]
    args += ["--max-sessions", str(max_sessions), "--log-level", log_level]
    for root in weights_roots:
        args += ["--weights-root", os.fspath(root)]
    if compilation_cache is not None:
        args += ["--compilation-cache", os.fspath(compilation_cache)]
    for flag, path in (("--token-file", token_file), ("--tls-cert", tls_cert),
                       ("--tls-key", tls_key), ("--tls-ca", tls_ca)):
        if path is not None:
            args += [flag, os.fspath(path)]
    if gpu_memory_fraction is not None:
        args += ["--gpu-memory-fraction", str(gpu_memory_fraction)]
    return args + list(extra_args)


def parse_ready(line: str) -> tuple[str, str] | None:
    """``(address, device)`` from a worker's ready line; ``None`` for any other line."""
    m = _READY.match(line.strip())
    return (m.group(1), m.group(2)) if m else None
