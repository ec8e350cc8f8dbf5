"""Faults: a killed or frozen worker is named within the deadline, and with spare workers the
pipeline fails over and generation finishes with the output of a run with no fault.

Real worker processes, real signals: SIGKILL for a dead worker, SIGSTOP for a frozen one.
"""

from __future__ import annotations

import dataclasses
import pathlib
import signal
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
from faults import frozen
from models import mlp, mlp_reference, save_tiny_llama

from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.datapath import TcpSender
from jaxdist.core.errors import RemoteStageError, TransportError

from jaxdist.coordinator.generation import Generator, SamplingParams
from jaxdist.exporters.llama import llama_model

PROMPTS = [[5, 17, 99, 3], [9, 250, 1, 33, 33, 128, 64, 77, 12, 4, 180, 7], [42], [100, 101, 102]]
LENGTHS = [20, 16, 24, 12]
MAX_SLOTS, MAX_SEQ = 4, 64


def _x(b: int = 4) -> np.ndarray:
    return np.random.default_rng(7).standard_normal((b, 32)).astype(np.float32)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, object]:
    root = tmp_path_factory.mktemp("failover")
    return root, save_tiny_llama(root / "llama", layers=4)


def _hf_greedy(hf: object, prompt: list[int], n: int) -> list[int]:
    import torch  # only the generation tests need the reference (the 'reference' extra)

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _generator(pipe: object, model: object, depth: int) -> Generator:
    return Generator(pipe, input_dtypes={k: v[1] for k, v in model.inputs.items()},
                     max_slots=MAX_SLOTS, max_seq=MAX_SEQ, prefill_buckets=(8,), depth=depth)


class _KillAt:
    """An engine observer that SIGKILLs ``process`` at the ``n``-th token, from the engine's
    loop: the kill lands before the next step is sent. (A kill from ``on_token``, which runs in
    the caller's thread, can come after the engine has already finished on a busy machine.)"""

    def __init__(self, n: int, process: subprocess.Popen) -> None:
        self.n, self.process, self.seen = n, process, 0

    def token(self, request_id: str, n_new: int, since_last_s: float, first: bool) -> None:
        before, self.seen = self.seen, self.seen + n_new
        if before < self.n <= self.seen:
            self.process.send_signal(signal.SIGKILL)

    def queued(self, *_: object) -> None:
        """Not needed here."""

    scheduled = finished = step = queued


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, ignore_eos=True) for n in LENGTHS]


def test_killed_worker_is_named(mlp_root):
    """The dead worker, not the one that tried to forward to it, is named. How fast that
    happens is measured by bench/failover.py, not asserted here."""
    with Cluster.local(2, weights_roots=[str(mlp_root)]) as cluster:
        victim = cluster.local_workers[1]
        with cluster.deploy(mlp(), stages=2) as pipe:
            pipe.call(x=_x())
            victim.process.send_signal(signal.SIGKILL)
            assert victim.process.wait(timeout=10) == -signal.SIGKILL
            with pytest.raises(RemoteStageError) as err:
                while True:  # the first steps may still finish; the kill lands between steps
                    pipe.call(x=_x(), timeout=60)
            assert pipe.broken is err.value  # the pipeline was marked broken, then the call
    assert err.value.stage == 1 and err.value.address == victim.address
    assert victim.address in str(err.value) and "stage 1" in str(err.value)
    assert "worker died or became unreachable" in str(err.value)


def test_recover_moves_the_dead_workers_stage_to_a_spare(mlp_root):
    with Cluster.local(2, weights_roots=[str(mlp_root)], spares=1) as cluster:
        victim = cluster.local_workers[1]
        spare = cluster.spares[0]
        with cluster.deploy(mlp(), stages=2) as pipe:
            want = mlp_reference(mlp_root, _x())
            np.testing.assert_allclose(pipe.call(x=_x())["x"], want, rtol=1e-5, atol=1e-5)
            victim.process.send_signal(signal.SIGKILL)
            with pytest.raises(RemoteStageError, match=victim.address):
                while True:  # submit: call() would fail over by itself
                    pipe.submit({"x": _x()}).result(timeout=30)
            dead_client, old_sender = pipe.clients[1], pipe._sender
            (moved,) = pipe.recover()
            assert (moved.stages, moved.failed, moved.spare) == ((1,), victim.address, spare)
            assert [c.address for c in pipe.clients] == [cluster.local_workers[0].address, spare]
            assert cluster.spares == [] and spare in cluster.addresses
            np.testing.assert_allclose(pipe.call(x=_x())["x"], want, rtol=1e-5, atol=1e-5)
            assert pipe.specs[0].next_hop == spare
            # What the dead worker held here is given back: its channel is closed, its process
            # reaped, and the input stream of before the failover holds no thread.
            with pytest.raises(ValueError, match="closed channel"):
                dead_client.info(timeout=5)
            assert victim not in cluster.local_workers and victim.process.stdout.closed
            # Over the data port, the old connection is closed on the loop (no thread of its
            # own); over gRPC (test_recover_over_grpc_gives_back_the_input_streams_thread)
            # the old stream's request-iterator thread ends.
            assert isinstance(old_sender, TcpSender) and pipe.links[spare] == "tcp"
            assert old_sender._conn is not None and old_sender._conn.writer.is_closing()
            assert not [t for t in threading.enumerate() if t.name.startswith("sub-")]


def test_recover_over_grpc_gives_back_the_input_streams_thread(mlp_root):
    with Cluster.local(2, weights_roots=[str(mlp_root)], spares=1, data_path="grpc"
                       ) as cluster:
        victim = cluster.local_workers[0]
        with cluster.deploy(mlp(), stages=2) as pipe:
            want = mlp_reference(mlp_root, _x())
            np.testing.assert_allclose(pipe.call(x=_x())["x"], want, rtol=1e-5, atol=1e-5)
            victim.process.send_signal(signal.SIGKILL)
            with pytest.raises(RemoteStageError, match=victim.address):
                while True:
                    pipe.submit({"x": _x()}).result(timeout=30)
            old_sender = pipe._sender
            pipe.recover()
            assert set(pipe.links.values()) == {"grpc"}
            np.testing.assert_allclose(pipe.call(x=_x())["x"], want, rtol=1e-5, atol=1e-5)
            deadline = time.monotonic() + 60  # a hang guard: the thread ends once woken
            while _threads_feeding(old_sender) and time.monotonic() < deadline:
                threading.Event().wait(0.05)
            assert _threads_feeding(old_sender) == 0


def _threads_feeding(sender: object) -> int:
    """Threads whose stack is inside ``sender``'s request iterator (``FrameSender._requests``):
    gRPC's thread that consumes it, while the stream lives."""
    n = 0
    for frame in sys._current_frames().values():
        f: types.FrameType | None = frame
        while f is not None:
            if f.f_code.co_name == "_requests" and f.f_locals.get("self") is sender:
                n += 1
                break
            f = f.f_back
    return n


def test_recover_without_a_spare_says_so_and_stays_broken(mlp_root):
    with Cluster.local(2, weights_roots=[str(mlp_root)]) as cluster:
        victim = cluster.local_workers[0]
        with cluster.deploy(mlp(), stages=2) as pipe:
            pipe.call(x=_x())
            victim.process.send_signal(signal.SIGKILL)
            with pytest.raises(RemoteStageError):
                while True:
                    pipe.call(x=_x(), timeout=30)
            with pytest.raises(TransportError, match=f"{victim.address} is dead and no spare"):
                pipe.recover()
            with pytest.raises(TransportError, match="no spare"):
                pipe.call(x=_x())


def test_frozen_worker_fails_over_to_a_spare(mlp_root):
    with Cluster.local(2, weights_roots=[str(mlp_root)], spares=1,
                       heartbeat_timeout=2) as cluster:
        victim = cluster.local_workers[0]
        with cluster.deploy(mlp(), stages=2) as pipe:
            want = mlp_reference(mlp_root, _x())
            pipe.call(x=_x())
            with frozen(victim.process):
                with pytest.raises(RemoteStageError, match="no heartbeat") as err:
                    pipe.submit({"x": _x()}).result(timeout=30)
                assert err.value.address == victim.address
                (moved,) = pipe.recover()
                assert moved.failed == victim.address and moved.stages == (0,)
                np.testing.assert_allclose(pipe.call(x=_x())["x"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("victim_index,depth", [
    (1, 2),
    pytest.param(0, 1, marks=pytest.mark.slow),  # the same replay, from the first stage
])
def test_generation_survives_a_killed_worker_with_identical_output(tiny_llama, victim_index,
                                                                   depth):
    """Kill a worker mid-generation: the stages move to the spare, the steps are replayed, and
    every sequence comes out as in the run with no fault (and as transformers says)."""
    root, hf = tiny_llama
    model = llama_model("llama", roots=[root], max_slots=MAX_SLOTS, max_seq=MAX_SEQ,
                        prefill_buckets=(8,))
    model = dataclasses.replace(model, buckets=())
    with Cluster.local(2, weights_roots=[str(root)], spares=1) as cluster:
        pipe = cluster.deploy(model, stages=2)
        gen = _generator(pipe, model, depth)
        clean = [r.tokens for r in gen.run(PROMPTS, _params())]

        victim = cluster.local_workers[victim_index]
        produced: list[tuple[int, int]] = []
        gen.engine.observer = _KillAt(25, victim.process)  # mid-decode, several running
        faulted = gen.run(PROMPTS, _params(), on_token=lambda i, t: produced.append((i, t)))
        assert victim.process.wait(timeout=10) == -signal.SIGKILL
        assert len(pipe.failovers) == 1
        assert pipe.failovers[0].failed == victim.address
        assert [r.tokens for r in faulted] == clean
        # Streaming saw every token exactly once, in order, despite the replay.
        for i, r in enumerate(faulted):
            assert [t for j, t in produced if j == i] == r.tokens
        # And the pipeline keeps working after the failover.
        assert [r.tokens for r in gen.run(PROMPTS[:2], _params()[:2])] == clean[:2]
    for prompt, n, tokens in zip(PROMPTS, LENGTHS, clean):
        assert tokens == _hf_greedy(hf, prompt, n)


@pytest.mark.parametrize("victim_index", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_generation_without_spares_fails_naming_the_worker(tiny_llama, victim_index):
    root, _ = tiny_llama
    model = llama_model("llama", roots=[root], max_slots=MAX_SLOTS, max_seq=MAX_SEQ,
                        prefill_buckets=(8,))
    model = dataclasses.replace(model, buckets=())
    with Cluster.local(2, weights_roots=[str(root)]) as cluster:
        pipe = cluster.deploy(model, stages=2)
        gen = _generator(pipe, model, 1)
        victim = cluster.local_workers[victim_index]
        gen.engine.observer = _KillAt(5, victim.process)
        with pytest.raises(RemoteStageError, match=victim.address) as err:
            gen.run(PROMPTS, _params())
        assert victim.process.wait(timeout=10) == -signal.SIGKILL
        # It stays broken: the failover found no spare to move the dead worker's stages to.
        assert isinstance(pipe.broken, TransportError)
        assert f"worker {victim.address} is dead and no spare" in str(pipe.broken)
    assert err.value.stage == victim_index and err.value.address == victim.address
    assert any("no spare" in note for note in getattr(err.value, "__notes__", []))


def test_connect_checks_spares_and_cli_spares_option(mlp_root):
    import argparse

    from jaxdist.cli.common import add_cluster_args, open_cluster
    from jaxdist.coordinator.spawn import spawn_workers, stop_workers
    from jaxdist.core.errors import JaxdistError

    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    workers = spawn_workers(3, weights_roots=[str(mlp_root)])
    try:
        a, b, c = (w.address for w in workers)
        opts = parser.parse_args(["--workers", f"{a},{b}", "--spares", c])
        with open_cluster(opts, [mlp_root]) as cluster:
            assert cluster.addresses == [a, b] and cluster.spares == [c]
        with pytest.raises(JaxdistError, match="give the spares' addresses"):
            with open_cluster(parser.parse_args(["--workers", a, "--spares", "1"]), []):
                pass
        with pytest.raises(JaxdistError, match="give a number of spare workers"):
            with open_cluster(parser.parse_args(["--local", "1", "--spares", c]), []):
                pass
        with pytest.raises(TransportError, match="both as workers and as spares"):
            Cluster([a, b], spares=[b])
        stop_workers(workers[2:])
        with pytest.raises(TransportError, match=c):
            Cluster.connect([a, b], spares=[c], wait=2)
    finally:
        stop_workers(workers)


def test_stateless_calls_fail_over_by_themselves(mlp_root):
    """Session-less calls hold no state: with a spare, a dead worker costs the caller nothing."""
    with Cluster.local(2, weights_roots=[str(mlp_root)], spares=1) as cluster:
        victim = cluster.local_workers[1]
        with cluster.deploy(mlp(), stages=2) as pipe:
            want = mlp_reference(mlp_root, _x())
            pipe.call(x=_x())
            victim.process.send_signal(signal.SIGKILL)
            assert victim.process.wait(timeout=10) == -signal.SIGKILL
            for _ in range(5):
                np.testing.assert_allclose(pipe.call(x=_x(), timeout=60)["x"], want,
                                           rtol=1e-5, atol=1e-5)
            assert [f.failed for f in pipe.failovers] == [victim.address]
            # A call in a session does not: its state is gone with the worker.
            with pipe.session() as s:
                s(x=_x())
            cluster.local_workers[0].process.send_signal(signal.SIGKILL)
            with pytest.raises(RemoteStageError):
                while True:
                    pipe.call(x=_x(), session_id="s1", timeout=60)
