"""Export pipeline stages with ``jax.export``, and inspect and vet serialized artifacts.

Calling convention
------------------
A stage function has the signature::

    fn(params: dict[str, Array], state: dict[str, Array], inputs: dict[str, Array])
        -> tuple[dict[str, Array], dict[str, Array]]          # (outputs, new_state)

The exported artifact is FLAT, so that a worker needs no pytree knowledge and a StageSpec can list
names in call order:

* positional arguments: the params in the given order, then the state in order, then the inputs;
* results: the outputs in the order ``fn`` returns them (dict insertion order, captured while
  tracing; or ``output_names``), then the new state in the same order as the state.

``new_state`` must have exactly the state's names, shapes and dtypes, so that a worker can donate
the state buffers and update them in place. Weights are arguments, never constants, so an artifact
stays kilobytes however large the weights are.

Platforms
---------
Platforms use jax names: ``cpu``, ``cuda``, ``rocm``, ``tpu``. ``metal`` is special: jax-metal
(platform ``METAL``) is unmaintained and jax.export cannot lower for it, so ``platforms=("metal",)``
means a *portable* artifact: lowered for ``cpu`` with ``DisabledSafetyCheck.platform()``, which
lets the cpu lowering be compiled on any platform. Its :attr:`ArtifactMeta.platforms` is
``("cpu",)`` and :attr:`ArtifactMeta.portable` is true; :func:`load_artifact` accepts a portable
artifact for any requested platform. This is the only route to metal.

Vetting
-------
:func:`load_artifact` is what a worker calls on bytes it received. It checks, in order: the
digest, that the flatbuffer is readable and its versions (serialization schema, calling convention,
StableHLO) are inside what the local jax can read, the requested platform, and that every custom
call target is on an allowlist (:data:`DEFAULT_CUSTOM_CALL_ALLOWLIST`, glob patterns). A custom
call runs native code registered in jaxlib, so an unknown one is refused rather than trusted.

Always pass ``expected_digest`` for bytes from elsewhere. Damage in the flatbuffer is caught and
reported as "corrupt artifact", but the embedded StableHLO module is parsed by MLIR's native
bytecode reader, and a flipped byte there can abort the process (measured: ``malloc(): invalid
size``), which no Python ``except`` can catch. The digest check runs first and prevents that.

Determinism
-----------
The same stage, shapes and jax version give the same bytes, hence the same digest, whoever calls
:func:`export_stage` and wherever the code is checked out: MLIR locations keep only the innermost
user frame, with its directory stripped.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import logging
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
from jax import export as jexport

# Private jax modules: the flatbuffer schema and StableHLO versions are needed to read an
# artifact's versions *before* deserializing it; the config states make exports deterministic.
from jax._src import config as _jax_config
from jax._src.export import serialization as _jax_serialization
from jax._src.export import serialization_generated as _ser_flatbuf
from jax._src.lib.mlir.dialects import hlo as _hlo

from jaxdist.errors import ArtifactError

__all__ = [
    "DEFAULT_CUSTOM_CALL_ALLOWLIST", "EXPORT_PLATFORMS", "MIN_SERIALIZATION_VERSION",
    "MAX_SERIALIZATION_VERSION", "min_serialization_version", "max_serialization_version",
    "TensorMeta", "ArtifactMeta", "Artifact", "digest_of",
    "export_stage", "load_artifact", "custom_call_targets",
]

logger = logging.getLogger(__name__)

EXPORT_PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu", "metal")

# Version 1 (Nov 2023) predates the layout every later reader shares; versions 2..current are
# readable (see the changelog in jax/_src/export/serialization.py). Note that jax 0.10 still
# *writes* 3 into this field for the sake of old readers, whatever schema it used.
MIN_SERIALIZATION_VERSION = 2
MAX_SERIALIZATION_VERSION: int = _jax_serialization._SERIALIZATION_VERSION



def min_serialization_version() -> int:
    """The oldest artifact serialization version the local jax reads."""
    return MIN_SERIALIZATION_VERSION


def max_serialization_version() -> int:
    """The newest artifact serialization version (schema) the local jax reads."""
    return MAX_SERIALIZATION_VERSION


DEFAULT_CUSTOM_CALL_ALLOWLIST: frozenset[str] = frozenset({
    # Emitted by any export with symbolic dims: checks the actual shapes against the spec.
    "shape_assertion",
    # Sharding annotations (jit shardings, shard_map) and memory placement (device_put to host).
    "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement",
    "AllocateBuffer",  # lax.empty
    # Shape-polymorphic forms of ordinary ops (top_k, reduce_window, rng_bit_generator).
    "stablehlo.dynamic_top_k", "stablehlo.dynamic_approx_top_k",
    "stablehlo.dynamic_reduce_window", "stablehlo.dynamic_rng_bit_generator",
    # cpu: jnp.linalg (cholesky, qr, eigh, svd, lu, solve, triangular_solve, ...).
    "lapack_*_ffi",
    # cuda / rocm: jnp.linalg, and threefry when it is not partitionable.
    "cusolver_*_ffi", "cusparse_gtsv2_ffi", "cu_lu_pivots_to_permutation", "cu_threefry2x32_ffi",
    "hipsolver_*_ffi", "hip_lu_pivots_to_permutation", "hip_threefry2x32_ffi",
    # tpu: jnp.linalg and lax.approx_max_k.
    "Eigh", "Qr", "ProductOfElementaryHouseholderReflectors", "LuDecomposition", "ApproxTopK",
})
"""Custom call targets a worker accepts by default (``fnmatch`` patterns).

Measured with jax 0.10.2 by exporting matmul, softmax, argmax, top_k, sort, cumsum, jax.random
(threefry), approx_max_k, device_put to host and jnp.linalg for cpu, cuda, rocm and tpu. Every name
is on jax's own list of targets with a compatibility guarantee. Left out on purpose, though jax
guarantees them: Pallas/Triton kernels (``tpu_custom_call``, ``mosaic_gpu_v2``) carry arbitrary
user code, and ``tf.call_tf_function`` needs TensorFlow; pass ``allowed_custom_calls`` to accept
them. (cuBLAS and cuDNN calls appear only when XLA compiles, never in an exported module.)
"""

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_CUSTOM_CALL_RE = re.compile(
    r'stablehlo\.custom_call\s+@(?:"((?:[^"\\]|\\.)*)"|([\w.$-]+))'
    r'|(?:custom_call_target|call_target_name)\s*=\s*"((?:[^"\\]|\\.)*)"'
)
_MLIR_BYTECODE_MAGIC = b"ML\xefR"
_STABLEHLO_PRODUCER_RE = re.compile(rb"StableHLO_v(\d+)\.(\d+)\.(\d+)")


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """One flat argument or result of an artifact.

    Attributes:
        name: the name in the stage's params/state/inputs/outputs dict.
        dtype: numpy dtype name, e.g. ``"float32"``, ``"bfloat16"``.
        dims: one string per dim; a constant as digits, a symbolic dim by its expression (``"b"``).
    """

    name: str
    dtype: str
    dims: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ArtifactMeta:
    """What an artifact is, read off the export (names are not inside the serialized bytes).

    Attributes:
        platforms: platforms the module was lowered for (jax names).
        portable: lowered for cpu with the platform check disabled: runs anywhere, incl. metal.
        params, state, inputs: the flat arguments, in call order.
        outputs: the flat results before the new state, in call order.
        symbolic_constraints: constraints on the symbolic dims given at export.
        jax_version, jaxlib_version: of the exporting process.
        serialization_version: the version field stored in the flatbuffer.
        calling_convention_version: ``Exported.calling_convention_version``.
        stablehlo_version: the StableHLO producer version of the serialized module.
        custom_call_targets: sorted custom call targets found in the module.
        nr_devices: ``Exported.nr_devices``.
    """

    platforms: tuple[str, ...]
    portable: bool
    params: tuple[TensorMeta, ...]
    state: tuple[TensorMeta, ...]
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    symbolic_constraints: tuple[str, ...]
    jax_version: str
    jaxlib_version: str
    serialization_version: int
    calling_convention_version: int
    stablehlo_version: str
    custom_call_targets: tuple[str, ...]
    nr_devices: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (tuples become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ArtifactMeta:
        """Inverse of :meth:`to_dict`."""
        groups = ("params", "state", "inputs", "outputs")
        fields = {k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(cls)}}
        for key, value in fields.items():
            if key in groups:
                fields[key] = tuple(
                    TensorMeta(t["name"], t["dtype"], tuple(t["dims"])) for t in value
                )
            elif isinstance(value, list):
                fields[key] = tuple(value)
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A serialized stage: the bytes, their content address and their description."""

    data: bytes
    digest: str
    meta: ArtifactMeta


def digest_of(data: bytes) -> str:
    """The content address of ``data``: ``"sha256:<64 hex digits>"``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _to_sds(group: str, name: str, spec: Any, scope: jexport.SymbolicScope) -> jax.ShapeDtypeStruct:
    """Turn one tensor spec into a ShapeDtypeStruct, parsing symbolic dims in the shared scope."""
    where = f"{group}[{name!r}]"
    if isinstance(spec, jax.ShapeDtypeStruct):
        return spec
    if isinstance(spec, tuple) and len(spec) == 2:
        shape, dtype = spec
        try:
            dtype = jnp.dtype(dtype)
        except TypeError as exc:
            raise ArtifactError(f"{where}: dtype {dtype!r} is not a dtype: {exc}") from exc
        text = shape if isinstance(shape, str) else ", ".join(str(d) for d in shape)
        try:
            dims = jexport.symbolic_shape(text, scope=scope)
        except Exception as exc:
            raise ArtifactError(
                f"{where}: cannot parse shape spec {text!r} (expected e.g. 'b, s, 576'): {exc}"
            ) from exc
        return jax.ShapeDtypeStruct(tuple(dims), dtype)
    if hasattr(spec, "shape") and hasattr(spec, "dtype"):
        return jax.ShapeDtypeStruct(tuple(spec.shape), spec.dtype)
    raise ArtifactError(
        f"{where}: expected a jax.ShapeDtypeStruct, an array, or a (shape, dtype) tuple such as "
        f"('b, s, 576', 'float32'); got {type(spec).__name__}"
    )


def _lowering(platforms: Sequence[str]) -> tuple[tuple[str, ...], bool]:
    """Map requested platforms to (jax lowering platforms, portable)."""
    requested = tuple(str(p).lower() for p in platforms)
    unknown = [p for p in requested if p not in EXPORT_PLATFORMS]
    if not requested or unknown:
        raise ArtifactError(
            f"export platforms {tuple(platforms)!r}: expected a non-empty subset of "
            f"{EXPORT_PLATFORMS}; unknown: {unknown or 'none given'}"
        )
    if "metal" not in requested:
        return tuple(dict.fromkeys(requested)), False
    if set(requested) - {"metal", "cpu"}:
        raise ArtifactError(
            f"export platforms {tuple(platforms)!r}: 'metal' means a portable cpu lowering and "
            "can only be combined with 'cpu'; export a separate artifact for the other platforms"
        )
    return ("cpu",), True


def _tensor_metas(names: Sequence[str], avals: Sequence[Any]) -> tuple[TensorMeta, ...]:
    return tuple(
        TensorMeta(n, jnp.dtype(a.dtype).name, tuple(str(d) for d in a.shape))
        for n, a in zip(names, avals)
    )


def export_stage(
    fn: Callable[..., Any],
    *,
    params: Mapping[str, Any],
    inputs: Mapping[str, Any],
    state: Mapping[str, Any] | None = None,
    platforms: Sequence[str] = ("cpu", "cuda", "tpu"),
    symbolic_constraints: Sequence[str] = (),
    output_names: Sequence[str] | None = None,
    unstable_custom_calls: Sequence[str] = (),
) -> Artifact:
    """Export a stage function (see the module docstring for its calling convention).

    Args:
        fn: ``fn(params, state, inputs) -> (outputs, new_state)``, all dicts of arrays.
        params: name -> ``jax.ShapeDtypeStruct`` (or ``(shape, dtype)``), in call order.
        inputs: name -> ``jax.ShapeDtypeStruct`` or ``(shape_spec, dtype)``, where the spec may
            name symbolic dims: ``("b, s, 576", "float32")``. All specs share one symbolic scope,
            so ``b`` is the same dim everywhere.
        state: like ``params``; the resident state (e.g. a KV cache) ``fn`` returns updated.
        platforms: jax platform names to lower for; ``("metal",)`` makes a portable artifact.
        symbolic_constraints: e.g. ``("s <= 2048",)``, applied to the shared scope.
        output_names: the output order; by default the order in which ``fn`` returns them.
        unstable_custom_calls: custom call targets without a jax stability guarantee to let
            through export (your own FFI kernels). Workers must also allow them when loading.

    Returns:
        The :class:`Artifact`.

    Raises:
        ArtifactError: a spec is malformed, names collide, ``fn`` breaks the calling convention,
            or the platforms are unknown. Errors from tracing ``fn`` itself propagate unchanged.

    Example:
        >>> art = export_stage(lambda p, s, x: ({"y": x["x"] @ p["w"]}, {}),
        ...                    params={"w": ((4, 4), "float32")},
        ...                    inputs={"x": ("b, 4", "float32")})
        >>> [t.dims for t in art.meta.outputs]
        [('b', '4')]
    """
    state = state or {}
    lowering_platforms, portable = _lowering(platforms)
    groups = {"params": params, "state": state, "inputs": inputs}
    seen: dict[str, str] = {}
    for group, specs in groups.items():
        for name in specs:
            if not isinstance(name, str) or not name:
                raise ArtifactError(f"{group}: names must be non-empty strings, got {name!r}")
            if name in seen:
                raise ArtifactError(
                    f"{group}[{name!r}]: name already used in {seen[name]}; every param, state "
                    "and input name must be unique within a stage"
                )
            seen[name] = group
    scope = jexport.SymbolicScope(tuple(symbolic_constraints))
    sds = {g: [_to_sds(g, n, s, scope) for n, s in specs.items()] for g, specs in groups.items()}
    names = {g: list(specs) for g, specs in groups.items()}
    n_params, n_state = len(names["params"]), len(names["state"])
    captured: list[str] = []
    fun_name = getattr(fn, "__name__", "stage")

    def flat_fn(*args: Any) -> tuple[Any, ...]:
        p = dict(zip(names["params"], args[:n_params]))
        s = dict(zip(names["state"], args[n_params:n_params + n_state]))
        x = dict(zip(names["inputs"], args[n_params + n_state:]))
        result = fn(p, s, x)
        if not (isinstance(result, (tuple, list)) and len(result) == 2
                and all(isinstance(r, Mapping) for r in result)):
            raise ArtifactError(
                f"stage {fun_name!r} must return (outputs: dict, new_state: dict); "
                f"got {type(result).__name__}"
            )
        outputs, new_state = result
        order = list(output_names) if output_names is not None else list(outputs)
        if set(order) != set(outputs) or len(order) != len(outputs):
            raise ArtifactError(
                f"stage {fun_name!r}: output_names {order} do not match the outputs "
                f"returned, {list(outputs)}"
            )
        if set(new_state) != set(names["state"]):
            raise ArtifactError(
                f"stage {fun_name!r}: new_state must have exactly the state's names "
                f"{names['state']}; got {list(new_state)}"
            )
        for name, spec in zip(names["state"], sds["state"]):
            got = new_state[name]
            if (jnp.dtype(got.dtype) != jnp.dtype(spec.dtype)
                    or [str(d) for d in got.shape] != [str(d) for d in spec.shape]):
                raise ArtifactError(
                    f"stage {fun_name!r}: new_state[{name!r}] is {got.dtype}{list(got.shape)}, "
                    f"expected {spec.dtype}{list(spec.shape)} like state[{name!r}] (state is "
                    "updated in place, so it cannot change shape or dtype)"
                )
        captured[:] = order
        return tuple(outputs[n] for n in order) + tuple(new_state[n] for n in names["state"])

    flat_fn.__name__ = fun_name
    checks = [jexport.DisabledSafetyCheck.custom_call(t) for t in unstable_custom_calls]
    if portable:
        checks.append(jexport.DisabledSafetyCheck.platform())
    # Innermost user frame only, directory stripped: see "Determinism" in the module docstring.
    with _jax_config.include_full_tracebacks_in_locations(False), \
            _jax_config.hlo_source_file_canonicalization_regex(r".*/"):
        exported = jexport.export(jax.jit(flat_fn), platforms=lowering_platforms,
                                  disabled_checks=checks)(*sds["params"], *sds["state"],
                                                          *sds["inputs"])
    data = bytes(exported.serialize())
    header = _read_header(data)
    in_names = names["params"] + names["state"] + names["inputs"]
    in_meta = _tensor_metas(in_names, exported.in_avals)
    meta = ArtifactMeta(
        platforms=tuple(exported.platforms),
        portable=portable,
        params=in_meta[:n_params],
        state=in_meta[n_params:n_params + n_state],
        inputs=in_meta[n_params + n_state:],
        outputs=_tensor_metas(captured, exported.out_avals[:len(captured)]),
        symbolic_constraints=tuple(symbolic_constraints),
        jax_version=jax.__version__,
        jaxlib_version=jaxlib.__version__,
        serialization_version=header.serialization_version,
        calling_convention_version=exported.calling_convention_version,
        stablehlo_version=header.stablehlo_version,
        custom_call_targets=tuple(sorted(custom_call_targets(exported))),
        nr_devices=exported.nr_devices,
    )
    digest = digest_of(data)
    logger.info("exported stage %s for %s: %d bytes, %s",
                fun_name, meta.platforms, len(data), digest)
    return Artifact(data=data, digest=digest, meta=meta)


@dataclasses.dataclass(frozen=True)
class _Header:
    serialization_version: int
    calling_convention_version: int
    platforms: tuple[str, ...]
    stablehlo_version: str


def _read_header(data: bytes) -> _Header:
    """Read the version fields of a serialized Exported without deserializing it."""
    size = len(data)

    def corrupt(why: str) -> ArtifactError:
        return ArtifactError(
            f"corrupt artifact ({size} bytes): {why}; it is not a serialized jax.export.Exported "
            "(truncated, damaged, or not an artifact at all). Re-export or re-fetch it"
        )

    if size < 16:
        raise corrupt("too short")
    try:
        root = int.from_bytes(data[0:4], "little")
        if root + 4 > size:
            raise corrupt(f"root table offset {root} is past the end")
        vtable = root - int.from_bytes(data[root:root + 4], "little", signed=True)
        if not 0 <= vtable <= size - 4:
            raise corrupt(f"vtable offset {vtable} is out of range")
        vt_size = int.from_bytes(data[vtable:vtable + 2], "little")
        table_size = int.from_bytes(data[vtable + 2:vtable + 4], "little")
        if vt_size < 4 or vt_size % 2 or vtable + vt_size > size or root + table_size > size:
            raise corrupt("vtable is malformed")
        exp = _ser_flatbuf.Exported.GetRootAs(data, 0)
        version = exp.SerializationVersion()
        module = exp.MlirModuleSerializedAsNumpy()
        if isinstance(module, int) or len(module) < 8:
            raise corrupt("the StableHLO module is missing")
        module_bytes = module.tobytes()
        if not module_bytes.startswith(_MLIR_BYTECODE_MAGIC):
            raise corrupt("the StableHLO module is not MLIR bytecode")
        platforms = tuple(exp.Platforms(i).decode("ascii") for i in range(exp.PlatformsLength()))
        cc_version = exp.CallingConventionVersion()
    except ArtifactError:
        raise
    except Exception as exc:  # flatbuffers reads raw offsets: any garbage can throw anything
        raise corrupt(f"{type(exc).__name__}: {exc}") from exc
    producer = _STABLEHLO_PRODUCER_RE.search(module_bytes[:64])
    if producer is None:
        raise corrupt("the StableHLO module has no StableHLO producer version")
    return _Header(version, cc_version, platforms, b".".join(producer.groups()).decode())


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def _check_versions(header: _Header) -> None:
    local = f"local jax {jax.__version__} / jaxlib {jaxlib.__version__}"
    v = header.serialization_version
    if not MIN_SERIALIZATION_VERSION <= v <= MAX_SERIALIZATION_VERSION:
        raise ArtifactError(
            f"artifact serialization version {v} is not supported: {local} reads versions "
            f"{MIN_SERIALIZATION_VERSION}..{MAX_SERIALIZATION_VERSION}. Re-export the stage with a "
            "jax close to the worker's, or upgrade the worker's jax"
        )
    cc = header.calling_convention_version
    lo, hi = (jexport.minimum_supported_calling_convention_version,
              jexport.maximum_supported_calling_convention_version)
    if not lo <= cc <= hi:
        raise ArtifactError(
            f"artifact calling convention version {cc} is not supported: {local} supports "
            f"{lo}..{hi}. Re-export the stage with a jax close to the worker's"
        )
    shlo = header.stablehlo_version
    shlo_lo, shlo_hi = _hlo.get_minimum_version(), _hlo.get_current_version()
    if not _version_tuple(shlo_lo) <= _version_tuple(shlo) <= _version_tuple(shlo_hi):
        raise ArtifactError(
            f"artifact StableHLO version {shlo} is outside the window {shlo_lo}..{shlo_hi} "
            f"that {local} can read. Re-export the stage with a jax close to the worker's"
        )


def custom_call_targets(exported: jexport.Exported) -> set[str]:
    """Every custom call target named in an Exported's StableHLO module.

    Raises:
        ArtifactError: the module bytes cannot be parsed.
    """
    try:
        text = exported.mlir_module()
    except Exception as exc:
        raise ArtifactError(
            f"corrupt artifact: the StableHLO module of {exported.fun_name!r} cannot be parsed: "
            f"{exc}"
        ) from exc
    return {a or b or c for a, b, c in _CUSTOM_CALL_RE.findall(text)}


def load_artifact(
    data: bytes,
    *,
    expected_digest: str | None = None,
    platform: str | None = None,
    allowed_custom_calls: Collection[str] = DEFAULT_CUSTOM_CALL_ALLOWLIST,
) -> jexport.Exported:
    """Vet and deserialize an artifact; what a worker calls on bytes it did not make.

    Args:
        data: the serialized artifact.
        expected_digest: if given, ``digest_of(data)`` must equal it.
        platform: if given, the platform the caller will run on (``cpu``, ``cuda``, ``rocm``,
            ``tpu``, ``metal``); the artifact must be lowered for it, or be portable.
        allowed_custom_calls: ``fnmatch`` patterns of allowed custom call targets.

    Returns:
        The ``jax.export.Exported``; call it as ``jax.jit(exported.call)(*flat_args)``.

    Raises:
        ArtifactError: in this order, the digest differs, the bytes are corrupt, a version is
            outside what the local jax reads, the platform is missing, or a custom call target is
            not allowed. The message names what was expected and what was found.
    """
    data = bytes(data)
    if expected_digest is not None:
        if not _DIGEST_RE.match(expected_digest):
            raise ArtifactError(
                f"expected digest {expected_digest!r} is malformed: expected 'sha256:' followed by "
                "64 lowercase hex digits"
            )
        found = digest_of(data)
        if found != expected_digest:
            raise ArtifactError(
                f"artifact digest mismatch: expected {expected_digest}, found {found} "
                f"({len(data)} bytes); the bytes were damaged or the wrong artifact was sent"
            )
    header = _read_header(data)
    _check_versions(header)
    try:
        exported = jexport.deserialize(bytearray(data))
    except Exception as exc:
        raise ArtifactError(
            f"corrupt artifact ({len(data)} bytes): deserialization failed with "
            f"{type(exc).__name__}: {exc}. Re-export or re-fetch it"
        ) from exc
    if platform is not None:
        wanted = platform.lower()
        if wanted not in EXPORT_PLATFORMS:
            raise ArtifactError(
                f"platform {platform!r} is not known; expected one of {EXPORT_PLATFORMS}"
            )
        portable = jexport.DisabledSafetyCheck.platform() in exported.disabled_safety_checks
        if wanted not in exported.platforms and not portable:
            raise ArtifactError(
                f"artifact {exported.fun_name!r} was exported for {list(exported.platforms)}, "
                f"not for {wanted!r}. Re-export it with platforms including {wanted!r}, or run "
                f"it on a {'/'.join(exported.platforms)} worker"
            )
        if wanted not in exported.platforms:
            logger.info("running portable artifact (lowered for %s) on %s",
                        exported.platforms, wanted)
    for target in sorted(custom_call_targets(exported)):
        if not any(fnmatch.fnmatchcase(target, pattern) for pattern in allowed_custom_calls):
            raise ArtifactError(
                f"artifact {exported.fun_name!r} uses custom call {target!r}, which is not on "
                "the allowlist of custom call targets. If you trust it, extend the allowlist: "
                "pass allowed_custom_calls=DEFAULT_CUSTOM_CALL_ALLOWLIST | {" + repr(target) + "}"
                " to load_artifact (the worker's custom call allowlist option)"
            )
    return exported
