"""The long-lived engine: callers join and leave one batch, abort, a bounded queue, streamed
text, failover, async consumers.

Real parts: a tiny Llama (transformers is the reference) in process and on real worker
processes, and SmolLM2's real tokenizer. Nothing here waits on time: the tests that need an
order of events block the step loop in an observer hook, or gate the pipeline, until the test
has done its part (the engine's step counter tells how many steps passed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from llm_utils import GatedPipeline
from models import save_tiny_llama
from test_detokenizer import TEXTS, _stops_of  # split characters; stop strings to try

from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.engine import Engine, EngineClosed, QueueFull, RequestFailed
from jaxdist.coordinator.generation import Generator, SamplingParams
from jaxdist.coordinator.inprocess import InProcessPipeline
from jaxdist.coordinator.request import ParamError
from jaxdist.core.errors import LimitError, RemoteStageError, SpecError
from jaxdist.exporters.llama import llama_model
from jaxdist.exporters.tokenizer import Tokenizer, load_tokenizer

pytestmark = pytest.mark.reference

PROMPTS = [[5, 17, 99, 3], [9, 250, 1, 33, 33, 128, 64, 77, 12, 4, 180, 7], [42], [100, 101, 102],
           [7, 7, 7, 7, 7, 7], [200, 3, 4]]
SLOTS, SEQ, BUCKETS = 4, 64, (8,)
WAIT = 120.0  # seconds: generous, for a loaded machine; a test that hits it has failed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, Any, Any]:
    """(weights root, transformers reference, the exported model without shape buckets)."""
    root = tmp_path_factory.mktemp("engine")
    hf = save_tiny_llama(root / "llama", layers=3)
    model = llama_model("llama", roots=[root], max_slots=SLOTS, max_seq=SEQ,
                        prefill_buckets=BUCKETS)
    return root, hf, dataclasses.replace(model, buckets=())


@pytest.fixture(scope="module")
def pipe(tiny: tuple[pathlib.Path, Any, Any]) -> InProcessPipeline:
    root, _, model = tiny
    with InProcessPipeline(model, weights_roots=[str(root)], stages=2) as p:
        yield p


@pytest.fixture(scope="module")
def workers(tiny: tuple[pathlib.Path, Any, Any]) -> Any:
    """A pipeline over two real worker processes (nobody kills these)."""
    root, _, model = tiny
    with Cluster.local(2, weights_roots=[str(root)]) as cluster, cluster.deploy(
            model, stages=2) as p:
        yield p


@pytest.fixture(scope="module")
def smollm_tok(smollm2: pathlib.Path) -> Tokenizer:
    tok = load_tokenizer(smollm2)
    assert isinstance(tok, Tokenizer)
    return tok


def _dtypes(model: Any) -> dict[str, str]:
    return {k: v[1] for k, v in model.inputs.items()}


def _engine(pipeline: Any, model: Any, **kw: Any) -> Engine:
    return Engine(pipeline, input_dtypes=_dtypes(model), max_slots=SLOTS, max_seq=SEQ,
                  prefill_buckets=BUCKETS, **kw)


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    import torch  # the tests that compare with transformers need it (the 'reference' extra)

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


class Letters:
    """A stand-in detokenizer: one letter per id."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in ids)


class Recorder:
    """An EngineObserver that records what the loop tells it, with the engine's step count and
    slots in use at that moment; ``at_token[(rid, n)]`` runs in the loop at rid's n-th token
    (to block the loop until the test has done something)."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.events: list[tuple[Any, ...]] = []
        self.at_token: dict[tuple[str, int], Callable[[], None]] = {}
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def _add(self, *event: Any) -> None:
        assert self.engine is not None
        with self._lock:
            self.events.append((*event, self.engine.steps, self.engine.slots_in_use))

    def queued(self, request_id: str, prompt_tokens: int) -> None:
        self._add("queued", request_id, prompt_tokens)

    def scheduled(self, request_id: str, queue_s: float) -> None:
        self._add("scheduled", request_id)

    def token(self, request_id: str, n_new: int, since_last_s: float, first: bool) -> None:
        n = self._counts[request_id] = self._counts.get(request_id, 0) + n_new
        self._add("token", request_id, n, first)
        hook = self.at_token.get((request_id, n))
        if hook is not None:
            hook()

    def finished(self, request_id: str, reason: str, prompt_tokens: int,
                 completion_tokens: int, e2e_s: float) -> None:
        self._add("finished", request_id, reason, completion_tokens)

    def step(self, rows: int, tokens_per_row: int, seconds: float) -> None:
        self._add("step", rows, tokens_per_row)

    def of(self, kind: str, rid: str | None = None) -> list[tuple[Any, ...]]:
        with self._lock:
            return [e for e in self.events if e[0] == kind and (rid is None or e[1] == rid)]

    def index(self, kind: str, rid: str) -> int:
        with self._lock:
            return next(i for i, e in enumerate(self.events) if e[:2] == (kind, rid))


def _observed(pipeline: Any, model: Any, **kw: Any) -> tuple[Engine, Recorder]:
    rec = Recorder()
    engine = _engine(pipeline, model, observer=rec, **kw)
    rec.engine = engine
    return engine, rec


def _block_until(done: threading.Event, reached: threading.Event) -> Callable[[], None]:
    def hook() -> None:
        reached.set()
        if not done.wait(WAIT):
            raise AssertionError("the test did not release the step loop")
    return hook


# ---------------------------------------------------------------------------------------------
# 1. continuous batching across callers


@pytest.mark.parametrize("where", ["inprocess", "workers"])
def test_callers_from_threads_get_what_they_get_alone(tiny, request, where):
    """Three callers in three threads; C joins while A and B decode. Each gets exactly the
    tokens of the same request alone, of Generator.run alone, and of transformers."""
    _, hf, model = tiny
    pipeline = request.getfixturevalue("pipe" if where == "inprocess" else "workers")
    depth = 1 if where == "inprocess" else 2
    jobs = {"A": (PROMPTS[0], 14), "B": (PROMPTS[1], 10), "C": (PROMPTS[3], 8)}
    with _engine(pipeline, model, depth=depth) as alone:
        solo = {k: alone.submit(p, _greedy(n)).result(WAIT).tokens for k, (p, n) in jobs.items()}
    gen = Generator(pipeline, input_dtypes=_dtypes(model), max_slots=SLOTS, max_seq=SEQ,
                    prefill_buckets=BUCKETS, depth=depth)
    with gen:
        for k, (p, n) in jobs.items():
            assert gen.run([p], _greedy(n))[0].tokens == solo[k]
            assert solo[k] == _hf_greedy(hf, p, n)

    engine, rec = _observed(pipeline, model, depth=depth)
    a_mid, c_in = threading.Event(), threading.Event()
    rec.at_token[("A", 3)] = _block_until(c_in, a_mid)  # the loop waits at A's third token
    got: dict[str, list[int]] = {}
    start = threading.Barrier(2)

    def caller(key: str) -> None:
        prompt, n = jobs[key]
        if key == "C":
            assert a_mid.wait(WAIT)
            stream = engine.submit(prompt, _greedy(n), request_id=key)
            c_in.set()
        else:
            start.wait(WAIT)
            stream = engine.submit(prompt, _greedy(n), request_id=key)
        got[key] = [t for d in stream for t in d.token_ids]

    with engine, concurrent.futures.ThreadPoolExecutor(3) as pool:
        for f in [pool.submit(caller, k) for k in jobs]:
            f.result(WAIT)
    assert got == solo
    # C took its slot while A was still decoding (A's slot and C's in use then).
    assert rec.index("scheduled", "C") < rec.index("finished", "A")
    assert rec.of("scheduled", "C")[0][-1] >= 2
    if depth == 1:  # A and C decode together (with depth 2, each step may take one of them)
        assert any(e[1] >= 2 for e in rec.of("step")), "no step ever batched two requests"
    assert [e[2] for e in rec.of("finished")] == ["length"] * 3


# ---------------------------------------------------------------------------------------------
# 2. abort


def test_abort_mid_generation_frees_the_slot_within_one_step(tiny, pipe):
    _, _, model = tiny
    engine, rec = _observed(pipe, model)
    reached, go = threading.Event(), threading.Event()
    rec.at_token[("A", 3)] = _block_until(go, reached)
    with engine:
        b_alone = engine.submit(PROMPTS[2], _greedy(20)).result(WAIT).tokens
        a = engine.submit(PROMPTS[0], _greedy(40), request_id="A")
        b = engine.submit(PROMPTS[2], _greedy(20), request_id="B")
        assert reached.wait(WAIT)  # the loop is inside step k, at A's third token
        assert engine.slots_in_use == 2
        assert a.abort() is True
        at = engine.steps
        go.set()
        deltas = list(a)
        assert deltas[-1].finish_reason == "abort" and deltas[-1].token_ids == ()
        assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
        (fin,) = rec.of("finished", "A")
        steps_then, slots_then = fin[-2], fin[-1]
        assert steps_then - at <= 1, f"the slot was freed {steps_then - at} steps after abort"
        assert slots_then == 1  # B still holds its slot
        res = a.result(WAIT)
        assert res.finish_reason == "abort" and res.tokens == [t for d in deltas
                                                               for t in d.token_ids]
        assert b.result(WAIT).tokens == b_alone  # the other request did not notice
        assert engine.abort("A") is False and engine.abort("no-such-request") is False
        assert engine.slots_in_use == 0 and engine.num_running == 0


def test_abort_a_waiting_request_and_close_aborts_the_rest(tiny, pipe):
    _, _, model = tiny
    gated = GatedPipeline(pipe, WAIT)
    engine, rec = _observed(gated, model)
    running = [engine.submit(PROMPTS[0], _greedy(40), request_id=f"r{i}") for i in range(SLOTS)]
    waiting = [engine.submit(PROMPTS[1], _greedy(8), request_id=k) for k in ("w", "x")]
    assert (engine.num_running, engine.num_waiting) == (SLOTS, 2)
    assert engine.abort("w") is True
    rec.at_token[("r0", 2)] = engine.close  # closed from inside the loop, mid-generation
    gated.open.set()
    assert [d.finish_reason for d in waiting[0]] == ["abort"]
    assert waiting[0].result(WAIT).tokens == []
    assert [s.result(WAIT).finish_reason for s in [*running, waiting[1]]] == ["abort"] * 5
    engine.close()  # joins the loop
    assert (engine.num_running, engine.num_waiting, engine.slots_in_use) == (0, 0, 0)
    with pytest.raises(EngineClosed, match="the generation engine is closed"):
        engine.submit(PROMPTS[0])


# ---------------------------------------------------------------------------------------------
# 3. the queue bound


def test_queue_full_then_accepted_after_a_request_finishes(tiny, pipe):
    _, _, model = tiny
    gated = GatedPipeline(pipe, WAIT)
    with _engine(gated, model, max_queue=2) as engine:
        first = engine.submit(PROMPTS[2], _greedy(2))
        others = [engine.submit(p, _greedy(6)) for p in PROMPTS[:SLOTS - 1]]
        queued = [engine.submit(p, _greedy(6)) for p in PROMPTS[3:5]]
        assert (engine.slots_in_use, engine.num_running, engine.num_waiting) == (SLOTS, SLOTS, 2)
        with pytest.raises(QueueFull, match=r"max_queue=2") as err:
            engine.submit(PROMPTS[5], request_id="late")
        assert isinstance(err.value, LimitError) and err.value.code == "RESOURCE_EXHAUSTED"
        assert "'late'" in str(err.value) and f"all {SLOTS} KV slots are busy" in str(err.value)
        gated.open.set()
        assert first.result(WAIT).finish_reason == "length"
        late = engine.submit(PROMPTS[5], _greedy(3), request_id="late")  # a slot or a place
        assert late.result(WAIT).finish_reason == "length"
        assert all(s.result(WAIT).finish_reason == "length" for s in others + queued)


# ---------------------------------------------------------------------------------------------
# 4. streamed text and stop strings (the detokenizer alone: test_detokenizer)


class _Scripted:
    """A pipeline whose model "generates" a fixed script of ids (one request at a time), to
    stream known multi-byte text through the engine."""

    def __init__(self, script: list[int], prompt_len: int) -> None:
        self.script, self.prompt_len = script, prompt_len

    def submit(self, inputs: Any, *, session_id: str = "", step: int = 0) -> Any:
        pos, length = inputs["pos"], inputs["length"]
        k = int(pos[0] + length[0]) - self.prompt_len
        future: concurrent.futures.Future[dict[str, np.ndarray]] = concurrent.futures.Future()
        future.set_result({"token": np.full(pos.shape, self.script[min(k, len(self.script) - 1)],
                                            np.int32)})
        return future

    def end_session(self, session_id: str) -> int:
        return 0


@pytest.mark.parametrize("text", TEXTS[:2])
def test_engine_streams_multibyte_text_and_cuts_at_stop_strings(smollm_tok, text):
    ids = smollm_tok.encode(text, add_special_tokens=False)
    dtypes = {k: "int32" for k in ("tokens", "slot", "pos", "length")}
    with Engine(_Scripted(ids, 2), input_dtypes=dtypes, max_slots=1, max_seq=128,
                prefill_buckets=(8,), tokenizer=smollm_tok) as engine:
        stream = engine.submit([1, 2], _greedy(len(ids)))
        deltas = list(stream)
        assert [t for d in deltas for t in d.token_ids] == ids
        assert "".join(d.text for d in deltas) == stream.result().text == text
        assert deltas[-1].finish_reason == "length"
        assert (deltas[-1].prompt_tokens, deltas[-1].completion_tokens) == (2, len(ids))
        for stop in ("你好", "🙂", "𝄞", "ö"):
            if stop not in text:
                continue
            stream = engine.submit([1, 2], _greedy(len(ids), stop_strings=(stop,)))
            deltas = list(stream)
            res = stream.result()
            assert "".join(d.text for d in deltas) == res.text == text[:text.find(stop)]
            assert res.finish_reason == "stop" and deltas[-1].finish_reason == "stop"
            assert stop not in smollm_tok.decode(res.tokens)
            assert res.tokens == ids[:len(res.tokens)]


def test_real_model_text_equals_full_decode_of_its_tokens(tiny, pipe, smollm_tok):
    """The tiny Llama's ids are SmolLM2's first 256: special tokens (no text), bytes that are
    halves of characters (U+FFFD), ASCII. The streamed text is still the full decode."""
    _, _, model = tiny
    with _engine(pipe, model, tokenizer=smollm_tok) as engine:
        for prompt in PROMPTS[:4]:
            stream = engine.submit(prompt, _greedy(40))
            deltas = list(stream)
            tokens = [t for d in deltas for t in d.token_ids]
            full = smollm_tok.decode(tokens)
            assert "".join(d.text for d in deltas) == stream.result().text == full
            stops = [s for s in _stops_of(full) if "\ufffd" not in s and full.find(s) > 0]
            assert stops, f"no stop string to try in {full!r}"
            stop = stops[len(stops) // 2]
            cut = engine.submit(prompt, _greedy(40, stop_strings=(stop,)))
            res = cut.result(WAIT)
            assert res.text == full[:full.find(stop)] == "".join(d.text for d in cut)
            assert res.finish_reason == "stop" and res.tokens == tokens[:len(res.tokens)]


# ---------------------------------------------------------------------------------------------
# 5. failover


class _Fed:
    """The pipeline, recording the tokens each step feeds per KV slot, by session."""

    def __init__(self, pipeline: Any) -> None:
        self._pipeline = pipeline
        self.fed: dict[str, dict[int, list[list[int]]]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)

    def submit(self, inputs: Any, **kw: Any) -> Any:
        per_slot = self.fed.setdefault(kw["session_id"], {})
        for row, slot, n in zip(inputs["tokens"], inputs["slot"], inputs["length"]):
            if n > 0:  # padding rows (slot max_slots) are recorded too, under a slot of their own
                per_slot.setdefault(int(slot), []).append([int(t) for t in row[:n]])
        return self._pipeline.submit(inputs, **kw)


def test_failover_in_a_long_lived_engine_keeps_the_output(tiny):
    """Requests before, during and after a worker's death on one engine: the dead worker's
    stages move to the spare, the running requests are recomputed, and every request comes out
    as without a fault, each token streamed once. The recomputation rebuilds each cache as it
    was built: the prompt prefilled as before, then each generated token decoded again."""
    root, hf, model = tiny
    lengths = [20, 16, 24, 12]
    with Cluster.local(2, weights_roots=[str(root)], spares=1) as cluster:
        pipeline = _Fed(cluster.deploy(model, stages=2))
        # One session per run below (keep_session_s=0), prompts prefilled together.
        engine, rec = _observed(pipeline, model, depth=2, keep_session_s=0, prefill_rows=SLOTS)
        with engine:
            clean = [s.result(WAIT).tokens for s in
                     [engine.submit(p, _greedy(n)) for p, n in zip(PROMPTS, lengths)]]
            victim = cluster.local_workers[1]
            killed = threading.Event()

            def kill() -> None:
                victim.process.send_signal(signal.SIGKILL)
                killed.set()

            rec.at_token[("r1", 6)] = kill  # mid-decode, all four requests running
            streams = [engine.submit(p, _greedy(n), request_id=f"r{i}")
                       for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
            results = [s.result(WAIT) for s in streams]
            assert killed.is_set() and victim.process.wait(timeout=30) == -signal.SIGKILL
            assert [r.tokens for r in results] == clean
            for s, r in zip(streams, results):  # every token streamed exactly once, in order
                assert [t for d in s for t in d.token_ids] == r.tokens
            assert [f.failed for f in pipeline.failovers] == [victim.address]
            assert engine.recomputed == len(PROMPTS[:4])
            # The session after the failover gave each slot its prompt in one prefill chunk,
            # then one token per step: the tokens it had generated, decoded again. (A prefill
            # of prompt + tokens would start with another chunk than the prompt.)
            def decoded(steps: list[list[int]], prompt: list[int]) -> list[int] | None:
                """The tokens fed one per step after ``prompt`` in its prefill chunks."""
                n = 0
                for k, step in enumerate(steps):
                    if n == len(prompt):
                        rest = steps[k:]
                        return [t[0] for t in rest] if all(len(t) == 1 for t in rest) else None
                    if step != prompt[n:n + BUCKETS[-1]]:
                        return None
                    n += len(step)
                return [] if n == len(prompt) else None

            sessions = [v for v in pipeline.fed.values()
                        if all(any(decoded(steps, p) is not None for steps in v.values())
                               for p in PROMPTS[:4])]
            assert len(sessions) == 3  # the clean runs, the one that failed over, its rebuild
            for r, prompt in zip(results, PROMPTS):
                fed = next(d for v in sessions[2].values()
                           if (d := decoded(v, prompt)) is not None)
                assert fed and fed == r.tokens[:len(fed)]
            # The same engine goes on serving.
            assert engine.submit(PROMPTS[0], _greedy(20)).result(WAIT).tokens == clean[0]
        pipeline.close()
    for prompt, n, tokens in zip(PROMPTS, lengths, clean):
        assert tokens == _hf_greedy(hf, prompt, n)


def test_dead_worker_without_spare_fails_every_running_stream(tiny):
    root, _, model = tiny
    with Cluster.local(2, weights_roots=[str(root)]) as cluster:
        pipeline = cluster.deploy(model, stages=2)
        engine, rec = _observed(pipeline, model)
        victim = cluster.local_workers[0]
        rec.at_token[("a", 4)] = lambda: victim.process.send_signal(signal.SIGKILL)
        with engine:
            a = engine.submit(PROMPTS[0], _greedy(30), request_id="a")
            b = engine.submit(PROMPTS[3], _greedy(30), request_id="b")
            with pytest.raises(RemoteStageError, match=victim.address) as err_a:
                list(a)  # the sync consumer gets the pipeline's error
            with pytest.raises(RemoteStageError, match=victim.address) as err_b:
                b.result(WAIT)
            assert err_a.value is err_b.value and err_a.value.stage == 0
            assert any("no spare" in n for n in getattr(err_a.value, "__notes__", []))
            assert engine.slots_in_use == 0
            assert [e[2] for e in rec.of("finished")] == ["error", "error"]
        pipeline.close(unload=False)


class _FailsOnce:
    """A pipeline whose ``n``-th step fails on a stage, as a step with bad input would."""

    def __init__(self, pipeline: Any, n: int) -> None:
        self.pipeline, self.n, self.sent = pipeline, n, 0

    def submit(self, inputs: Any, *, session_id: str = "", step: int = 0) -> Any:
        self.sent += 1
        if self.sent == self.n:
            future: concurrent.futures.Future[dict[str, np.ndarray]] = concurrent.futures.Future()
            future.set_exception(RemoteStageError("tensor 'x' is NaN", stage=1,
                                                  address="10.0.0.2:50051",
                                                  remote_type="SpecError"))
            return future
        return self.pipeline.submit(inputs, session_id=session_id, step=step)

    def end_session(self, session_id: str) -> int:
        return self.pipeline.end_session(session_id)


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny, pipe):
    """A stage error is not a dead worker: the running requests get it as it was raised, the
    session is ended, and later requests run on a new one."""
    _, hf, model = tiny
    with _engine(_FailsOnce(pipe, 4), model) as engine:
        a, b = engine.submit(PROMPTS[0], _greedy(10)), engine.submit(PROMPTS[3], _greedy(10))
        with pytest.raises(RemoteStageError, match="stage 1 on worker 10.0.0.2:50051: "
                                                   "SpecError: tensor 'x' is NaN"):
            list(a)
        with pytest.raises(RemoteStageError, match="tensor 'x' is NaN"):
            b.result(WAIT)
        assert engine.slots_in_use == 0 and len(pipe.sessions) == 0
        assert engine.submit(PROMPTS[0], _greedy(6)).result(WAIT).tokens == _hf_greedy(
            hf, PROMPTS[0], 6)


def _slipped_past(params: SamplingParams, **values: Any) -> SamplingParams:
    """``params`` with values its checks refuse, set behind their back: a value that reaches
    the step loop anyway (a bug elsewhere), as ``top_k=1e20`` did before issue #33."""
    for name, value in values.items():
        object.__setattr__(params, name, value)
    return params


def test_a_request_that_fails_in_the_engine_fails_alone(tiny, pipe):
    """Issue #33: top_k=1e20 raised OverflowError while its step was built, and the engine
    closed for good. Now only that request fails (RequestFailed, the error as its cause), even
    when it shares a prefill step with others; they and later requests are served."""
    _, hf, model = tiny
    engine, rec = _observed(pipe, model, prefill_rows=SLOTS)
    done, reached = threading.Event(), threading.Event()
    with engine:
        # Hold the loop so the three wait together and are prefilled in one step.
        rec.at_token[("hold", 1)] = _block_until(done, reached)
        hold = engine.submit([1, 2], _greedy(2), request_id="hold")
        assert reached.wait(WAIT)
        good = engine.submit(PROMPTS[0], _greedy(6))
        bad = engine.submit(PROMPTS[3], _slipped_past(_greedy(6), top_k=10**20),
                            request_id="bad")
        other = engine.submit(PROMPTS[2], _greedy(5))
        done.set()
        with pytest.raises(RequestFailed, match=r"request 'bad' failed in the generation "
                                                r"engine while building its step's inputs: "
                                                r"OverflowError") as err:
            bad.result(WAIT)
        assert isinstance(err.value.__cause__, OverflowError)
        assert hold.result(WAIT).finish_reason == "length"
        assert good.result(WAIT).tokens == _hf_greedy(hf, PROMPTS[0], 6)
        assert other.result(WAIT).tokens == _hf_greedy(hf, PROMPTS[2], 5)
        assert engine.stopped is None and engine.slots_in_use == 0
        assert engine.submit(PROMPTS[1], _greedy(4)).result(WAIT).tokens == _hf_greedy(
            hf, PROMPTS[1], 4)
    assert rec.of("finished", "bad")[0][2] == "error"
    assert engine.stopped == "the generation engine was closed"


class _FailsOn:
    """A detokenizer that fails on one id, as a buggy tokenizer would: the failure comes while
    the engine hands a request its new token."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def decode(self, ids: list[int]) -> str:
        if self.bad in ids:
            raise ValueError(f"cannot decode id {self.bad}")
        return Letters().decode(ids)


def test_a_request_whose_text_fails_fails_alone(tiny, pipe):
    _, hf, model = tiny
    want = _hf_greedy(hf, PROMPTS[0], 8)
    other = _hf_greedy(hf, PROMPTS[2], 8)
    bad_id = next(t for t in want[2:] if t not in other)
    with _engine(pipe, model, tokenizer=_FailsOn(bad_id)) as engine:
        failing = engine.submit(PROMPTS[0], _greedy(8))
        fine = engine.submit(PROMPTS[2], _greedy(8))
        with pytest.raises(RequestFailed, match=f"while handling its new token: ValueError: "
                                                f"cannot decode id {bad_id}"):
            failing.result(WAIT)
        assert fine.result(WAIT).tokens == other
        assert engine.stopped is None


def test_error_parameters_out_of_range_name_the_field_before_anything_runs(tiny, pipe):
    """One check for every front end: SamplingParams' own ranges when it is made, the model's
    (the vocabulary) when a request is submitted or a Generator runs."""
    _, _, model = tiny
    with pytest.raises(ParamError, match=r"^top_k: expected an integer in 0\.\.2147483647 "
                                         r".*found 100000000000000000000$"):
        SamplingParams(top_k=10**20)
    for kw, field in (({"temperature": float("nan")}, "temperature"), ({"seed": 1 << 32}, "seed"),
                      ({"top_p": 0.0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                      ({"stop_strings": ("x",) * 9}, "stop_strings"),
                      ({"stop_strings": ("x" * 129,)}, "stop_strings[0]"),
                      ({"stop_ids": frozenset({-1})}, "stop_ids")):
        with pytest.raises(ParamError) as err:
            SamplingParams(**kw)
        assert err.value.field == field and "expected" in str(err.value), str(err.value)
    vocab = 256  # the tiny Llama's
    gated = GatedPipeline(pipe, WAIT)  # closed: nothing may reach the pipeline
    with _engine(gated, model, vocab_size=vocab) as engine:
        with pytest.raises(ParamError, match=r"request 'k': top_k: expected an integer in "
                                             r"0\.\.256 .* found 257"):
            engine.submit([1], _greedy(2, top_k=vocab + 1), request_id="k")
        with pytest.raises(ParamError, match=r"request 'p': prompt\[1\]: expected a token id "
                                             r"in 0\.\.255 \(the vocabulary of 256 tokens\), "
                                             r"found 256"):
            engine.submit([1, vocab], request_id="p")
        with pytest.raises(ParamError, match=r"stop_ids: expected token ids in 0\.\.255"):
            engine.submit([1], _greedy(2, stop_ids=frozenset({vocab})))
        assert engine.num_waiting == engine.num_running == 0
    gen = Generator(pipe, input_dtypes=_dtypes(model), max_slots=SLOTS, max_seq=SEQ,
                    prefill_buckets=BUCKETS, vocab_size=vocab)
    with pytest.raises(ParamError, match=r"prompt 1: top_k: expected an integer in 0\.\.256"):
        gen.run([[1], [2]], [_greedy(2), _greedy(2, top_k=1000)])
    assert gen._engine is None  # refused before the engine started


def test_an_idle_engine_keeps_its_session_then_ends_it(tiny, pipe):
    """The KV memory outlives an idle gap: the next request runs on the same session (it pays
    no allocation); after keep_session_s without a request the session is ended."""
    _, hf, model = tiny
    fed = _Fed(pipe)
    with _engine(fed, model, keep_session_s=WAIT) as engine:
        assert engine.submit(PROMPTS[0], _greedy(3)).result(WAIT).tokens == _hf_greedy(
            hf, PROMPTS[0], 3)
        held = len(pipe.sessions)
        assert held == 2  # idle, kept: the session's state on each of the 2 stages
        assert engine.submit(PROMPTS[3], _greedy(4)).result(WAIT).tokens == _hf_greedy(
            hf, PROMPTS[3], 4)
        assert len(fed.fed) == 1 and len(pipe.sessions) == held  # both on that session
    assert len(pipe.sessions) == 0  # close ends it
    with _engine(pipe, model, keep_session_s=WAIT) as engine:
        # A kept session whose requests were all aborted: the loop waits, it does not spin.
        stream = engine.submit(PROMPTS[1], _greedy(50))
        next(iter(stream))
        assert stream.abort() and stream.result(WAIT).finish_reason == "abort"
        rounds = 0
        real = engine._round

        def counted(*args: Any) -> bool:
            nonlocal rounds
            rounds += 1
            return real(*args)

        engine._round = counted  # type: ignore[method-assign]
        threading.Event().wait(0.5)  # a window to count in; a spinning loop runs thousands
        assert rounds <= 2 and len(pipe.sessions) == 2
    with _engine(pipe, model, keep_session_s=0.2) as engine:
        engine.submit(PROMPTS[0], _greedy(3)).result(WAIT)
        deadline = time.monotonic() + WAIT
        while len(pipe.sessions) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pipe.sessions) == 0


def test_an_engine_never_closed_ends_its_session_at_exit(tiny):
    """A script that leaves its engine open still ends the kept session when it exits, so
    remote workers do not hold the KV memory until their idle timeout."""
    root, _, _ = tiny
    script = f"""
import sys
from jaxdist.coordinator.engine import Engine
from jaxdist.coordinator.inprocess import InProcessPipeline
from jaxdist.coordinator.request import ParamError
from jaxdist.coordinator.request import SamplingParams
from jaxdist.exporters.llama import llama_model

class Told:
    closed = False
    def __init__(self, pipe):
        self.pipe = pipe
    def submit(self, inputs, **kw):
        return self.pipe.submit(inputs, **kw)
    def end_session(self, session_id):
        if self.closed:  # as a closed gRPC channel answers
            raise ValueError("Cannot invoke RPC on closed channel!")
        print("ended", session_id, flush=True)
        return self.pipe.end_session(session_id)

model = llama_model("llama", roots=[{str(root)!r}], max_slots=2, max_seq=32,
                    prefill_buckets=(8,))
pipe = InProcessPipeline(model, weights_roots=[{str(root)!r}])
told = Told(pipe)
engine = Engine(told, input_dtypes={{k: v[1] for k, v in model.inputs.items()}},
                max_slots=2, max_seq=32, prefill_buckets=(8,), keep_session_s=600)
engine.submit([5, 17, 99], SamplingParams(max_tokens=3)).result(120)
told.closed = sys.argv[1] == "closed"
print("done", flush=True)
"""
    out = subprocess.run([sys.executable, "-c", script, "open"], capture_output=True,
                         text=True, timeout=WAIT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "done" and len(lines) == 2 and lines[1].startswith("ended gen-"), lines
    # Its pipeline closed first (channels gone): the exit stays quiet, no traceback.
    out = subprocess.run([sys.executable, "-c", script, "closed"], capture_output=True,
                         text=True, timeout=WAIT)
    assert out.returncode == 0 and out.stdout.splitlines() == ["done"], out.stderr
    assert "Traceback" not in out.stderr and "step loop failed" not in out.stderr, out.stderr


def test_keep_session_0_ends_the_session_with_the_last_request(tiny, pipe):
    """Once a caller has its last result, the workers hold no state of the engine."""
    _, _, model = tiny
    with _engine(pipe, model, keep_session_s=0) as engine:
        engine.submit(PROMPTS[0], _greedy(3)).result(WAIT)
        assert len(pipe.sessions) == 0
        streams = [engine.submit(p, _greedy(4)) for p in PROMPTS[:3]]
        for st in streams:
            st.result(WAIT)
        assert len(pipe.sessions) == 0


def test_a_session_the_workers_reclaimed_while_idle_is_rebuilt(tiny):
    """A worker whose --session-idle-timeout is shorter than the engine's keep_session_s
    reclaims the idle session; the next request is rebuilt on a new one, not failed."""
    root, hf, model = tiny
    with Cluster.local(2, weights_roots=[str(root)],
                       extra_args=["--session-idle-timeout", "1"]) as cluster:
        pipeline = _Fed(cluster.deploy(model, stages=2))
        with _engine(pipeline, model, keep_session_s=WAIT, depth=2) as engine:
            assert engine.submit(PROMPTS[1], _greedy(5)).result(WAIT).tokens == _hf_greedy(
                hf, PROMPTS[1], 5)
            deadline = time.monotonic() + WAIT  # the workers' reaper runs every 0.25 s
            while (any(i.sessions for i in cluster.info())
                   and time.monotonic() < deadline):
                time.sleep(0.2)
            assert not any(i.sessions for i in cluster.info())
            streams = [engine.submit(p, _greedy(6)) for p in PROMPTS[2:4]]
            assert [st.result(WAIT).tokens for st in streams] == [
                _hf_greedy(hf, p, 6) for p in PROMPTS[2:4]]
            # Rebuilt: what had gone out on the reclaimed session when its error came back.
            assert 1 <= engine.recomputed <= 2 and len(pipeline.fed) == 2
        pipeline.close()


def test_waiting_prompts_are_prefilled_together(tiny, pipe):
    """With prefill_rows, the prompts that wait share prefill steps (in chunks of the smallest
    bucket), and every output is still transformers' greedy one."""
    _, hf, model = tiny
    fed = _Fed(pipe)
    lengths = [5, 7, 4, 6]
    engine, rec = _observed(fed, model, prefill_rows=SLOTS)
    done = threading.Event()
    reached = threading.Event()
    with engine:
        # Hold the loop on a first request so the others all wait, then let them in together.
        rec.at_token[("hold", 1)] = _block_until(done, reached)
        hold = engine.submit([1, 2], _greedy(2), request_id="hold")
        assert reached.wait(WAIT)
        streams = [engine.submit(p, _greedy(n)) for p, n in zip(PROMPTS[:4], lengths)]
        done.set()
        hold.result(WAIT)
        results = [st.result(WAIT).tokens for st in streams]
    assert results == [_hf_greedy(hf, p, n) for p, n in zip(PROMPTS[:4], lengths)]
    prefills = [e[1] for e in rec.of("step") if e[2] > 1]
    assert max(prefills) >= 3, f"prefill steps carried {prefills} rows"
    # The 12-token prompt went in chunks of the bucket: 8 tokens, then 4.
    (session,) = fed.fed.values()
    (fed_12,) = [steps for steps in session.values() if steps[0] == PROMPTS[1][:8]]
    assert fed_12[:2] == [PROMPTS[1][:8], PROMPTS[1][8:]]


# ---------------------------------------------------------------------------------------------
# 6. async consumers


def _content(deltas: list[Any]) -> list[tuple[Any, ...]]:
    return [(d.token_ids, d.text, d.finish_reason, d.prompt_tokens, d.completion_tokens)
            for d in deltas]


def test_async_consumers_get_the_same_deltas(tiny, pipe):
    _, _, model = tiny
    params = [_greedy(12), _greedy(7, stop_strings=("q",)), _greedy(9)]
    with _engine(pipe, model, tokenizer=Letters()) as engine:
        sync = [_content(list(engine.submit(p, sp))) for p, sp in zip(PROMPTS, params)]

        async def consume(prompt: list[int], sp: SamplingParams) -> list[tuple[Any, ...]]:
            return _content([d async for d in engine.submit(prompt, sp)])

        async def main() -> list[list[tuple[Any, ...]]]:
            return list(await asyncio.gather(*(consume(p, sp) for p, sp in zip(PROMPTS, params))))

        assert asyncio.run(main()) == sync
    assert all(s[-1][2] in ("length", "stop") for s in sync)


# ---------------------------------------------------------------------------------------------
# the observer, errors


class _Broken:
    def __getattr__(self, name: str) -> Callable[..., None]:
        def hook(*args: Any) -> None:
            raise RuntimeError(f"observer {name} broke")
        return hook


def test_a_failing_observer_is_logged_and_changes_nothing(tiny, pipe, caplog):
    _, hf, model = tiny
    with caplog.at_level(logging.ERROR, logger="jaxdist.coordinator.engine"), _engine(
            pipe, model, observer=_Broken()) as engine:
        assert engine.submit(PROMPTS[0], _greedy(5)).result(WAIT).tokens == _hf_greedy(
            hf, PROMPTS[0], 5)
    assert "the observer failed" in caplog.text and "observer step broke" in caplog.text


def test_error_prompts_name_the_request_and_the_limit(tiny, pipe):
    _, _, model = tiny
    gated = GatedPipeline(pipe, WAIT)  # closed: "dup" keeps running until the end of the test
    with _engine(gated, model) as engine:
        with pytest.raises(SpecError, match=r"the prompt of request 'r7' is empty"):
            engine.submit([], request_id="r7")
        with pytest.raises(SpecError, match=r"request 'r8' has 64 tokens; the KV cache holds "
                                            r"64 positions \(max_seq\)"):
            engine.submit([1] * SEQ, request_id="r8")
        with pytest.raises(SpecError, match=r"request 'r9' has stop_strings .* no tokenizer"):
            engine.submit([1], SamplingParams(stop_strings=("x",)), request_id="r9")
        engine.submit([1], _greedy(3), request_id="dup")
        with pytest.raises(SpecError, match="request id 'dup' is already running"):
            engine.submit([1], _greedy(3), request_id="dup")
        gated.open.set()
    with pytest.raises(SpecError, match="max_queue must be >= 0, got -1"):
        _engine(pipe, model, max_queue=-1)
