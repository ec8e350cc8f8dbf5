"""The HTTP server of ``jaxdist serve``: uvicorn over h11, with bounds on connections, time and
bodies that hold against clients that do not play fair.

uvicorn with its defaults keeps a connection that never sends a request, waits forever for a
declared body, accepts until the process runs out of file descriptors (and then logs a
traceback per failed ``accept``), and answers a request whose body hides another one
(``Content-Length`` with ``Transfer-Encoding``). :func:`server_config` builds its ``Config``
with these bounds (:class:`HTTPLimits`):

* **Connections.** At most ``max_connections``, below the open-file limit
  (:func:`jaxdist.core.openfiles.connection_limit`). A connection over the cap closes the oldest
  one that has no request under way (idle, or still sending its headers), so a flood of idle or
  trickling connections cannot lock a real client out; with none such, the new one gets 503.
  ``accept`` handles at most :data:`BACKLOG` connections per turn of the loop, so the cap holds
  even before they are counted.
* **Time.** A connection with no request under way is closed after ``idle_timeout_s``; the
  request line and headers must be complete ``header_timeout_s`` after their first byte; a body
  must arrive within ``body_timeout_s`` plus one second per ``body_min_rate`` bytes received
  (a slowloris at 1 byte/s is cut at ``body_timeout_s``). A request cut short gets 408.
* **Bodies.** At most ``max_body_bytes``: a larger declared ``Content-Length`` gets 413 at once,
  before a byte of the body is read, and a chunked body is cut with 413 where it passes.
* **Strict HTTP/1.1.** h11, pinned (not httptools). A request with both ``Content-Length`` and
  ``Transfer-Encoding``, or two ``Content-Length`` headers, gets 400 before its body is read,
  as does one that h11 refuses (a malformed chunk, a bad header line).

Every error has OpenAI's body. After an answer the client may still be sending to (one sent
before the body was read, a 400, a 408), the connection is closed, lingering up to
:data:`LINGER_S` so the client reads the answer before a reset.
Refusals and timeouts are logged at most once per cause per :data:`LOG_INTERVAL_S`, with a
count, and so is asyncio's ``accept`` failure (otherwise a traceback per attempt).

Example:
    >>> limits = HTTPLimits(max_body_bytes=default_max_body_bytes(512), max_connections=768)
    >>> config = server_config(app, host="127.0.0.1", port=0, limits=limits)  # doctest: +SKIP
    >>> uvicorn.Server(config).run()                                          # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import re
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxdist.core.openfiles import FD_RESERVE, connection_limit
from jaxdist.serving import protocol as api

__all__ = ["BACKLOG", "BodyLimit", "HTTPLimits", "default_max_body_bytes", "server_config",
           "server_connection_limit"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]

BACKLOG = 128
"""The listening socket's backlog, which is also how many connections asyncio accepts in one
turn of its loop before any of them is counted."""

MAX_HEAD_BYTES = 16 * 1024
"""A request line and its headers (h11's own default); more is a 400."""

LINGER_S = 5.0
"""After an answer sent before the request was read to its end (401, 413, 400, 408), how long
the connection keeps reading (and dropping) what the client still sends, so the client reads
the answer rather than a reset; it closes sooner when the client does."""

LINGER_BYTES = 1 << 20
"""What a lingering connection drops before it is closed anyway."""

LOG_INTERVAL_S = 10.0
"""Refusals and timeouts are logged once per cause in this time, with a count of the others."""

BODY_OVERHEAD_BYTES = 1 << 20
"""What a request body holds beyond its prompt, in the default limit: the messages' structure,
stop strings, an embeddings batch."""

BODY_BYTES_PER_TOKEN = 3 * api.PROMPT_BYTES_PER_TOKEN
"""Body bytes per position of the context, in the default limit: the prompt text's bound per
token (:data:`~jaxdist.serving.protocol.PROMPT_BYTES_PER_TOKEN`), tripled for JSON's ``\\uXXXX``
escapes (a 2-byte character becomes 6). A token id takes at most 12 bytes as JSON."""


def default_max_body_bytes(max_seq: int) -> int:
    """The default body limit of a server whose model holds ``max_seq`` positions: it fits the
    longest prompt the server takes, as text or as token ids, with the JSON around it.

    Example:
        >>> default_max_body_bytes(512)
        1097728
    """
    return BODY_OVERHEAD_BYTES + BODY_BYTES_PER_TOKEN * max(0, max_seq)


def server_connection_limit() -> int:
    """Connections the HTTP server holds at once under the current open-file limit: the
    limit less :data:`~jaxdist.core.openfiles.FD_RESERVE` and twice :data:`BACKLOG` (accepted in
    one turn of the loop, and closed in the next)."""
    return connection_limit(FD_RESERVE + 2 * BACKLOG)


@dataclasses.dataclass(frozen=True)
class HTTPLimits:
    """The bounds of :func:`server_config` (see the module docstring)."""

    max_body_bytes: int  # a request body; a larger one is 413 (--max-body-bytes)
    max_connections: int  # connections held at once (server_connection_limit())
    idle_timeout_s: float = 5.0  # no request under way: fresh, or kept alive after an answer
    header_timeout_s: float = 10.0  # the request line and headers, from their first byte
    body_timeout_s: float = 30.0  # a body's time, plus 1 s per body_min_rate bytes received
    body_min_rate: int = 16 * 1024  # bytes per second a body earns more time with

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_connections", "body_min_rate"):
            if getattr(self, name) < 1:
                raise ValueError(f"HTTPLimits.{name}: expected >= 1, found {getattr(self, name)}")
        for name in ("idle_timeout_s", "header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"HTTPLimits.{name}: expected seconds > 0, found {value}")


# -- bodies --------------------------------------------------------------------------------------

def _json_response(status: int, message: str, *, code: str | None,
                   headers: dict[str, str] | None = None
                   ) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps(api.error_body(message, type=kind, code=code)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return body, head


class BodyLimit:
    """ASGI middleware: a request body larger than ``max_bytes`` is 413 in OpenAI's body.

    A declared ``Content-Length`` over the limit is answered before the application runs, and
    so before the body is read; a chunked body is counted as the application reads it, which
    then gets an :class:`~jaxdist.serving.protocol.APIError` (413) from ``receive``.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> str:
        return (f"the request body is {size}; this server takes at most {self.max_bytes} bytes "
                f"(jaxdist serve --max-body-bytes)")

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            body, headers = _json_response(413, self._too_large(
                f"{int(declared)} bytes (Content-Length)"), code="request_too_large")
            await send({"type": "http.response.start", "status": 413, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise api.APIError(self._too_large(f"over {self.max_bytes} bytes (chunked)"),
                                       status=413, code="request_too_large")
            return message

        await self.app(scope, limited, send)


# -- strict HTTP ---------------------------------------------------------------------------------

_BLANK_LINE = re.compile(rb"\n\r?\n")  # where h11 ends a head


class _StrictConnection(h11.Connection):
    """h11, refusing what it lets through but a proxy in front might read otherwise: a request
    with ``Transfer-Encoding`` and ``Content-Length`` (h11 reads the chunks and ignores the
    length), and two ``Content-Length`` headers (h11 merges equal ones). Each is a way to hide
    one request in another's body. The head is checked in the bytes, before h11 parses it."""

    error: str | None = None  # what was wrong with the last request refused

    def next_event(self) -> Any:
        if self.their_state is h11.IDLE:
            self._check_head(self.trailing_data[0])
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.error = str(exc)[:200]  # h11 quotes the bytes it refused: the client's
            raise

    def _check_head(self, data: bytes) -> None:
        if data[:1] == b"\n" or data[:2] == b"\r\n":
            return  # h11 refuses that itself
        end = _BLANK_LINE.search(data)
        if end is None:
            return  # not all here yet
        names = collections.Counter(
            line.split(b":", 1)[0].rstrip(b"\r").lower()
            for line in data[:end.start()].split(b"\n")[1:] if line[:1] not in (b" ", b"\t"))
        if names[b"content-length"] > 1:
            self.error = (f"the request has {names[b'content-length']} Content-Length headers; "
                          f"expected one")
        elif names[b"content-length"] and names[b"transfer-encoding"]:
            self.error = ("the request has both Content-Length and Transfer-Encoding; expected "
                          "one of them")
        else:
            return
        raise h11.RemoteProtocolError(self.error, error_status_hint=400)


# -- connections ---------------------------------------------------------------------------------

class _LogLimit(logging.Filter):
    """Lets the first record of each cause through, then one per ``interval`` with the count of
    those left out, without a traceback: a client that retries a refused connection in a loop
    cannot flood the log. ``causes`` are the messages' beginnings; other records pass."""

    def __init__(self, causes: tuple[str, ...], interval: float) -> None:
        super().__init__()
        self.causes = causes
        self.interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        cause = next((c for c in self.causes if text.startswith(c)), None)
        if cause is None:
            return True
        now = time.monotonic()
        with self._lock:
            last, left_out = self._last.get(cause, (-math.inf, 0))
            if now - last < self.interval:
                self._last[cause] = (last, left_out + 1)
                return False
            self._last[cause] = (now, 0)
        if record.exc_info:
            exc = record.exc_info[1]
            record.msg, record.args = f"{cause}: {type(exc).__name__}: {exc}", None
        elif record.args:
            record.msg, record.args = record.getMessage(), None
        if left_out:
            record.msg = f"{record.msg} ({left_out} more in the last {self.interval:g} s)"
        record.exc_info = record.exc_text = None
        return True


_ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's words


def _raw_response(status: int, message: str, *, code: str,
                  headers: dict[str, str] | None = None) -> bytes:
    """A whole response, for when no request was parsed (h11 cannot send one then)."""
    body, head = _json_response(status, message, code=code, headers=headers)
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}".encode()] + [k + b": " + v for k, v in head]
    return b"\r\n".join(lines + [b"connection: close", b"", body])


_REASONS = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}


class _Gate:
    """What the connections of one server share: the cap, and the connections with no request
    under way, oldest first."""

    def __init__(self, limits: HTTPLimits) -> None:
        self.limits = limits
        self.idle: collections.OrderedDict[_LimitedH11, None] = collections.OrderedDict()


# Our own refusals, asyncio's accept failure, and uvicorn's line for a request h11 refused.
log.addFilter(_LogLimit(("closed an idle connection", "refused a connection",
                         "timed out a request's headers", "timed out a request's body",
                         "refused a request"), LOG_INTERVAL_S))
_ASYNCIO_LIMIT = _LogLimit((_ACCEPT_FAILED,), LOG_INTERVAL_S)


def _not_uvicorns_bad_request(record: logging.LogRecord) -> bool:
    """uvicorn's line for a request h11 refused says less than ours (which names the fault),
    and comes once per request."""
    return not str(record.msg).startswith("Invalid HTTP request received")


class _LimitedH11(H11Protocol):
    """uvicorn's h11 protocol under a :class:`_Gate`: the connection cap, the timeouts, strict
    heads, OpenAI bodies for the protocol's own errors, and a lingering close."""

    gate: _Gate  # set on the subclass that protocol_class makes

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.conn = _StrictConnection(h11.SERVER, MAX_HEAD_BYTES)
        # head: no request under way (none yet, or kept alive after one); body: reading a
        # request's body; app: the application answers; linger: dropping what comes after an
        # answer sent before the body was read; closed
        self._phase = ""
        self._timer: asyncio.TimerHandle | None = None
        self._since = 0.0  # when the phase (or the head's first byte) began
        self._bytes = 0  # received in the phase

    # -- the cap ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        gate = self.gate
        if len(self.connections) > gate.limits.max_connections:
            victim = next(iter(gate.idle), None)
            if victim is None:
                log.warning("refused a connection: %d connections are open, each with a "
                            "request under way (the limit is %d)", len(self.connections) - 1,
                            gate.limits.max_connections)
                transport.write(_raw_response(
                    503, f"the server holds {gate.limits.max_connections} connections, each "
                         f"with a request under way; retry shortly", code="too_many_connections",
                    headers={"Retry-After": "1"}))
                self._close()
                return
            log.warning("closed an idle connection for a new one: %d connections is the "
                        "limit", gate.limits.max_connections)
            victim._close()
        self._sync()

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter("closed")
        super().connection_lost(exc)

    # -- phases and their clocks -----------------------------------------------------------

    def _enter(self, phase: str) -> None:
        if phase == self._phase:
            return
        self._phase = phase
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.gate.idle.pop(self, None)
        # a body's bytes that came with the head are the body's
        self._since, self._bytes = self.loop.time(), self._bytes if phase == "body" else 0
        limits = self.gate.limits
        if phase in ("head", "linger"):  # no request under way: the first to go for a new one
            self.gate.idle[self] = None
        if phase == "head":
            self._timer = self.loop.call_later(limits.idle_timeout_s, self._head_timeout)
        elif phase == "body":
            self._timer = self.loop.call_later(limits.body_timeout_s, self._body_timeout)
        elif phase == "linger":
            self._timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _sync(self) -> None:
        """Follow h11's state of the client into a phase."""
        if self._phase in ("linger", "closed"):
            return
        if self.transport.is_closing():
            self._enter("closed")
            return
        state = self.conn.their_state
        self._enter("head" if state is h11.IDLE else "body" if state is h11.SEND_BODY
                    else "app")

    def data_received(self, data: bytes) -> None:
        if self._phase == "linger":
            self._bytes += len(data)
            if self._bytes > LINGER_BYTES:
                self.transport.close()
            return
        if self._phase == "head" and self._bytes == 0 and self._timer is not None:
            # the head's first byte: from now on, the header timeout
            self._timer.cancel()
            self._since = self.loop.time()
            self._timer = self.loop.call_later(self.gate.limits.header_timeout_s,
                                               self._head_timeout)
        self._bytes += len(data)
        super().data_received(data)
        self._sync()

    def _head_timeout(self) -> None:
        self._timer = None
        limits = self.gate.limits
        if self._bytes:  # a head begun and not finished
            log.warning("timed out a request's headers: not complete %g s after their first "
                        "byte", limits.header_timeout_s)
            self.transport.write(_raw_response(
                408, f"the request's headers were not complete {limits.header_timeout_s:g} s "
                     f"after their first byte", code="request_timeout"))
            self._linger()
            return
        self._close()

    def _body_timeout(self) -> None:
        self._timer = None
        limits = self.gate.limits
        now = self.loop.time()
        due = self._since + limits.body_timeout_s + self._bytes / limits.body_min_rate
        if self.flow.read_paused:  # the application is not reading: not the client's time
            self._timer = self.loop.call_later(limits.body_timeout_s, self._body_timeout)
            return
        if now < due:
            self._timer = self.loop.call_later(due - now, self._body_timeout)
            return
        log.warning("timed out a request's body: %d bytes of the request %.0f s after its "
                    "headers (a body gets %g s, and 1 s more per %d bytes)", self._bytes,
                    now - self._since, limits.body_timeout_s, limits.body_min_rate)
        answered = self.cycle is not None and self.cycle.response_started
        self._detach_cycle()
        if not answered:
            self.transport.write(_raw_response(
                408, f"the request's body did not arrive in time: {self._bytes} bytes of the "
                     f"request {now - self._since:.0f} s after its headers; a body gets "
                     f"{limits.body_timeout_s:g} s, and 1 s more for each "
                     f"{limits.body_min_rate} bytes", code="request_timeout"))
            self._linger()
            return
        self._close()

    # -- ends ------------------------------------------------------------------------------

    def _detach_cycle(self) -> None:
        """The request under way ends here: the application reads a disconnect, and what it
        still sends is dropped."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()

    def _close(self) -> None:
        self._enter("closed")
        self.transport.close()

    def _linger(self) -> None:
        """Close after an answer the client may still be sending to: send the end of the
        stream, then drop what comes, up to LINGER_S or LINGER_BYTES (closed at once, unread
        bytes would reset the connection, and the client could lose the answer)."""
        self._enter("linger")
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:
            self._close()

    def send_400_response(self, msg: str) -> None:
        """A request h11 or :class:`_StrictConnection` refused: 400 in OpenAI's body, naming
        what was wrong, and the connection closed."""
        reason = getattr(self.conn, "error", None) or msg
        log.warning("refused a request that is not valid HTTP/1.1: %s", reason)
        answered = self.cycle is not None and self.cycle.response_started
        self._detach_cycle()
        if answered:
            self._close()
            return
        self.transport.write(_raw_response(
            400, f"the request is not valid HTTP/1.1: {reason}", code="invalid_http"))
        self._linger()

    def on_response_complete(self) -> None:
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            # answered before the body was read (401, 413): nothing can follow on this
            # connection, and the client may still be sending
            self.server_state.total_requests += 1
            self._linger()
            return
        super().on_response_complete()
        self._sync()

    def shutdown(self) -> None:
        if self._phase == "linger":
            self._close()
            return
        super().shutdown()


def protocol_class(limits: HTTPLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol under ``limits``, for one server (its connections share a cap)."""
    return type("JaxdistH11Protocol", (_LimitedH11,), {"gate": _Gate(limits)})


def server_config(app: ASGIApp, *, host: str, port: int, limits: HTTPLimits,
                  log_level: str = "warning") -> uvicorn.Config:
    """uvicorn's ``Config`` for ``app`` under ``limits`` (see the module docstring): h11,
    pinned; no WebSockets, no lifespan, no access log.

    Args:
        app: the ASGI application (:func:`jaxdist.serving.app.create_app`).
        host, port: where to listen (port 0 picks a free one).
        limits: the bounds.
        log_level: uvicorn's.
    """
    config = uvicorn.Config(BodyLimit(app, limits.max_body_bytes), host=host, port=port,
                            http=protocol_class(limits), ws="none", lifespan="off",
                            log_level=log_level, access_log=False, backlog=BACKLOG,
                            timeout_keep_alive=max(1, round(limits.idle_timeout_s)),
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES)
    # After the Config, which configures uvicorn's loggers (addFilter keeps one of each).
    logging.getLogger("asyncio").addFilter(_ASYNCIO_LIMIT)
    logging.getLogger("uvicorn.error").addFilter(_not_uvicorns_bad_request)
    return config
