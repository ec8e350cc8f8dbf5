"""Prometheus metrics of a worker: ``jaxdist-worker --metrics-listen HOST:PORT`` (off by default).

Everything is read when Prometheus scrapes, from what the worker keeps anyway: its loaded
stages (``WorkerServicer.runtimes``), their session store, and the few counters each
:class:`~jaxdist.core.runtime.StageRuntime` updates per frame (a handful of integer and float
additions). A stage's series carry the labels ``pipeline_id`` and ``stage_index``, and vanish
when the stage is unloaded, so there are as many as there are loaded stages; the counters of a
stage that is loaded again start from zero, which Prometheus reads as a counter reset.

The names follow vLLM's (``vllm:num_requests_running``): a ``jaxdist:`` prefix, then what is
measured, units last::

    jaxdist:worker_info{version, jax, jaxlib, platform, device, device_kind}        1
    jaxdist:worker_stages                        loaded stages
    jaxdist:worker_sessions                      live sessions, all stages
    jaxdist:worker_max_sessions                  --max-sessions
    jaxdist:worker_state_bytes                   session state (KV cache) held, all stages
    jaxdist:worker_max_state_bytes               --max-kv-bytes (0: no limit)
    jaxdist:worker_artifact_cache_bytes          bytes of the artifacts in --artifact-cache
    jaxdist:worker_max_artifact_cache_bytes      --max-artifact-cache-bytes (0: no bound)
    jaxdist:worker_artifact_cache_deleted_total  artifacts deleted to stay within it
    jaxdist:worker_stage_info{pipeline_id, stage_index, stage_id, model, device}     1
    jaxdist:worker_stage_compute_seconds         histogram of step times (the step alone)
    jaxdist:worker_stage_frames_total            frames run and sent on
    jaxdist:worker_stage_input_bytes_total       tensor bytes of the frames run
    jaxdist:worker_stage_output_bytes_total      tensor bytes of the frames sent on
    jaxdist:worker_stage_sessions                live sessions
    jaxdist:worker_stage_state_bytes             state held: sessions x the stage's state_bytes
    jaxdist:worker_stage_weight_bytes            weights bound on the device
    jaxdist:worker_stage_compiled_shapes         input shapes compiled (buckets included)
    jaxdist:worker_stage_compile_cache_hits_total    frames of a shape compiled already
    jaxdist:worker_stage_compile_cache_misses_total  frames that waited for a compile
    jaxdist:worker_stage_compile_seconds_total   seconds spent compiling (buckets included)

plus ``process_*`` (resident memory, CPU seconds, open files) from prometheus_client. Each
worker has a registry of its own, never the process-wide default one.

The port serves metrics to anyone who reaches it, with no token and no TLS, and the metrics name
the pipelines and their sizes: bind it to loopback or a private network (SECURITY.md, "Health
checks and metrics").
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import jax
import jaxlib
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

import jaxdist
from jaxdist.core import devices
from jaxdist.core.errors import TransportError
from jaxdist.core.runtime import STEP_SECONDS_BUCKETS
from jaxdist.worker.servicer import WorkerServicer

__all__ = ["PREFIX", "MetricsServer", "WorkerCollector", "serve_metrics", "worker_registry"]

PREFIX = "jaxdist:worker_"
STAGE_LABELS = ("pipeline_id", "stage_index")
_BOUNDS = [floatToGoString(b) for b in STEP_SECONDS_BUCKETS] + ["+Inf"]


class WorkerCollector(Collector):
    """The metrics of one worker, read from its servicer at every scrape.

    Example::

        registry = CollectorRegistry()
        registry.register(WorkerCollector(servicer))
        text = prometheus_client.generate_latest(registry)
    """

    def __init__(self, servicer: WorkerServicer) -> None:
        self._servicer = servicer
        desc = devices.describe_device(servicer.device, [servicer.device])
        self._info = {"version": jaxdist.__version__, "jax": jax.__version__,
                      "jaxlib": jaxlib.__version__,
                      "platform": devices.device_platform(servicer.device),
                      "device": servicer.device_name, "device_kind": str(desc.get("kind", ""))}

    def collect(self) -> Iterator[Metric]:
        s = self._servicer
        info = InfoMetricFamily(PREFIX.rstrip("_"), "The worker's versions and device.")
        info.add_metric([], self._info)
        yield info
        runtimes = s.runtimes()
        yield GaugeMetricFamily(PREFIX + "stages", "Stages loaded on the worker.",
                                value=len(runtimes))
        yield GaugeMetricFamily(PREFIX + "sessions", "Live sessions, all stages.",
                                value=len(s.sessions))
        yield GaugeMetricFamily(PREFIX + "max_sessions", "Sessions held at once at most "
                                "(--max-sessions).", value=s.sessions.max_sessions)
        yield GaugeMetricFamily(PREFIX + "state_bytes", "Bytes of session state (KV caches) "
                                "held, all stages.", value=s.sessions.nbytes)
        yield GaugeMetricFamily(PREFIX + "max_state_bytes", "Bytes of session state held at "
                                "once at most (--max-kv-bytes); 0: no limit.",
                                value=s.sessions.max_kv_bytes)
        yield GaugeMetricFamily(PREFIX + "artifact_cache_bytes", "Bytes of the artifacts in "
                                "the artifact cache (--artifact-cache).",
                                value=sum(e.size for e in s.registry.list()))
        yield GaugeMetricFamily(PREFIX + "max_artifact_cache_bytes", "Bytes of artifacts the "
                                "cache keeps at most (--max-artifact-cache-bytes); 0: no bound.",
                                value=s.registry.max_bytes)
        yield CounterMetricFamily(PREFIX + "artifact_cache_deleted", "Artifacts deleted, the "
                                  "least recently used first, to stay within "
                                  "--max-artifact-cache-bytes.", value=s.registry.deleted)

        labels = list(STAGE_LABELS)
        stage_info = InfoMetricFamily(PREFIX + "stage", "A loaded stage: its id, model and "
                                      "device.", labels=labels)
        compute = HistogramMetricFamily(
            PREFIX + "stage_compute_seconds", "Seconds a stage's steps took to run: the step "
            "alone, without compiling, queueing or sending.", labels=labels)
        frames = CounterMetricFamily(PREFIX + "stage_frames", "Frames a stage ran and sent "
                                     "on.", labels=labels)
        bytes_in = CounterMetricFamily(PREFIX + "stage_input_bytes", "Tensor bytes of the "
                                       "frames a stage ran.", labels=labels)
        bytes_out = CounterMetricFamily(PREFIX + "stage_output_bytes", "Tensor bytes of the "
                                        "frames a stage sent on.", labels=labels)
        sessions = GaugeMetricFamily(PREFIX + "stage_sessions", "Live sessions of a stage.",
                                     labels=labels)
        state = GaugeMetricFamily(PREFIX + "stage_state_bytes", "Bytes of session state a "
                                  "stage holds (sessions times its state_bytes).", labels=labels)
        weights = GaugeMetricFamily(PREFIX + "stage_weight_bytes", "Bytes of weights a stage "
                                    "bound on its device.", labels=labels)
        shapes = GaugeMetricFamily(PREFIX + "stage_compiled_shapes", "Input shapes a stage has "
                                   "compiled, its buckets included.", labels=labels)
        hits = CounterMetricFamily(PREFIX + "stage_compile_cache_hits", "Frames whose input "
                                   "shapes the stage had compiled already.", labels=labels)
        misses = CounterMetricFamily(PREFIX + "stage_compile_cache_misses", "Frames that waited "
                                     "for their input shapes to compile.", labels=labels)
        compile_s = CounterMetricFamily(PREFIX + "stage_compile_seconds", "Seconds a stage "
                                        "spent compiling, its buckets at load included.",
                                        labels=labels)
        for rt in runtimes:
            values = [rt.pipeline_id, str(rt.spec.stage_index)]
            stage_info.add_metric(values, {"stage_id": rt.stage_id, "model": rt.spec.model,
                                           "device": str(rt.stage.device)})
            counts, total = [], 0
            for n in list(rt.step_counts):  # a copy: the loop adds to it meanwhile
                total += n
                counts.append(total)
            compute.add_metric(values, list(zip(_BOUNDS, counts)), sum_value=rt.compute_s)
            frames.add_metric(values, rt.frames_done)
            bytes_in.add_metric(values, rt.bytes_in)
            bytes_out.add_metric(values, rt.bytes_out)
            live = s.sessions.count(rt.stage_id)
            sessions.add_metric(values, live)
            state.add_metric(values, live * rt.spec.state_bytes)
            weights.add_metric(values, rt.stage.weight_bytes)
            shapes.add_metric(values, len(rt.stage.compiled_shapes))
            hits.add_metric(values, rt.compile_hits)
            misses.add_metric(values, rt.compile_misses)
            compile_s.add_metric(values, rt.stage.compile_seconds)
        yield from (stage_info, compute, frames, bytes_in, bytes_out, sessions, state, weights,
                    shapes, hits, misses, compile_s)


def worker_registry(servicer: WorkerServicer) -> CollectorRegistry:
    """A registry of this worker's metrics and its process's (never the global default one)."""
    registry = CollectorRegistry()
    registry.register(WorkerCollector(servicer))
    ProcessCollector(registry=registry)
    return registry


@dataclass
class MetricsServer:
    """The HTTP server of ``--metrics-listen``, serving in a daemon thread."""

    address: str  # the bound HOST:PORT
    httpd: WSGIServer
    thread: threading.Thread

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def serve_metrics(host: str, port: int, servicer: WorkerServicer) -> MetricsServer:
    """Serve the worker's metrics over HTTP on ``host:port`` (port 0 picks a free port).

    Raises:
        TransportError: the address cannot be bound, naming ``--metrics-listen``.
    """
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        httpd, thread = start_http_server(port, addr=host, registry=worker_registry(servicer))
    except OSError as exc:
        raise TransportError(f"cannot listen on {where} (--metrics-listen): "
                             f"{exc.strerror or exc}") from None
    bound = httpd.server_address[1]
    return MetricsServer(f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}", httpd,
                         thread)
