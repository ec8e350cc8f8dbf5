"""The worker's limits: each one exceeded gets RESOURCE_EXHAUSTED with a message naming the flag,
its value and what was asked for, and the same worker then still serves a correct request.

Real worker processes on loopback, each started with small limits through ``extra_args``. Unary
calls go through a raw stub (to see the real status code); frame failures come back through the
deployed ``Pipeline`` as ``RemoteStageError`` carrying the worker's status in ``code``. The
``SessionStore`` tests at the end run without a worker, on a fake clock.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from models import D, accumulator, mlp, mlp_reference

from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.spawn import spawn_workers, stop_workers
from jaxdist.core import artifacts
from jaxdist.core.errors import LimitError, RemoteStageError, SessionError
from jaxdist.core.sessions import SessionStore
from jaxdist.export.model import Model, Unit
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.proto import jaxdist_pb2_grpc as pb_grpc

ARTIFACT_LIMIT = 64 << 10
FRAME_LIMIT = 64 << 10
TENSORS_LIMIT = 2
SESSIONS_LIMIT = 2
KV_LIMIT = 5000  # bytes: two sessions of accumulator(256) on one stage (2 x 2048), not three
LIMITS = ["--max-artifact-bytes", "64KiB", "--max-frame-bytes", "64KiB",
          "--max-tensors-per-frame", str(TENSORS_LIMIT), "--max-kv-bytes", "0"]


def _sum_of(n: int) -> Model:
    """A model with ``n`` inputs ``x0 .. x{n-1}`` of shape ``(b, m)``, returning their sum."""
    def fn(params, state, carry):
        return {"y": sum(carry[f"x{i}"] for i in range(n))}, {}
    return Model(f"sum{n}", [Unit("sum", fn)],
                 inputs={f"x{i}": ("b, m", "float32") for i in range(n)})


class Served:
    """A worker with small limits, and the MLP pipeline that checks it still serves."""

    def __init__(self, worker, cluster: Cluster, root) -> None:
        self.worker = worker
        self.cluster = cluster
        self.root = root
        self.mlp = cluster.deploy(mlp(), stages=1)
        self.channel = grpc.insecure_channel(worker.address)
        self.stub = pb_grpc.WorkerStub(self.channel)

    def check_serves(self) -> None:
        x = np.random.default_rng(3).standard_normal((4, D)).astype(np.float32)
        out = self.mlp.call(x=x, timeout=60)
        np.testing.assert_allclose(out["x"], mlp_reference(self.root, x), rtol=1e-5, atol=1e-6)
        assert self.worker.alive()


def _spawn(root, extra_args: list[str], max_sessions: int = 64) -> tuple[object, Cluster]:
    (worker,) = spawn_workers(1, weights_roots=[str(root)], max_sessions=max_sessions,
                              extra_args=extra_args)
    return worker, Cluster([worker.address])


@pytest.fixture(scope="module")
def served(mlp_root):
    worker, cluster = _spawn(mlp_root, LIMITS, max_sessions=SESSIONS_LIMIT)
    env = Served(worker, cluster, mlp_root)
    try:
        yield env
    finally:
        env.mlp.close()
        env.channel.close()
        cluster.close()
        stop_workers([worker])


def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


# -- artifacts --------------------------------------------------------------------------------


def test_error_artifact_declared_over_limit(served):
    data = b"\0" * 16
    digest = artifacts.digest_of(data)
    code, msg = _status(lambda: served.stub.UploadArtifact(iter([pb.ArtifactChunk(
        digest=digest, data=data, total_bytes=ARTIFACT_LIMIT + 1)]), timeout=30))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert msg == (f"artifact {digest} is {ARTIFACT_LIMIT + 1} bytes, over the artifact size "
                   f"limit of {ARTIFACT_LIMIT} (--max-artifact-bytes)")
    served.check_serves()


def test_error_artifact_sent_over_limit(served):
    # The first chunk declares a small total; the bytes that follow are counted all the same.
    data = b"\1" * (ARTIFACT_LIMIT // 2)
    digest = artifacts.digest_of(data * 3)
    code, msg = _status(lambda: served.stub.UploadArtifact(iter([pb.ArtifactChunk(
        digest=digest, data=data, total_bytes=10)] + [pb.ArtifactChunk(data=data)] * 2),
        timeout=30))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert msg == (f"artifact {digest} exceeds the artifact size limit of {ARTIFACT_LIMIT} "
                   f"bytes (--max-artifact-bytes): {3 * len(data)} bytes received so far")
    served.check_serves()


def test_error_artifact_inline_over_limit(served):
    spec = served.mlp.specs[0].replace(artifact=b"\0" * (ARTIFACT_LIMIT + 1),
                                       stage_id="inline/0")
    code, msg = _status(lambda: served.stub.LoadStage(pb.LoadStageRequest(
        spec=spec.to_proto(), pipeline_id="inline"), timeout=60))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert re.fullmatch(rf"artifact sha256:[0-9a-f]{{64}} inlined in the spec of stage inline/0 "
                        rf"is {ARTIFACT_LIMIT + 1} bytes, over the artifact size limit "
                        rf"\(--max-artifact-bytes={ARTIFACT_LIMIT}\)", msg), msg
    served.check_serves()


# -- ids --------------------------------------------------------------------------------------


def test_error_ids_over_limit(served):
    """An id over --max-id-bytes (256 by default) is refused before the worker keeps or logs
    it: before, a 130 MiB pipeline id made Info fail for every client until it was unloaded."""
    long = "p" * 300
    spec = served.mlp.specs[0].replace(stage_id=f"{long}/0")
    code, msg = _status(lambda: served.stub.LoadStage(pb.LoadStageRequest(
        spec=spec.to_proto(), pipeline_id=long), timeout=60))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert msg == (f"LoadStage: pipeline_id is 300 bytes, over the id length limit "
                   f"(--max-id-bytes=256); it starts {'p' * 40!r}")
    code, msg = _status(lambda: next(iter(served.stub.Subscribe(pb.SubscribeRequest(
        pipeline_id="x", reply_to="r" * 1000), timeout=30))))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert msg.startswith("Subscribe: reply_to is 1000 bytes, over the id length limit")
    code, msg = _status(lambda: served.stub.EndSession(pb.EndSessionRequest(
        pipeline_id="x", session_id="é" * 200), timeout=30))  # 400 bytes in UTF-8
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert msg.startswith("EndSession: session_id is 400 bytes")
    # A frame with a long session id is refused on the caller's subscription.
    pipe = served.mlp
    with pytest.raises(RemoteStageError, match=r"frame: session_id is 257 bytes, over the id "
                                               r"length limit \(--max-id-bytes=256\)"):
        pipe.submit({"x": np.zeros((4, D), np.float32)}, session_id="s" * 257).result(60)
    assert all(len(st.pipeline_id) <= 256 for st in served.stub.Info(pb.InfoRequest()).stages)
    served.check_serves()


def test_error_compiled_shapes_over_limit(mlp_root):
    """Each new batch size compiles a new executable, cached until unload (+214 MB and 8 s of
    CPU for 120 of them): a stage compiles at most --max-compiled-shapes, its buckets included."""
    worker, cluster = _spawn(mlp_root, ["--max-compiled-shapes", "2"])
    try:
        with cluster.deploy(mlp(), stages=1) as pipe:  # its bucket, b=4, is shape 1
            x = np.random.default_rng(4).standard_normal((5, D)).astype(np.float32)
            np.testing.assert_allclose(pipe.call(x=x[:3], timeout=60)["x"],
                                       mlp_reference(mlp_root, x[:3]), rtol=1e-5, atol=1e-6)
            with pytest.raises(RemoteStageError) as err:  # a third shape
                pipe.call(x=x, timeout=60)
            assert err.value.code == "RESOURCE_EXHAUSTED"
            assert (f"stage 0: input shapes (({5}, {D}),) would be compiled shapes number 3, "
                    f"over the limit of the worker (--max-compiled-shapes=2)") in err.value.message
            for b in (4, 3):  # the compiled shapes still run
                np.testing.assert_allclose(pipe.call(x=x[:b], timeout=60)["x"],
                                           mlp_reference(mlp_root, x[:b]), rtol=1e-5, atol=1e-6)
            with pytest.raises(LimitError, match=r"has 3 buckets to compile, over the limit of "
                                                 r"this worker \(--max-compiled-shapes=2\)"):
                cluster.deploy(Model("three", mlp().units,
                                     inputs={"x": (f"b, {D}", "float32")},
                                     buckets=[{"b": 1}, {"b": 2}, {"b": 4}]), stages=1)
    finally:
        cluster.close()
        stop_workers([worker])


# -- frames -----------------------------------------------------------------------------------


def test_error_frame_bytes_over_limit(served):
    # Two tensors of 40 KB: each is under the 64 KiB limit, the frame is not.
    x = np.ones((1, 10_000), np.float32)
    with served.cluster.deploy(_sum_of(2), stages=1) as pipe:
        with pytest.raises(RemoteStageError) as err:
            pipe.call(x0=x, x1=x, timeout=60)
        e = err.value
        assert e.code == "RESOURCE_EXHAUSTED" and e.remote_type == "LimitError"
        assert e.stage == 0 and e.address == served.worker.address
        assert (f"frame of session '' step 0 is over the frame size limit "
                f"(--max-frame-bytes={FRAME_LIMIT}): 80000 bytes of tensor data so far"
                in e.message), e.message
        np.testing.assert_array_equal(pipe.call(x0=x[:, :100], x1=x[:, :100])["y"], 2 * x[:, :100])
    served.check_serves()


def test_error_tensors_per_frame_over_limit(served):
    x = np.ones((1, 4), np.float32)
    with served.cluster.deploy(_sum_of(TENSORS_LIMIT + 1), stages=1) as pipe:
        with pytest.raises(RemoteStageError) as err:
            pipe.call({f"x{i}": x for i in range(TENSORS_LIMIT + 1)}, timeout=60)
        e = err.value
        assert e.code == "RESOURCE_EXHAUSTED" and e.remote_type == "LimitError"
        assert f"more than {TENSORS_LIMIT} tensors in one frame" in e.message, e.message
        assert f"--max-tensors-per-frame={TENSORS_LIMIT}" in e.message, e.message
    with served.cluster.deploy(_sum_of(TENSORS_LIMIT), stages=1) as pipe:
        out = pipe.call({f"x{i}": x for i in range(TENSORS_LIMIT)}, timeout=60)
        np.testing.assert_array_equal(out["y"], TENSORS_LIMIT * x)
    served.check_serves()


# -- sessions ---------------------------------------------------------------------------------


def test_error_sessions_over_limit(served):
    one = np.ones((1, 4), np.float32)
    with served.cluster.deploy(accumulator(), stages=1) as pipe:
        for sid in ("s1", "s2"):
            pipe.call(x=one, session_id=sid, step=0, timeout=60)
        with pytest.raises(RemoteStageError) as err:
            pipe.call(x=one, session_id="s3", step=0, timeout=60)
        e = err.value
        assert e.code == "RESOURCE_EXHAUSTED" and e.remote_type == "LimitError"
        assert re.search(rf"session 's3' on stage acc-[0-9a-f]+/0 refused: this worker holds "
                         rf"{SESSIONS_LIMIT} sessions, the limit \(--max-sessions="
                         rf"{SESSIONS_LIMIT}\)", e.message), e.message
        # Nothing was evicted: s1 goes on from its own state (the first unit's sums are 1, 2;
        # the second unit's running total of them is 1 + 2).
        out = pipe.call(x=one, session_id="s1", step=1, timeout=60)
        np.testing.assert_array_equal(out["total"], np.full((4,), 3.0, np.float32))
        pipe.end_session("s2")
        pipe.call(x=one, session_id="s3", step=0, timeout=60)  # room again
    served.check_serves()


@pytest.fixture(scope="module")
def kv_worker(mlp_root):
    worker, cluster = _spawn(mlp_root, ["--max-kv-bytes", str(KV_LIMIT)])
    env = Served(worker, cluster, mlp_root)
    try:
        yield env
    finally:
        env.mlp.close()
        env.channel.close()
        cluster.close()
        stop_workers([worker])


def test_error_kv_bytes_over_limit(kv_worker):
    x = np.ones((1, 256), np.float32)
    with kv_worker.cluster.deploy(accumulator(256), stages=1) as pipe:
        assert pipe.specs[0].state_bytes == 2048  # two (256,) float32 sums
        pipe.call(x=x, session_id="a", step=0, timeout=60)
        pipe.call(x=x, session_id="b", step=0, timeout=60)
        with pytest.raises(RemoteStageError) as err:
            pipe.call(x=x, session_id="c", step=0, timeout=60)
        e = err.value
        assert e.code == "RESOURCE_EXHAUSTED" and e.remote_type == "LimitError"
        assert re.search(r"session 'c' on stage acc-[0-9a-f]+/0 refused: it needs 2048 bytes "
                         r"\(0\.0 MiB\) of state, and this worker holds 4096 bytes \(0\.0 MiB\) "
                         r"in 2 sessions, so 6144 bytes would cross the limit "
                         rf"\(--max-kv-bytes={KV_LIMIT}, ", e.message), e.message
        assert pipe.end_session("a") == 2048
        pipe.call(x=x, session_id="c", step=0, timeout=60)
        pipe.call(x=x, session_id="b", step=1, timeout=60)
    kv_worker.check_serves()


def test_idle_session_is_reclaimed_and_says_so(mlp_root):
    worker, cluster = _spawn(mlp_root, ["--session-idle-timeout", "1"])
    one = np.ones((1, 4), np.float32)
    try:
        with cluster.deploy(accumulator(), stages=1) as pipe:
            pipe.call(x=one, session_id="idle", step=0, timeout=60)
            deadline = time.monotonic() + 60  # the reaper runs every 0.25 s; generous
            while cluster.info()[0].sessions and time.monotonic() < deadline:
                time.sleep(0.2)
            assert cluster.info()[0].sessions == 0
            with pytest.raises(RemoteStageError) as err:
                pipe.call(x=one, session_id="idle", step=1, timeout=60)
            e = err.value
            assert e.remote_type == "SessionError" and e.code == "FAILED_PRECONDITION"
            assert re.search(r"session 'idle' on stage acc-[0-9a-f]+/0 was reclaimed after "
                             r"[0-9]+ s without a step \(--session-idle-timeout=1\); start it "
                             r"again from step 0", e.message), e.message
            out = pipe.call(x=one, session_id="again", step=0, timeout=60)
            np.testing.assert_array_equal(out["total"], np.ones((4,), np.float32))
        with open(worker.log_path) as f:
            assert re.search(r"reclaimed session 'idle' on stage acc-[0-9a-f]+/0: idle [0-9]+ s, "
                             r"over --session-idle-timeout=1; freed 32 bytes", f.read())
    finally:
        cluster.close()
        stop_workers([worker])


def test_error_bad_limit_flag_values():
    for args, text in ((["--max-frame-bytes", "12X"], "expected a size in bytes"),
                       (["--max-sessions", "0"], "--max-sessions must be >= 1, got 0"),
                       (["--max-artifact-bytes", "2M", "--max-artifact-cache-bytes", "1M"],
                        "--max-artifact-cache-bytes (1000000) must be 0 (no bound) or >= "
                        "--max-artifact-bytes (2000000)")):
        proc = subprocess.run([sys.executable, "-m", "jaxdist.worker", "--listen",
                               "127.0.0.1:0", *args], capture_output=True, text=True,
                              timeout=120, check=False)
        assert proc.returncode == 2 and text in proc.stderr, proc.stderr


# -- the session store on its own (fake clock) ------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_store_refuses_over_limits_without_evicting():
    store = SessionStore(2, max_kv_bytes=250, clock=Clock())
    store.open("st", "a", 100)
    store.open("st", "b", 100)
    with pytest.raises(LimitError, match=r"holds 2 sessions, the limit \(--max-sessions=2\)"):
        store.open("st", "c", 10)
    store.end("b")
    with pytest.raises(LimitError, match=r"it needs 200 bytes .* holds 100 bytes .* in 1 "
                                         r"sessions, so 300 bytes would cross the limit "
                                         r"\(--max-kv-bytes=250"):
        store.open("st", "c", 200)
    assert (len(store), store.nbytes) == (1, 100)
    store.take("st", "a", 0)  # still there, at its first step


def test_store_reclaims_idle_sessions_and_remembers_why():
    clock = Clock()
    store = SessionStore(4, idle_timeout=10, clock=clock)
    store.open("st", "old", 8).step = 0
    clock.now += 6
    store.open("st", "new", 8).step = 0
    clock.now += 6
    assert store.reclaim_idle() == [("st", "old")]
    assert (len(store), store.nbytes) == (1, 8)
    with pytest.raises(SessionError, match=r"^session 'old' on stage st was reclaimed after 12 s "
                                           r"without a step \(--session-idle-timeout=10\); start "
                                           r"it again from step 0"):
        store.take("st", "old", 1)
    store.take("st", "new", 1)  # a step keeps a session alive
    clock.now += 9
    assert store.reclaim_idle() == []


def test_store_remembers_lost_and_dropped_sessions():
    store = SessionStore(4, clock=Clock())
    store.open("st", "a", 8).step = 0
    store.open("st", "b", 8).step = 0
    store.lose("st", "a", "was lost: step 1 failed")
    with pytest.raises(SessionError, match="^session 'a' on stage st was lost: step 1 failed"):
        store.take("st", "a", 1)
    assert store.drop_stage("st") == 1
    with pytest.raises(SessionError, match="was dropped when stage st was unloaded or replaced"):
        store.take("st", "b", 1)
    with pytest.raises(SessionError, match="^unknown session 'z'"):
        store.take("st", "z", 1)
    assert store.nbytes == 0
