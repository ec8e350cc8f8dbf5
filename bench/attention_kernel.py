"""Time the CPU attention kernel (``jaxdist_cache_attention_v1``, attention.cc) on its own.

Shapes: SmolLM2-135M (9 query heads over 3 key/value heads, head dim 64) and a ~1B Llama (32
over 8, head dim 64), decode steps (one query per row) and prefill chunks of 16 queries. Each
timing is one jitted ``fori_loop`` of ``--calls`` kernel calls (the call marked side-effecting,
so XLA neither hoists nor merges it), divided by the calls: the per-call time without jax's
dispatch. The median of ``--reps`` such loops is printed per (case, threads, ISA), where the ISA
is switched in-process with ``kernels.set_isa`` (``wide``: AVX-512F where the CPU has it;
``avx2``: the AVX2+FMA path) and the threads with ``kernels.load(threads=...)``; the
configurations take turns loop by loop. The cache is the same every call, so it is read from
the CPU's caches, not from memory as in a model's decode step.

The kernel splits a call over 2 threads from 2M multiply-adds, or from 256K when a helper
thread is awake (spinning after a matmul it helped with). A loop of attention calls alone
keeps no helper awake, so here decode steps under 2M run on one thread whatever ``--threads``
says; ``bench/attention_threads.cc`` times the units through the pool with the helpers awake
and asleep.

Usage::

    python bench/attention_kernel.py [--calls 200] [--reps 31] [--cases smol_decode,...]

Prints one line per measurement, plus JSON records with ``--json``. On a shared machine run it
more than once: medians of many short loops still move by 5-10% with foreign load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist.core import kernels

# name: (B, S, H, KV, D, T, pos per row, length per row)
CASES: dict[str, tuple[int, int, int, int, int, int, list[int], list[int]]] = {
    "smol_decode_200": (1, 1, 9, 3, 64, 256, [199], [1]),
    "smol_decode_b8_200": (8, 1, 9, 3, 64, 256, [199] * 8, [1] * 8),
    "smol_prefill_b16_s16": (16, 16, 9, 3, 64, 256, [2 * r for r in range(16)], [16] * 16),
    "1b_decode_100": (1, 1, 32, 8, 64, 512, [99], [1]),
    "1b_decode_400": (1, 1, 32, 8, 64, 512, [399], [1]),
    "1b_s16_100": (1, 16, 32, 8, 64, 512, [84], [16]),
    "1b_s16_400": (1, 16, 32, 8, 64, 512, [384], [16]),
}
# Around the split threshold (kMinSplitMacs in attention.cc): decode steps of growing length.
SCAN: dict[str, tuple[int, int, int, int, int, int, list[int], list[int]]] = {
    **{f"smol_decode_{n}": (1, 1, 9, 3, 64, 1024, [n - 1], [1]) for n in (100, 300, 500, 800)},
    **{f"1b_decode_{n}": (1, 1, 32, 8, 64, 512, [n - 1], [1]) for n in (25, 50, 200)},
}
CASES.update(SCAN)


def make_fn(case: str, calls: int) -> tuple[Any, tuple[np.ndarray, ...]]:
    b, s, h, kv, d, t, pos, length = CASES[case]
    rng = np.random.default_rng(0)
    slots = max(b, 1)
    q = rng.standard_normal((b, s, h, d)).astype(np.float32)
    kc = rng.standard_normal((slots, kv, t, d)).astype(np.float32)
    vc = rng.standard_normal((slots, kv, t, d)).astype(np.float32)
    args = (q, kc, vc, np.arange(b, dtype=np.int32), np.array(pos, np.int32),
            np.array(length, np.int32))
    call = jax.ffi.ffi_call(kernels.ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            has_side_effect=True)

    def loop(*a: Any) -> Any:
        def body(_: Any, acc: Any) -> Any:
            return acc + call(*a, scale=np.float32(d ** -0.5))[0, 0, 0, 0]
        return lax.fori_loop(0, calls, body, jnp.float32(0))

    return jax.jit(loop).lower(*args).compile(), args


def time_configs(fn: Any, args: tuple[np.ndarray, ...], calls: int, reps: int,
                 configs: list[tuple[int, str]]) -> dict[tuple[int, str], float]:
    """Median microseconds per call of each (threads, isa), the configurations taking turns
    loop by loop so that load from other processes falls on all of them alike."""
    times: dict[tuple[int, str], list[float]] = {c: [] for c in configs}
    for rep in range(reps + 1):
        for threads, isa in configs:
            kernels.load(threads=threads)
            kernels.set_isa(isa == "wide")
            t0 = time.perf_counter()
            fn(*args).block_until_ready()
            if rep:  # the first round warms up (helpers started, caches)
                times[(threads, isa)].append((time.perf_counter() - t0) / calls)
    return {c: statistics.median(t) * 1e6 for c, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--cases", default=",".join(c for c in CASES if c not in SCAN),
                    help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--isas", default="wide,avx2")
    ap.add_argument("--json", action="store_true")
    opts = ap.parse_args()
    info = kernels.load()
    if not info.available:
        raise SystemExit(f"CPU kernels unavailable: {info.reason}")
    configs = [(int(t), i) for t in opts.threads.split(",") for i in opts.isas.split(",")]
    try:
        for case in opts.cases.split(","):
            fn, args = make_fn(case, opts.calls)
            result = time_configs(fn, args, opts.calls, opts.reps, configs)
            for (threads, isa), us in result.items():
                print(f"{case:22s} threads={threads} isa={isa:5s} {us:9.2f} us/call", flush=True)
                if opts.json:
                    print(json.dumps({"case": case, "threads": threads, "isa": isa,
                                      "us_per_call": round(us, 3)}), flush=True)
    finally:
        kernels.load(threads=0)
        kernels.set_isa(True)


if __name__ == "__main__":
    main()
