"""gRPC health checking of the worker (``worker/health.py``), probed the way Kubernetes and
``grpc_health_probe`` probe: grpc's own ``HealthStub``, ``Check`` and ``Watch``, against real
worker processes on loopback port 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Iterator

import grpc
import pytest
import test_security
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxdist.core.transport.security import TOKENLESS_METHODS, client_auth
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.proto import jaxdist_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WORKER_SERVICE = "jaxdist.v1.Worker"
BEARER = (("authorization", f"Bearer {test_security.TOKEN}"),)
pki = test_security.pki  # a fixture: the security tests' throwaway CA and token


@dataclasses.dataclass
class WorkerProcess:
    """A ``python -m jaxdist.worker`` process, and the addresses it printed before it was ready:
    ``address`` (``listening on``), ``health`` and ``metrics`` (``HOST:PORT``, ``None`` when not
    asked for)."""

    process: subprocess.Popen[str]
    address: str
    health: str | None
    metrics: str | None
    log_path: str

    def stop(self) -> int:
        """SIGTERM, then the exit status; after a clean exit its temporary directory is removed.
        A worker still running after 60 s is asked for its threads' stacks (SIGUSR1), killed,
        and reported with the end of its log."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=2)
            self.process.kill()
            self.process.wait()
            with open(self.log_path) as f:
                raise AssertionError(f"worker did not exit 60 s after SIGTERM; its log ends:\n"
                                     f"{f.read()[-8000:]}") from None
        if code == 0:
            shutil.rmtree(os.path.dirname(self.log_path), ignore_errors=True)
        return code


def start_worker(*args: str, timeout: float = 120.0) -> WorkerProcess:
    """Start a worker on ``127.0.0.1:0`` with ``args`` and read its start-up lines: the ready
    line, then one line per ``--health-listen`` and ``--metrics-listen``."""
    logdir = tempfile.mkdtemp(prefix="jaxdist-health-")
    log_path = os.path.join(logdir, "worker.log")
    cmd = [sys.executable, "-m", "jaxdist.worker", "--listen", "127.0.0.1:0", "--device", "cpu",
           "--artifact-cache", os.path.join(logdir, "artifacts"), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                text=True, start_new_session=True)
    assert proc.stdout is not None
    stdout = proc.stdout
    found: dict[str, str] = {}
    expected = {"address"} | {name for name, flag in (("health", "--health-listen"),
                                                      ("metrics", "--metrics-listen"))
                              if flag in args}
    ready = threading.Event()

    def read() -> None:
        # A thread of its own: the lines come in one burst, so select() on the pipe would wait
        # for data that readline has buffered already.
        for line in stdout:
            words = line.split()
            if line.startswith("jaxdist-worker health on "):
                found["health"] = words[3]
            elif line.startswith("jaxdist-worker metrics on "):
                found["metrics"] = words[3].removeprefix("http://").removesuffix("/metrics")
            elif line.startswith("jaxdist-worker listening on "):
                found["address"] = words[3]
            if set(found) == expected:
                break
        ready.set()  # every line expected, or the end of the output

    threading.Thread(target=read, name="worker-stdout", daemon=True).start()
    ready.wait(timeout)
    if set(found) != expected:
        proc.kill()
        with open(log_path) as f:
            raise AssertionError(f"worker did not start: {f.read()[-3000:]}")
    return WorkerProcess(proc, found["address"], found.get("health"), found.get("metrics"),
                         log_path)


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    """Workers a test starts (append to it); each is stopped and must exit 0."""
    started: list[WorkerProcess] = []
    yield started
    codes = [w.stop() for w in started]
    assert codes == [0] * len(started)


def _health(address: str) -> tuple[grpc.Channel, health_pb2_grpc.HealthStub]:
    channel = grpc.insecure_channel(address)
    return channel, health_pb2_grpc.HealthStub(channel)


def _check(stub: health_pb2_grpc.HealthStub, service: str = "",
           metadata: tuple[tuple[str, str], ...] = ()) -> int:
    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=20,
                       metadata=metadata)
    return int(reply.status)


# ---------------------------------------------------------------------------------------------
# Without credentials configured


def test_health_serving_on_the_worker_port(workers: list[WorkerProcess]) -> None:
    workers.append(w := start_worker())
    channel, stub = _health(w.address)
    with channel:
        assert _check(stub) == SERVING
        assert _check(stub, WORKER_SERVICE) == SERVING
        statuses = stub.List(health_pb2.HealthListRequest(), timeout=20).statuses
        assert {k: v.status for k, v in statuses.items()} == {"": SERVING,
                                                              WORKER_SERVICE: SERVING}
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=60)
        assert next(watch).status == SERVING
        watch.cancel()


def test_error_health_of_an_unknown_service_is_not_found(workers: list[WorkerProcess]) -> None:
    workers.append(w := start_worker())
    channel, stub = _health(w.address)
    with channel, pytest.raises(grpc.RpcError) as err:
        _check(stub, "jaxdist.v1.NoSuchService")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


# ---------------------------------------------------------------------------------------------
# With a token: health checks need none, everything else does


def test_health_needs_no_token_other_calls_do(workers: list[WorkerProcess],
                                              pki: types.SimpleNamespace) -> None:
    workers.append(w := start_worker("--token-file", pki.token))
    channel, stub = _health(w.address)
    with channel:
        assert _check(stub) == SERVING  # no token, as the kubelet and grpc_health_probe send
        assert _check(stub, WORKER_SERVICE) == SERVING
        assert _check(stub, metadata=(("authorization", "Bearer wrong"),)) == SERVING
        statuses = stub.List(health_pb2.HealthListRequest(), timeout=20).statuses
        assert statuses[""].status == SERVING

        worker = pb_grpc.WorkerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            worker.Info(pb.InfoRequest(), timeout=20)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "missing credentials" in (err.value.details() or "")
        assert worker.Info(pb.InfoRequest(), timeout=20, metadata=BEARER).address == w.address

        # Watch holds a call open: it needs the token, so callers without it can hold nothing.
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=20))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60,
                           metadata=BEARER)
        assert next(watch).status == SERVING
        watch.cancel()
    assert TOKENLESS_METHODS == {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/List"}


def test_health_port_serves_health_alone_without_credentials(
        workers: list[WorkerProcess], pki: types.SimpleNamespace) -> None:
    """Mutual TLS and a token on the worker port; --health-listen answers a plaintext probe."""
    workers.append(w := start_worker("--health-listen", "127.0.0.1:0", "--token-file", pki.token,
                                     "--tls-cert", pki.cert, "--tls-key", pki.key,
                                     "--tls-ca", pki.ca))
    assert w.health is not None and w.health != w.address
    channel, stub = _health(w.health)
    with channel:
        assert _check(stub) == SERVING
        assert _check(stub, WORKER_SERVICE) == SERVING
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        assert next(watch).status == SERVING
        watch.cancel()
        with pytest.raises(grpc.RpcError) as err:  # requests are small there
            _check(stub, "x" * 5000)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as err:  # nothing but health on that port
            pb_grpc.WorkerStub(channel).Info(pb.InfoRequest(), timeout=20, metadata=BEARER)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # The worker port itself: a plaintext probe fails the TLS handshake ...
    channel, stub = _health(w.address)
    with channel, pytest.raises(grpc.RpcError) as err:
        _check(stub)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # ... and a probe with the client certificate gets its answer without the token.
    auth = client_auth(tls_cert=pki.cert, tls_key=pki.key, tls_ca=pki.ca)
    assert auth.credentials is not None
    with grpc.secure_channel(w.address, auth.credentials) as channel:
        assert _check(health_pb2_grpc.HealthStub(channel)) == SERVING


def test_error_health_listen_flag() -> None:
    proc = subprocess.run([sys.executable, "-m", "jaxdist.worker", "--health-listen", "9100"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert ("argument --health-listen: expected HOST:PORT such as 127.0.0.1:9100, found "
            "'9100'") in proc.stderr


# ---------------------------------------------------------------------------------------------
# The life cycle: NOT_SERVING until ready, SERVING, NOT_SERVING once a drain begins


def test_not_serving_at_the_start_of_a_sigterm_drain(pki: types.SimpleNamespace) -> None:
    """Watchers on both ports see SERVING, then NOT_SERVING once SIGTERM starts the drain;
    the worker exits 0. The main port's watch stays open through the server's grace period,
    so the transition is seen before either port goes away."""
    w = start_worker("--health-listen", "127.0.0.1:0", "--token-file", pki.token)
    assert w.health is not None
    main_channel, main = _health(w.address)
    side_channel, side = _health(w.health)
    try:
        request = health_pb2.HealthCheckRequest(service=WORKER_SERVICE)
        watches = [main.Watch(request, timeout=90, metadata=BEARER),
                   side.Watch(request, timeout=90)]
        assert [next(s).status for s in watches] == [SERVING, SERVING]
        w.process.send_signal(signal.SIGTERM)
        assert [next(s).status for s in watches] == [NOT_SERVING, NOT_SERVING]
        assert w.process.wait(timeout=60) == 0
    finally:
        main_channel.close()
        side_channel.close()
        if w.process.poll() is None:
            w.process.kill()


def test_status_follows_the_life_cycle(tmp_path: pathlib.Path) -> None:
    """In one process, where each step is in the test's hands: NOT_SERVING until set_serving,
    NOT_SERVING for good from the start of drain."""
    from jaxdist.worker.config import WorkerConfig
    from jaxdist.worker.server import create_server

    server, servicer, address = create_server(
        "127.0.0.1:0", WorkerConfig(artifact_cache=str(tmp_path), session_idle_timeout=0))
    channel, stub = _health(address)
    try:
        assert [_check(stub), _check(stub, WORKER_SERVICE)] == [NOT_SERVING, NOT_SERVING]
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        assert next(watch).status == NOT_SERVING
        servicer.health.set_serving()
        assert next(watch).status == SERVING
        assert [_check(stub), _check(stub, WORKER_SERVICE)] == [SERVING, SERVING]
        assert servicer.drain(timeout=5)
        assert next(watch).status == NOT_SERVING
        servicer.health.set_serving()  # too late: a drain has begun
        assert [_check(stub), _check(stub, WORKER_SERVICE)] == [NOT_SERVING, NOT_SERVING]
        watch.cancel()
    finally:
        channel.close()
        server.stop(grace=0).wait(10)
        servicer.close()


def test_error_health_port_in_use(workers: list[WorkerProcess]) -> None:
    workers.append(w := start_worker("--health-listen", "127.0.0.1:0"))
    assert w.health is not None
    proc = subprocess.run([sys.executable, "-m", "jaxdist.worker", "--listen", "127.0.0.1:0",
                           "--health-listen", w.health], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2
    assert f"cannot listen on {w.health} (--health-listen): " in proc.stderr


# ---------------------------------------------------------------------------------------------
# A shutdown that cannot hang, and stacks on demand


def test_sigusr1_prints_every_threads_stack_and_the_worker_serves_on(
        workers: list[WorkerProcess]) -> None:
    workers.append(w := start_worker())
    w.process.send_signal(signal.SIGUSR1)
    channel, stub = _health(w.address)
    with channel:
        assert _check(stub) == SERVING  # the dump happened in the handler, before this reply
    with open(w.log_path) as f:
        log = f.read()
    assert "(most recent call first):" in log  # faulthandler's heading, once per thread
    assert "threading.py" in log  # the frames of the waiting threads


def test_sigterm_at_once_after_ready_is_not_lost(workers: list[WorkerProcess]) -> None:
    """The signal arrives as soon as the ready line is read: it exits 0 (``workers`` checks)."""
    workers.append(start_worker())


def test_a_stuck_shutdown_prints_stacks_and_exits_1() -> None:
    """The watchdog armed at SIGTERM ends a process whose shutdown is stuck (here: a main
    thread that waits forever) with every thread's stack and exit status 1."""
    code = ("import threading\n"
            "from jaxdist.worker.__main__ import _arm_shutdown_watchdog\n"
            "_arm_shutdown_watchdog(0.5)\n"
            "threading.Event().wait()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 1
    assert "shutdown did not finish within 0.5 s of the signal" in proc.stderr
    assert 'File "<string>", line 4' in proc.stderr  # the stuck main thread, named
