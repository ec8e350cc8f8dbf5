"""Physical limits of this machine, and the decode rate memory bandwidth allows SmolLM2.

* **memory_bandwidth**: a large numpy copy (``np.copyto`` of a 512 MiB float32 array into
  another), counted as bytes read plus bytes written per second, best of a few repeats, with 1
  thread and with one thread per core (each copying its own slice; numpy releases the GIL while it
  copies). The value is the better of the two. The detail adds a read-only figure (XLA:CPU
  summing the same array with its thread pool), which is what a decode step mostly does.
* **decode_tokens_per_s_bound_smollm2**: at batch 1 a decode step reads every bound weight once,
  so tokens/s <= memory bandwidth / bytes read per token. Bytes per token is the sum of the
  bound weight bytes of all stages of SmolLM2 as bench/decode.py deploys it (float32, the tied
  embedding bound twice: once for the lookup, once transposed as the output projection). The
  detail also gives the bound without the embedding table, of which a step reads one row, and
  the bound for llama.cpp's bytes per token (the GGUF's tensor bytes, Q4_1 and Q8_0, read once).
  bench/decode.py's measured rate is compared with it in RESULTS.md.

The raw TCP loopback limits (round trip and bandwidth) are measured by bench/transport.py
(``tcp_median_rtt_ms`` and ``tcp_wire_gbps`` of its records); bench/run_all.py puts them in the
same table.

Usage::

    python bench/limits.py [--quick] [--out FILE]
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import _common as c

COPY_BYTES = 512 << 20
note = c.note("limits")


def _copy_gbps(src: Any, dst: Any, threads: int, repeats: int) -> float:
    """Best (read + written) GB/s of copying src into dst with ``threads`` threads."""
    import numpy as np

    n = src.shape[0]
    cuts = [n * i // threads for i in range(threads + 1)]
    best = 0.0
    for _ in range(repeats):
        barrier = threading.Barrier(threads + 1)

        def part(i: int, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            np.copyto(dst[cuts[i]:cuts[i + 1]], src[cuts[i]:cuts[i + 1]])

        ts = [threading.Thread(target=part, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in ts:
            t.join()
        best = max(best, 2 * src.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def _xla_read_gbps(src: Any, repeats: int) -> float:
    import jax
    import jax.numpy as jnp

    x = jax.device_put(src)
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = max(best, src.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def bytes_per_token() -> dict[str, Any]:
    """SmolLM2's bound bytes per decode step (jaxdist, float32) and its GGUF tensor bytes."""
    import gguf

    from jaxdist.export.plugins import default_model
    from jaxdist.export.plugins import load_model

    path = default_model()
    loaded = load_model(path.name, roots=[str(path.parent)], max_seq=256, max_slots=8,
                        prefill_buckets=(16, 64))
    units = loaded.model.units
    # Stages partition the units, so the sum over stages is the sum over units.
    bound = sum(u.weight_bytes for u in units)
    embed = units[0].weight_bytes
    reader = gguf.GGUFReader(str(path))
    gguf_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    return {"model": path.name, "bound_weight_bytes": int(bound),
            "embedding_unit_bytes": int(embed), "gguf_tensor_bytes": gguf_bytes}


def run(opts: Any) -> list[dict[str, Any]]:
    import numpy as np

    machine = c.machine()
    records: list[dict[str, Any]] = []
    repeats = 3 if opts.quick else 7
    src = np.random.default_rng(0).standard_normal(COPY_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    dst[:] = 0  # fault the pages in before timing
    cores = os.cpu_count() or 1
    one = _copy_gbps(src, dst, 1, repeats)
    many = _copy_gbps(src, dst, cores, repeats) if cores > 1 else one
    read = _xla_read_gbps(src, repeats)
    bw = max(one, many)
    note(f"numpy copy {one:.1f} GB/s (1 thread), {many:.1f} GB/s ({cores} threads); "
         f"XLA read {read:.1f} GB/s")
    c.emit(c.record("memory_bandwidth", bw, "GB/s", "", None, None, "reported", None,
                    method="numpy copyto of 512 MiB float32, (read + written) bytes / s, best",
                    copy_gbps_1_thread=round(one, 2),
                    copy_gbps_threads={str(cores): round(many, 2)},
                    xla_read_gbps=round(read, 2), array_bytes=COPY_BYTES, repeats=repeats,
                    **machine), records)
    b = bytes_per_token()
    bound = bw * 1e9 / b["bound_weight_bytes"]
    c.emit(c.record("decode_tokens_per_s_bound_smollm2", bound, "tokens/s",
                    "memory bandwidth / bound weight bytes per token", None, None,
                    "reported (an upper limit)", None, memory_bandwidth_gbps=round(bw, 2),
                    **b,
                    bound_excluding_embedding_lookup=round(
                        bw * 1e9 / (b["bound_weight_bytes"] - b["embedding_unit_bytes"]), 2),
                    bound_at_xla_read_gbps=round(read * 1e9 / b["bound_weight_bytes"], 2),
                    llamacpp_bound_tokens_per_s=round(bw * 1e9 / b["gguf_tensor_bytes"], 2),
                    **machine), records)
    return records


if __name__ == "__main__":
    sys.exit(c.cli(__doc__, run))
