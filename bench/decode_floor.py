"""Decode floor: what two processes cost a token before any of jaxdist's worker runs.

The same SmolLM2-135M Q4_1 model and export settings as ``bench/decode.py`` (batch 1, greedy,
48 new tokens after the prompt "The capital of France is"). Five systems, timed in interleaved
rounds whose order rotates, so drift of a shared 2-core machine hits all of them alike:

* ``single``: one stage in this process (``InProcessPipeline`` and the ``Generator``, as
  ``bench/decode.py``'s baseline).
* ``inproc2``: the two stages of the 2-worker split, in this process, run one after the other
  with a host copy of stage 0's output between them: no event loop, no transport.
* ``relays2``: the same two stages in two *relay* processes on loopback:
  client -> relay 0 -> relay 1 -> client, the three transfers per token of a 2-worker
  deployment. A relay reads a length-prefixed frame from a blocking socket, decodes it with
  jaxdist's frame codec (``frames.parse_frame``, ``FrameAssembler``), runs its stage
  (``WorkerStage.run``, the worker's own stage class), copies the outputs to the host, encodes
  them (``frames.split_frame``) and writes them on. It has none of the worker's event loop,
  checks, limits or stage runtime: the floor of a pipeline of two Python processes that each run
  a jax stage.
* ``loop2``: the relays of ``relays2`` with the decode loop closed on them: the client sends
  the prompt once, relay 1 sends each token straight back to relay 0, which builds the next
  step's inputs itself, and sends the client all the tokens at the end, with when each step
  ended (``time.perf_counter`` in relay 1). Two transfers per token instead of three, and no
  client in the loop: the floor of a decode loop run by the workers that streams nothing.
* ``2w``: jaxdist, ``Cluster.local(2)`` with one stage per worker (``bench/decode.py``'s ``2w``).

Records: ``decode_floor_tokens_per_s_{single,inproc2,relays2,loop2,2w}`` (1 / median step, with
``median_step_ms`` and each round's steps in the detail), each against ``single``;
``decode_floor_2w_over_relays2``: jaxdist's 2 workers against the relay floor. The relays'
tokens are compared with the single process's (``same_tokens``).
``decode_floor_loop2_over_relays2``: the closed loop against the chain. Nothing here asserts on
time.

Usage::

    python bench/decode_floor.py [--quick] [--out results.json]
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import _common
import decode

_LEN = struct.Struct("<Q")
_READY = "relay listening on port "
_UPSTREAM = b"U"  # a connection that sends frames into a relay
_RETURN = b"R"  # the client's connection to the last relay, for the results
_FEEDBACK = b"F"  # loop2: the last relay's connection back to the first, for the tokens
_PORT = struct.Struct("<I")  # after _UPSTREAM: the sender's own port (0 from the client)
NEW_TOKENS = 48


# ---------------------------------------------------------------------------------------------
# Frames on a blocking socket (both ends)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """The next ``n`` bytes; ``None`` if the peer closed before the first."""
    buf = bytearray(n)
    return bytes(buf) if _common.recv_into(sock, memoryview(buf)) else None


def _send(sock: socket.socket, header: Any, tensors: dict[str, Any]) -> None:
    from jaxdist.core.transport.frames import split_frame

    (message,) = split_frame(header, tensors)  # a decode step's frame is one message
    sock.sendall(_LEN.pack(len(message)) + message)


def _receive(sock: socket.socket, asm: Any) -> tuple[Any, dict[str, Any]] | None:
    from jaxdist.core.transport.frames import header_of, parse_frame

    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    data = _recv_exact(sock, n)
    if data is None:
        raise ConnectionError("peer closed inside a frame")
    view = parse_frame(data)
    done = asm.add(view, header_of(view.msg))
    if done is None:
        raise ConnectionError("a decode step's frame came in more than one message")
    return done


# ---------------------------------------------------------------------------------------------
# The relay process


def _load_stage(workdir: pathlib.Path, k: int) -> Any:
    from jaxdist.core import kernels
    from jaxdist.core.spec import StageSpec
    from jaxdist.core.stage import WorkerStage
    from jaxdist.core.weights import WeightCache

    kernels.load()
    spec = StageSpec.deserialize((workdir / f"spec{k}").read_bytes())
    cache = WeightCache([(workdir / "root").read_text()])
    return WorkerStage.load(spec, artifact=(workdir / f"artifact{k}").read_bytes(), cache=cache)


def _relay_main(workdir: str, k: int, next_port: int, loop: bool) -> int:
    """Run stage ``k`` on every frame from upstream; send the outputs, with the step's other
    tensors, which the next stage reads, to ``next_port``; or (0) the outputs alone back to
    the client. With ``loop`` (``loop2``), relay 1 also sends them back to relay 0, which
    runs the decode steps of a prompt from them (:func:`_loop_first`)."""
    stage = _load_stage(pathlib.Path(workdir), k)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    print(f"{_READY}{port}", flush=True)
    down = feedback = None
    if next_port:
        down = _common.nodelay(socket.create_connection(("127.0.0.1", next_port)))
        down.sendall(_UPSTREAM + _PORT.pack(port))
    # the first relay of a loop hears from the last; the last relay of any chain, the client
    wanted = {_UPSTREAM, *([_FEEDBACK] if loop and next_port else []),
              *([] if next_port else [_RETURN])}
    conns: dict[bytes, socket.socket] = {}
    while set(conns) != wanted:  # each connection says what it is: they race
        conn = _common.nodelay(server.accept()[0])
        role = _recv_exact(conn, 1) or b""
        if role == _UPSTREAM:
            (back,) = _PORT.unpack(_recv_exact(conn, _PORT.size) or bytes(_PORT.size))
            if loop and not next_port and back:  # the last relay of a loop dials the first
                feedback = _common.nodelay(socket.create_connection(("127.0.0.1", back)))
                feedback.sendall(_FEEDBACK)
        if role in wanted and role not in conns:
            conns[role] = conn
        else:
            conn.close()
    up, out_sock = conns[_UPSTREAM], down or conns[_RETURN]
    if loop and next_port:
        _loop_first(stage, up, conns[_FEEDBACK], out_sock, pathlib.Path(workdir))
    elif loop:
        assert feedback is not None
        _loop_last(stage, up, feedback, out_sock)
    else:
        _chain(stage, up, out_sock, forward=bool(next_port))
    return 0


def _run(stage: Any, tensors: dict[str, Any], state: Any) -> tuple[dict[str, Any], Any]:
    import numpy as np

    inputs = {s.name: tensors[s.name] for s in stage.spec.inputs}
    outputs, state = stage.run(inputs, state, shapes=stage.check_inputs(inputs))
    return {n: np.asarray(v) for n, v in outputs.items()}, state


def _chain(stage: Any, up: socket.socket, down: socket.socket, *, forward: bool) -> None:
    """A relay of the chain: one step per frame from ``up``. ``forward``: the step's other
    tensors (position, sampling) go on with the outputs, to the next stage."""
    from jaxdist.core.transport.frames import FrameAssembler, FrameHeader

    asm, state = FrameAssembler(), None
    while (got := _receive(up, asm)) is not None:
        header, tensors = got
        if header.step == 0:
            state = stage.init_state()
        out, state = _run(stage, tensors, state)
        _send(down, FrameHeader(header.pipeline_id, header.session_id, header.step,
                                header.stage + 1), {**tensors, **out} if forward else out)


def _loop_last(stage: Any, up: socket.socket, feedback: socket.socket,
               down: socket.socket) -> None:
    """loop2's last relay: each step's outputs go back to the first relay (but a prompt's
    last token). The client hears once per prompt: its tokens, and when each step ended
    (``time.perf_counter``, the system's monotonic clock): sending it every token would wake
    it while the first relay computes, so this is the floor of a loop that streams nothing."""
    import numpy as np

    from jaxdist.core.transport.frames import FrameAssembler, FrameHeader

    asm, state = FrameAssembler(), None
    tokens: list[int] = []
    ends: list[float] = []
    while (got := _receive(up, asm)) is not None:
        header, tensors = got
        if header.step == 0:
            state, tokens, ends = stage.init_state(), [], []
        out, state = _run(stage, tensors, state)
        reply = FrameHeader(header.pipeline_id, header.session_id, header.step, 2)
        last = header.step + 1 == _loop_tokens(header.session_id)[0]
        if not last:
            _send(feedback, reply, out)
        tokens.append(_first_token(out))
        ends.append(time.perf_counter())
        if last:
            _send(down, reply, {"tokens": np.asarray(tokens, np.int64),
                                "ends": np.asarray(ends, np.float64)})


def _loop_tokens(session_id: str) -> tuple[int, int]:
    """loop2's session id: ``"<new tokens>:<prompt length>"``."""
    n, prompt = session_id.split(":")
    return int(n), int(prompt)


def _loop_first(stage: Any, up: socket.socket, feedback: socket.socket, down: socket.socket,
                workdir: pathlib.Path) -> None:
    """loop2's first relay: a prompt frame from the client, then each decode step from the
    token that the last relay sends back, the step's inputs built here (as the coordinator
    builds them)."""
    from jaxdist.coordinator.request import SamplingParams
    from jaxdist.coordinator.steps import step_inputs
    from jaxdist.core.transport.frames import FrameAssembler, FrameHeader

    meta = json.loads((workdir / "inputs.json").read_text())
    asm, params = FrameAssembler(), SamplingParams()
    while (got := _receive(up, asm)) is not None:
        header, tensors = got
        n, prompt = _loop_tokens(header.session_id)
        state = stage.init_state()
        for step in range(n):
            if step:
                back = _receive(feedback, asm)
                if back is None:
                    raise ConnectionError("the last relay closed its loop connection")
                tensors = step_inputs([(0, prompt + step - 1, [_first_token(back[1])], params)],
                                      1, dtypes=meta["dtypes"], max_slots=meta["max_slots"])
            out, state = _run(stage, tensors, state)
            _send(down, FrameHeader(header.pipeline_id, header.session_id, step, 1),
                  {**tensors, **out})


class Relays:
    """Two relay processes with the stages of the 2-worker split, and the client's sockets."""

    def __init__(self, workdir: pathlib.Path, *, loop: bool = False) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        port = 0
        try:
            for k in (1, 0):  # the last first: each dials the one after it
                proc = subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "_relay", str(workdir), str(k),
                     str(port), "loop" if loop else "chain"], stdout=subprocess.PIPE,
                    stdin=subprocess.DEVNULL, text=True)
                self.procs.append(proc)
                line = proc.stdout.readline().strip() if proc.stdout else ""
                if not line.startswith(_READY):
                    raise RuntimeError(f"relay {k} (pid {proc.pid}) did not start: {line!r}")
                port = int(line[len(_READY):])
                if k == 1:
                    last = port
            self.send = _common.nodelay(socket.create_connection(("127.0.0.1", port)))
            self.send.sendall(_UPSTREAM + _PORT.pack(0))
            self.back = _common.nodelay(socket.create_connection(("127.0.0.1", last)))
            self.back.sendall(_RETURN)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for s in (getattr(self, "send", None), getattr(self, "back", None)):
            if s is not None:
                s.close()
        _common.stop_relays(self.procs, 10.0)  # relay 0 ends when the client closes, then 1
        self.procs = []


# ---------------------------------------------------------------------------------------------
# The systems: each generates NEW_TOKENS tokens greedily; returns (tokens, step durations)

Generate = Callable[[list[int], int], tuple[list[int], list[float]]]


def _steps_loop(step: Callable[[dict[str, Any], int], int], lm: Any) -> Generate:
    """Prefill the prompt (its 16 bucket), then decode ``n`` tokens one step at a time."""
    from jaxdist.coordinator.request import SamplingParams
    from jaxdist.coordinator.steps import step_inputs

    params = SamplingParams()

    def generate(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        first = step_inputs([(0, 0, ids, params)], decode.PREFILL_BUCKETS[0],
                            dtypes=lm.input_dtypes, max_slots=lm.max_slots)
        tokens, stamps = [step(first, 0)], []
        for i in range(n - 1):
            x = step_inputs([(0, len(ids) + i, [tokens[-1]], params)], 1,
                            dtypes=lm.input_dtypes, max_slots=lm.max_slots)
            tokens.append(step(x, i + 1))
            stamps.append(time.perf_counter())
        return tokens, [b - a for a, b in zip(stamps, stamps[1:])]

    return generate


def _first_token(outputs: dict[str, Any]) -> int:
    import numpy as np

    return int(np.asarray(next(iter(outputs.values()))).reshape(-1)[0])


def _inproc2(stages: Sequence[Any], lm: Any) -> Generate:
    states: list[Any] = [None, None]

    def step(x: dict[str, Any], n: int) -> int:
        tensors = dict(x)
        for k, stage in enumerate(stages):
            if n == 0:
                states[k] = stage.init_state()
            outputs, states[k] = _run(stage, tensors, states[k])
            tensors.update(outputs)
        return _first_token(outputs)

    return _steps_loop(step, lm)


def _relays2(relays: Relays, lm: Any) -> Generate:
    from jaxdist.core.transport.frames import FrameAssembler, FrameHeader

    asm = FrameAssembler()

    def step(x: dict[str, Any], n: int) -> int:
        _send(relays.send, FrameHeader("floor", "s", n, 0), x)
        got = _receive(relays.back, asm)
        if got is None:
            raise ConnectionError("relay 1 closed its connection")
        return _first_token(got[1])  # the last relay sends its stage's outputs only

    return _steps_loop(step, lm)


def _loop2(relays: Relays, lm: Any) -> Generate:
    from jaxdist.coordinator.request import SamplingParams
    from jaxdist.coordinator.steps import step_inputs
    from jaxdist.core.transport.frames import FrameAssembler, FrameHeader

    asm = FrameAssembler()

    def generate(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        x = step_inputs([(0, 0, ids, SamplingParams())], decode.PREFILL_BUCKETS[0],
                        dtypes=lm.input_dtypes, max_slots=lm.max_slots)
        _send(relays.send, FrameHeader("floor", f"{n}:{len(ids)}", 0, 0), x)
        got = _receive(relays.back, asm)
        if got is None:
            raise ConnectionError("relay 1 closed its connection")
        tokens, ends = got[1]["tokens"].tolist(), got[1]["ends"].tolist()
        # as _steps_loop: the intervals between decode steps (the prompt's token excluded)
        return tokens, [b - a for a, b in zip(ends[1:], ends[2:])]

    return generate


def _generator(cfg: Any) -> Generate:
    def generate(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        result, steps = decode._batch1(cfg, ids, n)
        return list(result.tokens), steps

    return generate


# ---------------------------------------------------------------------------------------------


def run(opts: Any) -> list[dict[str, Any]]:
    import jax

    from jaxdist.core import config
    from jaxdist.export.partition import balanced_split
    from jaxdist.export.plugins import load_model
    from jaxdist.export.stages import build_stage_specs

    note = _common.note("decode_floor")
    rounds = 3 if opts.quick else 7
    machine = _common.machine()
    config.configure_compilation_cache(config.default_compilation_cache(),
                                       jax.devices("cpu")[0].device_kind)
    path = decode.smollm2_path()
    root = os.fspath(path.parent)
    loaded = load_model(path.name, roots=[root], max_seq=decode.MAX_SEQ,
                        max_slots=decode.MAX_SLOTS, prefill_buckets=decode.PREFILL_BUCKETS)
    lm, model = loaded.causal_lm, loaded.model
    ids = loaded.tokenizer.encode(decode.PROMPT)
    records: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        workdir = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory()))
        (workdir / "root").write_text(root)
        (workdir / "inputs.json").write_text(json.dumps({"dtypes": dict(lm.input_dtypes),
                                                         "max_slots": lm.max_slots}))
        # The split of Cluster.deploy(stages=2), exported once for the relays and this process
        ranges = balanced_split([u.weight_bytes + u.state_bytes + 1 for u in model.units], 2)
        for b in build_stage_specs(model, ranges, platforms=("cpu",)):
            (workdir / f"spec{b.spec.stage_index}").write_bytes(b.spec.serialize())
            (workdir / f"artifact{b.spec.stage_index}").write_bytes(b.artifact.data)
        single = decode._build_single(loaded, root)
        stack.callback(single.pipe.close)
        two = decode._build_workers(loaded, root, 2)
        stack.callback(two.cluster.close)
        relays = Relays(workdir)
        stack.callback(relays.close)
        loop = Relays(workdir, loop=True)
        stack.callback(loop.close)
        stages = [_load_stage(workdir, k) for k in (0, 1)]
        note(f"built; the 2-stage split is units {[len(r) for r in ranges]}")
        systems: dict[str, Generate] = {"single": _generator(single),
                                        "inproc2": _inproc2(stages, lm),
                                        "relays2": _relays2(relays, lm),
                                        "loop2": _loop2(loop, lm), "2w": _generator(two)}
        tokens: dict[str, list[int]] = {}
        for name, generate in systems.items():  # warm-up: every shape compiled
            tokens[name] = generate(ids, 8)[0]
        steps: dict[str, list[float]] = {name: [] for name in systems}
        medians: dict[str, list[float]] = {name: [] for name in systems}
        loads = []
        for r in range(rounds):
            names = list(systems)
            for name in names[r % len(names):] + names[:r % len(names)]:
                tokens[name], got = systems[name](ids, NEW_TOKENS)
                steps[name] += got
                medians[name].append(round(_common.median(got) * 1e3, 3))
            loads.append(_common.load())
            note(f"round {r + 1}/{rounds}: median step ms {({k: v[-1] for k, v in medians.items()})}")
        tps = {name: 1.0 / _common.median(v) for name, v in steps.items()}
        same = {name: tokens[name] == tokens["single"] for name in systems}
        what = {"single": "one stage in this process (InProcessPipeline)",
                "inproc2": "the 2 stages in this process, one after the other",
                "relays2": "the 2 stages in 2 relay processes, blocking sockets, frame codec",
                "loop2": "relays2 with the decode loop closed on the relays (relay 1 sends each "
                         "token straight to relay 0)",
                "2w": "jaxdist, Cluster.local(2)"}
        for name in systems:
            _common.emit(_common.record(
                f"decode_floor_tokens_per_s_{name}", tps[name], "tok/s",
                "" if name == "single" else "single process", None if name == "single"
                else tps["single"], None if name == "single" else tps[name] / tps["single"],
                "", None, system=what[name], median_step_ms=round(1e3 / tps[name], 3),
                round_median_step_ms=medians[name], same_tokens_as_single=same[name],
                new_tokens=NEW_TOKENS, rounds=rounds, loadavg_1m_during=[min(loads), max(loads)],
                **machine), records)
        _common.emit(_common.record(
            "decode_floor_2w_over_relays2", tps["2w"], "tok/s", "2 relay processes",
            tps["relays2"], tps["2w"] / tps["relays2"], "", None,
            note="jaxdist's 2 workers against the floor of 2 Python processes running the "
                 "same stages", **machine), records)
        _common.emit(_common.record(
            "decode_floor_loop2_over_relays2", tps["loop2"], "tok/s", "2 relay processes",
            tps["relays2"], tps["loop2"] / tps["relays2"], "", None,
            note="what closing the decode loop on the relays (2 transfers a token, no client "
                 "in the loop) saves against the chain of 3", **machine), records)
    return records


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_relay":
        sys.exit(_relay_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                             sys.argv[5] == "loop"))
    sys.exit(_common.cli(__doc__ or "", run))
