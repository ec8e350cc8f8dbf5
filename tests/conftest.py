"""Shared fixtures: small real weight files and real worker processes on loopback."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxdist.coordinator import Cluster

D = 32  # width of the test MLP


@pytest.fixture(scope="session")
def mlp_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A weights root with ``mlp.safetensors``: four (D, D) layers ``l0.w`` .. ``l3.w``."""
    root = tmp_path_factory.mktemp("weights")
    rng = np.random.default_rng(1234)
    save_file({f"l{i}.w": (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)
               for i in range(4)}, str(root / "mlp.safetensors"))
    return root


@pytest.fixture(scope="session")
def cluster3(mlp_root: pathlib.Path) -> Cluster:
    """Three real worker processes shared by the tests that do not kill workers."""
    with Cluster.local(3, weights_roots=[str(mlp_root)], max_sessions=8) as cluster:
        yield cluster
