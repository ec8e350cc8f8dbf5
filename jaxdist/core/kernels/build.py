"""Build the CPU kernel library once per machine, and cache it.

The handler sources (``ggml_matmul.cc``, ``attention.cc``, and the wide-vector dot products
``wide_simple.cc`` and ``wide_kquants.cc`` behind ``wide.h``; ``pool.h`` shares the helper
threads) ship with jaxdist. They are compiled
into one library on first use with the machine's C++ compiler against two sets of headers that the normal install brings: XLA's FFI
API (``jax.ffi.include_dir()``) and ggml's (the ``libggml-python`` wheel). The shared object goes
to the kernel cache, keyed by a digest of everything that affects it (sources, jaxlib and
libggml versions, compiler, machine), so an upgrade of any of them builds afresh and concurrent
workers build it once (a file lock).

The cache is ``$JAXDIST_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/jaxdist/kernels``, else
``~/.cache/jaxdist/kernels``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from jaxdist.core.errors import JaxdistError

__all__ = ["GgmlLibrary", "KernelBuildError", "build", "cache_dir", "find_ggml"]

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(n) for n in ("ggml_matmul.cc", "attention.cc",
                                                      "wide_simple.cc", "wide_kquants.cc"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("wide.h", "pool.h"))
BUILD_TIMEOUT_S = 300.0


class KernelBuildError(JaxdistError):
    """The CPU kernels cannot be built or loaded here (the reason says what is missing)."""

    code = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class GgmlLibrary:
    """Where the libggml-python wheel put ggml's CPU library and headers."""

    version: str
    include: Path
    lib: Path


def find_ggml() -> GgmlLibrary:
    """Locate the ``libggml`` package (the ``libggml-python`` wheel).

    Raises:
        KernelBuildError: the package is not installed, or lacks headers or ``libggml-cpu``.
    """
    spec = importlib.util.find_spec("libggml")
    if spec is None or not spec.submodule_search_locations:
        raise KernelBuildError("the libggml-python package is not installed (pip install "
                               "libggml-python; its wheels exist for Linux x86_64)")
    root = Path(next(iter(spec.submodule_search_locations)))
    include = root / "include"
    lib = next((root / d for d in ("lib64", "lib") if (root / d / "libggml-cpu.so").exists()),
               None)
    if lib is None or not (include / "ggml-cpu.h").is_file():
        raise KernelBuildError(f"libggml-python at {root} has no include/ggml-cpu.h or "
                               f"lib64/libggml-cpu.so; reinstall it")
    try:
        version = importlib.metadata.version("libggml-python")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return GgmlLibrary(version, include, lib)


def cache_dir() -> Path:
    """The kernel cache directory (see the module docstring)."""
    env = os.environ.get("JAXDIST_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxdist" / "kernels"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++) to build the "
                               "jaxdist CPU kernels")
    return cxx


def _key(cxx: str, ggml: GgmlLibrary, jax_include: str) -> str:
    import jaxlib  # noqa: PLC0415

    try:
        cc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30,
                            check=False).stdout.splitlines()[:1]
    except OSError as exc:
        raise KernelBuildError(f"the C++ compiler {cxx!r} does not run: {exc}") from exc
    h = hashlib.sha256(b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS)))
    for part in (jaxlib.__version__, jax_include, ggml.version, str(ggml.lib), *cc,
                 platform.machine()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def build(*, force: bool = False) -> Path:
    """The path of the built kernel library, building it first if the cache lacks it.

    Raises:
        KernelBuildError: no compiler, no libggml-python, or the compile failed (the compiler's
            output is in the message).
    """
    import jax  # noqa: PLC0415

    ggml = find_ggml()
    cxx = _compiler()
    jax_include = jax.ffi.include_dir()
    key = _key(cxx, ggml, jax_include)
    out_dir = cache_dir()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelBuildError(f"cannot create the kernel cache {out_dir}: {exc} (set "
                               f"JAXDIST_KERNEL_CACHE to a writable directory)") from exc
    target = out_dir / f"jaxdist_kernels_v2-{key}.so"
    if target.exists() and not force:
        return target
    with open(out_dir / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be building the same key
        if target.exists() and not force:
            return target
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
               f"-I{jax_include}", f"-I{ggml.include}", f"-I{SOURCES[0].parent}", *map(str, SOURCES), f"-L{ggml.lib}",
               "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{ggml.lib}", "-o", str(tmp)]
        log.warning("building the jaxdist CPU kernels (once per machine, about 20 s): %s",
                    target)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise KernelBuildError(f"building the CPU kernels failed: {exc}") from exc
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise KernelBuildError(f"building the CPU kernels failed (exit {proc.returncode}): "
                                   f"{' '.join(cmd)}\n{proc.stderr[-4000:]}")
        os.replace(tmp, target)
        log.info("built %s in %.1fs", target, time.monotonic() - t0)
    return target
