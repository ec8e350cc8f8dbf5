"""The OpenAI-compatible HTTP server: FastAPI routes over one :class:`Engine` (or encoder).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /v1/embeddings`` (an encoder pipeline), ``GET /health`` and ``GET /metrics``. Requests
(:mod:`jaxdist.serving.schema`), responses and errors (:mod:`jaxdist.serving.protocol`) follow
OpenAI's. With API keys, every ``/v1`` route needs ``Authorization: Bearer KEY``, compared in
constant time; ``/health`` and ``/metrics`` stay open (a load balancer and Prometheus call them
without a key).

Status codes: 400 bad parameters (``param`` names the field by its path, as in
``messages[1].content``; an unknown field is refused by name) or a body that is not strict JSON
(:func:`~jaxdist.serving.protocol.parse_json`), 401 a missing or wrong key, 404 an unknown model
or route, 405 a route's wrong method, 500 a request that failed in the engine (the others go
on), 503 with ``Retry-After`` while loading, when the engine's queue is full, or when the
pipeline is broken (the message names the worker). Every error has OpenAI's body,
``{"error": {"message", "type", "param", "code"}}``.

``/health`` is 200 only while requests can be served: 503 while loading, after a failed load,
when the pipeline is broken, and once the engine has stopped, each with the reason.

A chat's messages are rendered with the model's chat template by a
:class:`~jaxdist.coordinator.chat_template.ChatEncoder`: special-token text in a message is
tokenized as text, so a client cannot close its turn or open a system turn
(``Served.special_tokens_in_content`` allows it).

A client that disconnects aborts its request: its KV slot is free by the next step.

A request's body is parsed, its chat rendered and its prompt tokenized in a thread, never on
the event loop, so a large body does not hold up ``/health`` or the streams of others. Prompt
text longer than the model's context can hold (``max_seq`` times
:data:`~jaxdist.serving.protocol.PROMPT_BYTES_PER_TOKEN` bytes) is refused with 400 before it
is tokenized. Body size, connections and timeouts are the HTTP server's
(:mod:`jaxdist.serving.server`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from jaxdist.coordinator.chat_template import ChatEncoder
from jaxdist.coordinator.engine import EngineClosed, QueueFull, RequestFailed
from jaxdist.coordinator.request import (
    Delta,
    ParamError,
    RequestStream,
    SamplingParams,
    check_token_ids,
)
from jaxdist.core.errors import JaxdistError, LimitError, SpecError
from jaxdist.serving import protocol as api
from jaxdist.serving import schema
from jaxdist.serving.metrics import ServerMetrics

__all__ = ["Served", "ServerState", "create_app"]

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 503 asks the client to wait

_T = TypeVar("_T")


@dataclasses.dataclass
class Served:
    """The model behind the server, once it is deployed.

    Attributes:
        name: the served model name (``--served-model-name``), the one ``model`` accepted.
        kind: ``"causal-lm"`` or ``"encoder"``.
        tokenizer: the model's tokenizer (``encode``, ``decode``, ``apply_chat_template``).
        engine: the generation engine (a causal LM).
        max_seq: KV-cache positions per sequence (a causal LM).
        embed: ``embed(rows of token ids) -> (n, dim)`` vectors (an encoder); blocking.
        broken: ``broken() -> error | None``: why the pipeline cannot serve (a dead worker and
            no spare), for ``/health``.
        special_tokens_in_content: let special-token text in chat messages become control
            tokens (``--allow-special-tokens-in-content``); by default it is plain text.
        chat: renders and tokenizes chats; made from ``tokenizer`` when it has a chat
            template.

    Raises:
        SpecError: the tokenizer cannot keep special tokens out of chat messages (see
            :class:`~jaxdist.coordinator.chat_template.ChatEncoder`).
    """

    name: str
    kind: str
    tokenizer: Any
    engine: Any = None
    max_seq: int = 0
    embed: Callable[[list[list[int]]], np.ndarray] | None = None
    broken: Callable[[], BaseException | None] = lambda: None
    special_tokens_in_content: bool = False
    chat: ChatEncoder | None = None

    def __post_init__(self) -> None:
        if self.chat is None and getattr(self.tokenizer, "chat_template", None) is not None:
            self.chat = ChatEncoder(self.tokenizer,
                                    special_tokens_in_content=self.special_tokens_in_content)

    def stopped(self) -> str | None:
        """Why the engine takes no more requests (closed, or its step loop failed), or
        ``None`` (also for a model without an engine)."""
        stopped = getattr(self.engine, "stopped", None)
        return stopped if isinstance(stopped, str) else None


class ServerState:
    """What the routes read: the model once loaded, the keys, the metrics. Thread-safe.

    The server answers before the model is deployed (``/health`` is 503 until then), so a
    load balancer or Kubernetes sees it come up.
    """

    def __init__(self, name: str, *, api_keys: Sequence[str] = (),
                 metrics: ServerMetrics | None = None) -> None:
        self.name = name
        self.api_keys = tuple(k.encode() for k in api_keys)
        self.metrics = metrics if metrics is not None else ServerMetrics(name)
        self._lock = threading.Lock()
        self._served: Served | None = None
        self._failure: str | None = None
        self.ready = threading.Event()

    def serve(self, served: Served) -> None:
        with self._lock:
            self._served = served
        self.ready.set()

    def fail(self, message: str) -> None:
        """Loading failed: the server answers 503 with ``message`` until it stops."""
        with self._lock:
            self._failure = message

    def served(self) -> Served:
        """The model, or APIError 503 while loading or after a failed load."""
        with self._lock:
            served, failure = self._served, self._failure
        if served is not None:
            return served
        if failure is not None:
            raise api.APIError(f"the model failed to load: {failure}", status=503,
                               type="server_error", code="model_load_failed")
        raise api.APIError(f"model {self.name} is still loading (compiling on the workers); "
                           f"retry shortly", status=503, type="server_error",
                           code="model_loading", headers={"Retry-After": str(RETRY_AFTER_S)})


def _authorized(state: ServerState, request: Request) -> bool:
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    token = given.strip().encode() if scheme.lower() == "bearer" else b""
    ok = False
    for key in state.api_keys:  # every key is compared: the time says nothing of which
        ok |= hmac.compare_digest(token, key)
    return ok


def _error_response(exc: api.APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _engine_error(exc: JaxdistError) -> api.APIError:
    """The API error for an error of the engine or the pipeline."""
    if isinstance(exc, QueueFull):
        return api.APIError(f"the server is busy: {exc}", status=503, type="server_error",
                            code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, ParamError):
        return api.param_error(exc)
    if isinstance(exc, (SpecError, LimitError)):
        return api.APIError(str(exc))
    if isinstance(exc, RequestFailed):  # this request's own failure; the others go on
        return api.APIError(f"the request failed: {exc}", status=500, type="server_error",
                            code="request_failed")
    kind = "engine_closed" if isinstance(exc, EngineClosed) else "pipeline_unavailable"
    return api.APIError(f"the pipeline cannot serve: {exc}", status=503, type="server_error",
                        code=kind, headers={"Retry-After": str(RETRY_AFTER_S)})


def _check_model(state: ServerState, model: str, kind: str, route: str) -> Served:
    served = state.served()
    if model != served.name:
        raise api.APIError(f"The model `{model}` does not exist; this server serves "
                           f"`{served.name}`", status=404, param="model",
                           code="model_not_found")
    if served.kind != kind:
        other = "/v1/embeddings" if served.kind == "encoder" else "/v1/completions"
        raise api.APIError(f"model `{model}` is a {served.kind}, which {route} does not "
                           f"serve; use {other}", param="model")
    return served


def _check_prompt_bytes(served: Served, texts: Sequence[str], param: str) -> None:
    """400 for prompt text longer than the context can hold, before it is tokenized (an
    encoder, whose ``max_seq`` is not known here, is bounded by the body limit alone)."""
    if served.max_seq <= 0:
        return
    limit = served.max_seq * api.PROMPT_BYTES_PER_TOKEN
    chars = sum(len(t) for t in texts)
    if chars * 4 <= limit:  # at most 4 UTF-8 bytes a character
        return
    size = sum(len(t) if t.isascii() else len(t.encode("utf-8")) for t in texts)
    if size > limit:
        raise api.APIError(f"{param}: the prompt's text is {size} bytes; this server tokenizes "
                           f"at most {limit} ({api.PROMPT_BYTES_PER_TOKEN} bytes for each of the "
                           f"{served.max_seq} positions of this model's context, max_seq)",
                           param=param, code="context_length_exceeded")


def _prompt_ids(served: Served, prompt: str | Sequence[int], param: str) -> list[int]:
    """The token ids of a prompt; ids a client sent are checked against the vocabulary by the
    engine (a completion) or by the embeddings route."""
    tok = served.tokenizer
    if isinstance(prompt, str):
        if tok is None:
            raise api.APIError(f"{param}: model `{served.name}` has no tokenizer here; send "
                               f"token ids", param=param)
        return list(tok.encode(prompt))
    return list(prompt)


def _params(req: schema.CompletionRequest | schema.ChatRequest, served: Served, prompt_len: int,
            default_max_tokens: int | None) -> SamplingParams:
    room = served.max_seq - prompt_len
    if room < 1:
        raise api.APIError(f"the prompt has {prompt_len} tokens; this model's context holds "
                           f"{served.max_seq} (max_seq), and generating needs one more",
                           param="messages" if isinstance(req, schema.ChatRequest) else "prompt",
                           code="context_length_exceeded")
    if req.max_tokens is not None and req.max_tokens > room:
        raise api.APIError(f"max_tokens: {req.max_tokens} new tokens after a prompt of "
                           f"{prompt_len} exceed this model's context of {served.max_seq} "
                           f"(max_seq); ask for at most {room}", param="max_tokens",
                           code="context_length_exceeded")
    try:
        return req.params(max_seq=served.max_seq, prompt_len=prompt_len,
                          default_max_tokens=default_max_tokens)
    except ParamError as exc:
        raise api.param_error(exc) from None


def _completion_inputs(state: ServerState, body: object
                       ) -> tuple[schema.CompletionRequest, Served, list[int], SamplingParams]:
    """A completions request read, checked and tokenized: blocking, run in a thread."""
    req = schema.parse_completion(body)
    served = _check_model(state, req.model, "causal-lm", "/v1/completions")
    if isinstance(req.prompt, str):
        _check_prompt_bytes(served, [req.prompt], "prompt")
    ids = _prompt_ids(served, req.prompt, "prompt")
    params = _params(req, served, len(ids), default_max_tokens=16)  # OpenAI's default
    return req, served, ids, params


def _chat_inputs(state: ServerState, body: object
                 ) -> tuple[schema.ChatRequest, Served, list[int], SamplingParams]:
    """A chat request read, checked, rendered and tokenized: blocking, run in a thread."""
    req = schema.parse_chat(body)
    served = _check_model(state, req.model, "causal-lm", "/v1/chat/completions")
    if served.chat is None:
        raise api.APIError(f"model `{served.name}` has no tokenizer with a chat template "
                           f"here; use /v1/completions with token ids", param="messages")
    turns = req.turns()
    _check_prompt_bytes(served, [m["content"] for m in turns], "messages")
    try:
        ids = served.chat.encode(turns, add_generation_prompt=True)
    except SpecError as exc:
        raise api.APIError(f"messages: {exc}", param="messages") from None
    params = _params(req, served, len(ids), default_max_tokens=None)
    return req, served, ids, params


def _embedding_inputs(state: ServerState, body: object
                      ) -> tuple[schema.EmbeddingRequest, Served, list[list[int]]]:
    """An embeddings request read, checked and tokenized: blocking, run in a thread."""
    req = schema.parse_embedding(body)
    served = _check_model(state, req.model, "encoder", "/v1/embeddings")
    rows = [_prompt_ids(served, item, f"input[{i}]") for i, item in enumerate(req.input)]
    vocab = getattr(served.tokenizer, "vocab_size", None)
    for i, row in enumerate(rows):
        try:
            check_token_ids(row, vocab, field=f"input[{i}]")
        except ParamError as exc:
            raise api.param_error(exc) from None
    return req, served, rows


def _dismantle(value: object) -> None:
    """Free a parsed body an item at a time. Freed whole, a 10 MB array of token ids frees
    1.7 million ints in one call that holds the GIL for 50-100 ms; item by item, the thread
    lets the event loop run between them."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            while item:
                child = item.pop()
                if isinstance(child, (list, dict)):
                    stack.append(child)
        elif isinstance(item, dict):
            while item:
                child = item.popitem()[1]
                if isinstance(child, (list, dict)):
                    stack.append(child)


DISMANTLE_BYTES = 1 << 20  # a body at least this large is freed an item at a time


async def _off_loop(read: Callable[[ServerState, object], _T], state: ServerState,
                    raw: bytes) -> _T:
    """``read(state, body)`` on the body parsed from ``raw``, in a thread. What the request
    parsed is freed there too, not on the event loop: a refusal comes back without its
    traceback (whose frames hold the request), and a large body is taken apart
    (:func:`_dismantle`) once nothing else holds its items."""
    def run() -> tuple[_T | None, api.APIError | None]:
        body: object = None
        try:
            body = api.parse_json(raw)
            return read(state, body), None
        except api.APIError as exc:
            exc.__traceback__ = exc.__context__ = exc.__cause__ = None
            return None, exc
        finally:
            if len(raw) >= DISMANTLE_BYTES:
                _dismantle(body)

    value, error = await asyncio.to_thread(run)
    if error is not None:
        raise error
    return value  # type: ignore[return-value]


async def _wait_disconnect(request: Request) -> None:
    """Return when the client goes away (the ASGI ``http.disconnect`` message)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(stream: RequestStream, request: Request) -> tuple[str, Delta] | None:
    """All the text of a request, and its last delta; None if the client left first."""
    async def read() -> tuple[str, Delta]:
        parts, last = [], None
        async for delta in stream:
            parts.append(delta.text)
            last = delta
        assert last is not None  # a stream ends with a delta that has a finish reason
        return "".join(parts), last

    reader = asyncio.ensure_future(read())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({reader, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if reader not in done:
        stream.abort()
        reader.cancel()
        log.info("request %s: the client disconnected; aborted", stream.request_id)
        return None
    return reader.result()


def _sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def _sse_stream(stream: RequestStream, chunks: Callable[[Delta, bool], list[object]],
                      final: Callable[[Delta], object | None]) -> AsyncIterator[bytes]:
    """The SSE body of a streamed request; aborts it if the client goes away (Starlette
    cancels this generator then)."""
    with stream:  # leaving unfinished (a disconnect) aborts the request
        first = True
        try:
            async for delta in stream:
                for chunk in chunks(delta, first):
                    yield _sse(chunk)
                first = False
                if delta.finish_reason is not None:
                    tail = final(delta)
                    if tail is not None:
                        yield _sse(tail)
        except JaxdistError as exc:  # the pipeline failed mid-stream: say so, then end
            err = _engine_error(exc)
            yield _sse(err.body())
        yield b"data: [DONE]\n\n"


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application over ``state`` (see the module docstring)."""
    app = FastAPI(title="jaxdist", docs_url=None, redoc_url=None, openapi_url=None)

    def guard(request: Request) -> None:
        """401 unless the request carries a key (when the server has keys)."""
        if state.api_keys and not _authorized(state, request):
            raise api.APIError("Incorrect or missing API key: send Authorization: Bearer KEY",
                               status=401, code="invalid_api_key")

    @app.exception_handler(api.APIError)
    async def api_error(request: Request, exc: api.APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """An unknown route (404) or a route's wrong method (405), in OpenAI's body."""
        where = f"{request.method} {request.url.path}"[:200]
        if exc.status_code == 404:
            message = f"Invalid URL ({where}): no such route"
        elif exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            message = f"Method not allowed ({where}); this route takes {allow or 'another'}"
        else:
            message = f"{where}: {exc.detail}"
        return _error_response(api.APIError(message, status=exc.status_code,
                                            headers=exc.headers))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        """The client went (or the server cut it off) while its body was read: nobody reads
        an answer, and it is no server error."""
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        """A bug: OpenAI's 500 body rather than a bare text. Starlette raises the exception
        again once this is sent, so the server logs its traceback; the client sees only its
        type."""
        return _error_response(api.APIError(
            f"the server failed on this request: {type(exc).__name__}", status=500,
            type="server_error", code="internal_error"))

    @app.get("/health")
    async def health() -> Response:
        try:
            served = state.served()
        except api.APIError as exc:
            return JSONResponse({"status": exc.code, "message": exc.message}, status_code=503,
                                headers=exc.headers)
        broken = served.broken()
        if broken is not None:
            return JSONResponse({"status": "broken", "message": str(broken)}, status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        stopped = served.stopped()
        if stopped is not None:  # for good: a retry here does not help, another replica does
            return JSONResponse({"status": "engine_stopped", "message": stopped},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        guard(request)
        return JSONResponse(api.models_response([state.name]))

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        guard(request)
        req, served, ids, params = await _off_loop(_completion_inputs, state,
                                                   await request.body())
        return await _generate(request, served, req, ids, params, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        guard(request)
        req, served, ids, params = await _off_loop(_chat_inputs, state, await request.body())
        return await _generate(request, served, req, ids, params, chat=True)

    async def _generate(request: Request, served: Served,
                        req: schema.CompletionRequest | schema.ChatRequest, ids: list[int],
                        params: SamplingParams, *, chat: bool) -> Response:
        rid = api.new_id("chatcmpl" if chat else "cmpl")
        created = int(time.time())
        try:
            stream = served.engine.submit(ids, params, request_id=rid)
        except JaxdistError as exc:
            raise _engine_error(exc) from None
        if req.stream:
            obj = "chat.completion.chunk" if chat else "text_completion"

            def chunks(delta: Delta, first: bool) -> list[object]:
                out: list[object] = []
                if chat and first:
                    out.append(api.chat_chunk(rid, served.name, {"role": "assistant",
                                                                 "content": ""}, None, created,
                                              with_usage=req.include_usage))
                if delta.text:
                    out.append(api.chat_chunk(rid, served.name, {"content": delta.text}, None,
                                              created, with_usage=req.include_usage) if chat
                               else api.completion_chunk(rid, served.name, delta.text, None,
                                                         created, with_usage=req.include_usage))
                if delta.finish_reason is not None:
                    out.append(api.chat_chunk(rid, served.name, {}, delta.finish_reason,
                                              created, with_usage=req.include_usage) if chat
                               else api.completion_chunk(rid, served.name, "",
                                                         delta.finish_reason, created,
                                                         with_usage=req.include_usage))
                return out

            def final(delta: Delta) -> object | None:
                if not req.include_usage:
                    return None
                return api.usage_chunk(rid, served.name, obj, created, delta.prompt_tokens,
                                       delta.completion_tokens)

            return StreamingResponse(_sse_stream(stream, chunks, final),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            got = await _collect(stream, request)
        except JaxdistError as exc:
            raise _engine_error(exc) from None
        if got is None:
            return Response(status_code=499)  # nobody reads it
        text, last = got
        assert last.finish_reason is not None
        build = api.chat_response if chat else api.completion_response
        return JSONResponse(build(rid, served.name, text, last.finish_reason,
                                  last.prompt_tokens, last.completion_tokens, created))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        guard(request)
        req, served, rows = await _off_loop(_embedding_inputs, state, await request.body())
        assert served.embed is not None
        try:
            vectors = await asyncio.to_thread(served.embed, rows)
        except JaxdistError as exc:
            raise _engine_error(exc) from None
        return JSONResponse(api.embedding_response(
            served.name, vectors, sum(len(r) for r in rows),
            as_base64=req.encoding_format == "base64"))

    return app
