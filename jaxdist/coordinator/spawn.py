"""Spawn worker processes on loopback: the embedded default for demos, tests and benchmarks.

Each worker is a real ``python -P -m jaxdist.worker`` process listening on ``127.0.0.1:0``; we
read the address from the one line it prints when ready. Teardown sends SIGTERM (the worker
drains and exits 0) and SIGKILLs a worker that does not exit in time.

On Linux the workers die with this process, even when it is killed with SIGKILL
(``PR_SET_PDEATHSIG``, :func:`jaxdist.launch.process.worker_command`). The signal follows the
thread that started a worker, so every worker is started by one thread that lives as long as
the process (:func:`jaxdist.launch.process.start_process`), whichever thread spawns: ``jaxdist
serve`` spawns from its loader thread, and a worker must not die when such a thread ends.
Elsewhere a worker outlives a coordinator killed with SIGKILL (a clean exit still stops it).

The workers of one :func:`spawn_workers` call write their logs (and, by default, their shared
artifact cache) into one temporary directory. It is removed once all of them have stopped; the
log of a worker that did not exit cleanly is kept, and its path logged, so a crash can still be
read after the cluster closes.

Before any worker starts, :func:`check_device` refuses a device directive this machine cannot
honour (the workers run here, so this machine's devices are theirs), and a GPU memory fraction
that is out of range or that the environment contradicts; the error names what is present.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from jaxdist.core import config
from jaxdist.core.devices import parse_directive
from jaxdist.core.errors import DeviceError, TransportError
from jaxdist.core.transport.security import server_auth
from jaxdist.launch.process import parse_ready, start_process, worker_args, worker_command

__all__ = ["LocalWorker", "check_device", "spawn_workers", "stop_workers"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Scratch:
    """The temporary directory of one :func:`spawn_workers` call, and the workers that use it."""

    path: str
    owns_cache: bool  # the artifact cache is our ``artifacts`` subdirectory
    workers: list[LocalWorker] = field(default_factory=list)

    def release(self) -> None:
        """Remove the directory once every worker in it has stopped: the clean ones' logs and
        our artifact cache; the logs of workers that did not exit cleanly stay."""
        if any(w.process.returncode is None for w in self.workers):
            return
        kept = [w for w in self.workers if w.process.returncode != 0]
        for w in self.workers:
            if w not in kept:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(w.log_path)
        if self.owns_cache:
            shutil.rmtree(os.path.join(self.path, "artifacts"), ignore_errors=True)
        if kept:
            for w in kept:
                log.warning("local worker pid %d exited with status %s; its log is kept at %s",
                            w.pid, w.process.returncode, w.log_path)
            return
        with contextlib.suppress(OSError):  # not empty: someone else wrote there
            os.rmdir(self.path)


@dataclass(eq=False)
class LocalWorker:
    """A worker subprocess and where it listens. ``log_path`` is its stderr; the file is
    removed when the worker exits cleanly and every worker started with it has stopped."""

    process: subprocess.Popen[str]
    address: str
    device: str
    log_path: str
    _scratch: _Scratch | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None


def _start(args: list[str], env: dict[str, str], log_path: str,
           cpu: int | None) -> subprocess.Popen[str]:
    # taskset execs the worker's command in the same process, so the parent stays this one.
    cmd = worker_command(args, parent=os.getpid())
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        cmd = ["taskset", "-c", str(cpu), *cmd]
    logf = open(log_path, "w")  # noqa: SIM115 - handed to the child, closed with it
    proc: subprocess.Popen[str] = start_process(
        cmd, stdout=subprocess.PIPE, stderr=logf, stdin=subprocess.DEVNULL, text=True, env=env,
        start_new_session=True)
    return proc


def _wait_ready(proc: subprocess.Popen[str], log_path: str, timeout: float) -> tuple[str, str]:
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None  # we created the pipe ourselves
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sel.select(timeout=0.2):
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        ready = parse_ready(line)
        if ready is not None:
            return ready
    proc.kill()
    with open(log_path) as f:
        tail = "".join(f.readlines()[-15:])
    raise TransportError(f"local worker (pid {proc.pid}) did not become ready within {timeout}s; "
                         f"its log ({log_path}) ends with:\n{tail}")


# The directives check_device found present, with the workers' extra environment: a CLI checks
# its --device before it reads the model, then spawns, and a device does not come and go.
_PRESENT: set[tuple[str, tuple[tuple[str, str], ...]]] = set()

# Run as `python -P -c _PROBE DIRECTIVE` with the workers' environment (-P: the working
# directory cannot shadow the package, as for the workers): exit 0, or 3 with the
# DeviceError's message on stdout.
_PROBE = """\
import sys
from jaxdist.core.devices import resolve_device
from jaxdist.core.errors import DeviceError
try:
    resolve_device(sys.argv[1])
except DeviceError as exc:
    print(exc)
    sys.exit(3)
"""


def check_device(device: str, *, gpu_memory_fraction: float | None = None,
                 env: dict[str, str] | None = None, timeout: float = 120.0) -> str:
    """Refuse what local workers could not honour, before any of them starts.

    Args:
        device: the workers' device directive.
        gpu_memory_fraction: their ``--gpu-memory-fraction``, or ``None``.
        env: the extra environment variables they get.
        timeout: seconds the device check may take.

    Returns:
        The directive, normalized (``"cuda:1"``).

    Raises:
        DeviceError: a malformed directive; one naming a device this machine lacks (the
            message lists the devices present); a fraction outside ``(0, 1]``, or one given
            while the environment sets jax's GPU memory variables itself.
    """
    directive = parse_directive(device)
    if gpu_memory_fraction is not None:
        fraction = config.check_gpu_memory_fraction(gpu_memory_fraction, "gpu_memory_fraction")
        config.gpu_memory_env(fraction, _worker_env(env), name="gpu_memory_fraction")
    if directive.platform in ("auto", "cpu") and directive.index is None:
        return str(directive)  # every jax has a cpu device, and auto falls back to it
    key = (str(directive), tuple(sorted((env or {}).items())))
    if key in _PRESENT:
        return str(directive)
    # The devices are listed in a child process with the workers' environment, not here:
    # starting jax's backends here would start all of them, whatever the directive, and a GPU
    # backend takes 75% of the GPU by default and a TPU backend holds its chips until this
    # process exits, so the workers would find the device taken. The child also sees what
    # the workers will see under `env` (CUDA_VISIBLE_DEVICES, XLA_FLAGS), and its exit frees
    # what it took. It costs a jax start (a second or two), so auto and cpu skip it.
    child_env = _worker_env(env)
    child_env.update(config.gpu_memory_env(None, child_env)[0])  # the child holds no pool
    try:
        probe = subprocess.run([sys.executable, "-P", "-c", _PROBE, str(directive)],
                               env=child_env, stdin=subprocess.DEVNULL, capture_output=True,
                               text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise DeviceError(f"device directive {str(directive)!r}: listing this machine's "
                          f"devices took more than {timeout:g} s") from None
    if probe.returncode == 3:
        raise DeviceError(probe.stdout.strip())
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise DeviceError(f"device directive {str(directive)!r}: listing this machine's "
                          f"devices failed (exit {probe.returncode}): {tail}")
    _PRESENT.add(key)
    return str(directive)


def _worker_env(env: dict[str, str] | None) -> dict[str, str]:
    """The environment of a local worker: the user's (without the GPU memory setting this
    process chose for itself, see :func:`jaxdist.core.config.inherited_environ`) and ``env``."""
    full = config.inherited_environ()
    full.update(env or {})
    return full


def spawn_workers(n: int, *, weights_roots: Sequence[str] = (), device: str = "auto",
                  gpu_memory_fraction: float | None = None,
                  artifact_cache: str | None = None, compilation_cache: str | None = None,
                  max_sessions: int = 64, pin_cpus: Sequence[int] | None = None,
                  extra_args: Sequence[str] = (), log_level: str = "WARNING",
                  env: dict[str, str] | None = None, timeout: float = 120.0,
                  token_file: str | None = None, tls_cert: str | None = None,
                  tls_key: str | None = None, tls_ca: str | None = None) -> list[LocalWorker]:
    """Start ``n`` workers in parallel and wait until each is listening.

    Args:
        n: number of workers.
        weights_roots: passed as ``--weights-root`` to every worker.
        device: device directive of every worker (``--device``): ``auto`` (a TPU, a CUDA or
            ROCm GPU, else the cpu), ``cpu``, ``cuda[:N]``, ``rocm[:N]``, ``tpu[:N]``,
            ``metal``. Checked on this machine first (:func:`check_device`). Several workers
            may share one GPU.
        gpu_memory_fraction: ``--gpu-memory-fraction`` of every worker: each preallocates this
            fraction of its GPU's memory. ``None``: each allocates what it needs (unless the
            environment sets jax's ``XLA_PYTHON_CLIENT_*`` memory variables).
        artifact_cache: shared artifact cache dir (default: a fresh temporary dir per call).
        compilation_cache: persistent XLA cache dir, or ``None`` for the worker default.
        max_sessions: ``--max-sessions``.
        pin_cpus: pin worker i to core ``pin_cpus[i]`` with ``taskset``.
        extra_args: more worker arguments.
        log_level: worker log level.
        env: extra environment variables.
        timeout: seconds to wait for each worker.
        token_file: ``--token-file`` of every worker (calls must carry this bearer token).
        tls_cert: ``--tls-cert`` of every worker (serve TLS with this certificate).
        tls_key: ``--tls-key``, the key of ``tls_cert``.
        tls_ca: ``--tls-ca`` (mutual TLS: clients must present a certificate signed by it).

    Raises:
        TransportError: a worker did not start; the message holds the end of its log.
        AuthError: the token or TLS files are unusable (checked here, before any worker starts,
            so the error is the worker's own message).
        DeviceError: the directive or the fraction is refused (:func:`check_device`), before
            any worker starts.
    """
    if n < 1:
        raise TransportError(f"need at least one local worker, asked for {n}")
    server_auth(token_file=token_file, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca)
    device = check_device(device, gpu_memory_fraction=gpu_memory_fraction, env=env,
                          timeout=timeout)
    # This process traces the model after the workers start, and tracing starts its jax
    # backends: with jax's default it would then take 75% of a GPU the workers share.
    config.apply_gpu_memory_env(None)
    logdir = tempfile.mkdtemp(prefix="jaxdist-workers-")
    cache = artifact_cache or os.path.join(logdir, "artifacts")
    full_env = _worker_env(env)
    started = []
    try:
        for i in range(n):
            args = worker_args("127.0.0.1:0", device=device, weights_roots=weights_roots,
                               artifact_cache=cache, compilation_cache=compilation_cache,
                               max_sessions=max_sessions, log_level=log_level,
                               token_file=token_file, tls_cert=tls_cert, tls_key=tls_key,
                               tls_ca=tls_ca, gpu_memory_fraction=gpu_memory_fraction,
                               extra_args=extra_args)
            log_path = os.path.join(logdir, f"worker-{i}.log")
            cpu = pin_cpus[i] if pin_cpus is not None else None
            started.append((_start(args, full_env, log_path, cpu), log_path))
        scratch = _Scratch(logdir, owns_cache=artifact_cache is None)
        for proc, log_path in started:
            address, dev = _wait_ready(proc, log_path, timeout)
            scratch.workers.append(LocalWorker(proc, address, dev, log_path, scratch))
            log.info("local worker pid %d on %s (%s)", proc.pid, address, dev)
        found = [w.device for w in scratch.workers]
        if len({d.partition(":")[0] for d in found}) > 1:
            # auto takes the best platform each worker can open: a TPU one process holds,
            # say, is not there for the next one, which takes the cpu.
            log.warning("local workers started with device %r run on different devices (%s); "
                        "name one device to choose it", device, ", ".join(found))
        return list(scratch.workers)
    except BaseException:  # the logs stay: the error names the one that explains it
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if artifact_cache is None:
            shutil.rmtree(cache, ignore_errors=True)
        raise


def stop_workers(workers: Sequence[LocalWorker], timeout: float = 20.0) -> None:
    """SIGTERM every worker, wait, SIGKILL stragglers; then remove the temporary directory of
    every spawn whose workers have all stopped (see the module's docstring)."""
    for w in workers:
        if w.alive():
            try:
                w.process.send_signal(signal.SIGTERM)
                # A SIGSTOP'ed worker (fault tests) cannot act on SIGTERM until continued.
                w.process.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    for w in workers:
        try:
            w.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("worker pid %d did not exit after SIGTERM; its threads' stacks go to "
                        "its stderr, then it is killed", w.pid)
            try:
                w.process.send_signal(signal.SIGUSR1)  # faulthandler in the worker
                w.process.wait(timeout=1.0)  # the dump is written in the signal's handler
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            w.process.kill()
            w.process.wait()
        if w.process.stdout is not None:
            w.process.stdout.close()
    for scratch in {w._scratch for w in workers if w._scratch is not None}:
        scratch.release()
