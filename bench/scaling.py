"""Microbatch scaling: a compute-bound model on 1 worker against 2 workers, one core each.

The model is an MLP of ``LAYERS`` dense layers (``x = tanh(x @ W)``, W float32 ``D x D``), its
weights written to a temporary safetensors file and bound by the workers from there. A
microbatch is ``(BATCH, D)`` float32: ``2 * BATCH * D * D * LAYERS`` FLOP (537 MFLOP with the
defaults, about 10 to 20 ms on one core of these machines) and a 128 KiB activation per hop.

* **1w**: ``Cluster.local(1, pin_cpus=[0])``: the whole MLP on one worker pinned to core 0.
* **2w**: ``Cluster.local(2, pin_cpus=[0, 1])``: half the layers on each worker, one per core.

Each worker runs XLA:CPU single-threaded: ``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`` (dots
and convolutions run on the calling thread instead of an Eigen pool that would fight over the
one core) plus the ``taskset`` pinning, which also sizes XLA's intra-op pool to the one core.
(``intra_op_parallelism_threads`` is a TensorFlow session option, not an XLA flag: XLA rejects
``--intra_op_parallelism_threads`` as an unknown flag and silently ignores the bare word.)
The coordinator (this process) is not pinned.

Both clusters stay up for the whole run. ``pipe.stream(batches, depth=8)`` pushes
``microbatches`` microbatches per timed run; runs alternate between 1w and 2w, ``rounds``
times, so drift of a shared machine hits both alike. Throughput is microbatches/s (and GFLOP/s),
median over the rounds; the headline is ``microbatch_scaling_2w`` = 2w / 1w at ``BATCH`` rows
(537 MFLOP), target >= 1.7x. The detail reports the CPU each process spent per microbatch (the
coordinator's own use from ``getrusage``, the workers' from ``/proc/PID/task/*/schedstat``),
the CPU the control processes below spent on the same layers (``compute_cpu_ms_per_microbatch``)
and the difference, what a worker spends per frame beyond the compute
(``worker_cpu_beyond_compute_ms_per_microbatch``: gRPC, codec, queues, dispatch).

Two sweeps, fewer runs each:

* **size**: microbatches of 8, 32 and 128 rows (134, 537 and 2147 MFLOP; every size is a
  compiled bucket) at depth 8: ``microbatch_scaling_2w_<n>MFLOP``. Each frame costs a worker
  a roughly fixed amount of CPU besides the compute, and the coordinator needs CPU on one of
  the same two cores, so the ratio grows with the compute per microbatch.
* **depth**: 1, 2, 4, 8 microbatches in flight at 537 MFLOP. With depth 1 nothing overlaps and
  2 workers cannot beat one.

A control runs in the same rounds: the same layers in plain ``jax.jit`` processes with the
same flags and pinning, one process on core 0 against two (half the layers each, on cores 0 and
1) running at the same time: ``compute_scaling_2cores_raw_xla``. That is a pipeline whose
communication is free, so it is the most the cores gave at those moments.

The machine may be shared. Each record gives the cores that other processes kept busy during
its runs (``/proc/stat`` less this benchmark's processes), and
``projected_scaling_free_cores``: the ratio the measured CPU per microbatch allows when each
worker has its core to itself (1w: its worker's CPU per microbatch; 2w: the busier worker's
plus half the coordinator's), which other load does not move.

The outputs of the first microbatch are checked against the same MLP in numpy.

Usage::

    python bench/scaling.py [--quick] [--out FILE]
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import _common as c

D = 1024
LAYERS = 8
BATCH = 32
DEPTH = 8
SWEEP_DEPTHS = (1, 2, 4, 8)
TARGET = 1.7
XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"
note = c.note("scaling")


SIZES = (8, 32, 128)      # rows per microbatch in the size sweep (BATCH is one of them)


@dataclass(frozen=True)
class Plan:
    microbatches: int      # per timed run of the headline
    rounds: int            # timed runs per configuration (alternating)
    sweep_microbatches: int   # per run of the depth sweep
    size_rounds: int          # runs per configuration and size of the size sweep
    size_seconds: float       # about how long one size-sweep run of 1w takes


FULL = Plan(microbatches=240, rounds=5, sweep_microbatches=64, size_rounds=2, size_seconds=1.5)
QUICK = Plan(microbatches=64, rounds=2, sweep_microbatches=24, size_rounds=1, size_seconds=0.6)


@dataclass
class Config:
    name: str
    cluster: Any
    pipe: Any
    rates: list[float] = field(default_factory=list)          # microbatches/s per run
    coord_cpu: list[float] = field(default_factory=list)      # coordinator CPU s per microbatch
    worker_cpu: list[list[float]] = field(default_factory=list)  # per run, per worker
    load: list[float] = field(default_factory=list)
    sweep: dict[int, float] = field(default_factory=dict)
    by_size: dict[int, list[float]] = field(default_factory=dict)  # rows -> rates
    # rows -> per run: (coordinator CPU s, [worker CPU s]) per microbatch
    cpu_by_size: dict[int, list[tuple[float, list[float]]]] = field(default_factory=dict)
    others: list[float] = field(default_factory=list)  # cores used by other processes, per run


def _dense(params: dict[str, Any], state: dict[str, Any], carry: dict[str, Any]
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    import jax.numpy as jnp

    return {"x": jnp.tanh(carry["x"] @ params["w"])}, {}


def write_weights(root: str) -> dict[str, Any]:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    # Scaled so tanh stays in its linear-ish range and the check below is meaningful.
    ws = {f"l{i}.w": (rng.standard_normal((D, D), dtype=np.float32) / np.sqrt(D)).astype(
        np.float32) for i in range(LAYERS)}
    save_file(ws, os.path.join(root, "scaling.safetensors"))
    return ws


def model() -> Any:
    from jaxdist.export.model import Model, Param, Unit

    units = [Unit(f"l{i}", _dense,
                  {"w": Param(f"safetensors://scaling.safetensors#l{i}.w", (D, D))})
             for i in range(LAYERS)]
    return Model("scaling-mlp", units, inputs={"x": (f"b, {D}", "float32")},
                 buckets=[{"b": n} for n in SIZES])


def _reference(ws: dict[str, Any], x: Any) -> Any:
    import numpy as np

    for i in range(LAYERS):
        x = np.tanh(x @ ws[f"l{i}.w"])
    return x


def _cpu_s(pid: int) -> float:
    """CPU seconds a process has run, all its threads, in nanoseconds' resolution.

    The sum of each thread's ``/proc/PID/task/TID/schedstat`` run time. (``utime + stime`` in
    ``/proc/PID/stat`` count in 10 ms ticks: too coarse for a fraction of a millisecond per
    microbatch over a run of a second.) A thread that ends during a run drops out of the sum;
    a worker's threads (gRPC's, the loop, the egress pool) live as long as the worker.
    """
    total = 0
    task = f"/proc/{pid}/task"
    for tid in os.listdir(task):
        try:
            with open(f"{task}/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread ended meanwhile
    return total / 1e9


def _machine_busy_s() -> float:
    """CPU seconds every process on the machine has used (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _self_cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)  # microseconds, ended threads included
    return u.ru_utime + u.ru_stime


def _timed_stream(cfg: Config, batches: list[dict[str, Any]], depth: int
                  ) -> tuple[float, float, list[float]]:
    """(wall s, coordinator CPU s, per-worker CPU s) of one streamed run.

    Also appends to ``cfg.others`` the cores that processes other than this benchmark's kept
    busy meanwhile (machine-wide busy time from /proc/stat less ours): on a shared machine
    that is CPU the workers could not have.
    """
    pids = [w.pid for w in cfg.cluster.local_workers]
    w0 = [_cpu_s(p) for p in pids]
    c0 = _self_cpu_s()
    m0 = _machine_busy_s()
    t0 = time.perf_counter()
    n = sum(1 for _ in cfg.pipe.stream(batches, depth=depth))
    wall = time.perf_counter() - t0
    busy = _machine_busy_s() - m0
    if n != len(batches):
        raise RuntimeError(f"{cfg.name}: {n} outputs for {len(batches)} microbatches")
    coord = _self_cpu_s() - c0
    workers = [_cpu_s(p) - a for p, a in zip(pids, w0)]
    cfg.others.append(max(0.0, busy - coord - sum(workers)) / wall)
    return wall, coord, workers


class RawCompute:
    """A process pinned to one core that runs MLP layers with plain ``jax.jit``: no jaxdist.

    The control for the scaling ratio: two of them computing half the layers each, at the same
    time, is a pipeline with free communication, so raw 2 / raw 1 is what the machine's cores
    give at that moment, with the same XLA flags and pinning as the workers.
    """

    def __init__(self, root: str, cpu: int, layers: Sequence[int]) -> None:
        env = dict(os.environ, XLA_FLAGS=XLA_FLAGS)
        self.proc = subprocess.Popen(
            ["taskset", "-c", str(cpu), sys.executable, os.path.abspath(__file__), "_raw", root,
             ",".join(map(str, layers))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env)
        self._read()  # ready

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"raw compute process {self.proc.pid} exited with "
                               f"{self.proc.wait()}")
        return line

    def start(self, n: int, at: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{n} {at}\n")
        self.proc.stdin.flush()

    def wall(self) -> float:
        return float(self._read())

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)
        if self.proc.stdout:
            self.proc.stdout.close()


def _raw_main(root: str, layers: str) -> int:
    import jax
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    ws = load_file(os.path.join(root, "scaling.safetensors"))
    params = [jnp.asarray(ws[f"l{int(i)}.w"]) for i in layers.split(",")]

    @jax.jit
    def chain(x: Any, params: list[Any]) -> Any:
        for w in params:
            x = jnp.tanh(x @ w)
        return x

    x = jnp.ones((BATCH, D), jnp.float32)
    chain(x, params).block_until_ready()
    print("ready", flush=True)
    for line in sys.stdin:
        n, at = line.split()
        while time.time() < float(at):
            time.sleep(0.0005)
        t0 = time.perf_counter()
        for _ in range(int(n)):
            y = chain(x, params)
        y.block_until_ready()
        print(time.perf_counter() - t0, flush=True)
    return 0


def _raw_rate(procs: Sequence[RawCompute], n: int) -> float:
    """Microbatches/s of ``procs`` each running ``n`` microbatches at once (slowest wins)."""
    at = time.time() + 0.05
    for p in procs:
        p.start(n, at)
    return n / max(p.wall() for p in procs)


def projected_scaling(one: list[tuple[float, list[float]]],
                      two: list[tuple[float, list[float]]]) -> float:
    """2w / 1w throughput if each worker had its core to itself (from CPU per microbatch).

    1w is bound by its one worker's CPU per microbatch (the coordinator runs on the other,
    idle core). 2w is bound by the busier worker, whose core also carries half of the
    coordinator's CPU (it runs on either core). Load from other processes drops out.
    """
    w1 = c.median([w[0] for _, w in one])
    w2 = max(c.median([w[i] for _, w in two]) for i in range(len(two[0][1])))
    coord = c.median([k for k, _ in two])
    return w1 / (w2 + coord / 2)


def run(opts: Any) -> list[dict[str, Any]]:
    import numpy as np

    from jaxdist.coordinator.cluster import Cluster

    plan = QUICK if opts.quick else FULL
    machine = c.machine()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("scaling bench: needs at least 2 cores to pin 2 workers")
    tmp = tempfile.mkdtemp(prefix="jaxdist-bench-scaling-")
    records: list[dict[str, Any]] = []
    configs: list[Config] = []
    try:
        ws = write_weights(tmp)
        m = model()
        env = {"XLA_FLAGS": XLA_FLAGS}
        for n, cpus in ((1, [0]), (2, [0, 1])):
            t0 = time.perf_counter()
            cluster = Cluster.local(n, weights_roots=[tmp], pin_cpus=cpus, env=env)
            configs.append(Config(f"{n}w", cluster, None))
            configs[-1].pipe = cluster.deploy(m, stages=n, platforms=("cpu",))
            note(f"{n}w: spawned and deployed in {time.perf_counter() - t0:.1f}s "
                 f"(split {[len(s.weights) for s in configs[-1].pipe.specs]} layers)")
        rng = np.random.default_rng(1)
        xs = [rng.standard_normal((BATCH, D), dtype=np.float32) for _ in range(8)]
        batches = [{"x": xs[i % len(xs)]} for i in range(plan.microbatches)]
        ref = _reference(ws, xs[0])
        max_err = {}
        for cfg in configs:  # warm-up (first calls) and the correctness check
            out = cfg.pipe.call({"x": xs[0]})["x"]
            max_err[cfg.name] = float(np.max(np.abs(out - ref)))
            if max_err[cfg.name] > 1e-3:
                raise RuntimeError(f"{cfg.name}: output differs from numpy by {max_err[cfg.name]}")
            for _ in cfg.pipe.stream(batches[:16], depth=DEPTH):
                pass
        half = LAYERS // 2
        raw_procs = [RawCompute(tmp, 0, range(LAYERS)), RawCompute(tmp, 0, range(half)),
                     RawCompute(tmp, 1, range(half, LAYERS))]
        raw1: list[float] = []
        raw_cpu: list[list[float]] = []  # per round: CPU s per microbatch of each raw process
        raw2: list[float] = []
        for r in range(plan.rounds):
            for cfg in configs if r % 2 == 0 else configs[::-1]:
                wall, coord, workers = _timed_stream(cfg, batches, DEPTH)
                cfg.rates.append(len(batches) / wall)
                cfg.coord_cpu.append(coord / len(batches))
                cfg.worker_cpu.append([w / len(batches) for w in workers])
                cfg.load.append(c.load())
            r0 = [_cpu_s(p.proc.pid) for p in raw_procs]
            raw1.append(_raw_rate(raw_procs[:1], len(batches)))
            raw2.append(_raw_rate(raw_procs[1:], len(batches)))
            raw_cpu.append([(_cpu_s(p.proc.pid) - a) / len(batches)
                            for p, a in zip(raw_procs, r0)])
            note(f"round {r + 1}/{plan.rounds}: " + ", ".join(
                f"{x.name} {x.rates[-1]:.1f} mb/s" for x in configs)
                + f" -> {configs[1].rates[-1] / configs[0].rates[-1]:.2f}x; raw XLA "
                f"{raw1[-1]:.1f} / {raw2[-1]:.1f} mb/s -> {raw2[-1] / raw1[-1]:.2f}x")
        for p in raw_procs:
            p.close()
        sweep_batches = batches[:plan.sweep_microbatches]
        for depth in SWEEP_DEPTHS:
            for cfg in configs:
                wall, _, _ = _timed_stream(cfg, sweep_batches, depth)
                cfg.sweep[depth] = len(sweep_batches) / wall
        note("depth sweep: " + "; ".join(
            f"{x.name} " + ", ".join(f"d{k} {v:.1f}" for k, v in x.sweep.items())
            for x in configs))
        for rows in SIZES:
            x = rng.standard_normal((rows, D), dtype=np.float32)
            for cfg in configs:  # warm-up of this shape
                for _ in cfg.pipe.stream([{"x": x}] * 4, depth=DEPTH):
                    pass
            # as many microbatches as 1w streams in about size_seconds
            wall, _, _ = _timed_stream(configs[0], [{"x": x}] * 8, DEPTH)
            n = max(16, round(plan.size_seconds * 8 / wall))
            for r in range(plan.size_rounds):
                for cfg in configs if r % 2 == 0 else configs[::-1]:
                    wall, coord, workers = _timed_stream(cfg, [{"x": x}] * n, DEPTH)
                    cfg.by_size.setdefault(rows, []).append(n / wall)
                    cfg.cpu_by_size.setdefault(rows, []).append(
                        (coord / n, [w / n for w in workers]))
        note("size sweep: " + ", ".join(
            f"{rows} rows {c.median(configs[1].by_size[rows]) / c.median(configs[0].by_size[rows]):.2f}x"
            for rows in SIZES))
    finally:
        for cfg in configs:
            cfg.cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)

    one, two = configs
    flop = 2 * BATCH * D * D * LAYERS
    paired = [b / a for a, b in zip(one.rates, two.rates)]
    common = {"d": D, "layers": LAYERS, "microbatch": [BATCH, D],
              "mflop_per_microbatch": round(flop / 1e6, 1),
              "activation_bytes": BATCH * D * 4, "weight_bytes": LAYERS * D * D * 4,
              "depth": DEPTH, "microbatches_per_run": plan.microbatches, "rounds": plan.rounds,
              "xla_flags": XLA_FLAGS, "max_abs_err_vs_numpy": max_err}

    # The compute alone: the CPU the raw processes spent per microbatch on the same layers
    # (1w: all layers; 2w: each half), to subtract from the workers' CPU.
    compute = {"1w": [c.median([r[0] for r in raw_cpu]) * 1e3],
               "2w": [c.median([r[i] for r in raw_cpu]) * 1e3 for i in (1, 2)]}

    def detail(cfg: Config) -> dict[str, Any]:
        rate = c.median(cfg.rates)
        coord = c.median(cfg.coord_cpu)
        per_worker = [round(c.median([w[i] for w in cfg.worker_cpu]) * 1e3, 3)
                      for i in range(len(cfg.worker_cpu[0]))]
        return {"config": cfg.name, "pin_cpus": list(range(len(per_worker))),
                "rates_per_run": [round(x, 2) for x in cfg.rates],
                "gflop_per_s": round(rate * flop / 1e9, 2),
                "ms_per_microbatch": round(1e3 / rate, 3),
                "coordinator_cpu_ms_per_microbatch": round(coord * 1e3, 3),
                # share of one core the coordinator keeps busy while streaming
                "coordinator_cpu_cores": round(coord * rate, 3),
                "worker_cpu_ms_per_microbatch": per_worker,
                "worker_cpu_cores": [round(w * rate / 1e3, 3) for w in per_worker],
                # the same layers in a plain jax.jit process, CPU per microbatch
                "compute_cpu_ms_per_microbatch": [round(x, 3) for x in compute[cfg.name]],
                # what a worker spends per frame beyond the compute (gRPC, codec, queues)
                "worker_cpu_beyond_compute_ms_per_microbatch": [
                    round(w - x, 3) for w, x in zip(per_worker, compute[cfg.name])],
                "depth_sweep_microbatches_per_s": {str(k): round(v, 2)
                                                   for k, v in cfg.sweep.items()},
                "loadavg_1m_during": [min(cfg.load), max(cfg.load)],
                # cores other processes on the machine kept busy during this config's runs
                "other_processes_cpu_cores": round(c.median(cfg.others), 3)}

    ratio = c.median(two.rates) / c.median(one.rates)
    c.emit(c.record("microbatch_throughput_1w", c.median(one.rates), "microbatches/s",
                    "none (this is the baseline)", None, None, "", None,
                    **detail(one), **common, **machine), records)
    c.emit(c.record("microbatch_throughput_2w", c.median(two.rates), "microbatches/s",
                    "1 worker pinned to 1 core", c.median(one.rates), ratio, "", None,
                    **detail(two), **common, **machine), records)
    raw_ratio = c.median(raw2) / c.median(raw1)
    raw = {"raw_xla_microbatches_per_s": {"1 core": round(c.median(raw1), 2),
                                          "2 cores": round(c.median(raw2), 2)},
           "raw_xla_scaling": round(raw_ratio, 3),
           "raw_xla_paired_ratios": [round(b / a, 3) for a, b in zip(raw1, raw2)],
           # jaxdist's share of what the cores gave at the same moments
           "scaling_over_raw_xla": round(ratio / raw_ratio, 3)}
    c.emit(c.record("microbatch_scaling_2w", ratio, "x", "1 worker pinned to 1 core",
                    c.median(one.rates), ratio, f">= {TARGET}x 1-worker throughput",
                    ratio >= TARGET, baseline_unit="microbatches/s",
                    throughput_2w=round(c.median(two.rates), 2),
                    paired_ratio_median=round(c.median(paired), 4),
                    paired_ratios=[round(x, 3) for x in paired],
                    depth_sweep_ratio={str(k): round(two.sweep[k] / one.sweep[k], 3)
                                       for k in SWEEP_DEPTHS},
                    projected_scaling_free_cores=round(projected_scaling(
                        [(k, w) for k, w in zip(one.coord_cpu, one.worker_cpu)],
                        [(k, w) for k, w in zip(two.coord_cpu, two.worker_cpu)]), 3),
                    **raw,
                    coordinator_cpu_ms_per_microbatch=detail(two)[
                        "coordinator_cpu_ms_per_microbatch"],
                    worker_cpu_beyond_compute_ms_per_microbatch={
                        x.name: detail(x)["worker_cpu_beyond_compute_ms_per_microbatch"]
                        for x in configs},
                    coordinator_cpu_cores=detail(two)["coordinator_cpu_cores"],
                    other_processes_cpu_cores={x.name: round(c.median(x.others), 3)
                                               for x in configs},
                    **common, **machine), records)
    c.emit(c.record("compute_scaling_2cores_raw_xla", raw_ratio, "x",
                    "the same layers in 1 process on 1 core", c.median(raw1), raw_ratio,
                    "reported (the machine's ceiling for microbatch_scaling_2w)", None,
                    baseline_unit="microbatches/s", throughput_2cores=round(c.median(raw2), 2),
                    paired_ratios=raw["raw_xla_paired_ratios"], mflop_per_microbatch=round(
                        flop / 1e6, 1), xla_flags=XLA_FLAGS, **machine), records)
    for rows in SIZES:
        mflop = 2 * rows * D * D * LAYERS / 1e6
        a, b = c.median(one.by_size[rows]), c.median(two.by_size[rows])
        c.emit(c.record(f"microbatch_scaling_2w_{mflop:.0f}MFLOP", b / a, "x",
                        "1 worker pinned to 1 core", a, b / a, "reported", None,
                        baseline_unit="microbatches/s",
                        rows=rows, mflop_per_microbatch=round(mflop, 1),
                        throughput_1w=round(a, 2), throughput_2w=round(b, 2),
                        rates_1w=[round(x, 2) for x in one.by_size[rows]],
                        rates_2w=[round(x, 2) for x in two.by_size[rows]],
                        projected_scaling_free_cores=round(projected_scaling(
                            one.cpu_by_size[rows], two.cpu_by_size[rows]), 3),
                        worker_cpu_ms_per_microbatch={
                            x.name: [round(c.median([w[i] for _, w in x.cpu_by_size[rows]])
                                           * 1e3, 3) for i in range(len(x.cpu_by_size[rows][0][1]))]
                            for x in configs},
                        coordinator_cpu_ms_per_microbatch=round(
                            c.median([k for k, _ in two.cpu_by_size[rows]]) * 1e3, 3),
                        depth=DEPTH, **machine), records)
    return records


if __name__ == "__main__":
    if sys.argv[1:2] == ["_raw"]:
        sys.exit(_raw_main(sys.argv[2], sys.argv[3]))
    sys.exit(c.cli(__doc__, run))
