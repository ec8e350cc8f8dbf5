"""How a worker process is started: its command line, the thread that starts it, and the line
it prints when ready.

Every launcher (:mod:`jaxdist.coordinator.spawn` on loopback, :mod:`jaxdist.launch.ray` as Ray
actors) builds the ``jaxdist-worker`` arguments (:func:`worker_args`) and its command line
(:func:`worker_command`) here and reads the worker's ready line here, so a worker option is
passed the same way, and a worker runs the same way, whoever starts it.

Decisions:

* **The working directory cannot shadow the package.** A worker runs as ``python -P -m
  jaxdist.worker``: plain ``-m`` puts the working directory first on ``sys.path``, so a folder
  named ``jaxdist`` there (the directory that holds a clone, say) would be imported instead of
  the installed package. ``-P`` (Python 3.11+) leaves it off.
* **A worker dies with the process that started it** (Linux). :func:`worker_command` with
  ``parent=`` runs a few lines of Python first that set ``PR_SET_PDEATHSIG`` = SIGKILL and then
  ``exec`` the worker, so when its parent dies, even of SIGKILL, the kernel kills the worker.
  The signal follows the parent *thread*, not the process: a worker started from a thread
  that then ends would be killed with that thread. :func:`start_process` therefore starts
  every local worker from one thread that lives as long as the process (the Ray actor starts
  its worker from a thread that lives as long as the worker). Other systems have no
  ``prctl``: there the worker is started directly, as before, and outlives a parent killed
  with SIGKILL (a parent that exits cleanly still stops its workers).

Example:
    >>> worker_args("127.0.0.1:0", device="cpu", weights_roots=["/srv/models"])[:4]
    ['--listen', '127.0.0.1:0', '--device', 'cpu']
    >>> worker_command(["--device", "cpu"])[1:]
    ['-P', '-m', 'jaxdist.worker', '--device', 'cpu']
    >>> parse_ready("jaxdist-worker listening on 127.0.0.1:40123 device=cpu:0")
    ('127.0.0.1:40123', 'cpu:0')
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["DIES_WITH_PARENT", "parse_ready", "start_process", "worker_args", "worker_command"]

DIES_WITH_PARENT = sys.platform.startswith("linux")
"""Whether :func:`worker_command` can tie a worker to its parent (``prctl``, Linux only)."""

# Run as `python -P -c _SHIM PARENT_PID ARGS...` before the child becomes the worker: die with
# the parent (PR_SET_PDEATHSIG = 1), and give up if the parent died before that was set (the
# child was re-parented already). exec keeps the setting (the interpreter is not set-user-ID).
_SHIM = """\
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
    sys.exit("jaxdist-worker: prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):
    sys.exit("jaxdist-worker: the process that started it exited before the worker started")
os.execv(sys.executable, [sys.executable, "-P", "-m", "jaxdist.worker", *sys.argv[2:]])
"""

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


def worker_command(args: Sequence[str], *, parent: int | None = None) -> list[str]:
    """The command line that runs ``jaxdist-worker`` with ``args`` (from :func:`worker_args`):
    ``python -P -m jaxdist.worker ARGS``, so the working directory cannot shadow the package.

    Args:
        args: the worker's arguments.
        parent: the process id of the process that starts the worker (``os.getpid()``). On
            Linux the worker is then killed when that process dies (``PR_SET_PDEATHSIG``, set
            by a short Python shim that then execs the worker; see the module's decisions),
            and it refuses to start if that process is gone already. Start it
            from a thread that lives as long as the worker (:func:`start_process`): the
            signal follows the parent thread. Elsewhere (no ``prctl``) the argument is
            ignored and nothing ties the worker to its parent. ``None``: nothing ties it.
    """
    if parent is not None and DIES_WITH_PARENT:
        return [sys.executable, "-P", "-c", _SHIM, str(parent), *args]
    return [sys.executable, "-P", "-m", "jaxdist.worker", *args]


_Job = tuple[concurrent.futures.Future[subprocess.Popen[Any]], list[str], dict[str, Any]]
_starter_lock = threading.Lock()
_starter: tuple[int, queue.SimpleQueue[_Job]] | None = None  # (pid, its starter's queue)


def start_process(cmd: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(cmd, **popen)``, run by one thread of this process that lives until
    the process exits, whichever thread calls.

    A worker started with :func:`worker_command` ``(parent=...)`` is killed when the *thread*
    that started it ends, not only the process: a worker spawned from a short-lived thread
    (``jaxdist serve`` deploys from one, a library user may spawn from a pool) would die with
    it. The starter thread is a daemon that waits for work, so it ends only with the process.

    Raises:
        OSError: as ``subprocess.Popen`` raises it.
    """
    future: concurrent.futures.Future[subprocess.Popen[Any]] = concurrent.futures.Future()
    _starter_queue().put((future, list(cmd), popen))
    try:
        return future.result()
    except BaseException:  # Ctrl-C while it started: what it started is not left running
        future.add_done_callback(_kill_started)
        raise


def _starter_queue() -> queue.SimpleQueue[_Job]:
    global _starter
    with _starter_lock:
        if _starter is None or _starter[0] != os.getpid():  # none yet, or a forked child's
            jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
            threading.Thread(target=_start_loop, args=(jobs,), name="jaxdist-process-starter",
                             daemon=True).start()
            _starter = (os.getpid(), jobs)
        return _starter[1]


def _start_loop(jobs: queue.SimpleQueue[_Job]) -> None:
    while True:
        future, cmd, popen = jobs.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(subprocess.Popen(cmd, **popen))
        except BaseException as exc:  # noqa: BLE001 - the caller's to raise; this thread stays
            future.set_exception(exc)


def _kill_started(future: concurrent.futures.Future[subprocess.Popen[Any]]) -> None:
    if not future.cancelled() and future.exception() is None:
        proc = future.result()
        proc.kill()
        proc.wait()
