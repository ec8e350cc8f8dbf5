"""StageSpec: everything a worker needs to run one pipeline stage, with nothing implied.

The wire form is the ``jaxdist.v1.StageSpec`` protobuf message (``jaxdist/proto/jaxdist.proto``).
This module is its thin, typed Python view: frozen dataclasses, conversion in matched
``to_proto`` / ``from_proto`` pairs, and :func:`validate`, which raises :class:`SpecError` naming
the offending field (``weights[3].sha256``).

Calling convention of a stage artifact (see ``jaxdist/core/artifacts.py``): positional arguments are
the weights in spec order, then the state tensors, then the inputs; results are the outputs, then
the new state in the same order as ``state``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf.message import DecodeError

from jaxdist.core import codec
from jaxdist.core.control import check_control
from jaxdist.core.devices import parse_directive
from jaxdist.core.dims import Dim, check_dim, parse_dim, symbols_of
from jaxdist.core.errors import CodecError, DeviceError, SpecError, WeightError
from jaxdist.core.weights import parse_uri
from jaxdist.proto import jaxdist_pb2 as pb

__all__ = [
    "SPEC_VERSION",
    "ShapeBucket",
    "StageSpec",
    "StateSig",
    "TensorSig",
    "Versions",
    "WeightRef",
    "validate",
]

# Spec format version, "MAJOR.MINOR" (docs/design.md, "Compatibility").
# Bump rules:
#   - MINOR: a new optional field that a worker of an earlier MINOR may ignore without changing
#     what a stage computes. Workers accept every MINOR of a MAJOR they know.
#   - MAJOR: any change an earlier worker would misread: a changed meaning of a field, a new
#     required field, a changed calling convention. Workers refuse a MAJOR they do not know.
# Changelog:
#   1.0: the first release.
SPEC_VERSION = "1.0"  # what this jaxdist writes into StageSpec.spec_version
SUPPORTED_SPEC_MAJORS = (1,)

# Matched with fullmatch: "$" would also accept a trailing newline.
_HOSTPORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):([0-9]{1,5})", re.ASCII)
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}", re.ASCII)
_SHA = re.compile(r"[0-9a-f]{64}", re.ASCII)
# A spec major version: at most 9 digits.
_MAJOR = re.compile(r"[0-9]{1,9}", re.ASCII)


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    n = codec.dtype_from_name(dtype).itemsize
    for d in shape:
        n *= d
    return n


@dataclasses.dataclass(frozen=True)
class TensorSig:
    """Name, dtype and dims of an activation: one argument or result of a stage.

    A dim is an ``int``, a symbol bound by the inputs (``"b"``) or an expression of symbols as
    jax prints it (``"2*b"``, ``"b + 1"``): see :mod:`jaxdist.core.dims`.

    Example:
        >>> TensorSig("hidden", "float32", ("b", "s", 576)).to_proto().dims
        ['b', 's', '576']
    """

    name: str
    dtype: str
    dims: tuple[Dim, ...]

    def to_proto(self) -> pb.TensorSig:
        return pb.TensorSig(name=self.name, dtype=self.dtype, dims=[str(d) for d in self.dims])

    @classmethod
    def from_proto(cls, msg: pb.TensorSig) -> TensorSig:
        return cls(msg.name, msg.dtype, tuple(parse_dim(d) for d in msg.dims))


@dataclasses.dataclass(frozen=True)
class StateSig:
    """A per-session resident tensor (e.g. a KV cache), allocated as zeros on first use.

    Example:
        >>> StateSig("blocks.0.k", "float32", (4, 256, 3, 64)).nbytes  # 4 slots x 256 positions
        786432
    """

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)

    def to_proto(self) -> pb.StateSig:
        return pb.StateSig(name=self.name, dtype=self.dtype, shape=list(self.shape))

    @classmethod
    def from_proto(cls, msg: pb.StateSig) -> StateSig:
        return cls(msg.name, msg.dtype, tuple(msg.shape))


@dataclasses.dataclass(frozen=True)
class WeightRef:
    """Where one parameter comes from, and what it must look like once bound.

    Attributes:
        param: parameter path in the stage function (``"blocks.3.attn.wq"``).
        uri: ``gguf://PATH#TENSOR``, ``safetensors://PATH#TENSOR`` or ``file://PATH``.
        shape: shape of the bound array, after the layout transform.
        dtype: dtype of the bound array (``"uint8"`` when packed).
        sha256: optional hex digest of the tensor's stored bytes.
        packed: bind the raw quantized blocks; the graph dequantizes.
        transpose: reverse the axes once at bind time.
        quant: GGML quant type when packed (``"Q8_0"``).

    Example:
        >>> w = WeightRef("blocks.0.attn.wq", "gguf://SmolLM2.gguf#blk.0.attn_q.weight",
        ...               (576, 612), "uint8", packed=True, quant="Q8_0")
        >>> w.nbytes
        352512
    """

    param: str
    uri: str
    shape: tuple[int, ...]
    dtype: str
    sha256: str | None = None
    packed: bool = False
    transpose: bool = False
    quant: str | None = None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)

    @property
    def binding(self) -> tuple[object, ...]:
        """What a bound array is made of: refs with the same binding share one array (a tied
        embedding bound packed serves as lookup table and LM head)."""
        return (self.uri, self.shape, self.dtype, self.sha256, self.packed, self.transpose,
                self.quant)

    def to_proto(self) -> pb.WeightRef:
        return pb.WeightRef(
            param=self.param, uri=self.uri, shape=list(self.shape), dtype=self.dtype,
            sha256=self.sha256 or "", packed=self.packed,
            layout=pb.LAYOUT_TRANSPOSE if self.transpose else pb.LAYOUT_AS_STORED,
            quant=self.quant or "")

    @classmethod
    def from_proto(cls, msg: pb.WeightRef) -> WeightRef:
        return cls(msg.param, msg.uri, tuple(msg.shape), msg.dtype, msg.sha256 or None, msg.packed,
                   msg.layout == pb.LAYOUT_TRANSPOSE, msg.quant or None)


@dataclasses.dataclass(frozen=True)
class ShapeBucket:
    """One binding of the symbolic dims (``{"b": 1, "s": 64}``) to compile ahead of time."""

    dims: Mapping[str, int]

    def to_proto(self) -> pb.ShapeBucket:
        return pb.ShapeBucket(dims=dict(self.dims))

    @classmethod
    def from_proto(cls, msg: pb.ShapeBucket) -> ShapeBucket:
        return cls(dict(msg.dims))


@dataclasses.dataclass(frozen=True)
class Versions:
    """The versions of the tools that made an artifact."""

    spec: str = SPEC_VERSION
    jax: str = ""
    jaxlib: str = ""
    serialization_version: int = 0
    calling_convention_version: int = 0
    stablehlo: str = ""

    def to_proto(self) -> pb.Versions:
        return pb.Versions(**dataclasses.asdict(self))

    @classmethod
    def from_proto(cls, msg: pb.Versions) -> Versions:
        return cls(msg.spec, msg.jax, msg.jaxlib, msg.serialization_version,
                   msg.calling_convention_version, msg.stablehlo)


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """A self-describing unit of work for a worker. See the module docstring for the convention.

    The wire form is the ``jaxdist.v1.StageSpec`` protobuf message, the one schema of a stage
    (manifests store it too, in proto3 JSON). :meth:`deserialize` validates what it reads.

    Example:
        >>> spec = StageSpec("sha256:" + "ab" * 32,
        ...                  inputs=(TensorSig("x", "float32", ("b", 32)),),
        ...                  outputs=(TensorSig("y", "float32", ("b", 32)),),
        ...                  weights=(WeightRef("w", "safetensors://mlp.safetensors#l0.w",
        ...                                     (32, 32), "float32"),))
        >>> StageSpec.deserialize(spec.serialize()) == spec
        True
        >>> spec.weight_bytes
        4096
    """

    artifact_digest: str
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    weights: tuple[WeightRef, ...] = ()
    state: tuple[StateSig, ...] = ()
    device: str = "auto"
    stage_index: int = 0
    num_stages: int = 1
    next_hop: str = ""
    buckets: tuple[ShapeBucket, ...] = ()
    platforms: tuple[str, ...] = ()
    versions: Versions = dataclasses.field(default_factory=Versions)
    model: str = ""
    stage_id: str = ""
    artifact: bytes | None = dataclasses.field(default=None, repr=False)
    spec_version: str = SPEC_VERSION
    control: tuple[str, ...] = ()
    """Inputs read from each frame's step-control header (:mod:`jaxdist.core.control`), not
    from its tensors; empty for a stage that reads every input from the tensors."""
    next_data_hop: str = ""
    """``HOST:PORT`` of the next stage's worker's data port (frames over a TCP connection,
    :mod:`jaxdist.core.transport.stream`); empty: over gRPC to ``next_hop``."""
    any_shape: bool = False
    """Whether a frame may come in input shapes no bucket declares (compiled when they first
    come). False: a stage with buckets refuses any other shape before it compiles; a stage with
    no buckets takes any shape either way (see :attr:`strict_shapes`)."""

    @property
    def strict_shapes(self) -> bool:
        """Whether a frame must be in one of the buckets: the spec declares some, and does not
        allow any shape."""
        return bool(self.buckets) and not self.any_shape

    @property
    def weight_bytes(self) -> int:
        """Bytes the stage binds: weights with the same binding (a tied embedding bound packed,
        as lookup table and LM head) are bound once, and count once."""
        unique = {w.binding: w for w in self.weights}
        return sum(w.nbytes for w in unique.values())

    @property
    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.state)

    def replace(self, **changes: Any) -> StageSpec:
        return dataclasses.replace(self, **changes)

    def to_proto(self) -> pb.StageSpec:
        return pb.StageSpec(
            spec_version=self.spec_version, model=self.model, stage_index=self.stage_index,
            num_stages=self.num_stages, artifact_digest=self.artifact_digest,
            artifact=self.artifact or b"", inputs=[t.to_proto() for t in self.inputs],
            outputs=[t.to_proto() for t in self.outputs], state=[s.to_proto() for s in self.state],
            weights=[w.to_proto() for w in self.weights], device=self.device,
            next_hop=self.next_hop, buckets=[b.to_proto() for b in self.buckets],
            versions=self.versions.to_proto(), platforms=list(self.platforms),
            stage_id=self.stage_id, control=list(self.control), next_data_hop=self.next_data_hop,
            any_shape=self.any_shape)

    @classmethod
    def from_proto(cls, msg: pb.StageSpec) -> StageSpec:
        return cls(
            artifact_digest=msg.artifact_digest,
            inputs=tuple(TensorSig.from_proto(t) for t in msg.inputs),
            outputs=tuple(TensorSig.from_proto(t) for t in msg.outputs),
            weights=tuple(WeightRef.from_proto(w) for w in msg.weights),
            state=tuple(StateSig.from_proto(s) for s in msg.state),
            device=msg.device, stage_index=msg.stage_index, num_stages=msg.num_stages,
            next_hop=msg.next_hop, buckets=tuple(ShapeBucket.from_proto(b) for b in msg.buckets),
            platforms=tuple(msg.platforms), versions=Versions.from_proto(msg.versions),
            model=msg.model, stage_id=msg.stage_id, artifact=msg.artifact or None,
            spec_version=msg.spec_version, control=tuple(msg.control),
            next_data_hop=msg.next_data_hop, any_shape=msg.any_shape)

    def serialize(self) -> bytes:
        """Wire bytes. Deterministic: a bucket's map entries are written sorted by key (upb's
        own map order varies between runs)."""
        data: bytes = self.to_proto().SerializeToString(deterministic=True)
        return data

    @classmethod
    def deserialize(cls, data: bytes) -> StageSpec:
        """Parse and validate wire bytes. Raises SpecError on anything malformed."""
        msg = pb.StageSpec()
        try:
            msg.ParseFromString(data)
        except DecodeError as exc:
            raise SpecError(f"malformed StageSpec bytes ({len(data)} bytes): {exc}") from None
        spec = cls.from_proto(msg)
        validate(spec)
        return spec


def _fail(field: str, problem: str) -> SpecError:
    return SpecError(f"StageSpec.{field}: {problem}")


def _clip(text: str, limit: int = 40) -> str:
    """``repr(text)``, shortened when long (a hostile field may hold megabytes)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def _check_dtype(field: str, dtype: str) -> None:
    try:
        if codec.canonical_dtype(dtype) != dtype:
            raise _fail(field, f"dtype must be the canonical name {codec.canonical_dtype(dtype)!r}, "
                               f"found {dtype!r}")
    except CodecError:
        raise _fail(field, f"unknown dtype {dtype!r}; expected one of "
                           f"{', '.join(codec.SUPPORTED_DTYPES)}") from None


def _check_names(field: str, names: Sequence[str]) -> None:
    seen: set[str] = set()
    for i, name in enumerate(names):
        if not name:
            raise _fail(f"{field}[{i}].name", "must not be empty")
        if name in seen:
            raise _fail(f"{field}[{i}].name", f"duplicate name {name!r}")
        seen.add(name)


def _check_control(spec: StageSpec) -> None:
    inputs = {s.name: s for s in spec.inputs}
    seen: set[str] = set()
    for i, name in enumerate(spec.control):
        if name in seen:
            raise _fail(f"control[{i}]", f"duplicate name {_clip(name)}")
        seen.add(name)
        sig = inputs.get(name)
        if sig is None:
            raise _fail(f"control[{i}]", f"{_clip(name)} is not an input of the stage (its "
                                         f"inputs are {sorted(inputs)[:16]})")
        problem = check_control(name, sig.dtype, sig.dims)
        if problem is not None:
            raise _fail(f"control[{i}]", problem)


def validate(spec: StageSpec) -> None:
    """Check a spec for internal consistency. Does not touch the disk or the devices.

    Raises:
        SpecError: naming the first offending field, what was expected and what was found.
    """
    major = spec.spec_version.split(".", 1)[0]
    if not _MAJOR.fullmatch(major) or int(major) not in SUPPORTED_SPEC_MAJORS:
        raise _fail("spec_version", f"unsupported version {_clip(spec.spec_version)}; this "
                                    f"jaxdist reads major versions {SUPPORTED_SPEC_MAJORS} "
                                    f"(is {SPEC_VERSION})")
    if not _DIGEST.fullmatch(spec.artifact_digest):
        raise _fail("artifact_digest", f"expected 'sha256:' and 64 lowercase hex digits, found "
                                       f"{spec.artifact_digest!r}")
    if spec.num_stages < 1 or not 0 <= spec.stage_index < spec.num_stages:
        raise _fail("stage_index", f"expected 0 <= stage_index < num_stages, found "
                                   f"stage_index={spec.stage_index}, num_stages={spec.num_stages}")
    if spec.next_hop and not _HOSTPORT.fullmatch(spec.next_hop):
        raise _fail("next_hop", f"expected HOST:PORT, found {spec.next_hop!r}")
    if spec.next_hop and spec.stage_index == spec.num_stages - 1:
        raise _fail("next_hop", "the last stage returns to the coordinator; next_hop must be empty")
    if spec.next_data_hop and not _HOSTPORT.fullmatch(spec.next_data_hop):
        raise _fail("next_data_hop", f"expected HOST:PORT, found {_clip(spec.next_data_hop)}")
    if spec.next_data_hop and not spec.next_hop:
        raise _fail("next_data_hop", "a data port is the next hop's: next_hop must be set too")
    try:
        parse_directive(spec.device)
    except DeviceError as exc:
        raise _fail("device", str(exc)) from None
    if not spec.outputs:
        raise _fail("outputs", "a stage needs at least one output")
    symbols: set[str] = set()
    for field, sigs in (("inputs", spec.inputs), ("outputs", spec.outputs)):
        _check_names(field, [s.name for s in sigs])
        for i, sig in enumerate(sigs):
            _check_dtype(f"{field}[{i}].dtype", sig.dtype)
            for j, d in enumerate(sig.dims):
                problem = check_dim(d)
                if problem is not None:
                    raise _fail(f"{field}[{i}].dims[{j}]", problem)
                if field == "inputs":
                    symbols |= symbols_of(d)
                elif not symbols_of(d) <= symbols:
                    raise _fail(f"{field}[{i}].dims[{j}]",
                                f"{d!r} uses {sorted(symbols_of(d) - symbols)}, which no input "
                                f"binds (the inputs use {sorted(symbols)})")
    _check_control(spec)
    _check_names("state", [s.name for s in spec.state])
    for i, st in enumerate(spec.state):
        _check_dtype(f"state[{i}].dtype", st.dtype)
        if any(d < 0 for d in st.shape):
            raise _fail(f"state[{i}].shape", f"expected non-negative sizes, found {st.shape}")
    _check_names("weights", [w.param for w in spec.weights])
    for i, w in enumerate(spec.weights):
        try:
            parse_uri(w.uri)
        except WeightError as exc:
            raise _fail(f"weights[{i}].uri", str(exc)) from None
        _check_dtype(f"weights[{i}].dtype", w.dtype)
        if any(d < 0 for d in w.shape):
            raise _fail(f"weights[{i}].shape", f"expected non-negative sizes, found {w.shape}")
        if w.sha256 is not None and not _SHA.fullmatch(w.sha256):
            raise _fail(f"weights[{i}].sha256", f"expected 64 lowercase hex digits, found {w.sha256!r}")
        if w.packed and (w.dtype != "uint8" or not w.quant):
            raise _fail(f"weights[{i}]", f"a packed weight ({w.param!r}) needs dtype 'uint8' and a "
                                         f"quant type, found dtype={w.dtype!r} quant={w.quant!r}")
    for i, bucket in enumerate(spec.buckets):
        unknown = set(bucket.dims) - symbols
        if unknown:
            raise _fail(f"buckets[{i}]", f"unknown symbols {sorted(unknown)}; the inputs use "
                                         f"{sorted(symbols)}")
        if any(v < 1 for v in bucket.dims.values()):
            raise _fail(f"buckets[{i}]", f"sizes must be >= 1, found {dict(bucket.dims)}")
