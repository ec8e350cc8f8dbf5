"""Per-step control in the frame header (:mod:`jaxdist.core.control`).

The codec is checked against protobuf's own parser and serializer of ``StepControl``; the export
contract (control inputs in every stage, in no stage's outputs) on the exported specs; and the
data path on real workers: a two-stage model that reads control on both stages matches numpy,
and frames with control in the wrong place, or none, or malformed, are refused with the stage
named while the worker goes on serving.
"""

from __future__ import annotations

import doctest
import queue
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.inprocess import InProcessPipeline
from jaxdist.coordinator.pipeline import Pipeline
from jaxdist.coordinator.spawn import spawn_workers, stop_workers
from jaxdist.core import control, protowire
from jaxdist.core.errors import CodecError, SpecError
from jaxdist.core.spec import StageSpec, TensorSig
from jaxdist.core.transport.client import WorkerClient
from jaxdist.core.transport.frames import FrameHeader, split_frame
from jaxdist.export.model import Model, Unit
from jaxdist.export.stages import build_stage_specs
from jaxdist.proto import jaxdist_pb2 as pb

pytestmark = pytest.mark.timeout(180)

N = 4
CONTROL = ("pos", "length", "temperature")


def _scale(params: Any, state: Any, carry: dict[str, Any]) -> tuple[dict[str, Any], dict]:
    x = carry["x"] * carry["temperature"][:, None] + carry["pos"][:, None]
    return {"x": x}, {}  # the control is not passed on: the stage runtime keeps it


def _shift(params: Any, state: Any, carry: dict[str, Any]) -> tuple[dict[str, Any], dict]:
    return {"x": carry["x"] - carry["length"][:, None].astype(jnp.float32)}, {}


def _rewrite_pos(params: Any, state: Any, carry: dict[str, Any]) -> tuple[dict[str, Any], dict]:
    return {"x": carry["x"], "pos": carry["pos"] + 1}, {}


def control_model(units: tuple[Any, ...] = (_scale, _shift)) -> Model:
    return Model("ctl", [Unit(f"u{i}", fn) for i, fn in enumerate(units)],
                 inputs={"x": (f"b, {N}", "float32"), "pos": ("b", "int32"),
                         "length": ("b", "int32"), "temperature": ("b", "float32")},
                 buckets=[{"b": 2}], control=CONTROL)


def reference(inputs: dict[str, np.ndarray]) -> np.ndarray:
    x = inputs["x"] * inputs["temperature"][:, None] + inputs["pos"][:, None]
    return x - inputs["length"][:, None]


def step(b: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((b, N)).astype(np.float32),
            "pos": rng.integers(0, 100, b).astype(np.int32),
            "length": rng.integers(1, 9, b).astype(np.int32),
            "temperature": rng.uniform(0.1, 2, b).astype(np.float32)}


# -- the codec ----------------------------------------------------------------------------------

VALUES = {"slot": [0, 3, -1], "pos": [5, 0, 2**31 - 1], "length": [1, 16, 3],
          "temperature": [0.0, 0.7, 1.5], "top_k": [0, 40, 1], "top_p": [1.0, 0.9, 0.5],
          "seed": [0, 2**32 - 1, 7]}


def test_encode_is_read_by_protobuf_and_protobuf_is_read_by_decode() -> None:
    data = control.encode(VALUES)
    msg = pb.StepControl.FromString(data)
    for name, values in VALUES.items():
        expected = np.asarray(values, dtype=control.FIELDS[name])
        np.testing.assert_array_equal(np.asarray(getattr(msg, name), expected.dtype), expected)
    back = control.decode(pb.StepControl(**VALUES).SerializeToString())
    assert set(back) == set(VALUES)
    for name, values in VALUES.items():
        assert back[name].dtype == np.dtype(control.FIELDS[name])
        np.testing.assert_array_equal(back[name], np.asarray(values, control.FIELDS[name]))


def test_the_examples_run() -> None:
    assert doctest.testmod(control).failed == 0


def test_unpacked_fields_decode_too() -> None:
    """Protobuf allows a repeated scalar one value per tag; jaxdist writes packed, reads both."""
    data = b"".join(protowire.varint(1 << 3 | protowire.I32) + int(v).to_bytes(4, "little",
                                                                                signed=True)
                    for v in (4, -2))
    assert pb.StepControl.FromString(data).slot == [4, -2]  # what protobuf itself reads
    np.testing.assert_array_equal(control.decode(data)["slot"], [4, -2])


@pytest.mark.parametrize("data, match", [
    (protowire.field_prefix(1, 5) + bytes(5), "'slot': 5 bytes is not a whole number"),
    (protowire.field_prefix(4, 8) + bytes(4), "runs past the end"),
    (control.encode({"pos": [1]}) * 2, "'pos': field given twice"),
])
def test_malformed_headers_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        control.decode(data)


@pytest.mark.parametrize("values, match", [
    ({"slots": [1]}, "'slots': not a StepControl field"),
    ({"pos": [[1, 2]]}, r"'pos': expected one value per row \(1-D\), found shape \(1, 2\)"),
    ({"pos": [2**31]}, "'pos': 2147483648 is out of the range of int32"),
    ({"seed": [-1]}, "'seed': -1 is out of the range of uint32"),
    ({"top_k": [1.5]}, r"'top_k': expected integers \(int32\), found float64"),
])
def test_encode_refuses_what_the_header_cannot_hold(values: dict[str, Any], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        control.encode(values)


# -- the contract -------------------------------------------------------------------------------

DIGEST = "sha256:" + "ab" * 32
X = TensorSig("x", "float32", ("b", N))


@pytest.mark.parametrize("inputs, names, match", [
    ((X,), ("pos",), r"control\[0\]: 'pos' is not an input of the stage"),
    ((X, TensorSig("pos", "float32", ("b",))), ("pos",), "'pos' must be int32, found float32"),
    ((X, TensorSig("pos", "int32", ("b", 2))), ("pos",), "'pos' must have one axis"),
    ((X, TensorSig("row", "int32", ("b",))), ("row",), "'row' is not a StepControl field"),
    ((X, TensorSig("pos", "int32", ("b",))), ("pos", "pos"), r"control\[1\]: duplicate"),
])
def test_a_spec_with_bad_control_is_refused(inputs: tuple[TensorSig, ...],
                                            names: tuple[str, ...], match: str) -> None:
    spec = StageSpec(DIGEST, inputs=inputs, outputs=(X,), control=names)
    with pytest.raises(SpecError, match=match):
        StageSpec.deserialize(spec.serialize())


def test_a_model_with_bad_control_is_refused() -> None:
    with pytest.raises(SpecError, match="control input 'seed' is not one of its inputs"):
        Model("m", [Unit("u", _shift)], inputs={"x": ("b, 4", "float32")}, control=("seed",))
    with pytest.raises(SpecError, match="'length' must be int32, found float32"):
        Model("m", [Unit("u", _shift)], inputs={"x": ("b, 4", "float32"),
                                                "length": ("b", "float32")}, control=("length",))


def test_every_stage_reads_control_and_none_forwards_it() -> None:
    model = control_model()
    built = build_stage_specs(model, [range(1), range(1, 2)], platforms=("cpu",))
    first, second = (b.spec for b in built)
    assert [t.name for t in first.outputs] == ["x"]  # only the activation crosses the hop
    assert {t.name for t in second.inputs} == {"x", *CONTROL}
    assert first.control == second.control == CONTROL
    # The artifact records the same signature (read back from jax.export's own description).
    assert [t.name for t in built[1].artifact.meta.inputs] == [t.name for t in second.inputs]


def test_a_unit_that_changes_control_is_refused_at_export() -> None:
    with pytest.raises(SpecError, match=r"unit 'u0' returned new values for the step control "
                                        r"\['pos'\]; control inputs are read-only"):
        build_stage_specs(control_model((_rewrite_pos, _shift)), [range(2)],
                          platforms=("cpu",))


def test_in_process_two_stages_match_numpy(tmp_path: Any) -> None:
    with InProcessPipeline(control_model(), weights_roots=[str(tmp_path)], stages=2) as pipe:
        for seed in range(3):
            inputs = step(seed=seed)
            np.testing.assert_allclose(pipe.call(inputs)["x"], reference(inputs), rtol=1e-6)


# -- real workers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    root = tmp_path_factory.mktemp("control-root")
    workers = spawn_workers(2, weights_roots=[str(root)])
    try:
        with Cluster.connect([w.address for w in workers]) as cluster:
            yield cluster.deploy(control_model(), stages=2)
    finally:
        stop_workers(workers)


class _Raw:
    """Hand-made frames to the first stage, and the errors that come back."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe = pipe
        self.reply_to = f"control-{uuid.uuid4().hex}"
        self.client = WorkerClient(pipe.clients[0].address)
        self.events: queue.Queue[Any] = queue.Queue()
        self.call = self.client.subscribe(pipe.pipeline_id, self.reply_to, pipe.key)
        threading.Thread(target=self._read, daemon=True).start()
        assert not isinstance(self.events.get(timeout=30), BaseException)  # the greeting
        self.sender = self.client.sender()

    def _read(self) -> None:
        try:
            for view in self.call:
                self.events.put(view)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            self.events.put(exc)

    def error_of(self, tensors: dict[str, Any], ctl: bytes, request_id: int) -> pb.RemoteError:
        header = FrameHeader(self.pipe.pipeline_id, "", 0, 0, request_id, self.reply_to,
                             control=ctl, key=self.pipe.key)
        for msg in split_frame(header, tensors):
            self.sender.send(msg, timeout=30)
        while True:
            item = self.events.get(timeout=60)
            assert not isinstance(item, BaseException), item
            assert item.result is None or item.result.msg.request_id != request_id, \
                "the bad frame was computed"
            if item.msg.WhichOneof("kind") == "error" and item.msg.request_id == request_id:
                return item.msg.error

    def close(self) -> None:
        self.sender.close()
        self.call.cancel()
        self.client.close()


def test_two_workers_match_numpy(deployed: Pipeline) -> None:
    for seed in range(3):
        inputs = step(seed=seed)
        np.testing.assert_allclose(deployed.call(inputs, timeout=60)["x"], reference(inputs),
                                   rtol=1e-6)


def test_control_in_the_wrong_place_is_refused_and_the_worker_serves_on(deployed: Pipeline
                                                                        ) -> None:
    inputs = step()
    tensors, ctl = control.split(inputs, CONTROL)
    raw = _Raw(deployed)
    try:
        e = raw.error_of(inputs, ctl, 1)  # control sent as tensors as well
        assert (e.code, e.type, e.stage) == ("INVALID_ARGUMENT", "SpecError", 0)
        assert "['pos', 'length', 'temperature'] came as tensors" in e.message
        e = raw.error_of(tensors, control.encode({"pos": inputs["pos"]}), 2)
        assert (e.code, e.type) == ("INVALID_ARGUMENT", "SpecError")
        assert "header lacks ['length', 'temperature'] (it has ['pos'])" in e.message
        e = raw.error_of(tensors, control.encode({**{k: inputs[k] for k in CONTROL},
                                                  "pos": inputs["pos"][:1]}), 4)
        assert (e.code, e.type) == ("INVALID_ARGUMENT", "SpecError")
        assert "input 'pos': symbol 'b' is 2 in an earlier input but 1 here" in e.message
    finally:
        raw.close()
    # A header protobuf cannot parse makes a malformed Frame: its stream is refused, as for any
    # malformed frame (the worker's own reader of the bytes is checked in the codec tests).
    broke: queue.Queue[Exception] = queue.Queue()
    client = WorkerClient(deployed.clients[0].address)
    sender = client.sender(on_error=broke.put)
    try:
        header = FrameHeader(deployed.pipeline_id, "", 0, 0, 5, "nobody",
                             control=protowire.field_prefix(2, 3) + bytes(3))
        for msg in split_frame(header, tensors):
            sender.send(msg, timeout=30)
        error = broke.get(timeout=60)
        assert "INVALID_ARGUMENT" in str(error) and "malformed Frame message" in str(error)
    finally:
        sender.close()
        client.close()
    np.testing.assert_allclose(deployed.call(inputs, timeout=60)["x"], reference(inputs),
                               rtol=1e-6)
