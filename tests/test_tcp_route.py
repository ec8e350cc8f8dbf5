"""The TCP route between workers (``worker/tcp_route.py``, ``worker/data_listener.py``,
``jaxdist/core/transport/stream.py``) with real worker processes on loopback.

Parity: the same pipeline gives bit-identical outputs over the TCP route and over gRPC, equal
to a single-process ``jax.jit`` of the same function; SmolLM2 greedy decoding across two workers
gives the same tokens over both routes, and transformers' tokens. Refusals: a missing or wrong
proof of the token, a client that never finishes the handshake, a declared length over the
limit and a message that is not a ``Frame`` each close that connection, and the same worker
then still serves. A next hop without a data port is reached over gRPC, and status says so. A
killed next hop is named and failed over as on gRPC. A relay between two workers sees the frames
but never the token (SECURITY.md, "The data port").
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from deploy_utils import cli
from llm_utils import generate
from models import mlp, mlp_jit, mlp_reference

from jaxdist.coordinator.cluster import Cluster
from jaxdist.core.errors import AuthError, CodecError, LimitError, RemoteStageError
from jaxdist.core.transport import stream

D = 32
TOKEN = "tcp-route-token-7c1d9e0f2a4b6c8d"
RNG = np.random.default_rng(5)


def _x(b: int = 4) -> np.ndarray:
    return RNG.standard_normal((b, D)).astype(np.float32)


@pytest.fixture(scope="module")
def tcp_cluster(mlp_root: pathlib.Path, smollm2: pathlib.Path) -> Iterator[Cluster]:
    """Three workers with their default data port: the TCP route between them."""
    with Cluster.local(3, weights_roots=[str(mlp_root), str(smollm2.parent)]) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_cluster(mlp_root: pathlib.Path, smollm2: pathlib.Path) -> Iterator[Cluster]:
    """Three workers started with ``--data-listen off``: frames between them over gRPC."""
    with Cluster.local(3, weights_roots=[str(mlp_root), str(smollm2.parent)],
                       extra_args=["--data-listen", "off"]) as c:
        yield c


@pytest.fixture(scope="module")
def token_cluster(mlp_root: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Cluster]:
    """Two workers that require a token, with a 1 MiB frame limit."""
    token = tmp_path_factory.mktemp("token") / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    with Cluster.local(2, weights_roots=[str(mlp_root)], token_file=str(token),
                       extra_args=["--max-frame-bytes", "1MiB"]) as c:
        yield c


def _routes(cluster: Cluster, pipeline_id: str) -> list[str]:
    """The route each stage of a pipeline reports in ``Info``, by stage index."""
    found = {st.stage_index: st.route for info in cluster.info() for st in info.stages
             if st.pipeline_id == pipeline_id}
    return [found[k] for k in sorted(found)]


def _data_address(cluster: Cluster, k: int) -> str:
    return f"127.0.0.1:{cluster.clients[k].info().data_port}"


def _serves(pipe: Any, root: pathlib.Path) -> None:
    x = _x()
    np.testing.assert_allclose(pipe.call({"x": x}, timeout=60)["x"], mlp_reference(root, x),
                               rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Parity


def test_three_stages_over_tcp_and_grpc_equal_a_single_jit(tcp_cluster: Cluster,
                                                            grpc_cluster: Cluster,
                                                            mlp_root: pathlib.Path) -> None:
    model = mlp()
    whole = mlp_jit(mlp_root, model)  # the same units, one process, one jit
    xs = [_x() for _ in range(5)]
    want = [np.asarray(whole(x)) for x in xs]
    outs = {}
    for name, cluster in (("tcp", tcp_cluster), ("grpc", grpc_cluster)):
        with cluster.deploy(model, split=[2, 1, 1], platforms=("cpu",)) as pipe:
            hops = [s.next_data_hop for s in pipe.specs]
            if name == "tcp":
                assert hops == [_data_address(cluster, 1), _data_address(cluster, 2), ""]
            else:
                assert hops == ["", "", ""]
            assert _routes(cluster, pipe.pipeline_id) == [name, name, "grpc"]
            assert [load.route for load in cluster.stage_loads(pipe.pipeline_id)] == [
                name, name, "grpc"]
            outs[name] = [pipe.call({"x": xs[0]}, timeout=60)["x"],
                          *(o["x"] for o in pipe.stream([{"x": x} for x in xs[1:]], depth=3))]
    for got_tcp, got_grpc, w in zip(outs["tcp"], outs["grpc"], want):
        np.testing.assert_array_equal(got_tcp, got_grpc)
        np.testing.assert_allclose(got_tcp, w, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_smollm2_greedy_over_tcp_matches_grpc_and_transformers(tcp_cluster: Cluster,
                                                               grpc_cluster: Cluster,
                                                               smollm2: pathlib.Path,
                                                               smollm2_reference: Any) -> None:
    from jaxdist.exporters.llama import llama_model

    prompt, want = smollm2_reference
    n_new = 24
    tokens = {}
    for name, cluster in (("tcp", tcp_cluster), ("grpc", grpc_cluster)):
        # Dequantized float32, as transformers computes: its tokens are the reference.
        model = llama_model(smollm2.name, roots=[smollm2.parent], max_slots=1, max_seq=128,
                            quantized=False)
        with cluster.deploy(model, stages=2, workers=cluster.addresses[:2],
                            platforms=("cpu",)) as pipe:
            assert _routes(cluster, pipe.pipeline_id) == [name, "grpc"]
            tokens[name], _ = generate(pipe, [prompt], n_new, bucket=16)
    assert tokens["tcp"] == tokens["grpc"]
    assert tokens["tcp"][0][:len(want)] == want


# ---------------------------------------------------------------------------------------------
# Which route, shown


def test_a_next_hop_without_a_data_port_is_reached_over_grpc_and_status_says_so(
        tcp_cluster: Cluster, grpc_cluster: Cluster, mlp_root: pathlib.Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """Stage 0 on a worker with a data port, stage 1 on one with ``--data-listen off``, stage 2
    on one with a data port again: grpc, then tcp (a worker without a data port of its own
    still dials the next one's)."""
    workers = [tcp_cluster.addresses[0], grpc_cluster.addresses[0], tcp_cluster.addresses[1]]
    with Cluster.connect(workers) as mixed, caplog.at_level("WARNING"), \
            mixed.deploy(mlp(), split=[2, 1, 1], platforms=("cpu",)) as pipe:
        assert [s.next_data_hop for s in pipe.specs] == ["", _data_address(tcp_cluster, 1), ""]
        _serves(pipe, mlp_root)
        assert _routes(mixed, pipe.pipeline_id) == ["grpc", "tcp", "grpc"]
        table = cli("status", "--workers", ",".join(workers))
        as_json = cli("status", "--workers", ",".join(workers), "--json")
    assert table.returncode == 0 and as_json.returncode == 0, table.stderr + as_json.stderr
    logged = [r.getMessage() for r in caplog.records]
    assert any(f"stage 0 sends to stage 1 over gRPC: worker {workers[1]} has no data port"
               in m for m in logged), logged
    replies = json.loads(as_json.stdout)
    assert [r.get("data_port", 0) > 0 for r in replies] == [True, False, True]
    routes = [s["route"] for r in replies for s in r["stages"]
              if s["pipeline_id"] == pipe.pipeline_id]
    assert routes == ["grpc", "tcp", "grpc"]
    rows = [line.split() for line in table.stdout.splitlines() if pipe.pipeline_id in line]
    assert [(row[1], row[-2]) for row in rows] == [("0", "grpc"), ("1", "tcp"), ("2", "grpc")]
    assert "data port: off" in table.stdout


# ---------------------------------------------------------------------------------------------
# The data port refuses, and keeps serving


async def _handshake(address: str, key: bytes | None) -> stream.Hello:
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        return await stream.client_handshake(reader, writer, key=key, peer=address)
    finally:
        writer.close()


async def _send_after_handshake(address: str, key: bytes | None, data: bytes
                                ) -> Exception | None:
    """Handshake, write ``data`` raw, and read what the worker says before it closes."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await stream.client_handshake(reader, writer, key=key, peer=address)
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(60):
            said = await stream.read_status(reader, address)
            assert await reader.read() == b""  # then it closed the connection
        return said
    finally:
        writer.close()


def test_error_data_connection_without_the_token(token_cluster: Cluster,
                                                 mlp_root: pathlib.Path) -> None:
    with token_cluster.deploy(mlp(), stages=2, platforms=("cpu",)) as pipe:
        assert _routes(token_cluster, pipe.pipeline_id) == ["tcp", "grpc"]  # the right proof
        address = _data_address(token_cluster, 1)
        with pytest.raises(AuthError, match=f"data port {address}: missing credentials: this "
                                            f"worker's data port requires a proof of its token"):
            asyncio.run(_handshake(address, None))
        _serves(pipe, mlp_root)


def test_error_data_connection_with_a_wrong_token(token_cluster: Cluster,
                                                  mlp_root: pathlib.Path) -> None:
    with token_cluster.deploy(mlp(), stages=2, platforms=("cpu",)) as pipe:
        address = _data_address(token_cluster, 1)
        with pytest.raises(AuthError, match="wrong credentials: the proof does not match this "
                                            "worker's --token-file"):
            asyncio.run(_handshake(address, b"not-the-token-000000000000"))
        assert asyncio.run(_handshake(address, TOKEN.encode())).needs_token  # the right one
        _serves(pipe, mlp_root)


def test_error_a_silent_connection_is_closed_after_the_handshake_timeout(
        token_cluster: Cluster, mlp_root: pathlib.Path) -> None:
    async def silent(address: str) -> bytes:
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            async with asyncio.timeout(60):  # a bound on the test, not the assertion
                return await reader.read()  # the hello, then nothing: until the worker closes
        finally:
            writer.close()

    with token_cluster.deploy(mlp(), stages=2, platforms=("cpu",)) as pipe:
        got = asyncio.run(silent(_data_address(token_cluster, 1)))
        assert got.startswith(stream.MAGIC)  # the hello only; the connection then ended
        _serves(pipe, mlp_root)


def test_error_oversized_declared_message(token_cluster: Cluster,
                                          mlp_root: pathlib.Path) -> None:
    declared = 1 << 31
    with token_cluster.deploy(mlp(), stages=2, platforms=("cpu",)) as pipe:
        address = _data_address(token_cluster, 1)
        hello = asyncio.run(_handshake(address, TOKEN.encode()))
        assert hello.max_message == (1 << 20) + (1 << 20)  # --max-frame-bytes 1MiB + headers
        said = asyncio.run(_send_after_handshake(address, TOKEN.encode(),
                                                 declared.to_bytes(4, "little")))
        assert isinstance(said, LimitError)
        assert f"declares {declared} bytes, over this worker's limit of {hello.max_message}" \
               " bytes per message (--max-frame-bytes=1048576" in str(said)
        _serves(pipe, mlp_root)


def test_error_a_message_that_is_not_a_frame(token_cluster: Cluster,
                                             mlp_root: pathlib.Path) -> None:
    junk = b"\xff" * 40
    with token_cluster.deploy(mlp(), stages=2, platforms=("cpu",)) as pipe:
        said = asyncio.run(_send_after_handshake(_data_address(token_cluster, 1),
                                                 TOKEN.encode(),
                                                 len(junk).to_bytes(4, "little") + junk))
        assert isinstance(said, CodecError) and "malformed Frame message (40 bytes)" in str(said)
        _serves(pipe, mlp_root)


# ---------------------------------------------------------------------------------------------
# The token never crosses the wire


class Relay:
    """A TCP relay on loopback (its own loop thread) that records what its clients send."""

    def __init__(self, target: str) -> None:
        self.sent = bytearray()
        self._target = target
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(10)
        self.address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, _, port = self._target.rpartition(":")
        up_reader, up_writer = await asyncio.open_connection(host, int(port))

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       record: bool) -> None:
            while data := await src.read(1 << 16):
                if record:
                    self.sent += data
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False),
                             return_exceptions=True)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def test_a_relay_between_workers_sees_frames_but_never_the_token(
        token_cluster: Cluster, mlp_root: pathlib.Path) -> None:
    """Stage 0 is sent through a relay to stage 1's data port: the pipeline works, the relay
    saw the frames (plaintext: SECURITY.md says so), and nothing it saw holds the token: the
    handshake's answer is a hop answer, a proof of the pipeline's own credential."""
    relay = Relay(_data_address(token_cluster, 1))
    try:
        with token_cluster.deploy(mlp(), stages=2, platforms=("cpu",)) as pipe:
            spec = pipe.specs[0].replace(next_data_hop=relay.address)
            token_cluster.clients[0].load_stage(spec, pipe.pipeline_id, key=pipe.key)
            x = np.full((4, D), 0.25, np.float32)
            np.testing.assert_allclose(pipe.call({"x": x}, timeout=60)["x"],
                                       mlp_reference(mlp_root, x), rtol=1e-5, atol=1e-6)
            assert len(relay.sent) > x.nbytes and pipe.pipeline_id.encode() in relay.sent
            assert TOKEN.encode() not in relay.sent
            assert relay.sent[:5] == stream.MAGIC + bytes((stream.HOP_VERSION,))
            assert relay.sent[39:39 + len(pipe.pipeline_id)] == pipe.pipeline_id.encode()
            assert TOKEN.encode().hex().encode() not in relay.sent
    finally:
        relay.close()


# ---------------------------------------------------------------------------------------------
# Failures of the next hop


def test_an_unreachable_data_port_names_the_next_hop(tcp_cluster: Cluster) -> None:
    """The route reports a refused connection as UNAVAILABLE for the next stage, as the gRPC
    route does, so the coordinator names that worker."""
    with tcp_cluster.deploy(mlp(), stages=2, workers=tcp_cluster.addresses[:2],
                            platforms=("cpu",)) as pipe:
        nowhere = "127.0.0.1:1"  # nothing listens on port 1
        spec = pipe.specs[0].replace(next_data_hop=nowhere)
        tcp_cluster.clients[0].load_stage(spec, pipe.pipeline_id, key=pipe.key)
        with pytest.raises(RemoteStageError) as err:
            pipe.call({"x": _x()}, timeout=60)
        for client in tcp_cluster.clients[:2]:  # a broken pipeline leaves its stages loaded
            client.unload_stage(pipe.pipeline_id)
    assert err.value.address == tcp_cluster.addresses[1]
    assert "worker died or became unreachable" in str(err.value)
    assert f"stage 0 could not forward to stage 1 at {tcp_cluster.addresses[1]} (data port " \
           f"{nowhere})" in str(err.value)


def test_a_next_hop_killed_mid_stream_fails_over_to_a_spare(mlp_root: pathlib.Path) -> None:
    with Cluster.local(2, weights_roots=[str(mlp_root)], spares=1) as cluster:
        victim = cluster.local_workers[1]
        spare = cluster.spares[0]
        with cluster.deploy(mlp(), stages=2, platforms=("cpu",)) as pipe:
            assert _routes(cluster, pipe.pipeline_id) == ["tcp", "grpc"]
            _serves(pipe, mlp_root)
            pending = [pipe.submit({"x": _x()}) for _ in range(8)]
            victim.process.send_signal(signal.SIGKILL)
            assert victim.process.wait(timeout=30) == -signal.SIGKILL
            with pytest.raises(RemoteStageError, match=victim.address) as err:
                for f in pending:
                    f.result(timeout=60)
                while True:  # the frames in flight may have finished before the kill
                    pipe.submit({"x": _x()}).result(timeout=60)
            assert err.value.address == victim.address
            (moved,) = pipe.recover()
            assert (moved.stages, moved.failed, moved.spare) == ((1,), victim.address, spare)
            assert pipe.specs[0].next_data_hop == f"127.0.0.1:{pipe.clients[1].info().data_port}"
            assert _routes(cluster, pipe.pipeline_id) == ["tcp", "grpc"]
            _serves(pipe, mlp_root)
