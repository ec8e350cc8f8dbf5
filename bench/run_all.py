"""Run every benchmark, then rewrite bench/RESULTS.md and the plots in bench/plots/.

Each benchmark runs as a subprocess (``python bench/NAME.py [--quick] --out bench/out/NAME.json``);
its JSON records are printed here as they come. Then RESULTS.md is rewritten: one table of every
record (metric | jaxdist | baseline | ratio | target | met?), the physical limits of the machine
in the same table, the date and the machine, the load average during each benchmark (the machine
may be shared), the plots, and how to reproduce. Hand-written analysis lives in bench/NOTES.md,
which this script never touches.

Order: limits, transport, decode, llamacpp (only with ``--with-llamacpp``; right after decode,
whose records it compares against), cpu_step (also only with ``--with-llamacpp``: the decode step
against llama.cpp on SmolLM2 and on generated 0.92B models), decode_floor, scaling, memory, deploy, serve (llama-server too when
bench/serve.py finds it built), soak (only with ``--with-soak``:
a stability run, 4 minutes here), chaos (only with ``--with-chaos``: workers killed and
restarted under load, 4 minutes here; run ``bench/chaos.py`` alone for the full 30). A benchmark that fails or times out is reported as such in
RESULTS.md and the others still run.

Usage::

    python bench/run_all.py [--quick] [--with-llamacpp] [--with-soak] [--with-chaos]
                            [--only NAME,NAME]
                            [--no-results | --report-only]

``--with-llamacpp`` builds llama.cpp into bench/.venv-llamacpp on first use (8 to 12 minutes on 2
cores, not counted in the benchmark's time; later runs reuse it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common as c
import report

OUT = HERE / "out"
BENCHES = ("limits", "transport", "decode", "llamacpp", "cpu_step", "decode_floor", "scaling",
           "memory", "deploy", "serve", "soak", "chaos")
OPT_IN = {"llamacpp": "with_llamacpp", "cpu_step": "with_llamacpp",  # benchmark -> its option
          "soak": "with_soak", "chaos": "with_chaos"}
SOAK_MINUTES = "4"   # bench/soak.py defaults to 10 minutes; here it keeps to the 5-minute budget
TIMEOUT_S = 600          # a benchmark is meant to take under 300 s; this only stops a hang
BUDGET_S = 300


class LoadSampler:
    """The 1-minute load average every few seconds, in a thread."""

    def __init__(self, every: float = 5.0) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), os.getloadavg()[0]))
            self._stop.wait(every)

    def between(self, t0: float, t1: float) -> list[float]:
        return [x for t, x in self.samples if t0 <= t <= t1]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_bench(name: str, quick: bool, extra: list[str]) -> dict[str, Any]:
    """Run one benchmark; echo its records; return its status and records."""
    script = HERE / f"{name}.py"
    out = OUT / f"{name}.json"
    if out.exists():
        out.unlink()
    cmd = [sys.executable, str(script), "--out", str(out), *(["--quick"] if quick else []),
           *extra]
    print(f"[run_all {time.strftime('%H:%M:%S')}] {' '.join(cmd[1:])}", file=sys.stderr,
          flush=True)
    t0 = time.time()
    records: list[dict[str, Any]] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            cwd=HERE.parent)
    timer = threading.Timer(TIMEOUT_S, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if not line:
                continue
            print(line, flush=True)
            if line.startswith("{"):
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        rc = proc.wait()
    finally:
        timer.cancel()
    wall = time.time() - t0
    if out.exists():  # the file is the complete list; stdout may have been cut by a crash
        try:
            records = json.loads(out.read_text())
        except json.JSONDecodeError:
            pass
    status = "ok" if rc == 0 else ("timed out" if wall >= TIMEOUT_S else f"failed (exit {rc})")
    print(f"[run_all {time.strftime('%H:%M:%S')}] {name}: {status} in {wall:.0f}s, "
          f"{len(records)} records", file=sys.stderr, flush=True)
    return {"name": name, "status": status, "wall_s": round(wall, 1), "t0": t0,
            "t1": t0 + wall, "records": records,
            "command": " ".join(["python", f"bench/{name}.py", *(["--quick"] if quick else []),
                                 *(e.replace(str(OUT), "bench/out") for e in extra)])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="every benchmark with --quick")
    p.add_argument("--with-llamacpp", action="store_true",
                   help="also run bench/llamacpp.py and bench/cpu_step.py (builds llama.cpp "
                        "on first use)")
    p.add_argument("--with-soak", action="store_true",
                   help=f"also run bench/soak.py ({SOAK_MINUTES} minutes, 1 with --quick): "
                        "worker memory must stay flat under continuous generation")
    p.add_argument("--with-chaos", action="store_true",
                   help=f"also run bench/chaos.py ({SOAK_MINUTES} minutes, 2 with --quick): "
                        "SIGKILLed workers, no request lost, outputs as solo runs")
    p.add_argument("--only", help="comma-separated subset of: " + ", ".join(BENCHES))
    p.add_argument("--no-results", action="store_true",
                   help="run and print, but leave RESULTS.md and the plots alone")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rewrite RESULTS.md and the plots from bench/out/run_all.json")
    opts = p.parse_args(argv)
    if not opts.no_results and importlib.util.find_spec("matplotlib") is None:
        # Checked first: the plots are drawn after every benchmark has run
        p.error("RESULTS.md's plots need matplotlib, which is not installed: "
                "pip install -e '.[bench]' (or pass --no-results to leave RESULTS.md alone)")
    if opts.report_only:
        saved = json.loads((OUT / "run_all.json").read_text())
        runs = [dict(r, records=saved["records"].get(r["name"], [])) for r in saved["runs"]]
        summary = {k: v for k, v in saved.items() if k != "records"}
        write_results(runs, summary)
        return 0
    names = [n for n in BENCHES if n not in OPT_IN or getattr(opts, OPT_IN[n])]
    if opts.only:
        wanted = [x.strip() for x in opts.only.split(",") if x.strip()]
        unknown = sorted(set(wanted) - set(BENCHES))
        if unknown:
            p.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHES)}")
        names = [n for n in names if n in wanted]
    OUT.mkdir(exist_ok=True)
    started = time.time()
    machine = c.machine()
    sampler = LoadSampler()
    runs: list[dict[str, Any]] = []
    build: dict[str, Any] | None = None
    try:
        for name in names:
            extra: list[str] = []
            if name == "llamacpp":
                build = build_llamacpp()
                if build.get("error"):
                    runs.append({"name": name, "status": "build failed", "wall_s": 0,
                                 "t0": time.time(), "t1": time.time(), "records": [],
                                 "command": "python bench/llamacpp.py --setup-only",
                                 "error": build["error"]})
                    continue
                extra = []
            if name in ("soak", "chaos") and not opts.quick:
                extra = ["--minutes", SOAK_MINUTES]
            runs.append(run_bench(name, opts.quick, extra))
    finally:
        sampler.stop()
    for r in runs:
        r["loadavg_1m"] = sampler.between(r["t0"], r["t1"])
    summary = {"started": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
               "wall_s": round(time.time() - started, 1), "quick": opts.quick,
               "with_llamacpp": opts.with_llamacpp, "with_soak": opts.with_soak,
               "with_chaos": opts.with_chaos,
               "machine": machine,
               "llamacpp_build": build,
               "runs": [{k: v for k, v in r.items() if k != "records"} for r in runs]}
    (OUT / "run_all.json").write_text(json.dumps(
        {**summary, "records": {r["name"]: r["records"] for r in runs}}, indent=1))
    if not opts.no_results:
        write_results(runs, summary)
    failed = [r["name"] for r in runs if r["status"] != "ok"]
    if failed:
        print(f"[run_all] not ok: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def write_results(runs: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """Rewrite RESULTS.md and the plots; keep a copy of a RESULTS.md that was written by hand."""
    results = HERE / "RESULTS.md"
    if results.exists() and report.MARKER not in results.read_text():
        backup = OUT / "RESULTS.md.hand-written"
        backup.write_text(results.read_text())
        print(f"[run_all] RESULTS.md was not generated by this script; kept a copy in {backup} "
              "(hand-written analysis belongs in bench/NOTES.md)", file=sys.stderr)
    report.write(HERE, runs, summary)
    print(f"[run_all] wrote {results} and {HERE / 'plots'}/", file=sys.stderr)


def build_llamacpp() -> dict[str, Any]:
    """Build the llama.cpp venv if needed (its own subprocess; not part of the timing)."""
    cmd = [sys.executable, str(HERE / "llamacpp.py"), "--setup-only"]
    print(f"[run_all {time.strftime('%H:%M:%S')}] llamacpp.py --setup-only (builds llama.cpp "
          "on first use, 8 to 12 minutes; then reuses it)", file=sys.stderr, flush=True)
    t0 = time.time()
    r = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    if r.returncode:
        return {"error": f"llamacpp.py --setup-only exited with {r.returncode}",
                "setup_s": round(time.time() - t0, 1)}
    status = json.loads(r.stdout.strip().splitlines()[-1])
    status["setup_s"] = round(time.time() - t0, 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
