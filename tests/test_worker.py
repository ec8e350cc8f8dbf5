"""The gRPC worker and the coordinator, with real worker processes on loopback."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from faults import frozen
from models import D, accumulator, identity, mlp, mlp_reference

from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.spawn import spawn_workers, stop_workers
from jaxdist.core import artifacts
from jaxdist.core.errors import (
    ArtifactError,
    RemoteStageError,
    SpecError,
    TransportError,
    WeightError,
)
from jaxdist.core.spec import SPEC_VERSION, StageSpec, TensorSig
from jaxdist.core.transport.client import WorkerClient
from jaxdist.export.model import Model, Param, Unit

RNG = np.random.default_rng(7)


def _x(b: int = 4) -> np.ndarray:
    return RNG.standard_normal((b, D)).astype(np.float32)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_pipeline_matches_single_process(cluster3, mlp_root, stages):
    with cluster3.deploy(mlp(), stages=stages) as pipe:
        assert len(pipe.specs) == stages
        assert len({c.address for c in pipe.clients}) == stages  # one worker per stage
        for b in (4, 3):  # a bucket shape and one compiled on demand
            x = _x(b)
            out = pipe.call(x=x)
            np.testing.assert_allclose(out["x"], mlp_reference(mlp_root, x), rtol=1e-5, atol=1e-6)


def test_stream_microbatches_in_order(cluster3, mlp_root):
    xs = [_x() for _ in range(12)]
    with cluster3.deploy(mlp(), stages=3) as pipe:
        outs = list(pipe.stream([{"x": x} for x in xs], depth=6))
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(out["x"], mlp_reference(mlp_root, x), rtol=1e-5, atol=1e-6)


def test_explicit_split_and_balance(cluster3):
    with cluster3.deploy(mlp(), split=[1, 3]) as pipe:
        assert [len(s.weights) for s in pipe.specs] == [1, 3]
        assert pipe.specs[0].next_hop == pipe.clients[1].address
        assert pipe.specs[1].next_hop == ""
    with cluster3.deploy(mlp(), stages=2) as pipe:
        assert [len(s.weights) for s in pipe.specs] == [2, 2]


def test_large_activation_over_4mib(cluster3):
    x = RNG.standard_normal((3, 1 << 19)).astype(np.float32)  # 6 MiB, chunked on the wire
    with cluster3.deploy(identity(2), stages=2) as pipe:
        out = pipe.call(x=x)
    np.testing.assert_array_equal(out["x"], x)


def _acc_reference(steps: list[np.ndarray]) -> np.ndarray:
    a = np.zeros(steps[0].shape[1], np.float32)
    b = np.zeros_like(a)
    for x in steps:
        a = a + x.sum(axis=0)
        b = b + a
    return b


def test_concurrent_sessions_keep_their_own_state(cluster3):
    with cluster3.deploy(accumulator(), stages=2) as pipe:
        def run(seed: int) -> tuple[list[np.ndarray], np.ndarray]:
            rng = np.random.default_rng(seed)
            steps = [rng.standard_normal((2, 4)).astype(np.float32) for _ in range(6)]
            with pipe.session(f"s{seed}") as sess:
                out = None
                for x in steps:
                    out = sess(x=x)
            return steps, out["total"]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(run, range(4)))
    for steps, total in results:
        np.testing.assert_allclose(total, _acc_reference(steps), rtol=1e-5)


def test_end_session_frees_state(cluster3):
    with cluster3.deploy(accumulator(), stages=2) as pipe:
        sess = pipe.session("ending")
        sess(x=np.ones((1, 4), np.float32))
        infos = {i.address: i for i in cluster3.info()}
        assert sum(s.sessions for a in infos.values() for s in a.stages
                   if s.pipeline_id == pipe.pipeline_id) == 2
        assert pipe.end_session("ending") == 2 * 4 * 4  # two (4,) float32 states
        with pytest.raises(RemoteStageError, match="unknown session 'ending'") as err:
            pipe.call(x=np.ones((1, 4), np.float32), session_id="ending", step=1)
        assert err.value.stage == 0


def test_session_limit_in_a_later_stage_reaches_the_caller(mlp_root):
    # Stage 1's worker holds one session only, so a second session is refused there; the first
    # keeps its state (nothing is evicted).
    workers = spawn_workers(1, max_sessions=8) + spawn_workers(1, max_sessions=1)
    cluster = Cluster([w.address for w in workers])
    try:
        with cluster.deploy(accumulator(), stages=2) as pipe:
            one = np.ones((1, 4), np.float32)
            pipe.call(x=one, session_id="first", step=0)
            with pytest.raises(RemoteStageError) as err:
                pipe.call(x=one, session_id="second", step=0)
            e = err.value
            assert e.stage == 1 and e.address == workers[1].address
            assert e.remote_type == "LimitError" and e.code == "RESOURCE_EXHAUSTED"
            assert "refused" in str(e) and "--max-sessions=1" in str(e)
            assert "Traceback" in e.remote_traceback
            pipe.call(x=one, session_id="first", step=1)  # the first one goes on
    finally:
        cluster.close()
        stop_workers(workers)


def test_error_wrong_shaped_frame_then_worker_keeps_serving(cluster3, mlp_root):
    with cluster3.deploy(mlp(), stages=2) as pipe:
        with pytest.raises(RemoteStageError) as err:
            pipe.call(x=np.zeros((2, D + 1), np.float32))
        assert err.value.stage == 0 and err.value.remote_type == "SpecError"
        assert f"input 'x': expected dims (b, {D}), found (2, {D + 1})" in str(err.value)
        with pytest.raises(RemoteStageError, match="expected dtype float32, found float64"):
            pipe.call(x=np.zeros((2, D)))
        with pytest.raises(RemoteStageError, match=r"expected inputs \['x'\], found \['y'\]"):
            pipe.call(y=np.zeros((2, D), np.float32))
        x = _x()
        np.testing.assert_allclose(pipe.call(x=x)["x"], mlp_reference(mlp_root, x), rtol=1e-5,
                                   atol=1e-6)


def _deployed_spec(pipe) -> StageSpec:
    return pipe.specs[0]


def test_error_malformed_spec_is_invalid_argument(cluster3, mlp_root):
    client = cluster3.clients[0]
    with cluster3.deploy(mlp(), stages=1) as pipe:
        good = _deployed_spec(pipe)
        bad = good.replace(stage_index=3, num_stages=2, stage_id="bad/3")
        with pytest.raises(SpecError, match=r"StageSpec.stage_index: expected 0 <= stage_index"):
            client.load_stage(bad, "bad")
        bad = good.replace(outputs=(TensorSig("x", "float32", ("b", D + 1)),), stage_id="bad/0")
        with pytest.raises(SpecError, match=r"output 'x': the artifact has float32\(b, 32\), the "
                                            r"spec says float32\(b, 33\)"):
            client.load_stage(bad, "bad")
        # The worker still serves the deployed pipeline.
        x = _x()
        np.testing.assert_allclose(pipe.call(x=x)["x"], mlp_reference(mlp_root, x), rtol=1e-5,
                                   atol=1e-6)


def test_error_weight_outside_roots_and_missing_tensor(cluster3, tmp_path):
    outside = Model("outside", [Unit("l0", mlp().units[0].fn, {
        "w": Param(f"safetensors://{tmp_path}/nope.safetensors#w", (D, D))})],
        inputs={"x": (f"b, {D}", "float32")})
    with pytest.raises(WeightError, match="outside the weight roots") as err:
        cluster3.deploy(outside, stages=1)
    assert cluster3.clients[0].address in str(err.value)
    missing = Model("missing", [Unit("l0", mlp().units[0].fn, {
        "w": Param("safetensors://mlp.safetensors#l9.w", (D, D))})],
        inputs={"x": (f"b, {D}", "float32")})
    with pytest.raises(WeightError, match="tensor 'l9.w' not found"):
        cluster3.deploy(missing, stages=1)


def test_error_unsupported_device(cluster3):
    with pytest.raises(Exception) as err:
        cluster3.deploy(mlp(), stages=1, device="tpu")
    assert type(err.value).__name__ == "DeviceError"
    assert "tpu" in str(err.value) and "cpu" in str(err.value)


def test_artifact_upload_skipped_when_present_and_load_idempotent(cluster3):
    client = cluster3.clients[0]
    with cluster3.deploy(mlp(), stages=1) as pipe:
        spec = pipe.specs[0]
        assert client.has_artifact(spec.artifact_digest)
        reply = client.load_stage(spec, pipe.pipeline_id, key=pipe.key)
        assert reply.already_loaded
    assert not client.has_artifact("sha256:" + "0" * 64)


def test_error_upload_digest_mismatch(cluster3):
    client = cluster3.clients[0]
    with pytest.raises(ArtifactError, match="does not match its digest"):
        client.upload_artifact("sha256:" + "1" * 64, b"not an artifact")


def test_error_load_without_artifact(cluster3):
    client = cluster3.clients[0]
    art = artifacts.export_stage(lambda p, s, x: ({"y": x["x"] * 3}, {}), params={},
                                 inputs={"x": ("b", "float32")}, platforms=("cpu",))
    spec = StageSpec(artifact_digest=art.digest, inputs=(TensorSig("x", "float32", ("b",)),),
                     outputs=(TensorSig("y", "float32", ("b",)),), stage_id="noart/0")
    if not client.has_artifact(art.digest):
        with pytest.raises(ArtifactError, match="not in this worker's cache; upload it first"):
            client.load_stage(spec, "noart")
    reply = client.load_stage(spec.replace(artifact=art.data), "noart")
    assert not reply.already_loaded
    assert client.unload_stage("noart/0")


def test_describe_weights_and_info(cluster3):
    client = cluster3.clients[1]
    tensors, _meta = client.describe_weights("mlp.safetensors")
    assert {t.name: tuple(t.shape) for t in tensors} == {f"l{i}.w": (D, D) for i in range(4)}
    info = client.info()
    assert info.address == client.address
    assert info.default_device == "cpu:0"
    assert info.devices[0].platform == "cpu"
    assert info.versions.jax and info.versions.spec == SPEC_VERSION
    assert info.rss_bytes > 0 and info.max_sessions == 8


def test_error_garbage_bytes_on_the_port(cluster3, mlp_root):
    host, port = cluster3.clients[2].address.rsplit(":", 1)
    for payload in (os.urandom(4096), b"GET / HTTP/1.1\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                    + os.urandom(512)):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(2)
            try:
                s.recv(1024)
            except (TimeoutError, ConnectionResetError):
                pass
    x = _x()
    with cluster3.deploy(mlp(), stages=3) as pipe:
        np.testing.assert_allclose(pipe.call(x=x)["x"], mlp_reference(mlp_root, x), rtol=1e-5,
                                   atol=1e-6)


def test_error_connect_to_nothing():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransportError, match=f"worker 127.0.0.1:{port} is not reachable"):
        Cluster.connect([f"127.0.0.1:{port}"], wait=1)


def test_killed_worker_mid_stream_names_the_worker(mlp_root):
    with Cluster.local(2, weights_roots=[str(mlp_root)], heartbeat_timeout=5) as cluster:
        victim = cluster.local_workers[1]
        with cluster.deploy(mlp(), stages=2) as pipe:
            pipe.call(x=_x())
            stop = threading.Event()
            errors: list[BaseException] = []

            def pump() -> None:
                while not stop.is_set():
                    try:
                        pipe.call(x=_x(), timeout=30)
                    except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                        errors.append(exc)
                        return

            t = threading.Thread(target=pump)
            t.start()
            time.sleep(0.3)
            victim.process.send_signal(signal.SIGKILL)
            t.join(timeout=30)
            stop.set()
            assert not t.is_alive(), "the caller hung after a worker died"
            assert errors and isinstance(errors[0], RemoteStageError)
            assert errors[0].address == victim.address and errors[0].stage == 1
            with pytest.raises(RemoteStageError, match=victim.address):
                pipe.call(x=_x())


def test_frozen_worker_gives_a_deadline_error(mlp_root):
    with Cluster.local(2, weights_roots=[str(mlp_root)], heartbeat_timeout=4) as cluster:
        victim = cluster.local_workers[0]
        with cluster.deploy(mlp(), stages=2) as pipe:
            pipe.call(x=_x())
            with frozen(victim.process):
                fut = pipe.submit({"x": _x()})
                with pytest.raises(RemoteStageError, match="no heartbeat") as err:
                    fut.result(timeout=30)
                assert err.value.address == victim.address


def test_sigterm_exits_zero():
    (w,) = spawn_workers(1)
    client = WorkerClient(w.address)
    client.info()
    w.process.send_signal(signal.SIGTERM)
    assert w.process.wait(timeout=90) == 0
    client.close()


def test_worker_cli_rejects_bad_listen_address():
    proc = subprocess.run([sys.executable, "-m", "jaxdist.worker", "--listen", "nonsense"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--listen expects HOST:PORT, found 'nonsense'" in proc.stderr


@pytest.mark.parametrize("listen", ["127.0.0.1:\u00b2", "127.0.0.1:\u0665\u0660", "127.0.0.1:",
                                    ":5000", "127.0.0.1:123456"])
def test_create_server_rejects_bad_listen_before_binding(listen):
    from jaxdist.worker.config import WorkerConfig
    from jaxdist.worker.server import create_server

    with pytest.raises(TransportError, match="--listen expects HOST:PORT"):
        create_server(listen, WorkerConfig())
