"""Vet serialized stage artifacts before a worker deserializes and runs them.

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

A portable artifact (lowered for ``cpu`` with the platform check disabled; see "Platforms" in
:mod:`jaxdist.core.artifacts`) is accepted for any requested platform.

Exporting lives in :mod:`jaxdist.core.artifacts`, which imports this module (never the reverse) and
re-exports its public names.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import logging
import re
from collections.abc import Collection

import jax
import jaxlib
from jax import export as jexport

# Private jax modules: the flatbuffer schema and StableHLO versions are needed to read an
# artifact's versions *before* deserializing it.
from jax._src.export import serialization as _jax_serialization
from jax._src.export import serialization_generated as _ser_flatbuf
from jax._src.lib.mlir.dialects import hlo as _hlo

from jaxdist.core.errors import ArtifactError

__all__ = [
    "DEFAULT_CUSTOM_CALL_ALLOWLIST", "EXPORT_PLATFORMS", "MIN_SERIALIZATION_VERSION",
    "MAX_SERIALIZATION_VERSION", "min_serialization_version", "max_serialization_version",
    "digest_of", "load_artifact", "custom_call_targets",
]

logger = logging.getLogger(__name__)

# The platforms an artifact may be exported for and a worker may request (jax names, plus
# "metal": see "Platforms" in jaxdist.core.artifacts). Here rather than there so that
# load_artifact can check a requested platform without importing the export side.
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


def digest_of(data: bytes) -> str:
    """The content address of ``data``: ``"sha256:<64 hex digits>"``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


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
        # jax writes the function name first, so it ends the buffer and a truncation cuts it
        # first; flatbuffers' Python reader slices strings without a bounds check, so a cut
        # name would load silently. Check that the string (length, bytes, NUL) fits.
        name_slot = exp._tab.Offset(6)  # Exported.function_name (field 1)
        if name_slot:
            at = exp._tab.Pos + name_slot
            at += int.from_bytes(data[at:at + 4], "little")
            end = at + 4 + int.from_bytes(data[at:at + 4], "little") + 1
            if at + 4 > size or end > size:
                raise corrupt(f"the function name ends at byte {end}, past the end")
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
