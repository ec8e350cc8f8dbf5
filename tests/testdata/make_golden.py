"""Make the golden registry that tests/test_compat.py loads: artifacts and a manifest written by
jaxdist's first release (spec 1.0, manifest version 2) with jax 0.10.2, kept in git so that later
versions prove they still load and run them.

    python tests/testdata/make_golden.py          # from the repository root

writes ``tests/testdata/golden/`` (a registry: ``sha256/..`` artifacts with metadata sidecars and
``manifests/golden-mlp-<hex>.json``, a few KB). No weights are committed: the tests write them
with :func:`write_weights` (seeded, deterministic) into a temporary directory.

The model is small but exercises every part of the format: two stages, symbolic batch dim,
a weight bound transposed (stored ``(out, in)``), biases, and per-session state (a running sum).

Never regenerate ``golden/`` itself once released. A new format version adds its own registry
beside it (``--out tests/testdata/golden-<version>``), and the tests keep loading every one, the
way jax keeps its export back-compat test data (docs/design.md, "Compatibility").
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

import numpy as np
from safetensors.numpy import save_file

D = 8
SEED = 20261130
WEIGHTS_FILE = "golden-mlp.safetensors"
HERE = pathlib.Path(__file__).resolve().parent


def weights(seed: int = SEED) -> dict[str, np.ndarray]:
    """The golden weights, from a seed. ``l0.w`` is stored (out, in), as torch stores it."""
    rng = np.random.default_rng(seed)
    return {"l0.w": (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32),
            "l0.b": (rng.standard_normal(D) * 0.1).astype(np.float32),
            "l1.w": (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32),
            "l1.b": (rng.standard_normal(D) * 0.1).astype(np.float32)}


def write_weights(directory: pathlib.Path) -> pathlib.Path:
    """Write the golden weights as ``directory/golden-mlp.safetensors``."""
    path = pathlib.Path(directory) / WEIGHTS_FILE
    save_file(weights(), str(path))
    return path


def reference(xs: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The model in numpy, step by step through one session (the running sum carries over)."""
    w = weights()
    total = np.zeros(D, np.float32)
    outs = []
    for x in xs:
        h = np.tanh(x @ w["l0.w"].T + w["l0.b"])
        h = np.tanh(h @ w["l1.w"] + w["l1.b"])
        total = total + h.sum(axis=0)
        outs.append({"x": h, "total": total.copy()})
    return outs


def model() -> Any:
    """The golden model as jaxdist units (imported lazily: the tests import this module)."""
    import jax.numpy as jnp

    from jaxdist.export.model import Model, Param, Unit

    def dense(params: dict[str, Any], state: dict[str, Any], carry: dict[str, Any]
              ) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"x": jnp.tanh(carry["x"] @ params["w"] + params["b"])}, {}

    def accumulate(params: dict[str, Any], state: dict[str, Any], carry: dict[str, Any]
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
        total = state["total"] + carry["x"].sum(axis=0)
        return {"x": carry["x"], "total": total}, {"total": total}

    def p(name: str, shape: tuple[int, ...], **kw: Any) -> Param:
        return Param(f"safetensors://{WEIGHTS_FILE}#{name}", shape, **kw)

    return Model("golden-mlp", [
        Unit("l0", dense, {"w": p("l0.w", (D, D), transpose=True), "b": p("l0.b", (D,))}),
        Unit("l1", dense, {"w": p("l1.w", (D, D)), "b": p("l1.b", (D,))}),
        Unit("acc", accumulate, state={"total": ((D,), "float32")}),
    ], inputs={"x": (f"b, {D}", "float32")}, buckets=[{"b": 2}])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "golden"), help="registry to write")
    opts = parser.parse_args(argv)
    from jaxdist.registry.publish import publish

    pub = publish(model(), opts.out, split=[1, 2], model_path=WEIGHTS_FILE)
    print(f"wrote {pub.location}")
    for s in pub.manifest.stages:
        print(f"  {s.digest} ({s.artifact_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
