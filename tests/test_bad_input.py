"""A bad-input matrix against one real worker process: every case is refused with the right gRPC
status and message, and the same worker then still serves a correct request.

One worker is spawned for the module (``max_sessions=4``, so the session limit is reachable) with a weights
root this module writes. Two pipelines are deployed on it: the test MLP (stateless; after every
case it must still compute what numpy computes) and the accumulator (stateful, for the session
cases). Each case is one test id, ``test_error[<case>]``, and asserts:

* the status code and the message (a regex on the details), and for refusals the jaxdist error
  class the worker names (``jaxdist-error-type`` trailing metadata, or ``RemoteError.type``);
* afterwards: the worker process is alive and the MLP pipeline returns numpy's answer.

Unary calls go through raw stubs (``WorkerStub`` on a ``grpc.insecure_channel``) to see the real
status. Frame errors do not fail a call: they come back on a subscription. Frame cases subscribe
themselves (``WorkerClient.subscribe`` with their own ``reply_to``) and push hand-made frames, so
they can send what the coordinator never would, and see the status code in the ``RemoteError``;
where the coordinator *can* send the frame, the case is replayed through the deployed
``Pipeline`` too and must surface as ``RemoteStageError`` with the same class and message, stage 0
and this worker's address.

Limits: these cases run against the ``WorkerConfig`` defaults (256 MiB artifacts, 1 GiB per
tensor, 256 tensors per frame); tests/test_limits.py sets each limit through its worker flag.
Over-limit sizes are *declared* in headers; no case sends gigabytes.

A case that reveals a bug is marked ``xfail(strict=True, raises=CaseMismatch)`` with the bug as
the reason until it is fixed; the health check still runs (and fails the test for real) for it.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from models import D, accumulator, mlp, mlp_reference
from safetensors.numpy import save_file

from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.pipeline import Pipeline
from jaxdist.coordinator.spawn import LocalWorker, spawn_workers, stop_workers
from jaxdist.core import artifacts, protowire
from jaxdist.core.errors import RemoteStageError
from jaxdist.core.spec import ShapeBucket, StageSpec, StateSig, TensorSig
from jaxdist.core.transport.client import WorkerClient
from jaxdist.core.transport.frames import FrameHeader, split_frame
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.proto import jaxdist_pb2_grpc as pb_grpc
from jaxdist.worker.config import WorkerConfig

pytestmark = pytest.mark.timeout(120)

MAX_SESSIONS = 4
LIMITS = WorkerConfig()  # the worker CLI exposes none of these: the defaults apply
RNG = np.random.default_rng(11)
S = grpc.StatusCode


class CaseMismatch(AssertionError):
    """The worker answered a case with another status, error class or message."""


class WorkerUnhealthy(Exception):
    """After a case, the worker died or no longer serves the MLP correctly."""


@dataclass(frozen=True)
class Result:
    """What the worker answered: a status code name, the jaxdist error class, the message."""

    code: str
    type: str
    message: str


# ---------------------------------------------------------------------------------------------
# The worker and its weights


@dataclass
class Env:
    worker: LocalWorker
    root: Path
    outside: Path
    channel: grpc.Channel
    stub: pb_grpc.WorkerStub
    client: WorkerClient
    cluster: Cluster
    mlp: Pipeline
    acc: Pipeline
    artifacts: dict[str, artifacts.Artifact] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.worker.address

    @property
    def good(self) -> StageSpec:
        """The MLP's deployed (valid) spec, re-targeted at the scratch pipeline 'bad'."""
        return self.mlp.specs[0].replace(stage_id="bad/0")


def _write_weights(root: Path, outside: Path) -> None:
    rng = np.random.default_rng(1234)
    save_file({f"l{i}.w": (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)
               for i in range(4)}, str(root / "mlp.safetensors"))
    save_file({"l0.w": np.ones((16, D), np.float32)}, str(root / "other.safetensors"))
    save_file({"i": np.arange(D * D, dtype=np.int64).reshape(D, D)}, str(root / "ints.safetensors"))
    (root / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    (root / "corrupt.gguf").write_bytes(b"NOTG" + bytes(60))
    (root / "raw.bin").write_bytes(bytes(10))
    (root / "notes.txt").write_text("not weights\n")
    head = b'{"__metadata__":["not","an","object"]}'
    (root / "meta-list.safetensors").write_bytes(len(head).to_bytes(8, "little") + head)
    (root / "badcfg").mkdir()
    save_file({"w": np.ones(4, np.float32)}, str(root / "badcfg" / "model.safetensors"))
    (root / "badcfg" / "config.json").write_text("{this is not json")
    save_file({"l0.w": np.ones((D, D), np.float32)}, str(outside / "secret.safetensors"))
    os.symlink(outside / "secret.safetensors", root / "escape.safetensors")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("bad-input-root")
    outside = tmp_path_factory.mktemp("outside-the-roots")
    _write_weights(root, outside)
    (worker,) = spawn_workers(1, weights_roots=[str(root)], max_sessions=MAX_SESSIONS)
    cluster = None
    try:
        # Shared pipelines (no lease, no key: as `jaxdist deploy` loads them), so the raw
        # streams and calls below reach them with the worker token alone.
        cluster = Cluster.connect([worker.address], lease_s=0)
        mlp_pipe = cluster.deploy(mlp(), stages=1)
        acc_pipe = cluster.deploy(accumulator(), stages=1)
        channel = grpc.insecure_channel(worker.address)
        e = Env(worker, root, outside, channel, pb_grpc.WorkerStub(channel),
                WorkerClient(worker.address), cluster, mlp_pipe, acc_pipe)
        assert_healthy(e)
        yield e
        channel.close()
        e.client.close()
    finally:
        if cluster is not None:
            cluster.close()
        stop_workers([worker])


def assert_healthy(env: Env) -> None:
    """The worker is alive and the MLP deployed on it still computes numpy's answer."""
    if not env.worker.alive():
        raise WorkerUnhealthy(f"worker pid {env.worker.pid} died "
                              f"(exit {env.worker.process.poll()})")
    x = RNG.standard_normal((4, D)).astype(np.float32)
    try:
        out = env.mlp.call(x=x, timeout=30)
    except Exception as exc:
        raise WorkerUnhealthy(f"the MLP pipeline failed after the case: {exc!r}") from exc
    try:
        np.testing.assert_allclose(out["x"], mlp_reference(env.root, x), rtol=1e-5, atol=1e-6)
    except AssertionError as exc:
        raise WorkerUnhealthy(f"wrong MLP output after the case: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# Unary calls


def unary(method: Callable[..., Any], request: Any, timeout: float = 60.0) -> Result:
    try:
        reply = method(request, timeout=timeout)
    except grpc.RpcError as exc:
        kind = dict(exc.trailing_metadata() or ()).get("jaxdist-error-type", "")
        return Result(exc.code().name, kind, exc.details() or "")
    return Result("OK", "", str(reply).replace("\n", " "))


def load(env: Env, spec: StageSpec, pipeline: str = "bad") -> Result:
    return unary(env.stub.LoadStage, pb.LoadStageRequest(spec=spec.to_proto(),
                                                          pipeline_id=pipeline))


def load_proto(env: Env, edit: Callable[[pb.StageSpec], None]) -> Result:
    """LoadStage of the good spec with a raw protobuf edit (for values StageSpec cannot hold)."""
    msg = env.good.to_proto()
    edit(msg)
    return unary(env.stub.LoadStage, pb.LoadStageRequest(spec=msg, pipeline_id="bad"))


def load_bytes(env: Env, data: bytes) -> Result:
    """LoadStage with raw request bytes, past every serializer."""
    method = env.channel.unary_unary("/jaxdist.v1.Worker/LoadStage",
                                     request_serializer=lambda b: b,
                                     response_deserializer=pb.LoadStageReply.FromString)
    return unary(method, data)


def spec_request_bytes(env: Env) -> bytes:
    return pb.LoadStageRequest(spec=env.good.to_proto(), pipeline_id="bad").SerializeToString()


def spec_cut_before_outputs(env: Env) -> bytes:
    """The good spec's bytes, cut cleanly before its first ``outputs`` field (a valid message
    that lost its tail)."""
    data = env.good.to_proto().SerializeToString()
    outputs = pb.StageSpec.DESCRIPTOR.fields_by_name["outputs"].number
    cut = next(start for fld, _, start, _, _ in protowire.fields(data) if fld == outputs)
    spec = data[:cut]
    return protowire.field_prefix(1, len(spec)) + spec  # LoadStageRequest.spec


def edit_weight(spec: StageSpec, **changes: Any) -> StageSpec:
    """``spec`` with fields of weights[0] changed."""
    w = spec.weights
    return spec.replace(weights=(dataclasses.replace(w[0], **changes), *w[1:]))


def with_weight(env: Env, **changes: Any) -> StageSpec:
    """The good spec with fields of weights[0] changed."""
    return edit_weight(env.good, **changes)


def describe(env: Env, path: str) -> Result:
    return unary(env.stub.DescribeWeights, pb.DescribeWeightsRequest(path=path))


def upload(env: Env, chunks: list[pb.ArtifactChunk]) -> Result:
    return unary(env.stub.UploadArtifact, iter(chunks))


def exported(env: Env, key: str) -> artifacts.Artifact:
    """Small artifacts made in this process, once."""
    if key not in env.artifacts:
        import jax
        import jax.numpy as jnp

        def ffi(p: Any, s: Any, x: Any) -> Any:
            result = jax.ShapeDtypeStruct(x["x"].shape, jnp.float32)
            return {"y": jax.ffi.ffi_call("my_secret_kernel", result)(x["x"])}, {}

        def triple(p: Any, s: Any, x: Any) -> Any:
            return {"y": x["x"] * 3}, {}

        if key == "ffi":
            art = artifacts.export_stage(ffi, params={}, inputs={"x": ((4,), "float32")},
                                         platforms=("cpu",),
                                         unstable_custom_calls=["my_secret_kernel"])
        elif key == "tpu":
            art = artifacts.export_stage(triple, params={}, inputs={"x": ((4,), "float32")},
                                         platforms=("tpu",))
        else:
            art = artifacts.export_stage(triple, params={}, inputs={"x": ((4,), "float32")},
                                         platforms=("cpu",))
        env.artifacts[key] = art
    return env.artifacts[key]


def small_spec(art: artifacts.Artifact, **changes: Any) -> StageSpec:
    spec = StageSpec(artifact_digest=art.digest, inputs=(TensorSig("x", "float32", (4,)),),
                     outputs=(TensorSig("y", "float32", (4,)),), device="cpu", stage_id="bad/0",
                     artifact=art.data)
    return spec.replace(**changes)


# ---------------------------------------------------------------------------------------------
# Frames


class RawStream:
    """A subscription and a Push stream of our own, for one pipeline id."""

    def __init__(self, env: Env, pipeline_id: str) -> None:
        self.env = env
        self.pipeline_id = pipeline_id
        self.reply_to = f"bad-input-{uuid.uuid4().hex}"
        self._events: queue.Queue[Any] = queue.Queue()
        self._call = env.client.subscribe(pipeline_id, self.reply_to)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        first = self._events.get(timeout=30)  # the worker greets a subscription with a beat
        assert not isinstance(first, BaseException), first
        self.sender = env.client.sender()
        self._ids = iter(range(1, 1 << 30))
        self._stages: dict[int, int] = {}

    def _read(self) -> None:
        try:
            for view in self._call:
                self._events.put(view)
        except grpc.RpcError as exc:
            self._events.put(exc)

    def header(self, *, session: str = "", step: int = 0, stage: int = 0) -> FrameHeader:
        h = FrameHeader(self.pipeline_id, session, step, stage, next(self._ids), self.reply_to)
        self._stages[h.request_id] = stage
        return h

    def send(self, msgs: Any) -> None:
        for m in msgs:
            self.sender.send(m, timeout=10)

    def send_frame(self, tensors: dict[str, Any], **kw: Any) -> int:
        h = self.header(**kw)
        self.send(split_frame(h, tensors))
        return h.request_id

    def send_raw(self, tensors: list[pb.Tensor], *, last_chunk: bool = True, **kw: Any) -> int:
        h = self.header(**kw)
        self.send([pb.Frame(pipeline_id=h.pipeline_id, session_id=h.session_id, step=h.step,
                            stage=h.stage, request_id=h.request_id, reply_to=h.reply_to,
                            tensors=tensors, last_chunk=last_chunk)])
        return h.request_id

    def wait(self, request_id: int, timeout: float = 30.0) -> Result:
        """The outcome of one frame: its error, or ``Result("OK", ...)`` for a result."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = self._events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise CaseMismatch(f"no answer to frame {request_id} within {timeout}s") from None
            if isinstance(item, BaseException):
                raise CaseMismatch(f"the subscription broke: {item!r}")
            if item.result is not None and item.result.msg.request_id == request_id:
                if item.result.msg.last_chunk:
                    return Result("OK", "", "result")
                continue
            if item.msg.WhichOneof("kind") == "error" and item.msg.request_id == request_id:
                e = item.msg.error
                if e.stage != self._stages[request_id] or e.address != self.env.address:
                    raise CaseMismatch(f"error names stage {e.stage} on {e.address!r}")
                if "Traceback" not in e.traceback:
                    raise CaseMismatch("the error carries no traceback")
                return Result(e.code, e.type, e.message)

    def close(self) -> None:
        self.sender.close()
        self._call.cancel()


def frame_case(env: Env, pipeline: Pipeline | None, send: Callable[[RawStream], int],
               pipeline_id: str | None = None) -> Result:
    raw = RawStream(env, pipeline_id or (pipeline.pipeline_id if pipeline else ""))
    try:
        return raw.wait(send(raw))
    finally:
        raw.close()


def via_pipeline(pipe: Pipeline, inputs: dict[str, Any], session: str = "", step: int = 0
                 ) -> Result:
    """The same frame sent by the coordinator: it must come back as RemoteStageError."""
    try:
        pipe.call(inputs, session_id=session, step=step, timeout=30)
    except RemoteStageError as exc:
        if exc.stage != 0 or exc.address != pipe.clients[0].address:
            raise CaseMismatch(f"RemoteStageError names stage {exc.stage} on {exc.address!r}")
        if "Traceback" not in exc.remote_traceback:
            raise CaseMismatch("RemoteStageError carries no remote traceback") from exc
        return Result("", exc.remote_type, exc.message)
    raise CaseMismatch("the coordinator got a result for a bad frame")


def tensor_frame(env: Env, tensors: dict[str, Any]) -> tuple[Result, Result | None]:
    """A frame of these tensors to the MLP: raw, then through the deployed Pipeline."""
    raw = frame_case(env, env.mlp, lambda r: r.send_frame(tensors))
    return raw, via_pipeline(env.mlp, tensors)


def x(b: int = 4, d: int = D, dtype: Any = np.float32) -> np.ndarray:
    return RNG.standard_normal((b, d)).astype(dtype)


def chunk(name: str = "x", dtype: int = pb.F32, shape: tuple[int, ...] = (4, D),
          data: bytes | None = None, offset: int = 0, total: int | None = None) -> pb.Tensor:
    n = int(np.prod(shape)) * 4
    data = bytes(n) if data is None else data
    return pb.Tensor(name=name, dtype=dtype, shape=list(shape), data=data, offset=offset,
                     total_bytes=n if total is None else total)


# ---------------------------------------------------------------------------------------------
# Sessions (the accumulator: stateful)


def session_steps(env: Env, steps: list[tuple[str, int]], end: tuple[str, ...] = ()
                  ) -> tuple[Result, Result]:
    """Run ``(session, step)`` pairs; all but the last must succeed, sessions in ``end`` are
    ended after their first step. Raw frames first, then through the Pipeline with other ids."""
    one = np.ones((1, 4), np.float32)
    outcomes = []
    for how in ("raw", "pipe"):
        tag = f"{how}-{uuid.uuid4().hex[:6]}-"
        raw = RawStream(env, env.acc.pipeline_id) if how == "raw" else None
        try:
            for i, (sess, step) in enumerate(steps):
                sid = tag + sess
                last = i == len(steps) - 1
                if raw is not None:
                    res = raw.wait(raw.send_frame({"x": one}, session=sid, step=step))
                elif last:
                    res = via_pipeline(env.acc, {"x": one}, sid, step)
                else:
                    env.acc.call(x=one, session_id=sid, step=step, timeout=30)
                    res = Result("OK", "", "result")
                if not last and res.code != "OK":
                    raise CaseMismatch(f"set-up step {sid}@{step} failed: {res}")
                if sess in end and step == 0:
                    unary(env.stub.EndSession, pb.EndSessionRequest(
                        pipeline_id=env.acc.pipeline_id, session_id=sid))
        finally:
            if raw is not None:
                raw.close()
            for sess in {s for s, _ in steps}:  # sessions beyond --max-sessions are refused
                unary(env.stub.EndSession, pb.EndSessionRequest(
                    pipeline_id=env.acc.pipeline_id, session_id=tag + sess))
        outcomes.append(res)
    return outcomes[0], outcomes[1]


# ---------------------------------------------------------------------------------------------
# Raw TCP


def tcp_garbage(env: Env, payload: bytes) -> Result:
    """Send bytes that are not HTTP/2 gRPC; the server must hang up (EOF within 10 s)."""
    host, port = env.address.rsplit(":", 1)
    got = b""
    with socket.create_connection((host, int(port)), timeout=10) as s:
        try:
            s.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            return Result("CLOSED", "", "reset while sending")
        s.settimeout(10)
        try:
            while chunk_ := s.recv(65536):
                got += chunk_
        except ConnectionResetError:
            return Result("CLOSED", "", "reset")
        except TimeoutError:
            return Result("OPEN", "", f"still open after 10 s; {len(got)} bytes received")
    # The server's HTTP/2 preface (a SETTINGS frame, type 4) may precede the hang-up.
    kind = "SETTINGS" if len(got) >= 9 and got[3] == 4 else "nothing" if not got else "other"
    return Result("CLOSED", "", f"server sent {kind} ({len(got)} bytes) then closed")


def push_bytes(env: Env, payloads: list[bytes]) -> Result:
    """Raw bytes as Push requests, bypassing every serializer."""
    push = env.channel.stream_unary("/jaxdist.v1.Worker/Push",
                                    request_serializer=lambda b: b,
                                    response_deserializer=pb.PushAck.FromString)
    return unary(push, iter(payloads), timeout=30)


def subscribe_bytes(env: Env, data: bytes) -> Result:
    """Raw bytes as a Subscribe request; the call must fail before any event."""
    subscribe = env.channel.unary_stream("/jaxdist.v1.Worker/Subscribe",
                                         request_serializer=lambda b: b,
                                         response_deserializer=pb.Event.FromString)
    return unary(lambda request, timeout: list(subscribe(request, timeout=timeout)), data,
                 timeout=30)


def upload_bytes(env: Env, payloads: list[bytes]) -> Result:
    """Raw bytes as UploadArtifact requests, bypassing every serializer."""
    method = env.channel.stream_unary("/jaxdist.v1.Worker/UploadArtifact",
                                      request_serializer=lambda b: b,
                                      response_deserializer=pb.UploadReply.FromString)
    return unary(method, iter(payloads), timeout=30)


# ---------------------------------------------------------------------------------------------
# The matrix


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Env], Result | tuple[Result, Result | None]]
    code: str                 # status code name ("OK" for calls that must succeed)
    message: str              # regex the details (or reply) must match
    type: str = ""            # jaxdist error class the worker names
    bug: str | None = None    # xfail reason: the bug this case reveals


def spec_case(name: str, edit: Callable[[StageSpec], StageSpec], message: str, *,
              code: str = "INVALID_ARGUMENT", type: str = "SpecError",
              bug: str | None = None) -> Case:
    return Case(name, lambda e: load(e, edit(e.good)), code, message, type, bug)


def _sig(name: str = "x", dtype: str = "float32", dims: tuple[Any, ...] = ("b", D)) -> TensorSig:
    return TensorSig(name, dtype, dims)


CASES: list[Case] = [
    # -- specs: every validate() failure LoadStage can reach --------------------------------
    Case("spec_cut_at_a_field_boundary", lambda e: load_bytes(e, spec_cut_before_outputs(e)),
         # outputs, device, next hop, ... are gone; validate() names the first field it checks
         "INVALID_ARGUMENT", r"^StageSpec\.device: device directive '' is malformed; expected "
         r"one of: auto, cpu", "SpecError"),
    Case("spec_truncated_mid_field", lambda e: load_bytes(e, spec_request_bytes(e)[:-7]),
         "INVALID_ARGUMENT", r"^malformed LoadStageRequest \(\d+ bytes\): Error parsing message",
         "CodecError"),
    Case("request_garbage_bytes", lambda e: load_bytes(e, b"\xff\xff\xff\xff"),
         "INVALID_ARGUMENT", r"^malformed LoadStageRequest \(4 bytes\): Error parsing message",
         "CodecError"),
    spec_case("spec_version_major_2", lambda s: s.replace(spec_version="2.0"),
              r"^StageSpec\.spec_version: unsupported version '2\.0'; this jaxdist reads major "
              r"versions \(1,\)"),
    spec_case("spec_version_empty", lambda s: s.replace(spec_version=""),
              r"^StageSpec\.spec_version: unsupported version ''"),
    spec_case("spec_version_unicode_digit", lambda s: s.replace(spec_version="².0"),
              r"^StageSpec\.spec_version: unsupported version '²\.0'; this jaxdist reads major "
              r"versions \(1,\)"),
    spec_case("digest_wrong_algorithm", lambda s: s.replace(artifact_digest="md5:" + "0" * 32),
              r"^StageSpec\.artifact_digest: expected 'sha256:' and 64 lowercase hex digits, "
              r"found 'md5:0{32}'"),
    spec_case("digest_uppercase_hex", lambda s: s.replace(
        artifact_digest=s.artifact_digest.upper().replace("SHA256", "sha256")),
              r"^StageSpec\.artifact_digest: expected 'sha256:' and 64 lowercase hex digits"),
    spec_case("digest_truncated", lambda s: s.replace(artifact_digest=s.artifact_digest[:-1]),
              r"^StageSpec\.artifact_digest: expected 'sha256:' and 64 lowercase hex digits"),
    spec_case("stage_index_past_num_stages", lambda s: s.replace(stage_index=3, num_stages=2),
              r"^StageSpec\.stage_index: expected 0 <= stage_index < num_stages, found "
              r"stage_index=3, num_stages=2"),
    spec_case("num_stages_zero", lambda s: s.replace(stage_index=0, num_stages=0),
              r"^StageSpec\.stage_index: expected 0 <= stage_index < num_stages, found "
              r"stage_index=0, num_stages=0"),
    spec_case("next_hop_not_host_port", lambda s: s.replace(num_stages=2, next_hop="no-port"),
              r"^StageSpec\.next_hop: expected HOST:PORT, found 'no-port'"),
    spec_case("next_hop_on_last_stage", lambda s: s.replace(next_hop="127.0.0.1:1"),
              r"^StageSpec\.next_hop: the last stage returns to the coordinator; next_hop must "
              r"be empty"),
    spec_case("device_gpu_ambiguous", lambda s: s.replace(device="gpu"),
              r"^StageSpec\.device: device directive 'gpu' is ambiguous: jax calls both CUDA and "
              r"ROCm devices 'gpu'; write cuda or rocm instead"),
    spec_case("device_unknown_platform", lambda s: s.replace(device="npu:0"),
              r"^StageSpec\.device: device directive 'npu:0' is malformed; expected one of: "
              r"auto, cpu, cuda"),
    spec_case("device_cuda_absent", lambda s: s.replace(device="cuda"),
              r"^device directive 'cuda' cannot be honoured: no cuda device is present\. "
              r"Devices present: .*cpu", code="FAILED_PRECONDITION", type="DeviceError"),
    spec_case("device_tpu_index_absent", lambda s: s.replace(device="tpu:3"),
              r"^device directive 'tpu:3' cannot be honoured: no tpu device is present",
              code="FAILED_PRECONDITION", type="DeviceError"),
    spec_case("device_cpu_index_out_of_range", lambda s: s.replace(device="cpu:7"),
              r"^device directive 'cpu:7' cannot be honoured: index 7 is out of range, this "
              r"machine has 1 cpu device\(s\)", code="FAILED_PRECONDITION", type="DeviceError"),
    spec_case("no_outputs", lambda s: s.replace(outputs=()),
              r"^StageSpec\.outputs: a stage needs at least one output"),
    spec_case("duplicate_input_names", lambda s: s.replace(inputs=(_sig(), _sig())),
              r"^StageSpec\.inputs\[1\]\.name: duplicate name 'x'"),
    spec_case("empty_output_name", lambda s: s.replace(outputs=(_sig(""),)),
              r"^StageSpec\.outputs\[0\]\.name: must not be empty"),
    spec_case("unknown_dtype", lambda s: s.replace(inputs=(_sig(dtype="float8"),)),
              r"^StageSpec\.inputs\[0\]\.dtype: unknown dtype 'float8'; expected one of float32"),
    spec_case("non_canonical_dtype", lambda s: s.replace(inputs=(_sig(dtype="f32"),)),
              r"^StageSpec\.inputs\[0\]\.dtype: dtype must be the canonical name 'float32', "
              r"found 'f32'"),
    spec_case("negative_dim", lambda s: s.replace(inputs=(_sig(dims=("b", -32)),)),
              r"^StageSpec\.inputs\[0\]\.dims\[1\]: negative size -32"),
    spec_case("dim_not_a_symbol", lambda s: s.replace(inputs=(_sig(dims=("b-", D)),)),
              r"^StageSpec\.inputs\[0\]\.dims\[0\]: expected an integer or a symbol name, "
              r"found 'b-', which is no expression of symbols such as '2\*b' either: it ends "
              r"early$"),
    Case("dim_unicode_digit", lambda e: load_proto(e, lambda m: m.inputs[0].dims.__setitem__(
        1, "³²")), "INVALID_ARGUMENT", r"^StageSpec\.inputs\[0\]\.dims\[1\]: expected an "
         r"integer or a symbol name, found '³²'", "SpecError"),
    spec_case("duplicate_state_names", lambda s: s.replace(state=(
        StateSig("k", "float32", (4,)), StateSig("k", "float32", (4,)))),
              r"^StageSpec\.state\[1\]\.name: duplicate name 'k'"),
    spec_case("state_negative_shape", lambda s: s.replace(state=(StateSig("k", "float32", (-4,)),)),
              r"^StageSpec\.state\[0\]\.shape: expected non-negative sizes, found \(-4,\)"),
    spec_case("duplicate_weight_params", lambda s: s.replace(weights=(s.weights[0], s.weights[0])),
              r"^StageSpec\.weights\[1\]\.name: duplicate name 'l0\.w'"),
    spec_case("weight_uri_bad_scheme", lambda s: edit_weight(s, uri="s3://bucket/mlp#l0.w"),
              r"^StageSpec\.weights\[0\]\.uri: weight URI 's3://bucket/mlp#l0\.w': expected a "
              r"scheme of gguf://, safetensors://, file://, found scheme 's3'"),
    spec_case("weight_uri_no_scheme", lambda s: edit_weight(s, uri="mlp.safetensors"),
              r"^StageSpec\.weights\[0\]\.uri: weight URI 'mlp\.safetensors': expected a scheme "
              r"of .* found no scheme"),
    spec_case("weight_uri_file_with_tensor", lambda s: edit_weight(s, uri="file://raw.bin#t"),
              r"^StageSpec\.weights\[0\]\.uri: .*file:// holds one raw array and takes no "
              r"'#TENSOR' part"),
    spec_case("weight_uri_empty_tensor", lambda s: edit_weight(
        s, uri="safetensors://mlp.safetensors#"),
              r"^StageSpec\.weights\[0\]\.uri: .*the tensor name after '#' is empty"),
    spec_case("weight_sha256_malformed", lambda s: edit_weight(s, sha256="XYZ"),
              r"^StageSpec\.weights\[0\]\.sha256: expected 64 lowercase hex digits, found 'XYZ'"),
    spec_case("weight_packed_without_quant", lambda s: edit_weight(s, packed=True),
              r"^StageSpec\.weights\[0\]: a packed weight \('l0\.w'\) needs dtype 'uint8' and "
              r"a quant type, found dtype='float32' quant=None"),
    spec_case("weight_negative_shape", lambda s: edit_weight(s, shape=(-1, D)),
              r"^StageSpec\.weights\[0\]\.shape: expected non-negative sizes, found \(-1, 32\)"),
    spec_case("bucket_unknown_symbol", lambda s: s.replace(buckets=(ShapeBucket({"s": 4}),)),
              r"^StageSpec\.buckets\[0\]: unknown symbols \['s'\]; the inputs use \['b'\]"),
    spec_case("bucket_size_zero", lambda s: s.replace(buckets=(ShapeBucket({"b": 0}),)),
              r"^StageSpec\.buckets\[0\]: sizes must be >= 1, found \{'b': 0\}"),
    # -- the spec against its artifact --------------------------------------------------------
    spec_case("signature_output_dims", lambda s: s.replace(outputs=(_sig(dims=("b", D + 1)),)),
              r"^stage 0 \(sha256:[0-9a-f]{12}\): output 'x': the artifact has float32\(b, 32\), "
              r"the spec says float32\(b, 33\)"),
    spec_case("signature_weight_count", lambda s: s.replace(weights=s.weights[:3]),
              r"^stage 0 \(sha256:[0-9a-f]{12}\): the artifact takes 5 arguments, the spec lists "
              r"3 weights \+ 0 state \+ 1 inputs = 4"),
    spec_case("signature_weight_shape", lambda s: edit_weight(s, shape=(16, D)),
              r"^stage 0 \(sha256:[0-9a-f]{12}\): weight 'l0\.w': the artifact expects "
              r"float32\(32, 32\), the spec binds float32\(16, 32\)"),
    # -- artifacts --------------------------------------------------------------------------
    Case("upload_wrong_digest", lambda e: upload(e, [pb.ArtifactChunk(
        digest="sha256:" + "1" * 64, data=b"not an artifact", total_bytes=15)]),
         "FAILED_PRECONDITION", r"^uploaded artifact does not match its digest: expected "
         r"sha256:1{64}, found sha256:[0-9a-f]{64} \(15 bytes\)", "ArtifactError"),
    Case("upload_declared_over_limit", lambda e: upload(e, [pb.ArtifactChunk(
        digest="sha256:" + "2" * 64, data=b"x", total_bytes=LIMITS.max_artifact_bytes + 1)]),
         "RESOURCE_EXHAUSTED", rf"^artifact sha256:2{{64}} is {LIMITS.max_artifact_bytes + 1} "
         rf"bytes, over the artifact size limit of {LIMITS.max_artifact_bytes}", "LimitError"),
    Case("upload_empty_stream", lambda e: upload(e, []), "FAILED_PRECONDITION",
         r"^empty artifact upload: the first chunk must name the digest", "ArtifactError"),
    Case("has_artifact_malformed_digest", lambda e: unary(
        e.stub.HasArtifact, pb.ArtifactQuery(digest="../../etc/passwd")),
         "FAILED_PRECONDITION", r"^artifact digest '\.\./\.\./etc/passwd' is malformed: expected "
         r"'sha256:' followed by 64 lowercase hex digits", "ArtifactError"),
    spec_case("load_unknown_digest", lambda s: s.replace(artifact_digest="sha256:" + "3" * 64),
              r"^artifact sha256:3{64} not in this worker's cache; upload it first "
              r"\(UploadArtifact\) or inline it in the spec", code="FAILED_PRECONDITION",
              type="ArtifactError"),
    spec_case("inline_artifact_wrong_bytes", lambda s: s.replace(artifact=b"garbage" * 10),
              r"^artifact digest mismatch: expected sha256:[0-9a-f]{64}, found sha256:[0-9a-f]{64} "
              r"\(70 bytes\); the bytes were damaged or the wrong artifact was sent",
              code="FAILED_PRECONDITION", type="ArtifactError"),
    Case("inline_artifact_truncated", lambda e: load(e, truncated_spec(e, 0.5)),
         "FAILED_PRECONDITION", r"^corrupt artifact \(\d+ bytes\): .*not a serialized "
         r"jax\.export\.Exported", "ArtifactError"),
    Case("inline_artifact_garbage", lambda e: load(e, garbage_spec(e)), "FAILED_PRECONDITION",
         r"^corrupt artifact \(4096 bytes\): root table offset \d+ is past the end",
         "ArtifactError"),
    Case("forbidden_custom_call", lambda e: load(e, small_spec(exported(e, "ffi"))),
         "FAILED_PRECONDITION", r"^artifact 'ffi' uses custom call 'my_secret_kernel', which is "
         r"not on the allowlist of custom call targets", "ArtifactError"),
    Case("artifact_for_another_platform", lambda e: load(e, small_spec(exported(e, "tpu"))),
         "FAILED_PRECONDITION", r"^artifact 'triple' was exported for \['tpu'\], not for 'cpu'",
         "ArtifactError"),
    # -- weights ----------------------------------------------------------------------------
    Case("weight_absolute_path_outside_roots", lambda e: load(e, with_weight(
        e, uri=f"safetensors://{e.outside}/secret.safetensors#l0.w")), "PERMISSION_DENIED",
         r"^weight 'safetensors://.*secret\.safetensors#l0\.w': path '.*secret\.safetensors' "
         r"resolves to '.*', which is outside the weight roots", "WeightError"),
    Case("weight_dotdot_escape", lambda e: load(e, with_weight(
        e, uri=f"safetensors://../{e.outside.name}/secret.safetensors#l0.w")),
         "PERMISSION_DENIED", r"^weight '.*': path '\.\./.*' resolves to '.*secret\.safetensors', "
         r"which is outside the weight roots", "WeightError"),
    Case("weight_symlink_escape", lambda e: load(e, with_weight(
        e, uri="safetensors://escape.safetensors#l0.w")), "PERMISSION_DENIED",
         r"^weight '.*': path 'escape\.safetensors' resolves to '.*secret\.safetensors', which "
         r"is outside the weight roots", "WeightError"),
    Case("weight_file_missing", lambda e: load(e, with_weight(
        e, uri="safetensors://nope.safetensors#l0.w")), "NOT_FOUND",
         r"^weight 'safetensors://nope\.safetensors#l0\.w': file not found; looked for "
         r".*nope\.safetensors", "WeightError"),
    Case("weight_tensor_missing", lambda e: load(e, with_weight(
        e, uri="safetensors://mlp.safetensors#l9.w")), "NOT_FOUND",
         r"^tensor 'l9\.w' not found in safetensors file '.*mlp\.safetensors' \(4 tensors\)",
         "WeightError"),
    Case("weight_uri_names_no_tensor", lambda e: load(e, with_weight(
        e, uri="safetensors://mlp.safetensors")), "INVALID_ARGUMENT",
         r"^weight URI 'safetensors://mlp\.safetensors' names no tensor", "WeightError"),
    Case("weight_shape_differs_from_file", lambda e: load(e, with_weight(
        e, uri="safetensors://other.safetensors#l0.w")), "INVALID_ARGUMENT",
         r"^weight 'l0\.w' \(safetensors://other\.safetensors#l0\.w\): shape mismatch: expected "
         r"\(32, 32\), found \(16, 32\)", "WeightError"),
    Case("weight_int_file_for_float_param", lambda e: load(e, with_weight(
        e, uri="safetensors://ints.safetensors#i")), "INVALID_ARGUMENT",
         r"^weight 'l0\.w' .*: dtype mismatch: expected float32, found int64; a int tensor is "
         r"not converted to float implicitly", "WeightError"),
    Case("weight_sha256_mismatch", lambda e: load(e, with_weight(e, sha256="0" * 64)),
         "INVALID_ARGUMENT", r"^weight 'l0\.w' .*: checksum mismatch: expected sha256 0{64}, "
         r"found [0-9a-f]{64}", "WeightError"),
    Case("weight_corrupt_safetensors", lambda e: load(e, with_weight(
        e, uri="safetensors://corrupt.safetensors#l0.w")), "INVALID_ARGUMENT",
         r"^safetensors file '.*corrupt\.safetensors' is malformed", "WeightError"),
    Case("weight_gguf_bad_magic", lambda e: load(e, with_weight(
        e, uri="gguf://corrupt.gguf#l0.w")), "INVALID_ARGUMENT",
         r"^GGUF file '.*corrupt\.gguf' could not be read: bad magic b'NOTG' at offset 0",
         "WeightError"),
    Case("weight_raw_file_wrong_size", lambda e: load(e, with_weight(e, uri="file://raw.bin")),
         "INVALID_ARGUMENT", r"^raw weight 'file://raw\.bin': size mismatch: expected 4096 bytes "
         r"\(float32 \(32, 32\)\), found 10 bytes", "WeightError"),
    # -- DescribeWeights ----------------------------------------------------------------------
    Case("describe_outside_roots", lambda e: describe(e, str(e.outside / "secret.safetensors")),
         "PERMISSION_DENIED", r"^weight '.*secret\.safetensors': path .* is outside the weight "
         r"roots", "WeightError"),
    Case("describe_dotdot", lambda e: describe(e, f"../{e.outside.name}/secret.safetensors"),
         "PERMISSION_DENIED", r"^weight 'safetensors://\.\./.*': path '\.\./.*' resolves to "
         r".* outside the weight roots", "WeightError"),
    Case("describe_etc_passwd", lambda e: describe(e, "/etc/passwd"), "PERMISSION_DENIED",
         r"^weight '/etc/passwd': path '/etc/passwd' resolves to '/etc/passwd', which is outside "
         r"the weight roots", "WeightError"),
    Case("describe_missing_file", lambda e: describe(e, "nope.gguf"), "NOT_FOUND",
         r"^weight 'nope\.gguf': file not found; looked for .*nope\.gguf", "WeightError"),
    Case("describe_not_weights", lambda e: describe(e, "notes.txt"), "INVALID_ARGUMENT",
         r"^safetensors file '.*notes\.txt' is malformed", "WeightError"),
    Case("describe_bad_scheme", lambda e: describe(e, "s3://bucket/model.gguf"),
         "INVALID_ARGUMENT", r"^weight URI 's3://bucket/model\.gguf': expected a scheme of",
         "WeightError"),
    Case("describe_malformed_config_json", lambda e: describe(e, "badcfg"), "INVALID_ARGUMENT",
         r"^checkpoint config '.*badcfg/config\.json' could not be read: Expecting property "
         r"name", "WeightError"),
    Case("describe_metadata_not_an_object", lambda e: describe(e, "meta-list.safetensors"),
         "INVALID_ARGUMENT", r"^safetensors file '.*meta-list\.safetensors' is malformed: "
         r"'__metadata__' must be an object of strings, found \['not', 'an', 'object'\]",
         "WeightError"),
    # -- frames to the MLP ---------------------------------------------------------------------
    Case("frame_wrong_dtype", lambda e: tensor_frame(e, {"x": x(dtype=np.float64)}),
         "INVALID_ARGUMENT", r"^stage 0: input 'x': expected dtype float32, found float64$",
         "SpecError"),
    Case("frame_wrong_shape", lambda e: tensor_frame(e, {"x": x(2, D + 1)}), "INVALID_ARGUMENT",
         rf"^stage 0: input 'x': expected dims \(b, {D}\), found \(2, {D + 1}\)$", "SpecError"),
    Case("frame_wrong_rank", lambda e: tensor_frame(e, {"x": np.zeros((4, 2, D), np.float32)}),
         "INVALID_ARGUMENT", rf"^stage 0: input 'x': expected dims \(b, {D}\), found "
         rf"\(4, 2, {D}\)$", "SpecError"),
    Case("frame_wrong_name", lambda e: tensor_frame(e, {"y": x()}), "INVALID_ARGUMENT",
         r"^stage 0: expected inputs \['x'\], found \['y'\]$", "SpecError"),
    Case("frame_extra_tensor", lambda e: tensor_frame(e, {"x": x(), "z": x()}),
         "INVALID_ARGUMENT", r"^stage 0: expected inputs \['x'\], found \['x', 'z'\]$",
         "SpecError"),
    Case("frame_no_tensors", lambda e: tensor_frame(e, {}), "INVALID_ARGUMENT",
         r"^stage 0: expected inputs \['x'\], found \[\]$", "SpecError"),
    Case("frame_unknown_pipeline", lambda e: frame_case(
        e, None, lambda r: r.send_frame({"x": x()}), pipeline_id="ghost-pipeline"),
         "FAILED_PRECONDITION", r"^unknown stage: pipeline 'ghost-pipeline' stage 0 is not "
         r"loaded on worker 127\.0\.0\.1:\d+$", "SessionError"),
    Case("frame_unknown_stage", lambda e: frame_case(
        e, e.mlp, lambda r: r.send_frame({"x": x()}, stage=7)), "FAILED_PRECONDITION",
         r"^unknown stage: pipeline 'mlp-[0-9a-f]+' stage 7 is not loaded on worker",
         "SessionError"),
    Case("frame_dtype_enum_unknown", lambda e: frame_case(
        e, e.mlp, lambda r: r.send_raw([chunk(dtype=99)])), "INVALID_ARGUMENT",
         r"^session '' step 0: tensor 'x': unknown dtype enum 99$", "CodecError"),
    Case("frame_negative_dim", lambda e: frame_case(
        e, e.mlp, lambda r: r.send_raw([pb.Tensor(name="x", dtype=pb.F32, shape=[-4, D])])),
         "INVALID_ARGUMENT", r"^session '' step 0: tensor 'x': negative dimension in shape "
         r"\(-4, 32\)$", "CodecError"),
    Case("frame_data_shorter_than_shape", lambda e: frame_case(
        e, e.mlp, lambda r: r.send_raw([chunk(data=bytes(100), total=100)])), "INVALID_ARGUMENT",
         r"^session '' step 0: tensor 'x': shape \(4, 32\) of float32 needs 512 bytes, header "
         r"says total_bytes=100$", "CodecError"),
    Case("frame_chunk_overruns_tensor", lambda e: frame_case(
        e, e.mlp, lambda r: r.send_raw([chunk(data=bytes(64), offset=500)])), "INVALID_ARGUMENT",
         r"^session '' step 0: tensor 'x': chunk \[500, 564\) overruns 512 bytes$", "CodecError"),
    Case("frame_incomplete_tensor", lambda e: frame_case(
        e, e.mlp, lambda r: r.send_raw([chunk(data=bytes(256))])), "INVALID_ARGUMENT",
         r"^session '' step 0: incomplete tensors at end of frame: 'x' \(256/512 bytes\)$",
         "CodecError"),
    Case("frame_overlapping_chunks", lambda e: frame_case(
        e, e.mlp, lambda r: r.send_raw([chunk(data=bytes(256)), chunk(data=bytes(128), offset=128),
                                        chunk(data=bytes(128), offset=384)])), "INVALID_ARGUMENT",
         r"^session '' step 0: tensor 'x': chunks overlap or leave a gap at byte 256$",
         "CodecError"),
    Case("frame_tensor_twice", lambda e: frame_case(
        e, e.mlp, lambda r: r.send_raw([chunk(), chunk()])), "INVALID_ARGUMENT",
         r"^session '' step 0: tensor 'x' received twice in one frame$", "CodecError"),
    Case("frame_chunk_header_changes", lambda e: frame_case(
        e, e.mlp, lambda r: r.send_raw([chunk(data=bytes(256)), chunk(
            dtype=pb.I32, data=bytes(256), offset=256)])), "INVALID_ARGUMENT",
         r"^session '' step 0: tensor 'x': chunk header int32\[4, 32\] differs from the first "
         r"chunk's float32\[4, 32\]$", "CodecError"),
    Case("frame_interleaved_without_last_chunk", lambda e: frame_case(
        e, e.mlp, lambda r: (r.send_raw([chunk(data=bytes(256))], last_chunk=False),
                             r.send_raw([chunk()], step=1))[1]), "INVALID_ARGUMENT",
         r"^frame of session '' step 1 began before the previous frame ended \(missing "
         r"last_chunk\)$", "CodecError"),
    Case("frame_tensor_over_size_limit", lambda e: frame_case(
        e, e.mlp, lambda r: r.send_raw([chunk(
            shape=(LIMITS.max_frame_tensor_bytes // 4 + 1,), data=bytes(16))])),
         "RESOURCE_EXHAUSTED", rf"tensor 'x' is {LIMITS.max_frame_tensor_bytes + 4} bytes, over "
         rf"the limit of {LIMITS.max_frame_tensor_bytes}", "LimitError"),
    Case("frame_too_many_tensors", lambda e: frame_case(
        e, e.mlp, lambda r: r.send_raw([chunk(name=f"t{i}", shape=(1,))
                                        for i in range(LIMITS.max_tensors_per_frame + 1)])),
         "RESOURCE_EXHAUSTED", rf"more than {LIMITS.max_tensors_per_frame} tensors in one frame",
         "LimitError"),
    Case("frame_rank_65", lambda e: frame_case(
        e, e.mlp, lambda r: r.send_raw([chunk(shape=(1,) * 65)])), "INVALID_ARGUMENT",
         r"^session '' step 0: tensor 'x': rank 65 is over the largest supported rank of 64$",
         "CodecError"),
    Case("push_undecodable_bytes", lambda e: push_bytes(e, [b"\xff\xff\xff"]),
         "INVALID_ARGUMENT", r"^malformed Frame message \(3 bytes\): Error parsing message",
         "CodecError"),
    Case("subscribe_undecodable_bytes", lambda e: subscribe_bytes(e, b"\xff\xff\xff"),
         "INVALID_ARGUMENT", r"^malformed SubscribeRequest \(3 bytes\): Error parsing message",
         "CodecError"),
    Case("info_undecodable_bytes", lambda e: unary(e.channel.unary_unary(
        "/jaxdist.v1.Worker/Info", request_serializer=lambda b: b,
        response_deserializer=pb.InfoReply.FromString), b"\x0a\x05ab"),
         "INVALID_ARGUMENT", r"^malformed InfoRequest \(4 bytes\): Error parsing message",
         "CodecError"),
    Case("upload_undecodable_bytes", lambda e: upload_bytes(e, [b"\xff\xff\xff"]),
         "INVALID_ARGUMENT", r"malformed", "CodecError"),
    # -- sessions (the stateful accumulator) ---------------------------------------------------
    Case("session_unknown", lambda e: session_steps(e, [("s", 1)]), "FAILED_PRECONDITION",
         r"^unknown session '.*-s' on stage acc-[0-9a-f]+/0: step 1 of a session that never "
         r"started here or has ended$", "SessionError"),
    Case("session_ended", lambda e: session_steps(e, [("s", 0), ("s", 1)], end=("s",)),
         "FAILED_PRECONDITION", r"^unknown session '.*-s' on stage acc-[0-9a-f]+/0: step 1 of "
         r"a session that never started here or has ended$", "SessionError"),
    Case("session_step_skipped", lambda e: session_steps(e, [("s", 0), ("s", 2)]),
         "FAILED_PRECONDITION", r"^session '.*-s' on stage acc-[0-9a-f]+/0: expected step 1, "
         r"found step 2$", "SessionError"),
    Case("session_step_repeated", lambda e: session_steps(e, [("s", 0), ("s", 1), ("s", 1)]),
         "FAILED_PRECONDITION", r"^session '.*-s' on stage acc-[0-9a-f]+/0: expected step 2, "
         r"found step 1$", "SessionError"),
    Case("session_started_twice", lambda e: session_steps(e, [("s", 0), ("s", 0)]),
         "FAILED_PRECONDITION", r"^session '.*-s' already exists on stage acc-[0-9a-f]+/0; step "
         r"0 starts a session \(end it first, or use a new id\)$", "SessionError"),
    Case("session_over_limit", lambda e: session_steps(
        e, [(f"o{i}", 0) for i in range(MAX_SESSIONS)] + [("s", 0)]),
         "RESOURCE_EXHAUSTED", rf"^session '.*-s' on stage acc-[0-9a-f]+/0 refused: this worker "
         rf"holds {MAX_SESSIONS} sessions, the limit \(--max-sessions={MAX_SESSIONS}\)",
         "LimitError"),
    # -- calls on ids that do not exist (idempotent: OK, nothing done) -------------------------
    Case("end_session_unknown", lambda e: unary(e.stub.EndSession, pb.EndSessionRequest(
        pipeline_id="nope", session_id="never")), "OK", r"^$"),
    Case("end_session_unknown_on_live_pipeline", lambda e: unary(
        e.stub.EndSession, pb.EndSessionRequest(pipeline_id=e.acc.pipeline_id,
                                                session_id="never")), "OK", r"^$"),
    Case("unload_unknown_stage", lambda e: unary(e.stub.UnloadStage, pb.UnloadStageRequest(
        stage_id="nope/0")), "OK", r"^$"),
    # -- not gRPC at all -----------------------------------------------------------------------
    Case("tcp_random_bytes", lambda e: tcp_garbage(e, os.urandom(4096)), "CLOSED",
         r"then closed$"),
    Case("tcp_http1_request", lambda e: tcp_garbage(e, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
         "CLOSED", r"then closed$"),
    Case("tcp_http2_preface_then_garbage", lambda e: tcp_garbage(
        e, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(512)), "CLOSED", r"then closed$"),
    Case("tcp_zeros", lambda e: tcp_garbage(e, bytes(100_000)), "CLOSED", r"then closed$"),
]


def truncated_spec(env: Env, fraction: float) -> StageSpec:
    """A spec whose inline artifact is the first part of a real one (digest of the cut bytes)."""
    data = exported(env, "cpu").data
    cut = data[:int(len(data) * fraction)]
    return small_spec(exported(env, "cpu"), artifact_digest=artifacts.digest_of(cut), artifact=cut)


def garbage_spec(env: Env) -> StageSpec:
    data = b"\xff\xff\x00\x00" + bytes(np.random.default_rng(3).integers(0, 256, 4092, np.uint8))
    return env.good.replace(artifact_digest=artifacts.digest_of(data), artifact=data)


def _params() -> list[Any]:
    out = []
    for case in CASES:
        marks = [pytest.mark.xfail(strict=True, raises=CaseMismatch, reason=case.bug)] \
            if case.bug else []
        out.append(pytest.param(case, id=case.name, marks=marks))
    return out


def test_the_matrix_is_large_and_names_are_unique() -> None:
    names = [c.name for c in CASES]
    assert len(names) == len(set(names)), "duplicate case names"
    assert len(CASES) >= 50


@pytest.mark.parametrize("case", _params())
def test_error(env: Env, case: Case) -> None:
    try:
        got = case.run(env)
    finally:
        unary(env.stub.UnloadStage, pb.UnloadStageRequest(stage_id="bad"))  # if it loaded
        assert_healthy(env)  # raises WorkerUnhealthy, which no xfail mark covers
    raw, coordinator = got if isinstance(got, tuple) else (got, None)
    problems = []
    if raw.code != case.code:
        problems.append(f"status {raw.code}, expected {case.code}")
    if case.type and raw.type != case.type:
        problems.append(f"error class {raw.type!r}, expected {case.type!r}")
    if not re.search(case.message, raw.message, re.DOTALL):
        problems.append(f"message {raw.message!r} does not match {case.message!r}")
    if coordinator is not None and (  # the same frame, as the coordinator's RemoteStageError
            coordinator.type != case.type
            or not re.search(case.message, coordinator.message, re.DOTALL)):
        problems.append(f"through the Pipeline: {coordinator.type}: {coordinator.message!r}")
    if problems:
        raise CaseMismatch(f"{case.name}: " + "; ".join(problems))
