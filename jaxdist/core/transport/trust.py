"""Where credentials may go: the next hops a worker dials, and the workers a coordinator dials.

A worker forwards its stages' outputs to the ``next_hop`` (and ``next_data_hop``) a
``LoadStage`` names, with its client certificate and each pipeline's own hop credential
(``transport/hop.py``: made from the pipeline's key, or for a pipeline without one from the
token; as call metadata on gRPC, as the key of a proof on the data port). The token itself, or
anything that opens more than that pipeline's frames, never goes to a hop. Whoever may load a
stage chooses that address, so the worker decides for itself, in one function
(:func:`check_hop`), whether it may trust the hop:

1. a loopback hop (``127.0.0.0/8``, ``::1``, ``localhost``) is trusted;
2. with mutual TLS (the worker's ``--tls-cert``, ``--tls-key`` and ``--tls-ca``) every hop is
   dialled over TLS verified against the cluster's CA: nothing leaves before the hop has
   proven it holds a certificate of that CA naming the hop's address, so any hop is allowed;
3. otherwise the hop must match a ``--peer-allow`` pattern (``HOST``, ``HOST:PORT``, a CIDR
   such as ``10.0.0.0/8``, or ``*``);
4. and a worker with a token never sends hop credentials in plaintext to a hop that is not
   loopback unless it was started with ``--insecure-token`` (logged once per hop, as a
   warning).

``LoadStage`` refuses a stage whose hop fails (``PERMISSION_DENIED``, naming the stage, the hop
and the flags); the routes check again before they dial, so nothing is ever sent to a hop this
function refused.

The gRPC route's channel is chosen by :func:`peer_credentials`, so that gRPC itself enforces
where a hop's metadata may go: TLS verified against the CA, or, in plaintext,
``local_channel_credentials``, whose handshake succeeds only when the connected peer address is
loopback (a ``localhost`` that resolves elsewhere fails). gRPC writes no call, and no metadata,
on a channel whose handshake failed. Only the ``--insecure-token`` case sends hop credentials
on a plaintext channel off loopback, on purpose.

The coordinator's side is :func:`check_token_destination`: it refuses to send a token in
plaintext to a worker address that is not loopback unless ``insecure_token`` is set
(``--insecure-token`` on the CLI).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import re
import threading
from collections.abc import Iterable

import grpc

from jaxdist.core.errors import AuthError
from jaxdist.core.transport.security import ClientAuth, is_loopback

__all__ = ["HopDecision", "HopPattern", "PeerTrust", "check_hop", "check_token_destination",
           "parse_hop_pattern", "peer_credentials", "split_host_port"]

log = logging.getLogger(__name__)

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?",
                   re.ASCII)
_TLS_FLAGS = "--tls-cert, --tls-key and --tls-ca"


def split_host_port(address: str) -> tuple[str, int | None]:
    """``HOST:PORT`` (``[v6]:PORT``) as ``(host, port)``; the host without brackets, lowercase.

    A bare IPv6 address or a host without a port gives ``port`` ``None``.
    """
    text = address.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        port = rest.removeprefix(":") if sep and rest.startswith(":") else ""
        return host.lower(), int(port) if port.isdigit() else None
    if text.count(":") > 1:  # a bare IPv6 address
        return text.lower(), None
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit():
        return host.lower(), int(port)
    return text.lower(), None


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# --peer-allow patterns


@dataclasses.dataclass(frozen=True)
class HopPattern:
    """One ``--peer-allow`` pattern: every hop (``*``), a network, or a host with or without a
    port. A host name matches only the same name (it is not resolved), an IP only the same IP.
    """

    text: str
    any_hop: bool = False
    network: IPNetwork | None = None
    host: str = ""
    port: int | None = None

    def matches(self, host: str, port: int | None) -> bool:
        """Whether a hop at ``host`` (lowercase, no brackets) and ``port`` matches."""
        if self.any_hop:
            return True
        ip = _ip(host)
        if self.network is not None:
            return ip is not None and ip in self.network
        if self.port is not None and port != self.port:
            return False
        mine = _ip(self.host)
        if mine is not None or ip is not None:
            return mine == ip
        return self.host.rstrip(".") == host.rstrip(".")


def parse_hop_pattern(text: str) -> HopPattern:
    """A ``--peer-allow`` pattern: ``*``, ``10.0.0.0/8``, ``fd00::/8``, ``10.1.2.3``,
    ``worker-1.internal``, ``worker-1.internal:50051``, ``[fd00::2]:50051``.

    Raises:
        AuthError: anything else, naming the pattern and what was expected.
    """
    pattern = text.strip()
    expected = ("expected *, a CIDR such as 10.0.0.0/8, a host such as worker-1.internal or "
                "10.0.0.5, or HOST:PORT such as 10.0.0.5:50051")
    if pattern == "*":
        return HopPattern(pattern, any_hop=True)
    if "/" in pattern:
        try:
            return HopPattern(pattern, network=ipaddress.ip_network(pattern, strict=False))
        except ValueError:
            raise AuthError(f"--peer-allow {text!r} is not a CIDR network; {expected}") from None
    host, port = split_host_port(pattern)
    if port is not None and not 0 < port < 65536:
        raise AuthError(f"--peer-allow {text!r}: port {port} is out of range; {expected}")
    if not host or (_ip(host) is None and not _NAME.fullmatch(host)):
        raise AuthError(f"--peer-allow {text!r} is not a pattern this worker understands; "
                        f"{expected}")
    return HopPattern(pattern, host=host, port=port)


# ---------------------------------------------------------------------------------------------
# The worker's policy


class PeerTrust:
    """The next hops a worker may dial beyond loopback and its cluster's CA (``--peer-allow``),
    and whether hop credentials made from its token may go to them in plaintext
    (``--insecure-token``).

    The default allows loopback hops only (and any hop under mutual TLS). Thread-safe: the
    routes and the load threads share one.
    """

    def __init__(self, allow: Iterable[str | HopPattern] = (), *,
                 insecure_token: bool = False) -> None:
        self.allow: tuple[HopPattern, ...] = tuple(
            p if isinstance(p, HopPattern) else parse_hop_pattern(p) for p in allow)
        self.insecure_token = insecure_token
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"PeerTrust(allow={[p.text for p in self.allow]!r}, "
                f"insecure_token={self.insecure_token})")

    def match(self, host: str, port: int | None) -> HopPattern | None:
        """The first ``--peer-allow`` pattern the hop matches, if any."""
        return next((p for p in self.allow if p.matches(host, port)), None)

    def warn_once(self, hop: str) -> None:
        """Log, once per hop, that hop credentials go to it in plaintext (``--insecure-token``)."""
        with self._lock:
            if hop in self._warned:
                return
            self._warned.add(hop)
        log.warning("--insecure-token: this worker sends its pipelines' hop credentials in "
                    "PLAINTEXT to next hop %s (not loopback); anyone on the path can read them "
                    "and push frames into those pipelines. Use mutual TLS (%s) instead", hop,
                    _TLS_FLAGS)


@dataclasses.dataclass(frozen=True)
class HopDecision:
    """Why a hop may be dialled: ``"loopback"``, ``"cluster CA"`` or ``"--peer-allow P"``;
    and whether a worker with a token sends hop credentials to it in plaintext (only with
    ``--insecure-token``)."""

    hop: str
    reason: str
    loopback: bool
    plaintext_token: bool = False


def check_hop(hop: str, auth: ClientAuth, trust: PeerTrust, *, stage: str) -> HopDecision:
    """Whether this worker may send a stage's frames, with its credentials ``auth``, to
    ``hop`` (``HOST:PORT``): the one decision, made at ``LoadStage`` and again before a route
    dials. ``stage`` names the stage in the error (e.g. ``"stage 0 of pipeline p"``).

    Raises:
        AuthError: (``PERMISSION_DENIED``) the hop is not loopback, not verified by the cluster's
            CA and matches no ``--peer-allow`` pattern; or it would get hop credentials in
            plaintext without ``--insecure-token``.
    """
    host, port = split_host_port(hop)
    if is_loopback(host):
        return HopDecision(hop, "loopback", loopback=True)
    if auth.cluster_ca:
        return HopDecision(hop, "cluster CA", loopback=False)
    pattern = trust.match(host, port)
    if pattern is None:
        allowed = ", ".join(p.text for p in trust.allow) or "none"
        raise AuthError(
            f"{stage}: next hop {hop} is refused: it is not loopback, this worker has no "
            f"mutual TLS ({_TLS_FLAGS}) to verify it against the cluster's CA, and it matches "
            f"no --peer-allow pattern (this worker's: {allowed}); start the worker with "
            f"--peer-allow {_suggested(host, port)} to let it send frames there",
            code="PERMISSION_DENIED")
    plaintext_token = auth.has_token and auth.credentials is None
    if plaintext_token and not trust.insecure_token:
        raise AuthError(
            f"{stage}: next hop {hop} (allowed by --peer-allow {pattern.text}) is refused: "
            f"this worker would send the pipeline's hop credential (made from its --token-file "
            f"or the pipeline's key) to it in plaintext, as it is not loopback; give the "
            f"workers TLS ({_TLS_FLAGS}), or accept that anyone on the path can read it, and "
            f"push frames into that pipeline, with --insecure-token", code="PERMISSION_DENIED")
    if plaintext_token:
        trust.warn_once(hop)
    return HopDecision(hop, f"--peer-allow {pattern.text}", loopback=False,
                       plaintext_token=plaintext_token)


def _suggested(host: str, port: int | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{shown}:{port}" if port is not None else shown


def peer_credentials(decision: HopDecision, auth: ClientAuth) -> grpc.ChannelCredentials | None:
    """The channel credentials of a gRPC channel to a hop that :func:`check_hop` allowed.

    * TLS (the worker's ``--tls-*``): its TLS credentials;
    * plaintext to loopback: ``local_channel_credentials`` (the handshake fails unless the
      connected peer is loopback);
    * plaintext elsewhere: ``None``, a plaintext channel.

    No token goes with them: each ``Push`` stream carries its pipeline's hop credential as call
    metadata (``transport/hop.py``), written only once the channel's handshake succeeded.
    """
    if auth.credentials is not None:
        return auth.credentials
    if decision.loopback:
        return grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    return None


# ---------------------------------------------------------------------------------------------
# The coordinator's side


def check_token_destination(address: str, *, token: bool, tls: bool,
                            insecure_token: bool) -> None:
    """Refuse to send a token in plaintext to a worker ``address`` that is not loopback,
    unless ``insecure_token`` (``--insecure-token``); such a send is logged as a warning.

    Raises:
        AuthError: the token would go in plaintext to a non-loopback address.
    """
    if not token or tls or is_loopback(split_host_port(address)[0]):
        return
    if not insecure_token:
        raise AuthError(f"refusing to send the token (--token-file) in plaintext to worker "
                        f"{address}, which is not loopback: anyone on the path could read it; "
                        f"connect with TLS (--tls-ca, and --tls-cert and --tls-key if the "
                        f"workers require client certificates), or accept the exposure with "
                        f"--insecure-token (insecure_token=True in Python)")
    log.warning("--insecure-token: sending the token in PLAINTEXT to worker %s (not loopback)",
                address)
