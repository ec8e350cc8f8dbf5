"""The ``jaxdist`` command: run models on workers and inspect them.

Subcommands:
    demo      deploy a small MLP across local workers and check it against one process
    status    a table per worker: address, device, memory, versions, stages, sessions, uptime

Every failure prints one line (``jaxdist: error: ...``) and exits non-zero; no tracebacks for
errors a user can fix.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from jaxdist.errors import JaxdistError

__all__ = ["main"]


class ProgressBar:
    """A one-line progress display on stderr, for ``Cluster.deploy(progress=...)``."""

    def __init__(self, stream: Any = sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()

    def __call__(self, what: str, done: int, total: int) -> None:
        width = 24
        filled = int(width * done / max(total, 1))
        bar = "#" * filled + "-" * (width - filled)
        line = f"[{bar}] {done}/{total} {what} ({time.perf_counter() - self.t0:.1f}s)"
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if done >= total and total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _workers_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="", help="comma-separated HOST:PORT of running workers")
    p.add_argument("--local", type=int, default=None, metavar="N",
                   help="spawn N local workers (default 2 when --workers is not given)")


def _cmd_demo(opts: argparse.Namespace) -> int:
    import jax.numpy as jnp
    import numpy as np
    from safetensors.numpy import save_file

    from jaxdist.coordinator import Cluster
    from jaxdist.model import Model, Param, Unit

    d, layers = opts.width, opts.layers
    root = tempfile.mkdtemp(prefix="jaxdist-demo-")
    rng = np.random.default_rng(0)
    weights = {f"l{i}.w": (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)
               for i in range(layers)}
    save_file(weights, f"{root}/mlp.safetensors")

    def dense(params: dict[str, Any], state: dict[str, Any], carry: dict[str, Any]
              ) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"x": jnp.tanh(carry["x"] @ params["w"])}, {}

    model = Model("demo-mlp", [Unit(f"l{i}", dense, {
        "w": Param(f"safetensors://mlp.safetensors#l{i}.w", (d, d))}) for i in range(layers)],
        inputs={"x": (f"b, {d}", "float32")}, buckets=[{"b": 8}])
    x = rng.standard_normal((8, d)).astype(np.float32)
    ref = x
    for i in range(layers):
        ref = np.tanh(ref @ weights[f"l{i}.w"])
    n = opts.local or 2
    print(f"spawning {n} local workers; weights in {root} (only URIs cross the network)")
    with Cluster.local(n, weights_roots=[root]) as cluster:
        pipe = cluster.deploy(model, progress=ProgressBar())
        for k, spec in enumerate(pipe.specs):
            print(f"  stage {k}: {len(spec.weights)} layers on {pipe.clients[k].address}, "
                  f"artifact {spec.artifact_digest[:19]}..")
        t0 = time.perf_counter()
        out = pipe.call(x=x)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = list(pipe.stream([{"x": x}] * 32, depth=8))
        rate = 32 / (time.perf_counter() - t0)
        err = float(np.abs(out["x"] - ref).max())
        err = max(err, max(float(np.abs(o["x"] - ref).max()) for o in outs))
        pipe.close()
    print(f"max |jaxdist - numpy| = {err:.2e}; first call {first * 1e3:.1f} ms; "
          f"{rate:.0f} microbatches/s pipelined")
    if err > 1e-4:
        print("jaxdist: error: the pipeline disagrees with the single-process reference",
              file=sys.stderr)
        return 1
    print("ok")
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _cmd_status(opts: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from jaxdist.transport.client import WorkerClient

    addresses = [a.strip() for a in opts.workers.split(",") if a.strip()]
    if not addresses:
        raise JaxdistError("status needs --workers HOST:PORT[,HOST:PORT...]")
    replies = []
    for a in addresses:
        c = WorkerClient(a, timeout=opts.timeout)
        try:
            c.wait_ready(opts.timeout)
            replies.append(c.info())
        finally:
            c.close()
    if opts.json:
        print(json.dumps([MessageToDict(r, preserving_proto_field_name=True) for r in replies],
                         indent=2))
        return 0
    for r in replies:
        mem = r.devices[0] if r.devices else None
        print(f"{r.address}  device={r.default_device}  jax={r.versions.jax} "
              f"jaxlib={r.versions.jaxlib} spec={r.versions.spec}  uptime={r.uptime_s:.0f}s")
        if mem is not None and mem.memory_total:
            print(f"  memory: {_fmt_bytes(mem.memory_free)} free of {_fmt_bytes(mem.memory_total)};"
                  f" worker RSS {_fmt_bytes(r.rss_bytes)}")
        print(f"  sessions: {r.sessions}/{r.max_sessions}; artifacts cached: {len(r.artifacts)}")
        if r.stages:
            print(f"  {'stage':<28} {'digest':<20} {'weights':>10} {'sessions':>8}")
            for s in r.stages:
                print(f"  {s.stage_id:<28} {s.artifact_digest[:19]:<20} "
                      f"{_fmt_bytes(s.weight_bytes):>10} {s.sessions:>8}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxdist", description="Run models across generic workers.")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="deploy a small MLP across local workers")
    demo.add_argument("--local", type=int, default=2, metavar="N", help="workers (default 2)")
    demo.add_argument("--width", type=int, default=256)
    demo.add_argument("--layers", type=int, default=4)
    demo.set_defaults(run=_cmd_demo)

    status = sub.add_parser("status", help="show what each worker runs")
    status.add_argument("--workers", required=True, help="comma-separated HOST:PORT")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--timeout", type=float, default=5.0)
    status.set_defaults(run=_cmd_status)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    logging.basicConfig(level=opts.log_level, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(opts.run(opts))
    except JaxdistError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"jaxdist: error: {first}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
