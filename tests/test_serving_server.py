"""The HTTP server under attack (issue #33), with raw sockets and httpx against the real app
under the real server (:mod:`jaxdist.serving.server`): strict HTTP/1.1, the body limit, the
timeouts, the connection cap, and work kept off the event loop. The app serves the stand-in LM
of :mod:`serving_utils`; one test runs it in a process of its own, at a hard open-file limit of
1024, and floods it with 1100 connections.

Timeouts are set short here (a fraction of a second) so that a test waits for the server to
act, never for a clock: each test waits on the server's answer or its closing the socket, with
a generous bound only as a guard against a hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import pathlib
import queue
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
import httpx2 as httpx  # noqa: E402  (the openai client's HTTP library)
from serving_utils import (  # noqa: E402
    MAX_SEQ,
    WAIT,
    ByteTokenizer,
    counter_engine,
    counter_state,
    running,
)

from jaxdist.serving.server import BACKLOG, HTTPLimits, default_max_body_bytes  # noqa: E402

LIMITS = HTTPLimits(max_body_bytes=4096, max_connections=64, idle_timeout_s=2.0,
                    header_timeout_s=0.3, body_timeout_s=0.3, body_min_rate=1000)
PATIENT = HTTPLimits(max_body_bytes=4096, max_connections=64)  # timeouts that never fire here
SLOW = HTTPLimits(max_body_bytes=4096, max_connections=8)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with counter_engine(tmp_path_factory.mktemp("counter"), max_slots=4, max_queue=64) \
            as (gated, engine):
        gated.open.set()
        yield engine


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[tuple[str, int]]:
    """Short timeouts, for the tests of them (headers and body 0.3 s, idle 2 s)."""
    with running(counter_state(engine), LIMITS) as address:
        yield address


@pytest.fixture(scope="module")
def patient(engine: Any) -> Iterator[tuple[str, int]]:
    """The default timeouts: for clients that write a request in pieces (httpx), or twice."""
    with running(counter_state(engine), PATIENT) as address:
        yield address


def _completion(**kw: Any) -> bytes:
    return json.dumps({"model": "counter", "prompt": [1, 2, 3], "max_tokens": 3,
                       "temperature": 0, **kw}).encode()


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=WAIT)
    return sock


def _read_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (WAIT guards a hang); a
    reset ends it too (what came before it is checked by the caller)."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _exchange(address: tuple[str, int], raw: bytes) -> bytes:
    with _connect(address) as sock:
        sock.sendall(raw)
        return _read_to_end(sock)


def _one_response(data: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    """The status, headers and OpenAI error of the one response in ``data``; nothing may
    follow it (a second answer would be a request smuggled in the first one's body)."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    assert sep, data
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    size = int(headers["content-length"])
    assert rest[size:] == b"", f"more than one response: {data!r}"
    body = json.loads(rest[:size])
    if status >= 400:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return status, headers, body


def _post_head(path: str = "/v1/completions", *headers: str) -> bytes:
    return ("\r\n".join([f"POST {path} HTTP/1.1", "Host: test", *headers]) + "\r\n\r\n").encode()


# -- strict HTTP ---------------------------------------------------------------------------------


def test_error_content_length_with_transfer_encoding_is_400_and_hides_nothing(
        patient: tuple[str, int]) -> None:
    """Issue #33: the request hidden in the body was answered too, on a connection kept
    open."""
    hidden = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"
    raw = _post_head("/v1/completions", "Content-Length: 5",
                     "Transfer-Encoding: chunked") + b"0\r\n\r\n" + hidden
    status, headers, body = _one_response(_exchange(patient, raw))  # and then closed
    assert status == 400 and headers["connection"] == "close"
    assert body["error"]["message"] == ("the request is not valid HTTP/1.1: the request has both "
                                        "Content-Length and Transfer-Encoding; expected one of "
                                        "them")
    assert body["error"]["code"] == "invalid_http"


def test_error_two_content_lengths_are_400(patient: tuple[str, int]) -> None:
    raw = _post_head("/v1/completions", "Content-Length: 5", "content-length: 5") + b"hello"
    status, _, body = _one_response(_exchange(patient, raw))
    assert status == 400
    assert "the request has 2 Content-Length headers; expected one" in body["error"]["message"]


def test_error_a_malformed_chunk_is_400(patient: tuple[str, int]) -> None:
    raw = _post_head("/v1/completions", "Transfer-Encoding: chunked") + b"zz\r\n{}\r\n0\r\n\r\n"
    status, _, body = _one_response(_exchange(patient, raw))
    assert status == 400 and "illegal chunk header" in body["error"]["message"]


def test_a_valid_request_is_answered_on_a_connection_kept_alive(
        patient: tuple[str, int]) -> None:
    """The reference for the refusals above: the same bytes, framed once, are served, twice
    on one connection."""
    body = _completion()
    raw = _post_head("/v1/completions", f"Content-Length: {len(body)}") + body
    with _connect(patient) as sock:
        for _ in range(2):
            sock.sendall(raw)
            data = b""
            while b"}}" not in data:  # the body ends with the usage object
                data += sock.recv(65536)
            status, _, answer = _one_response(data)
            assert status == 200 and answer["usage"]["completion_tokens"] == 3


# -- bodies --------------------------------------------------------------------------------------


def test_error_a_declared_huge_body_is_413_before_it_is_read(patient: tuple[str, int]) -> None:
    """Issue #33: ``Content-Length: 1000000000000`` was waited for forever. No byte of the
    body is sent: the answer comes on the headers alone."""
    raw = _post_head("/v1/completions", "Content-Length: 1000000000000")
    status, _, body = _one_response(_exchange(patient, raw))
    assert status == 413
    assert body["error"] == {
        "message": "the request body is 1000000000000 bytes (Content-Length); this server takes "
                   "at most 4096 bytes (jaxdist serve --max-body-bytes)",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}


def test_error_a_chunked_body_past_the_limit_is_413(patient: tuple[str, int]) -> None:
    chunk = b"x" * 1000
    chunks = b"".join(b"3e8\r\n" + chunk + b"\r\n" for _ in range(5)) + b"0\r\n\r\n"
    raw = _post_head("/v1/completions", "Transfer-Encoding: chunked") + chunks
    status, _, body = _one_response(_exchange(patient, raw))
    assert status == 413 and "over 4096 bytes (chunked)" in body["error"]["message"]


def test_a_body_at_the_limit_is_read(patient: tuple[str, int]) -> None:
    body = _completion()
    body += b" " * (4096 - len(body))  # JSON allows the padding
    with httpx.Client(base_url=f"http://{patient[0]}:{patient[1]}", timeout=WAIT) as client:
        r = client.post("/v1/completions", content=body)
        assert r.status_code == 200, r.text
        r = client.post("/v1/completions", content=body + b" ")
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_the_default_body_limit_fits_the_longest_prompt() -> None:
    text = "\u00e9" * (MAX_SEQ * 32 // 2)  # the longest text prompt taken: 2 bytes a character
    ids = [10**6] * MAX_SEQ
    for prompt in (text, ids):
        body = json.dumps({"model": "counter", "prompt": prompt, "max_tokens": 1,
                           "stop": ["x" * 128] * 8})  # ensure_ascii: \u00e9, 6 bytes each
        assert len(body) <= default_max_body_bytes(MAX_SEQ)
    assert default_max_body_bytes(131072) == (1 << 20) + 96 * 131072  # 13 MiB


# -- timeouts ------------------------------------------------------------------------------------


def test_a_connection_that_sends_nothing_is_closed(server: tuple[str, int]) -> None:
    """Issue #33: 100 silent connections were still open after 45 s."""
    with _connect(server) as sock:
        assert _read_to_end(sock) == b""  # closed without a word


def _trickle(address: tuple[str, int], head: bytes, drip: bytes) -> bytes:
    """Send ``head``, then ``drip`` a byte at a time, each 20 ms after the last, until the
    server closes the connection; what it sent."""
    with _connect(address) as sock:
        sock.sendall(head)
        closed = threading.Event()
        out: list[bytes] = []

        def read() -> None:
            out.append(_read_to_end(sock))
            closed.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        for byte in drip:
            if closed.wait(0.02):  # the pace of the drip; the server ends it
                break
            try:
                sock.send(bytes([byte]))
            except OSError:  # closed under our feet
                break
        assert closed.wait(WAIT), "the server kept a trickling connection open"
        return out[0]


def test_error_headers_trickled_past_their_timeout_are_408(server: tuple[str, int]) -> None:
    """Issue #33: connections sending 1 byte a second were still open after 45 s. Each byte
    here comes well within any gap a server might allow; the headers never end."""
    data = _trickle(server, b"POST /v1/completions HTTP/1.1\r\n", b"X-Slow: " + b"a" * 10000)
    status, _, body = _one_response(data)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert body["error"]["message"] == ("the request's headers were not complete 0.3 s after "
                                        "their first byte")


def test_error_a_body_trickled_past_its_timeout_is_408(server: tuple[str, int],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    head = _post_head("/v1/completions", "Content-Length: 3000")
    data = _trickle(server, head, b" " * 3000)
    status, _, body = _one_response(data)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert body["error"]["message"].startswith("the request's body did not arrive in time")
    # the application saw a client gone, not a failure: no traceback
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


# -- the connection cap --------------------------------------------------------------------------


def test_a_connection_over_the_cap_closes_the_oldest_idle_one(engine: Any) -> None:
    with running(counter_state(engine), SLOW) as address:
        idle = [_connect(address) for _ in range(SLOW.max_connections)]
        idle[1].sendall(b"POST /v1/completions HTTP/1.1\r\n")  # headers begun: still idle
        try:
            with httpx.Client(base_url=f"http://{address[0]}:{address[1]}",
                              timeout=WAIT) as client:
                r = client.post("/v1/completions", content=_completion())
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert _read_to_end(idle[0]) == b""  # the oldest went for it
        finally:
            for sock in idle:
                sock.close()


def test_error_over_the_cap_with_every_connection_busy_is_503(engine: Any) -> None:
    """Connections in the middle of a request are not closed for a new one: it gets 503. Each
    busy connection has sent its headers and waits to send its body; ``Expect: 100-continue``
    tells when the server reads it."""
    with running(counter_state(engine), SLOW) as address:
        busy = [_connect(address) for _ in range(SLOW.max_connections)]
        try:
            for sock in busy:
                sock.sendall(_post_head("/v1/completions", "Content-Length: 100",
                                        "Expect: 100-continue"))
                assert sock.recv(100).startswith(b"HTTP/1.1 100 ")
            with _connect(address) as sock:
                status, headers, body = _one_response(_read_to_end(sock))
            assert status == 503 and headers["retry-after"] == "1"
            assert body["error"]["code"] == "too_many_connections"
            assert body["error"]["type"] == "server_error"
        finally:
            for sock in busy:
                sock.close()


def test_asyncios_accept_failures_are_logged_once_without_a_traceback(
        caplog: pytest.LogCaptureFixture, engine: Any) -> None:
    """Issue #33: 108,000 tracebacks (45 MB) in 25 s, one per failed ``accept``. The loop's
    own exception handler reports the failure here, as it does when ``accept`` fails."""
    with running(counter_state(engine), SLOW):  # installs the log's bounds
        pass
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for _ in range(1000):
                loop.call_exception_handler({
                    "message": "socket.accept() out of system resource",
                    "exception": OSError(24, "Too many open files")})
    finally:
        loop.close()
    lines = [r for r in caplog.records if r.name == "asyncio"]
    assert len(lines) <= 1, [r.getMessage() for r in lines]
    for record in lines:
        assert record.exc_info is None and "Too many open files" in record.getMessage()


# -- big inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"model": "counter", "prompt": "Hi there", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "counter", "max_tokens": 2,
                              "messages": [{"role": "user", "content": "Hi there"}]}),
])
def test_tokenizing_is_off_the_event_loop(engine: Any, route: str, body: dict[str, Any]) -> None:
    """Issue #33: a 10 MB prompt blocked the loop for 16.6 s. Here the tokenizer (the chat
    template first, for a chat) holds until the test lets it go; ``/health`` is answered
    meanwhile."""
    gate = threading.Event()
    tokenizer = ByteTokenizer(gate)
    with running(counter_state(engine, tokenizer), SLOW) as (host, port), \
            httpx.Client(base_url=f"http://{host}:{port}", timeout=WAIT) as client, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(client.post, route, json=body)
        try:
            assert tokenizer.entered.wait(WAIT)
            with httpx.Client(base_url=f"http://{host}:{port}", timeout=WAIT) as other:
                r = other.get("/health")
            assert r.status_code == 200 and r.json() == {"status": "ok"}
            assert not held.done()
        finally:
            gate.set()
        r = held.result(WAIT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# -- a flood, at an open-file limit of 1024 ------------------------------------------------------

NOFILE = 1024
KEY = "flood-key-123"


def _raise_own_fd_limit(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"the test needs {want} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_flood_of_1100_connections_at_1024_open_files_leaves_room_for_a_client() -> None:
    """Issue #33: 1100 idle connections at a soft limit of 1024 made chats and /health time
    out, with a traceback per failed ``accept``. The server runs in its own process with a
    hard limit of 1024, so it cannot raise it, and with idle and header timeouts of 10
    minutes, so only the connection cap can make room. The flood is half silent connections
    and half with headers begun, the shapes of an idle flood and a slowloris. (Without the cap,
    ``--max-connections 5000``, the client times out and asyncio fails ``accept`` some 10,000
    times in 10 s, logged in two lines.)"""
    _raise_own_fd_limit(1100 + 256)

    here = pathlib.Path(__file__).parent
    limited = (f"import resource, runpy, sys; "  # `ulimit -n 1024` with the hard limit too
               f"resource.setrlimit(resource.RLIMIT_NOFILE, ({NOFILE}, {NOFILE})); "
               f"sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    path = os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-c", limited, str(here / "serving_utils.py"),
                             "--api-key", KEY, "--head-timeout", "600"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": path})
    lines: queue.Queue[str | None] = queue.Queue()
    log: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    flood: list[socket.socket] = []
    try:
        port = 0
        while not port:
            line = lines.get(timeout=120)
            assert line is not None, "the server exited:\n" + "".join(log)
            if m := re.search(r"listening on http://127\.0\.0\.1:([0-9]+) \(at most ([0-9]+)",
                              line):
                port, cap = int(m.group(1)), int(m.group(2))
        assert cap == NOFILE - 256 - 2 * BACKLOG  # the limit less the reserve
        for i in range(1100):
            sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
            if i % 2:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            flood.append(sock)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=WAIT,
                          headers={"Authorization": f"Bearer {KEY}"}) as client:
            r = client.post("/v1/completions", content=_completion())
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
            assert client.get("/health").json() == {"status": "ok"}
        assert _fds(proc.pid) < NOFILE
    finally:
        for sock in flood:
            sock.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=WAIT)
    text = "".join(log)
    assert "out of system resource" not in text, text[-2000:]
    assert len(log) < 20 and "Traceback" not in text, text[-2000:]
