"""GPU workers on one machine: every row of issue #37's table, as one command.

Models (random weights from a seeded generator, written by bench/make_gguf.py under
``bench/.models/`` on first use, never downloaded or committed): SmolLM2's architecture scaled to
0.92B parameters (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 5632, vocab 49152), once
with bfloat16 matrices and once in Q4_0. Rows, each a real cluster of local workers started with
``--device``, prompt of 12 tokens, greedy, EOS ignored:

* ``bf16_1w``, ``bf16_2w``: 1 and 2 workers on the device, bfloat16, batch 1;
* ``f32_2w``: 2 workers, float32 (its products pinned to float32, not TF32);
* ``f32_mixed``: one worker on the device and one on the CPU, float32 (the CPU stage holds the
  last layers); skipped where the device is the CPU;
* ``q4_0_1w``: the Q4_0 file, 1 worker, packed weights (dequantized in the graph on a GPU);
* ``bf16_batch16``: 16 prompts at once (16 KV slots), bfloat16, tokens/s in all;
* ``transformers``: transformers' eager ``generate`` on the same file, batch 1 and 16 (where
  torch is installed; on the device when torch sees it).

Every row records decode tokens/s, ms a token and the time to first token. The per-step
breakdown splits ``bf16_1w``'s step into the part outside the worker (coordinator and
transport: its step less the same step in one process, ``InProcessPipeline``), the worker's own
time per frame (its ``compute_seconds`` over frames: dispatch, plus the device time where the
platform runs synchronously), and the rest. ``--profile DIR`` also writes a ``jax.profiler``
trace of the in-process steps for a device-time split (open it in Perfetto or TensorBoard).

``--tiny`` makes a 27M-parameter model of the same layout and runs every row on the CPU (the
tests run it so that this script cannot rot); half-precision rows run in float32 there, since a
CPU worker refuses half-precision stages. Its ``bf16_1w`` step is the step's fixed cost: the
products cost nothing at that size.

Usage::

    python bench/gpu.py [--device cuda:0] [--tiny] [--tokens 64] [--out FILE] [--profile DIR]

About 5 minutes on an H200 (the models are written once, ~30 s); ``--tiny``: about 1 minute
on 2 CPU cores. Prints one JSON record per metric on stdout, then the markdown section for
bench/RESULTS.md on stderr; ``--out`` writes the records to a file (``bench/out/gpu.json`` is
what bench/report.py puts into RESULTS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

# Several processes share the GPU: none may take 75% of its memory up front (JAX's default).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import _common  # noqa: E402
import make_gguf  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
MODELS_DIR = HERE / ".models"
PROMPT_TOKENS = 12
BATCH = 16
MAX_SEQ = 128
TINY = dict(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512)  # Q6_K rows: 256 wide
TARGETS = {  # issue #37, on one H200
    "bf16_1w": ("tokens_per_s", ">= 600 tok/s", lambda r, rows: r >= 600),
    "bf16_2w": ("ratio to bf16_1w", ">= 0.85x of 1 worker",
                lambda r, rows: r >= 0.85 * rows["bf16_1w"]),
    "bf16_batch16": ("tokens_per_s", ">= 3000 tok/s in all", lambda r, rows: r >= 3000),
    "q4_0_1w": ("ratio to bf16_1w", ">= 1.0x bf16 at batch 1",
                lambda r, rows: r >= rows["bf16_1w"]),
}
note = _common.note("gpu")


@dataclass
class Row:
    """One system under test and what was measured on it."""

    name: str
    model: str                     # "bf16" or "q4_0"
    dtype: str
    devices: tuple[str, ...]       # one directive per worker; () for transformers
    batch: int = 1
    gen: Any = None
    cluster: Any = None
    detail: dict[str, Any] = field(default_factory=dict)
    tps: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)


def make_models(tiny: bool, models_dir: pathlib.Path = MODELS_DIR) -> dict[str, pathlib.Path]:
    shape = TINY if tiny else {}
    tag = "tiny" if tiny else "0.9b"
    return {name: make_gguf.write(models_dir / f"llama-{tag}-{name}.gguf",
                                  make_gguf.Shape(quant=name.upper(), **shape))
            for name in ("bf16", "q4_0")}


def platform_of(directive: str) -> str:
    """The platform a directive names, resolving ``auto`` (which initializes the backends)."""
    from jaxdist.core.devices import device_platform, parse_directive, resolve_device

    d = parse_directive(directive)
    return device_platform(resolve_device(d)) if d.platform == "auto" else d.platform


@contextlib.contextmanager
def deployed(row: Row, path: pathlib.Path, loaded: Any) -> Iterator[Row]:
    """Spawn the row's workers, deploy the model on them and give the row its generator."""
    from jaxdist.coordinator.cluster import Cluster
    from jaxdist.coordinator.generation import Generator
    from jaxdist.coordinator.spawn import spawn_workers, stop_workers

    t0 = time.perf_counter()
    workers = [w for d in row.devices for w in spawn_workers(1, weights_roots=[str(path.parent)],
                                                           device=d)]
    try:
        cluster = Cluster([w.address for w in workers])
        try:
            platforms = tuple(dict.fromkeys(["cpu", *(platform_of(d) for d in row.devices)]))
            pipe = cluster.deploy(loaded.model, stages=len(workers), platforms=platforms)
            row.gen, row.cluster = Generator.for_model(pipe, loaded.causal_lm), cluster
            row.detail["setup_s"] = round(time.perf_counter() - t0, 1)
            row.detail["workers"] = [f"{i.address} {i.default_device}" for i in cluster.info()]
            note(f"{row.name}: {len(workers)} workers on {', '.join(row.devices)}, deployed "
                 f"in {row.detail['setup_s']}s")
            yield row
        finally:
            if row.gen is not None:
                row.gen.close()
            cluster.close()
    finally:
        stop_workers(workers)


def timed(row: Row, prompts: list[list[int]], n: int) -> None:
    """One generation of ``n`` tokens for every prompt at once; appends to the row."""
    from jaxdist.coordinator.generation import SamplingParams

    stamps: list[float] = []
    results = row.gen.run(prompts, SamplingParams(max_tokens=n, ignore_eos=True),
                          on_token=lambda _i, _t: stamps.append(time.perf_counter()))
    if len(prompts) == 1:
        row.steps.extend(b - a for a, b in itertools.pairwise(stamps))
    first = min(r.ttft_s for r in results)
    last = max(r.ttft_s + r.decode_s for r in results)
    row.tps.append(sum(len(r.tokens) - 1 for r in results) / max(last - first, 1e-9))
    row.ttft.append(first)


def worker_seconds_per_frame(row: Row) -> float | None:
    """The workers' compute seconds per frame, summed over the stages of the row's pipeline."""
    total = 0.0
    for info in row.cluster.info():
        for st in info.stages:
            if st.frames:
                total += st.compute_seconds / st.frames
    return total or None


def run_transformers(path: pathlib.Path, prompt: list[int], n: int, dtype: str,
                     runs: int) -> dict[str, Any] | None:
    try:
        import torch
        import transformers
    except ImportError:
        note("transformers row skipped: torch or transformers is not installed")
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        dtype = "float32"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)).to(device).eval()
    out: dict[str, Any] = {"torch_device": device, "dtype": dtype}
    for batch in (1, BATCH):
        ids = torch.tensor([prompt] * batch, device=device)
        tps = []
        for r in range(runs + 1):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                               pad_token_id=0, eos_token_id=None)
            if device == "cuda":
                torch.cuda.synchronize()
            if r:  # the first run warms up
                tps.append(batch * n / (time.perf_counter() - t0))
        out[f"tokens_per_s_batch{batch}"] = round(statistics.median(tps), 2)
    del model
    return out


def breakdown(row: Row, path: pathlib.Path, loaded: Any, prompt: list[int], n: int,
              profile: str | None) -> dict[str, float | None]:
    """``row``'s step split into outside the worker, the worker's dispatch, and the rest.

    The worker's ``compute_seconds`` end when its step is dispatched: on an asynchronous
    platform (a GPU) the device time falls in the rest, with the host's own work (the logits'
    copy, sampling); ``--profile`` tells them apart."""
    from jaxdist.coordinator.generation import Generator, SamplingParams
    from jaxdist.coordinator.inprocess import InProcessPipeline

    pipe = InProcessPipeline(loaded.model, weights_roots=[str(path.parent)],
                             device=row.devices[0])
    steps: list[float] = []
    try:
        with Generator.for_model(pipe, loaded.causal_lm) as gen:
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            gen.run([prompt], SamplingParams(max_tokens=4, ignore_eos=True))

            def go() -> None:
                stamps: list[float] = []
                gen.run([prompt], params, on_token=lambda _i, _t: stamps.append(
                    time.perf_counter()))
                steps.extend(b - a for a, b in itertools.pairwise(stamps))

            if profile:
                import jax

                with jax.profiler.trace(profile, create_perfetto_trace=True):
                    go()
                note(f"profile of the in-process steps written under {profile}")
            else:
                go()
    finally:
        pipe.close()
    step = statistics.median(row.steps)
    inproc = statistics.median(steps)
    worker = worker_seconds_per_frame(row)
    return {"step_ms": step * 1e3, "in_process_step_ms": inproc * 1e3,
            "coordinator_and_transport_ms": (step - inproc) * 1e3,
            "worker_dispatch_ms": None if worker is None else worker * 1e3,
            "rest_of_in_process_ms": None if worker is None else (inproc - worker) * 1e3}


def build_rows(device: str, on_cpu: bool) -> list[Row]:
    half = "float32" if on_cpu else "bfloat16"
    rows = [Row("bf16_1w", "bf16", half, (device,)),
            Row("bf16_2w", "bf16", half, (device, device)),
            Row("f32_2w", "bf16", "float32", (device, device))]
    if not on_cpu:
        rows.append(Row("f32_mixed", "bf16", "float32", (device, "cpu")))
    rows += [Row("q4_0_1w", "q4_0", "float32" if on_cpu else "bfloat16", (device,)),
             Row("bf16_batch16", "bf16", half, (device,), batch=BATCH)]
    return rows


def records_of(rows: Sequence[Row], hf: dict[str, Any] | None, split: dict[str, Any],
               common: dict[str, Any], tiny: bool) -> list[dict[str, Any]]:
    by = {r.name: statistics.median(r.tps) for r in rows if r.tps}
    out = []
    for r in rows:
        if not r.tps:
            continue
        tps = by[r.name]
        tgt = None if tiny else TARGETS.get(r.name)
        base = by["bf16_1w"] if r.name != "bf16_1w" else None
        out.append(_common.record(
            f"gpu_{r.name}_tokens_per_s", tps, "tok/s",
            "1 worker, bf16 (bf16_1w)" if base else "", base,
            None if base is None else tps / base, tgt[1] if tgt else "",
            tgt[2](tps, by) if tgt else None,
            dtype=r.dtype, devices=list(r.devices), batch=r.batch,
            ms_per_token=None if r.batch > 1 else 1e3 / tps,
            ttft_ms=statistics.median(r.ttft) * 1e3, runs=len(r.tps), **r.detail, **common))
    if hf:
        for batch in (1, BATCH):
            v = hf[f"tokens_per_s_batch{batch}"]
            mine = by.get("bf16_1w" if batch == 1 else "bf16_batch16")
            out.append(_common.record(
                f"gpu_transformers_batch{batch}_tokens_per_s", v, "tok/s",
                "jaxdist, same batch", mine, None if not mine else mine / v, "", None,
                note="ratio = jaxdist / transformers", **hf, **common))
    out.append(_common.record("gpu_step_breakdown_ms", split["step_ms"], "ms", "", None, None,
                              "", None, **{k: None if v is None else round(v, 4)
                                           for k, v in split.items()}, **common))
    return out


def section(records: Sequence[dict[str, Any]]) -> str:
    """The markdown for bench/RESULTS.md."""
    if not records:
        return ""
    c = records[0]
    lines = [f"{'`--tiny` run: ' if c['tiny'] else ''}device {c['device']} ({c['device_kind']}), "
             f"{c['model_params'] / 1e9:.2f}B-parameter "
             f"random Llama, prompt {PROMPT_TOKENS} tokens, {c['new_tokens']} new, greedy; "
             f"jax {c['jax']} on the workers' machine.", "",
             "| row | dtype | workers | tok/s | ms a token | TTFT | vs bf16_1w | target | met? |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        if r["metric"].startswith("gpu_transformers"):
            lines.append(f"| {r['metric'][4:-13]} ({r['torch_device']}) | {r['dtype']} | | "
                         f"{r['value']:.1f} | | | jaxdist {ratio}x of it | | |")
        elif r["metric"] != "gpu_step_breakdown_ms":
            ms = "" if r["ms_per_token"] is None else f"{r['ms_per_token']:.2f}"
            met = {True: "yes", False: "**no**", None: ""}[r["meets_target"]]
            lines.append(f"| {r['metric'][4:-13]} | {r['dtype']} | {', '.join(r['devices'])} | "
                         f"{r['value']:.1f} | {ms} | {r['ttft_ms']:.1f} ms | {ratio} | "
                         f"{r['target']} | {met} |")
    b = next(r for r in records if r["metric"] == "gpu_step_breakdown_ms")

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f} ms"

    lines += ["", f"Step of bf16_1w, {ms(b['step_ms'])}: coordinator and transport "
              f"{ms(b['coordinator_and_transport_ms'])} (the step less the same step in one "
              f"process, {ms(b['in_process_step_ms'])}); the worker's dispatch "
              f"{ms(b['worker_dispatch_ms'])} a frame; the rest of the in-process step "
              f"(device time, logits to the host, sampling) {ms(b['rest_of_in_process_ms'])}."]
    return "\n".join(lines)


def run(opts: argparse.Namespace) -> list[dict[str, Any]]:
    import jax

    from jaxdist.export.plugins import load_model

    device = opts.device
    platform = platform_of(device)
    on_cpu = platform == "cpu"
    if not opts.tiny and on_cpu:
        note("the device is the CPU: the full model's rows take long there; --tiny is the "
             "CPU mode")
    t0 = time.perf_counter()
    paths = make_models(opts.tiny, opts.models_dir)
    note(f"models ready in {time.perf_counter() - t0:.1f}s: "
         + ", ".join(f"{k} {p.stat().st_size / 1e6:.0f} MB" for k, p in paths.items()))
    n = opts.tokens
    runs = 1 if opts.tiny else opts.runs
    prompt = list(range(100, 100 + PROMPT_TOKENS))
    prompts = [[t + 7 * i for t in prompt] for i in range(BATCH)]
    rows = build_rows(device, on_cpu)
    shape = make_gguf.Shape(quant="BF16", **(TINY if opts.tiny else {}))
    dev = jax.devices(platform if platform != "cuda" else "gpu")[0]
    common = {"device": device, "device_kind": dev.device_kind, "new_tokens": n,
              "model_params": shape.params, "jax": jax.__version__, "tiny": opts.tiny}
    split: dict[str, Any] = {}
    for row in rows:
        path = paths[row.model]
        loaded = load_model(path.name, roots=[str(path.parent)], max_seq=MAX_SEQ,
                            max_slots=row.batch, prefill_buckets=(16,), dtype=row.dtype,
                            quantized=row.model == "q4_0")
        with deployed(row, path, loaded):
            batch = prompts if row.batch > 1 else [prompt]
            timed(row, batch, 4)  # compiles; not counted
            row.tps.clear(), row.ttft.clear(), row.steps.clear()
            for _ in range(runs):
                timed(row, batch, n)
            note(f"{row.name}: {statistics.median(row.tps):.1f} tok/s")
            if row.name == "bf16_1w":
                split = breakdown(row, path, loaded, prompt, n, opts.profile)
                note("bf16_1w step: " + ", ".join(
                    f"{k} {'n/a' if v is None else f'{v:.2f}'}" for k, v in split.items()))
    hf = run_transformers(paths["bf16"], prompt, n, "bfloat16", runs)
    records: list[dict[str, Any]] = []
    for rec in records_of(rows, hf, split, common, opts.tiny):
        _common.emit(rec, records)
    print(section(records), file=sys.stderr)
    return records


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="the workers' device directive (default %(default)s: the GPU where "
                        "there is one)")
    p.add_argument("--tiny", action="store_true",
                   help="a 27M-parameter model, 1 run per row: the CPU mode the tests run")
    p.add_argument("--tokens", type=int, default=64, help="new tokens a run (default 64)")
    p.add_argument("--runs", type=int, default=3, help="timed runs a row (default 3)")
    p.add_argument("--models-dir", type=pathlib.Path, default=MODELS_DIR,
                   help="where the models are written (default bench/.models)")
    p.add_argument("--profile", metavar="DIR",
                   help="write a jax.profiler trace of the in-process bf16_1w steps to DIR")


def main(argv: list[str] | None = None) -> int:
    return _common.cli(__doc__, run, add_args, argv)


if __name__ == "__main__":
    sys.exit(main())
