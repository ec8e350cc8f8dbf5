"""Where a worker's (and a coordinator's) credentials go: the next-hop trust policy
(``jaxdist/core/transport/trust.py``), with real worker processes on loopback port 0.

A worker sends a stage's frames only to a hop it may trust: loopback, any hop verified against
its cluster's CA (mutual TLS), or a ``--peer-allow`` pattern; and hop credentials go in
plaintext to a non-loopback hop only with ``--insecure-token``. What a hop gets is the
pipeline's own credential (``jaxdist/core/transport/hop.py``), never the worker's token nor a
proof keyed by it. An attacker's listener named as the next hop records every call's metadata
(and a raw socket every connection, a fake data port every handshake answer): a refused hop is
never dialled, a listener whose certificate is of another CA never sees a call, a trusted one
gets a credential that opens nothing but that pipeline's frames, and the worker goes on
serving. The "non-loopback" hops are this machine's own non-loopback
address when it has one (else those tests are skipped, and the refusals are shown with
``10.255.255.1``, which is refused before any dial). The coordinator's side refuses a token in
plaintext to a non-loopback worker address unless ``insecure_token``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import pathlib
import re
import socket
import struct
import threading
import types
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest
import test_security
from deploy_utils import assert_one_line_error, cli
from models import D, mlp
from test_security import TOKEN, _events, _push

from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.spawn import LocalWorker, spawn_workers, stop_workers
from jaxdist.core.errors import AuthError, JaxdistError, PipelineKeyError, TransportError
from jaxdist.core.spec import StageSpec
from jaxdist.core.transport import stream, wire
from jaxdist.core.transport.client import WorkerClient
from jaxdist.core.transport.frames import FrameHeader, split_frame
from jaxdist.core.transport.hop import CREDENTIAL_HEADER, PIPELINE_HEADER
from jaxdist.core.transport.hop import credential as hop_credential
from jaxdist.core.transport.hop import metadata as hop_metadata
from jaxdist.core.transport.security import ClientAuth, client_auth
from jaxdist.core.transport.trust import (
    HopDecision,
    PeerTrust,
    check_hop,
    check_token_destination,
    parse_hop_pattern,
    peer_credentials,
)
from jaxdist.proto import jaxdist_pb2 as pb

pki = test_security.pki  # a fixture: the security tests' throwaway CAs and token
BEARER = f"Bearer {TOKEN}"
UNROUTABLE = "10.255.255.1:1"  # refused before any dial, so nothing is ever sent there


def _own_ip() -> str | None:
    """This machine's non-loopback IPv4 address, if it has one (a UDP "connect" sends nothing;
    it only picks the source address of the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ipaddress.ip_address(ip).is_loopback or ip == "0.0.0.0" else ip


OWN_IP = _own_ip()
needs_own_ip = pytest.mark.skipif(OWN_IP is None, reason="this machine has no non-loopback "
                                                         "IPv4 address to listen on")


# ---------------------------------------------------------------------------------------------
# The policy, without workers


def _token_auth(tmp_path: pathlib.Path) -> ClientAuth:
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "token").chmod(0o600)
    return client_auth(token_file=str(tmp_path / "token"))


@pytest.mark.parametrize("pattern, hop, matches", [
    ("*", "203.0.113.9:1", True),
    ("10.0.0.0/8", "10.1.2.3:50051", True),
    ("10.0.0.0/8", "11.1.2.3:50051", False),
    ("10.0.0.0/8", "ten.example:50051", False),  # a name is not resolved to match a network
    ("10.0.0.5", "10.0.0.5:7", True),
    ("10.0.0.5:50051", "10.0.0.5:50051", True),
    ("10.0.0.5:50051", "10.0.0.5:50052", False),
    ("Worker-1.Internal", "worker-1.internal:50051", True),
    ("worker-1.internal:50051", "worker-1.internal:1", False),
    ("worker-1.internal", "worker-2.internal:50051", False),
    ("fd00::/8", "[fd00::2]:50051", True),
    ("[fd00::2]:50051", "[fd00::2]:50051", True),
    ("fd00::2", "[fd00:0::2]:1", True),
])
def test_peer_allow_patterns(pattern: str, hop: str, matches: bool) -> None:
    trust = PeerTrust([pattern])
    if matches:
        assert check_hop(hop, ClientAuth(), trust, stage="stage 0").reason == \
            f"--peer-allow {pattern}"
    else:
        with pytest.raises(AuthError, match="matches no --peer-allow pattern"):
            check_hop(hop, ClientAuth(), trust, stage="stage 0")


@pytest.mark.parametrize("bad", ["", "  ", "10.0.0.0/33", "host:port", "bad pattern", "*.corp",
                                 "10.0.0.5:0", "10.0.0.5:70000"])
def test_peer_allow_refuses_what_it_cannot_read(bad: str) -> None:
    with pytest.raises(AuthError, match=re.escape(f"--peer-allow {bad!r}") + r".*expected \*, "
                                        r"a CIDR"):
        parse_hop_pattern(bad)


@pytest.mark.parametrize("hop", ["127.0.0.1:5", "127.9.9.9:5", "[::1]:5", "localhost:5",
                                 "LOCALHOST:5"])
def test_loopback_hops_are_trusted_without_flags(hop: str, tmp_path: pathlib.Path) -> None:
    decision = check_hop(hop, _token_auth(tmp_path), PeerTrust(), stage="stage 0")
    assert decision == HopDecision(hop, "loopback", loopback=True)
    # local_channel_credentials: gRPC refuses that handshake, and so writes no call and no
    # metadata, unless the connected peer is loopback. No token goes with them.
    assert isinstance(peer_credentials(decision, _token_auth(tmp_path)),
                      grpc.ChannelCredentials)


def test_refused_hop_names_the_stage_the_hop_and_the_flags(tmp_path: pathlib.Path) -> None:
    with pytest.raises(AuthError) as err:
        check_hop("203.0.113.9:50051", _token_auth(tmp_path), PeerTrust(["10.0.0.0/8"]),
                  stage="LoadStage: stage 0 of pipeline 'p'")
    text = str(err.value)
    assert err.value.code == "PERMISSION_DENIED"
    assert text.startswith("LoadStage: stage 0 of pipeline 'p': next hop 203.0.113.9:50051 is "
                           "refused")
    assert "this worker's: 10.0.0.0/8" in text and "--peer-allow 203.0.113.9:50051" in text
    assert "--tls-cert, --tls-key and --tls-ca" in text


def test_plaintext_token_needs_insecure_token_even_when_allowed(tmp_path: pathlib.Path,
                                                                 caplog) -> None:
    auth = _token_auth(tmp_path)
    with pytest.raises(AuthError) as err:
        check_hop("10.0.0.5:50051", auth, PeerTrust(["*"]), stage="stage 1")
    assert err.value.code == "PERMISSION_DENIED"
    assert "stage 1: next hop 10.0.0.5:50051 (allowed by --peer-allow *) is refused: this " \
           "worker would send the pipeline's hop credential (made from its --token-file or " \
           "the pipeline's key) to it in plaintext" in str(err.value)
    assert "--tls-cert" in str(err.value) and "--insecure-token" in str(err.value)
    # Without a token nothing secret goes there: the allowlist alone suffices.
    assert not check_hop("10.0.0.5:50051", ClientAuth(), PeerTrust(["*"]),
                         stage="stage 1").plaintext_token
    trust = PeerTrust(["*"], insecure_token=True)
    with caplog.at_level(logging.WARNING, "jaxdist.core.transport.trust"):
        for _ in range(3):
            decision = check_hop("10.0.0.5:50051", auth, trust, stage="stage 1")
    assert decision.plaintext_token
    warned = [r for r in caplog.records if "PLAINTEXT" in r.getMessage()]
    assert len(warned) == 1 and "10.0.0.5:50051" in warned[0].getMessage()
    assert TOKEN not in caplog.text
    assert peer_credentials(decision, auth) is None  # plaintext; each stream: its hop credential


def test_mutual_tls_trusts_any_hop_and_sends_no_plain_metadata(pki) -> None:
    auth = client_auth(token_file=pki.token, tls_cert=pki.cert, tls_key=pki.key, tls_ca=pki.ca)
    decision = check_hop("203.0.113.9:50051", auth, PeerTrust(), stage="stage 0")
    assert decision.reason == "cluster CA" and not decision.plaintext_token
    assert peer_credentials(decision, auth) is auth.credentials  # TLS, and no token with it
    # TLS without a CA of the cluster's own (the system's trust store) proves nothing about
    # the cluster: the hop must be allowed, though the token is encrypted.
    public = client_auth(token_file=pki.token, tls_cert=pki.cert, tls_key=pki.key)
    with pytest.raises(AuthError, match="matches no --peer-allow pattern"):
        check_hop("203.0.113.9:50051", public, PeerTrust(), stage="stage 0")
    assert not check_hop("203.0.113.9:50051", public, PeerTrust(["203.0.113.0/24"]),
                         stage="stage 0").plaintext_token


def test_coordinator_refuses_a_plaintext_token_to_a_non_loopback_worker(pki, caplog) -> None:
    auth = client_auth(token_file=pki.token)
    with pytest.raises(AuthError) as err:
        WorkerClient(UNROUTABLE, metadata=auth.metadata)
    assert "refusing to send the token (--token-file) in plaintext to worker 10.255.255.1:1" \
           in str(err.value)
    assert "--tls-ca" in str(err.value) and "--insecure-token" in str(err.value)
    with pytest.raises(AuthError, match="in plaintext to worker 10.255.255.1:1"):
        Cluster([UNROUTABLE], metadata=auth.metadata)
    for fine in ({"address": "127.0.0.1:1", "token": True, "tls": False},
                 {"address": "localhost:1", "token": True, "tls": False},
                 {"address": UNROUTABLE, "token": True, "tls": True},
                 {"address": UNROUTABLE, "token": False, "tls": False}):
        check_token_destination(fine.pop("address"), insecure_token=False, **fine)
    with caplog.at_level(logging.WARNING, "jaxdist.core.transport.trust"):
        WorkerClient(UNROUTABLE, metadata=auth.metadata, insecure_token=True).close()
    assert "sending the token in PLAINTEXT to worker 10.255.255.1:1" in caplog.text


def test_cli_refuses_a_plaintext_token_to_a_non_loopback_worker(pki) -> None:
    assert_one_line_error(cli("status", "--workers", UNROUTABLE, "--token-file", pki.token),
                          "refusing to send the token (--token-file) in plaintext to worker "
                          "10.255.255.1:1")


# ---------------------------------------------------------------------------------------------
# Listeners an attacker would run


class Recorder(grpc.GenericRpcHandler):
    """A gRPC server that records the metadata of every call it is offered, whatever the
    method, and answers UNIMPLEMENTED."""

    def __init__(self, host: str, credentials: grpc.ServerCredentials | None = None) -> None:
        self.calls: list[dict[str, str]] = []
        self._offered = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                                   handlers=[self])
        bind = f"{host}:0"
        port = (self._server.add_secure_port(bind, credentials) if credentials is not None
                else self._server.add_insecure_port(bind))
        self.address = f"{host}:{port}"
        self._server.start()

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> None:
        with self._offered:
            self.calls.append({k: v for k, v in handler_call_details.invocation_metadata})
            self._offered.notify_all()

    def wait_calls(self, n: int, timeout: float = 60.0) -> list[dict[str, str]]:
        """The metadata of the first ``n`` calls, once they have come (a bound, not a delay)."""
        with self._offered:
            assert self._offered.wait_for(lambda: len(self.calls) >= n, timeout), self.calls
            return self.calls[:n]

    def close(self) -> None:
        self._server.stop(grace=None).wait()


@contextlib.contextmanager
def recorder(host: str, credentials: grpc.ServerCredentials | None = None
             ) -> Iterator[Recorder]:
    r = Recorder(host, credentials)
    try:
        yield r
    finally:
        r.close()


@contextlib.contextmanager
def raw_listener(host: str) -> Iterator[tuple[socket.socket, str]]:
    """A listening TCP socket nobody accepts on: ``accept`` tells whether anyone connected."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        s.listen(8)
        s.setblocking(False)
        yield s, f"{host}:{s.getsockname()[1]}"


def _nobody_connected(s: socket.socket) -> bool:
    try:
        conn, _ = s.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


def _tls_server(pki: types.SimpleNamespace, which: str) -> grpc.ServerCredentials:
    cert, key = {"cluster": (pki.cert, pki.key), "rogue": (pki.rogue_cert, pki.rogue_key)}[which]
    return grpc.ssl_server_credentials([(pathlib.Path(key).read_bytes(),
                                         pathlib.Path(cert).read_bytes())])


# ---------------------------------------------------------------------------------------------
# Workers: a spec of stage 0 that a LoadStage points at any hop


def _worker(root: pathlib.Path, *extra: str, **files: str) -> Iterator[types.SimpleNamespace]:
    (w,) = spawn_workers(1, weights_roots=[str(root)], extra_args=list(extra), **files)
    cluster = Cluster.connect([w.address], **_client_args(files))
    try:
        # Both stages on this one worker: stage 0's spec (its artifact uploaded) is the template.
        with cluster.deploy(mlp(), stages=2) as pipe:
            yield types.SimpleNamespace(worker=w, client=pipe.clients[0], spec=pipe.specs[0],
                                        specs=pipe.specs, pipeline_id=pipe.pipeline_id,
                                        key=pipe.key, files=files)
    finally:
        cluster.close()
        stop_workers([w])


def _client_args(files: dict[str, str]) -> dict[str, object]:
    auth = client_auth(**files)
    return {"metadata": auth.metadata, "credentials": auth.credentials}


@pytest.fixture(scope="module")
def allowed_listener() -> Iterator[tuple[socket.socket, str] | None]:
    """A raw listener on this machine's non-loopback address, which ``plain_worker`` allows."""
    if OWN_IP is None:
        yield None
        return
    with raw_listener(OWN_IP) as found:
        yield found


@pytest.fixture(scope="module")
def plain_worker(pki, mlp_root: pathlib.Path, allowed_listener
                 ) -> Iterator[types.SimpleNamespace]:
    """A plaintext worker with a token, allowed 10.255.255.0/24 (and ``allowed_listener``'s
    HOST:PORT), without --insecure-token."""
    more = ["--peer-allow", allowed_listener[1]] if allowed_listener is not None else []
    yield from _worker(mlp_root, "--peer-allow", "10.255.255.0/24", *more, token_file=pki.token)


@pytest.fixture(scope="module")
def insecure_worker(pki, mlp_root: pathlib.Path) -> Iterator[types.SimpleNamespace]:
    """A plaintext worker with a token, allowed this machine's address, with --insecure-token."""
    if OWN_IP is None:
        pytest.skip("this machine has no non-loopback IPv4 address to listen on")
    yield from _worker(mlp_root, "--peer-allow", OWN_IP, "--insecure-token",
                       token_file=pki.token)


@pytest.fixture(scope="module")
def mtls_worker(pki, mlp_root: pathlib.Path) -> Iterator[types.SimpleNamespace]:
    """A worker with mutual TLS and a token, and no --peer-allow."""
    yield from _worker(mlp_root, token_file=pki.token, tls_cert=pki.cert, tls_key=pki.key,
                       tls_ca=pki.ca)


def _towards(w: types.SimpleNamespace, hop: str, data_hop: str = "") -> tuple[StageSpec, str]:
    """Stage 0's spec as a pipeline of its own whose next hop is ``hop``, and its id."""
    pipeline_id = f"hop-{uuid.uuid4().hex[:12]}"
    return w.spec.replace(next_hop=hop, next_data_hop=data_hop,
                          stage_id=f"{pipeline_id}/0"), pipeline_id


def _load_towards(w: types.SimpleNamespace, hop: str) -> str:
    """Load stage 0 again, as a pipeline of its own whose next hop is ``hop``; its id."""
    spec, pipeline_id = _towards(w, hop)
    w.client.load_stage(spec, pipeline_id)
    return pipeline_id


def _push_one(w: types.SimpleNamespace, pipeline_id: str, watch: str = "") -> None:
    """Push one frame (request 7) into stage 0 of ``pipeline_id``; stage 0 forwards it."""
    x = np.full((4, D), 0.5, np.float32)
    assert _push(w.client, FrameHeader(pipeline_id, "", 0, 0, 7, watch), x) == []


def _forward_fails(w: types.SimpleNamespace, pipeline_id: str) -> str:
    """Push one frame into stage 0 of ``pipeline_id``; the error its forward reports."""
    watch = uuid.uuid4().hex
    sub = w.client.subscribe(pipeline_id, watch)
    try:
        _push_one(w, pipeline_id, watch)
        events = _events(sub, until_request=7)
    finally:
        sub.cancel()
    assert [e.msg.WhichOneof("kind") for e in events] == ["error"], events
    return str(events[0].msg.error.message)


def _log(w: LocalWorker) -> str:
    return pathlib.Path(w.log_path).read_text()


# ---------------------------------------------------------------------------------------------
# Refused at LoadStage, before any dial; the worker serves on


def _refused_load(w: types.SimpleNamespace, hop: str, *, data_hop: str = "") -> str:
    """LoadStage's status and message for stage 0 pointed at ``hop``; the worker serves on."""
    spec, pipeline_id = _towards(w, hop, data_hop)
    request = pb.LoadStageRequest(spec=spec.to_proto(), pipeline_id=pipeline_id)
    with pytest.raises(grpc.RpcError) as err:
        w.client.stub.LoadStage(request, timeout=60, metadata=w.client.metadata)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
    assert w.client.info().address == w.worker.address  # it still serves
    assert not any(st.pipeline_id == pipeline_id for st in w.client.info().stages)
    with pytest.raises(AuthError):  # the coordinator's class for it
        w.client.load_stage(spec, pipeline_id)
    return str(err.value.details())


@needs_own_ip
def test_a_hop_matching_no_pattern_is_refused_and_never_dialled(plain_worker) -> None:
    assert OWN_IP is not None
    with raw_listener(OWN_IP) as (listener, hop):
        text = _refused_load(plain_worker, hop)
        assert _nobody_connected(listener)
    assert "LoadStage: stage 0 of pipeline 'hop-" in text
    assert f"next hop {hop} is refused: it is not loopback" in text
    assert "(this worker's: 10.255.255.0/24" in text
    assert f"); start the worker with --peer-allow {hop} to let it send frames there" in text


def test_a_plaintext_token_to_an_allowed_hop_is_refused(plain_worker) -> None:
    text = _refused_load(plain_worker, UNROUTABLE)
    assert f"next hop {UNROUTABLE} (allowed by --peer-allow 10.255.255.0/24) is refused: this " \
           f"worker would send the pipeline's hop credential (made from its --token-file or " \
           f"the pipeline's key) to it in plaintext" in text
    assert "--tls-cert, --tls-key and --tls-ca" in text and "--insecure-token" in text


@needs_own_ip
def test_an_allowed_listener_gets_no_plaintext_token_without_the_flag(plain_worker,
                                                                      allowed_listener) -> None:
    listener, hop = allowed_listener
    text = _refused_load(plain_worker, hop)
    assert f"next hop {hop} (allowed by --peer-allow {hop}) is refused: this worker would " \
           f"send the pipeline's hop credential" in text
    assert _nobody_connected(listener)


def test_a_data_hop_is_checked_like_the_grpc_hop(plain_worker) -> None:
    loopback = plain_worker.spec.next_hop  # the worker itself: trusted
    text = _refused_load(plain_worker, loopback, data_hop="203.0.113.9:9")
    assert "next hop 203.0.113.9:9 is refused" in text


def _no_token_in(call: dict[str, str | bytes]) -> None:
    """Nothing in a call's metadata is the token or holds it."""
    assert "authorization" not in call, call
    for value in call.values():
        raw = value if isinstance(value, bytes) else value.encode()
        assert TOKEN.encode() not in raw and TOKEN.encode().hex().encode() not in raw


def test_a_loopback_hop_gets_the_pipelines_credential_never_the_token(plain_worker) -> None:
    """A listener on loopback posing as the next hop (loopback is trusted without flags)
    receives the pipeline's hop credential, never the worker's bearer token; and what it
    received opens nothing else on that worker: no call as a client, no other pipeline."""
    w = plain_worker
    with recorder("127.0.0.1") as r:
        pipeline_id = _load_towards(w, r.address)
        try:
            _push_one(w, pipeline_id)
            (call,) = r.wait_calls(1)
            stolen = call[CREDENTIAL_HEADER]
            assert isinstance(stolen, bytes)
            # Replayed as a bearer token, or as a hop credential on another call: refused.
            for metadata in ((("authorization", f"Bearer {stolen.hex()}"),),
                             hop_metadata(pipeline_id, stolen)):
                with pytest.raises(grpc.RpcError) as err:
                    w.client.stub.Info(pb.InfoRequest(), metadata=metadata, timeout=20)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Replayed for the worker's other pipeline: refused before any frame is read.
            refused = _hop_push(w, w.pipeline_id, stolen, _header(w, request_id=31))
            assert refused is not None and refused.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            w.client.unload_stage(pipeline_id)
    _no_token_in(call)
    assert call[PIPELINE_HEADER] == pipeline_id.encode()
    # The pipeline has no key (loaded without one): its credential is made from the token,
    # bound to the pipeline's id, and the token cannot be read back from it.
    assert stolen == hop_credential(pipeline_id, b"", TOKEN.encode())
    assert "wrong credentials: this worker takes no hop" not in refused.details()
    assert f"the hop credential presented for pipeline {w.pipeline_id!r} is not that " \
           f"pipeline's" in refused.details()
    _serves_pipeline(w)


# ---------------------------------------------------------------------------------------------
# A hop's stream opens one pipeline's frames, and nothing else


def _header(w: types.SimpleNamespace, *, request_id: int, reply_to: str = "",
            pipeline_id: str = "", key: bytes | None = None) -> FrameHeader:
    """A frame into stage 1 of the worker's keyed pipeline (or of ``pipeline_id``)."""
    return FrameHeader(pipeline_id or w.pipeline_id, "", 0, 1, request_id, reply_to,
                       key=w.key if key is None else key)


def _hop_push(w: types.SimpleNamespace, pipeline_id: str, credential: bytes,
              header: FrameHeader) -> grpc.RpcError | None:
    """Push one frame as a next hop would: ``pipeline_id``'s hop ``credential``, no token.
    The call's error, if it was refused."""
    x = np.full((4, D), 0.5, np.float32)
    channel = grpc.insecure_channel(w.worker.address)
    try:
        wire.push_method(channel)(iter(split_frame(header, {"x": x})),
                                  metadata=hop_metadata(pipeline_id, credential), timeout=60)
    except grpc.RpcError as exc:
        return exc
    finally:
        channel.close()
    return None


def _data_push(w: types.SimpleNamespace, pipeline_id: str, credential: bytes,
               header: FrameHeader) -> Exception | None:
    """The same on the worker's data port (a hop answer of the handshake): the error of the
    handshake, or the goodbye the worker sent before it closed the connection."""
    address = f"127.0.0.1:{w.client.info().data_port}"
    x = np.full((4, D), 0.5, np.float32)

    async def send() -> Exception | None:
        reader, writer = await asyncio.open_connection(*address.rsplit(":", 1))
        try:
            async with asyncio.timeout(60):  # a bound on the test, not the assertion
                await stream.client_handshake(reader, writer, key=None, peer=address,
                                              hop_pipeline=pipeline_id,
                                              hop_credential=credential)
                for msg in split_frame(header, {"x": x}):
                    stream.write_message(writer, msg)
                writer.write_eof()  # then the worker closes, with a goodbye if it refused
                await writer.drain()
                try:
                    return await stream.read_status(reader, address)
                except TransportError:
                    return None  # closed without a word: the frame was taken
        except JaxdistError as exc:
            return exc
        finally:
            writer.close()

    return asyncio.run(send())


def _ran(w: types.SimpleNamespace, push: Callable[[FrameHeader], object],
         request_id: int) -> bool:
    """Whether a frame pushed by ``push(header)`` into the keyed pipeline ran: its result
    came; or, refused, nothing of it came before the result of a frame the coordinator pushed
    after it (request ``request_id + 1``)."""
    sub, watch = _subscribe(w, w.pipeline_id, w.key)
    try:
        refused = push(_header(w, request_id=request_id, reply_to=watch))
        if refused is None:
            events = _events(sub, until_request=request_id)
        else:
            _push_key(w, request_id + 1, watch)
            events = _events(sub, until_request=request_id + 1)
    finally:
        sub.cancel()
    assert all(e.msg.WhichOneof("kind") == "result" for e in events), (refused, events)
    return request_id in [e.msg.request_id for e in events]


def _push_key(w: types.SimpleNamespace, request_id: int, watch: str) -> None:
    """The coordinator's own frame into stage 1 of the keyed pipeline (with the token)."""
    x = np.full((4, D), 0.5, np.float32)
    assert _push(w.client, _header(w, request_id=request_id, reply_to=watch), x) == []


def _subscribe(w: types.SimpleNamespace, pipeline_id: str, key: bytes
               ) -> tuple[grpc.RpcContext, str]:
    """A subscription to ``pipeline_id``'s results and its ``reply_to``, once the worker has it
    (its first event, a heartbeat, is sent after the subscription is registered)."""
    watch = uuid.uuid4().hex
    sub = w.client.subscribe(pipeline_id, watch, key)
    assert next(iter(sub)).msg.WhichOneof("kind") == "heartbeat"
    return sub, watch


def _serves_pipeline(w: types.SimpleNamespace) -> None:
    sub, watch = _subscribe(w, w.pipeline_id, w.key)
    try:
        _push_key(w, 99, watch)
        (event,) = _events(sub, until_request=99)
    finally:
        sub.cancel()
    assert event.msg.WhichOneof("kind") == "result"


@pytest.mark.parametrize("port", ["grpc", "data"])
def test_a_hop_stream_opens_only_its_own_pipeline(plain_worker, port) -> None:
    """A next hop's stream with the pipeline's credential runs its frames (the control); a
    wrong credential, another pipeline's credential, a credential of a pipeline not loaded
    there, or frames of another pipeline than the credential's are refused with a clear error,
    and the worker goes on serving."""
    w = plain_worker
    push = _hop_push if port == "grpc" else _data_push
    right = hop_credential(w.pipeline_id, w.key, None)  # the pipeline's key makes it
    assert right is not None and right != hop_credential(w.pipeline_id, b"", TOKEN.encode())
    other = _load_towards(w, w.spec.next_hop)  # a pipeline without a key, loaded here
    try:
        others = hop_credential(other, b"", TOKEN.encode())
        assert others is not None
        assert _ran(w, lambda h: push(w, w.pipeline_id, right, h), 41)
        errors = {
            "wrong": push(w, w.pipeline_id, os.urandom(32), _header(w, request_id=51)),
            "another pipeline's": push(w, w.pipeline_id, others, _header(w, request_id=52)),
            "not loaded": push(w, "nowhere", hop_credential("nowhere", b"", TOKEN.encode()),
                               _header(w, request_id=53)),
            "frames of another pipeline": push(w, other, others, _header(w, request_id=54)),
        }
        assert not _ran(w, lambda h: push(w, other, others, h), 61)
    finally:
        w.client.unload_stage(other)
    shown = repr(w.pipeline_id)
    texts = {k: str(e.details() if isinstance(e, grpc.RpcError) else e)
             for k, e in errors.items()}
    wrong = (f"wrong credentials: the hop credential presented for pipeline {shown} is not "
             f"that pipeline's" if port == "grpc" else
             f"wrong credentials: the hop proof for pipeline {shown} does not match that "
             f"pipeline's credential")
    assert wrong in texts["wrong"], texts
    assert texts["another pipeline's"] == texts["wrong"]
    assert "pipeline 'nowhere', which is not loaded on this worker" in texts["not loaded"]
    assert f"frame for pipeline {shown} on worker {w.worker.address} came on a next hop's " \
           f"stream of pipeline {other!r}: a hop credential opens only its own pipeline's " \
           f"frames" in texts["frames of another pipeline"], texts
    for which, error in errors.items():
        if port == "grpc":
            assert isinstance(error, grpc.RpcError), which
            assert error.code() == (grpc.StatusCode.PERMISSION_DENIED
                                    if which == "frames of another pipeline"
                                    else grpc.StatusCode.UNAUTHENTICATED), (which, error)
        else:
            assert isinstance(error, PipelineKeyError if which == "frames of another pipeline"
                              else AuthError), (which, error)
    assert TOKEN not in _log(w.worker)
    _serves_pipeline(w)


def test_a_hop_credential_is_no_client_credential(plain_worker) -> None:
    """Presented on any other call than Push, a hop credential, even the right one, is
    refused (on the data port a hop answer has no mode: it opens frames only)."""
    w = plain_worker
    right = hop_credential(w.pipeline_id, w.key, None)
    assert right is not None
    with pytest.raises(grpc.RpcError) as err:
        w.client.stub.Info(pb.InfoRequest(), metadata=hop_metadata(w.pipeline_id, right),
                           timeout=20)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert f"a hop credential (of pipeline {w.pipeline_id!r}) opens only Push, not " \
           f"/jaxdist.v1.Worker/Info" in err.value.details()
    _serves_pipeline(w)


class FakeDataPort:
    """A data port posing as the next hop: it sends a hello that asks for a token proof with
    a nonce of its own, records the answer, and closes."""

    def __init__(self) -> None:
        self.nonce = os.urandom(stream.NONCE_BYTES)
        self.answer = b""
        self.answered = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self._sock.accept()
            with conn:
                conn.settimeout(60)
                conn.sendall(struct.pack("<4sBBI32s", stream.MAGIC, stream.VERSION,
                                         stream.FLAG_TOKEN, 1 << 20, self.nonce))
                data = b""
                while len(data) < 39 or len(data) < 39 + int.from_bytes(data[37:39], "little"):
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                self.answer = data
                self.answered.set()

    def close(self) -> None:
        self._sock.close()


def test_a_fake_data_port_gets_a_hop_proof_never_a_token_proof(plain_worker) -> None:
    """The data port's hop answer names the pipeline and proves its credential for the fake
    port's nonce: no token, and not the token's proof (which would open the worker's data
    port as a coordinator, frames or events, to whoever relays it)."""
    w = plain_worker
    fake = FakeDataPort()
    try:
        spec, pipeline_id = _towards(w, w.spec.next_hop, data_hop=fake.address)
        w.client.load_stage(spec, pipeline_id)
        try:
            _push_one(w, pipeline_id)
            assert fake.answered.wait(60)
        finally:
            w.client.unload_stage(pipeline_id)
    finally:
        fake.close()
    magic, version, given, n = struct.unpack("<4sB32sH", fake.answer[:39])
    assert (magic, version) == (stream.MAGIC, stream.HOP_VERSION)
    assert fake.answer[39:39 + n] == pipeline_id.encode()
    credential = hop_credential(pipeline_id, b"", TOKEN.encode())
    assert credential is not None and given == stream.hop_proof(credential, fake.nonce)
    assert given != stream.proof(TOKEN.encode(), fake.nonce)
    assert TOKEN.encode() not in fake.answer
    _serves_pipeline(w)


def test_grpc_and_data_hops_run_keyed_and_keyless_pipelines(plain_worker) -> None:
    """The worker's own pipelines over both hops, with and without a key: each hop presents
    the pipeline's credential (the key's, or the token's for a pipeline without one), and the
    next stage's worker takes it."""
    w = plain_worker
    for key in (w.key, b""):
        for data_hop in (w.specs[0].next_data_hop, ""):
            pipeline_id = f"hops-{uuid.uuid4().hex[:12]}"
            for k, spec in enumerate(w.specs):
                w.client.load_stage(spec.replace(stage_id=f"{pipeline_id}/{k}",
                                                 next_data_hop=data_hop if k == 0 else ""),
                                    pipeline_id, key=key)
            try:
                routes = {st.stage_index: st.route for st in w.client.info().stages
                          if st.pipeline_id == pipeline_id}
                assert routes[0] == ("tcp" if data_hop else "grpc")
                sub, watch = _subscribe(w, pipeline_id, key)
                try:
                    x = np.full((4, D), 0.5, np.float32)
                    assert _push(w.client, FrameHeader(pipeline_id, "", 0, 0, 5, watch,
                                                       key=key), x) == []
                    (event,) = _events(sub, until_request=5)
                finally:
                    sub.cancel()
                assert event.msg.WhichOneof("kind") == "result", (key != b"", data_hop, event)
            finally:
                w.client.unload_stage(pipeline_id)


# ---------------------------------------------------------------------------------------------
# --insecure-token: the explicit opt-in, warned once


def test_insecure_token_lets_hop_credentials_through_with_one_warning(insecure_worker) -> None:
    """With --insecure-token a plaintext hop off loopback is allowed: it gets each pipeline's
    own credential, still never the token."""
    assert OWN_IP is not None
    with recorder(OWN_IP) as r:
        ids = [_load_towards(insecure_worker, r.address) for _ in range(2)]
        try:
            for pipeline_id in ids:
                _push_one(insecure_worker, pipeline_id)
            calls = r.wait_calls(2)
        finally:
            for pipeline_id in ids:
                insecure_worker.client.unload_stage(pipeline_id)
    for call in calls:
        _no_token_in(call)
    assert sorted(c[PIPELINE_HEADER] for c in calls) == sorted(i.encode() for i in ids)
    assert {c[CREDENTIAL_HEADER] for c in calls} == {
        hop_credential(i, b"", TOKEN.encode()) for i in ids}  # one per pipeline
    log = _log(insecure_worker.worker)
    warned = [line for line in log.splitlines() if "--insecure-token: this worker sends its "
              f"pipelines' hop credentials in PLAINTEXT to next hop {r.address}" in line]
    assert len(warned) == 1 and "WARNING" in warned[0]
    assert TOKEN not in log


# ---------------------------------------------------------------------------------------------
# Mutual TLS: a call only after the hop proved the cluster's identity


@pytest.mark.parametrize("which", ["cluster", "rogue"])
def test_mtls_calls_only_a_hop_of_the_cluster_ca(pki, mtls_worker, which) -> None:
    """A listener with a certificate of the cluster's CA gets the call, with the pipeline's
    hop credential and not the token (the control); one whose certificate is of another CA,
    for the same address, gets no call at all: gRPC sends no metadata before the handshake
    has verified the server."""
    with recorder("127.0.0.1", _tls_server(pki, which)) as r:
        pipeline_id = _load_towards(mtls_worker, r.address)  # any hop: verified by the CA
        try:
            if which == "cluster":
                _push_one(mtls_worker, pipeline_id)
                (call,) = r.wait_calls(1)
                _no_token_in(call)
                assert call[CREDENTIAL_HEADER] == hop_credential(pipeline_id, b"",
                                                                 TOKEN.encode())
            else:
                # The frame's forward fails at the handshake, and says so to its caller; by
                # then the connection attempt is over, and the listener saw no call.
                message = _forward_fails(mtls_worker, pipeline_id)
                assert f"stage 0 could not forward to stage 1 at {r.address}" in message
                assert r.calls == []
        finally:
            mtls_worker.client.unload_stage(pipeline_id)
    assert mtls_worker.client.info().address == mtls_worker.worker.address


@pytest.mark.parametrize("trusting", ["other_ca", "ca"])
def test_grpc_sends_plain_metadata_only_after_the_server_is_verified(pki, trusting) -> None:
    """The same guarantee for per-call metadata (how a coordinator sends the token): a client
    trusting the attacker's CA hands it the token (the control: the recorder sees what a
    successful handshake lets through); one trusting only the cluster's CA sends nothing."""
    with recorder("127.0.0.1", _tls_server(pki, "rogue")) as r:
        auth = client_auth(token_file=pki.token, tls_ca=getattr(pki, trusting))
        client = WorkerClient(r.address, timeout=20, metadata=auth.metadata,
                              credentials=auth.credentials)
        try:
            with pytest.raises(JaxdistError, match="Info: Method not found"
                               if trusting == "other_ca" else "Info: UNAVAILABLE"):
                client.info()
        finally:
            client.close()
        calls = list(r.calls)
    if trusting == "other_ca":
        assert calls and calls[0]["authorization"] == BEARER
    else:
        assert calls == []
