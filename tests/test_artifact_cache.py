"""The worker's artifact cache is bounded (``--max-artifact-cache-bytes``): storing an artifact
past the bound deletes the least recently used ones, never a loaded stage's. A real worker
process on loopback port 0, artifacts uploaded through the real client."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator

import numpy as np
import pytest
from models import accumulator

from jaxdist.coordinator.cluster import Cluster
from jaxdist.core import artifacts

KIB = 1 << 10
BOUND = 2000 * KIB  # --max-artifact-cache-bytes
BLOB = 900 * KIB  # three of them pass the bound, two do not


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    with Cluster.local(1, artifact_cache=str(tmp_path / "cache"), log_level="INFO",
                       extra_args=["--max-artifact-bytes", str(1000 * KIB),
                                   "--max-artifact-cache-bytes", str(BOUND)]) as c:
        yield c


def _upload(cluster: Cluster, seed: int) -> str:
    data = np.random.default_rng(seed).bytes(BLOB)
    digest = artifacts.digest_of(data)
    assert cluster.clients[0].upload_artifact(digest, data).stored
    return digest


def _cached_bytes(root: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in (root / "sha256").glob("??/*")
               if not p.name.endswith(".json") and not p.name.startswith(".tmp-"))


def test_least_recently_used_artifacts_go_past_the_bound(cluster: Cluster,
                                                         tmp_path: pathlib.Path) -> None:
    client = cluster.clients[0]
    a, b = _upload(cluster, 1), _upload(cluster, 2)
    c = _upload(cluster, 3)  # a + b + c pass the bound: a, the least recently used, goes
    assert [client.has_artifact(d) for d in (a, b, c)] == [False, True, True]
    assert client.has_artifact(b)  # asked for again: now more recent than c
    d = _upload(cluster, 4)
    assert [client.has_artifact(x) for x in (b, c, d)] == [True, False, True]
    held = _cached_bytes(tmp_path / "cache")
    assert held <= BOUND
    info = client.info()  # what jaxdist status shows
    assert (info.artifact_cache_bytes, info.artifact_cache_max_bytes) == (held, BOUND)
    log = pathlib.Path(cluster.local_workers[0].log_path).read_text()
    assert (f"over --max-artifact-cache-bytes={BOUND}, deleted the least recently used: {a} "
            f"({BLOB} bytes)") in log


def test_a_loaded_stages_artifact_stays(cluster: Cluster, tmp_path: pathlib.Path) -> None:
    client = cluster.clients[0]
    with cluster.deploy(accumulator(), stages=1) as pipe:
        stage = pipe.specs[0].artifact_digest
        first = [_upload(cluster, seed) for seed in (1, 2, 3)]
        assert client.has_artifact(stage)  # the oldest, but in use
        assert [client.has_artifact(x) for x in first] == [False, True, True]
        one = np.ones((1, 4), np.float32)
        out = pipe.call(x=one, session_id="s", step=0, timeout=60)
        np.testing.assert_array_equal(out["total"], one[0])
    assert os.path.exists(tmp_path / "cache" / "sha256" / stage[7:9] / stage[7:])
