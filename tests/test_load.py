"""Load: 16 concurrent generation sessions x 64 tokens through 2 real workers.

A tiny random Llama (transformers, saved as safetensors) is deployed as 2 stages on
``Cluster.local(2)`` with ``max_slots=1``, so every ``Generator.run`` is its own session holding
its own sequence. Sixteen threads generate at once; every output must be token-for-token the
output of the same prompt run alone (greedy decoding: any cross-talk between sessions, a lost or
reordered step, or state from another session changes tokens).

Then the workers must be back where they started once the sessions have ended: no session left
(``Info.sessions``), and resident memory, thread count and open file descriptors at their
baseline. The baseline is taken after a short concurrent warm-up burst and the solo reference
runs, so thread pools (gRPC's and the worker's control-plane pool, which grow on demand up to a
bound and never shrink), channels and every compiled shape already exist. Tolerances:

* fds: exactly the baseline. Nothing per session may keep a socket, pipe or file open.
* threads: at most ``THREAD_TOLERANCE`` (4) above the baseline. The worker's control-plane pool
  (``EndSession``, ``Info``: a ThreadPoolExecutor of up to 64) and its egress pool (up to 4)
  start a thread only when every existing one is busy, so a burst whose peak concurrency exceeds
  the warm-up's adds one or two (measured: +1), and they are kept for reuse. A thread per session
  would add 16 on each worker.
* RSS: baseline + ``RSS_TOLERANCE`` (16 MiB). What the burst legitimately leaves behind is heap
  that glibc keeps for reuse rather than returning to the kernel, which measured 0-3 MiB here.
  The sessions themselves hold ``STATE_BYTES`` of KV cache per worker, too small to see in RSS,
  so the check targets leaks in the per-step path: 16 x 64 = 1024 steps per worker, so a leak of
  16 KiB or more per step (a frame's buffers, a compiled executable, a future) exceeds the bound.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models import save_tiny_llama

from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.generation import Generator, SamplingParams
from jaxdist.exporters.llama import llama_model

pytestmark = [pytest.mark.reference, pytest.mark.timeout(240)]

SESSIONS = 16
TOKENS = 64
MAX_SEQ = 80          # longest prompt (8) + 64 new tokens fits
BUCKET = 8
RSS_TOLERANCE = 16 << 20
THREAD_TOLERANCE = 4


@pytest.fixture(scope="module")
def llama_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("load")
    save_tiny_llama(root / "llama", layers=4)
    return root


def proc_counts(pid: int) -> dict[str, int]:
    """Threads and open file descriptors of a process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return {"threads": threads, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def snapshot(cluster: Cluster) -> list[dict[str, int]]:
    out = []
    for w, info in zip(cluster.local_workers, cluster.info()):
        out.append({"rss": int(info.rss_bytes), "sessions": int(info.sessions),
                    **proc_counts(w.pid)})
    return out


def wait_sessions_ended(cluster: Cluster, timeout: float = 30.0) -> list[dict[str, int]]:
    """Sessions end with an EndSession per worker after each run; poll until none is left."""
    deadline = time.monotonic() + timeout
    while True:
        snap = snapshot(cluster)
        if all(s["sessions"] == 0 for s in snap) or time.monotonic() > deadline:
            return snap
        time.sleep(0.2)


def test_16_concurrent_sessions_match_solo_runs_and_leave_nothing_behind(llama_root: Path):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=int(n)).tolist()
               for n in rng.integers(1, BUCKET + 1, size=SESSIONS)]
    assert len({tuple(p) for p in prompts}) == SESSIONS  # every session computes something else
    model = llama_model("llama", roots=[llama_root], max_slots=1, max_seq=MAX_SEQ,
                        prefill_buckets=(BUCKET,))
    dtypes = {k: v[1] for k, v in model.inputs.items()}
    t0 = time.monotonic()
    with Cluster.local(2, weights_roots=[str(llama_root)], max_sessions=2 * SESSIONS) as cluster:
        pipe = cluster.deploy(model, stages=2, platforms=("cpu",))
        assert len({c.address for c in pipe.clients}) == 2  # one stage per worker

        def run(prompt: list[int], n: int = TOKENS) -> list[int]:
            # Closed at once: an engine keeps its session (and the workers its KV memory)
            # through idle gaps until it is closed or keep_session_s passes.
            with Generator(pipe, input_dtypes=dtypes, max_slots=1, max_seq=MAX_SEQ,
                           prefill_buckets=(BUCKET,)) as gen:
                (res,) = gen.run([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
            assert res.finish_reason == "length" and len(res.tokens) == n
            return res.tokens

        def burst(n: int) -> list[list[int]]:
            with concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool:
                return list(pool.map(lambda p: run(p, n), prompts))

        burst(4)  # warm-up: grows the thread pools and channels to their concurrent size
        alone = [run(p) for p in prompts]
        baseline = wait_sessions_ended(cluster)
        live: list[int] = []  # sessions held by the workers, polled during the burst
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                live.append(min(int(i.sessions) for i in cluster.info()))
                time.sleep(0.02)

        poller = threading.Thread(target=poll, daemon=True)
        t_burst = time.monotonic()
        poller.start()
        together = burst(TOKENS)
        burst_s = time.monotonic() - t_burst
        done.set()
        poller.join()
        after = wait_sessions_ended(cluster)
        state_bytes = [spec.state_bytes for spec in pipe.specs]

    for i, (a, b) in enumerate(zip(alone, together)):
        assert a == b, f"session {i} (prompt {prompts[i]}): concurrent output differs from solo"
    assert len({tuple(t) for t in alone}) > 1, "degenerate model: every prompt gives the same"
    # The burst really was concurrent: both workers held many sessions at once.
    assert max(live) >= SESSIONS // 2, f"at most {max(live)} sessions were live at once"
    report = (f"{SESSIONS}x{TOKENS} tokens in {burst_s:.1f}s, up to {max(live)} sessions live; "
              f"baseline {baseline}, after "
              f"{after}; KV state per session per stage {state_bytes} bytes; total "
              f"{time.monotonic() - t0:.0f}s")
    for k, (base, end) in enumerate(zip(baseline, after)):
        assert end["sessions"] == 0, f"worker {k} kept sessions: {report}"
        assert end["threads"] <= base["threads"] + THREAD_TOLERANCE, f"worker {k} threads: {report}"
        assert end["fds"] == base["fds"], f"worker {k} fds: {report}"
        assert end["rss"] - base["rss"] <= RSS_TOLERANCE, f"worker {k} RSS grew: {report}"
    print(report)
