"""WorkerStage: one exported stage, its weights bound on a device, compiled and ready to run.

This is everything a worker does for a stage, in one process and without any network:

1. load the artifact (digest, platform and custom-call checks live in ``artifacts.py``);
2. check the spec against the artifact's own signature, so a wrong spec fails at load, not at
   the first step;
3. compile ``jax.jit(exported.call)`` with the state arguments donated, ahead of time for every
   shape bucket in the spec (the persistent compilation cache makes a restart cheap), from the
   weights' shapes, and give the compiler's free heap back (``jaxdist.core.heap``);
4. bind each weight through the :class:`~jaxdist.core.weights.WeightCache` (shape, dtype, sha256 and
   layout are settled once, here) and put it on the directed device, where XLA:CPU takes the
   host array as its buffer (no second copy);
5. run: inputs in, outputs and the new state out. The state stays on the device; the caller
   keeps it between steps and passes it back, and donation lets XLA update it in place.

Example:
    >>> stage = WorkerStage.load(spec, artifact=data, cache=WeightCache([root]))  # doctest: +SKIP
    >>> outputs, state = stage.run({"x": x}, stage.init_state())                 # doctest: +SKIP
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxdist.core import codec, kernels
from jaxdist.core.artifacts import DEFAULT_CUSTOM_CALL_ALLOWLIST, custom_call_targets, load_artifact
from jaxdist.core.devices import device_platform, resolve_device
from jaxdist.core.dims import Dim, evaluate, is_symbol, symbols_of
from jaxdist.core.errors import ArtifactError, SpecError
from jaxdist.core.heap import release_free_heap
from jaxdist.core.spec import ShapeBucket, StageSpec, TensorSig, validate
from jaxdist.core.weights import WeightCache

__all__ = ["WorkerStage", "shapes_at_load"]

log = logging.getLogger(__name__)

MAX_CHECKED_SHAPES = 1024  # input shapes whose dims check is remembered (a bound on memory)
SHOWN_BUCKETS = 8  # buckets a refusal lists


def _dims_str(dims: Sequence[object]) -> str:
    return "(" + ", ".join(str(d) for d in dims) + ")"


def _aval_dims(aval: Any) -> tuple[int | str, ...]:
    return tuple(d if isinstance(d, int) else str(d) for d in aval.shape)


def _bindings_str(bound: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(bound.items())) or "no symbols"


def _bind_symbols(where: str, sigs: Sequence[TensorSig],
                  shapes: Sequence[tuple[int, ...]]) -> dict[str, int]:
    """The value of every symbol of the inputs, read off their shapes.

    A bare symbol (``b``) is bound by any axis that has it; a symbol that appears only inside an
    expression is solved from an axis whose expression is linear in it (``2*b``, ``b + 1``), the
    way jax solves them; the result is then checked by evaluating every dim.

    Raises:
        SpecError: a symbol is bound to two values, or cannot be solved from the shapes.
    """
    bound: dict[str, int] = {}
    pending: list[tuple[TensorSig, Dim, int]] = []
    for sig, shape in zip(sigs, shapes):
        for d, n in zip(sig.dims, shape):
            if is_symbol(d):
                assert isinstance(d, str)
                if bound.setdefault(d, n) != n:
                    raise SpecError(f"{where}: input {sig.name!r}: symbol {d!r} is {bound[d]} "
                                    f"in an earlier input but {n} here (shape {shape})")
            elif not isinstance(d, int):
                pending.append((sig, d, n))
    progress = True
    while pending and progress:  # each pass solves the dims left with one unknown symbol
        progress = False
        for item in list(pending):
            sig, d, n = item
            unknown = sorted(symbols_of(d) - set(bound))
            if len(unknown) > 1:
                continue
            pending.remove(item)
            progress = True
            if unknown:
                (sym,) = unknown
                at0 = evaluate(d, {**bound, sym: 0})
                slope = evaluate(d, {**bound, sym: 1}) - at0
                value = (n - at0) // slope if slope else -1
                if value < 0 or evaluate(d, {**bound, sym: value}) != n:
                    raise SpecError(f"{where}: input {sig.name!r}: cannot solve symbol {sym!r} "
                                    f"from the axis {d!r} of size {n}")
                bound[sym] = value
    if pending:
        sig, d, _ = pending[0]
        raise SpecError(f"{where}: input {sig.name!r}: the axis {d!r} has more than one symbol no "
                        f"other axis binds ({sorted(symbols_of(d) - set(bound))})")
    return bound


class WorkerStage:
    """A stage bound and compiled on one device. Build it with :meth:`load`.

    Thread safety: :meth:`run` may be called from several threads; compilation of a new shape is
    serialized by a lock.

    Example:
        >>> from jaxdist import WeightCache, WorkerStage
        >>> with WeightCache(["/srv/models"]) as cache:  # doctest: +SKIP
        ...     stage = WorkerStage.load(spec, artifact=data, cache=cache)  # as on LoadStage
        ...     outputs, state = stage.run({"x": x}, stage.init_state())
    """

    def __init__(self, spec: StageSpec, exported: jax.export.Exported, device: jax.Device,
                 params: list[jax.Array]) -> None:
        self.spec = spec
        self.exported = exported
        self.device = device
        self.platform = device_platform(device)
        self._params = params
        self._sharding = SingleDeviceSharding(device)
        n_w, n_s = len(spec.weights), len(spec.state)
        self._state_names = [s.name for s in spec.state]
        self._input_names = [t.name for t in spec.inputs]
        self._output_names = [t.name for t in spec.outputs]
        self._input_dtypes = [codec.dtype_from_name(t.dtype) for t in spec.inputs]
        self._jitted = jax.jit(exported.call, donate_argnums=tuple(range(n_w, n_w + n_s)))
        self._compiled: dict[tuple[tuple[int, ...], ...], Any] = {}
        # Input shapes whose dims were found to agree with the spec: checked once each
        self._shapes_ok: set[tuple[tuple[int, ...], ...]] = set()
        # The buckets' input shapes: the only ones a strict spec takes (spec.strict_shapes).
        # A bucket that binds too little is left out here; compiling it fails the load.
        self._bucket_shapes: set[tuple[tuple[int, ...], ...]] = set()
        for bucket in spec.buckets:
            try:
                self._bucket_shapes.add(self.bucket_shapes(bucket))
            except SpecError:
                pass
        self._lock = threading.Lock()
        self.compile_seconds = 0.0
        self.bind_seconds = 0.0
        self._bound = len(params) == n_w

    # ------------------------------------------------------------------------------------------
    # Construction

    @classmethod
    def load(
        cls,
        spec: StageSpec,
        *,
        artifact: bytes,
        cache: WeightCache,
        allowed_custom_calls: Collection[str] = DEFAULT_CUSTOM_CALL_ALLOWLIST,
        devices: Sequence[Any] | None = None,
        compile_buckets: bool = True,
        worker: str = "",
        on_phase: Callable[[str, int, int], None] | None = None,
    ) -> WorkerStage:
        """Check, compile and bind a stage: :meth:`prepare`, :meth:`compile` every bucket, then
        :meth:`bind`.

        Compiling comes first, from the spec's weight shapes (the signature check made them the
        artifact's): each compile gives the compiler's free heap back (``jaxdist.core.heap``) before
        the weights arrive, so the peak memory is the larger of the two, not their sum.

        Args:
            spec: the stage spec; validated here.
            artifact: the serialized ``jax.export`` artifact named by ``spec.artifact_digest``.
            cache: resolves the weight URIs (and enforces the weight roots).
            allowed_custom_calls: custom-call targets the artifact may use.
            devices: restrict device resolution to these (tests pass fakes); default: all.
            compile_buckets: compile every shape bucket now (ahead of time).
            worker: this worker's address, for error messages.
            on_phase: ``on_phase(phase, done, total)`` is called as each step starts:
                ``("load", 0, 0)``, ``("compile", i, n)`` before bucket ``i`` of ``n``, and
                ``("bind", 0, 0)``. An exception it raises ends the load there: nothing after
                it runs (the worker stops a load whose caller left this way).

        Raises:
            SpecError: the spec is malformed or disagrees with the artifact's signature.
            ArtifactError: corrupt artifact, wrong digest, missing platform, forbidden call.
            DeviceError: the device directive cannot be honoured here.
            WeightError: a weight cannot be resolved or does not match its WeightRef.
        """
        phase = on_phase or (lambda _phase, _done, _total: None)
        phase("load", 0, 0)
        stage = cls.prepare(spec, artifact=artifact, allowed_custom_calls=allowed_custom_calls,
                            devices=devices, worker=worker)
        if compile_buckets:
            # A stage of one static shape is compiled now too, so that whatever its first frame
            # would fail to compile (a custom call no handler serves) fails the load instead.
            buckets: list[Any] = list(spec.buckets) or ([{}] if _static(spec) else [])
            for i, bucket in enumerate(buckets):
                phase("compile", i, len(buckets))
                stage.compile(bucket)
        phase("bind", 0, 0)
        stage.bind(cache)
        return stage

    @classmethod
    def prepare(
        cls,
        spec: StageSpec,
        *,
        artifact: bytes,
        allowed_custom_calls: Collection[str] = DEFAULT_CUSTOM_CALL_ALLOWLIST,
        devices: Sequence[Any] | None = None,
        worker: str = "",
    ) -> WorkerStage:
        """Check a spec and its artifact and resolve the device; no weights yet. The stage can
        :meth:`compile`; it runs once :meth:`bind` has bound its weights. Raises as
        :meth:`load`, except ``WeightError``."""
        validate(spec)
        device = resolve_device(spec.device, devices)
        platform = device_platform(device)
        exported = load_artifact(artifact, expected_digest=spec.artifact_digest,
                                 platform=platform,
                                 allowed_custom_calls=(*allowed_custom_calls,
                                                       *kernels.OWN_TARGETS))
        kernels.require(custom_call_targets(exported), platform, worker=worker,
                        where=f"stage {spec.stage_index} ({spec.artifact_digest[:19]})")
        cls._check_signature(spec, exported)
        return cls(spec, exported, device, [])

    def bind(self, cache: WeightCache) -> None:
        """Bind the spec's weights through ``cache`` and put them on the device (once).

        Raises:
            WeightError: a weight cannot be resolved or does not match its WeightRef.
        """
        if self._bound:
            return
        t0 = time.perf_counter()
        params = []
        # One array per distinct binding: a tied embedding bound packed is the lookup table
        # and the LM head at once, with the same bytes.
        bound: dict[tuple[Any, ...], jax.Array] = {}
        for ref in self.spec.weights:
            key = ref.binding
            if key not in bound:
                host = cache.load(ref.uri, param=ref.param, shape=ref.shape, dtype=ref.dtype,
                                  sha256=ref.sha256, packed=ref.packed,
                                  transpose=ref.transpose, quant=ref.quant)
                # ``host`` is new, aligned and ours: XLA:CPU takes it as the buffer (no
                # second copy); other platforms copy it to the device, and it is freed here.
                bound[key] = jax.device_put(host, self.device, may_alias=True)
                del host
            params.append(bound[key])
        jax.block_until_ready(params)
        self._params = params
        self._bound = True
        release_free_heap()  # the conversions' temporaries
        self.bind_seconds = time.perf_counter() - t0
        log.info("stage %d/%d (%s): bound %d weights (%.1f MB) on %s in %.2fs",
                 self.spec.stage_index, self.spec.num_stages, self.spec.artifact_digest[:19],
                 len(params), self.spec.weight_bytes / 1e6, self.device, self.bind_seconds)

    @staticmethod
    def _check_signature(spec: StageSpec, exported: jax.export.Exported) -> None:
        where = f"stage {spec.stage_index} ({spec.artifact_digest[:19]})"
        n_w, n_s, n_i = len(spec.weights), len(spec.state), len(spec.inputs)
        avals = exported.in_avals
        if len(avals) != n_w + n_s + n_i:
            raise SpecError(f"{where}: the artifact takes {len(avals)} arguments, the spec lists "
                            f"{n_w} weights + {n_s} state + {n_i} inputs = {n_w + n_s + n_i}")
        for ref, aval in zip(spec.weights, avals[:n_w]):
            if tuple(aval.shape) != tuple(ref.shape) or aval.dtype.name != ref.dtype:
                raise SpecError(f"{where}: weight {ref.param!r}: the artifact expects "
                                f"{aval.dtype.name}{_dims_str(aval.shape)}, the spec binds "
                                f"{ref.dtype}{_dims_str(ref.shape)}")
        for st, aval in zip(spec.state, avals[n_w:n_w + n_s]):
            if tuple(aval.shape) != tuple(st.shape) or aval.dtype.name != st.dtype:
                raise SpecError(f"{where}: state {st.name!r}: the artifact expects "
                                f"{aval.dtype.name}{_dims_str(aval.shape)}, the spec declares "
                                f"{st.dtype}{_dims_str(st.shape)}")
        outs = exported.out_avals
        if len(outs) != len(spec.outputs) + n_s:
            raise SpecError(f"{where}: the artifact returns {len(outs)} results, the spec lists "
                            f"{len(spec.outputs)} outputs + {n_s} state")
        pairs: list[tuple[str, TensorSig, Any]] = [
            ("input", sig, aval) for sig, aval in zip(spec.inputs, avals[n_w + n_s:])]
        pairs += [("output", sig, aval) for sig, aval in zip(spec.outputs, outs)]
        for kind, sig, aval in pairs:
            if _aval_dims(aval) != tuple(sig.dims) or aval.dtype.name != sig.dtype:
                raise SpecError(f"{where}: {kind} {sig.name!r}: the artifact has "
                                f"{aval.dtype.name}{_dims_str(_aval_dims(aval))}, the spec says "
                                f"{sig.dtype}{_dims_str(sig.dims)}")

    # ------------------------------------------------------------------------------------------
    # Compilation

    def _arg_specs(self, input_shapes: Sequence[tuple[int, ...]]) -> list[jax.ShapeDtypeStruct]:
        sh = self._sharding
        specs = [jax.ShapeDtypeStruct(tuple(w.shape), codec.dtype_from_name(w.dtype), sharding=sh)
                 for w in self.spec.weights]
        specs += [jax.ShapeDtypeStruct(s.shape, codec.dtype_from_name(s.dtype), sharding=sh)
                  for s in self.spec.state]
        specs += [jax.ShapeDtypeStruct(shape, dt, sharding=sh)
                  for shape, dt in zip(input_shapes, self._input_dtypes)]
        return specs

    def bucket_shapes(self, bucket: ShapeBucket | Mapping[str, int]
                      ) -> tuple[tuple[int, ...], ...]:
        """The input shapes of one binding of the symbolic dims.

        Raises:
            SpecError: the bucket leaves a symbol unbound, or makes a dim invalid.
        """
        dims = bucket.dims if isinstance(bucket, ShapeBucket) else bucket
        shapes = []
        for sig in self.spec.inputs:
            try:
                shapes.append(tuple(evaluate(d, dims) for d in sig.dims))
            except KeyError as exc:
                raise SpecError(f"stage {self.spec.stage_index}: bucket {dict(dims)} does not bind "
                                f"symbol {exc.args[0]!r} of input {sig.name!r}") from None
            except ValueError as exc:
                raise SpecError(f"stage {self.spec.stage_index}: bucket {dict(dims)}, input "
                                f"{sig.name!r}: {exc}") from None
        return tuple(shapes)

    def compile(self, bucket: ShapeBucket | Mapping[str, int]) -> float:
        """Compile ahead of time for one binding of the symbolic dims. Returns seconds spent."""
        return self.compile_shapes(self.bucket_shapes(bucket))

    def is_compiled(self, shapes: tuple[tuple[int, ...], ...]) -> bool:
        """Whether :meth:`run` has an executable for these input shapes (no compile on call)."""
        return shapes in self._compiled

    def compile_shapes(self, shapes: tuple[tuple[int, ...], ...]) -> float:
        """Compile for concrete input shapes (as :meth:`check_inputs` returns them), once.
        Returns seconds spent (0 when compiled already)."""
        with self._lock:
            if shapes in self._compiled:
                return 0.0
            t0 = time.perf_counter()
            try:
                self._compiled[shapes] = self._jitted.lower(*self._arg_specs(shapes)).compile()
            except Exception as exc:
                m = _NO_HANDLER.search(str(exc))
                if m is None:
                    raise
                raise ArtifactError(
                    f"stage {self.spec.stage_index}: custom call {m.group(1)!r} is allowed but "
                    f"no handler for it is registered on this worker "
                    f"({device_platform(self.device)}); it cannot run here") from None
            took = time.perf_counter() - t0
            self.compile_seconds += took
        release_free_heap()  # the compiler's transient heap, hundreds of MB for a large stage
        log.info("stage %d: compiled input shapes %s in %.2fs", self.spec.stage_index, shapes, took)
        return took

    @property
    def compiled_shapes(self) -> list[tuple[tuple[int, ...], ...]]:
        return list(self._compiled)

    # ------------------------------------------------------------------------------------------
    # Running

    def init_state(self) -> dict[str, jax.Array]:
        """Fresh zero state for a new session, on this stage's device."""
        return {s.name: jax.device_put(np.zeros(s.shape, codec.dtype_from_name(s.dtype)),
                                       self.device) for s in self.spec.state}

    def check_inputs(self, inputs: Mapping[str, Any]) -> tuple[tuple[int, ...], ...]:
        """Check names, dtypes and dims of inputs against the spec, and, when the spec is
        strict (:attr:`StageSpec.strict_shapes`), that their shapes are a bucket's; return
        their shapes.

        Raises:
            SpecError: naming the stage, the input, the expected and the found signature; or
                the shapes found and the buckets, for shapes in none of them.
        """
        where = f"stage {self.spec.stage_index}"
        if list(inputs) != self._input_names and set(inputs) != set(self._input_names):
            raise SpecError(f"{where}: expected inputs {self._input_names}, found {list(inputs)}")
        shapes = []
        for sig, dtype in zip(self.spec.inputs, self._input_dtypes):
            x = inputs[sig.name]
            if not hasattr(x, "shape"):
                x = np.asarray(x)
            if x.dtype != dtype:
                raise SpecError(f"{where}: input {sig.name!r}: expected dtype {dtype.name}, "
                                f"found {np.dtype(x.dtype).name}")
            if len(x.shape) != len(sig.dims):
                raise SpecError(f"{where}: input {sig.name!r}: expected dims "
                                f"{_dims_str(sig.dims)}, found {tuple(x.shape)}")
            shapes.append(tuple(x.shape))
        key = tuple(shapes)
        if key in self._shapes_ok:  # the dims below depend on the shapes alone
            return key
        bound = _bind_symbols(where, self.spec.inputs, shapes)
        for sig, shape in zip(self.spec.inputs, shapes):
            if any(evaluate(d, bound) != n for d, n in zip(sig.dims, shape)):
                with_ = "" if all(isinstance(d, int) or is_symbol(d) for d in sig.dims) else \
                    f" with {_bindings_str(bound)}"
                raise SpecError(f"{where}: input {sig.name!r}: expected dims "
                                f"{_dims_str(sig.dims)}{with_}, found {shape}")
        if self.spec.strict_shapes and key not in self._bucket_shapes:
            raise SpecError(self._off_bucket(key, bound))
        if len(self._shapes_ok) < MAX_CHECKED_SHAPES:
            self._shapes_ok.add(key)
        return key

    def _off_bucket(self, shapes: tuple[tuple[int, ...], ...], bound: Mapping[str, int]) -> str:
        """Why a strict stage refuses inputs of ``shapes`` (symbols ``bound``)."""
        buckets = self.spec.buckets
        shown = "; ".join(_bindings_str(b.dims) for b in buckets[:SHOWN_BUCKETS])
        more = f"; and {len(buckets) - SHOWN_BUCKETS} more" if len(buckets) > SHOWN_BUCKETS else ""
        found = ", ".join(f"{n} {_dims_str(s)}" for n, s in zip(self._input_names, shapes))
        return (f"stage {self.spec.stage_index}: input shapes {found} ({_bindings_str(bound)}) "
                f"are in none of its {len(buckets)} buckets ({shown}{more}); the spec takes "
                f"those shapes only (StageSpec.any_shape is false): pad the inputs to a bucket")

    def run(self, inputs: Mapping[str, Any], state: Mapping[str, jax.Array] | None = None, *,
            shapes: tuple[tuple[int, ...], ...] | None = None
            ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        """Run one step.

        Args:
            inputs: arrays by input name (numpy or jax); moved to the device here.
            state: the session's state from the previous step (or :meth:`init_state`). These
                buffers are donated: do not use them after the call.
            shapes: the result of :meth:`check_inputs` when the caller already checked them.

        Returns:
            ``(outputs, new_state)``, both on the device. Outputs are not copied to the host;
            JAX dispatch is asynchronous, so the caller decides when to wait.

        Raises:
            SpecError: the inputs do not match the spec.
        """
        if not self._bound:
            raise SpecError(f"stage {self.spec.stage_index}: its weights are not bound; call "
                            f"bind(cache) before run (WorkerStage.load does both)")
        if shapes is None:
            shapes = self.check_inputs(inputs)
        if shapes not in self._compiled:
            log.info("stage %d: input shapes %s not compiled yet; compiling now",
                     self.spec.stage_index, shapes)
            self.compile_shapes(shapes)
        if self._state_names:
            if state is None:
                raise SpecError(f"stage {self.spec.stage_index}: this stage keeps state "
                                f"{self._state_names}; pass state (init_state() for a new session)")
            missing = [n for n in self._state_names if n not in state]
            if missing:
                raise SpecError(f"stage {self.spec.stage_index}: this stage keeps state "
                                f"{self._state_names}, found {list(state)}: missing {missing}")
            st = [state[n] for n in self._state_names]
        else:
            st = []
        # Host arrays go straight to the executable, which copies them to its device: cheaper
        # than a separate jax.device_put per input (measured ~6 us against ~19 us on CPU).
        results = self._compiled[shapes](*self._params, *st,
                                         *(inputs[n] for n in self._input_names))
        n_out = len(self._output_names)
        return (dict(zip(self._output_names, results[:n_out])),
                dict(zip(self._state_names, results[n_out:])))

    @property
    def packed_bytes(self) -> int:
        """Of :attr:`weight_bytes`, the GGML blocks bound as stored."""
        packed = {id(p): p for ref, p in zip(self.spec.weights, self._params) if ref.packed}
        return sum(p.nbytes for p in packed.values())

    @property
    def dequantized_types(self) -> list[str]:
        """GGML types of the weights dequantized when bound (sorted, once each)."""
        return sorted({r.quant for r in self.spec.weights
                       if r.quant and not r.packed and r.quant != "F32"})

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights bound on the device (a tensor shared by two params counts once)."""
        return sum(p.nbytes for p in {id(p): p for p in self._params}.values())


_NO_HANDLER = re.compile(r"No (?:FFI handler|registered implementation for custom call)"
                         r"(?: registered)? (?:for|to) ([\w.$-]+)")


def shapes_at_load(spec: StageSpec) -> int:
    """How many input shapes :meth:`WorkerStage.load` compiles for ``spec`` (at most): its
    distinct buckets, or its one shape when no input dim is a symbol."""
    if spec.buckets:
        return len({tuple(sorted(b.dims.items())) for b in spec.buckets})
    return 1 if _static(spec) else 0


def _static(spec: StageSpec) -> bool:
    """Whether every input dim of ``spec`` is a number (no symbol to bind)."""
    try:
        return all(evaluate(d, {}) >= 0 for sig in spec.inputs for d in sig.dims)
    except (KeyError, ValueError):
        return False
