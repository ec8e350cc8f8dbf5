"""Build a model's stages: plan the split, export each stage, describe it as a StageSpec.

:func:`plan_stages` groups a model's units into stages (:mod:`jaxdist.export.partition`);
:func:`build_stage_specs` traces each stage with ``jax.export`` (:mod:`jaxdist.core.artifacts`) and
describes it as a :class:`~jaxdist.core.spec.StageSpec`, not yet placed on a worker. Both the
coordinator (:meth:`jaxdist.coordinator.cluster.Cluster.deploy`) and an offline export into a registry
(:func:`jaxdist.registry.publish.publish`) use them; nothing here dials a worker, so an offline export
imports no gRPC.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from jaxdist.core import artifacts, kernels
from jaxdist.core.dims import symbols_of
from jaxdist.core.errors import SpecError
from jaxdist.core.kernels import ops
from jaxdist.core.kernels.ops import QTensor
from jaxdist.core.spec import ShapeBucket, StageSpec, StateSig, Versions
from jaxdist.export.model import Model, Param, Unit
from jaxdist.export.partition import balanced_split, explicit_split

__all__ = ["BuiltStage", "Progress", "build_stage_specs", "log_progress", "plan_stages"]

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
"""``progress(what, done, total)``: called as deploy advances; the CLI draws a bar with it."""


def log_progress(what: str, done: int, total: int) -> None:
    """The default :data:`Progress`: a log line per step."""
    log.info("%s (%d/%d)", what, done, total)




def _operand(param: Param, value: Any) -> Any:
    """What a unit receives for a bound weight: the array, or a QTensor of packed blocks."""
    if param.packed:
        return QTensor(value, str(param.quant), transposed=param.transpose)
    return value


def _stage_fn(units: Sequence[Unit], control: Sequence[str]) -> Callable[..., Any]:
    """The stage's function. ``control`` inputs are in every unit's carry (a unit may read
    them, not change them) and leave the stage in no output: the next stage reads them from
    the frame's control header, as this one did."""

    def stage(params: dict[str, Any], state: dict[str, Any], carry: dict[str, Any]
              ) -> tuple[dict[str, Any], dict[str, Any]]:
        ctl = {k: carry[k] for k in control}
        new_state: dict[str, Any] = {}
        for u in units:
            p = {k: _operand(param, params[f"{u.name}.{k}"]) for k, param in u.params.items()}
            s = {k: state[f"{u.name}.{k}"] for k in u.state}
            carry, ns = u.fn(p, s, {**carry, **ctl})
            missing = set(u.state) - set(ns)
            if missing:
                raise SpecError(f"unit {u.name!r} did not return new state for {sorted(missing)}")
            changed = [k for k in control if k in carry and carry[k] is not ctl[k]]
            if changed:
                raise SpecError(f"unit {u.name!r} returned new values for the step control "
                                f"{changed}; control inputs are read-only (every stage reads "
                                f"them from the frame's header): give the new value another "
                                f"name")
            new_state.update({f"{u.name}.{k}": ns[k] for k in u.state})
        return {k: v for k, v in carry.items() if k not in ctl}, new_state

    stage.__name__ = f"stage_{units[0].name}_{units[-1].name}"
    return stage


@dataclass(frozen=True)
class BuiltStage:
    """An exported stage and its spec, not yet placed (no device, next hop or stage id)."""

    artifact: artifacts.Artifact
    spec: StageSpec


def _unpacked(unit: Unit) -> Unit:
    """The unit with its packed weights dequantized when bound (for a worker without kernels)."""
    if not any(p.packed for p in unit.params.values()):
        return unit
    return dataclasses.replace(unit, params={n: p.unpacked() for n, p in unit.params.items()})


def build_stage_specs(model: Model, ranges: Sequence[range], *,
                      platforms: Sequence[str] = ("cpu", "cuda", "tpu"),
                      progress: Progress = log_progress,
                      unpack: Sequence[bool] = ()) -> list[BuiltStage]:
    """Export each stage of ``model`` (its units in ``ranges``) and describe it as a spec.

    ``unpack[k]`` true: stage k binds its packed (quantized) weights dequantized instead, for
    a CPU worker that has no kernels.
    """
    inputs: dict[str, tuple[str, str]] = dict(model.inputs)
    control = tuple(model.control)
    control_inputs = {k: model.inputs[k] for k in control}
    built = []
    for k, rng in enumerate(ranges):
        progress(f"export stage {k}", k, len(ranges))
        units = [model.units[i] for i in rng]
        if k < len(unpack) and unpack[k]:
            units = [_unpacked(u) for u in units]
        params = {f"{u.name}.{n}": p for u in units for n, p in u.params.items()}
        state = {f"{u.name}.{n}": sd for u in units for n, sd in u.state.items()}
        # A stage with packed weights calls the CPU kernels (jaxdist.core.kernels) through custom
        # calls: its matmuls, and its decode attention (ops.cache_attention).
        for_kernels = any(p.packed for p in params.values())
        with ops.exporting_for_kernels(for_kernels):
            art = artifacts.export_stage(
                _stage_fn(units, control),
                params={n: jax.ShapeDtypeStruct(p.bound_shape, jax.numpy.dtype(p.bound_dtype))
                        for n, p in params.items()},
                unstable_custom_calls=tuple(sorted(kernels.OWN_TARGETS)) if for_kernels else (),
                state={n: jax.ShapeDtypeStruct(tuple(shape), jax.numpy.dtype(dtype))
                       for n, (shape, dtype) in state.items()},
                inputs=inputs, platforms=platforms,
                symbolic_constraints=tuple(model.constraints))
        meta = art.meta
        symbols = {s for t in meta.inputs for d in t.dims for s in symbols_of(d)}
        buckets = []
        for b in model.buckets:
            dims = {s: int(v) for s, v in b.items() if s in symbols}
            if dims and ShapeBucket(dims) not in buckets:
                buckets.append(ShapeBucket(dims))
        spec = StageSpec(
            artifact_digest=art.digest,
            inputs=meta.inputs,
            outputs=meta.outputs,
            weights=tuple(p.ref(n) for n, p in params.items()),
            state=tuple(StateSig(n, jax.numpy.dtype(dt).name, tuple(sh))
                        for n, (sh, dt) in state.items()),
            stage_index=k, num_stages=len(ranges), buckets=tuple(buckets),
            platforms=meta.platforms, model=model.name, control=control,
            any_shape=model.any_shape,
            versions=Versions(jax=meta.jax_version, jaxlib=meta.jaxlib_version,
                              serialization_version=meta.serialization_version,
                              calling_convention_version=meta.calling_convention_version,
                              stablehlo=meta.stablehlo_version))
        built.append(BuiltStage(art, spec))
        inputs = {t.name: (", ".join(str(d) for d in t.dims), t.dtype) for t in meta.outputs}
        inputs.update(control_inputs)
    progress("exported", len(ranges), len(ranges))
    return built


def plan_stages(model: Model, *, stages: int | None = None, split: Sequence[int] | None = None,
                capacities: Sequence[float] | None = None) -> list[range]:
    """The units of each stage: ``split`` (unit counts) if given, else ``stages`` stages
    balanced by weight plus state bytes (weighted by ``capacities``)."""
    if split is not None:
        return explicit_split(len(model.units), split)
    costs = [u.weight_bytes + u.state_bytes + 1 for u in model.units]
    return balanced_split(costs, stages or 1, capacities)
