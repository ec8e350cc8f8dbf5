"""Process-wide settings: environment variables are read and checked here, and only here.

Environment variables:
    JAXDIST_COMPILATION_CACHE: directory of the persistent XLA compilation cache
        (default ``~/.cache/jaxdist/xla``; ``off`` disables it).
    JAXDIST_ARTIFACT_CACHE: directory of the worker's on-disk artifact cache
        (default ``~/.cache/jaxdist/artifacts``).
"""

from __future__ import annotations

import logging
import os
import pathlib
import re

import jax
import jaxlib

__all__ = ["configure_compilation_cache", "default_artifact_cache", "default_compilation_cache"]

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


def configure_compilation_cache(directory: str | os.PathLike[str] | None, device_kind: str = ""
                                ) -> pathlib.Path | None:
    """Turn on JAX's persistent compilation cache under ``directory``.

    JAX's own cache key already covers the computation, the compile options, the jaxlib version
    and the device kind. We still namespace the directory by jaxlib version and device kind so a
    cache shared between machines or upgraded in place can never hand back a wrong entry, and so
    stale generations can be deleted as a whole.

    Args:
        directory: cache root, or ``None`` to leave the cache off.
        device_kind: e.g. ``"cpu"`` or ``"NVIDIA H100"``; part of the subdirectory name.

    Returns:
        The directory actually used, or ``None``.
    """
    if directory is None:
        return None
    kind = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_kind or jax.default_backend())
    path = pathlib.Path(directory) / f"jaxlib-{jaxlib.__version__}" / kind
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Cache every executable: stage compiles are few and each restart should be warm.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log.info("persistent compilation cache at %s", path)
    return path
