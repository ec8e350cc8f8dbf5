"""Unloading a stage gives its memory back (issue #33 item 6): ``UnloadStage`` and a lease that
runs out stop the stage, collect and trim the heap (``worker/pipelines.py``,
``stop_unloaded``), so a worker that loads and unloads stages over and over stays near the
resident size of one cycle.

A real worker process on loopback port 0; RSS is read from ``Info`` and compared within the
run, never against fixed numbers.
"""

from __future__ import annotations

import pathlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from models import mlp, save_mlp_weights

from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.spawn import spawn_workers, stop_workers
from jaxdist.core.transport.client import WorkerClient
from jaxdist.worker import pipelines

MIB = 1 << 20
WIDE = 1024  # the MLP's width: four 4 MiB weights, 16 MiB a stage
CYCLES = 20
# Over the cycles, the RSS after an unload may grow by at most this: two stages' weights. A
# stage whose weights stayed resident would pass it by the third cycle; what jax's caches and
# the allocator keep per cycle was measured at about 0.3 MiB (6 MiB over 20 cycles, on a busy
# 2-core machine), so the margin leaves the noise of a loaded machine room to spare.
MARGIN = 32 * MIB


@pytest.fixture(scope="module")
def wide_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("wide-weights")
    save_mlp_weights(root, WIDE, seed=7)
    return root


def test_load_unload_cycles_give_the_memory_back(wide_root: pathlib.Path) -> None:
    """20 cycles of deploy, call, unload of a 16 MiB MLP stage: each unload gives back most of
    the stage's weights (on average at least half of them: the heap is trimmed, not kept at
    its peak), and the RSS after the last unload is within MARGIN of the first's."""
    (worker,) = spawn_workers(1, weights_roots=[str(wide_root)])
    cluster = Cluster([worker.address])
    client = WorkerClient(worker.address, timeout=60)
    try:
        x = np.ones((4, WIDE), np.float32)
        loaded, unloaded, weights = [], [], 0
        for _ in range(CYCLES):
            with cluster.deploy(mlp(d=WIDE), stages=1) as pipe:
                assert pipe.call(x=x, timeout=120)["x"].shape == x.shape
                info = client.info()
                (stage,) = info.stages
                weights = stage.weight_bytes
                loaded.append(info.rss_bytes)
            info = client.info()  # Pipeline.close unloaded it; UnloadStage has answered
            assert not info.stages
            unloaded.append(info.rss_bytes)
        assert weights == 4 * WIDE * WIDE * 4
        given_back = [a - b for a, b in zip(loaded, unloaded)]
        assert sum(given_back) / CYCLES >= weights / 2, [g // MIB for g in given_back]
        assert unloaded[-1] - unloaded[0] <= MARGIN, [u // MIB for u in unloaded]
    finally:
        client.close()
        cluster.close()
        stop_workers([worker])


def test_an_expired_lease_stops_its_stages_and_gives_the_heap_back(monkeypatch) -> None:
    """The lease watch unloads a pipeline nobody subscribes to, stops its stages, then
    collects and trims the heap, as ``UnloadStage`` does."""
    trims: list[int] = []
    monkeypatch.setattr(pipelines.heap, "release_free_heap", lambda: trims.append(1) or True)
    stopped: list[str] = []

    def runtime(pipeline_id: str, index: int) -> Any:
        return SimpleNamespace(pipeline_id=pipeline_id, stage_id=f"{pipeline_id}/{index}",
                               spec=SimpleNamespace(stage_index=index),
                               stop=lambda: stopped.append(f"{pipeline_id}/{index}"))

    loaded = pipelines.LoadedPipelines("test", subscribed=lambda pipeline_id: False)
    for rt in (runtime("leased", 0), runtime("leased", 1), runtime("pinned", 0)):
        assert loaded.install(rt, b"", abandoned=lambda: False)[0]
    loaded.lease("leased", 1.0)
    loaded.expire_leases(now=pipelines.time.monotonic() + 0.5)  # within the lease
    assert not stopped and not trims
    loaded.expire_leases(now=pipelines.time.monotonic() + 2.0)
    assert sorted(stopped) == ["leased/0", "leased/1"]
    assert trims == [1]  # once, after both were stopped
    assert [rt.stage_id for rt in loaded.runtimes()] == ["pinned/0"]
    assert pipelines.stop_unloaded([]) == 0 and trims == [1]  # nothing unloaded: no trim
