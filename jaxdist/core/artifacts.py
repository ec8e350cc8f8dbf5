"""Export pipeline stages with ``jax.export`` and describe the artifacts.

Vetting serialized artifacts (digest, versions, platform, custom call allowlist) lives in
:mod:`jaxdist.core.vetting`; its public names are re-exported here, so
``from jaxdist.core.artifacts import load_artifact`` keeps working.

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
``("cpu",)`` and :attr:`ArtifactMeta.portable` is true; :func:`~jaxdist.core.vetting.load_artifact`
accepts a portable artifact for any requested platform. This is the only route to metal.

Precision
---------
A product in StableHLO (``dot_general``) without a precision config runs at each platform's
default: TF32 on NVIDIA GPUs, one bf16 pass on TPUs, float32 only on CPUs. So "float32" would
mean three different things. :func:`export_stage` pins every product of a float32 stage to
``HIGHEST`` (``matmul_precision="auto"``): a stage is float32 when none of its params, state or
inputs is a half type (bfloat16, float16). A half-precision stage keeps the platform's fast
products. ``matmul_precision`` overrides it per stage: ``"highest"`` or ``"default"``.

Determinism
-----------
The same stage, shapes and jax version give the same bytes, hence the same digest, whoever calls
:func:`export_stage` and wherever the code is checked out: MLIR locations keep only the innermost
user frame, with its directory stripped.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxdist.core.about import check_versions

check_versions()  # before jax's internals below: another jax fails here, by name

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
from jax import export as jexport  # noqa: E402

# Private jax module: the config states make exports deterministic.
from jax._src import config as _jax_config  # noqa: E402

from jaxdist.core.dims import parse_dim
from jaxdist.core.errors import ArtifactError
from jaxdist.core.spec import TensorSig
from jaxdist.core.vetting import (
    DEFAULT_CUSTOM_CALL_ALLOWLIST,
    EXPORT_PLATFORMS,
    MAX_SERIALIZATION_VERSION,
    MIN_SERIALIZATION_VERSION,
    _read_serialization_version,
    _stablehlo_version,
    custom_call_targets,
    digest_of,
    load_artifact,
    max_serialization_version,
    min_serialization_version,
)

__all__ = [
    "DEFAULT_CUSTOM_CALL_ALLOWLIST", "EXPORT_PLATFORMS", "MIN_SERIALIZATION_VERSION",
    "MAX_SERIALIZATION_VERSION", "min_serialization_version", "max_serialization_version",
    "ArtifactMeta", "Artifact", "digest_of",
    "export_stage", "load_artifact", "custom_call_targets",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ArtifactMeta:
    """What an artifact is, read off the export (names are not inside the serialized bytes).

    Attributes:
        platforms: platforms the module was lowered for (jax names).
        portable: lowered for cpu with the platform check disabled: runs anywhere, incl. metal.
        params, state, inputs: the flat arguments, in call order, with the names the stage
            function gave them (the artifact records only positions) and the dims jax recorded
            (:class:`~jaxdist.core.spec.TensorSig`, the one signature type).
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
    params: tuple[TensorSig, ...]
    state: tuple[TensorSig, ...]
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
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
                # Sidecars written before 2026-12-01 hold every dim as a string ("512").
                fields[key] = tuple(
                    TensorSig(t["name"], t["dtype"], tuple(parse_dim(str(d)) for d in t["dims"]))
                    for t in value
                )
            elif isinstance(value, list):
                fields[key] = tuple(value)
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A serialized stage: the bytes, their content address and their description.

    Example:
        >>> art = export_stage(lambda p, s, x: ({"y": x["x"] * p["w"]}, {}),
        ...                    params={"w": ((4,), "float32")},
        ...                    inputs={"x": ("b, 4", "float32")}, platforms=("cpu",))
        >>> art.digest == digest_of(art.data), art.meta.platforms
        (True, ('cpu',))
    """

    data: bytes
    digest: str
    meta: ArtifactMeta


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


_HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MATMUL_PRECISIONS = ("auto", "highest", "default")


def _matmul_precision(choice: str, avals: Sequence[jax.ShapeDtypeStruct]) -> str | None:
    """The ``jax.default_matmul_precision`` to trace under (None: each platform's default)."""
    if choice not in MATMUL_PRECISIONS:
        raise ArtifactError(f"matmul_precision {choice!r}: expected one of {MATMUL_PRECISIONS}")
    if choice == "auto":
        choice = ("default" if any(jnp.dtype(a.dtype) in _HALF_DTYPES for a in avals)
                  else "highest")
    return None if choice == "default" else choice


def _signatures(names: Sequence[str], avals: Sequence[Any]) -> tuple[TensorSig, ...]:
    """Name each flat aval: its dims as jax records them (an int, or a symbolic dim's text)."""
    return tuple(
        TensorSig(n, jnp.dtype(a.dtype).name, tuple(parse_dim(str(d)) for d in a.shape))
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
    matmul_precision: str = "auto",
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
        matmul_precision: ``"auto"`` (``"highest"`` for a float32 stage, ``"default"`` for one
            with a half-precision param, state or input), ``"highest"`` or ``"default"``; see
            "Precision" in the module docstring.

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
        [('b', 4)]
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
    precision = _matmul_precision(matmul_precision, [a for g in sds.values() for a in g])
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
            _jax_config.hlo_source_file_canonicalization_regex(r".*/"), \
            jax.default_matmul_precision(precision):
        exported = jexport.export(jax.jit(flat_fn), platforms=lowering_platforms,
                                  disabled_checks=checks)(*sds["params"], *sds["state"],
                                                          *sds["inputs"])
    data = bytes(exported.serialize())
    in_names = names["params"] + names["state"] + names["inputs"]
    in_meta = _signatures(in_names, exported.in_avals)
    meta = ArtifactMeta(
        platforms=tuple(exported.platforms),
        portable=portable,
        params=in_meta[:n_params],
        state=in_meta[n_params:n_params + n_state],
        inputs=in_meta[n_params + n_state:],
        outputs=_signatures(captured, exported.out_avals[:len(captured)]),
        symbolic_constraints=tuple(symbolic_constraints),
        jax_version=jax.__version__,
        jaxlib_version=jaxlib.__version__,
        serialization_version=_read_serialization_version(data),
        calling_convention_version=exported.calling_convention_version,
        stablehlo_version=_stablehlo_version(exported, data),
        custom_call_targets=tuple(sorted(custom_call_targets(exported))),
        nr_devices=exported.nr_devices,
    )
    digest = digest_of(data)
    logger.info("exported stage %s for %s: %d bytes, %s",
                fun_name, meta.platforms, len(data), digest)
    return Artifact(data=data, digest=digest, meta=meta)
