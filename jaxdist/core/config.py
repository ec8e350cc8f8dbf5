"""Process-wide settings: environment variables are read and checked here, and only here.

Environment variables:
    JAXDIST_COMPILATION_CACHE: directory of the persistent XLA compilation cache
        (default ``~/.cache/jaxdist/xla``; ``off`` disables it).
    JAXDIST_ARTIFACT_CACHE: directory of the worker's on-disk artifact cache
        (default ``~/.cache/jaxdist/artifacts``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import platform
import re

import jax
import jaxlib

__all__ = ["DEFAULT_COMPILATION_CACHE_BYTES", "configure_compilation_cache",
           "default_artifact_cache", "default_compilation_cache", "host_cpu_fingerprint"]

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
