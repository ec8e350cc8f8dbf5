"""Per-pipeline keys (#15 item 1): the worker token alone does not open another coordinator's
pipeline. Real workers on loopback port 0; the "other coordinator" is a plain
:class:`WorkerClient` that knows the pipeline's id (``Info`` lists it) but not its key.
"""

from __future__ import annotations

import pathlib
import uuid
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from models import D, mlp, mlp_reference
from test_security import _push  # frames on a Push stream; what it ended with

from jaxdist.coordinator.cluster import Cluster
from jaxdist.core.errors import PipelineKeyError, SpecError
from jaxdist.core.transport.client import WorkerClient
from jaxdist.core.transport.frames import FrameHeader


@pytest.fixture(scope="module")
def cluster(mlp_root: pathlib.Path) -> Iterator[Cluster]:
    with Cluster.local(2, weights_roots=[str(mlp_root)], heartbeat_timeout=10.0) as c:
        yield c


def _x() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((2, D)).astype(np.float32)


def _results(call: grpc.RpcContext, until_request: int) -> list[int]:
    """Request ids of the non-heartbeat events, up to ``until_request``."""
    seen = []
    for view in call:
        if view.msg.WhichOneof("kind") == "heartbeat":
            continue
        seen.append(view.msg.request_id)
        if view.msg.request_id == until_request:
            return seen
    raise AssertionError(f"subscription ended before request {until_request}: {seen}")


def test_a_pipeline_loaded_for_a_run_has_a_key_a_pinned_one_is_shared(
        cluster: Cluster, mlp_root: pathlib.Path) -> None:
    with cluster.deploy(mlp(), stages=2) as pipe:
        assert len(pipe.key) == 32
        x = _x()
        np.testing.assert_allclose(pipe.call(x=x)["x"], mlp_reference(mlp_root, x), rtol=1e-5,
                                   atol=1e-6)
    with Cluster.connect(cluster.addresses, lease_s=0) as pinning, \
            pinning.deploy(mlp(), stages=2) as pinned:
        assert pinned.key == b""  # shared: any holder of the worker token may attach to it


def test_without_the_key_nothing_of_the_pipeline_is_reached(cluster: Cluster,
                                                             mlp_root: pathlib.Path) -> None:
    with cluster.deploy(mlp(), stages=2) as pipe:
        first, last = (WorkerClient(c.address) for c in pipe.clients)
        try:
            # Subscribe: refused at once, with no key and with a wrong one.
            for key in (b"", b"k" * 32):
                with pytest.raises(grpc.RpcError) as err:
                    next(iter(last.subscribe(pipe.pipeline_id, uuid.uuid4().hex, key)))
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert (f"Subscribe: pipeline '{pipe.pipeline_id}' on worker {last.address} was "
                        f"loaded by another coordinator") in err.value.details()
            # EndSession: refused (it would free the owner's KV memory).
            with pytest.raises(PipelineKeyError, match="EndSession: pipeline"):
                first.end_session(pipe.pipeline_id, "s", b"")
            # LoadStage into its id with another key: refused before anything is compiled.
            with pytest.raises(PipelineKeyError, match="LoadStage: pipeline"):
                first.load_stage(pipe.specs[0], pipe.pipeline_id, key=b"k" * 32)
            with pytest.raises(SpecError, match=r"pipeline_key .* is 3 bytes; expected none "
                                                r"\(a shared pipeline\) or 16 to 64"):
                first.load_stage(pipe.specs[0], pipe.pipeline_id, key=b"abc")
            # Frames: the stream ends PERMISSION_DENIED, and the owner's subscription hears
            # nothing of them (no error event a stranger could inject).
            watch = uuid.uuid4().hex
            sub = last.subscribe(pipe.pipeline_id, watch, pipe.key)
            try:
                errors = _push(first, FrameHeader(pipe.pipeline_id, "intruder", 0, 0, 1, watch),
                               _x())
                assert errors and "PERMISSION_DENIED" in str(errors[-1]), errors
                assert "the pipeline key presented (none) is not its key" in str(errors[-1])
                x = _x()
                assert _push(first, FrameHeader(pipe.pipeline_id, "", 0, 0, 2, watch,
                                                key=pipe.key), x) == []
                assert _results(sub, until_request=2) == [2]
            finally:
                sub.cancel()
            # The owner is served throughout.
            np.testing.assert_allclose(pipe.call(x=x)["x"], mlp_reference(mlp_root, x),
                                       rtol=1e-5, atol=1e-6)
        finally:
            first.close()
            last.close()


def test_a_subscription_opened_before_the_load_is_bound_to_its_key(
        cluster: Cluster) -> None:
    """A stranger subscribes to a pipeline id before its owner loads it: once the owner's
    stages are loaded, the stranger's stream ends PERMISSION_DENIED at its next event."""
    pipeline_id = f"squat-{uuid.uuid4().hex[:8]}"
    address = cluster.clients[0].address
    stranger = WorkerClient(address)
    try:
        early = iter(stranger.subscribe(pipeline_id, "mine", b""))
        assert next(early).msg.WhichOneof("kind") == "heartbeat"  # nothing loaded: allowed
        spec = mlp_spec(cluster)
        owner_key = b"o" * 32
        cluster.clients[0].load_stage(spec.replace(stage_id=f"{pipeline_id}/0"), pipeline_id,
                                      key=owner_key)
        try:
            with pytest.raises(grpc.RpcError) as err:
                for _ in early:  # heartbeats until the check sees the owner's key
                    pass
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "by another coordinator since this subscription began" in err.value.details()
        finally:
            assert cluster.clients[0].unload_stage(pipeline_id)
        # Unloaded: the key is forgotten, and a new owner may take the id with its own.
        cluster.clients[0].load_stage(spec.replace(stage_id=f"{pipeline_id}/0"), pipeline_id,
                                      key=b"n" * 32)
        assert cluster.clients[0].unload_stage(pipeline_id)
    finally:
        stranger.close()


def mlp_spec(cluster: Cluster):  # the spec of a one-stage mlp, as a coordinator would load it
    with cluster.deploy(mlp(), stages=1) as pipe:
        return pipe.specs[0]
