"""The coordinator's data path over the workers' data ports (``jaxdist/coordinator/datapath.py``,
the events mode of ``worker/data_listener.py``), with real worker processes on loopback.

Parity: the same pipeline gives bit-identical outputs with the coordinator's frames and events
over the data ports and over gRPC, equal to a single-process ``jax.jit`` of the same function.
Threads: over the data ports a coordinator runs one data-loop thread whatever its number of
workers, and no listener thread per worker (gRPC: one per worker). A worker without a data port
is reached over gRPC, logged, and ``Pipeline.links`` says so, as is one whose ``Info``
fails when the pipeline connects (injected). Refusals on the events mode: a
wrong pipeline key, a malformed request, an unknown mode, and a silent subscriber (dropped with
the bound, which it reads at the end); the worker goes on serving.
"""

from __future__ import annotations

import asyncio
import pathlib
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from models import mlp, mlp_jit, mlp_reference

from jaxdist.coordinator.cluster import Cluster
from jaxdist.core.errors import CodecError, LimitError, PipelineKeyError, TransportError
from jaxdist.core.transport import frames, stream
from jaxdist.core.transport.client import WorkerClient
from jaxdist.core.transport.dataconn import data_address
from jaxdist.core.transport.frames import FrameHeader, split_frame
from jaxdist.proto import jaxdist_pb2 as pb

D = 32
RNG = np.random.default_rng(11)


def _x(b: int = 4) -> np.ndarray:
    return RNG.standard_normal((b, D)).astype(np.float32)


@pytest.fixture(scope="module")
def cluster(mlp_root: pathlib.Path) -> Iterator[Cluster]:
    with Cluster.local(3, weights_roots=[str(mlp_root)],
                       extra_args=["--max-subscriber-events", "8"]) as c:
        yield c


def _data_address(cluster: Cluster, k: int) -> str:
    return f"127.0.0.1:{cluster.clients[k].info().data_port}"


def _threads(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


# ---------------------------------------------------------------------------------------------
# Parity, and what it runs on


def test_frames_and_events_over_the_data_ports_equal_grpc_and_a_single_jit(
        cluster: Cluster, mlp_root: pathlib.Path) -> None:
    model = mlp()
    whole = mlp_jit(mlp_root, model)  # the same units, one process, one jit
    xs = [_x() for _ in range(6)]
    want = [np.asarray(whole(x)) for x in xs]
    outs = {}
    for path in ("tcp", "grpc"):
        with Cluster.connect(cluster.addresses, data_path=path) as c, \
                c.deploy(model, split=[2, 1, 1], platforms=("cpu",)) as pipe:
            assert set(pipe.links.values()) == {path} and len(pipe.links) == 3
            listeners = _threads("sub-")
            if path == "tcp":  # one loop thread for every connection, no thread per worker
                assert listeners == [] and _threads("jaxdist-data") == ["jaxdist-data"]
            else:
                assert sorted(listeners) == sorted(f"sub-{a}" for a in cluster.addresses)
            outs[path] = [pipe.call({"x": xs[0]}, timeout=60)["x"],
                          *(o["x"] for o in pipe.stream([{"x": x} for x in xs[1:]], depth=4))]
    for got_tcp, got_grpc, w in zip(outs["tcp"], outs["grpc"], want, strict=True):
        np.testing.assert_array_equal(got_tcp, got_grpc)
        np.testing.assert_allclose(got_tcp, w, rtol=1e-6, atol=1e-6)


def test_a_stage_error_comes_back_over_the_events_connection(cluster: Cluster) -> None:
    with cluster.deploy(mlp(), stages=2, platforms=("cpu",)) as pipe:
        assert set(pipe.links.values()) == {"tcp"}
        with pytest.raises(Exception, match="stage 0") as err:
            pipe.call({"x": np.zeros((4, D + 1), np.float32)}, timeout=60)
        assert "x" in str(err.value)
        np.testing.assert_equal(pipe.call({"x": _x()}, timeout=60)["x"].shape, (4, D))
        assert pipe.broken is None


def test_a_worker_without_a_data_port_is_reached_over_grpc_and_logged(
        cluster: Cluster, mlp_root: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    with Cluster.local(1, weights_roots=[str(mlp_root)],
                       extra_args=["--data-listen", "off"]) as off:
        workers = [cluster.addresses[0], off.addresses[0]]
        with Cluster.connect(workers) as mixed, caplog.at_level("WARNING"):
            _deploy_second_over_grpc(mixed, mlp_root)
    _assert_logged(caplog, f"reaches worker {workers[1]} over gRPC", "no data port")


def _deploy_second_over_grpc(cluster: Cluster, root: pathlib.Path) -> None:
    """Deploy 2 stages on the cluster's 2 workers; the second must be reached over gRPC and
    the pipeline must still answer as the reference does."""
    with cluster.deploy(mlp(), stages=2, platforms=("cpu",)) as pipe:
        assert pipe.links == {cluster.addresses[0]: "tcp", cluster.addresses[1]: "grpc"}
        x = _x()
        np.testing.assert_allclose(pipe.call({"x": x}, timeout=60)["x"],
                                   mlp_reference(root, x), rtol=1e-5, atol=1e-6)


def _assert_logged(caplog: pytest.LogCaptureFixture, *parts: str) -> None:
    """Some record's message holds every one of ``parts``."""
    logged = [r.getMessage() for r in caplog.records]
    assert any(all(p in m for p in parts) for m in logged), (parts, logged)


def test_a_worker_whose_info_fails_at_connect_is_reached_over_grpc_and_logged(
        cluster: Cluster, mlp_root: pathlib.Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The failure is injected (a real worker's Info fails only in passing, between the plan and
    the pipeline's connect): ``Info`` fails only when the pipeline asks for the data port, not
    when the deploy plans the hops between workers."""
    workers = cluster.addresses[:2]
    with Cluster.connect(workers) as c:
        flaky = c.clients[1]
        real_info = flaky.info

        def info(*args: object, **kwargs: object) -> pb.InfoReply:
            caller = sys._getframe(1).f_code
            if caller.co_name == "_data_hop" and caller.co_filename.endswith("pipeline.py"):
                raise TransportError(f"worker {flaky.address}: Info: UNAVAILABLE (injected)")
            return real_info(*args, **kwargs)

        monkeypatch.setattr(flaky, "info", info)
        with caplog.at_level("WARNING"):
            _deploy_second_over_grpc(c, mlp_root)
    _assert_logged(caplog, f"reaches worker {workers[1]} over gRPC",
                   "its Info failed (TransportError:", "injected")


# ---------------------------------------------------------------------------------------------
# The events mode refuses, and the worker keeps serving


async def _events(address: str, request: bytes | None, *, mode: int = stream.MODE_EVENTS,
                  read: bool = True) -> tuple[list[frames.EventView], Exception | None]:
    """Subscribe raw over a data port; the events read until the goodbye, and the goodbye."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await stream.client_handshake(reader, writer, key=None, peer=address, mode=mode)
        if request is not None:
            stream.write_message(writer, request)
            await writer.drain()
        async with asyncio.timeout(60):  # a bound on the test, not the assertion
            return await _read_events(reader, address, 1 if not read else None)
    finally:
        writer.close()


async def _read_events(reader: asyncio.StreamReader, address: str, most: int | None = None
                       ) -> tuple[list[frames.EventView], Exception | None]:
    """Events until the goodbye (or ``most`` of them), and what the goodbye said."""
    got: list[frames.EventView] = []
    while most is None or len(got) < most:
        data = await stream.read_message(reader, 1 << 30, "test")
        if data is None:
            break
        if not data:
            return got, await stream.read_status(reader, address)
        got.append(frames.parse_event(data))
    return got, None


def test_error_events_with_a_wrong_pipeline_key(cluster: Cluster,
                                                mlp_root: pathlib.Path) -> None:
    with cluster.deploy(mlp(), stages=2, platforms=("cpu",)) as pipe:
        assert pipe.key  # a leased pipeline: this coordinator's alone
        request = pb.SubscribeRequest(pipeline_id=pipe.pipeline_id, reply_to="other",
                                      pipeline_key=b"k" * 32).SerializeToString()
        got, said = asyncio.run(_events(_data_address(cluster, 1), request))
        assert got == [] and isinstance(said, PipelineKeyError)
        assert "loaded by another coordinator" in str(said) and pipe.pipeline_id in str(said)
        x = _x()
        np.testing.assert_allclose(pipe.call({"x": x}, timeout=60)["x"],
                                   mlp_reference(mlp_root, x), rtol=1e-5, atol=1e-6)


def test_error_events_with_a_malformed_request(cluster: Cluster) -> None:
    got, said = asyncio.run(_events(_data_address(cluster, 0), b"\xff" * 9))
    assert got == [] and isinstance(said, CodecError)
    assert "malformed SubscribeRequest (9 bytes)" in str(said)
    assert cluster.clients[0].info().address  # still serving


def test_error_an_unknown_mode_is_refused(cluster: Cluster) -> None:
    with pytest.raises(CodecError, match=r"asks for mode 7 of the data protocol; this worker "
                                         r"knows modes \[0, 1\]"):
        asyncio.run(_events(_data_address(cluster, 0), None, mode=7))


def test_error_a_subscribe_request_that_stops_midway_is_closed(cluster: Cluster) -> None:
    """The events mode's request declares 64 bytes and sends 2: the worker closes the
    connection within its handshake bound (one timer, ``stream.IdleWatch``) and keeps serving."""
    async def main() -> bytes:
        host, _, port = _data_address(cluster, 0).rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            await stream.client_handshake(reader, writer, key=None, peer=host,
                                          mode=stream.MODE_EVENTS)
            writer.write((64).to_bytes(4, "little") + b"\x0a\x01")
            await writer.drain()
            async with asyncio.timeout(60):  # a bound on the test; the worker's is 5 s
                return await reader.read()  # until the worker closes
        finally:
            writer.close()

    assert asyncio.run(main()) == b""  # closed, and nothing sent
    assert cluster.clients[0].info().address  # still serving


def test_a_silent_events_subscriber_costs_only_itself(cluster: Cluster,
                                                      mlp_root: pathlib.Path) -> None:
    """A subscriber that reads nothing while its pipeline's results flood in is dropped with
    the worker's bound (it reads why after the events that were on their way); the pipeline's
    own caller is served meanwhile."""
    wide = 1 << 18  # floats per row: 1 MiB results, so the socket's buffers fill fast
    from test_datapath import wide_model

    with cluster.deploy(wide_model(), stages=2, platforms=("cpu",)) as pipe:
        request = pb.SubscribeRequest(pipeline_id=pipe.pipeline_id, reply_to="silent",
                                      pipeline_key=pipe.key).SerializeToString()
        address = _data_address(cluster, 1)

        async def silent_then_read() -> tuple[list[frames.EventView], Exception | None]:
            host, _, port = address.rpartition(":")
            reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 22)
            try:
                await stream.client_handshake(reader, writer, key=None, peer=address,
                                              mode=stream.MODE_EVENTS)
                stream.write_message(writer, request)
                await writer.drain()
                (first,), _ = await _read_events(reader, address, 1)
                assert first.msg.WhichOneof("kind") == "heartbeat"  # registered
                await asyncio.to_thread(_flood_and_serve)  # read nothing meanwhile
                async with asyncio.timeout(120):  # a bound on the test
                    return await _read_events(reader, address)
            finally:
                writer.close()

        def _flood_and_serve() -> None:
            client = WorkerClient(pipe.clients[0].address)
            sender = client.sender()
            x = np.ones((1, wide), np.float32)
            for i in range(64):
                sender.send_frame(split_frame(FrameHeader(pipe.pipeline_id, "", 0, 0, 10_000 + i,
                                                          "silent", key=pipe.key), {"x": x}),
                                  timeout=30)
            sender.close()
            client.close()
            y = RNG.standard_normal((1, wide)).astype(np.float32)
            np.testing.assert_array_equal(pipe.call({"x": y}, timeout=60)["x"], y)

        got, said = asyncio.run(silent_then_read())
        assert isinstance(said, LimitError), said
        assert f"the subscriber of pipeline {pipe.pipeline_id} is not reading" in str(said)
        assert len(got) < 64  # dropped: not every result was kept for it
        assert pipe.broken is None


def test_data_address_keeps_the_host_a_worker_is_dialled_at() -> None:
    assert data_address("10.0.0.5:50051", 7000) == "10.0.0.5:7000"
    assert data_address("[::1]:50051", 7000) == "[::1]:7000"
    assert data_address("worker-3.jaxdist.svc:50051", 50052) == "worker-3.jaxdist.svc:50052"
