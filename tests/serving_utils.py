"""Test helpers for the HTTP server: a stand-in LM behind a real :class:`Engine`, a tokenizer
a test can hold, and the real app under the real server (:mod:`jaxdist.serving.server`), in a
thread or, run as a script, in a process of its own.

The stand-in LM's next token is the last one plus one (the example of
:class:`~jaxdist.coordinator.engine.Engine`), so every expected token follows from the prompt.
Its pipeline is gated: its steps wait until the test opens the gate, so a request holds its KV
slot for as long as the test needs (no timing).

As a script (``python tests/serving_utils.py --api-key KEY``) it serves the stand-in with its
gate open, as ``jaxdist serve`` would: the open-file limit raised, the connection cap sized from
it, and ``jaxdist: listening on http://127.0.0.1:PORT`` on stderr once it listens.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import jax
import uvicorn
from llm_utils import GatedPipeline

from jaxdist.coordinator.engine import Engine
from jaxdist.coordinator.inprocess import InProcessPipeline
from jaxdist.export.model import Model, Unit
from jaxdist.serving.app import Served, ServerState, create_app
from jaxdist.serving.server import HTTPLimits, server_config

WAIT = 60.0
MAX_SEQ = 64


def _next_token(params: Any, state: Any, carry: dict[str, Any]) -> tuple[dict[str, Any], dict]:
    rows = jax.numpy.arange(carry["tokens"].shape[0])
    return {"token": carry["tokens"][rows, carry["length"] - 1] + 1}, {}


INPUTS = {"tokens": ("b, s", "int32"), "slot": ("b", "int32"), "pos": ("b", "int32"),
          "length": ("b", "int32"), "temperature": ("b", "float32"), "top_k": ("b", "int32"),
          "top_p": ("b", "float32"), "seed": ("b", "uint32")}


@contextlib.contextmanager
def counter_engine(tmp_path: Any, pipeline: Any = None, **engine_kw: Any
                   ) -> Iterator[tuple[GatedPipeline, Engine]]:
    """The stand-in LM's engine, behind a gate; ``pipeline(pipe)`` wraps the pipeline."""
    model = Model("counter", [Unit("next", _next_token)], inputs=INPUTS,
                  control=("slot", "pos", "length", "temperature", "top_k", "top_p", "seed"))
    with InProcessPipeline(model, weights_roots=[str(tmp_path)]) as pipe:
        gated = GatedPipeline(pipe if pipeline is None else pipeline(pipe), WAIT)
        with Engine(gated, input_dtypes={k: v[1] for k, v in INPUTS.items()}, max_seq=MAX_SEQ,
                    prefill_buckets=[4, 8], **{"max_slots": 1, "max_queue": 0, **engine_kw}
                    ) as engine:
            yield gated, engine


class ByteTokenizer:
    """A tokenizer a test can hold: a token per UTF-8 byte (id = byte % 32 + 1), a chat
    template that writes ``<role>content``. With ``gate``, ``encode`` and
    ``apply_chat_template`` say they started (``entered``) and wait for the gate."""

    chat_template = "<role>content"

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.entered = threading.Event()
        self.calls = 0

    def _hold(self) -> None:
        self.calls += 1
        self.entered.set()
        if self.gate is not None and not self.gate.wait(WAIT):
            raise AssertionError("the tokenizer's gate was never opened")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self._hold()
        return [b % 32 + 1 for b in text.encode()]

    def decode(self, ids: Any, *, skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + int(t) % 26) for t in ids)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        self._hold()
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def counter_state(engine: Any, tokenizer: Any = None, *, api_keys: tuple[str, ...] = ()
                  ) -> ServerState:
    """A server state serving ``engine`` as model ``counter``."""
    state = ServerState("counter", api_keys=api_keys)
    state.serve(Served("counter", "causal-lm", tokenizer, engine=engine, max_seq=MAX_SEQ,
                       special_tokens_in_content=True))
    return state


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = threading.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        self.listening.set()


@contextlib.contextmanager
def running(state: ServerState, limits: HTTPLimits) -> Iterator[tuple[str, int]]:
    """The real app over ``state`` under the real server, in a thread: ``(host, port)``."""
    server = _Server(server_config(create_app(state), host="127.0.0.1", port=0,
                                   limits=limits))
    thread = threading.Thread(target=server.run, name="http-server", daemon=True)
    thread.start()
    assert server.listening.wait(WAIT) and server.started, "the server did not start"
    try:
        yield "127.0.0.1", server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(WAIT)


def main() -> None:
    from jaxdist.core.openfiles import raise_fd_limit
    from jaxdist.serving.server import default_max_body_bytes, server_connection_limit

    p = argparse.ArgumentParser()
    p.add_argument("--api-key", default="")
    p.add_argument("--max-connections", type=int, default=None)
    p.add_argument("--head-timeout", type=float, default=None,
                   help="idle and header timeouts (long: only the cap makes room in a flood)")
    opts = p.parse_args()
    raise_fd_limit()
    head = {} if opts.head_timeout is None else {"idle_timeout_s": opts.head_timeout,
                                                  "header_timeout_s": opts.head_timeout}
    limits = HTTPLimits(max_body_bytes=default_max_body_bytes(MAX_SEQ),
                        max_connections=opts.max_connections or server_connection_limit(),
                        **head)
    with tempfile.TemporaryDirectory() as tmp, \
            counter_engine(tmp, max_slots=4, max_queue=64) as (gated, engine):
        gated.open.set()
        state = counter_state(engine, ByteTokenizer(),
                              api_keys=(opts.api_key,) if opts.api_key else ())
        server = _Server(server_config(create_app(state), host="127.0.0.1", port=0,
                                       limits=limits))

        def announce() -> None:
            if server.listening.wait(WAIT):
                port = server.servers[0].sockets[0].getsockname()[1]
                print(f"jaxdist: listening on http://127.0.0.1:{port} (at most "
                      f"{limits.max_connections} connections)", file=sys.stderr, flush=True)

        threading.Thread(target=announce, daemon=True).start()
        server.run()  # until SIGTERM or SIGINT


if __name__ == "__main__":
    main()
