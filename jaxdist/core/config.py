"""Process-wide settings: environment variables are read and checked here, and only here.

Environment variables:
    JAXDIST_COMPILATION_CACHE: directory of the persistent XLA compilation cache
        (default ``~/.cache/jaxdist/xla``; ``off`` disables it).
    JAXDIST_ARTIFACT_CACHE: directory of the worker's on-disk artifact cache
        (default ``~/.cache/jaxdist/artifacts``).
    XLA_PYTHON_CLIENT_PREALLOCATE, XLA_PYTHON_CLIENT_MEM_FRACTION, XLA_CLIENT_MEM_FRACTION,
        XLA_PYTHON_CLIENT_ALLOCATOR: how jax's GPU backend takes memory. jaxdist sets them only
        where the user has set none of them (:func:`gpu_memory_env`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import platform
import re
from collections.abc import Mapping

import jax
import jaxlib

from jaxdist.core.errors import DeviceError

__all__ = ["DEFAULT_COMPILATION_CACHE_BYTES", "GPU_MEMORY_VARIABLES", "apply_gpu_memory_env",
           "check_gpu_memory_fraction", "configure_compilation_cache", "default_artifact_cache",
           "default_compilation_cache", "gpu_memory_env", "host_cpu_fingerprint",
           "inherited_environ"]

log = logging.getLogger(__name__)

_CACHE_HOME = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))


def default_compilation_cache() -> pathlib.Path | None:
    """The compilation cache directory from the environment, or ``None`` when disabled."""
    value = os.environ.get("JAXDIST_COMPILATION_CACHE", "")
    if value.lower() in ("off", "0", "none", "false"):
        return None
    return pathlib.Path(value) if value else _CACHE_HOME / "jaxdist" / "xla"


def default_artifact_cache() -> pathlib.Path:
    value = os.environ.get("JAXDIST_ARTIFACT_CACHE", "")
    return pathlib.Path(value) if value else _CACHE_HOME / "jaxdist" / "artifacts"


def host_cpu_fingerprint() -> str:
    """8 hex digits naming this host's CPU model and instruction-set flags."""
    model = flags = ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Processor", "cpu model") and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:  # not Linux: the platform module is the best we have
        model = platform.processor()
    text = f"{platform.machine()}|{model}|{flags}"
    return hashlib.sha256(text.encode()).hexdigest()[:8]


# JAX's LRU cache (jax/_src/lru_cache.py, read at jax 0.10.2) keeps KEY-cache files, and, when
# it has a bound, KEY-atime files: the last use, time.time_ns() as 8 little-endian bytes. Entries
# written without a bound have no atime file, and its eviction fails on them (every later put
# then fails with a warning), so a directory that an unbounded process wrote is dated first.
# tests/test_config.py (a bounded cache over an unbounded one's entries) fails if that changes.
_CACHE_SUFFIX, _ATIME_SUFFIX = "-cache", "-atime"

DEFAULT_COMPILATION_CACHE_BYTES = 4 << 30  # the worker's --max-compilation-cache-bytes


def _date_undated_entries(path: pathlib.Path) -> None:
    """Give each entry of a compilation cache directory without a last-use time its write time."""
    for entry in path.glob(f"*{_CACHE_SUFFIX}"):
        atime = entry.with_name(entry.name.removesuffix(_CACHE_SUFFIX) + _ATIME_SUFFIX)
        if not atime.exists():
            try:
                atime.write_bytes(entry.stat().st_mtime_ns.to_bytes(8, "little"))
            except OSError as exc:  # a read-only cache: JAX's own puts will say so
                log.warning("compilation cache %s: cannot date the entry %s: %s", path,
                            entry.name, exc)


def configure_compilation_cache(directory: str | os.PathLike[str] | None, device_kind: str = "",
                                *, max_bytes: int = DEFAULT_COMPILATION_CACHE_BYTES
                                ) -> pathlib.Path | None:
    """Turn on JAX's persistent compilation cache under ``directory``.

    JAX's own cache key already covers the computation, the compile options, the jaxlib version
    and the device kind. We still namespace the directory by jaxlib version and device kind
    (``DIR/jaxlib-0.10.2/NVIDIA_H100``) so a cache shared between machines or upgraded in place
    can never hand back a wrong entry, and so stale generations can be deleted as a whole. On
    CPU the device kind is just ``cpu`` while XLA compiles for the host's instruction set, so
    the CPU directory also carries a fingerprint of the host CPU (``cpu-1a2b3c4d``): a cache on
    shared storage never feeds an AVX-512 executable to a machine without AVX-512.

    Args:
        directory: cache root, or ``None`` to leave the cache off.
        device_kind: e.g. ``"cpu"`` or ``"NVIDIA H100"``; part of the subdirectory name.
        max_bytes: the bound on the directory's bytes, past which JAX deletes the least
            recently used executables (``jax_compilation_cache_max_size``); ``0``: no bound.
            Processes that share a directory should all bound it (see ``_ATIME_SUFFIX``).

    Returns:
        The directory actually used, or ``None``.
    """
    if directory is None:
        return None
    kind = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_kind or jax.default_backend())
    if kind.lower() == "cpu":
        kind = f"cpu-{host_cpu_fingerprint()}"
    path = pathlib.Path(directory) / f"jaxlib-{jaxlib.__version__}" / kind
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Cache every executable: stage compiles are few and each restart should be warm.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if max_bytes > 0:
        _date_undated_entries(path)
    jax.config.update("jax_compilation_cache_max_size", max_bytes if max_bytes > 0 else -1)
    log.info("persistent compilation cache at %s (%s)", path,
             f"at most {max_bytes} bytes" if max_bytes > 0 else "no bound")
    return path


# -- GPU memory -------------------------------------------------------------------------------
# jaxlib reads these when it creates the GPU backend (xla_client.generate_pjrt_gpu_plugin_options,
# read at jaxlib 0.10.2), not at import: setting them before the first device query is in time.
# By default that backend preallocates 75% of the GPU, so a second process on the same GPU
# (a second local worker, or the coordinator tracing a model) gets what is left, or nothing.
GPU_MEMORY_VARIABLES: tuple[str, ...] = (
    "XLA_PYTHON_CLIENT_PREALLOCATE",   # "false": allocate as needed
    "XLA_PYTHON_CLIENT_MEM_FRACTION",  # the fraction to preallocate (or the allocator's limit)
    "XLA_CLIENT_MEM_FRACTION",         # its newer name; jaxlib refuses both at once
    "XLA_PYTHON_CLIENT_ALLOCATOR",     # "platform": cudaMalloc per buffer, no pool
)
"""The variables through which a user chooses jax's GPU memory policy; set one, and jaxdist
leaves all of them as they are."""

# Names the variables that apply_gpu_memory_env set, as NAME=VALUE,...: a process started from
# this one (a worker a user script starts after Cluster.local, say) inherits them, and tells
# them from the user's own by this mark. It travels with the environment it describes.
_MARK = "JAXDIST_GPU_MEMORY_SET"


def check_gpu_memory_fraction(value: object, name: str = "--gpu-memory-fraction") -> float:
    """A GPU memory fraction ``F`` with ``0 < F <= 1``, from a flag's text or a number.

    Args:
        value: the text or number given.
        name: how the user gave it, for the message: a flag (``--gpu-memory-fraction``) or a
            keyword argument (``gpu_memory_fraction``).

    Raises:
        DeviceError: not a number, or not in ``(0, 1]``; the message names ``name`` and
            ``value``.

    Example:
        >>> check_gpu_memory_fraction("0.3")
        0.3
        >>> try:
        ...     check_gpu_memory_fraction(1.5, "gpu_memory_fraction")
        ... except DeviceError as exc:
        ...     print(str(exc).split(":")[0])
        gpu_memory_fraction=1.5
    """
    fraction = -1.0
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        try:
            fraction = float(value)
        except ValueError:
            pass
    if not 0 < fraction <= 1:  # also refuses nan
        raise DeviceError(f"{_given(name, value)}: expected the fraction of the GPU's memory "
                          f"each worker preallocates, 0 < F <= 1, such as 0.3")
    return fraction


def _given(name: str, value: object) -> str:
    return f"{name} {value}" if name.startswith("-") else f"{name}={value!r}"


def _show(variables: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in variables.items())


def gpu_memory_env(fraction: float | None, environ: Mapping[str, str], *,
                   name: str = "--gpu-memory-fraction") -> tuple[dict[str, str], str]:
    """How a process takes GPU memory: the variables to set before jax starts its backends.

    * No fraction, and none of :data:`GPU_MEMORY_VARIABLES` in ``environ``: allocate as needed
      (``XLA_PYTHON_CLIENT_PREALLOCATE=false``), so several processes share one GPU, each
      holding what it uses.
    * A fraction: preallocate that fraction of the GPU (``XLA_PYTHON_CLIENT_PREALLOCATE=true``,
      ``XLA_PYTHON_CLIENT_MEM_FRACTION=F``).
    * The user set one of the variables and no fraction: nothing is set; theirs is the policy.

    Harmless on a machine without a GPU: only jax's GPU backend reads these.

    Args:
        fraction: the fraction, checked by :func:`check_gpu_memory_fraction`; or ``None``.
        environ: the user's environment (:func:`inherited_environ`).
        name: how the user gave the fraction, for the message.

    Returns:
        ``(variables to set, the choice in words)``.

    Raises:
        DeviceError: a fraction while ``environ`` sets one of the variables too; which one
            should win is the user's to say.

    Example:
        >>> gpu_memory_env(None, {})[0]
        {'XLA_PYTHON_CLIENT_PREALLOCATE': 'false'}
        >>> gpu_memory_env(0.3, {})[0]
        {'XLA_PYTHON_CLIENT_PREALLOCATE': 'true', 'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.3'}
        >>> gpu_memory_env(None, {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"})[0]
        {}
    """
    given = {k: environ[k] for k in GPU_MEMORY_VARIABLES if k in environ}
    if fraction is not None:
        if given:
            raise DeviceError(f"{_given(name, fraction)}: the environment already sets "
                              f"{_show(given)}; unset it, or drop {name}")
        chosen = {"XLA_PYTHON_CLIENT_PREALLOCATE": "true",
                  "XLA_PYTHON_CLIENT_MEM_FRACTION": str(fraction)}
        return chosen, f"GPU memory: {fraction:.0%} of the GPU preallocated ({_show(chosen)})"
    if given:
        return {}, f"GPU memory: as the environment says ({_show(given)})"
    chosen = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    return chosen, (f"GPU memory: allocated as needed ({_show(chosen)}); "
                    f"--gpu-memory-fraction F preallocates a fixed share instead")


def _marked(environ: Mapping[str, str]) -> dict[str, str]:
    pairs = (item.partition("=") for item in environ.get(_MARK, "").split(",") if item)
    return {k: v for k, _, v in pairs}


def inherited_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The user's own environment: ``environ`` (default ``os.environ``) without the GPU memory
    variables that :func:`apply_gpu_memory_env` set in this process or in a jaxdist process
    it was started from, as long as they still hold the value it set.

    A worker decides its GPU memory from the user's environment and its own flags, not from
    the choice a parent process made for itself.
    """
    environ = os.environ if environ is None else environ
    marked = _marked(environ)
    return {k: v for k, v in environ.items() if k != _MARK and marked.get(k) != v}


def apply_gpu_memory_env(fraction: float | None = None) -> str:
    """Set :func:`gpu_memory_env`'s choice in this process's environment, and log it.

    Call it before jax starts a backend (the first device query); later, it changes nothing
    for this process. It replaces an earlier call's choice, never the user's.

    Returns:
        The choice, in words.

    Raises:
        DeviceError: as :func:`gpu_memory_env`.
    """
    user = inherited_environ()
    chosen, words = gpu_memory_env(fraction, user)
    for key in _marked(os.environ):
        if key not in user:
            os.environ.pop(key, None)
    os.environ.pop(_MARK, None)
    os.environ.update(chosen)
    if chosen:
        os.environ[_MARK] = ",".join(f"{k}={v}" for k, v in chosen.items())
    log.info("%s", words)
    return words
