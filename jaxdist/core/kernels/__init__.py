"""Native CPU kernels for quantized weights: what a worker (or a single process) registers.

The kernels multiply f32 activations by GGUF weight blocks as the file stores them, so a
quantized model stays quantized in memory and decode reads the narrow bytes. They are XLA FFI
handlers (``ggml_matmul.cc``, built on first use by :mod:`jaxdist.core.kernels.build`) under the
versioned target name :data:`TARGET`; exported stages reach them through
``lax.platform_dependent`` (:mod:`jaxdist.core.kernels.ops`), so the same artifact also runs on
GPU/TPU workers, which dequantize in the graph instead. :data:`MOE_TARGET` is the same product
for a mixture of experts' stacked expert matrices (ggml's ``mul_mat_id``). A third handler
(``attention.cc``, :data:`ATTENTION_TARGET`) attends a decode step over the slot KV cache reading only the
positions in use, on the same helper threads, with AVX-512F code where the CPU has it (AVX2
otherwise); quantized stages call it too.

:func:`load` builds, loads and registers the library once per process and returns a
:class:`KernelInfo`. It never raises: a library that cannot be had (no compiler, no
``libggml-python`` wheel, a CPU without AVX2) gives ``KernelInfo.available == False`` with the
reason, the worker says so at start-up and advertises no kernels, and the coordinator then binds
that worker's weights dequantized.

The activations are quantized by ggml's own routines (the ``libggml-python`` wheel), exactly as
llama.cpp does, so a jaxdist worker computes what llama.cpp computes. The dot products are
jaxdist's own AVX-512 VNNI code where the CPU has it and the type has one (Q4_0, Q4_1, Q8_0,
Q4_K, Q6_K: ``wide.h``), else ggml's AVX2 ``vec_dot``; :attr:`KernelInfo.isa` says which, and
:func:`set_isa` switches between them. See docs/kernels.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
from collections.abc import Collection
from dataclasses import dataclass

from jaxdist.core.errors import ArtifactError
from jaxdist.core.kernels.build import KernelBuildError, build, find_ggml

__all__ = ["ABI_VERSION", "ATTENTION_TARGET", "ATTENTION_V2_TARGET", "DEQUANTIZE_TARGET",
           "KERNEL_TYPES", "MOE_TARGET", "OWN_TARGETS", "TARGET", "KernelBuildError",
           "KernelInfo", "load", "loaded", "require", "set_isa"]

log = logging.getLogger(__name__)

ABI_VERSION = 2
"""The version of the library's exported C functions (``jaxdist_kernels_*``), checked at load;
the custom call targets are versioned by their names."""
TARGET = "jaxdist_ggml_matmul_v2"
"""The custom call target of the quantized matmul (with a mask of the rows to compute); a new
ABI gets a new name, never a change."""
MOE_TARGET = "jaxdist_ggml_moe_matmul_v1"
"""The quantized matmul of a mixture of experts (ggml's mul_mat_id): x (R, K), the experts'
blocks (E, N, row_bytes) and ids (T, S) int32 give y (T, S, N), y[t, s] = x_row @ W_ids[t, s].T
with x_row x[t] (R == T) or x[t * S + s] (R == T * S); a negative id gives zeros."""
DEQUANTIZE_TARGET = "jaxdist_ggml_dequantize_v2"
"""GGML blocks to float32 on the CPU (the many-rows path of the matmul), after the activations
it is for are computed (they are an operand, for ordering only)."""
ATTENTION_TARGET = "jaxdist_cache_attention_v1"
"""Attention of a decode step over the slot KV cache, reading only the positions in use. Full
(causal) attention: what every stage without a sliding window calls."""
ATTENTION_V2_TARGET = "jaxdist_cache_attention_v2"
"""The same with an attribute ``window`` (sliding-window attention: a query at position p sees
the keys in (p - window, p]; 0 is full attention). Layers with a window call it."""

OWN_TARGETS: frozenset[str] = frozenset({TARGET, MOE_TARGET, DEQUANTIZE_TARGET,
                                         ATTENTION_TARGET, ATTENTION_V2_TARGET})
"""Every custom call target of jaxdist's own kernels."""

KERNEL_TYPES: tuple[str, ...] = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K",
                                 "Q3_K", "Q4_K", "Q5_K", "Q6_K")
"""GGML types with a kernel; other quantized types are dequantized when bound."""


@dataclass(frozen=True)
class KernelInfo:
    """What this process has of the CPU kernels.

    Attributes:
        available: the handler is registered with XLA in this process.
        version: ``"<abi>+ggml-<libggml version>"`` when available, else ``""``.
        types: the GGML types with a kernel (empty when unavailable).
        targets: custom call targets registered (empty when unavailable).
        threads: threads per call as set (0: one per CPU the process may use, the caller
            included).
        reason: why the kernels are unavailable ("" when they are).
        isa: the dot products in use: ``"avx512vnni"`` (jaxdist's own, where the CPU has
            AVX-512 with VNNI and VBMI and the type has one: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) or
            ``"ggml"`` (the wheel's AVX2 ``vec_dot``; ``JAXDIST_KERNELS_ISA=ggml`` forces it).
        cpus: the CPUs the process may use (its affinity mask, capped by a cgroup CPU quota):
            the thread count when ``threads`` is 0.
    """

    available: bool
    version: str = ""
    types: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    threads: int = 0
    reason: str = ""
    isa: str = ""
    cpus: int = 0


_lock = threading.Lock()
_info: KernelInfo | None = None
_lib: ctypes.CDLL | None = None


def _register(threads: int) -> KernelInfo:
    global _lib
    import jax  # noqa: PLC0415

    ggml = find_ggml()
    path = build()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(f"cannot load the CPU kernels {path}: {exc}") from exc
    abi = lib.jaxdist_kernels_abi_version()
    if abi != ABI_VERSION:
        raise KernelBuildError(f"{path} has kernel ABI {abi}, expected {ABI_VERSION}; delete it "
                               f"to rebuild")
    err = ctypes.create_string_buffer(256)
    if lib.jaxdist_kernels_init(err, len(err)) != 0:
        raise KernelBuildError(err.value.decode())
    lib.jaxdist_kernels_set_threads(ctypes.c_int(threads))
    lib.jaxdist_kernels_types.restype = ctypes.c_char_p
    types = tuple(t.upper() for t in lib.jaxdist_kernels_types().decode().split(","))
    if types != KERNEL_TYPES:
        raise KernelBuildError(f"{path} has kernels for {types}, expected {KERNEL_TYPES}")
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxdistGgmlMatmulV2),
                                platform="cpu")
    jax.ffi.register_ffi_target(MOE_TARGET, jax.ffi.pycapsule(lib.JaxdistGgmlMoeMatmulV1),
                                platform="cpu")
    jax.ffi.register_ffi_target(DEQUANTIZE_TARGET,
                                jax.ffi.pycapsule(lib.JaxdistGgmlDequantizeV2), platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.JaxdistCacheAttentionV1),
                                platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_V2_TARGET,
                                jax.ffi.pycapsule(lib.JaxdistCacheAttentionV2), platform="cpu")
    lib.jaxdist_kernels_isa.restype = ctypes.c_char_p
    lib.jaxdist_kernels_set_isa.restype = ctypes.c_char_p
    _lib = lib
    return KernelInfo(True, f"{ABI_VERSION}+ggml-{ggml.version}", types,
                      tuple(sorted(OWN_TARGETS)), threads, isa=lib.jaxdist_kernels_isa().decode(),
                      cpus=lib.jaxdist_kernels_default_threads())


def load(*, threads: int = 0, enabled: bool = True) -> KernelInfo:
    """Build (first time), load and register the CPU kernels in this process; idempotent.

    Args:
        threads: threads per kernel call (0: one per core, the caller included).
            Changing it on a later call takes effect for later calls.
        enabled: ``False`` registers nothing and reports the kernels unavailable (the worker's
            ``--no-kernels``).

    Returns:
        What the process has; ``available`` is ``False`` with a ``reason`` when the kernels
        cannot be had here (never raises for that).
    """
    global _info
    with _lock:
        if not enabled:
            if _info is None or not _info.available:
                _info = KernelInfo(False, reason="disabled (--no-kernels)")
            return _info
        if _info is not None and _info.available:
            if threads != _info.threads and _lib is not None:
                _lib.jaxdist_kernels_set_threads(ctypes.c_int(threads))
                _info = dataclasses.replace(_info, threads=threads)
            return _info
        try:
            _info = _register(threads)
        except KernelBuildError as exc:
            log.warning("jaxdist CPU kernels unavailable: %s", exc)
            _info = KernelInfo(False, reason=str(exc))
        return _info


def set_isa(wide: bool) -> KernelInfo:
    """Use jaxdist's wide dot products (``True``, where the CPU has them) or ggml's (``False``)
    from the next call on; for comparing the two in one process (the tests, the benchmarks).
    The attention kernel follows it: AVX-512F (where the CPU has it) or AVX2. ``isa`` names the
    dot products only."""
    global _info
    with _lock:
        if _info is None or not _info.available or _lib is None:
            raise KernelBuildError("the CPU kernels are not loaded (kernels.load() first)")
        _info = dataclasses.replace(_info, isa=_lib.jaxdist_kernels_set_isa(int(wide)).decode())
        return _info


def loaded() -> KernelInfo:
    """What :func:`load` registered so far (unavailable, reason "not loaded", before any)."""
    return _info if _info is not None else KernelInfo(False, reason="not loaded")


def require(targets: Collection[str], platform: str, *, where: str, worker: str = "") -> None:
    """Check that this process can run the jaxdist kernels among an artifact's custom calls.

    Only the CPU lowering calls them; other platforms dequantize in the graph.

    Raises:
        ArtifactError: a kernel the artifact needs is not registered here, naming the kernel,
            the worker and why it has none. Raised at LoadStage, never at the first frame.
    """
    needed = sorted(set(targets) & OWN_TARGETS)
    if not needed or platform != "cpu":
        return
    info = loaded()
    missing = [t for t in needed if t not in info.targets]
    if missing:
        on = f"worker {worker}" if worker else "this process"
        raise ArtifactError(
            f"{where} calls the CPU kernel{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)}, which {on} does not have "
            f"({info.reason or 'another kernel ABI'}). Start the worker with the kernels "
            f"(jaxdist-worker without --no-kernels, on a machine with a C++ compiler and the "
            f"libggml-python wheel), or deploy onto it with quantized weights dequantized "
            f"(Cluster.deploy does that by itself for workers that advertise no kernels)")
