"""The worker's table of loaded stages, keys and leases (worker/pipelines.py), on real stage
runtimes (the identity model's, from an in-process pipeline). Leases are expired at explicit
times: no sleeps."""

from __future__ import annotations

import time

import pytest
from models import identity

from jaxdist.coordinator.inprocess import InProcessPipeline
from jaxdist.core.errors import PipelineKeyError, SpecError
from jaxdist.worker.pipelines import MAX_KEY_BYTES, MIN_KEY_BYTES, LoadedPipelines

KEY = b"k" * 32
OTHER = b"o" * 32


@pytest.fixture
def runtimes():
    pipes = [InProcessPipeline(identity(1), weights_roots=[]) for _ in range(2)]
    yield [p._runtimes[0] for p in pipes]
    for p in pipes:
        p.close()


def _table(subscribed=lambda pipeline_id: False) -> LoadedPipelines:
    return LoadedPipelines("127.0.0.1:1", subscribed)


def test_a_pipeline_opens_with_any_key_until_loaded_then_only_with_its_own(runtimes):
    table, rt = _table(), runtimes[0]
    assert table.opens(rt.pipeline_id, b"") and table.opens(rt.pipeline_id, OTHER)
    installed, old = table.install(rt, KEY, abandoned=lambda: False)
    assert installed and old is None
    assert table.get(rt.pipeline_id, 0) is rt and table.runtimes() == [rt]
    assert table.opens(rt.pipeline_id, KEY) and table.key_matches(rt.pipeline_id, KEY)
    assert not table.opens(rt.pipeline_id, OTHER) and not table.opens(rt.pipeline_id, b"")
    with pytest.raises(PipelineKeyError, match=r"EndSession: pipeline .* on worker "
                                               r"127\.0\.0\.1:1 was loaded by another "
                                               r"coordinator; the pipeline key presented "
                                               r"\(32 bytes\) is not its key"):
        table.stage_ids("EndSession", rt.pipeline_id, OTHER)
    assert table.stage_ids("EndSession", rt.pipeline_id, KEY) == [rt.stage_id]


def test_error_a_second_coordinator_cannot_install_over_a_keyed_pipeline(runtimes):
    table, rt = _table(), runtimes[0]
    table.install(rt, KEY, abandoned=lambda: False)
    with pytest.raises(PipelineKeyError, match="LoadStage: .*none"):
        table.install(rt, b"", abandoned=lambda: False)
    assert table.get(rt.pipeline_id, 0) is rt and table.key_matches(rt.pipeline_id, KEY)


@pytest.mark.parametrize("size", [1, MIN_KEY_BYTES - 1, MAX_KEY_BYTES + 1])
def test_error_a_key_of_the_wrong_size_names_the_pipeline_and_the_sizes(size):
    with pytest.raises(SpecError, match=rf"pipeline_key of pipeline 'p1' is {size} bytes; "
                                        rf"expected none \(a shared pipeline\) or "
                                        rf"{MIN_KEY_BYTES} to {MAX_KEY_BYTES} random bytes"):
        LoadedPipelines.check_key_size("p1", b"x" * size)
    LoadedPipelines.check_key_size("p1", b"")
    LoadedPipelines.check_key_size("p1", b"x" * MIN_KEY_BYTES)


@pytest.mark.parametrize("lease", [-1.0, float("nan"), 86400.5])
def test_error_a_lease_out_of_range_is_refused(lease):
    with pytest.raises(SpecError, match=r"lease_s .* is out of range; expected 0 \(pinned\) "
                                        r"to 86400 seconds"):
        _table().lease("p1", lease)


def test_an_install_whose_caller_left_installs_nothing(runtimes):
    table, rt = _table(), runtimes[0]
    assert table.install(rt, KEY, abandoned=lambda: True) == (False, None)
    assert table.runtimes() == [] and table.opens(rt.pipeline_id, OTHER)


def test_a_lease_unloads_its_pipeline_once_nobody_subscribed_for_its_seconds(runtimes):
    table = _table()
    kept, leased = runtimes
    for rt in runtimes:
        table.install(rt, KEY, abandoned=lambda: False)
    table.lease(leased.pipeline_id, 5.0)
    table.lease(kept.pipeline_id, 0.0)  # pinned
    table.expire_leases(time.monotonic() + 1.0)
    assert len(table.runtimes()) == 2
    table.expire_leases(time.monotonic() + 60.0)
    assert table.runtimes() == [kept]
    assert table.opens(leased.pipeline_id, OTHER)  # its key is forgotten with its stages
    assert not table.opens(kept.pipeline_id, OTHER)


def test_a_subscribed_pipeline_keeps_its_lease(runtimes):
    rt = runtimes[0]
    table = _table(subscribed=lambda pipeline_id: pipeline_id == rt.pipeline_id)
    table.install(rt, KEY, abandoned=lambda: False)
    table.lease(rt.pipeline_id, 5.0)
    table.expire_leases(time.monotonic() + 60.0)  # seen subscribed: its lease starts again
    assert table.runtimes() == [rt]


def test_unload_by_pipeline_or_stage_id_takes_the_stages_and_the_key(runtimes):
    table = _table()
    a, b = runtimes
    for rt in runtimes:
        table.install(rt, KEY, abandoned=lambda: False)
    assert table.unload(a.pipeline_id) == [a]
    assert table.unload(b.stage_id) == [b]
    assert table.unload("neither") == []
    assert table.runtimes() == [] and table.opens(a.pipeline_id, OTHER)
    table.install(a, KEY, abandoned=lambda: False)
    assert table.clear() == [a] and table.runtimes() == []


def test_compiled_shapes_are_counted_per_pipeline():
    """--max-compiled-shapes bounds each pipeline's shapes on its own; a stage being replaced
    does not count against its replacement, and what is given back is charged again."""
    table = LoadedPipelines("127.0.0.1:1", lambda pipeline_id: False, max_compiled_shapes=4)
    assert table.charge_shapes("p", 3) is None and table.shapes_held("p") == 3
    assert table.charge_shapes("p", 2) == 3  # refused: the shapes held, nothing charged
    assert table.shapes_held("p") == 3
    assert table.charge_shapes("q", 4) is None  # another pipeline: a budget of its own
    assert table.charge_shapes("p", 2, leaving=3) is None  # replaces the stage holding 3
    assert table.shapes_held("p") == 5
    table.refund_shapes("p", 3)  # the replaced stage stops
    budget = table.shape_budget("p")
    assert (budget.limit, budget.held()) == (4, 2)
    assert budget.charge(2) and not budget.charge(1)
    budget.refund(4)
    assert table.shapes_held("p") == 0 and table.shapes_held("q") == 4
    unbounded = LoadedPipelines("127.0.0.1:1", lambda pipeline_id: False)
    assert unbounded.charge_shapes("p", 1000) is None
