"""Prometheus metrics of the worker (``worker/metrics.py``): a real worker process with
``--metrics-listen``, scraped over HTTP before and after frames run, parsed with
prometheus_client's own parser."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from models import D, accumulator, mlp, mlp_reference
from prometheus_client.parser import text_string_to_metric_families
from test_health import WorkerProcess, start_worker

import jaxdist
from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.spawn import spawn_workers, stop_workers

P = "jaxdist:worker_"
STAGE_SERIES = ("stage_info", "stage_compute_seconds_count", "stage_frames_total",
                "stage_input_bytes_total", "stage_output_bytes_total", "stage_sessions",
                "stage_state_bytes", "stage_weight_bytes", "stage_compiled_shapes",
                "stage_compile_cache_hits_total", "stage_compile_cache_misses_total",
                "stage_compile_seconds_total")


class Scrape:
    """One scrape: every sample by name and labels."""

    def __init__(self, url: str) -> None:
        with urllib.request.urlopen(url, timeout=20) as reply:
            assert reply.status == 200
            assert reply.headers["Content-Type"].startswith("text/plain")
            text = reply.read().decode()
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples.setdefault(s.name, []).append((dict(s.labels), s.value))

    def value(self, name: str, **labels: str) -> float:
        """The one sample of ``jaxdist:worker_<name>`` whose labels include ``labels``."""
        found = [v for lab, v in self.samples.get(P + name, ())
                 if all(lab.get(k) == want for k, want in labels.items())]
        assert len(found) == 1, (name, labels, self.samples.get(P + name))
        return found[0]

    def pipelines(self) -> set[str]:
        """Pipeline ids in any stage series."""
        return {lab["pipeline_id"] for name, samples in self.samples.items()
                if name.startswith(P + "stage_") for lab, _ in samples}


@pytest.fixture
def worker(mlp_root) -> Iterator[WorkerProcess]:
    w = start_worker("--metrics-listen", "127.0.0.1:0", "--weights-root", str(mlp_root),
                     "--max-sessions", "8")
    yield w
    assert w.stop() == 0


def test_metrics_move_with_frames_and_vanish_on_unload(worker: WorkerProcess, mlp_root) -> None:
    assert worker.metrics is not None
    url = f"http://{worker.metrics}/metrics"
    before = Scrape(url)
    assert before.value("info", version=jaxdist.__version__, platform="cpu") == 1
    assert before.value("stages") == 0 and before.value("sessions") == 0
    assert before.value("max_sessions") == 8
    assert before.value("state_bytes") == 0
    assert before.value("artifact_cache_bytes") == 0  # a fresh --artifact-cache
    assert before.value("max_artifact_cache_bytes") == 4 << 30
    assert before.value("artifact_cache_deleted_total") == 0
    assert before.pipelines() == set()
    assert "process_resident_memory_bytes" in before.samples

    with Cluster([worker.address]) as cluster:
        acc = cluster.deploy(accumulator(), stages=1)
        net = cluster.deploy(mlp(), stages=1)
        a, m = {"pipeline_id": acc.pipeline_id}, {"pipeline_id": net.pipeline_id}
        loaded = Scrape(url)
        assert loaded.value("stages") == 2
        assert loaded.pipelines() == {acc.pipeline_id, net.pipeline_id}
        for name in STAGE_SERIES:
            assert loaded.value(name, **a, stage_index="0") >= 0
        assert loaded.value("stage_frames_total", **a) == 0
        assert loaded.value("stage_compute_seconds_count", **a) == 0
        assert loaded.value("stage_info", **m, model="mlp") == 1
        assert loaded.value("stage_weight_bytes", **m) == 4 * D * D * 4  # four f32 (D, D)
        assert loaded.value("stage_compiled_shapes", **m) == 1  # its bucket {b: 4}, at load
        cache = pathlib.Path(worker.log_path).parent / "artifacts" / "sha256"
        on_disk = sum(p.stat().st_size for p in cache.glob("??/*") if len(p.name) == 64)
        assert loaded.value("artifact_cache_bytes") == on_disk > 0  # the two stages' artifacts

        # A session of three steps of the accumulator, of one shape: compiled once, then hits.
        xs = [np.full((2, 4), i, np.float32) for i in range(3)]
        with acc.session("metrics-1") as sess:
            outs = [sess(x=x) for x in xs]
            live = Scrape(url)
            assert live.value("sessions") == 1
            assert live.value("stage_sessions", **a) == 1
            assert live.value("stage_state_bytes", **a) == acc.specs[0].state_bytes == 32
            assert live.value("state_bytes") == 32
        assert live.value("stage_frames_total", **a) == 3
        assert live.value("stage_compute_seconds_count", **a) == 3
        assert live.value("stage_compute_seconds_bucket", **a, le="+Inf") == 3
        assert live.value("stage_compute_seconds_sum", **a) > 0
        assert live.value("stage_input_bytes_total", **a) == sum(x.nbytes for x in xs)
        assert live.value("stage_output_bytes_total", **a) == sum(
            v.nbytes for out in outs for v in out.values())
        assert live.value("stage_compile_cache_misses_total", **a) == 1
        assert live.value("stage_compile_cache_hits_total", **a) == 2
        assert live.value("stage_compiled_shapes", **a) == 1
        assert live.value("stage_compile_seconds_total", **a) > 0

        # The MLP: a frame of its bucket's shape is a hit, a new batch size a miss.
        for b in (4, 4, 3):
            x = np.ones((b, D), np.float32)
            np.testing.assert_allclose(net.call(x=x)["x"], mlp_reference(mlp_root, x),
                                       rtol=1e-5, atol=1e-6)
        after = Scrape(url)
        assert after.value("sessions") == 0 and after.value("state_bytes") == 0  # it ended
        assert after.value("stage_sessions", **a) == 0
        assert after.value("stage_frames_total", **m) == 3
        assert after.value("stage_compile_cache_hits_total", **m) == 2
        assert after.value("stage_compile_cache_misses_total", **m) == 1
        assert after.value("stage_compiled_shapes", **m) == 2
        assert after.value("stage_input_bytes_total", **m) == (4 + 4 + 3) * D * 4
        assert after.value("stage_output_bytes_total", **m) == (4 + 4 + 3) * D * 4
        assert after.value("stage_frames_total", **a) == 3  # the other stage's are its own

        acc.close()  # unloads: its series vanish, the other stage's stay
        unloaded = Scrape(url)
        assert unloaded.pipelines() == {net.pipeline_id}
        assert unloaded.value("stages") == 1
        net.close()
    assert Scrape(url).pipelines() == set()


def test_metrics_histogram_buckets_are_cumulative(worker: WorkerProcess) -> None:
    assert worker.metrics is not None
    with Cluster([worker.address]) as cluster, cluster.deploy(accumulator(), stages=1) as acc:
        for i in range(4):
            acc.call(x=np.ones((1, 4), np.float32), session_id="h", step=i)
        acc.end_session("h")
        scrape = Scrape(f"http://{worker.metrics}/metrics")
    buckets = [(float(lab["le"]), v) for lab, v in
               scrape.samples[P + "stage_compute_seconds_bucket"]]
    assert [le for le, _ in buckets] == sorted(le for le, _ in buckets)
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and counts[-1] == 4  # cumulative, +Inf holds every step


def test_error_metrics_listen_flag() -> None:
    proc = subprocess.run([sys.executable, "-m", "jaxdist.worker", "--metrics-listen",
                           "localhost"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 2
    assert ("argument --metrics-listen: expected HOST:PORT such as 127.0.0.1:9100, found "
            "'localhost'") in proc.stderr


def test_error_metrics_port_in_use(worker: WorkerProcess) -> None:
    assert worker.metrics is not None
    proc = subprocess.run([sys.executable, "-m", "jaxdist.worker", "--listen", "127.0.0.1:0",
                           "--metrics-listen", worker.metrics], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2
    assert f"cannot listen on {worker.metrics} (--metrics-listen): " in proc.stderr


def test_spawned_worker_with_metrics_and_health_ports_becomes_ready() -> None:
    """The lines of the extra ports come after the ready line, which spawn_workers waits for."""
    (w,) = spawn_workers(1, extra_args=["--metrics-listen", "127.0.0.1:0",
                                        "--health-listen", "127.0.0.1:0"], timeout=60)
    try:
        assert w.alive() and w.address.startswith("127.0.0.1:")
    finally:
        stop_workers([w])
