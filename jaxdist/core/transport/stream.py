"""The data connection between workers: ``Frame`` messages, each after its length, on a TCP stream.

A second transport between workers beside gRPC's ``Push`` stream (docs/design.md, "The data
path"). It carries the same messages a ``Push`` stream carries: serialized ``Frame`` messages
written by :func:`frames.split_frame` and read by :func:`frames.parse_frame` and a
:class:`frames.FrameAssembler`, tensors in the one codec. What it leaves out is gRPC's
per-message machinery (HTTP/2 framing, and several thread wake-ups per message on each side).
It runs on asyncio streams, over plain TCP or over TLS with the worker's own files.

Wire format, version :data:`VERSION` (integers little-endian)::

    server -> client   hello     MAGIC | version u8 | flags u8 | max_message u32 | nonce (32)
    client -> server   answer    MAGIC | version u8 | proof (32) [| mode u8]
    server -> client   verdict   a status record; empty: accepted

then, in the connection's mode:

    frames (mode 0)    client -> server   length u32 | one serialized Frame   (repeated)
                       server -> client   goodbye: at most one status record, just before
                                          it closes
    events (mode 1)    client -> server   length u32 | one SubscribeRequest   (once)
                       server -> client   length u32 | one serialized Event   (repeated)
                                          then at most a goodbye: length 0, a status record

An answer of version 1 has no mode byte and asks for frames (what a worker's
``TcpRoute`` sends); an answer of version 2 carries the mode. A server that takes version 2
says so in its hello's flags (:data:`FLAG_MODES`): an older one is never sent an answer it
cannot read. The events mode is a coordinator's subscription (``Subscribe`` without gRPC).

A status record is ``length u32 | UTF-8 text``, the text ``CODE\\nErrorClass\\nmessage``: a
status code name as on gRPC, read back into an error class by ``transport/status.py``.
``proof`` is ``HMAC-SHA256(token, nonce + CONTEXT)`` when the hello's flags ask for a token
(:data:`FLAG_TOKEN`), else 32 zero bytes: the token never crosses the wire, and a recorded proof
is worth nothing for another nonce.
``max_message`` is the largest message the server reads; a sender checks its messages against it
before writing, and the server refuses a longer declared length before reading it.

Errors: a peer that breaks the protocol raises :class:`CodecError`; a length over the limit
:class:`LimitError`; a refused proof :class:`AuthError`; a closed or failed connection
:class:`TransportError`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import secrets
import struct
from collections.abc import Callable

import grpc

from jaxdist.core.errors import AuthError, CodecError, JaxdistError, LimitError, TransportError
from jaxdist.core.transport import status

__all__ = ["CONTEXT", "FLAG_MODES", "FLAG_TOKEN", "MAGIC", "MODE_EVENTS", "MODE_FRAMES",
           "VERSION", "Hello", "IdleWatch", "client_handshake", "proof", "read_message",
           "read_status", "server_handshake", "write_goodbye", "write_message", "write_status"]

MAGIC = b"JXDD"
VERSION = 1
CONTEXT = b"jaxdist data connection, protocol version 1: client proof"
"""What the client's proof is bound to besides the nonce: this protocol and its version, so a
proof made for anything else is no proof here."""
FLAG_TOKEN = 1  # the server requires a proof of the token
FLAG_MODES = 2  # the server reads answers of version 2 (with a mode byte)
MODE_FRAMES = 0  # the client sends frames
MODE_EVENTS = 1  # the client subscribes to a pipeline's events
MODES = {MODE_FRAMES: "frames", MODE_EVENTS: "events"}
NONCE_BYTES = 32
MAX_STATUS_BYTES = 4096  # a verdict's or goodbye's text is clipped to this

_LEN = struct.Struct("<I")
_HELLO = struct.Struct(f"<4sBBI{NONCE_BYTES}s")
_ANSWER = struct.Struct(f"<4sB{hashlib.sha256().digest_size}s")
_NO_PROOF = bytes(_ANSWER.size - 5)


def proof(key: bytes, nonce: bytes) -> bytes:
    """The client's answer to ``nonce``: ``HMAC-SHA256(key, nonce + CONTEXT)``."""
    return hmac.new(key, nonce + CONTEXT, hashlib.sha256).digest()


# ---------------------------------------------------------------------------------------------
# Records


def write_message(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Queue one message (its length, then its bytes) on ``writer``; drain it after."""
    if len(data) <= 1 << 16:  # one segment for a small message
        writer.write(_LEN.pack(len(data)) + data)
    else:  # no copy of a large message to prepend 4 bytes
        writer.write(_LEN.pack(len(data)))
        writer.write(data)


READ_STEP_BYTES = 1 << 20  # a long message is read in parts of this size, each timed


class IdleWatch:
    """The idle bound of one connection's reads, kept on one timer for the connection.

    ``asyncio.timeout`` around each read arms and cancels a timer per message: measured, a
    sixth of the data port's Python for a 4 KB frame (bench/NOTES.md). A watch keeps one
    deadline that each read sets; its single timer fires at a deadline and re-arms itself to
    the current one, so a connection busy with small messages makes a timer about once per
    ``seconds``. When a read's deadline passes, the task reading is cancelled, and the read
    raises ``TimeoutError``, as under ``asyncio.timeout``. Used on the loop, by one task.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("an IdleWatch is made inside the task that reads")
        self._task = task
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    async def read(self, reader: asyncio.StreamReader, n: int) -> bytes:
        """``reader.readexactly(n)``, within :attr:`seconds`."""
        self._deadline = deadline = self._loop.time() + self.seconds
        if self._timer is None:
            self._timer = self._loop.call_at(deadline, self._check)
        try:
            return await reader.readexactly(n)
        except asyncio.CancelledError:
            if self._expired:
                self._expired = False
                if self._task.uncancel() == 0:  # the watch alone cancelled it
                    raise TimeoutError(f"no data for {self.seconds:g} s") from None
            raise
        finally:
            self._deadline = None

    def _check(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None:  # between reads: the next read arms the timer again
            return
        if self._loop.time() >= deadline:
            self._expired = True
            self._task.cancel()
        else:
            self._timer = self._loop.call_at(deadline, self._check)

    def close(self) -> None:
        """Stop the timer (the connection ended)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def read_message(reader: asyncio.StreamReader, max_bytes: int, limit: str, *,
                       wait: float | None = None, watch: IdleWatch | None = None,
                       reserve: Callable[[int], None] | None = None) -> bytes | None:
    """The next message; ``None`` when the peer closed between messages.

    Args:
        max_bytes: the longest message accepted; a longer declared length is refused before a
            byte of it is read.
        limit: what sets ``max_bytes`` (a flag and its value), for the refusal's message.
        wait: the longest wait for a message's length (its first 4 bytes); ``None``: no bound.
        watch: once the length is read, the bound on each wait for more of the message (each
            part of :data:`READ_STEP_BYTES`), the connection's one timer; ``None``: no bound.
        reserve: called with a message's length before its bytes are read (it may refuse them
            by raising).

    Raises:
        LimitError: the declared length is over ``max_bytes``.
        TimeoutError: ``wait`` or the ``watch`` passed.
        TransportError: the connection closed or failed inside a message.
    """
    try:
        if wait is None:  # between frames: no timer to arm per message
            head = await reader.readexactly(_LEN.size)
        else:
            async with asyncio.timeout(wait):
                head = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None  # closed between messages
        raise TransportError("the data connection closed inside a message's length") from None
    (n,) = _LEN.unpack(head)
    if n > max_bytes:
        raise LimitError(f"a message on the data connection declares {n} bytes, over this "
                         f"worker's limit of {max_bytes} bytes per message ({limit})")
    if reserve is not None:
        reserve(n)
    got = 0
    try:
        read = reader.readexactly if watch is None else functools.partial(watch.read, reader)
        if n <= READ_STEP_BYTES:
            return await read(n)
        parts = []
        while got < n:
            parts.append(await read(min(READ_STEP_BYTES, n - got)))
            got += len(parts[-1])
        return b"".join(parts)
    except asyncio.IncompleteReadError as exc:
        raise TransportError(f"the data connection closed after {got + len(exc.partial)} of a "
                             f"message's {n} bytes") from None


def write_goodbye(writer: asyncio.StreamWriter, error: JaxdistError) -> None:
    """Queue the goodbye of an events connection: an empty message, then the status record."""
    writer.write(_LEN.pack(0))
    write_status(writer, error)


def write_status(writer: asyncio.StreamWriter, error: JaxdistError | None) -> None:
    """Queue a status record: accepted (``None``), or the error's status code and message."""
    text = b"" if error is None else (f"{error.code}\n{type(error).__name__}\n{error}"
                                      .encode("utf-8", "replace"))
    writer.write(_LEN.pack(min(len(text), MAX_STATUS_BYTES)) + text[:MAX_STATUS_BYTES])


async def read_status(reader: asyncio.StreamReader, peer: str) -> JaxdistError | None:
    """Read a status record: ``None`` for accepted, else the error it names, of the class its
    status code maps to (``UNAUTHENTICATED``: :class:`AuthError`, ...).

    Raises:
        CodecError: a record that is too long or not a status.
        TransportError: the connection closed first.
    """
    try:
        (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        if n > MAX_STATUS_BYTES:
            raise CodecError(f"data port {peer} sent a status of {n} bytes; a status is at most "
                             f"{MAX_STATUS_BYTES} bytes (is it a jaxdist worker's data port?)")
        text = (await reader.readexactly(n)).decode("utf-8", "replace")
    except asyncio.IncompleteReadError:
        raise TransportError(f"data port {peer} closed the connection") from None
    if not text:
        return None
    code, _, rest = text.partition("\n")
    remote_type, _, message = rest.partition("\n")
    known = code in grpc.StatusCode.__members__
    cls = status.error_class_for(grpc.StatusCode[code], remote_type) if known else JaxdistError
    return cls(f"data port {peer}: {message}", code=code if known else None)


# ---------------------------------------------------------------------------------------------
# The handshake


class Hello:
    """What the server's hello said: whether it wants a proof, and its message limit."""

    __slots__ = ("max_message", "needs_token")

    def __init__(self, needs_token: bool, max_message: int) -> None:
        self.needs_token = needs_token
        self.max_message = max_message


async def server_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                           key: bytes | None, max_message: int) -> int:
    """The server's half: send the hello, check the answer, send the verdict. Returns the
    connection's mode (:data:`MODE_FRAMES` or :data:`MODE_EVENTS`).

    Bound it in time (``asyncio.timeout``): a client that never answers holds the connection
    until then. A refusal is sent to the client before the error is raised.

    Args:
        key: the token the client must prove it holds; ``None``: no proof is asked for.
        max_message: the longest message this server reads (sent in the hello).

    Raises:
        AuthError: no proof or a wrong one, compared in constant time.
        CodecError: the client does not speak this protocol or version.
        TransportError: the client closed the connection first.
    """
    nonce = secrets.token_bytes(NONCE_BYTES)
    writer.write(_HELLO.pack(MAGIC, VERSION, FLAG_MODES | (FLAG_TOKEN if key is not None else 0),
                             max_message, nonce))
    mode = MODE_FRAMES
    try:
        magic, version, given = _ANSWER.unpack(await reader.readexactly(_ANSWER.size))
        if magic == MAGIC and version == 2:
            mode = (await reader.readexactly(1))[0]
    except asyncio.IncompleteReadError:
        raise TransportError("the client closed the data connection during the handshake"
                             ) from None
    error: JaxdistError | None = None
    if magic != MAGIC:
        error = CodecError("not a jaxdist data connection: the answer does not begin with "
                           f"{MAGIC!r}")
    elif version not in (VERSION, 2):
        error = CodecError(f"the client speaks data protocol version {version}; this worker "
                           f"speaks versions {VERSION} and 2")
    elif mode not in MODES:
        error = CodecError(f"the client asks for mode {mode} of the data protocol; this worker "
                           f"knows modes {sorted(MODES)} ({', '.join(MODES.values())})")
    elif key is not None:
        if given == _NO_PROOF:
            error = AuthError("missing credentials: this worker's data port requires a proof "
                              "of its token (give the sending worker the same --token-file)")
        elif not hmac.compare_digest(given, proof(key, nonce)):
            error = AuthError("wrong credentials: the proof does not match this worker's "
                              "--token-file")
    write_status(writer, error)
    await writer.drain()
    if error is not None:
        raise error
    return mode


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                           key: bytes | None, peer: str, mode: int = MODE_FRAMES) -> Hello:
    """The client's half: read the hello, answer it (with a proof when one is asked for and
    ``key`` is given) for a connection of ``mode``, read the verdict.

    Raises:
        AuthError: the server refused the proof, or asked for one and ``key`` is ``None``.
        CodecError: the server does not speak this protocol or version, or not ``mode`` (an
            older worker has only frames).
        TransportError: the connection closed first.
    """
    try:
        magic, version, flags, max_message, nonce = _HELLO.unpack(
            await reader.readexactly(_HELLO.size))
    except asyncio.IncompleteReadError:
        raise TransportError(f"data port {peer} closed the connection before its hello"
                             ) from None
    if magic != MAGIC:
        raise CodecError(f"{peer} is not a jaxdist data port: its hello does not begin with "
                         f"{MAGIC!r}")
    if version != VERSION:
        raise CodecError(f"data port {peer} speaks protocol version {version}; this worker "
                         f"speaks version {VERSION}")
    needs_token = bool(flags & FLAG_TOKEN)
    answer = proof(key, nonce) if needs_token and key is not None else _NO_PROOF
    if mode == MODE_FRAMES:
        writer.write(_ANSWER.pack(MAGIC, VERSION, answer))
    elif not flags & FLAG_MODES:
        raise CodecError(f"data port {peer} takes only frames (a jaxdist worker older than "
                         f"the {MODES.get(mode, mode)} mode of its data protocol)")
    else:
        writer.write(_ANSWER.pack(MAGIC, 2, answer) + bytes((mode,)))
    await writer.drain()
    refused = await read_status(reader, peer)
    if refused is not None:
        raise refused
    return Hello(needs_token, max_message)
