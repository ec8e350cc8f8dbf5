"""The HTTP app (:mod:`jaxdist.serving.app`) in process, over a real :class:`Engine` on a real
in-process pipeline, for what a live server cannot show on demand: the engine's queue full
(503 with ``Retry-After``), the server still loading, and the request parser's refusals.

The model is a stand-in LM whose next token is the last one plus one (the example of
:class:`~jaxdist.coordinator.engine.Engine`), so every expected token follows from the prompt.
Its pipeline is gated: its steps wait until the test opens the gate, so a request holds its KV
slot for as long as the test needs (no timing).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from llm_utils import GatedPipeline  # noqa: E402

from jaxdist.coordinator.engine import Engine  # noqa: E402
from jaxdist.coordinator.inprocess import InProcessPipeline  # noqa: E402
from jaxdist.export.model import Model, Unit  # noqa: E402
from jaxdist.serving import protocol  # noqa: E402
from jaxdist.serving.app import Served, ServerState, create_app  # noqa: E402

WAIT = 60.0


def _next_token(params: Any, state: Any, carry: dict[str, Any]) -> tuple[dict[str, Any], dict]:
    rows = jax.numpy.arange(carry["tokens"].shape[0])
    return {"token": carry["tokens"][rows, carry["length"] - 1] + 1}, {}


INPUTS = {"tokens": ("b, s", "int32"), "slot": ("b", "int32"), "pos": ("b", "int32"),
          "length": ("b", "int32"), "temperature": ("b", "float32"), "top_k": ("b", "int32"),
          "top_p": ("b", "float32"), "seed": ("b", "uint32")}


@pytest.fixture
def app(tmp_path: Any) -> Iterator[tuple[TestClient, GatedPipeline, Engine, ServerState]]:
    model = Model("counter", [Unit("next", _next_token)], inputs=INPUTS,
                  control=("slot", "pos", "length", "temperature", "top_k", "top_p", "seed"))
    with InProcessPipeline(model, weights_roots=[str(tmp_path)]) as pipe:
        gated = GatedPipeline(pipe, WAIT)
        with Engine(gated, input_dtypes={k: v[1] for k, v in INPUTS.items()}, max_slots=1,
                    max_seq=64, prefill_buckets=[4, 8], max_queue=0) as engine:
            state = ServerState("counter")
            yield TestClient(create_app(state)), gated, engine, state


def _body(**kw: Any) -> dict[str, Any]:
    return {"model": "counter", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, **kw}


def test_loading_then_serving(app: Any) -> None:
    client, gated, engine, state = app
    r = client.get("/health")
    assert r.status_code == 503 and r.headers["Retry-After"]
    r = client.post("/v1/completions", json=_body())
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
    state.serve(Served("counter", "causal-lm", None, engine=engine, max_seq=64))
    gated.open.set()
    r = client.post("/v1/completions", json=_body())
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert client.get("/health").json() == {"status": "ok"}


def test_a_full_queue_is_503_with_retry_after(app: Any) -> None:
    client, gated, engine, state = app
    state.serve(Served("counter", "causal-lm", None, engine=engine, max_seq=64))
    holder = engine.submit([5, 6], protocol.parse_completion(_body()).params(
        max_seq=64, prompt_len=2))  # takes the one slot; its steps wait at the gate
    assert engine.slots_in_use == 1
    r = client.post("/v1/completions", json=_body())
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "queue_full" and err["type"] == "server_error"
    assert "max_queue=0" in err["message"]
    gated.open.set()
    assert [t for d in holder for t in d.token_ids] == [7, 8, 9, 10]  # 6 + 1, ...
    r = client.post("/v1/completions", json=_body())
    assert r.status_code == 200  # the slot is free again


def test_streamed_token_ids_follow_the_prompt(app: Any) -> None:
    client, gated, engine, state = app
    state.serve(Served("counter", "causal-lm", None, engine=engine, max_seq=64))
    gated.open.set()
    with client.stream("POST", "/v1/completions",
                       json=_body(stream=True, stream_options={"include_usage": True})) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert '"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}' in lines[-2]


@pytest.mark.parametrize("body, param, text", [
    ({"prompt": "x"}, "model", "model: is required"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens", "expected an integer >= 1"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ({"model": "m", "prompt": "x", "seed": -1}, "seed", "in 0..4294967295"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options", "only allowed when stream is true"),
    ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty",
     "not supported yet"),
    ({"model": "m", "prompt": ""}, "prompt", "must not be empty"),
])
def test_completion_refusals_name_the_field(body: dict[str, Any], param: str, text: str) -> None:
    with pytest.raises(protocol.APIError) as err:
        protocol.parse_completion(body)
    assert err.value.param == param and text in err.value.message and err.value.status == 400


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = protocol.parse_completion({"model": "m", "prompt": "x", "max_tokens": 9,
                                     "max_completion_tokens": 3})
    assert req.max_tokens == 3


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content[0]"),
])
def test_chat_refusals_name_the_field(messages: list[Any], param: str) -> None:
    with pytest.raises(protocol.APIError) as err:
        protocol.parse_chat({"model": "m", "messages": messages})
    assert err.value.param == param


def test_chat_content_parts_join() -> None:
    req = protocol.parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]})
    assert req.messages == ({"role": "system", "content": "ab"},)
