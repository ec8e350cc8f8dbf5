"""The data path's seam: every pipeline edge is its own, and nothing one caller does on a shared
worker holds up another caller.

Real workers on loopback. The "attacker" is a second client holding the same worker token (no
token here): it subscribes to a pipeline's results under its own ``reply_to``, floods the
pipeline with frames whose results go to that subscription, and never reads. Before the seam,
the worker's stage waited up to 30 s on that subscription inside the egress every caller
shares, and across workers the pipelines' frames shared one ``Push`` stream; now the subscriber
is dropped with ``RESOURCE_EXHAUSTED``, which it sees, and the other callers go on.
"""

from __future__ import annotations

import contextlib
import itertools
import pathlib
import threading
import time
from collections.abc import Iterator

import grpc
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from models import mlp, mlp_reference

from jaxdist.coordinator.cluster import Cluster
from jaxdist.core.transport.client import WorkerClient
from jaxdist.core.transport.frames import FrameHeader, split_frame
from jaxdist.export.model import Model, Unit

WIDE = 1 << 18  # floats per row of the flood: 1 MiB frames, so gRPC's own buffers fill fast
D = 32


def _identity(p, st, c):
    return {"x": c["x"] + 0}, {}


def wide_model() -> Model:
    return Model("wide", [Unit("a", _identity), Unit("b", _identity)],
                 inputs={"x": (f"b, {WIDE}", "float32")}, buckets=[{"b": 1}])


@pytest.fixture(scope="module")
def cluster(mlp_root: pathlib.Path) -> Iterator[Cluster]:
    with Cluster.local(2, weights_roots=[str(mlp_root)], heartbeat_timeout=10.0,
                       extra_args=["--max-subscriber-events", "8"]) as c:
        yield c


def _flood(client: WorkerClient, pipeline_id: str, reply_to: str, frames: int,
           key: bytes = b"") -> None:
    """Frames into stage 0 of ``pipeline_id`` (whose key is ``key``) whose results go to
    ``reply_to``."""
    sender = client.sender()
    x = np.ones((1, WIDE), np.float32)
    for i in range(frames):
        for msg in split_frame(FrameHeader(pipeline_id, "", 0, 0, 10_000 + i, reply_to,
                                           key=key), {"x": x}):
            sender.send(msg, timeout=30)
    sender.close()


def test_a_silent_subscriber_costs_only_itself(cluster: Cluster,
                                               mlp_root: pathlib.Path) -> None:
    """Two pipelines over the same two workers. A silent subscriber of one of them, flooded,
    is dropped with an error it sees; both pipelines keep serving their own callers. (The
    subscriber holds the pipeline's key, as a buggy or stalled coordinator of its own would:
    without it, Subscribe is refused, see test_pipeline_keys.py.)"""
    victim = cluster.deploy(mlp(), stages=2, platforms=("cpu",))
    flooded = cluster.deploy(wide_model(), stages=2, platforms=("cpu",))
    with victim, flooded:
        assert [c.address for c in victim.clients] == [c.address for c in flooded.clients]
        last = WorkerClient(flooded.clients[1].address)
        silent = last.subscribe(flooded.pipeline_id, "attacker", flooded.key)
        first = WorkerClient(flooded.clients[0].address)
        _flood(first, flooded.pipeline_id, "attacker", frames=64, key=flooded.key)
        # The flooded stage kept going, so the victim and the flooded pipeline's own caller are
        # served; before, each waited out the 30 s publish timeout on the silent subscriber.
        x = np.random.default_rng(0).standard_normal((4, D)).astype(np.float32)
        np.testing.assert_allclose(victim.call({"x": x}, timeout=30)["x"],
                                   mlp_reference(mlp_root, x), rtol=1e-5, atol=1e-5)
        wide = np.random.default_rng(1).standard_normal((1, WIDE)).astype(np.float32)
        np.testing.assert_array_equal(flooded.call({"x": wide}, timeout=30)["x"], wide)
        # The silent subscriber learns why it lost its events: the stream ends with the bound.
        with pytest.raises(grpc.RpcError) as info:
            for _ in itertools.islice(silent, 10_000):
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"the subscriber of pipeline {flooded.pipeline_id} is not reading" in (
            info.value.details())
        assert victim.broken is None and flooded.broken is None
        first.close()
        last.close()


def _spin(p, st, c):
    """Seconds of dependent arithmetic per step on one core (a long step)."""
    def body(i, x):
        return jnp.tanh(x * 1.0001 + 0.5)
    return {"x": lax.fori_loop(0, c["n"][0], body, c["x"])}, {}


def test_a_long_step_does_not_hold_up_another_pipeline(cluster: Cluster,
                                                      mlp_root: pathlib.Path) -> None:
    """While one pipeline's steps run for seconds each, a second pipeline on the same worker
    is served between them, and the heartbeats keep coming: a step never runs on the worker's
    loop, not even one of a shape whose earlier steps were short (before, such a step ran
    inline, stalling everything for its length).

    The slow step's length is measured here first (it depends on the machine and its load)
    and scaled to about 3 s; then no fast call, and no gap between heartbeats, may take as
    long as one slow step, which it would if it waited for one."""
    slow_model = Model("spin", [Unit("spin", _spin)],
                       inputs={"x": ("b, 256", "float32"), "n": ("1", "int32")},
                       buckets=[{"b": 1}])
    worker = [cluster.clients[0].address]
    slow = cluster.deploy(slow_model, stages=1, platforms=("cpu",), workers=worker)
    fast = cluster.deploy(mlp(), stages=1, platforms=("cpu",), workers=worker)
    client = WorkerClient(worker[0])
    beats: list[float] = []
    with slow, fast:
        x = np.zeros((1, 256), np.float32)
        y = np.random.default_rng(2).standard_normal((4, D)).astype(np.float32)
        fast.call({"x": y}, timeout=60)  # warm
        for _ in range(3):  # short steps of the slow shape first
            slow.call({"x": x, "n": np.array([1], np.int32)}, timeout=60)
        probe = 2_000_000
        t0 = time.monotonic()
        slow.call({"x": x, "n": np.array([probe], np.int32)}, timeout=120)
        per_iter = (time.monotonic() - t0) / probe
        step_s = 3.0
        n = np.array([min(2**31 - 1, int(step_s / per_iter))], np.int32)
        events = client.subscribe(fast.pipeline_id, "beats", fast.key)

        def listen() -> None:
            with contextlib.suppress(grpc.RpcError):
                for view in events:
                    if view.msg.WhichOneof("kind") == "heartbeat":
                        beats.append(time.monotonic())

        threading.Thread(target=listen, daemon=True).start()
        steps = [slow.submit({"x": x, "n": n}) for _ in range(3)]
        latencies = []
        for _ in range(5):  # served while the slow steps are queued and running
            t1 = time.monotonic()
            np.testing.assert_allclose(fast.call({"x": y}, timeout=30)["x"],
                                       mlp_reference(mlp_root, y), rtol=1e-5, atol=1e-5)
            latencies.append(time.monotonic() - t1)
        # No fast call waited for a slow step, and the slow steps were still going.
        assert max(latencies) < step_s, (f"fast calls took {latencies} s; a slow step is "
                                         f"about {step_s} s ({n[0]} iterations)")
        assert not steps[-1].done(), (f"fast calls took {latencies} s; slow steps done: "
                                      f"{[f.done() for f in steps]}")
        for f in steps:
            assert f.result(timeout=120)["x"].shape == (1, 256)
        events.cancel()
        assert slow.broken is None and fast.broken is None
        # The heartbeats (every 0.5 s) kept coming through the three slow steps.
        gaps = [b - a for a, b in zip(beats, beats[1:])]
        assert len(beats) >= 3 and max(gaps) < step_s, (f"heartbeat gaps {gaps} s; a slow "
                                                         f"step is about {step_s} s")
    client.close()
