"""The worker's limits: each one exceeded gets RESOURCE_EXHAUSTED with a message naming the flag,
its value and what was asked for, and the same worker then still serves a correct request.

Real worker processes on loopback, each started with small limits through ``extra_args``. Unary
calls go through a raw stub (to see the real status code); frame failures come back through the
deployed ``Pipeline`` as ``RemoteStageError`` carrying the worker's status in ``code``. The
``SessionStore`` tests at the end run without a worker, on a fake clock.
"""

from __future__ import annotations

import dataclasses
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
from jaxdist.export.stages import build_stage_specs
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


# -- shapes -----------------------------------------------------------------------------------


def _rows(b: int) -> np.ndarray:
    return np.random.default_rng(b).standard_normal((b, D)).astype(np.float32)


def test_error_frame_outside_buckets(served):
    """A spec with buckets takes their shapes only: a frame of another shape is refused before
    anything compiles (a flood of distinct batch sizes compiled and kept 120 executables), and
    the same pipeline, session included, goes on with a frame of a bucket's shape."""
    with served.cluster.deploy(mlp(name="strict", any_shape=False), stages=1) as pipe:
        assert [b.dims for b in pipe.specs[0].buckets] == [{"b": 4}]
        assert not pipe.specs[0].any_shape
        with pytest.raises(RemoteStageError) as err:
            pipe.call(x=_rows(3), timeout=60)
        e = err.value
        assert e.code == "INVALID_ARGUMENT" and e.remote_type == "SpecError", e
        assert e.stage == 0 and e.address == served.worker.address
        assert (f"stage 0: input shapes x (3, {D}) (b=3) are in none of its 1 buckets (b=4); "
                f"the spec takes those shapes only (StageSpec.any_shape is false): pad the "
                f"inputs to a bucket") in e.message, e.message
        np.testing.assert_allclose(pipe.call(x=_rows(4), timeout=60)["x"],
                                   mlp_reference(served.root, _rows(4)), rtol=1e-5, atol=1e-6)
    # A session: the refused step leaves its state as it was, and is sent again.
    acc = dataclasses.replace(accumulator(), name="acc-strict", buckets=[{"b": 2}])
    two = np.ones((2, 4), np.float32)
    with served.cluster.deploy(acc, stages=1) as pipe:
        pipe.call(x=two, session_id="s", step=0, timeout=60)
        with pytest.raises(RemoteStageError, match=r"input shapes x \(3, 4\) \(b=3\) are in "
                                                   r"none of its 1 buckets \(b=2\)"):
            pipe.call(x=np.ones((3, 4), np.float32), session_id="s", step=1, timeout=60)
        out = pipe.call(x=two, session_id="s", step=1, timeout=60)
        # The first unit's sums are 2, 4; the second's running total of them is 2 + 4.
        np.testing.assert_array_equal(out["total"], np.full((4,), 6.0, np.float32))
        pipe.end_session("s")
    served.check_serves()


def test_any_shape_and_bucketless_specs_compile_other_shapes(served):
    """``any_shape``, or no buckets at all: a shape no bucket declares is compiled when it
    first comes, as before buckets were binding."""
    lazy = dataclasses.replace(mlp(name="lazy", any_shape=False), buckets=())
    for model in (mlp(name="any", any_shape=True), lazy):
        with served.cluster.deploy(model, stages=1) as pipe:
            assert pipe.specs[0].any_shape == model.any_shape
            assert not pipe.specs[0].strict_shapes
            for b in (3, 5):
                np.testing.assert_allclose(pipe.call(x=_rows(b), timeout=60)["x"],
                                           mlp_reference(served.root, _rows(b)), rtol=1e-5,
                                           atol=1e-6)
    served.check_serves()


SHAPES_LIMIT = 4


@pytest.fixture(scope="module")
def shapes_worker(mlp_root):
    worker, cluster = _spawn(mlp_root, ["--max-compiled-shapes", str(SHAPES_LIMIT)])
    try:
        yield worker, cluster
    finally:
        cluster.close()
        stop_workers([worker])


def test_error_compiled_shapes_over_limit(shapes_worker, mlp_root):
    """Each new batch size compiles a new executable, kept until unload (+214 MB and 8 s of
    CPU for 120 of them): the stages of one pipeline on a worker compile at most
    --max-compiled-shapes together, their buckets included; another pipeline has its own."""
    _, cluster = shapes_worker
    with cluster.deploy(mlp(any_shape=True), stages=2) as pipe:  # both stages on the worker
        assert pipe.clients[0].address == pipe.clients[1].address
        # Each stage's bucket, b=4: shapes 1 and 2 of the pipeline. b=3: 3 and 4.
        for b in (4, 3):
            np.testing.assert_allclose(pipe.call(x=_rows(b), timeout=60)["x"],
                                       mlp_reference(mlp_root, _rows(b)), rtol=1e-5, atol=1e-6)
        with pytest.raises(RemoteStageError) as err:  # each stage holds 2 shapes, under 4
            pipe.call(x=_rows(5), timeout=60)
        e = err.value
        assert e.code == "RESOURCE_EXHAUSTED" and e.remote_type == "LimitError" and e.stage == 0
        assert (f"stage 0 of pipeline {pipe.pipeline_id!r}: input shapes ((5, {D}),) would be "
                f"compiled shape number 5 of the pipeline on this worker, over its limit "
                f"(--max-compiled-shapes={SHAPES_LIMIT}, per pipeline); pad the inputs to a "
                f"shape it has compiled, such as [(({4}, {D}),), (({3}, {D}),)]") in e.message, \
            e.message
        with cluster.deploy(mlp(any_shape=True, name="other"), stages=1) as other:
            for b in (4, 3, 5):  # its own budget: 3 shapes of 4
                np.testing.assert_allclose(other.call(x=_rows(b), timeout=60)["x"],
                                           mlp_reference(mlp_root, _rows(b)), rtol=1e-5,
                                           atol=1e-6)
        for b in (4, 3):  # the compiled shapes still run
            np.testing.assert_allclose(pipe.call(x=_rows(b), timeout=60)["x"],
                                       mlp_reference(mlp_root, _rows(b)), rtol=1e-5, atol=1e-6)
    assert shapes_worker[0].alive()


def test_error_load_stage_buckets_over_pipeline_budget(shapes_worker):
    """A stage whose buckets would take its pipeline past --max-compiled-shapes is refused at
    LoadStage, before it compiles; another pipeline, or the same once a stage is unloaded, has
    room again."""
    worker, _ = shapes_worker
    three = Model("three", mlp().units, inputs={"x": (f"b, {D}", "float32")},
                  buckets=[{"b": 1}, {"b": 2}, {"b": 4}])
    built = build_stage_specs(three, [range(0, 2), range(2, 4)], platforms=("cpu",))
    with grpc.insecure_channel(worker.address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        for b in built:
            art = b.artifact
            stub.UploadArtifact(iter([pb.ArtifactChunk(digest=art.digest, data=art.data,
                                                       total_bytes=len(art.data))]), timeout=60)

        def load(k: int, pipeline: str) -> pb.LoadStageReply:
            spec = built[k].spec.replace(stage_id=f"{pipeline}/{k}")
            return stub.LoadStage(pb.LoadStageRequest(spec=spec.to_proto(),
                                                      pipeline_id=pipeline), timeout=120)

        assert load(0, "p").compile_s > 0  # shapes 1 to 3 of pipeline p
        code, msg = _status(lambda: load(1, "p"))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert msg == (f"LoadStage: stage 1 of pipeline 'p' has 3 buckets to compile, and the "
                       f"pipeline holds 3 compiled shapes on this worker: over its limit "
                       f"(--max-compiled-shapes={SHAPES_LIMIT}, per pipeline)")
        assert {st.stage_id for st in stub.Info(pb.InfoRequest()).stages} >= {"p/0"}
        assert "p/1" not in {st.stage_id for st in stub.Info(pb.InfoRequest()).stages}
        load(1, "q")  # another pipeline: a budget of its own
        assert stub.UnloadStage(pb.UnloadStageRequest(stage_id="p/0"), timeout=60).unloaded
        load(1, "p")  # p's shapes were given back with its stage
        for stage_id in ("p/1", "q/1"):
            stub.UnloadStage(pb.UnloadStageRequest(stage_id=stage_id), timeout=60)
    assert worker.alive()


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
