"""How a coordinator describes a model: an ordered list of units, each a pure JAX function.

A unit is ``fn(params, state, carry) -> (carry, new_state)``:

- ``params``: the unit's weights by local name (bound from URIs on the worker),
- ``state``: the unit's per-session resident tensors (e.g. its KV cache), possibly empty,
- ``carry``: a dict of activations; the unit returns the dict the next unit receives.

Contiguous units are grouped into stages (``partition.py``); a stage's function runs its units in
order, so the carry of the last unit of stage k is what travels to stage k+1. Anything a later
stage needs (positions, a mask) simply stays in the carry.

Example:
    >>> def dense(params, state, carry):
    ...     return {"x": jnp.tanh(carry["x"] @ params["w"])}, {}
    >>> model = Model("mlp", units=[Unit("l0", dense, {"w": Param("file://w0.bin", (8, 8))})],
    ...               inputs={"x": ("b, 8", "float32")})  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxdist.core import codec, quant
from jaxdist.core.control import check_control
from jaxdist.core.errors import SpecError
from jaxdist.core.spec import WeightRef
from jaxdist.core.weights.uri import relocate_uri

__all__ = ["Model", "Param", "Unit", "UnitFn"]

UnitFn = Callable[[dict[str, Any], dict[str, Any], dict[str, Any]],
                  tuple[dict[str, Any], dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class Param:
    """A weight as a unit sees it: where it lives and what it looks like once bound.

    Attributes:
        uri: where the worker reads it (``gguf://``, ``safetensors://``, ``file://``).
        shape: the shape the unit sees (after ``transpose``).
        dtype: the bound dtype (ignored when ``packed``: blocks are uint8).
        sha256: optional checksum of the stored bytes.
        packed: bind the GGML blocks exactly as stored (uint8 rows, no conversion); the unit
            gets a :class:`jaxdist.core.kernels.ops.QTensor` and multiplies through
            :func:`jaxdist.core.kernels.ops.linear`. Needs ``quant``.
        transpose: the unit sees the transpose of the stored matrix. Unpacked, the worker
            transposes once when binding; packed, the blocks stay as stored and the QTensor is
            marked transposed (the kernels read ``(out, in)`` rows).
        quant: the GGML storage type of the tensor (``"Q4_K"``), when it has one.

    Example:
        >>> from jaxdist import Param
        >>> wq = Param("gguf://m.gguf#blk.0.attn_q.weight", (576, 576), transpose=True)
        >>> wq.nbytes  # float32, bound once as the transpose of the stored matrix
        1327104
    """

    uri: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    sha256: str | None = None
    packed: bool = False
    transpose: bool = False
    quant: str | None = None

    def __post_init__(self) -> None:
        if self.packed and not self.quant:
            raise SpecError(f"Param {self.uri!r}: packed=True needs the GGML type (quant=)")

    @property
    def bound_shape(self) -> tuple[int, ...]:
        """The shape of the array the worker binds: for a packed weight, its stored bytes."""
        if not self.packed:
            return tuple(self.shape)
        stored = tuple(self.shape)[::-1] if self.transpose else tuple(self.shape)
        return quant.packed_shape(str(self.quant), stored)

    @property
    def bound_dtype(self) -> str:
        return "uint8" if self.packed else codec.canonical_dtype(self.dtype)

    def ref(self, name: str) -> WeightRef:
        return WeightRef(param=name, uri=self.uri, shape=self.bound_shape,
                         dtype=self.bound_dtype, sha256=self.sha256, packed=self.packed,
                         transpose=self.transpose and not self.packed, quant=self.quant)

    def unpacked(self, dtype: str = "float32") -> Param:
        """The same weight dequantized when bound (for a worker without kernels)."""
        return dataclasses.replace(self, packed=False, dtype=dtype) if self.packed else self

    @property
    def nbytes(self) -> int:
        """Bytes bound on the device."""
        n = codec.dtype_from_name(self.bound_dtype).itemsize
        for d in self.bound_shape:
            n *= d
        return n


@dataclasses.dataclass(frozen=True)
class Unit:
    """One unit of a model (an embedding, a block, a head).

    Attributes:
        name: unique within the model; prefixes the unit's parameter and state names.
        fn: ``fn(params, state, carry) -> (carry, new_state)``.
        params: the unit's weights by local name.
        state: per-session state by local name: ``(shape, dtype)``.

    Example:
        >>> from jaxdist import Param, Unit
        >>> def dense(params, state, carry):
        ...     return {"x": carry["x"] @ params["w"]}, {}
        >>> unit = Unit("l0", dense, {"w": Param("safetensors://mlp.safetensors#l0.w", (8, 8))})
        >>> unit.weight_bytes
        256
        >>> def count(params, state, carry):  # a stateful unit: a running count per session
        ...     n = state["n"] + 1
        ...     return carry, {"n": n}
        >>> Unit("count", count, state={"n": ((1,), "int32")}).state_bytes
        4
    """

    name: str
    fn: UnitFn
    params: Mapping[str, Param] = dataclasses.field(default_factory=dict)
    state: Mapping[str, tuple[tuple[int, ...], str]] = dataclasses.field(default_factory=dict)

    @property
    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.params.values())

    @property
    def state_bytes(self) -> int:
        total = 0
        for shape, dtype in self.state.values():
            n = codec.dtype_from_name(dtype).itemsize
            for d in shape:
                n *= d
            total += n
        return total


@dataclasses.dataclass(frozen=True)
class Model:
    """A model as units plus the signature of its inputs.

    Attributes:
        name: for logs and status.
        units: in execution order.
        inputs: name -> ``(dims, dtype)``; dims is a jax.export shape string such as
            ``"b, s, 576"`` where names are symbolic dims shared by all inputs.
        constraints: symbolic constraints, e.g. ``("s <= 2048",)``.
        buckets: symbolic dim bindings to compile ahead of time, e.g. ``[{"b": 1, "s": 1}]``.
            With buckets, they are the only shapes the stages take: a frame of another shape
            is refused before it compiles, unless ``any_shape``. With none, any shape is
            compiled when it first comes.
        any_shape: take input shapes outside ``buckets`` too, each compiled when it first
            comes (``StageSpec.any_shape``; a worker bounds them per pipeline,
            ``--max-compiled-shapes``).
        meta: free-form information for the caller (tokenizer, eos id, ...); never shipped.
        control: inputs that are per-step control (:data:`jaxdist.core.control.FIELDS`:
            ``slot``, ``pos``, ``length``, sampling), one value per row. They travel in each
            frame's control header, and every stage reads them there: units see them in their
            carry, may not change them, and need not pass them on.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist import Model, Param, Unit
        >>> def dense(params, state, carry):
        ...     return {"x": jnp.tanh(carry["x"] @ params["w"])}, {}
        >>> model = Model(
        ...     "mlp",
        ...     [Unit(f"l{i}", dense, {"w": Param(f"safetensors://mlp.safetensors#l{i}.w", (8, 8))})
        ...      for i in range(4)],
        ...     inputs={"x": ("b, 8", "float32")},  # b: a symbolic batch dim
        ...     buckets=[{"b": 4}])  # compiled ahead of time; the one batch size it takes
        >>> model.weight_bytes
        1024
        >>> pipe = cluster.deploy(model)  # see Cluster                       # doctest: +SKIP
    """

    name: str
    units: Sequence[Unit]
    inputs: Mapping[str, tuple[str, str]]
    constraints: Sequence[str] = ()
    buckets: Sequence[Mapping[str, int]] = ()
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    control: Sequence[str] = ()
    any_shape: bool = False

    def __post_init__(self) -> None:
        if not self.units:
            raise SpecError(f"model {self.name!r}: needs at least one unit")
        names = [u.name for u in self.units]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise SpecError(f"model {self.name!r}: duplicate unit names {sorted(dup)}")
        if not self.inputs:
            raise SpecError(f"model {self.name!r}: needs at least one input")
        for name in self.control:
            if name not in self.inputs:
                raise SpecError(f"model {self.name!r}: control input {name!r} is not one of its "
                                f"inputs {sorted(self.inputs)}")
            dims, dtype = self.inputs[name]
            problem = check_control(name, dtype, [d for d in dims.split(",") if d.strip()])
            if problem is not None:
                raise SpecError(f"model {self.name!r}: {problem}")

    @property
    def weight_bytes(self) -> int:
        return sum(u.weight_bytes for u in self.units)

    def relocated(self, old: str, new: str) -> Model:
        """The same model with its weights read from ``new`` where they were under ``old``.

        For a model traced from a local copy that the workers keep at another path (relative
        to their weights root, or absolute under one); ``jaxdist generate --model-path``.

        Example:
            >>> import jax.numpy as jnp
            >>> from jaxdist import Model, Param, Unit
            >>> m = Model("m", [Unit("l0", lambda p, s, c: ({"x": c["x"] @ p["w"]}, {}),
            ...                      {"w": Param("gguf://m.gguf#w", (2, 2))})],
            ...           {"x": ("b,2", "float32")})
            >>> m.relocated("m.gguf", "models/m.gguf").units[0].params["w"].uri
            'gguf://models/m.gguf#w'
        """
        units = [dataclasses.replace(u, params={
            k: dataclasses.replace(p, uri=relocate_uri(p.uri, old, new))
            for k, p in u.params.items()}) for u in self.units]
        return dataclasses.replace(self, units=units)
