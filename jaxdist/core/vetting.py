"""Vet serialized stage artifacts before a worker deserializes and runs them.

Vetting
-------
:func:`load_artifact` is what a worker calls on bytes it received. It checks, in order: the
digest; that the flatbuffer's root table is sound and its ``serialization_version`` field is in
the window; then it deserializes with :func:`jax.export.deserialize` and checks the calling
convention and StableHLO versions against what the local jax supports, the requested platform,
and that every custom call target is on an allowlist (:data:`DEFAULT_CUSTOM_CALL_ALLOWLIST`,
glob patterns). A custom call runs native code registered in jaxlib, so an unknown one is refused
rather than trusted. Every refusal, including any failure of jax's own reader, is an
:class:`~jaxdist.core.errors.ArtifactError`.

Always pass ``expected_digest`` for bytes from elsewhere. Damage in the flatbuffer is caught and
reported as "corrupt artifact", but the embedded StableHLO module is parsed by MLIR's native
bytecode reader, and a flipped byte there can abort the process (measured: ``malloc(): invalid
size``), which no Python ``except`` can catch. The digest check runs first and prevents that.

Versions
--------
What jax writes and reads (read in jax 0.10.2's ``jax/_src/export/serialization.py``,
``_export.py`` and ``config.py``):

* ``serialization_version``, the flatbuffer field, is always 3. ``_serialize_exported`` calls
  ``ExportedAddSerializationVersion(builder, 3)`` "for the sake of old deserializers" (readers
  before 11/2025 accepted only 2 and 3), although the schema it writes is
  ``_SERIALIZATION_VERSION`` (11). ``_deserialize_exported`` never reads the field and
  ``Exported`` has no attribute for it, so no public API reads it: this module reads it with a
  few lines over the flatbuffer's documented binary layout (:func:`_read_serialization_version`,
  not jax's private generated reader). The window :func:`min_serialization_version`..
  :func:`max_serialization_version` (2..the schema the local jax writes) therefore refuses only
  bytes that declare a schema this jax does not know, such as a future jax that stores its real
  version. An artifact from a newer jax that still writes 3 passes it; only the two windows
  below, or jax's reader failing on it, can refuse it.
* ``Exported.calling_convention_version`` is real: export writes the
  ``jax_export_calling_convention_version`` config value (default 10) and refuses any outside
  ``jax.export.minimum_supported_calling_convention_version``..
  ``maximum_supported_calling_convention_version`` (9..10). Neither ``jax.export.deserialize``
  nor ``Exported.call`` checks it on the way back in, so :func:`load_artifact` does.
* The StableHLO version is the producer named in the module's MLIR bytecode header (jax targets
  a version about four weeks old, so that older consumers read it); the window is StableHLO's own
  ``get_minimum_version()``..``get_current_version()``.

Custom calls are found by walking the deserialized MLIR module's operations, as jax's export check
does (``jax._src.export._export._check_module``), never by matching the printed text.

A portable artifact (lowered for ``cpu`` with the platform check disabled; see "Platforms" in
:mod:`jaxdist.core.artifacts`) is accepted for any requested platform.

Exporting lives in :mod:`jaxdist.core.artifacts`, which imports this module (never the reverse) and
re-exports its public names.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import re
from collections.abc import Collection

from jaxdist.core.about import check_versions

check_versions()  # before jax's internals below: another jax fails here, by name

import jax  # noqa: E402
import jaxlib  # noqa: E402
from jax import export as jexport  # noqa: E402

# Private jax name, the one left: the newest flatbuffer schema the local jax reads is kept only
# in this constant (the bytes never carry it; see "Versions" above).
from jax._src.export.serialization import _SERIALIZATION_VERSION  # noqa: E402
from jax.extend.mlir import ir  # noqa: E402
from jax.extend.mlir.dialects import stablehlo as _stablehlo  # noqa: E402

from jaxdist.core.errors import ArtifactError  # noqa: E402

__all__ = [
    "DEFAULT_CUSTOM_CALL_ALLOWLIST", "EXPORT_PLATFORMS", "LINALG_TARGETS", "MIN_SERIALIZATION_VERSION",
    "MAX_SERIALIZATION_VERSION", "min_serialization_version", "max_serialization_version",
    "digest_of", "load_artifact", "custom_call_targets",
]

logger = logging.getLogger(__name__)

# The platforms an artifact may be exported for and a worker may request (jax names, plus
# "metal": see "Platforms" in jaxdist.core.artifacts). Here rather than there so that
# load_artifact can check a requested platform without importing the export side.
EXPORT_PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu", "metal")

# jax's changelog (jax/_src/export/serialization.py) declares every schema since 3 "backwards
# compatible with Version 2", and its readers before 11/2025 accepted only 2 and 3 (never 1, the
# first, Nov 2023). tests/test_vetting.py checks the changelog of the installed jax.
MIN_SERIALIZATION_VERSION = 2
MAX_SERIALIZATION_VERSION: int = _SERIALIZATION_VERSION

# What the local jax exports and is documented to run (public jax.export constants).
_CALLING_CONVENTIONS: tuple[int, int] = (jexport.minimum_supported_calling_convention_version,
                                         jexport.maximum_supported_calling_convention_version)


def min_serialization_version() -> int:
    """The oldest flatbuffer ``serialization_version`` field the local jax reads."""
    return MIN_SERIALIZATION_VERSION


def max_serialization_version() -> int:
    """The newest flatbuffer schema the local jax reads (its own; it writes 3 in the field)."""
    return MAX_SERIALIZATION_VERSION


DEFAULT_CUSTOM_CALL_ALLOWLIST: frozenset[str] = frozenset({
    # Emitted by any export with symbolic dims: checks the actual shapes against the spec.
    "shape_assertion",
})
"""Custom call targets a worker accepts by default (``fnmatch`` patterns): only what the
project's own stages need, besides jaxdist's own kernels (:data:`jaxdist.core.kernels.OWN_TARGETS`,
which check every buffer against its declared type).

Measured with jax 0.10.2 by exporting every exporter's stages (Llama-family and GPT-2, GGUF
quantized and float, BERT) for cpu, cuda and tpu: ``shape_assertion`` is the only other target.
Everything else is denied, though jax guarantees many targets: a custom call runs native code on
buffers whose sizes XLA does not check, and the linear-algebra handlers (``lapack_*``,
``cusolver_*``, ...) size what they write from the operand, not from the declared result, so an
artifact that declares a smaller result overflows the heap (a 1.4 KB artifact calling
``lapack_sgetrf_ffi`` on a 512 x 512 operand with a 1 x 1 result crashed a worker when they were
allowed). An operator allows more with the worker's ``--allow-custom-call PATTERN``; see
:data:`LINALG_TARGETS` for what is still checked then.
"""

LINALG_TARGETS: tuple[str, ...] = ("lapack_*", "cusolver_*", "hipsolver_*")
"""Linear-algebra targets (``fnmatch`` patterns) that do not check their buffers' types.

When an operator allows one, each of its calls must alias an output to an operand
(``output_operand_aliases``, as every jax lowering of them does) with exactly the operand's type.
That refuses the overflow above. It cannot prove the other results (pivots, info, singular
values) large enough, which depends on each routine: allowing these targets trusts the
artifacts' authors. ``SECURITY.md`` says so.
"""

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_MLIR_BYTECODE_MAGIC = b"ML\xefR"
# MLIR bytecode opens with the magic, the bytecode version (a varint) and the producer string.
_STABLEHLO_PRODUCER_RE = re.compile(rb"ML\xefR.{1,9}?StableHLO_v(\d+)\.(\d+)\.(\d+)\x00", re.DOTALL)

# Field ids in the root table, ``Exported``, of jax's schema (serialization.fbs).
_FIELD_SERIALIZATION_VERSION = 0  # ushort
_FIELD_FUNCTION_NAME = 1  # string


def digest_of(data: bytes) -> str:
    """The content address of ``data``: ``"sha256:<64 hex digits>"``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _corrupt(data: bytes, why: str) -> ArtifactError:
    return ArtifactError(
        f"corrupt artifact ({len(data)} bytes): {why}; it is not a serialized "
        "jax.export.Exported (truncated, damaged, or not an artifact at all; its digest is "
        f"{digest_of(data)}). Re-export or re-fetch it"
    )


def _read_serialization_version(data: bytes) -> int:
    """The ``serialization_version`` field of a serialized Exported, read without jax.

    No public jax API reads the field, so this reads the flatbuffer layout directly: the root
    table's offset, its vtable, and the field's slot. It also checks that the root table, the
    vtable and the function name lie inside ``data``: flatbuffers' Python reader slices strings
    without a bounds check, and jax writes the function name first, so it ends the buffer and a
    truncated artifact would otherwise load with a cut name.

    Raises:
        ArtifactError: the bytes are not a sound flatbuffer ("corrupt artifact").
    """
    size = len(data)

    def u16(at: int) -> int:
        return int.from_bytes(data[at:at + 2], "little")

    def u32(at: int) -> int:
        return int.from_bytes(data[at:at + 4], "little")

    if size < 16:
        raise _corrupt(data, "too short")
    root = u32(0)
    if root + 4 > size:
        raise _corrupt(data, f"root table offset {root} is past the end")
    vtable = root - int.from_bytes(data[root:root + 4], "little", signed=True)
    if not 0 <= vtable <= size - 4:
        raise _corrupt(data, f"vtable offset {vtable} is out of range")
    vt_size, table_size = u16(vtable), u16(vtable + 2)
    if vt_size < 4 or vt_size % 2 or vtable + vt_size > size or root + table_size > size:
        raise _corrupt(data, "vtable is malformed")

    def field(field_id: int, width: int) -> int | None:
        """Where the field is in ``data``, or None if the writer left it out (its default)."""
        slot = 4 + 2 * field_id
        offset = u16(vtable + slot) if slot + 2 <= vt_size else 0
        if not offset:
            return None
        if offset + width > table_size:
            raise _corrupt(data, f"field {field_id} at offset {offset} is past its table's end")
        return root + offset

    at = field(_FIELD_SERIALIZATION_VERSION, 2)
    version = u16(at) if at is not None else 0
    at = field(_FIELD_FUNCTION_NAME, 4)
    if at is not None:
        start = at + u32(at)
        end = start + 4 + (u32(start) if start + 4 <= size else 0) + 1  # length, bytes, NUL
        if end > size:
            raise _corrupt(data, f"the function name ends at byte {end}, past the end")
    return version


def _deserialize(data: bytes) -> jexport.Exported:
    """``jax.export.deserialize``, with any failure as a corrupt-artifact error."""
    try:
        return jexport.deserialize(bytearray(data))
    except Exception as exc:  # it follows raw offsets: any garbage can throw anything
        raise _corrupt(data, f"jax.export.deserialize failed with {type(exc).__name__}: "
                             f"{exc}") from exc


def _stablehlo_version(exported: jexport.Exported, data: bytes) -> str:
    """The StableHLO producer version in the header of the module's MLIR bytecode.

    Raises:
        ArtifactError: the module is not StableHLO bytecode.
    """
    module = exported.mlir_module_serialized
    if not isinstance(module, bytes) or not module.startswith(_MLIR_BYTECODE_MAGIC):
        raise _corrupt(data, "the StableHLO module is not MLIR bytecode")
    producer = _STABLEHLO_PRODUCER_RE.match(module[:64])
    if producer is None:
        raise _corrupt(data, "the StableHLO module has no StableHLO producer version")
    return b".".join(producer.groups()).decode()


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def _local() -> str:
    return f"local jax {jax.__version__} / jaxlib {jaxlib.__version__}"


def _check_serialization_version(version: int, digest: str) -> None:
    if not MIN_SERIALIZATION_VERSION <= version <= MAX_SERIALIZATION_VERSION:
        raise ArtifactError(
            f"artifact serialization version {version} is not supported: {_local()} reads "
            f"versions {MIN_SERIALIZATION_VERSION}..{MAX_SERIALIZATION_VERSION} (artifact "
            f"{digest}). Re-export the stage with a jax close to the worker's, or upgrade the "
            "worker's jax"
        )


def _check_calling_convention(exported: jexport.Exported, window: tuple[int, int],
                              digest: str) -> None:
    version = exported.calling_convention_version
    lo, hi = window
    if not lo <= version <= hi:
        supported = f"{_local()} supports {_CALLING_CONVENTIONS[0]}..{_CALLING_CONVENTIONS[1]}"
        if window != _CALLING_CONVENTIONS:
            supported += f", and the caller accepts only {lo}..{hi}"
        raise ArtifactError(
            f"artifact calling convention version {version} is not supported: {supported} "
            f"(artifact {exported.fun_name!r}, {digest}). Re-export the stage with a jax close "
            "to the worker's, or with jax_export_calling_convention_version in the window"
        )


def _check_stablehlo(version: str, exported: jexport.Exported, digest: str) -> None:
    lo, hi = _stablehlo.get_minimum_version(), _stablehlo.get_current_version()
    if not _version_tuple(lo) <= _version_tuple(version) <= _version_tuple(hi):
        raise ArtifactError(
            f"artifact StableHLO version {version} is outside the window {lo}..{hi} that "
            f"{_local()} can read (artifact {exported.fun_name!r}, {digest}). Re-export the "
            "stage with a jax close to the worker's"
        )


def _calling_convention_window(window: tuple[int, int] | None) -> tuple[int, int]:
    if window is None:
        return _CALLING_CONVENTIONS
    jax_lo, jax_hi = _CALLING_CONVENTIONS
    if (not isinstance(window, tuple) or len(window) != 2
            or not all(isinstance(v, int) for v in window)
            or not jax_lo <= window[0] <= window[1] <= jax_hi):
        raise ArtifactError(
            f"calling_conventions={window!r}: expected a (lowest, highest) pair of ints inside "
            f"{jax_lo}..{jax_hi}, the calling convention versions {_local()} supports"
        )
    return window


def custom_call_targets(exported: jexport.Exported) -> set[str]:
    """Every custom call target in an Exported's StableHLO module.

    The module is deserialized with the MLIR bindings jax ships (``jax.extend.mlir``) and every
    operation in it is visited, nested regions included, as jax's own export check does
    (``jax._src.export._export._check_module``): each ``stablehlo.custom_call`` contributes its
    ``call_target_name``. Text anywhere else (a location, a string attribute, a
    ``backend_config``) is never taken for a target.

    Raises:
        ArtifactError: the module cannot be parsed, or a custom call has no target name.
    """
    return set(_custom_calls(exported))


def _custom_calls(exported: jexport.Exported) -> dict[str, list[str]]:
    """Every custom call target, with the problems of its calls' operand/result aliasing (for
    :data:`LINALG_TARGETS` only; see :func:`_alias_problem`)."""
    targets: dict[str, list[str]] = {}
    unnamed: list[str] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        # Never raises: the bindings would wrap it in a RuntimeError.
        if op.name == "stablehlo.custom_call":
            name = op.attributes.get("call_target_name")
            if isinstance(name, ir.StringAttr):
                problems = targets.setdefault(name.value, [])
                if any(fnmatch.fnmatchcase(name.value, p) for p in LINALG_TARGETS):
                    problem = _alias_problem(op)
                    if problem:
                        problems.append(f"{problem} (at {op.location})")
            else:
                unnamed.append(str(op.location))
        return ir.WalkResult.ADVANCE

    with ir.Context() as context:
        context.enable_multithreading(False)  # one module: no thread pool per call
        try:
            module = exported.mlir_module(serialized=False)
            module.operation.walk(visit)
        except Exception as exc:
            raise ArtifactError(
                f"corrupt artifact: the StableHLO module of {exported.fun_name!r} cannot be "
                f"parsed: {type(exc).__name__}: {exc}"
            ) from exc
    if unnamed:
        raise ArtifactError(
            f"corrupt artifact: {len(unnamed)} custom call(s) in the StableHLO module of "
            f"{exported.fun_name!r} have no string call_target_name, e.g. at {unnamed[0]}"
        )
    return targets


_ALIAS_RE = re.compile(r"output_tuple_indices = \[([0-9, ]*)\], operand_index = (\d+), "
                       r"operand_tuple_indices = \[\]")


def _alias_problem(op: ir.Operation) -> str:
    """Why a linear-algebra custom call's buffers are unsafe, or ``""``: it must alias an
    output to an operand, each alias joining two values of exactly the same type."""
    attr = op.attributes["output_operand_aliases"] if "output_operand_aliases" in op.attributes \
        else None
    aliases = _ALIAS_RE.findall(str(attr)) if attr is not None else []
    if not aliases:
        return "it aliases no output to an operand, as jax's lowering always does"
    operands, results = list(op.operands), list(op.results)
    for out_text, operand_text in aliases:
        out = [int(i) for i in out_text.replace(" ", "").split(",") if i]
        k, r = int(operand_text), (out[0] if out else 0)
        if len(out) > 1 or k >= len(operands) or r >= len(results):
            return f"an output_operand_alias ({out}, operand {k}) names no such value"
        if str(operands[k].type) != str(results[r].type):
            return (f"output {r} ({results[r].type}) is aliased to operand {k} "
                    f"({operands[k].type}) of another type")
    return ""


def load_artifact(
    data: bytes,
    *,
    expected_digest: str | None = None,
    platform: str | None = None,
    allowed_custom_calls: Collection[str] = DEFAULT_CUSTOM_CALL_ALLOWLIST,
    calling_conventions: tuple[int, int] | None = None,
) -> jexport.Exported:
    """Vet and deserialize an artifact; what a worker calls on bytes it did not make.

    Args:
        data: the serialized artifact.
        expected_digest: if given, ``digest_of(data)`` must equal it.
        platform: if given, the platform the caller will run on (``cpu``, ``cuda``, ``rocm``,
            ``tpu``, ``metal``); the artifact must be lowered for it, or be portable.
        allowed_custom_calls: ``fnmatch`` patterns of allowed custom call targets.
        calling_conventions: ``(lowest, highest)`` calling convention versions to accept, inside
            what the local jax supports (the default, ``jax.export``'s
            ``minimum/maximum_supported_calling_convention_version``).

    Returns:
        The ``jax.export.Exported``; call it as ``jax.jit(exported.call)(*flat_args)``.

    Raises:
        ArtifactError: in this order, the digest differs, the bytes are corrupt, a version is
            outside what the local jax reads, the platform is missing, or a custom call target is
            not allowed. The message names what was expected and what was found.

    Example:
        >>> art = export_stage(lambda p, s, x: ({"y": x["x"] * p["w"]}, {}),
        ...                    params={"w": ((4,), "float32")},
        ...                    inputs={"x": ("b, 4", "float32")}, platforms=("cpu",))
        >>> exported = load_artifact(art.data, expected_digest=art.digest, platform="cpu")
        >>> w, x = np.full(4, 2, np.float32), np.ones((3, 4), np.float32)
        >>> jax.jit(exported.call)(w, x)[0].tolist()  # flat: weights, state, inputs
        [[2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]]
    """
    data = bytes(data)
    window = _calling_convention_window(calling_conventions)
    found = digest_of(data)
    if expected_digest is not None:
        if not _DIGEST_RE.match(expected_digest):
            raise ArtifactError(
                f"expected digest {expected_digest!r} is malformed: expected 'sha256:' followed by "
                "64 lowercase hex digits"
            )
        if found != expected_digest:
            raise ArtifactError(
                f"artifact digest mismatch: expected {expected_digest}, found {found} "
                f"({len(data)} bytes); the bytes were damaged or the wrong artifact was sent"
            )
    # The field is checked before jax's reader runs: a schema this jax does not know is a version
    # error, not "corrupt".
    _check_serialization_version(_read_serialization_version(data), found)
    exported = _deserialize(data)
    _check_calling_convention(exported, window, found)
    _check_stablehlo(_stablehlo_version(exported, data), exported, found)
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
    calls = _custom_calls(exported)
    for target in sorted(calls):
        if not any(fnmatch.fnmatchcase(target, pattern) for pattern in allowed_custom_calls):
            raise ArtifactError(
                f"artifact {exported.fun_name!r} uses custom call {target!r}, which is not on "
                "the allowlist of custom call targets. If you trust it, extend the allowlist: "
                "pass allowed_custom_calls=DEFAULT_CUSTOM_CALL_ALLOWLIST | {" + repr(target) + "}"
                " to load_artifact (the worker's --allow-custom-call " + repr(target) + ")"
            )
        if calls[target]:
            raise ArtifactError(
                f"artifact {exported.fun_name!r}: custom call {target!r} does not check its "
                f"buffers, and {calls[target][0]}; refused, as it could write past a buffer")
    return exported
