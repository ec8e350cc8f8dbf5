"""Tests for the worker's caches across a restart (jaxdist.core.config and ``--artifact-cache``):
the artifact cache keeps uploaded artifacts, and the persistent XLA compilation cache, namespaced
by jaxlib version and device, makes the second start compile faster. Then the GPU memory
variables a worker sets before jax starts (``--gpu-memory-fraction``)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import jaxlib
import numpy as np
import pytest
from models import mlp, mlp_reference
from safetensors.numpy import save_file

from jaxdist.coordinator.cluster import Cluster
from jaxdist.core import config
from jaxdist.core.config import (
    GPU_MEMORY_VARIABLES,
    apply_gpu_memory_env,
    check_gpu_memory_fraction,
    gpu_memory_env,
    host_cpu_fingerprint,
    inherited_environ,
)
from jaxdist.core.errors import DeviceError
from jaxdist.export.model import Model
from jaxdist.registry.publish import publish

LAYERS = 24
BUCKETS = [{"b": b} for b in (1, 2, 4, 8, 16, 32, 64, 128)]  # 8 compiles per start


@pytest.fixture(scope="module")
def restarts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Start a worker on fresh caches and deploy; then restart it on the same cache directories
    and deploy again. Returns what each start saw."""
    tmp = tmp_path_factory.mktemp("caches")
    rng = np.random.default_rng(7)
    save_file({f"l{i}.w": (rng.standard_normal((32, 32)) / 6).astype(np.float32)
               for i in range(LAYERS)}, str(tmp / "mlp.safetensors"))
    base = mlp(LAYERS)
    model = Model(base.name, base.units, base.inputs, buckets=BUCKETS)
    pub = publish(model, tmp / "registry", stages=1, platforms=("cpu",),
                  model_path="mlp.safetensors")
    caches = {"artifact_cache": str(tmp / "artifacts"), "compilation_cache": str(tmp / "xla")}
    x = rng.standard_normal((4, 32)).astype(np.float32)
    seen: dict[str, Any] = {"tmp": tmp, "published": pub,
                            "want": mlp_reference(tmp, x, n_layers=LAYERS)}
    for run in ("cold", "warm"):
        with Cluster.local(1, weights_roots=[str(tmp)], **caches) as cluster:
            client = cluster.clients[0]
            seen[f"{run}_has"] = client.has_artifact(pub.manifest.digests[0])
            seen[f"{run}_kind"] = client.info().devices[0].kind
            # Warm: no registry at all, so any upload would fail; the cache must serve it.
            registry = pub.registry if run == "cold" else None
            pipe = cluster.deploy_manifest(pub.manifest, registry=registry)
            (seen[run],) = cluster.stage_loads(pipe.pipeline_id)
            seen[f"{run}_out"] = pipe.call(x=x)["x"]
            pipe.close()
    return seen


def test_artifact_cache_survives_restart(restarts: dict[str, Any]) -> None:
    assert not restarts["cold_has"] and restarts["cold"].uploaded
    assert restarts["warm_has"] and not restarts["warm"].uploaded
    for run in ("cold", "warm"):
        np.testing.assert_allclose(restarts[f"{run}_out"], restarts["want"], rtol=1e-5,
                                   atol=1e-5)


def test_compilation_cache_layout_names_jaxlib_and_device(restarts: dict[str, Any]) -> None:
    kind = restarts["cold_kind"]
    assert kind == "cpu"
    directory = restarts["tmp"] / "xla" / f"jaxlib-{jaxlib.__version__}" / (
        f"cpu-{host_cpu_fingerprint()}")
    entries = list(directory.iterdir())
    assert len(entries) >= len(BUCKETS), entries
    # Nothing outside the namespaced directory: another jaxlib or device starts empty.
    assert [p.name for p in (restarts["tmp"] / "xla").iterdir()] == [
        f"jaxlib-{jaxlib.__version__}"]


def test_second_start_compiles_faster(restarts: dict[str, Any]) -> None:
    cold, warm = restarts["cold"].compile_s, restarts["warm"].compile_s
    # A ratio within one run, not an absolute time: measured 0.2-0.25 on a 2-core machine.
    assert warm < 0.6 * cold, (cold, warm)


def test_host_cpu_fingerprint_is_stable() -> None:
    fp = host_cpu_fingerprint()
    assert fp == host_cpu_fingerprint() and len(fp) == 8 and int(fp, 16) >= 0


_COMPILE = """
import sys
import jax
import numpy as np
from jaxdist.core.config import configure_compilation_cache
configure_compilation_cache(sys.argv[1], "cpu", max_bytes=int(sys.argv[2]))
for i in range(int(sys.argv[3]), int(sys.argv[4])):  # one cache entry each
    jax.jit(lambda x, i=i: x * i + i)(np.ones(8, np.float32)).block_until_ready()
"""


def _compile(root: pathlib.Path, max_bytes: int, first: int, end: int) -> str:
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(root), str(max_bytes),
                           str(first), str(end)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_a_bounded_compilation_cache_keeps_within_its_bytes(tmp_path: pathlib.Path) -> None:
    """--max-compilation-cache-bytes, also over entries that an unbounded process wrote (JAX's
    eviction fails on those unless they are dated first)."""
    _compile(tmp_path, 0, 0, 4)  # no bound: 4 entries
    (directory,) = (tmp_path / f"jaxlib-{jaxlib.__version__}").iterdir()
    entries = sorted(directory.glob("*-cache"))
    assert len(entries) == 4
    size = max(p.stat().st_size for p in entries)
    bound = int(2.5 * size)
    stderr = _compile(tmp_path, bound, 4, 8)
    assert "Error writing persistent compilation cache entry" not in stderr, stderr
    assert "Error reading persistent compilation cache entry" not in stderr, stderr
    left = sorted(directory.glob("*-cache"))
    assert sum(p.stat().st_size for p in left) <= bound
    assert 1 <= len(left) <= 2 and not set(left) & set(entries)  # the oldest went first


# -- GPU memory: what a worker sets before jax starts its backends -------------------------------


def test_gpu_memory_by_default_is_allocated_as_needed() -> None:
    """What a worker on cuda does without the flag: no 75% preallocation, so workers share."""
    chosen, words = gpu_memory_env(None, {"PATH": "/usr/bin"})
    assert chosen == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert words.startswith("GPU memory: allocated as needed (XLA_PYTHON_CLIENT_PREALLOCATE=false)")


def test_gpu_memory_fraction_preallocates_that_share() -> None:
    chosen, words = gpu_memory_env(0.3, {})
    assert chosen == {"XLA_PYTHON_CLIENT_PREALLOCATE": "true",
                      "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"}
    assert words.startswith("GPU memory: 30% of the GPU preallocated")


@pytest.mark.parametrize("name", GPU_MEMORY_VARIABLES)
def test_gpu_memory_the_users_own_variables_decide(name: str) -> None:
    chosen, words = gpu_memory_env(None, {name: "0.9"})
    assert chosen == {}
    assert words == f"GPU memory: as the environment says ({name}=0.9)"


@pytest.mark.parametrize("name", GPU_MEMORY_VARIABLES)
def test_error_gpu_memory_fraction_beside_the_users_variables(name: str) -> None:
    with pytest.raises(DeviceError, match=rf"^--gpu-memory-fraction 0.3: the environment "
                                          rf"already sets {name}=false; unset it, or drop "
                                          rf"--gpu-memory-fraction$"):
        gpu_memory_env(0.3, {name: "false"})
    with pytest.raises(DeviceError, match=r"^gpu_memory_fraction=0.3: .* drop gpu_memory_fraction"):
        gpu_memory_env(0.3, {name: "false"}, name="gpu_memory_fraction")


@pytest.mark.parametrize("value", [0, "0", 1.5, "1.5", "abc", "", float("nan"), -1, True, None])
def test_error_gpu_memory_fraction_out_of_range(value: object) -> None:
    with pytest.raises(DeviceError, match=rf"^--gpu-memory-fraction {re.escape(str(value))}: "
                                          rf"expected the fraction of the GPU's memory each "
                                          rf"worker preallocates, 0 < F <= 1, such as 0.3$"):
        check_gpu_memory_fraction(value)
    with pytest.raises(DeviceError, match=rf"^gpu_memory_fraction={re.escape(repr(value))}: "):
        check_gpu_memory_fraction(value, "gpu_memory_fraction")


@pytest.mark.parametrize("value, want", [("1", 1.0), (0.25, 0.25), ("1e-3", 0.001)])
def test_gpu_memory_fraction_in_range(value: object, want: float) -> None:
    assert check_gpu_memory_fraction(value) == want


def test_inherited_environ_drops_only_what_jaxdist_set_and_nobody_changed() -> None:
    environ = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".5",
               "JAXDIST_GPU_MEMORY_SET": "XLA_PYTHON_CLIENT_PREALLOCATE=false,"
                                         "XLA_PYTHON_CLIENT_MEM_FRACTION=0.3",
               "HOME": "/root"}
    # The fraction was changed since jaxdist set it: the user's now.
    assert inherited_environ(environ) == {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5", "HOME": "/root"}
    assert inherited_environ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}) == {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # unmarked: the user's


def test_apply_gpu_memory_env_replaces_its_own_choice_never_the_users(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*GPU_MEMORY_VARIABLES, config._MARK):  # restored by monkeypatch at the end
        monkeypatch.delenv(name, raising=False)
    apply_gpu_memory_env(None)
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    apply_gpu_memory_env(0.3)  # its own earlier choice is no conflict
    assert (os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"],
            os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == ("true", "0.3")
    # A process started from here (a worker) sees the user's environment: nothing of this.
    assert not set(GPU_MEMORY_VARIABLES) & set(inherited_environ(os.environ))
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the user's, now
    assert apply_gpu_memory_env(None) == ("GPU memory: as the environment says "
                                          "(XLA_PYTHON_CLIENT_PREALLOCATE=false)")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ and config._MARK not in os.environ
    with pytest.raises(DeviceError, match="already sets XLA_PYTHON_CLIENT_PREALLOCATE=false"):
        apply_gpu_memory_env(0.5)
