"""``jaxdist demo``: a small MLP deployed across local workers, checked against numpy."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from jaxdist.cli.common import (
    ProgressBar,
    add_auth_args,
    add_device_args,
    auth_files,
    device_args_of,
)
from jaxdist.export.model import Model, Param, Unit

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    demo = sub.add_parser("demo", help="deploy a small MLP across local workers")
    demo.add_argument("--local", type=int, default=2, metavar="N", help="workers (default 2)")
    demo.add_argument("--width", type=int, default=256)
    demo.add_argument("--layers", type=int, default=4)
    add_device_args(demo)
    add_auth_args(demo)
    demo.set_defaults(run=run)


def run(opts: argparse.Namespace) -> int:
    devices = device_args_of(opts)  # before anything is made
    with tempfile.TemporaryDirectory(prefix="jaxdist-demo-") as root:  # removed at the end
        return _run(opts, root, devices)


def _run(opts: argparse.Namespace, root: str, devices: dict[str, Any]) -> int:
    d, layers = opts.width, opts.layers
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
    from jaxdist.coordinator.cluster import Cluster  # noqa: PLC0415 - gRPC only for this verb

    with Cluster.local(n, weights_roots=[root], **devices, **auth_files(opts)) as cluster:
        with ProgressBar() as bar:
            pipe = cluster.deploy(model, progress=bar)
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


