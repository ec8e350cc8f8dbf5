"""Authentication and TLS (``jaxdist.core.transport.security``) with real worker processes.

A throwaway PKI is made per module: a CA, a certificate for 127.0.0.1/localhost signed by it
(workers serve with it and present it to their next hops; the coordinator presents it too), and
a "rogue" certificate signed by another CA. Every refusal is followed by a correct authenticated
request to the same worker, checked against numpy.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import pathlib
import types
import uuid

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from deploy_utils import assert_one_line_error, cli
from models import D, mlp, mlp_reference

from jaxdist.cli import build_parser
from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.spawn import spawn_workers, stop_workers
from jaxdist.core import artifacts
from jaxdist.core.errors import AuthError, TransportError
from jaxdist.core.transport.client import WorkerClient
from jaxdist.core.transport.frames import FrameAssembler, FrameHeader, split_frame
from jaxdist.core.transport.security import (
    TokenInterceptor,
    client_auth,
    exposure_warning,
    is_loopback,
    read_token,
    server_auth,
)
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.proto import jaxdist_pb2_grpc as pb_grpc
from jaxdist.worker.__main__ import main as worker_main

RNG = np.random.default_rng(11)
TOKEN = "test-token-5f0c2a9e8b7d4c1a"


# ---------------------------------------------------------------------------------------------
# A throwaway PKI


def _write_pair(base: pathlib.Path, key: ec.EllipticCurvePrivateKey,
                cert: x509.Certificate) -> None:
    base.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile = base.with_suffix(".key")
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    keyfile.chmod(0o600)


def _certificate(name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
                 issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = (builder
                   .add_extension(x509.SubjectAlternativeName([
                       x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                       x509.DNSName("localhost")]), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]),
                                  critical=False))
    return builder.sign(issuer_key, hashes.SHA256())


def _make_ca(d: pathlib.Path, name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Name]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    _write_pair(d / name, key, _certificate(name, key, subject, key, ca=True))
    return key, subject


def _make_leaf(d: pathlib.Path, name: str, ca: tuple[ec.EllipticCurvePrivateKey, x509.Name]
               ) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    _write_pair(d / name, key, _certificate(name, key, ca[1], ca[0], ca=False))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    d = tmp_path_factory.mktemp("pki")
    ca = _make_ca(d, "ca")
    _make_leaf(d, "node", ca)
    other = _make_ca(d, "other-ca")
    _make_leaf(d, "rogue", other)
    (d / "token").write_text(TOKEN + "\n")
    (d / "token").chmod(0o600)
    (d / "wrong-token").write_text("not-the-token-0000000000\n")
    (d / "wrong-token").chmod(0o600)
    return types.SimpleNamespace(
        dir=d, ca=str(d / "ca.pem"), cert=str(d / "node.pem"), key=str(d / "node.key"),
        other_ca=str(d / "other-ca.pem"), rogue_cert=str(d / "rogue.pem"),
        rogue_key=str(d / "rogue.key"), token=str(d / "token"),
        wrong_token=str(d / "wrong-token"))


def _client(address: str, **files: str | None) -> WorkerClient:
    auth = client_auth(**files)
    return WorkerClient(address, timeout=20.0, metadata=auth.metadata,
                        credentials=auth.credentials)


def _x(b: int = 4) -> np.ndarray:
    return RNG.standard_normal((b, D)).astype(np.float32)


def _serves(pipe: object, root: pathlib.Path) -> None:
    """The worker still answers a correct, authenticated request: numpy's result."""
    x = _x()
    out = pipe.call(x=x, timeout=60)  # type: ignore[attr-defined]
    np.testing.assert_allclose(out["x"], mlp_reference(root, x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Reading credentials: clear errors, no worker needed


def test_error_token_file_missing(tmp_path: pathlib.Path) -> None:
    with pytest.raises(AuthError, match=r"token file '.*nope' does not exist"):
        client_auth(token_file=str(tmp_path / "nope"))


def test_error_token_file_empty(tmp_path: pathlib.Path) -> None:
    (tmp_path / "t").write_text("  \n")
    with pytest.raises(AuthError, match=r"token file '.*t' is empty"):
        server_auth(token_file=str(tmp_path / "t"))


def test_error_token_file_is_a_directory(tmp_path: pathlib.Path) -> None:
    with pytest.raises(AuthError, match="is a directory, expected a file"):
        read_token(tmp_path)


def test_error_token_with_inner_whitespace(tmp_path: pathlib.Path) -> None:
    (tmp_path / "t").write_text("two words-0123456789\n")
    with pytest.raises(AuthError, match="1 whitespace or control character") as info:
        read_token(tmp_path / "t")
    assert "words" not in str(info.value)  # the token is never echoed


def test_error_token_unreadable(tmp_path: pathlib.Path) -> None:
    (tmp_path / "file").write_text(TOKEN)  # a path through a file fails as root, too
    with pytest.raises(AuthError, match=r"token file '.*file/t' cannot be read: Not a "
                                        r"directory"):
        read_token(tmp_path / "file" / "t")


def test_token_readable_by_others_is_warned_and_never_logged(
        tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "t").write_text(TOKEN)
    (tmp_path / "t").chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="jaxdist.core.transport.security"):
        auth = client_auth(token_file=str(tmp_path / "t"))
    assert "accessible by group or others (mode 0o644)" in caplog.text
    assert "chmod 600" in caplog.text
    assert TOKEN not in caplog.text and TOKEN not in repr(auth)
    assert auth.metadata == (("authorization", f"Bearer {TOKEN}"),)


def test_refusals_log_escaped_and_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    """A caller's method path is its own text: a newline in it cannot forge a log line, a long
    one is clipped, and a caller retrying in a loop gets one line per interval, not one per
    call. (The interceptor itself, on a fake clock; real refusals are tested above.)"""
    import asyncio

    from jaxdist.core.transport.security import TokenInterceptor

    now = [0.0]
    interceptor = TokenInterceptor(TOKEN, clock=lambda: now[0])
    forged = "/jaxdist.v1.Worker/Info\nINFO forged: all good" + "x" * 500

    async def refuse(n: int) -> None:
        for _ in range(n):
            details = types.SimpleNamespace(method=forged, invocation_metadata=())
            handler = await interceptor.intercept_service(_never_called, details)
            assert handler is not None  # the refusal handler, never the continuation

    with caplog.at_level(logging.WARNING, logger="jaxdist.core.transport.security"):
        asyncio.run(refuse(100))
        now[0] += TokenInterceptor.LOG_INTERVAL_S
        asyncio.run(refuse(1))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert all("\n" not in line and len(line) < 250 for line in lines)
    assert lines[0].startswith("refused '/jaxdist.v1.Worker/Info\\nINFO forged: all good")
    assert lines[0].endswith("...: missing credentials")
    assert lines[1].endswith("missing credentials (99 more refused since the last line)")


async def _never_called(details: object) -> None:
    raise AssertionError("a refused call reached the servicer")


def test_error_cert_without_key(pki: types.SimpleNamespace) -> None:
    with pytest.raises(AuthError, match="--tls-cert '.*node.pem' given without --tls-key"):
        server_auth(tls_cert=pki.cert)
    with pytest.raises(AuthError, match="--tls-cert '.*node.pem' given without --tls-key"):
        client_auth(tls_cert=pki.cert, tls_ca=pki.ca)


def test_error_key_without_cert(pki: types.SimpleNamespace) -> None:
    with pytest.raises(AuthError, match="--tls-key '.*node.key' given without --tls-cert"):
        server_auth(tls_key=pki.key)


def test_error_ca_without_cert_on_the_worker(pki: types.SimpleNamespace) -> None:
    with pytest.raises(AuthError, match="--tls-ca '.*ca.pem' given without --tls-cert and "
                                        "--tls-key"):
        server_auth(tls_ca=pki.ca)
    client_auth(tls_ca=pki.ca)  # a client may verify the worker without a certificate of its own


def test_error_spawn_refuses_bad_files_before_starting(pki: types.SimpleNamespace) -> None:
    with pytest.raises(AuthError, match="--tls-ca '.*ca.pem' given without"):
        spawn_workers(1, tls_ca=pki.ca)


def test_error_worker_cli_names_the_bad_file(pki: types.SimpleNamespace,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert worker_main(["--listen", "127.0.0.1:0", "--token-file",
                        str(pki.dir / "missing")]) == 2
    assert "token file '" in capsys.readouterr().err
    assert worker_main(["--listen", "127.0.0.1:0", "--tls-ca", pki.ca]) == 2
    assert "given without --tls-cert and --tls-key" in capsys.readouterr().err


def test_error_unparseable_pem(pki: types.SimpleNamespace, tmp_path: pathlib.Path) -> None:
    (tmp_path / "junk.pem").write_text("this is not a certificate\n")
    with pytest.raises(AuthError, match=r"TLS certificate '.*junk.pem' is not PEM: expected a "
                                        r"'-----BEGIN CERTIFICATE-----' block"):
        server_auth(tls_cert=str(tmp_path / "junk.pem"), tls_key=pki.key)
    with pytest.raises(AuthError, match=r"TLS key '.*node.pem' holds PEM blocks of kind "
                                        r"CERTIFICATE; expected PRIVATE KEY"):
        server_auth(tls_cert=pki.cert, tls_key=pki.cert)
    broken = pathlib.Path(pki.cert).read_text().replace("M", "*", 3)  # damaged base64
    (tmp_path / "broken.pem").write_text(broken)
    with pytest.raises(AuthError, match=r"TLS certificate '.*broken.pem' or key '.*node.key' "
                                        r"cannot be parsed"):
        server_auth(tls_cert=str(tmp_path / "broken.pem"), tls_key=pki.key)
    with pytest.raises(AuthError, match=r"TLS CA '.*broken.pem' cannot be parsed"):
        client_auth(tls_ca=str(tmp_path / "broken.pem"))


def test_error_key_does_not_match_cert(pki: types.SimpleNamespace) -> None:
    with pytest.raises(AuthError, match=r"TLS key '.*rogue.key' does not belong to the "
                                        r"certificate '.*node.pem'"):
        server_auth(tls_cert=pki.cert, tls_key=pki.rogue_key)


def test_error_encrypted_key(pki: types.SimpleNamespace, tmp_path: pathlib.Path) -> None:
    key = serialization.load_pem_private_key(pathlib.Path(pki.key).read_bytes(), None)
    (tmp_path / "enc.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pw")))
    with pytest.raises(AuthError, match=r"TLS key '.*enc.key' is encrypted"):
        client_auth(tls_cert=pki.cert, tls_key=str(tmp_path / "enc.key"))


def test_token_check() -> None:
    check = TokenInterceptor(TOKEN).check
    assert check([("authorization", f"Bearer {TOKEN}")]) is None
    assert check([("x", "y"), ("authorization", f"Bearer {TOKEN}".encode())]) is None
    assert "missing credentials" in check([("x", "y")])
    assert "missing credentials" in check(None)
    for wrong in (f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", TOKEN, f"bearer {TOKEN}", ""):
        assert "wrong credentials" in check([("authorization", wrong)]), wrong
    assert "more than one" in check([("authorization", f"Bearer {TOKEN}")] * 2)


def test_loopback_and_the_exposure_warning(pki: types.SimpleNamespace) -> None:
    for host in ("127.0.0.1", "127.8.0.1", "localhost", "[::1]", "::1"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "[::]", "10.0.0.5", "", "example.com"):
        assert not is_loopback(host), host
    plain, tls = server_auth(), server_auth(tls_cert=pki.cert, tls_key=pki.key)
    for host, auth in (("127.0.0.1", plain), ("0.0.0.0", server_auth(token_file=pki.token)),
                       ("0.0.0.0", server_auth(tls_cert=pki.cert, tls_key=pki.key,
                                               tls_ca=pki.ca))):
        assert exposure_warning(host, auth) is None
    for auth in (plain, tls):  # TLS alone encrypts; it does not say who may call
        text = exposure_warning("0.0.0.0", auth)
        assert text is not None and "WITHOUT AUTHENTICATION" in text
        assert len(text.splitlines()) > 3


# ---------------------------------------------------------------------------------------------
# A worker that requires a token (plaintext), bound to all interfaces


@pytest.fixture(scope="module")
def token_worker(pki: types.SimpleNamespace, mlp_root: pathlib.Path):
    """One worker on 0.0.0.0 that requires the token; yields (address, worker, pipeline)."""
    (w,) = spawn_workers(1, weights_roots=[str(mlp_root)], token_file=pki.token,
                         extra_args=["--listen", "0.0.0.0:0"])
    address = "127.0.0.1:" + w.address.rpartition(":")[2]
    auth = client_auth(token_file=pki.token)
    cluster = Cluster.connect([address], metadata=auth.metadata, credentials=auth.credentials)
    try:
        with cluster.deploy(mlp(), stages=1) as pipe:
            yield types.SimpleNamespace(address=address, worker=w, pipe=pipe)
    finally:
        cluster.close()
        stop_workers([w])


CREDENTIALS = {"missing": None, "wrong": "wrong_token"}


def _bad_client(pki: types.SimpleNamespace, address: str, which: str) -> WorkerClient:
    attr = CREDENTIALS[which]
    return _client(address, token_file=getattr(pki, attr) if attr else None)


def test_no_warning_on_all_interfaces_with_a_token(token_worker) -> None:
    log = pathlib.Path(token_worker.worker.log_path).read_text()
    assert token_worker.worker.address.startswith("0.0.0.0:")
    assert "WITHOUT AUTHENTICATION" not in log


@pytest.mark.parametrize("which", ["missing", "wrong", "right"])
def test_unary_call_needs_the_token(pki, token_worker, mlp_root, which) -> None:
    metadata = {"missing": (), "wrong": (("authorization", "Bearer not-the-token"),),
                "right": (("authorization", f"Bearer {TOKEN}"),)}[which]
    channel = grpc.insecure_channel(token_worker.address)
    try:
        stub = pb_grpc.WorkerStub(channel)
        if which == "right":
            assert stub.Info(pb.InfoRequest(), metadata=metadata, timeout=20).address
        else:
            with pytest.raises(grpc.RpcError) as info:
                stub.Info(pb.InfoRequest(), metadata=metadata, timeout=20)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert f"{which} credentials" in info.value.details()
    finally:
        channel.close()
    if which != "right":
        client = _bad_client(pki, token_worker.address, which)
        with pytest.raises(AuthError, match=f"worker {token_worker.address}: Info: "
                                            f"UNAUTHENTICATED: {which} credentials"):
            client.info()
        client.close()
    _serves(token_worker.pipe, mlp_root)


@pytest.mark.parametrize("which", ["missing", "wrong"])
def test_refused_upload_stores_nothing(pki, token_worker, mlp_root, which) -> None:
    data = uuid.uuid4().bytes * 64
    digest = artifacts.digest_of(data)
    bad, good = _bad_client(pki, token_worker.address, which), token_worker.pipe.clients[0]
    try:
        with pytest.raises(AuthError, match="UploadArtifact: UNAUTHENTICATED"):
            bad.upload_artifact(digest, data)
        with pytest.raises(AuthError, match="HasArtifact: UNAUTHENTICATED"):
            bad.has_artifact(digest)
    finally:
        bad.close()
    assert not good.has_artifact(digest)
    assert digest not in good.info().artifacts
    assert good.upload_artifact(digest, data).stored  # the same bytes, authenticated
    _serves(token_worker.pipe, mlp_root)


@pytest.mark.parametrize("which", ["missing", "wrong"])
def test_refused_control_calls_change_nothing(pki, token_worker, mlp_root, which) -> None:
    pipe = token_worker.pipe
    bad, good = _bad_client(pki, token_worker.address, which), pipe.clients[0]
    try:
        with pytest.raises(AuthError, match=r"LoadStage \(stage 0\): UNAUTHENTICATED"):
            bad.load_stage(pipe.specs[0], "intruder")
        with pytest.raises(AuthError, match="UnloadStage: UNAUTHENTICATED"):
            bad.unload_stage(pipe.pipeline_id)
        with pytest.raises(AuthError, match="EndSession: UNAUTHENTICATED"):
            bad.end_session(pipe.pipeline_id, "s")
        with pytest.raises(AuthError, match="UNAUTHENTICATED"):
            bad.describe_weights("mlp.safetensors")
    finally:
        bad.close()
    loaded = {s.pipeline_id for s in good.info().stages}
    assert loaded == {pipe.pipeline_id}  # nothing loaded for "intruder", nothing unloaded
    _serves(pipe, mlp_root)


def _events(call: grpc.RpcContext, until_request: int) -> list[pb.Event]:
    """Events of a subscription, heartbeats skipped, up to the one for ``until_request``."""
    seen = []
    for view in call:
        if view.msg.WhichOneof("kind") == "heartbeat":
            continue
        seen.append(view)
        if view.msg.request_id == until_request:
            return seen
    raise AssertionError(f"subscription ended before request {until_request}: {seen}")


def _push(client: WorkerClient, header: FrameHeader, x: np.ndarray) -> list[TransportError]:
    errors: list[TransportError] = []
    sender = client.sender(on_error=errors.append)
    try:
        for msg in split_frame(header, {"x": x}):
            sender.send(msg, timeout=20)
    except TransportError as exc:
        errors.append(exc)
    sender.close()
    return errors


@pytest.mark.parametrize("which", ["missing", "wrong"])
def test_push_without_the_token_runs_nothing(pki, token_worker, mlp_root, which) -> None:
    pipe, good = token_worker.pipe, token_worker.pipe.clients[0]
    watch = uuid.uuid4().hex
    sub = good.subscribe(pipe.pipeline_id, watch, pipe.key)
    try:
        bad = _bad_client(pki, token_worker.address, which)
        errors = _push(bad, FrameHeader(pipe.pipeline_id, "intruder", 0, 0, 1, watch,
                                       key=pipe.key), _x())  # the key alone is not enough
        bad.close()
        assert errors and all("UNAUTHENTICATED" in str(e) for e in errors), errors
        x = _x()
        assert _push(good, FrameHeader(pipe.pipeline_id, "", 0, 0, 2, watch, key=pipe.key),
                     x) == []
        events = _events(sub, until_request=2)
    finally:
        sub.cancel()
    # The refused frame (request 1) produced neither a result nor an error: it never ran.
    assert [e.msg.request_id for e in events] == [2]
    _, tensors = FrameAssembler().add(events[0].result)
    np.testing.assert_allclose(tensors["x"], mlp_reference(mlp_root, x), rtol=1e-5, atol=1e-6)
    _serves(pipe, mlp_root)


@pytest.mark.parametrize("which", ["missing", "wrong"])
def test_subscribe_without_the_token_takes_over_nothing(pki, token_worker, mlp_root,
                                                         which) -> None:
    pipe, good = token_worker.pipe, token_worker.pipe.clients[0]
    victim = uuid.uuid4().hex
    sub = good.subscribe(pipe.pipeline_id, victim, pipe.key)
    try:
        bad = _bad_client(pki, token_worker.address, which)
        stolen = bad.subscribe(pipe.pipeline_id, victim, pipe.key)  # the key alone is not enough
        with pytest.raises(grpc.RpcError) as info:
            next(iter(stolen))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert f"{which} credentials" in info.value.details()
        bad.close()
        # A second Subscribe with the same reply_to would have ended ours: it still delivers.
        x = _x()
        assert _push(good, FrameHeader(pipe.pipeline_id, "", 0, 0, 7, victim, key=pipe.key),
                     x) == []
        (event,) = _events(sub, until_request=7)
    finally:
        sub.cancel()
    _, tensors = FrameAssembler().add(event.result)
    np.testing.assert_allclose(tensors["x"], mlp_reference(mlp_root, x), rtol=1e-5, atol=1e-6)
    _serves(pipe, mlp_root)


def test_cli_status_with_and_without_the_token(pki, token_worker, mlp_root) -> None:
    ok = cli("status", "--workers", token_worker.address, "--token-file", pki.token)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(token_worker.worker.address)  # as the worker reports it
    assert token_worker.pipe.pipeline_id in ok.stdout
    assert_one_line_error(cli("status", "--workers", token_worker.address),
                          "Info: UNAUTHENTICATED: missing credentials")
    assert_one_line_error(cli("status", "--workers", token_worker.address,
                              "--token-file", pki.wrong_token),
                          "Info: UNAUTHENTICATED: wrong credentials")
    assert_one_line_error(cli("unload", "--workers", token_worker.address,
                              token_worker.pipe.pipeline_id),
                          "UnloadStage: UNAUTHENTICATED: missing credentials")
    assert_one_line_error(cli("status", "--workers", token_worker.address,
                              "--token-file", str(pki.dir / "nope")),
                          "token file '")
    _serves(token_worker.pipe, mlp_root)


# ---------------------------------------------------------------------------------------------
# Mutual TLS and a token, through a 2-worker pipeline


@pytest.fixture(scope="module")
def mtls_cluster(pki: types.SimpleNamespace, mlp_root: pathlib.Path):
    """Two workers that require the token and a client certificate; a 2-stage MLP on them."""
    cluster = Cluster.local(2, weights_roots=[str(mlp_root)], token_file=pki.token,
                            tls_cert=pki.cert, tls_key=pki.key, tls_ca=pki.ca)
    with cluster, cluster.deploy(mlp(), stages=2) as pipe:
        yield types.SimpleNamespace(cluster=cluster, pipe=pipe)


def test_pipeline_under_mtls_and_token_matches_single_process(mtls_cluster, mlp_root) -> None:
    pipe = mtls_cluster.pipe
    assert len({c.address for c in pipe.clients}) == 2
    assert pipe.specs[0].next_hop == pipe.clients[1].address  # worker 0 dials worker 1
    xs = [_x() for _ in range(6)]
    outs = [pipe.call(x=xs[0], timeout=60), *pipe.stream([{"x": x} for x in xs[1:]], depth=3)]
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(out["x"], mlp_reference(mlp_root, x), rtol=1e-5, atol=1e-6)


def test_cli_status_under_mtls(pki, mtls_cluster) -> None:
    workers = ",".join(mtls_cluster.cluster.addresses)
    ok = cli("status", "--workers", workers, "--json", "--token-file", pki.token,
             "--tls-cert", pki.cert, "--tls-key", pki.key, "--tls-ca", pki.ca)
    assert ok.returncode == 0, ok.stderr
    assert mtls_cluster.pipe.pipeline_id in ok.stdout
    assert_one_line_error(cli("status", "--workers", workers, "--timeout", "2",
                              "--token-file", pki.token),
                          "this client connects in plaintext; if the worker serves TLS")


@pytest.mark.parametrize("case", ["plaintext", "no client certificate",
                                  "certificate of another CA", "worker not trusted"])
def test_mtls_refuses_the_handshake(pki, mtls_cluster, mlp_root, case) -> None:
    files = {"plaintext": {},
             "no client certificate": {"tls_ca": pki.ca},
             "certificate of another CA": {"tls_ca": pki.ca, "tls_cert": pki.rogue_cert,
                                           "tls_key": pki.rogue_key},
             "worker not trusted": {"tls_ca": pki.other_ca, "tls_cert": pki.cert,
                                    "tls_key": pki.key}}[case]
    address = mtls_cluster.cluster.addresses[0]
    client = _client(address, token_file=pki.token, **files)
    try:
        with pytest.raises(TransportError, match=f"worker {address}: Info: UNAVAILABLE: .* "
                                                 r"\((this client connects in plaintext|the "
                                                 r"TLS handshake failed)"):
            client.info()
    finally:
        client.close()
    _serves(mtls_cluster.pipe, mlp_root)


def test_mtls_with_certificate_but_no_token_is_unauthenticated(pki, mtls_cluster,
                                                                mlp_root) -> None:
    address = mtls_cluster.cluster.addresses[1]
    client = _client(address, tls_ca=pki.ca, tls_cert=pki.cert, tls_key=pki.key)
    try:
        with pytest.raises(AuthError, match="Info: UNAUTHENTICATED: missing credentials"):
            client.info()
    finally:
        client.close()
    _serves(mtls_cluster.pipe, mlp_root)


def _data_handshake(address: str, **files: str | None) -> object:
    """The data port's handshake (``transport/stream.py``), with the TLS and token of
    ``files`` (as a worker dials its next hop); returns the hello, or raises."""
    import asyncio

    from jaxdist.core.transport import stream

    auth = client_auth(**files)
    host, _, port = address.rpartition(":")

    async def shake() -> object:
        async with asyncio.timeout(60):  # a bound on the test: the worker closes long before
            reader, writer = await asyncio.open_connection(
                host, int(port), ssl=auth.ssl_context,
                server_hostname=host if auth.ssl_context else None)
            try:
                return await stream.client_handshake(reader, writer, key=auth.hmac_key,
                                                     peer=address)
            finally:
                writer.close()

    return asyncio.run(shake())


def test_data_connections_under_mtls_and_token(pki, mtls_cluster, mlp_root) -> None:
    """Worker 0 reaches worker 1's data port with TLS, its client certificate and the proof of
    the token; the same worker refuses a data connection that lacks any of them."""
    import ssl

    pipe = mtls_cluster.pipe
    data = f"127.0.0.1:{pipe.clients[1].info().data_port}"
    assert pipe.specs[0].next_data_hop == data
    routes = {st.stage_index: st.route for st in pipe.clients[0].info().stages
              if st.pipeline_id == pipe.pipeline_id}
    assert routes == {0: "tcp"}
    good = {"tls_ca": pki.ca, "tls_cert": pki.cert, "tls_key": pki.key}
    assert _data_handshake(data, token_file=pki.token, **good).needs_token
    with pytest.raises(AuthError, match="missing credentials: this worker's data port requires"):
        _data_handshake(data, **good)
    with pytest.raises(AuthError, match="wrong credentials"):
        _data_handshake(data, token_file=pki.wrong_token, **good)
    for files in ({}, {"tls_ca": pki.ca}, {"tls_ca": pki.ca, "tls_cert": pki.rogue_cert,
                                           "tls_key": pki.rogue_key},
                  {"tls_ca": pki.other_ca, "tls_cert": pki.cert, "tls_key": pki.key}):
        # plaintext, no client certificate, one of another CA, a worker not trusted
        with pytest.raises((TransportError, ssl.SSLError, ConnectionError)):
            _data_handshake(data, token_file=pki.token, **files)
    _serves(pipe, mlp_root)


# ---------------------------------------------------------------------------------------------
# TLS without authentication, on all interfaces


def test_tls_only_worker_on_all_interfaces_warns_and_serves_tls(pki) -> None:
    (w,) = spawn_workers(1, tls_cert=pki.cert, tls_key=pki.key,
                         extra_args=["--listen", "0.0.0.0:0"])
    try:
        log = pathlib.Path(w.log_path).read_text()
        assert "WARNING: this worker listens on 0.0.0.0, which is not loopback, WITHOUT " \
               "AUTHENTICATION." in log
        assert len([line for line in log.splitlines() if line.startswith("WARNING:")]) >= 4
        address = "127.0.0.1:" + w.address.rpartition(":")[2]
        plain = _client(address)
        with pytest.raises(TransportError, match="this client connects in plaintext"):
            plain.info()
        plain.close()
        untrusting = _client(address, tls_ca=pki.other_ca)
        with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED.*the TLS handshake "
                                                 "failed"):
            untrusting.info()
        untrusting.close()
        verified = _client(address, tls_ca=pki.ca)  # TLS with the right CA, no client cert
        try:
            assert verified.info().address == w.address
        finally:
            verified.close()
    finally:
        stop_workers([w])


# ---------------------------------------------------------------------------------------------
# The CLI: the same options on every subcommand that dials workers


@pytest.mark.parametrize("argv", [["generate"], ["embed", "--model", "m", "--text", "t"],
                                  ["deploy", "--manifest", "m", "--workers", "w"],
                                  ["unload", "--workers", "w", "p"], ["status", "--workers", "w"],
                                  ["demo"]])
def test_cli_subcommands_take_the_credential_options(argv: list[str]) -> None:
    opts = build_parser().parse_args([*argv, "--token-file", "T", "--tls-cert", "C",
                                      "--tls-key", "K", "--tls-ca", "A"])
    assert (opts.token_file, opts.tls_cert, opts.tls_key, opts.tls_ca) == ("T", "C", "K", "A")


def test_cli_demo_spawns_local_workers_with_the_same_credentials(pki) -> None:
    proc = cli("demo", "--local", "2", "--width", "32", "--layers", "2", "--token-file",
               pki.token, "--tls-cert", pki.cert, "--tls-key", pki.key, "--tls-ca", pki.ca)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("ok")  # the demo's own check against numpy passed
