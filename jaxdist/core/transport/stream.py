"""The data connection between workers: ``Frame`` messages, each after its length, on a TCP stream.

A second transport between workers beside gRPC's ``Push`` stream (docs/design.md, "The data
path"). It carries the same messages a ``Push`` stream carries: serialized ``Frame`` messages
written by :func:`frames.split_frame` and read by :func:`frames.parse_frame` and a
:class:`frames.FrameAssembler`, tensors in the one codec. What it leaves out is gRPC's
per-message machinery (HTTP/2 framing, and several thread wake-ups per message on each side).
It runs on asyncio streams, over plain TCP or over TLS with the worker's own files.

Wire format, version :data:`VERSION` (integers little-endian)::

    server -> client   hello     MAGIC | version u8 | flags u8 | max_message u32 | nonce (32)
    client -> server   answer    MAGIC | 1 | proof (32)                           (frames)
                  or answer      MAGIC | 2 | proof (32) | mode u8
                  or hop answer  MAGIC | 3 | hop proof (32) | length u16 | pipeline id (UTF-8)
    server -> client   verdict   a status record; empty: accepted

then, in the connection's mode:

    frames (mode 0)    client -> server   length u32 | one serialized Frame   (repeated)
                       server -> client   goodbye: at most one status record, just before
                                          it closes
    events (mode 1)    client -> server   length u32 | one SubscribeRequest   (once)
                       server -> client   length u32 | one serialized Event   (repeated)
                                          then at most a goodbye: length 0, a status record

A coordinator's answer of version 1 has no mode byte and asks for frames (what it sends to
stage 0); its answer of version 2 carries the mode (the events mode is its subscription,
``Subscribe`` without gRPC). A server reads both.

A worker's stage sending to the next stage's worker gives a hop answer (version
:data:`HOP_VERSION`): it names its pipeline and proves the pipeline's hop credential
(``transport/hop.py``), never the token. Such a connection is in the frames mode and carries
frames of that pipeline only.

A status record is ``length u32 | UTF-8 text``, the text ``CODE\\nErrorClass\\nmessage``: a
status code name as on gRPC, read back into an error class by ``transport/status.py``.
``proof`` is ``HMAC-SHA256(token, nonce + CONTEXT)`` when the hello's flags ask for a token
(:data:`FLAG_TOKEN`), else 32 zero bytes: the token never crosses the wire, and a recorded proof
is worth nothing for another nonce. ``hop proof`` is ``HMAC-SHA256(credential, nonce +
HOP_CONTEXT)``, ``credential`` the named pipeline's hop credential, when the hello asks for a
token, else 32 zero bytes: a relay learns nothing that opens another pipeline or any call.
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
import mmap
import secrets
import struct
from collections.abc import Callable

import grpc

from jaxdist.core.errors import AuthError, CodecError, JaxdistError, LimitError, TransportError
from jaxdist.core.transport import hop, status

__all__ = ["CONTEXT", "FLAG_TOKEN", "HOP_CONTEXT", "HOP_VERSION", "MAGIC", "MODES_VERSION",
           "MODE_EVENTS", "MODE_FRAMES", "VERSION", "Hello", "IdleWatch",
           "client_handshake", "hop_proof", "proof", "read_message", "read_status",
           "server_handshake", "write_goodbye", "write_message", "write_status"]

MAGIC = b"JXDD"
VERSION = 1
CONTEXT = b"jaxdist data connection, protocol version 1: client proof"
"""What the client's proof is bound to besides the nonce: this protocol and its version, so a
proof made for anything else is no proof here."""
FLAG_TOKEN = 1  # the server requires a proof of the token (the hello's only flag)
MODES_VERSION = 2  # a coordinator's answer with a mode byte
HOP_VERSION = 3  # a hop answer: a pipeline's hop credential
HOP_CONTEXT = b"jaxdist data connection, protocol version 3: hop proof"
"""What a hop proof is bound to besides the nonce (a token proof is never a hop proof)."""
MODE_FRAMES = 0  # the client sends frames
MODE_EVENTS = 1  # the client subscribes to a pipeline's events
MODES = {MODE_FRAMES: "frames", MODE_EVENTS: "events"}
NONCE_BYTES = 32
MAX_STATUS_BYTES = 4096  # a verdict's or goodbye's text is clipped to this

_LEN = struct.Struct("<I")
_HELLO = struct.Struct(f"<4sBBI{NONCE_BYTES}s")
_ANSWER = struct.Struct(f"<4sB{hashlib.sha256().digest_size}s")
_NO_PROOF = bytes(_ANSWER.size - 5)
_HOP_LENGTH = struct.Struct("<H")


def proof(key: bytes, nonce: bytes) -> bytes:
    """The client's answer to ``nonce``: ``HMAC-SHA256(key, nonce + CONTEXT)``."""
    return hmac.new(key, nonce + CONTEXT, hashlib.sha256).digest()


def hop_proof(credential: bytes, nonce: bytes) -> bytes:
    """A hop's answer to ``nonce``: ``HMAC-SHA256(credential, nonce + HOP_CONTEXT)``."""
    return hmac.new(credential, nonce + HOP_CONTEXT, hashlib.sha256).digest()


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
                       reserve: Callable[[int, int], None] | None = None
                       ) -> bytes | memoryview | None:
    """The next message; ``None`` when the peer closed between messages.

    A message longer than :data:`READ_STEP_BYTES` is read in parts of that size, each copied
    into one buffer of the message's length (an anonymous map) as it arrives, and returned as a
    (writable) ``memoryview`` of it: the parts are never joined into a second copy, and the
    buffer's pages cost memory only once written, not at the declared length.

    Args:
        max_bytes: the longest message accepted; a longer declared length is refused before a
            byte of it is read.
        limit: what sets ``max_bytes`` (a flag and its value), for the refusal's message.
        wait: the longest wait for a message's length (its first 4 bytes); ``None``: no bound.
        watch: once the length is read, the bound on each wait for more of the message (each
            part of :data:`READ_STEP_BYTES`), the connection's one timer; ``None``: no bound.
        reserve: ``reserve(part, length)`` is called before each part of a message is read,
            with the part's size (at most :data:`READ_STEP_BYTES`) and the message's declared
            length: what the message holds grows with what arrives. It may refuse the part by
            raising.

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
    got = 0
    try:
        read = reader.readexactly if watch is None else functools.partial(watch.read, reader)
        if n <= READ_STEP_BYTES:
            if reserve is not None:
                reserve(n, n)
            return await read(n)
        # private and anonymous: a page costs memory once written, and all of it goes back
        # to the OS when the message is freed
        data = memoryview(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE))
        while got < n:
            step = min(READ_STEP_BYTES, n - got)
            if reserve is not None:
                reserve(step, n)
            data[got:got + step] = await read(step)
            got += step
        return data
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
                           key: bytes | None, max_message: int,
                           hop_keys: hop.HopKeys | None = None) -> tuple[int, str | None]:
    """The server's half: send the hello, check the answer, send the verdict. Returns the
    connection's mode (:data:`MODE_FRAMES` or :data:`MODE_EVENTS`), and the pipeline a hop
    answer named (``None`` for any other answer): the connection's frames must all be of it.

    Bound it in time (``asyncio.timeout``): a client that never answers holds the connection
    until then. A refusal is sent to the client before the error is raised.

    Args:
        key: the token the client must prove it holds; ``None``: no proof is asked for.
        max_message: the longest message this server reads (sent in the hello).
        hop_keys: the keys of the pipelines loaded here, to check a hop answer's proof
            (``transport/hop.py``); ``None``: hop answers are not taken.

    Raises:
        AuthError: no proof or a wrong one, compared in constant time; a hop answer for a
            pipeline not loaded here.
        CodecError: the client does not speak this protocol or version.
        TransportError: the client closed the connection first.
    """
    nonce = secrets.token_bytes(NONCE_BYTES)
    flags = FLAG_TOKEN if key is not None else 0
    writer.write(_HELLO.pack(MAGIC, VERSION, flags, max_message, nonce))
    mode = MODE_FRAMES
    name = b""
    try:
        magic, version, given = _ANSWER.unpack(await reader.readexactly(_ANSWER.size))
        if magic == MAGIC and version == MODES_VERSION:
            mode = (await reader.readexactly(1))[0]
        elif magic == MAGIC and version == HOP_VERSION and hop_keys is not None:
            (n,) = _HOP_LENGTH.unpack(await reader.readexactly(_HOP_LENGTH.size))
            name = await reader.readexactly(n)
    except asyncio.IncompleteReadError:
        raise TransportError("the client closed the data connection during the handshake"
                             ) from None
    versions = ((VERSION, MODES_VERSION, HOP_VERSION) if hop_keys is not None
                else (VERSION, MODES_VERSION))
    pipeline: str | None = None
    error: JaxdistError | None = None
    if magic != MAGIC:
        error = CodecError("not a jaxdist data connection: the answer does not begin with "
                           f"{MAGIC!r}")
    elif version not in versions:
        error = CodecError(f"the client speaks data protocol version {version}; this worker "
                           f"speaks versions {', '.join(map(str, versions))}")
    elif version == HOP_VERSION and hop_keys is not None:
        try:
            pipeline = name.decode("utf-8")
        except UnicodeDecodeError:
            error = CodecError("the hop answer's pipeline id is not UTF-8")
        else:
            if key is not None:
                error = _hop_refusal(pipeline, given, nonce, key, hop_keys)
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
    return mode, pipeline


def _hop_refusal(pipeline: str, given: bytes, nonce: bytes, token: bytes,
                 hop_keys: hop.HopKeys) -> AuthError | None:
    """Why a hop answer for ``pipeline`` with proof ``given`` is refused, if it is."""
    shown = repr(pipeline[:64])
    if given == _NO_PROOF:
        return AuthError(f"missing credentials: this worker's data port requires a proof of "
                         f"the hop credential of pipeline {shown} (made from the pipeline's "
                         f"key, or for a pipeline without one from the workers' shared "
                         f"--token-file)")
    key = hop_keys(pipeline)
    if key is None:
        return AuthError(f"wrong credentials: a hop proof for pipeline {shown}, which is not "
                         f"loaded on this worker")
    credential = hop.credential(pipeline, key, token)
    if credential is None or not hmac.compare_digest(given, hop_proof(credential, nonce)):
        return AuthError(f"wrong credentials: the hop proof for pipeline {shown} does not "
                         f"match that pipeline's credential (made from its key, or for a "
                         f"pipeline without one from the workers' shared --token-file)")
    return None


def _token_answer(key: bytes | None, nonce: bytes, needs_token: bool) -> bytes:
    return proof(key, nonce) if needs_token and key is not None else _NO_PROOF


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                           key: bytes | None, peer: str, mode: int = MODE_FRAMES,
                           hop_pipeline: str | None = None,
                           hop_credential: bytes | None = None) -> Hello:
    """The client's half: read the hello, answer it (with a proof when one is asked for and
    ``key`` is given) for a connection of ``mode``, read the verdict.

    With ``hop_pipeline`` (a worker sending a stage's frames to the next one) it gives a hop
    answer instead: it names the pipeline and proves ``hop_credential`` (``transport/hop.py``);
    ``key`` is not used, and the connection carries that pipeline's frames only.

    Raises:
        AuthError: the server refused the proof, or asked for one and ``key`` is ``None``.
        CodecError: the server does not speak this protocol or version.
        TransportError: the connection closed first.
    """
    if hop_pipeline is not None and mode != MODE_FRAMES:
        raise ValueError("a hop connection carries frames only")
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
    if hop_pipeline is not None:
        name = hop_pipeline.encode("utf-8")
        if len(name) > 0xFFFF:
            raise CodecError(f"pipeline id of {len(name)} bytes is too long for a hop answer")
        answer = (hop_proof(hop_credential, nonce) if needs_token and hop_credential is not None
                  else _NO_PROOF)
        writer.write(_ANSWER.pack(MAGIC, HOP_VERSION, answer) + _HOP_LENGTH.pack(len(name))
                     + name)
    elif mode == MODE_FRAMES:
        writer.write(_ANSWER.pack(MAGIC, VERSION, _token_answer(key, nonce, needs_token)))
    else:
        writer.write(_ANSWER.pack(MAGIC, MODES_VERSION, _token_answer(key, nonce, needs_token))
                     + bytes((mode,)))
    await writer.drain()
    refused = await read_status(reader, peer)
    if refused is not None:
        raise refused
    return Hello(needs_token, max_message)
