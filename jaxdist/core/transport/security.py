"""Credentials: a bearer token and TLS/mTLS files, read once and turned into gRPC objects.

The one place that reads ``--token-file``, ``--tls-cert``, ``--tls-key`` and ``--tls-ca``, for
both ends:

* :func:`server_auth` (the worker): server credentials (TLS; mutual TLS when a CA is given, which
  requires and verifies a client certificate) and an interceptor that checks the bearer token on
  every call before its handler is entered (or, on a next hop's ``Push``, the pipeline's hop
  credential: ``transport/hop.py``).
* :func:`client_auth` (the coordinator, the CLI, and a worker dialling its next hop): call metadata
  (``authorization: Bearer <token>``) and channel credentials. A worker sends its next hops
  no token: only its TLS, and hop credentials made from the pipeline's key or the token.

A worker and its clients must agree: the same token file, and certificates that chain to the CA
each side verifies with. A refused call gets ``UNAUTHENTICATED``; a TLS handshake that fails
(plaintext client on a TLS port, no or untrusted client certificate) never becomes a call, and
the client sees ``UNAVAILABLE``.

Example::

    auth = client_auth(token_file="token", tls_ca="ca.pem", tls_cert="me.pem", tls_key="me.key")
    cluster = Cluster.connect("10.0.0.5:50051", metadata=auth.metadata,
                              credentials=auth.credentials)
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import ssl
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from jaxdist.core.errors import AuthError
from jaxdist.core.transport import hop

__all__ = ["TOKENLESS_METHODS", "ClientAuth", "RefusalLog", "ServerAuth", "TokenInterceptor",
           "client_auth", "connection_hint", "exposure_warning", "is_loopback", "read_token",
           "server_auth"]

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
MIN_TOKEN_CHARS = 16  # shorter tokens are accepted, with a warning

_HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
TOKENLESS_METHODS = frozenset(f"/{_HEALTH.full_name}/{name}" for name in ("Check", "List")
                              if name in _HEALTH.methods_by_name)
"""The calls a worker answers without the token: the gRPC health checks, which Kubernetes'
probes and ``grpc_health_probe`` make without credentials. A caller learns the serving status
and nothing else. Both are unary, so a caller without the token cannot hold a call open:
``Watch`` needs the token (SECURITY.md, "Health checks and metrics")."""


# ---------------------------------------------------------------------------------------------
# Reading the files


PathLike = str | os.PathLike[str]


def _path(path: PathLike | None) -> str | None:
    """``None`` for an option not given (``None`` or ``""``), else the path as a string."""
    return os.fspath(path) if path else None


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise AuthError(f"{what} {path!r} does not exist") from None
    except IsADirectoryError:
        raise AuthError(f"{what} {path!r} is a directory, expected a file") from None
    except OSError as exc:
        raise AuthError(f"{what} {path!r} cannot be read: {exc.strerror or exc}") from None


def _warn_if_shared(path: str, what: str) -> None:
    """A secret readable by group or others is logged (not refused: containers often need it)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s %s is accessible by group or others (mode %s); "
                    "restrict it with: chmod 600 %s", what, path, oct(stat.S_IMODE(mode)), path)


def read_token(path: PathLike) -> str:
    """The bearer token in ``path``: its content, surrounding whitespace stripped.

    Raises:
        AuthError: the file is missing, unreadable or empty, or the token holds characters a
            gRPC metadata value cannot carry (anything but printable ASCII without spaces).
    """
    path = os.fspath(path)
    raw = _read(path, "token file")
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise AuthError(f"token file {path!r} holds non-ASCII bytes; a token must be printable "
                        f"ASCII (e.g. made by: openssl rand -hex 32 > {path})") from None
    if not token:
        raise AuthError(f"token file {path!r} is empty; put a random token in it "
                        f"(e.g. openssl rand -hex 32 > {path})")
    bad = [c for c in token if not 0x21 <= ord(c) <= 0x7E]
    if bad:
        # Never echo the token; name only the kind of character found.
        raise AuthError(f"token file {path!r}: the token holds {len(bad)} whitespace or control "
                        f"character(s); expected one line of printable ASCII without spaces")
    _warn_if_shared(path, "token file")
    if len(token) < MIN_TOKEN_CHARS:
        log.warning("the token in %s is only %d characters; use at least 32 random characters "
                    "(openssl rand -hex 32)", path, len(token))
    return token


def _read_pem(path: str, what: str, kinds: Sequence[str]) -> bytes:
    """A PEM file holding a block of one of ``kinds`` (e.g. ``CERTIFICATE``), unencrypted."""
    data = _read(path, what)
    text = data.decode("ascii", errors="replace")
    begins = [line[len("-----BEGIN "):-len("-----")] for line in text.splitlines()
              if line.startswith("-----BEGIN ") and line.endswith("-----")]
    if not begins:
        raise AuthError(f"{what} {path!r} is not PEM: expected a '-----BEGIN "
                        f"{kinds[0]}-----' block, found none")
    if not any(b.endswith(tuple(kinds)) for b in begins):
        raise AuthError(f"{what} {path!r} holds PEM blocks of kind {', '.join(begins)}; expected "
                        f"{' or '.join(kinds)}")
    if any("ENCRYPTED" in b for b in begins) or "Proc-Type: 4,ENCRYPTED" in text:
        raise AuthError(f"{what} {path!r} is encrypted; gRPC needs an unencrypted key (decrypt "
                        f"it with: openssl pkey -in {path} -out KEY.pem, and chmod 600 KEY.pem)")
    return data


def _check_pair(cert: str, key: str) -> None:
    """Parse the certificate chain and the key, and check that they belong together."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        # An encrypted key was refused above; no password here, so OpenSSL never prompts.
        ctx.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if "KEY_VALUES_MISMATCH" in str(exc) or "values mismatch" in str(exc):
            raise AuthError(f"TLS key {key!r} does not belong to the certificate {cert!r}"
                            ) from None
        raise AuthError(f"TLS certificate {cert!r} or key {key!r} cannot be parsed "
                        f"({reason}); expected a PEM certificate chain and its PEM private key "
                        f"(unencrypted)") from None
    except OSError as exc:
        raise AuthError(f"TLS certificate {cert!r} or key {key!r} cannot be read: {exc}") from None


def _check_ca(path: str) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise AuthError(f"TLS CA {path!r} cannot be parsed ({exc.reason or exc}); expected PEM "
                        f"certificates") from None


@dataclass(frozen=True)
class _Files:
    """The PEM bytes of the TLS options that were given."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None


def _read_tls(tls_cert: PathLike | None, tls_key: PathLike | None, tls_ca: PathLike | None
              ) -> _Files:
    tls_cert, tls_key, tls_ca = _path(tls_cert), _path(tls_key), _path(tls_ca)
    if tls_cert and not tls_key:
        raise AuthError(f"--tls-cert {tls_cert!r} given without --tls-key: TLS needs the "
                        f"certificate's private key too")
    if tls_key and not tls_cert:
        raise AuthError(f"--tls-key {tls_key!r} given without --tls-cert: TLS needs the "
                        f"certificate the key belongs to")
    cert = key = ca = None
    if tls_cert and tls_key:
        cert = _read_pem(tls_cert, "TLS certificate", ["CERTIFICATE"])
        key = _read_pem(tls_key, "TLS key", ["PRIVATE KEY"])
        _check_pair(tls_cert, tls_key)
        _warn_if_shared(tls_key, "TLS key")
    if tls_ca:
        ca = _read_pem(tls_ca, "TLS CA", ["CERTIFICATE"])
        _check_ca(tls_ca)
    return _Files(cert, key, ca)


# ---------------------------------------------------------------------------------------------
# The client side


@dataclass(frozen=True)
class ClientAuth:
    """What a caller sends: call metadata (the token) and channel credentials (TLS).

    The default is no token and plaintext. ``metadata`` is kept out of ``repr`` so the token is
    never logged by accident.
    """

    metadata: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    credentials: grpc.ChannelCredentials | None = None  # None: plaintext
    # The same token and TLS for data connections (transport/stream.py): a coordinator's token
    # keys its proof, a worker's the hop credentials of pipelines without a key; never sent.
    # The context is TLS from the same files.
    hmac_key: bytes | None = field(default=None, repr=False)
    ssl_context: ssl.SSLContext | None = None  # None: plaintext
    # The peers' certificates are verified against the CA given (--tls-ca), not the system's
    # trust store: a peer that passes the handshake holds a certificate of the cluster's CA
    # (jaxdist.core.transport.trust trusts such next hops).
    cluster_ca: bool = False

    @property
    def has_token(self) -> bool:
        return any(k == AUTH_HEADER for k, _ in self.metadata)


def client_auth(*, token_file: PathLike | None = None, tls_cert: PathLike | None = None,
                tls_key: PathLike | None = None, tls_ca: PathLike | None = None) -> ClientAuth:
    """The metadata and channel credentials for calls to workers.

    Args:
        token_file: file holding the workers' bearer token.
        tls_cert: client certificate (PEM) to present, for workers that require mutual TLS.
        tls_key: its private key (PEM).
        tls_ca: CA certificates (PEM) that the workers' certificates must chain to. Without it
            (but with ``tls_cert``) the system's trust store is used.

    Any TLS option turns TLS on; none means plaintext.

    Raises:
        AuthError: a file is missing, unreadable, empty or not PEM, a certificate comes without
            its key (or the reverse), or the key does not match the certificate.
    """
    token_file = _path(token_file)
    metadata: tuple[tuple[str, str], ...] = ()
    key = None
    if token_file:
        token = read_token(token_file)
        metadata = ((AUTH_HEADER, f"Bearer {token}"),)
        key = token.encode("ascii")
    files = _read_tls(tls_cert, tls_key, tls_ca)
    credentials = context = None
    if files.cert or files.ca:
        credentials = grpc.ssl_channel_credentials(root_certificates=files.ca,
                                                   private_key=files.key,
                                                   certificate_chain=files.cert)
        # Verifies the server's certificate and its name, as gRPC does.
        context = ssl.create_default_context(cafile=_path(tls_ca))
        if tls_cert and tls_key:
            context.load_cert_chain(os.fspath(tls_cert), os.fspath(tls_key))
    return ClientAuth(metadata=metadata, credentials=credentials, hmac_key=key,
                      ssl_context=context, cluster_ca=files.ca is not None)


# ---------------------------------------------------------------------------------------------
# The server side


def _refusal(message: str) -> grpc.RpcMethodHandler:
    """A handler that answers UNAUTHENTICATED without reading the request.

    It is request-streaming whatever the method is, so gRPC does not receive or parse a unary
    request of an unauthenticated caller before the handler runs; the status is all that is sent.
    """
    async def refuse(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.stream_unary_rpc_method_handler(refuse)


class RefusalLog:
    """Log lines for refused callers: at most one per kind of refusal per interval (a caller
    retrying in a loop must not flood the log), then a count of those left out.

    What was refused is escaped and clipped: it may be the caller's text (a method path), and a
    newline in it must not forge a log line.
    """

    def __init__(self, logger: logging.Logger, interval: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._interval = interval
        self._clock = clock
        self._logged: dict[str, tuple[float, int]] = {}  # kind -> (last logged, suppressed)

    def refused(self, what: str, kind: str, detail: str = "") -> None:
        """Log that ``what`` was refused for a reason of ``kind`` (the key of the rate limit),
        with an optional ``detail`` (escaped and clipped like ``what``)."""
        now = self._clock()
        last, suppressed = self._logged.get(kind, (float("-inf"), 0))
        if now - last < self._interval:
            self._logged[kind] = (last, suppressed + 1)
            return
        self._logged[kind] = (now, 0)
        more = f" ({suppressed} more refused since the last line)" if suppressed else ""
        told = f" ({_clipped(detail, 300)})" if detail else ""
        self._log.warning("refused %s: %s%s%s", _clipped(what, 100), kind, told, more)


def _clipped(text: str, limit: int) -> str:
    return ascii(text[:limit]) + ("..." if len(text) > limit else "")


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose ``authorization`` metadata is not ``Bearer <token>``, except a
    ``Push`` that presents a hop credential (``transport/hop.py``) of a pipeline loaded here.

    It runs before the method's handler is chosen, so a refused call never reaches the servicer:
    nothing of it runs, and its request is not even read. The token is compared in constant time.
    The health checks of :data:`TOKENLESS_METHODS` pass without it.

    Args:
        hop_keys: the keys of the pipelines loaded on this worker (``hop.HopKeys``), which
            check a hop's credential; ``None``: hop credentials open nothing (see
            :meth:`for_worker`).
    """

    LOG_INTERVAL_S = 10.0  # at most one log line per kind of refusal in this interval

    def __init__(self, token: str, *, clock: Callable[[], float] = time.monotonic,
                 hop_keys: hop.HopKeys | None = None) -> None:
        self._token = token
        self._expected = f"Bearer {token}".encode("ascii")
        self._clock = clock
        self._hop_keys = hop_keys
        self._refusals = RefusalLog(log, self.LOG_INTERVAL_S, clock=clock)

    def for_worker(self, hop_keys: hop.HopKeys) -> TokenInterceptor:
        """The same check for one worker's server, which also lets through the hop streams of
        the pipelines ``hop_keys`` finds loaded there."""
        return TokenInterceptor(self._token, clock=self._clock, hop_keys=hop_keys)

    def check_hop(self, method: str, given: tuple[str, bytes] | str) -> str | None:
        """``None`` when a call of ``method`` may go on with the hop credential ``given``
        (:func:`hop.presented`), else why it is refused."""
        if isinstance(given, str):
            return given
        pipeline_id, credential = given
        if method != hop.PUSH_METHOD:
            return (f"wrong credentials: a hop credential (of pipeline {pipeline_id[:64]!r}) "
                    f"opens only Push, not {method[:100]}")
        if self._hop_keys is None:
            return "wrong credentials: this worker takes no hop credentials"
        return hop.check(pipeline_id, credential, key=self._hop_keys(pipeline_id),
                         token=self._token.encode("ascii"))

    def _log_refusal(self, method: str, kind: str) -> None:
        self._refusals.refused(method, kind)

    def check(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """``None`` when the metadata carries the token, else why the call is refused."""
        values = [v for k, v in metadata or () if k == AUTH_HEADER]
        if not values:
            return ("missing credentials: this worker requires 'authorization: Bearer <token>' "
                    "call metadata (give the worker's token with --token-file)")
        if len(values) > 1:
            return "more than one 'authorization' metadata entry; send exactly one"
        value = values[0]
        presented = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
        if not hmac.compare_digest(presented, self._expected):
            return ("wrong credentials: the bearer token does not match this worker's "
                    "--token-file")
        return None

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method in TOKENLESS_METHODS:
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata
        problem = self.check(metadata)
        if problem is not None and not any(k == AUTH_HEADER for k, _ in metadata or ()):
            given = hop.presented(metadata)  # a worker forwarding a pipeline's frames
            if given is not None:
                problem = self.check_hop(str(handler_call_details.method), given)
        if problem is None:
            return await continuation(handler_call_details)
        self._log_refusal(str(handler_call_details.method), problem.split(":")[0])
        return _refusal(problem)


@dataclass(frozen=True)
class ServerAuth:
    """What a worker requires of its callers (made by :func:`server_auth`).

    Attributes:
        credentials: TLS server credentials, or ``None`` to serve plaintext.
        interceptors: the token check, when a token is required.
        token: a bearer token is required.
        mutual_tls: a client certificate signed by the CA is required.
    """

    credentials: grpc.ServerCredentials | None = None
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
    token: bool = False
    mutual_tls: bool = False
    # The same token and TLS for the worker's data port (transport/stream.py): the token keys
    # the proof a data connection must give; the context requires a client certificate when
    # mutual_tls.
    hmac_key: bytes | None = field(default=None, repr=False)
    ssl_context: ssl.SSLContext | None = None

    @property
    def tls(self) -> bool:
        return self.credentials is not None

    @property
    def authenticates(self) -> bool:
        """Callers must prove who they are (a token, or a client certificate, or both)."""
        return self.token or self.mutual_tls

    def describe(self) -> str:
        """E.g. ``"mTLS + token"``, ``"TLS"`` or ``"plaintext, no auth"``, for start-up lines."""
        parts = ["mTLS" if self.mutual_tls else "TLS" if self.tls else "plaintext"]
        parts.append("token" if self.token else "")
        text = " + ".join(p for p in parts if p)
        return text if self.authenticates else f"{text}, no auth"


def server_auth(*, token_file: PathLike | None = None, tls_cert: PathLike | None = None,
                tls_key: PathLike | None = None, tls_ca: PathLike | None = None) -> ServerAuth:
    """What the worker requires: a token (``token_file``), TLS (``tls_cert`` + ``tls_key``), and
    mutual TLS (``tls_ca`` too: every client must present a certificate that chains to it).

    Raises:
        AuthError: a file is missing, unreadable, empty or not PEM; a certificate comes without
            its key or the reverse; a CA comes without a certificate and key.
    """
    token_file, tls_cert, tls_key, tls_ca = map(_path, (token_file, tls_cert, tls_key, tls_ca))
    if tls_ca and not (tls_cert or tls_key):
        raise AuthError(f"--tls-ca {tls_ca!r} given without --tls-cert and --tls-key: a worker "
                        f"needs its own certificate to serve TLS, and uses the CA to verify "
                        f"its clients' certificates (mutual TLS)")
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
    key = None
    if token_file:
        token = read_token(token_file)
        interceptors = (TokenInterceptor(token),)
        key = token.encode("ascii")
    files = _read_tls(tls_cert, tls_key, tls_ca)
    credentials = context = None
    if files.cert is not None and files.key is not None and tls_cert and tls_key:
        credentials = grpc.ssl_server_credentials([(files.key, files.cert)],
                                                  root_certificates=files.ca,
                                                  require_client_auth=files.ca is not None)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls_cert, tls_key)
        if tls_ca:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cafile=tls_ca)
    return ServerAuth(credentials=credentials, interceptors=interceptors,
                      token=bool(token_file), mutual_tls=files.ca is not None, hmac_key=key,
                      ssl_context=context)


def connection_hint(details: str, *, tls: bool) -> str:
    """A hint for a connection that failed the way a TLS mismatch fails, else ``""``.

    A TLS handshake that fails never becomes a call, so gRPC reports only ``UNAVAILABLE`` with a
    detail such as "Socket closed" or "Tls handshake failed"; a worker that is down reports
    "Connection refused" instead and gets no hint.
    """
    text = details.lower()
    if not any(s in text for s in ("socket closed", "handshake", "ssl", "tls", "end of file")):
        return ""
    if tls:
        return (" (the TLS handshake failed: check that --tls-ca is the CA that signed the "
                "worker's certificate, that the certificate names this address, and, if the "
                "worker requires client certificates (its --tls-ca), that --tls-cert and "
                "--tls-key are signed by that CA; a plaintext worker needs no TLS options)")
    return (" (this client connects in plaintext; if the worker serves TLS, connect with "
            "--tls-ca, and also --tls-cert and --tls-key if it requires client certificates)")


def is_loopback(host: str) -> bool:
    """``127.0.0.0/8``, ``::1`` and ``localhost`` are loopback; every other host is not."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def exposure_warning(host: str, auth: ServerAuth) -> str | None:
    """The start-up warning for a worker reachable from the network without authentication."""
    if is_loopback(host) or auth.authenticates:
        return None
    bar = "!" * 78
    return "\n".join([
        bar,
        f"WARNING: this worker listens on {host}, which is not loopback, WITHOUT AUTHENTICATION.",
        "WARNING: anyone who can reach this port can run code on this machine as this user",
        "WARNING: (a stage is code), read every file under --weights-root, and redirect frames.",
        "WARNING: require credentials with --token-file and/or mutual TLS (--tls-cert, --tls-key",
        "WARNING: and --tls-ca), or bind to 127.0.0.1 (the default). See SECURITY.md.",
        bar,
    ])
