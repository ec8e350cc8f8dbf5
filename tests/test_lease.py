"""Stages loaded for one run are leased to their coordinator (issue #15 item 7).

A worker unloads a leased pipeline's stages once nobody has subscribed to its results there for
the lease; a pinned pipeline (``jaxdist deploy``) stays. The coordinator here is a real process,
SIGKILLed after it deployed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from jaxdist.coordinator.spawn import spawn_workers, stop_workers
from jaxdist.core import artifacts
from jaxdist.core.spec import StageSpec, TensorSig
from jaxdist.core.transport.client import WorkerClient

DEADLINE = 120.0  # a hang guard: the lease is 1 s, checked every second


def _wait_until(what, predicate) -> None:
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        assert time.monotonic() < deadline, f"not within {DEADLINE} s: {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def worker():
    (w,) = spawn_workers(1)
    yield w
    stop_workers([w])


def _spec(pipeline_id: str) -> StageSpec:
    art = artifacts.export_stage(lambda p, s, x: ({"y": x["x"] * 3}, {}), params={},
                                 inputs={"x": ((4,), "float32")}, platforms=("cpu",))
    return StageSpec(artifact_digest=art.digest, inputs=(TensorSig("x", "float32", (4,)),),
                     outputs=(TensorSig("y", "float32", (4,)),), device="cpu",
                     stage_id=f"{pipeline_id}/0", artifact=art.data)


def _pipelines(client: WorkerClient) -> set[str]:
    return {s.pipeline_id for s in client.info().stages}


def test_a_leased_pipeline_goes_and_a_pinned_one_stays(worker):
    client = WorkerClient(worker.address, timeout=30)
    client.load_stage(_spec("pinned"), "pinned", lease_s=0.0)
    client.load_stage(_spec("leased"), "leased", lease_s=1.0)
    assert {"pinned", "leased"} <= _pipelines(client)
    _wait_until("the leased pipeline is unloaded", lambda: "leased" not in _pipelines(client))
    assert "pinned" in _pipelines(client)
    assert client.unload_stage("pinned")


def test_a_sigkilled_coordinators_stages_are_freed(worker):
    client = WorkerClient(worker.address, timeout=30)
    coordinator = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import numpy as np, jax.numpy as jnp
        from jaxdist import Cluster, Model, Unit
        model = Model("m", [Unit("u", lambda p, s, c: ({{"x": c["x"] + 1}}, {{}}))],
                      inputs={{"x": ("4", "float32")}})
        cluster = Cluster.connect(["{worker.address}"], lease_s=1.0)
        pipe = cluster.deploy(model, platforms=("cpu",))
        assert pipe.call(x=np.zeros(4, np.float32))["x"].tolist() == [1.0] * 4
        print(pipe.pipeline_id, flush=True)
        import time
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert coordinator.stdout is not None
        pipeline_id = coordinator.stdout.readline().strip()
        assert pipeline_id and pipeline_id in _pipelines(client)
        # While the coordinator lives, its subscription renews the lease: 3 leases pass.
        since = client.info().uptime_s
        _wait_until("three leases pass", lambda: client.info().uptime_s > since + 3.0)
        assert pipeline_id in _pipelines(client)
        coordinator.kill()
        coordinator.wait()
        _wait_until("the dead coordinator's stages are unloaded",
                    lambda: pipeline_id not in _pipelines(client))
    finally:
        coordinator.kill()
