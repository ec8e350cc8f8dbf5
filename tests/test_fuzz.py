"""Fuzzing of every decoder that reads bytes from the network or from a weight file.

Decoders under test, and the one error type each documents:

* the frame path: ``pb.Frame.FromString`` then ``frames.FrameAssembler`` (what the coordinator
  does with ``pb.Frame`` objects), the data plane's own deserializers ``frames.parse_frame`` /
  ``frames.parse_event`` (both paths: protobuf below ``SCAN_MIN_BYTES``, the wire scan above it),
  ``codec.parse_tensor``, ``protowire.fields`` and ``codec.TensorAssembler`` -> ``CodecError``,
  or ``LimitError`` from an assembler for a tensor over its limits (the worker's, or the
  defaults the coordinator's assembler has);
* the tensor codec, ``codec.from_bytes`` -> ``CodecError``;
* the spec decoder, ``StageSpec.deserialize`` -> ``SpecError``;
* the artifact loader, ``vetting.load_artifact`` with ``expected_digest`` = the digest of the
  fuzzed bytes -> ``ArtifactError``;
* the weight readers, ``weights.gguf.GGUFFile`` / ``weights.safetensors.SafetensorsFile`` /
  ``read_index`` and ``WeightCache.describe`` / ``metadata`` (what ``DescribeWeights`` runs) on
  fuzzed files -> ``WeightError``.

The property is the same everywhere: a decoder returns a well-formed value or raises its
documented ``JaxdistError`` subclass; no other exception, and no hang (each example runs under a
SIGALRM deadline of ``EXAMPLE_DEADLINE_S``; pytest-timeout's thread method backs it up).

Inputs are mostly *mutations of valid encodings* (bit flips, byte sets, inserts, deletes,
truncations, splices of interesting values), plus structured messages with hostile field values:
random bytes almost never get past a protobuf or flatbuffer's first byte.

**Artifacts.** The embedded StableHLO module is parsed by MLIR's native bytecode reader, and a
flipped byte *inside* it can abort the process (``malloc(): invalid size``, ``LLVM ERROR``,
documented in ``jaxdist/core/vetting.py``; the digest check is what protects a worker). So the
artifact fuzzer mutates only the flatbuffer around the module (the root table, vtables, the
module's length prefix, platform and name strings, shardings, avals) and truncates anywhere. It
runs in a child process, so a native abort fails this test with the offending input instead of
killing the whole pytest run.

**Known bugs.** Each bug the fuzzers found has its own ``test_error_<case>`` regression test below.
While a bug is open, its test is marked ``xfail(strict=True)`` with the bug in the reason, and the
fuzzers tolerate exactly its signature (exception type and message, :data:`KNOWN_BUGS`) so they
keep checking everything else. When a bug is fixed, its regression test passes, strict xfail
turns that into a failure, and whoever fixed it deletes the mark and the :data:`KNOWN_BUGS`
entry. None is open now.

**Budget.** The default run (``make test``) is derandomized (the same inputs every time) and
does a quarter of the shares below, 2,750 inputs across the decoders in about 8 s of CPU. The
slow tier (``make test-slow``) runs the full 11,000 with a fixed seed, so it draws other inputs
than the default run, the same ones in every CI run. A long run scales every fuzzer and draws
new random inputs each time::

    JAXDIST_FUZZ_EXAMPLES=200000 pytest tests/test_fuzz.py -p no:cacheprovider

``JAXDIST_FUZZ_EXAMPLES`` is the total number of inputs, split across the fuzzers in proportion to
their shares. ``JAXDIST_FUZZ_SEED=N`` makes a long run reproducible.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from jaxdist.core import codec, protowire
from jaxdist.core.errors import (
    ArtifactError,
    CodecError,
    JaxdistError,
    LimitError,
    SpecError,
    WeightError,
)
from jaxdist.core.spec import StageSpec
from jaxdist.core.transport import frames
from jaxdist.core.weights import WeightCache
from jaxdist.core.weights.gguf import GGUFFile
from jaxdist.core.weights.safetensors import SafetensorsFile, read_index
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.worker.config import WorkerConfig

WORKER = WorkerConfig()  # the worker's default limits (its CLI cannot change them)

# ---------------------------------------------------------------------------------------------
# Budget and settings

DEFAULT_SHARES = {  # inputs per fuzzer in the slow tier (11,000 in all); the default: a quarter
    "protowire": 2000, "from_bytes": 1000, "pb_frame": 700, "parse_frame": 1000,
    "scan_frame": 500, "parse_event": 900, "coordinator_assembler": 400, "spec_bytes": 1800,
    "spec_structured": 400, "artifact": 800, "gguf": 600, "safetensors": 600,
    "safetensors_index": 300,
}
_TOTAL = os.environ.get("JAXDIST_FUZZ_EXAMPLES", "").strip()
_SEED = os.environ.get("JAXDIST_FUZZ_SEED", "").strip()
LONG_RUN = bool(_TOTAL)
DEFAULT_FRACTION = 4  # the default run does 1/4 of each share
EXAMPLE_DEADLINE_S = 10.0  # per input; every input here is small, so this only catches hangs
EXAMPLES_RUN: dict[str, int] = {}


def budget(name: str) -> int:
    """Inputs for one fuzzer: its default share, or its share of JAXDIST_FUZZ_EXAMPLES."""
    share = DEFAULT_SHARES[name]
    if not LONG_RUN:
        return max(1, share // DEFAULT_FRACTION)
    return max(1, int(int(_TOTAL) * share / sum(DEFAULT_SHARES.values())))


def fuzz_settings(name: str) -> Callable[[Any], Any]:
    """Hypothesis settings of one fuzzer (derandomized unless this is a long run)."""
    s = settings(max_examples=budget(name), deadline=None, derandomize=not LONG_RUN,
                 database=None, print_blob=True,
                 suppress_health_check=list(HealthCheck))

    def apply(fn: Any) -> Any:
        fn = s(fn)
        return seed(int(_SEED))(fn) if LONG_RUN and _SEED else fn
    return apply


def timeout_for(name: str) -> pytest.MarkDecorator:
    """pytest-timeout backstop for a whole fuzzer; the thread method leaves SIGALRM to us."""
    return pytest.mark.timeout(120 + budget(name) // 20, method="thread")


class Hang(AssertionError):
    """An input took longer than EXAMPLE_DEADLINE_S."""


@contextlib.contextmanager
def deadline(seconds: float = EXAMPLE_DEADLINE_S) -> Iterator[None]:
    """Raise Hang if the block runs longer than ``seconds`` (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"input took more than {seconds}s (hang?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def count(name: str) -> None:
    EXAMPLES_RUN[name] = EXAMPLES_RUN.get(name, 0) + 1


def run_fuzzer(name: str, fuzz: Callable[[], None]) -> None:
    """Run one hypothesis fuzzer and check it really ran (about) its budget of inputs."""
    EXAMPLES_RUN[name] = 0
    fuzz()
    n = EXAMPLES_RUN[name]
    assert n >= 0.9 * budget(name), f"{name}: only {n} of {budget(name)} inputs were run"


# ---------------------------------------------------------------------------------------------
# Known bugs: tolerated by the fuzzers while open; each has an xfail(strict) regression test.

KNOWN_BUGS: dict[str, tuple[tuple[type[BaseException], ...], str]] = {
    # None open. An entry: "name": ((exception types,), r"message regex"), with a comment on
    # the bug; the fuzzers that meet it pass its name to outcome().
}
KNOWN_HITS: dict[str, int] = {}


def outcome(fn: Callable[[], Any],
            expected: type[JaxdistError] | tuple[type[JaxdistError], ...],
            *known: str) -> tuple[Any, Any]:
    """Run one decoder call: ``(value, None)``, or ``(None, error)`` for a documented error type
    or a tolerated known bug. Anything else fails the example with the exception chained."""
    try:
        return fn(), None
    except expected as exc:
        return None, exc
    except Hang:
        raise
    except Exception as exc:  # the point: classify every exception
        for key in known:
            types, pattern = KNOWN_BUGS[key]
            if isinstance(exc, types) and re.search(pattern, str(exc)):
                KNOWN_HITS[key] = KNOWN_HITS.get(key, 0) + 1
                return None, exc
        names = " or ".join(t.__name__ for t in (
            expected if isinstance(expected, tuple) else (expected,)))
        raise AssertionError(f"expected {names} or a value, got "
                             f"{type(exc).__module__}.{type(exc).__name__}: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# Mutations


INTERESTING = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\x01", b"\xff\xff\xff\xff\x0f",
               b"\xff" * 9 + b"\x01", b"\x80" * 10, b"\xfe\xff\xff\xff\xff\xff\xff\xff\xff\x01",
               struct.pack("<I", 0xFFFFFFFF), struct.pack("<I", 0x7FFFFFFF),
               struct.pack("<Q", 1 << 63),
               struct.pack("<i", -1), struct.pack("<i", -8)]


@st.composite
def mutation_of(draw: st.DrawFn, data: bytes, allowed: Callable[[int], bool] | None = None,
                max_ops: int = 4) -> bytes:
    """``data`` with 1..max_ops mutations. ``allowed(pos)`` limits where bytes may change
    (truncation is always allowed: it only cuts)."""
    buf = bytearray(data)

    def position(extra: int = 0) -> int | None:
        n = len(buf) + extra
        if n <= 0:
            return None
        for _ in range(8):
            p = draw(st.integers(0, n - 1))
            if allowed is None or allowed(p):
                return p
        return None

    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(["flip", "set", "interesting", "insert", "delete", "truncate",
                                   "duplicate", "append"]))
        if op == "truncate":
            del buf[draw(st.integers(0, len(buf))):]
            continue
        if op == "append" and allowed is None:
            buf += draw(st.binary(min_size=1, max_size=16))
            continue
        p = position()
        if p is None:
            continue
        if op == "flip":
            buf[p] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            buf[p] = draw(st.integers(0, 255))
        elif op == "interesting":
            value = draw(st.sampled_from(INTERESTING))
            end = min(len(buf), p + len(value))
            if allowed is None or all(allowed(i) for i in range(p, end)):
                buf[p:end] = value[:end - p]
        elif allowed is not None:  # length-changing ops would move the protected region
            buf[p] = draw(st.integers(0, 255))
        elif op == "insert":
            buf[p:p] = draw(st.binary(min_size=1, max_size=8) | st.sampled_from(INTERESTING))
        elif op == "delete":
            del buf[p:p + draw(st.integers(1, 8))]
        elif op == "duplicate":
            n = draw(st.integers(1, 16))
            buf[p:p] = buf[p:p + n]
    return bytes(buf)


def mutated(seeds: list[bytes], **kw: Any) -> st.SearchStrategy[bytes]:
    return st.sampled_from(seeds).flatmap(lambda s: mutation_of(s, **kw))


# ---------------------------------------------------------------------------------------------
# Tensors and frames

DTYPES = [np.float32, np.float16, np.int32, np.int64, np.uint8, np.bool_, np.float64]


def _seed_tensors() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    import ml_dtypes
    return [
        {"x": rng.standard_normal((2, 3)).astype(np.float32)},
        {"tokens": np.arange(6, dtype=np.int32).reshape(1, 6), "pos": np.zeros(1, np.int64)},
        {"s": np.array(3.5, np.float32), "b": np.array([True, False]),
         "h": np.ones((2, 2), ml_dtypes.bfloat16)},
        {"e": np.zeros((0, 4), np.float16), "u": np.arange(40, dtype=np.uint8)},
        {f"t{i}": np.full((3,), i, DTYPES[i % len(DTYPES)]) for i in range(5)},
    ]


SEED_TENSORS = _seed_tensors()
TENSOR_SEEDS = [codec.to_bytes(k, v) for t in SEED_TENSORS for k, v in t.items()]
HEADER = frames.FrameHeader("pipe", "sess", 3, 0, request_id=7, reply_to="me")


def _frame_seeds() -> list[list[bytes]]:
    """Frames (lists of messages); small chunk sizes make multi-message, chunked frames."""
    out = []
    for tensors in SEED_TENSORS:
        for chunk in (8, 64, codec.DEFAULT_CHUNK_BYTES):
            out.append(list(frames.split_frame(HEADER, tensors, chunk_bytes=chunk)))
    out.append(list(frames.split_frame(HEADER, {})))
    return out


FRAME_SEEDS = _frame_seeds()
FRAME_MSG_SEEDS = [m for f in FRAME_SEEDS for m in f]
EVENT_SEEDS = [m for t in SEED_TENSORS for chunk in (16, 1 << 20)
               for m in frames.result_events(HEADER, t, chunk_bytes=chunk)]
EVENT_SEEDS += [pb.Event(error=pb.RemoteError(code="INTERNAL", type="X", message="m", stage=1),
                         request_id=3, session_id="s").SerializeToString(),
                pb.Event(heartbeat=1.5).SerializeToString()]
# Unknown field 15, 64 KiB: pushes a message over SCAN_MIN_BYTES onto the wire-scan path.
SCAN_PAD = protowire.field_prefix(15, frames.SCAN_MIN_BYTES) + bytes(frames.SCAN_MIN_BYTES)


@st.composite
def tensor_messages(draw: st.DrawFn) -> bytes:
    """A Tensor message with hostile header values (shape, dtype enum, offsets, sizes)."""
    small = st.integers(0, 8)
    dim = small | st.integers(-(1 << 63), (1 << 63) - 1) | st.sampled_from(
        [0, 1, 1 << 31, 1 << 32, 1 << 62, (1 << 63) - 1, -1])
    shape = draw(st.lists(dim, max_size=4) | st.lists(st.just(1), min_size=60, max_size=70)
                 | st.lists(st.sampled_from([0, 1 << 62, 1 << 40]), min_size=1, max_size=4))
    enum = draw(st.integers(0, 14) | st.integers(-(1 << 31), (1 << 31) - 1))
    data = draw(st.binary(max_size=64))
    itemsize = codec._NP_BY_ENUM[enum].itemsize if enum in codec._NP_BY_ENUM else 1
    declared = itemsize * int(np.prod(shape, dtype=object)) if shape else itemsize
    total = draw(st.sampled_from([0, len(data)]) | st.integers(0, (1 << 64) - 1)
                 | st.just(declared % (1 << 64)))  # consistent with the shape: a real chunk
    offset = draw(st.sampled_from([0]) | st.integers(0, (1 << 64) - 1))
    name = draw(st.sampled_from(["x", "", "y"]) | st.text(max_size=8))
    return pb.Tensor(name=name, dtype=enum, shape=shape, data=data, offset=offset,
                     total_bytes=total).SerializeToString()


def check_tensor(name: str, arr: np.ndarray) -> None:
    assert isinstance(arr, np.ndarray), (name, type(arr))
    assert arr.nbytes == int(np.prod(arr.shape, dtype=object)) * arr.dtype.itemsize


@fuzz_settings("protowire")
@given(data=mutated(TENSOR_SEEDS + FRAME_MSG_SEEDS[:20]) | st.binary(max_size=64))
def _fuzz_protowire_fields(data: bytes) -> None:
    count("protowire")
    with deadline():
        fields, err = outcome(lambda: list(protowire.fields(memoryview(data))), CodecError)
    if err is None:
        for field, wire_type, start, value, end in fields:
            assert field > 0 and 0 <= start < end <= len(data)


@timeout_for("protowire")
def test_fuzz_protowire_fields() -> None:
    run_fuzzer("protowire", _fuzz_protowire_fields)


@fuzz_settings("from_bytes")
@given(data=mutated(TENSOR_SEEDS) | tensor_messages() | st.binary(max_size=48))
def _fuzz_codec_from_bytes(data: bytes) -> None:
    count("from_bytes")
    with deadline():
        value, err = outcome(lambda: codec.from_bytes(data), CodecError)
        chunk, err2 = outcome(lambda: codec.parse_tensor(memoryview(data), 0, len(data)),
                              CodecError)
    if err is None:
        check_tensor(*value)
    if err2 is None and err is None:  # both readers agree on what they both accept
        assert chunk[0] == value[0]


@timeout_for("from_bytes")
def test_fuzz_codec_from_bytes() -> None:
    run_fuzzer("from_bytes", _fuzz_codec_from_bytes)


def _worker_limits() -> dict[str, int]:
    """The worker's frame limits (WorkerConfig defaults), as Push's FrameAssembler gets them."""
    return {"max_bytes": WORKER.max_frame_tensor_bytes, "max_tensors": WORKER.max_tensors_per_frame}


@st.composite
def frame_streams(draw: st.DrawFn, hostile_tensor: bool = False) -> list[bytes]:
    """A stream of Frame messages: seed frames, some messages mutated, dropped, repeated,
    reordered or mixed with another frame's (which the assembler must refuse, not crash on).
    With ``hostile_tensor``, a hostile Tensor is always added to one message."""
    msgs = list(draw(st.sampled_from(FRAME_SEEDS)))
    if draw(st.booleans()):
        msgs += draw(st.sampled_from(FRAME_SEEDS))
    for i in draw(st.lists(st.integers(0, len(msgs) - 1), max_size=3)):
        msgs[i] = draw(mutation_of(msgs[i]))
    edit = "tensor" if hostile_tensor else draw(
        st.sampled_from(["none", "none", "drop", "repeat", "swap", "tensor"]))
    if edit == "drop" and len(msgs) > 1:
        del msgs[draw(st.integers(0, len(msgs) - 1))]
    elif edit == "repeat":
        msgs.append(msgs[draw(st.integers(0, len(msgs) - 1))])
    elif edit == "swap" and len(msgs) > 1:
        i = draw(st.integers(0, len(msgs) - 2))
        msgs[i], msgs[i + 1] = msgs[i + 1], msgs[i]
    elif edit == "tensor":  # a hostile Tensor appended to a message (field 5 of Frame)
        t = draw(tensor_messages())
        i = draw(st.integers(0, len(msgs) - 1))
        msgs[i] += protowire.field_prefix(5, len(t)) + t
    return msgs


def _assemble(views: list[Any], asm: frames.FrameAssembler) -> None:
    """Feed views to an assembler the way Push does: errors reset it and the stream goes on."""
    for view in views:
        result, err = outcome(lambda view=view: asm.add(view), (CodecError, LimitError))
        if err is not None:
            asm.reset()
        elif result is not None:
            header, tensors = result
            assert isinstance(header, frames.FrameHeader)
            for name, arr in tensors.items():
                check_tensor(name, arr)


@fuzz_settings("pb_frame")
@given(msgs=frame_streams())
def _fuzz_pb_frame_and_assembler(msgs: list[bytes]) -> None:
    """``pb.Frame.FromString`` (protobuf's DecodeError is its own documented error) then the
    assembler with the worker's limits, as the coordinator assembles ``pb.Frame`` objects."""
    count("pb_frame")
    parsed = []
    with deadline():
        for data in msgs:
            try:
                parsed.append(pb.Frame.FromString(data))
            except DecodeError:
                break
        _assemble(parsed, frames.FrameAssembler(**_worker_limits()))


@timeout_for("pb_frame")
def test_fuzz_pb_frame_and_assembler() -> None:
    run_fuzzer("pb_frame", _fuzz_pb_frame_and_assembler)


def _parse_views(msgs: list[bytes], parse: Callable[[bytes], Any]) -> list[Any]:
    views = []
    for data in msgs:
        view, err = outcome(lambda data=data: parse(data), CodecError)
        if err is not None:
            break  # gRPC ends the stream when the request deserializer raises
        views.append(view)
    return views


@fuzz_settings("parse_frame")
@given(msgs=frame_streams())
def _fuzz_parse_frame_and_assembler(msgs: list[bytes]) -> None:
    """The worker's Push path: ``parse_frame`` (the request deserializer), then the assembler
    with the worker's limits."""
    count("parse_frame")
    with deadline():
        views = _parse_views(msgs, frames.parse_frame)
        _assemble(views, frames.FrameAssembler(**_worker_limits()))


@timeout_for("parse_frame")
def test_fuzz_parse_frame_and_assembler() -> None:
    run_fuzzer("parse_frame", _fuzz_parse_frame_and_assembler)


@fuzz_settings("scan_frame")
@given(msgs=frame_streams(), pad_first=st.booleans())
def _fuzz_parse_frame_scan_path(msgs: list[bytes], pad_first: bool) -> None:
    """Messages padded past SCAN_MIN_BYTES (an unknown field) take the wire-scan parser."""
    count("scan_frame")
    padded = [SCAN_PAD + m if pad_first else m + SCAN_PAD for m in msgs]
    with deadline():
        views = _parse_views(padded, frames.parse_frame)
        _assemble(views, frames.FrameAssembler(**_worker_limits()))


@timeout_for("scan_frame")
def test_fuzz_parse_frame_scan_path() -> None:
    run_fuzzer("scan_frame", _fuzz_parse_frame_scan_path)


@fuzz_settings("parse_event")
@given(data=mutated(EVENT_SEEDS), pad=st.booleans())
def _fuzz_parse_event(data: bytes, pad: bool) -> None:
    """The coordinator's Subscribe deserializer, both paths; a result goes to an assembler."""
    count("parse_event")
    data = data + SCAN_PAD if pad else data
    with deadline():
        view, err = outcome(lambda: frames.parse_event(data), CodecError)
        if err is None and view.result is not None:
            _assemble([view.result], frames.FrameAssembler(**_worker_limits()))


@timeout_for("parse_event")
def test_fuzz_parse_event() -> None:
    run_fuzzer("parse_event", _fuzz_parse_event)


@fuzz_settings("coordinator_assembler")
@given(msgs=frame_streams(hostile_tensor=True))
def _fuzz_coordinator_assembler(msgs: list[bytes]) -> None:
    """The coordinator (``Pipeline._receive``) assembles results with ``FrameAssembler()``: the
    default limits. Every stream here carries a tensor with hostile header values."""
    count("coordinator_assembler")
    with deadline():
        views = _parse_views(msgs, frames.parse_frame)
        _assemble(views, frames.FrameAssembler())


@timeout_for("coordinator_assembler")
def test_fuzz_coordinator_assembler_default_limits() -> None:
    run_fuzzer("coordinator_assembler", _fuzz_coordinator_assembler)


# ---------------------------------------------------------------------------------------------
# Specs

DIGEST = "sha256:" + "ab" * 32


def _seed_specs() -> list[bytes]:
    from jaxdist.core.spec import ShapeBucket, StateSig, TensorSig, Versions, WeightRef

    base = StageSpec(
        artifact_digest=DIGEST, inputs=(TensorSig("x", "float32", ("b", 32)),),
        outputs=(TensorSig("x", "float32", ("b", 32)),),
        weights=tuple(WeightRef(f"l{i}.w", f"safetensors://mlp.safetensors#l{i}.w", (32, 32),
                                "float32") for i in range(2)),
        device="cpu", stage_index=0, num_stages=2, next_hop="127.0.0.1:5000",
        buckets=(ShapeBucket({"b": 4}),), platforms=("cpu",),
        versions=Versions(jax="0.10.2", jaxlib="0.10.2", serialization_version=3,
                          calling_convention_version=10, stablehlo="1.17.0"),
        model="mlp", stage_id="p/0")
    llm = base.replace(
        inputs=(TensorSig("tokens", "int32", ("b", "s")), TensorSig("pos", "int32", ("b",))),
        outputs=(TensorSig("token", "int32", ("b",)),),
        state=(StateSig("k", "bfloat16", (1, 8, 2, 4)), StateSig("v", "bfloat16", (1, 8, 2, 4))),
        weights=(WeightRef("emb", "gguf://m.gguf#token_embd.weight", (64, 16), "uint8",
                           sha256="0" * 64, packed=True, quant="Q8_0"),
                 WeightRef("raw", "file://raw.bin", (4,), "float16", transpose=True)),
        stage_index=1, next_hop="", buckets=(ShapeBucket({"b": 1, "s": 8}),),
        artifact=b"\x10\x00\x00\x00inline-artifact-bytes")
    return [base.serialize(), llm.serialize()]


SPEC_SEEDS = _seed_specs()


def _check_spec(data: bytes) -> None:
    spec, err = outcome(lambda: StageSpec.deserialize(data), SpecError)
    if err is None:  # a spec that validates survives a round trip unchanged
        assert StageSpec.deserialize(spec.serialize()) == spec


@fuzz_settings("spec_bytes")
@given(data=mutated(SPEC_SEEDS) | st.binary(max_size=64))
def _fuzz_spec_bytes(data: bytes) -> None:
    count("spec_bytes")
    with deadline():
        _check_spec(data)


@timeout_for("spec_bytes")
def test_fuzz_spec_bytes() -> None:
    run_fuzzer("spec_bytes", _fuzz_spec_bytes)


_WEIRD = ["", " ", "-1", "--5", "²", "٣", "1e3", "0x10", "b", "b-1", "_", "007", "9" * 30,
          "\x00", "é", "b ", "1.5", "+3", "𝟙"]


def _texts(*good: str) -> st.SearchStrategy[str]:
    return st.sampled_from(list(good) + _WEIRD) | st.text(max_size=12)


@st.composite
def structured_specs(draw: st.DrawFn) -> bytes:
    """A StageSpec message whose every field may hold a hostile value."""
    i64 = st.integers(0, 8) | st.integers(-(1 << 63), (1 << 63) - 1)
    dtype = _texts("float32", "bfloat16", "int32", "uint8", "f32", "complex64", "float8")
    dims = st.lists(_texts("b", "s", "4", "32", "0"), max_size=4)
    sig = st.builds(pb.TensorSig, name=_texts("x", "y", "tokens"), dtype=dtype, dims=dims)
    state = st.builds(pb.StateSig, name=_texts("k", "v"), dtype=dtype,
                      shape=st.lists(i64, max_size=4))
    uri = st.sampled_from(["gguf://m.gguf#t", "safetensors://a.safetensors#w", "file://r.bin",
                           "file://r.bin#t", "s3://b/k", "gguf://#t", "gguf://m.gguf#",
                           "safetensors://../x#w", "gguf:///etc/passwd#t", ""]) \
        | st.text(max_size=20)
    weight = st.builds(pb.WeightRef, param=_texts("w", "emb"), uri=uri,
                       shape=st.lists(i64, max_size=3), dtype=dtype,
                       sha256=st.sampled_from(["", "0" * 64, "A" * 64, "0" * 63, "g" * 64]),
                       packed=st.booleans(), layout=st.integers(0, 3),
                       quant=st.sampled_from(["", "Q8_0", "Q4_1", "NOPE"]))
    bucket = st.builds(pb.ShapeBucket, dims=st.dictionaries(_texts("b", "s"), i64, max_size=3))
    msg = pb.StageSpec(
        spec_version=draw(_texts("1.0", "1.9", "2.0", "1", "0.1", "1.0.0")),
        model=draw(st.text(max_size=8)),
        stage_index=draw(st.integers(0, 4) | st.integers(0, (1 << 32) - 1)),
        num_stages=draw(st.integers(0, 4) | st.integers(0, (1 << 32) - 1)),
        artifact_digest=draw(st.sampled_from([DIGEST, DIGEST.upper(), DIGEST[:-1], "sha256:",
                                              "md5:" + "0" * 32]) | st.text(max_size=10)),
        artifact=draw(st.binary(max_size=8)),
        inputs=draw(st.lists(sig, max_size=3)), outputs=draw(st.lists(sig, max_size=3)),
        state=draw(st.lists(state, max_size=2)), weights=draw(st.lists(weight, max_size=3)),
        device=draw(_texts("auto", "cpu", "cuda:1", "gpu", "tpu:3", "metal", "CPU ", "auto:1")),
        next_hop=draw(_texts("127.0.0.1:5000", "[::1]:80", "host:99999", "h:p", ":80")),
        buckets=draw(st.lists(bucket, max_size=2)),
        platforms=draw(st.lists(st.sampled_from(["cpu", "cuda", "x"]), max_size=2)),
        stage_id=draw(st.text(max_size=8)))
    return msg.SerializeToString()


@fuzz_settings("spec_structured")
@given(data=structured_specs())
def _fuzz_spec_structured(data: bytes) -> None:
    count("spec_structured")
    with deadline():
        _check_spec(data)


@timeout_for("spec_structured")
def test_fuzz_spec_structured() -> None:
    run_fuzzer("spec_structured", _fuzz_spec_structured)


# ---------------------------------------------------------------------------------------------
# Artifacts (in a child process: see the module docstring)


def _artifact_seeds() -> list[tuple[bytes, int, int]]:
    """(artifact bytes, start, end of the embedded StableHLO module) of a few real artifacts."""
    import jax.numpy as jnp
    from jax._src.export import serialization_generated as ser_flatbuf

    from jaxdist.core.artifacts import export_stage

    def dense(p: Any, s: Any, x: Any) -> Any:
        return {"y": jnp.tanh(x["x"] @ p["w"])}, {}

    def acc(p: Any, s: Any, x: Any) -> Any:
        total = s["acc"] + x["x"].sum(axis=0)
        return {"total": total}, {"acc": total}

    arts = [export_stage(dense, params={"w": ((4, 4), "float32")},
                         inputs={"x": ("b, 4", "float32")}, platforms=("cpu",)),
            export_stage(acc, params={}, state={"acc": ((4,), "float32")},
                         inputs={"x": ("b, 4", "float32")}, platforms=("cpu", "cuda", "tpu")),
            export_stage(dense, params={"w": ((4, 4), "float32")},
                         inputs={"x": ((2, 4), "float32")}, platforms=("metal",))]
    out = []
    for art in arts:
        module = ser_flatbuf.Exported.GetRootAs(art.data, 0).MlirModuleSerializedAsNumpy()
        start = (module.__array_interface__["data"][0]
                 - np.frombuffer(art.data, np.uint8).__array_interface__["data"][0])
        assert art.data[start:start + len(module)] == module.tobytes()
        out.append((art.data, start, start + len(module)))
    return out


def artifact_campaign(n: int, derandomize: bool, progress: str, seed_value: int | None) -> None:
    """Run the artifact fuzzer (in a child process). Writes each input to ``progress`` before
    vetting it, so a native abort can be traced to its input; prints ``examples=N`` at the end."""
    from jaxdist.core.vetting import digest_of, load_artifact

    seeds = _artifact_seeds()
    runs = [0]

    @st.composite
    def inputs(draw: st.DrawFn) -> bytes:
        data, start, end = draw(st.sampled_from(seeds))
        return draw(mutation_of(data, allowed=lambda p: not start <= p < end))

    @settings(max_examples=n, deadline=None, derandomize=derandomize, database=None,
              print_blob=True, suppress_health_check=list(HealthCheck))
    @given(data=inputs(), platform=st.sampled_from(["cpu", "cpu", "cuda", "metal"]))
    def run(data: bytes, platform: str) -> None:
        runs[0] += 1
        with open(progress, "w") as f:
            f.write(f"{platform} {data.hex()}\n")
        with deadline():
            exported, err = outcome(lambda: load_artifact(
                data, expected_digest=digest_of(data), platform=platform), ArtifactError)
        if err is None:
            assert exported.in_avals is not None

    if seed_value is not None:
        run = seed(seed_value)(run)
    run()
    print(f"examples={runs[0]}", flush=True)


@pytest.mark.timeout(300 + budget("artifact") // 10, method="thread")
def test_fuzz_load_artifact_flatbuffer_region(tmp_path: Path) -> None:
    n = budget("artifact")
    progress = tmp_path / "current-input.txt"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import test_fuzz
        test_fuzz.artifact_campaign({n}, {not LONG_RUN}, {str(progress)!r},
                                    {int(_SEED) if _SEED else None})
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          timeout=240 + n // 10,
                          env={**os.environ, "JAX_PLATFORMS": "cpu",
                               "TF_CPP_MIN_LOG_LEVEL": "3"})
    if proc.returncode < 0:
        last = progress.read_text() if progress.exists() else "(none)"
        pytest.fail(f"the artifact loader killed the process with signal {-proc.returncode} "
                    f"on input (platform, hex):\n{last}\nstderr tail:\n{proc.stderr[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    found = re.search(r"examples=(\d+)", proc.stdout)
    assert found and int(found.group(1)) >= 0.9 * n, proc.stdout[-2000:]
    EXAMPLES_RUN["artifact"] = int(found.group(1))


# ---------------------------------------------------------------------------------------------
# Weight files


def _gguf_seed(path: Path) -> bytes:
    from gguf import quants

    T, V = gguf.GGMLQuantizationType, gguf.GGUFValueType
    rng = np.random.default_rng(5)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("general.name", "fuzz")
    w.add_array("tokenizer.ggml.tokens", ["<s>", "hello", "wörld"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.0, -2.0])
    w.add_key_value("nested", [[1, 2], [3]], V.ARRAY)
    w.add_tensor("f32", rng.standard_normal((2, 8)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((3, 4)).astype(np.float16))
    src = rng.standard_normal((2, 64)).astype(np.float32)
    w.add_tensor("q8", quants.quantize(src, T.Q8_0), raw_dtype=T.Q8_0)
    w.add_tensor("q41", quants.quantize(src, T.Q4_1), raw_dtype=T.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


class _Files:
    """Fresh file names in one directory (a mapped file is never rewritten in place)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="jaxdist-fuzz-"))
        self.n = 0
        atexit.register(shutil.rmtree, self.dir, ignore_errors=True)

    def write(self, suffix: str, data: bytes) -> Path:
        self.n += 1
        path = self.dir / f"f{self.n}{suffix}"
        path.write_bytes(data)
        return path


FILES = _Files()
GGUF_SEED = _gguf_seed(FILES.dir / "seed.gguf")
# The header (KVs and tensor infos) is where the parser works; bias mutations there.
_GGUF_HEADER_END = GGUF_SEED.index(b"q41") + 64


@fuzz_settings("gguf")
@given(data=mutation_of(GGUF_SEED, allowed=None) | mutation_of(
    GGUF_SEED, allowed=lambda p: p < _GGUF_HEADER_END, max_ops=3) | st.binary(max_size=40))
def _fuzz_gguf_reader(data: bytes) -> None:
    count("gguf")
    path = FILES.write(".gguf", data)
    try:
        # Fuzzed quant scales decode to NaN/inf: numpy's warnings about them are expected.
        with deadline(), np.errstate(all="ignore"):
            reader, err = outcome(lambda: GGUFFile(path), WeightError)
            if err is None:
                outcome(reader.metadata, WeightError)
                for name in reader.names():
                    info, _ = outcome(lambda name=name: reader.info(name), WeightError)
                    arr, e = outcome(lambda name=name: reader.read(name), WeightError)
                    if e is None:
                        assert arr.shape == info.shape, (name, arr.shape, info.shape)
                reader.close()
            with WeightCache([FILES.dir]) as cache:
                outcome(lambda: cache.describe(path.name), WeightError)
                outcome(lambda: cache.metadata(path.name), WeightError)
    finally:
        path.unlink()


@timeout_for("gguf")
def test_fuzz_gguf_reader() -> None:
    run_fuzzer("gguf", _fuzz_gguf_reader)


def _safetensors_seed() -> bytes:
    import ml_dtypes
    path = FILES.dir / "seed.safetensors"
    rng = np.random.default_rng(6)
    save_file({"a": rng.standard_normal((2, 3)).astype(np.float32),
               "b": np.arange(4, dtype=np.int64), "c": np.ones((2, 2), ml_dtypes.bfloat16),
               "e": np.zeros((0,), np.float16)}, str(path), metadata={"format": "np"})
    return path.read_bytes()


SAFETENSORS_SEED = _safetensors_seed()


def _json_containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children,
                                                            max_size=3)


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70)
                     | st.sampled_from([1e999, -1e999, 0.5, float("nan")]) | st.text(max_size=6),
                     _json_containers, max_leaves=12)
_ENTRY = st.fixed_dictionaries(
    {}, optional={"dtype": st.sampled_from(["F32", "BF16", "I64", "F8_E4M3", "X"]) | _JSON,
                  "shape": st.lists(st.integers(-2, 6) | st.sampled_from([1 << 62, 1e999]),
                                    max_size=3) | _JSON,
                  "data_offsets": st.lists(st.integers(-2, 40) | st.sampled_from([1e999]),
                                           min_size=2, max_size=3) | _JSON})


@st.composite
def safetensors_files(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "header", "header", "nesting"]))
    if kind == "bytes":
        return draw(mutation_of(SAFETENSORS_SEED) | mutation_of(
            SAFETENSORS_SEED, allowed=lambda p: p < 8 + 200, max_ops=2))
    if kind == "nesting":
        depth = draw(st.sampled_from([10, 1000, 200_000]))
        head = ("[" * depth + "]" * depth).encode()
    else:
        keys = st.sampled_from(["a", "b", "__metadata__"]) | st.text(max_size=4)
        header = draw(st.dictionaries(keys, _ENTRY | _JSON, max_size=3))
        head = json.dumps(header).encode()  # allow_nan: 1e999 is written as Infinity
    n = len(head) + draw(st.sampled_from([0, 0, 1, -1, 1 << 40]))
    return struct.pack("<Q", max(0, n)) + head + bytes(draw(st.integers(0, 48)))


@fuzz_settings("safetensors")
@given(data=safetensors_files())
def _fuzz_safetensors_reader(data: bytes) -> None:
    count("safetensors")
    path = FILES.write(".safetensors", data)
    try:
        with deadline():
            reader, err = outcome(lambda: SafetensorsFile(path), WeightError)
            if err is None:
                for name in reader.names():
                    info = reader.info(name)
                    arr, e = outcome(lambda name=name: reader.read(name), WeightError)
                    if e is None:
                        assert arr.shape == info.shape and arr.nbytes == info.nbytes
                reader.close()
            with WeightCache([FILES.dir]) as cache:
                outcome(lambda: cache.describe(path.name), WeightError)
                outcome(lambda: cache.metadata(path.name), WeightError)
    finally:
        path.unlink()


@timeout_for("safetensors")
def test_fuzz_safetensors_reader() -> None:
    run_fuzzer("safetensors", _fuzz_safetensors_reader)


@fuzz_settings("safetensors_index")
@given(doc=_JSON | st.fixed_dictionaries({"weight_map": _JSON}),
       raw=st.none() | st.binary(max_size=24))
def _fuzz_safetensors_index(doc: Any, raw: bytes | None) -> None:
    count("safetensors_index")
    data = raw if raw is not None else json.dumps(doc).encode()
    path = FILES.write(".json", data)
    try:
        with deadline():
            index, err = outcome(lambda: read_index(path), WeightError)
        if err is None:
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in index.items())
    finally:
        path.unlink()


@timeout_for("safetensors_index")
def test_fuzz_safetensors_index() -> None:
    run_fuzzer("safetensors_index", _fuzz_safetensors_index)


# ---------------------------------------------------------------------------------------------
# Regression tests of the bugs the fuzzers found (xfail while open; see KNOWN_BUGS)


@pytest.mark.parametrize("dim", ["²", "--5", "1" * 5000, "1" * 19, "b\n"],
                         ids=["superscript", "double-minus", "5000-digits", "19-digits",
                              "trailing-newline"])
def test_error_spec_dim_not_ascii_integer(dim: str) -> None:
    """Fixed: ``str.isdigit()`` took '²' and '--5' (then int() raised ValueError), and int()
    refuses 4301+ digits. A dim is an int only for 1 to 18 ASCII digits."""
    msg = pb.StageSpec.FromString(SPEC_SEEDS[0])
    msg.outputs[0].dims[1] = dim
    with pytest.raises(SpecError, match=r"^StageSpec\.outputs\[0\]\.dims\[1\]: expected an "
                                        r"integer or a symbol name, found ") as info:
        StageSpec.deserialize(msg.SerializeToString())
    assert len(str(info.value)) < 300  # a hostile value is clipped in the message


@pytest.mark.parametrize("dim, value", [("0", 0), ("32", 32), ("-4", -4), ("9" * 18, int("9" * 18)),
                                        ("b", "b"), ("²", "²")])
def test_parse_dim(dim: str, value: int | str) -> None:
    from jaxdist.core.dims import parse_dim
    assert parse_dim(dim) == value and type(parse_dim(dim)) is type(value)


@pytest.mark.parametrize("version", ["².0", "1" * 5000, "٣.0", "1\n.0"],
                         ids=["superscript", "5000-digits", "arabic-indic", "newline"])
def test_error_spec_version_not_ascii_integer(version: str) -> None:
    """Fixed: the major version passed ``str.isdigit()``, then int() raised ValueError."""
    msg = pb.StageSpec.FromString(SPEC_SEEDS[0])
    msg.spec_version = version
    with pytest.raises(SpecError, match=r"^StageSpec\.spec_version: unsupported version .*; this "
                                        r"jaxdist reads major versions \(1,\)"):
        StageSpec.deserialize(msg.SerializeToString())


@pytest.mark.parametrize("shape, message", [
    ([1] * 65, r"rank 65 is over the largest supported rank of 64"),
    ([0, 1 << 62, 1 << 62], r"is over numpy's largest array"),
    ([16, 32] + [64] * 9 + [0], r"is over numpy's largest array")],
    ids=["rank-65", "zero-huge", "zero-overflowing-product"])
def test_error_codec_shape_numpy_cannot_make(shape: list[int], message: str) -> None:
    """Fixed: a shape numpy cannot make (rank > 64; non-zero dims whose product times the item
    size reaches 2**63, even next to a zero) got numpy's ValueError from reshape."""
    empty = 0 in shape
    data = pb.Tensor(name="x", dtype=pb.U8, shape=shape, data=b"" if empty else b"\0",
                     total_bytes=0 if empty else 1).SerializeToString()
    with pytest.raises(CodecError, match=rf"^tensor 'x': .*{message}"):
        codec.from_bytes(data)
    with pytest.raises(CodecError, match=rf"^tensor 'x': .*{message}"):
        codec.TensorAssembler().add(pb.Tensor.FromString(data))


def test_codec_largest_empty_shape_numpy_makes() -> None:
    """The bound is numpy's own: one byte less than the refused shapes above still decodes."""
    shape = [0, (1 << 63) - 1]
    data = pb.Tensor(name="x", dtype=pb.U8, shape=shape).SerializeToString()
    assert codec.from_bytes(data)[1].shape == tuple(shape)


def test_coordinator_assembler_has_the_worker_limits() -> None:
    """The coordinator's ``FrameAssembler()`` (``Pipeline._receive``) and a bare
    ``TensorAssembler()`` take the same limits as a worker's ``Push``."""
    asm = frames.FrameAssembler()
    assert (asm.max_bytes, asm.max_tensors) == (WORKER.max_frame_tensor_bytes,
                                                WORKER.max_tensors_per_frame)
    assert (codec.DEFAULT_MAX_TENSOR_BYTES, codec.DEFAULT_MAX_TENSORS) == (
        WORKER.max_frame_tensor_bytes, WORKER.max_tensors_per_frame)


OVER_LIMIT = (rf"^tensor 'x' is {4 << 40} bytes, over the limit of "
              rf"{codec.DEFAULT_MAX_TENSOR_BYTES} bytes per tensor$")
OVER_NUMPY = r"^tensor 'x': shape \(2305843009213693952,\) of float32 is over numpy's largest array"


@pytest.mark.parametrize("elements, error, message", [
    (1 << 40, LimitError, OVER_LIMIT), (1 << 61, CodecError, OVER_NUMPY)], ids=["4TiB", "8EiB"])
def test_error_coordinator_assembler_huge_declared_tensor(
        elements: int, error: type[JaxdistError], message: str) -> None:
    """Fixed: with no limits (the coordinator's assembler had none), the first chunk of a
    tensor declared at 4 TiB allocated it (MemoryError or ValueError from numpy)."""
    msg = pb.Tensor(name="x", dtype=pb.F32, shape=[elements], data=b"\0" * 4, offset=0,
                    total_bytes=elements * 4)
    with pytest.raises(error, match=message):
        codec.TensorAssembler().add(msg)
    asm = frames.FrameAssembler()
    frame = pb.Frame(session_id="s", step=2, tensors=[msg], last_chunk=True)
    with pytest.raises(error, match=r"^session 's' step 2: " + message.lstrip("^")):
        asm.add(frame)
    assert asm.add(pb.Frame(session_id="s", step=3, last_chunk=True))[1] == {}  # reset


def test_error_assembler_without_limits_cannot_allocate() -> None:
    """With the limits turned off, a declared size no address space holds (4 EiB) is a
    LimitError naming the tensor, not numpy's MemoryError."""
    msg = pb.Tensor(name="x", dtype=pb.U8, shape=[1 << 62], data=b"\0" * 4,
                    total_bytes=1 << 62)
    with pytest.raises(LimitError, match=rf"^tensor 'x': cannot allocate {1 << 62} bytes for it"):
        codec.TensorAssembler(max_bytes=None, max_tensors=None).add(msg)


def test_error_assembler_too_many_tensors() -> None:
    asm = codec.TensorAssembler(max_tensors=2)
    for name in ("a", "b"):
        asm.add(pb.Tensor(name=name, dtype=pb.U8, shape=[1], data=b"\0", total_bytes=1))
    with pytest.raises(LimitError, match=r"^more than 2 tensors in one frame \(the limit\); "
                                         r"tensor 'c' would be number 3$"):
        asm.add(pb.Tensor(name="c", dtype=pb.U8, shape=[1], data=b"\0", total_bytes=1))


@pytest.mark.parametrize("parse, data, message", [
    (frames.parse_frame, b"\xff\xff\xff", r"^malformed Frame message \(3 bytes\)"),
    (frames.parse_event, b"\xff\xff\xff", r"^malformed Event message \(3 bytes\)"),
    # Past SCAN_MIN_BYTES the scan reads the fields; protobuf still parses the header ones.
    (frames.parse_frame, SCAN_PAD + b"\x0a\x01\xff", r"^malformed Frame header fields"),
    # Event.result (field 1) holding a Frame whose pipeline_id is not UTF-8; then session_id.
    (frames.parse_event, SCAN_PAD + b"\x0a\x03\x0a\x01\xff", r"^malformed Frame header fields"),
    (frames.parse_event, SCAN_PAD + b"\x2a\x01\xff", r"^malformed Event fields")],
    ids=["frame", "event", "frame-scan", "event-scan-result", "event-scan"])
def test_error_frames_parse_garbage(parse: Callable[[bytes], Any], data: bytes,
                                    message: str) -> None:
    """Fixed: protobuf's DecodeError escaped the Push and Subscribe deserializers."""
    with pytest.raises(CodecError, match=message):
        parse(data)


@pytest.mark.parametrize("header, message", [
    ('{"a":{"dtype":"F32","shape":[1e999],"data_offsets":[0,4]}}',
     r"tensor 'a': 'shape' must be a list of non-negative integers, found \[inf\]"),
    ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,1e999]}}',
     r"tensor 'a': 'data_offsets' must be a list of non-negative integers, found \[0, inf\]"),
    ('{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}',
     r"tensor 'a': 'shape' must be a list of non-negative integers, found \[1\.0\]"),
    ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}',
     r"tensor 'a': 'data_offsets' must be \[begin, end\], found \[0, 4, 8\]"),
    ('{"a":[1]}', r"tensor 'a': expected an object with dtype, shape and data_offsets"),
    ('{"a":{"dtype":["F32"],"shape":[1],"data_offsets":[0,4]}}',
     r"tensor 'a': unknown dtype \['F32'\]"),
    ("[" * 100_000 + "]" * 100_000, r"the header JSON is nested too deeply to parse")],
    ids=["inf-shape", "inf-offset", "float-shape", "three-offsets", "entry-not-object",
         "dtype-not-string", "deep-nesting"])
def test_error_safetensors_hostile_json(tmp_path: Path, header: str, message: str) -> None:
    """Fixed: 1e999 (JSON Infinity) made int() raise OverflowError, a deeply nested header made
    json.loads raise RecursionError. Numbers must now be JSON integers (no float conversion)."""
    head = header.encode()
    path = tmp_path / "h.safetensors"
    path.write_bytes(struct.pack("<Q", len(head)) + head + bytes(8))
    with pytest.raises(WeightError, match=rf"^safetensors file '.*h\.safetensors' is malformed: "
                                          rf"{message}"):
        SafetensorsFile(path)


def test_error_safetensors_index_deep_nesting(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors.index.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(WeightError, match=r"^safetensors index '.*' could not be read: its JSON "
                                          r"is nested too deeply"):
        read_index(path)


@pytest.mark.parametrize("meta", ["[1,2]", '"x"', '{"a":1}', '{"a":{"b":"c"}}'],
                         ids=["list", "string", "number-value", "object-value"])
def test_error_safetensors_metadata_not_an_object(tmp_path: Path, meta: str) -> None:
    """Fixed: a '__metadata__' that is not an object of strings was kept, and
    ``WeightCache.metadata`` (DescribeWeights) failed in dict.update with TypeError."""
    head = b'{"__metadata__":' + meta.encode() + b"}"
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(head)) + head)
    with WeightCache([tmp_path]) as cache, pytest.raises(
            WeightError, match=r"^safetensors file '.*m\.safetensors' is malformed: "
                               r"'__metadata__' must be an object of strings, found "):
        cache.metadata("m.safetensors")


def test_safetensors_metadata_null_or_strings(tmp_path: Path) -> None:
    for n, meta in enumerate(["null", '{"format":"pt"}']):
        head = b'{"__metadata__":' + meta.encode() + b"}"
        (tmp_path / f"m{n}.safetensors").write_bytes(struct.pack("<Q", len(head)) + head)
    with WeightCache([tmp_path]) as cache:
        assert cache.metadata("m0.safetensors") == {}
        assert cache.metadata("m1.safetensors") == {"format": "pt"}


@pytest.mark.parametrize("config, message", [
    ("{not json", r"could not be read: Expecting property name"),
    ("[" * 100_000 + "]" * 100_000, r"could not be read: its JSON is nested too deeply"),
    ("[1, 2]", r"expected a JSON object, found list"),
    (b"\xff\xfe", r"could not be read: 'utf-8' codec can't decode")],
    ids=["not-json", "deep-nesting", "not-an-object", "not-utf8"])
def test_error_checkpoint_config_json(tmp_path: Path, config: str | bytes, message: str) -> None:
    """Fixed: a malformed config.json beside a checkpoint made ``WeightCache.metadata``
    (DescribeWeights) raise JSONDecodeError."""
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    cfg = tmp_path / "config.json"
    cfg.write_bytes(config if isinstance(config, bytes) else config.encode())
    with WeightCache([tmp_path]) as cache, pytest.raises(
            WeightError, match=rf"^checkpoint config '.*config\.json'.*{message}"):
        cache.metadata("model.safetensors")


def test_error_checkpoint_config_outside_the_roots(tmp_path: Path) -> None:
    """A config.json that links outside the weight roots is refused, like a weight file."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.json").write_text('{"secret": 1}')
    save_file({"w": np.ones(2, np.float32)}, str(root / "model.safetensors"))
    os.symlink(outside / "secret.json", root / "config.json")
    with WeightCache([root]) as cache, pytest.raises(
            WeightError, match=r"config\.json' resolves to .*secret\.json', which is outside"):
        cache.metadata("model.safetensors")
