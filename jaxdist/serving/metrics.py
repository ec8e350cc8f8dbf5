"""The serving coordinator's Prometheus metrics: vLLM's names, types and buckets, prefixed
``jaxdist:`` instead of ``vllm:``, so a vLLM dashboard works after a prefix change.

Request metrics come from the engine's :class:`~jaxdist.coordinator.engine.EngineObserver`
hooks; gauges (requests running and waiting, KV slots in use) are read from the engine when
scraped; pipeline metrics (failovers, workers up, heartbeat age, per-stage frames, compute
seconds and bytes per hop) are read from the pipeline and its workers' ``Info`` when scraped.

Example:
    >>> from prometheus_client import generate_latest
    >>> m = ServerMetrics("smollm2")
    >>> m.queued("r1", 5); m.scheduled("r1", 0.01); m.token("r1", 1, 0.2, True)
    >>> m.finished("r1", "length", 5, 1, 0.3)
    >>> b'jaxdist:request_success_total{finished_reason="length",model_name="smollm2"} 1.0' \\
    ...     in generate_latest(m.registry)
    True
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["E2E_BUCKETS", "ITL_BUCKETS", "TTFT_BUCKETS", "PipelineCollector", "ServerMetrics"]

log = logging.getLogger(__name__)

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that dashboards' quantiles line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error")  # vLLM's, plus the pipeline failing


class ServerMetrics:
    """The engine's request metrics (an :class:`EngineObserver`) in a registry of their own.

    Args:
        model_name: the served model name, the ``model_name`` label of every metric.
        registry: where to register; default a new one (so two servers in one process, as in
            the tests, do not collide).
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"jaxdist:{name}", doc, labels, buckets=buckets,
                             registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", E2E_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds",
                               "Histogram of time from a request's arrival to its first "
                               "scheduled step (waiting for a KV slot and for its turn).",
                               E2E_BUCKETS)
        self.prompt_tokens = Counter("jaxdist:prompt_tokens", "Number of prefill tokens "
                                     "processed.", labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("jaxdist:generation_tokens", "Number of generation "
                                         "tokens processed.", labels,
                                         registry=r).labels(model_name)
        success = Counter("jaxdist:request_success", "Count of successfully processed requests.",
                          [*labels, "finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, reason)
                        for reason in FINISHED_REASONS}
        self.running = Gauge("jaxdist:num_requests_running", "Number of requests in model "
                             "execution batches.", labels, registry=r).labels(model_name)
        self.waiting = Gauge("jaxdist:num_requests_waiting", "Number of requests waiting to be "
                             "processed.", labels, registry=r).labels(model_name)
        self.kv_usage = Gauge("jaxdist:kv_cache_usage_perc", "KV-cache usage: slots in use "
                              "over slots (1 means 100 percent).", labels,
                              registry=r).labels(model_name)
        self.step_time = Histogram("jaxdist:engine_step_seconds", "Time from sending a step to "
                                   "its result, by kind.", [*labels, "kind"],
                                   buckets=ITL_BUCKETS, registry=r)
        self._model = model_name
        self._steps = 0
        self._step_seconds = 0.0

    def watch_engine(self, engine: Any) -> None:
        """Read the gauges from ``engine`` (an :class:`~jaxdist.coordinator.engine.Engine`)
        when scraped."""
        self.running.set_function(lambda: engine.num_running)
        self.waiting.set_function(lambda: engine.num_waiting)
        self.kv_usage.set_function(lambda: engine.slots_in_use / engine.max_slots)

    # -- EngineObserver ---------------------------------------------------------------------

    def queued(self, request_id: str, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def scheduled(self, request_id: str, queue_s: float) -> None:
        self.queue_time.observe(queue_s)

    def token(self, request_id: str, n_new: int, since_last_s: float, first: bool) -> None:
        self.generation_tokens.inc(n_new)
        if first:
            self.ttft.observe(since_last_s)
        else:
            self.itl.observe(since_last_s)

    def finished(self, request_id: str, reason: str, prompt_tokens: int,
                 completion_tokens: int, e2e_s: float) -> None:
        kind = ("error" if reason == "error" else "abort" if reason == "abort"
                else "length" if reason in ("length", "max_seq") else "stop")
        self.success[kind].inc()
        self.e2e.observe(e2e_s)

    def step(self, rows: int, tokens_per_row: int, seconds: float) -> None:
        self.step_time.labels(self._model, "decode" if tokens_per_row == 1 else "prefill"
                              ).observe(seconds)
        self._steps += 1
        self._step_seconds += seconds

    def round_trips(self) -> tuple[int, float]:
        """The engine's steps so far and the sum of their round trips, in seconds."""
        return self._steps, self._step_seconds


class PipelineCollector(Collector):
    """Pipeline metrics read when scraped: failovers, and per worker whether it is up, its
    heartbeat age and its stages' frames, compute seconds and bytes.

    Args:
        model_name: the ``model_name`` label.
        pipeline: a :class:`~jaxdist.coordinator.pipeline.Pipeline` (or anything with
            ``failovers``, ``clients`` and ``heartbeat_ages()``); ``None`` while loading.
        info: ``info(address) -> WorkerInfo`` or ``None`` (a worker that does not answer);
            asked once per worker per scrape, with a short deadline.
        recomputed: ``recomputed() -> int``: requests the engine prefilled again on a spare
            after a failover (:attr:`~jaxdist.coordinator.engine.Engine.recomputed`).
        round_trips: ``round_trips() -> (steps, seconds)``: the engine's steps so far and the
            sum of their round trips (:meth:`ServerMetrics.round_trips`).
    """

    def __init__(self, model_name: str, pipeline: Callable[[], Any],
                 info: Callable[[str], Any] | None = None,
                 recomputed: Callable[[], int] = lambda: 0,
                 round_trips: Callable[[], tuple[int, float]] = lambda: (0, 0.0)) -> None:
        self._model = model_name
        self._pipeline = pipeline
        self._info = info
        self._recomputed = recomputed
        self._round_trips = round_trips

    def describe(self) -> list[Any]:
        return []  # collected on demand (the names depend on nothing but are read live)

    def collect(self) -> Iterator[Any]:
        pipe = self._pipeline()
        labels = ["model_name"]
        failovers = CounterMetricFamily("jaxdist:pipeline_failovers",
                                        "Failovers of a stage to a spare worker.", labels=labels)
        replayed = CounterMetricFamily("jaxdist:pipeline_recomputed_requests",
                                       "Requests whose KV cache was rebuilt on a spare after a "
                                       "failover.", labels=labels)
        up = GaugeMetricFamily("jaxdist:worker_up", "1 when the worker of a stage answers.",
                               labels=[*labels, "stage", "address"])
        age = GaugeMetricFamily("jaxdist:worker_heartbeat_age_seconds", "Seconds since the "
                                "worker's last event on its subscription.",
                                labels=[*labels, "stage", "address"])
        where = [*labels, "stage", "address"]
        frames = CounterMetricFamily("jaxdist:stage_frames", "Frames a stage has sent on.",
                                     labels=where)
        compute = CounterMetricFamily("jaxdist:stage_compute_seconds", "Seconds a stage's "
                                      "steps took on its worker.", labels=where)
        hop_bytes = CounterMetricFamily("jaxdist:stage_output_bytes", "Tensor bytes a stage "
                                        "sent on: the hop to the next stage (the last: to the "
                                        "coordinator).", labels=where)
        depth = GaugeMetricFamily("jaxdist:stage_frames_in_flight", "Frames a stage has taken "
                                  "in and not yet sent on (its queue depth).", labels=where)
        hop = GaugeMetricFamily("jaxdist:pipeline_hop_seconds_mean", "Mean seconds per hop of "
                                "a step outside the stages' compute (transport, encoding, "
                                "queueing): the engine's step round trip less the stages' mean "
                                "compute, over the stages + 1 hops, since the server started.",
                                labels=labels)
        compute_means: list[float] = []
        if pipe is not None:
            failovers.add_metric([self._model], float(len(getattr(pipe, "failovers", ()))))
            replayed.add_metric([self._model], float(self._recomputed()))
            ages = pipe.heartbeat_ages() if hasattr(pipe, "heartbeat_ages") else {}
            for k, client in enumerate(getattr(pipe, "clients", ())):
                address = client.address
                lab = [self._model, str(k), address]
                if address in ages:
                    age.add_metric(lab, ages[address])
                info = self._worker_info(address)
                up.add_metric(lab, 0.0 if info is None else 1.0)
                if info is not None:
                    for st in info.stages:
                        if st.pipeline_id == pipe.pipeline_id and st.stage_index == k:
                            frames.add_metric(lab, float(st.frames))
                            compute.add_metric(lab, st.compute_seconds)
                            hop_bytes.add_metric(lab, float(st.bytes_out))
                            depth.add_metric(lab, float(st.in_flight))
                            if st.frames:
                                compute_means.append(st.compute_seconds / st.frames)
            steps, seconds = self._round_trips()
            n = len(getattr(pipe, "clients", ()))
            if steps and n and len(compute_means) == n:
                hop.add_metric([self._model],
                               max(0.0, seconds / steps - sum(compute_means)) / (n + 1))
        yield from (failovers, replayed, up, age, frames, compute, hop_bytes, depth, hop)

    def _worker_info(self, address: str) -> Any:
        if self._info is None:
            return None
        try:
            return self._info(address)
        except Exception as exc:  # noqa: BLE001 - a worker that does not answer is down
            log.debug("metrics: worker %s did not answer Info: %s", address, exc)
            return None
