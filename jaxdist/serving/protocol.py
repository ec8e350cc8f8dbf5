"""The OpenAI HTTP API's request and response bodies, read and written by hand.

Requests are read field by field so that a bad one gets OpenAI's 400 with ``param`` naming the
field (a validation library would answer 422 in a shape of its own). Fields jaxdist cannot
serve yet (``n`` > 1, ``logprobs``, penalties, tools, ...) are refused by name rather than
ignored; fields it does not know are ignored, as OpenAI's own server does.

The body itself is strict JSON (:func:`parse_json`): nesting, integer digits and non-finite
numbers are bounded, and every string must be valid Unicode, so no body makes the server fail
later, when it prints or encodes a value. The sampling fields' ranges are the engine's own
(:class:`~jaxdist.coordinator.request.SamplingParams`): one check for the HTTP and the Python
API, reported here with the HTTP field's name (:func:`param_error`).

Example:
    >>> req = parse_completion({"model": "m", "prompt": "Hi", "max_tokens": 8, "stop": "."})
    >>> req.max_tokens, req.params(max_seq=512, prompt_len=2).stop_strings
    (8, ('.',))
    >>> parse_completion({"model": "m", "prompt": "Hi", "n": 2})
    Traceback (most recent call last):
    ...
    jaxdist.serving.protocol.APIError: n: only n=1 is supported, found 2
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxdist.coordinator.request import ParamError, SamplingParams

__all__ = ["PROMPT_BYTES_PER_TOKEN", "APIError", "ChatRequest", "CompletionRequest",
           "EmbeddingRequest", "chat_chunk", "chat_response", "completion_chunk",
           "completion_response", "embedding_response", "error_body", "finish_reason",
           "models_response", "param_error", "parse_chat", "parse_completion", "parse_embedding",
           "parse_json", "usage"]

MAX_JSON_DEPTH = 64  # arrays and objects inside each other; a request needs 4
MAX_INT_DIGITS = 64  # digits of a JSON integer (Python refuses to read more than 4300)
PROMPT_BYTES_PER_TOKEN = 32
"""Prompt text a server tokenizes per position of its model's context (``max_seq``), in UTF-8
bytes: text longer than ``max_seq`` times this is refused (400) before it is tokenized. English
averages about 4 bytes a token; only long runs of whitespace come near 32."""


class APIError(Exception):
    """An error as the OpenAI API reports it: an HTTP status and ``{"error": {...}}``."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(param: str, message: str) -> APIError:
    return APIError(f"{param}: {message}", param=param)


_HTTP_NAMES = {"stop_strings": "stop"}  # the engine's field -> the API's


def param_error(exc: ParamError, *, renames: Mapping[str, str] | None = None) -> APIError:
    """The 400 for an engine's :class:`ParamError`: the message names the request's field
    (``stop`` for the engine's ``stop_strings``, ``renames`` for more), and ``param`` is that
    field without an index (``prompt`` for ``prompt[3]``)."""
    base, bracket, rest = exc.field.partition("[")
    name = {**_HTTP_NAMES, **(renames or {})}.get(base, base)
    return APIError(f"{name}{bracket}{rest}: {exc.detail}", param=name)


# -- the body ------------------------------------------------------------------------------------

_SURROGATE = re.compile(r"[\ud800-\udfff]")
_SCAN_CHARS = 1 << 18  # a search holds the GIL: a long string is searched a slice at a time


def _surrogate(text: str) -> re.Match[str] | None:
    """The first lone surrogate in ``text``, or None. An ASCII string is answered at once; a
    long one is searched in slices, so a thread checking a 10 MB prompt lets the event loop run
    between them."""
    if text.isascii():
        return None
    for start in range(0, len(text), _SCAN_CHARS):
        found = _SURROGATE.search(text, start, start + _SCAN_CHARS)
        if found is not None:
            return found
    return None


def _json_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise APIError(f"the request body has an integer of {digits} digits; expected at most "
                       f"{MAX_INT_DIGITS}")
    return int(text)


def _json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise APIError(f"the request body has the number {text[:40]!r}, out of the range of a "
                       f"double; expected a finite number")
    return value


def _json_constant(name: str) -> float:
    raise APIError(f"the request body has {name}, which is not JSON; expected a finite number")


def _where(path: str) -> str:
    return path or "the request body"


def _check_string(text: str, path: str) -> None:
    bad = _surrogate(text)
    if bad is not None:
        raise APIError(f"{_where(path)}: expected a valid Unicode string, found a lone "
                       f"surrogate \\u{ord(bad.group()):04x} at character {bad.start()}",
                       param=path.split("[")[0].split(".")[0] or None)


def _check_json(value: object) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH` and strings (keys included) that are
    not valid Unicode: a lone surrogate (``"\\ud800"``) decodes but cannot be encoded again.
    A path is made only for a container, so a list of a million ids costs no strings."""
    if isinstance(value, str):
        _check_string(value, "")
    stack: list[tuple[object, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise APIError(f"the request body: expected arrays and objects nested at most "
                           f"{MAX_JSON_DEPTH} deep, found more at {path[:60]}")
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        for key, v in pairs:
            if isinstance(key, str) and _surrogate(key) is not None:
                raise APIError(f"{_where(path)}: expected keys that are valid Unicode, found "
                               f"one with a lone surrogate")
            if isinstance(v, str):
                if _surrogate(v) is not None:
                    _check_string(v, _child(path, key))
            elif isinstance(v, (dict, list)):
                stack.append((v, _child(path, key), depth + 1))


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def parse_json(raw: bytes) -> object:
    """Read a request body as strict JSON.

    Beyond :func:`json.loads`: the body must be UTF-8; arrays and objects nest at most
    :data:`MAX_JSON_DEPTH` deep; an integer has at most :data:`MAX_INT_DIGITS` digits; a
    number is finite (no ``NaN``, ``Infinity`` or ``1e999``); and every string, keys included,
    is valid Unicode (no lone surrogate).

    Raises:
        APIError: 400 saying which rule the body broke, and where.

    Example:
        >>> parse_json(b'{"model": "m", "seed": 1}')
        {'model': 'm', 'seed': 1}
        >>> parse_json(b"[" * 100_000 + b"]" * 100_000)
        Traceback (most recent call last):
        ...
        jaxdist.serving.protocol.APIError: the request body: expected arrays and objects nested
        at most 64 deep, found more
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"the request body is not UTF-8: {exc}") from None
    try:
        value = json.loads(text, parse_int=_json_int, parse_float=_json_float,
                           parse_constant=_json_constant)
    except RecursionError:  # json's own recursion: far deeper than we take
        raise APIError(f"the request body: expected arrays and objects nested at most "
                       f"{MAX_JSON_DEPTH} deep, found more") from None
    except json.JSONDecodeError as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from None
    _check_json(value)
    return value


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


# -- reading fields ------------------------------------------------------------------------------

class _Fields:
    """A JSON object's fields, read with OpenAI's types and their errors."""

    def __init__(self, body: object) -> None:
        if not isinstance(body, dict):
            raise APIError(f"the request body must be a JSON object, found {_type_name(body)}")
        self.body = body

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def str_(self, name: str, *, required: bool = False) -> str | None:
        value = self.body.get(name)
        if value is None:
            if required:
                raise _bad(name, "is required")
            return None
        if not isinstance(value, str):
            raise _bad(name, f"expected a string, found {_type_name(value)}")
        return value

    def bool_(self, name: str, default: bool = False) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise _bad(name, f"expected a boolean, found {_type_name(value)}")
        return value

    def int_(self, name: str, *, lo: int | None = None, hi: int | None = None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise _bad(name, f"expected an integer, found {_type_name(value)} {value!r}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = (f">= {lo}" if hi is None else f"<= {hi}" if lo is None
                      else f"in {lo}..{hi}")
            raise _bad(name, f"expected an integer {bounds}, found {value}")
        return value

    def float_(self, name: str, *, lo: float = -math.inf, hi: float = math.inf
               ) -> float | None:
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(name, f"expected a number, found {_type_name(value)} {value!r}")
        if not lo <= value <= hi:
            raise _bad(name, f"expected a number in [{lo}, {hi}], found {value}")
        try:
            return float(value)
        except OverflowError:  # an integer past a double: the range check tells
            return math.inf

    def refuse(self, name: str, allowed: Sequence[object], what: str) -> None:
        """400 naming ``name`` unless it is absent or one of ``allowed`` (not implemented)."""
        value = self.body.get(name)
        if value is not None and value not in allowed:
            raise _bad(name, f"{what}, found {value!r}")


@dataclasses.dataclass(frozen=True)
class _Sampling:
    """The sampling fields both generation routes share."""

    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False  # an extension of vLLM's and llama-server's, for benchmarks

    def params(self, *, max_seq: int, prompt_len: int, default_max_tokens: int | None = None
               ) -> SamplingParams:
        """The engine's parameters; ``max_tokens`` defaults to ``default_max_tokens`` or what
        the KV cache has left after the prompt.

        Raises:
            ParamError: a field out of the engine's range, naming it.
        """
        room = max(1, max_seq - prompt_len)
        wanted = (self.max_tokens if self.max_tokens is not None
                  else default_max_tokens or room)
        return SamplingParams(max_tokens=wanted, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                              stop_strings=self.stop, ignore_eos=self.ignore_eos)


def _sampling(f: _Fields) -> _Sampling:
    model = f.str_("model", required=True)
    assert model is not None
    f.refuse("n", (1,), "only n=1 is supported")
    f.refuse("best_of", (1,), "only best_of=1 is supported")
    for name in ("presence_penalty", "frequency_penalty"):
        f.refuse(name, (0, 0.0), "penalties are not supported yet; send 0 or leave it out")
    f.refuse("logit_bias", ({},), "logit_bias is not supported yet")
    max_completion = f.int_("max_completion_tokens")
    max_tokens = f.int_("max_tokens")
    stop = f.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _bad("stop", f"expected a string or a list of strings, found "
                           f"{_type_name(stop)}")
    options = f.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", f"expected an object, found {_type_name(options)}")
    stream = f.bool_("stream")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("stream_options", "is only allowed when stream is true")
        value = options.get("include_usage")
        if value is not None and not isinstance(value, bool):
            raise _bad("stream_options.include_usage",
                       f"expected a boolean, found {_type_name(value)}")
        include_usage = bool(value)
    temperature = f.float_("temperature", lo=0.0, hi=2.0)  # OpenAI's range
    top_p = f.float_("top_p")
    top_k = f.int_("top_k")
    seed = f.int_("seed")
    wanted = max_tokens if max_completion is None else max_completion
    out = _Sampling(model=model, max_tokens=wanted,
                    temperature=1.0 if temperature is None else temperature,
                    top_p=1.0 if top_p is None else top_p,
                    top_k=0 if top_k in (None, -1) else top_k,  # vLLM's -1 is off, as 0
                    seed=seed or 0, stop=stops, stream=stream,
                    include_usage=include_usage, ignore_eos=f.bool_("ignore_eos"))
    # The ranges are the engine's: checked by making its parameters, once, here.
    renames = {"max_tokens": "max_completion_tokens"} if max_completion is not None else {}
    try:
        out.params(max_seq=2, prompt_len=1)
    except ParamError as exc:
        raise param_error(exc, renames=renames) from None
    return out


# -- the routes' requests ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text or token ids."""

    prompt: str | tuple[int, ...] = ""


@dataclasses.dataclass(frozen=True)
class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: tuple[dict[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class EmbeddingRequest:
    """``POST /v1/embeddings``: each input is text or token ids."""

    model: str
    inputs: tuple[str | tuple[int, ...], ...]
    base64: bool


def _token_ids(value: list[Any], param: str) -> tuple[int, ...] | None:
    if value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(t < 0 for t in value):
            raise _bad(param, "token ids must be >= 0")
        return tuple(value)
    return None


def parse_completion(body: object) -> CompletionRequest:
    """Read a completions request. Raises APIError (400) naming the bad field."""
    f = _Fields(body)
    base = _sampling(f)
    f.refuse("echo", (False,), "echo is not supported yet")
    f.refuse("suffix", ("",), "suffix is not supported")
    f.refuse("logprobs", (0,), "logprobs are not supported yet")
    prompt = f.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "must not be empty")
        value: str | tuple[int, ...] = prompt
    elif isinstance(prompt, list):
        ids = _token_ids(prompt, "prompt")
        if ids is None:
            raise _bad("prompt", "a batch of several prompts is not supported; send one "
                                 "request per prompt (they are batched on the workers)")
        value = ids
    elif prompt is None:
        raise _bad("prompt", "is required")
    else:
        raise _bad("prompt", f"expected a string or a list of token ids, found "
                             f"{_type_name(prompt)}")
    return CompletionRequest(**dataclasses.asdict(base), prompt=value)


def parse_chat(body: object) -> ChatRequest:
    """Read a chat completions request. Raises APIError (400) naming the bad field."""
    f = _Fields(body)
    base = _sampling(f)
    f.refuse("logprobs", (False,), "logprobs are not supported yet")
    f.refuse("top_logprobs", (0,), "logprobs are not supported yet")
    for name in ("tools", "functions"):
        f.refuse(name, ([],), "tool calls are not supported yet")
    f.refuse("tool_choice", ("none",), "tool calls are not supported yet")
    fmt = f.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _bad("response_format", f"only {{'type': 'text'}} is supported, found {fmt!r}")
    messages = f.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", f"expected a non-empty list of messages, found "
                               f"{_type_name(messages)}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"expected an object, found {_type_name(m)}")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise _bad(f"{where}.role", f"expected system, developer, user or assistant, "
                                        f"found {role!r}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise _bad(f"{where}.content[{j}]", "only text parts are supported, found "
                                                        f"{part!r}"[:200])
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise _bad(f"{where}.content", f"expected a string or text parts, found "
                                           f"{_type_name(content)}")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return ChatRequest(**dataclasses.asdict(base), messages=tuple(out))


def parse_embedding(body: object) -> EmbeddingRequest:
    """Read an embeddings request. Raises APIError (400) naming the bad field."""
    f = _Fields(body)
    model = f.str_("model", required=True)
    assert model is not None
    fmt = f.str_("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise _bad("encoding_format", f"expected 'float' or 'base64', found {fmt!r}")
    f.refuse("dimensions", (), "dimensions is not supported (the model's own width is used)")
    raw = f.get("input")
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw:
        ids = _token_ids(raw, "input")
        items = [list(ids)] if ids is not None else raw
    else:
        raise _bad("input", f"expected a string, a list of strings or token id lists, found "
                            f"{_type_name(raw)}")
    inputs: list[str | tuple[int, ...]] = []
    for i, item in enumerate(items):
        if isinstance(item, str) and item:
            inputs.append(item)
        elif isinstance(item, list) and (ids := _token_ids(item, f"input[{i}]")) is not None:
            inputs.append(ids)
        else:
            raise _bad(f"input[{i}]", f"expected a non-empty string or token id list, found "
                                      f"{item!r}"[:200])
    return EmbeddingRequest(model=model, inputs=tuple(inputs), base64=fmt == "base64")


# -- responses -----------------------------------------------------------------------------------

def finish_reason(reason: str) -> str:
    """OpenAI's finish reason for the engine's: an end of text is ``stop``, a limit ``length``."""
    return "length" if reason in ("length", "max_seq") else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_response(rid: str, model: str, text: str, reason: str, prompt_tokens: int,
                        completion_tokens: int, created: int) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason(reason)}],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(rid: str, model: str, text: str, reason: str | None, created: int,
                     *, with_usage: bool) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None,
                     "finish_reason": None if reason is None else finish_reason(reason)}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def chat_response(rid: str, model: str, text: str, reason: str, prompt_tokens: int,
                  completion_tokens: int, created: int) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason(reason)}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk(rid: str, model: str, delta: dict[str, str], reason: str | None, created: int,
               *, with_usage: bool) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None,
                     "finish_reason": None if reason is None else finish_reason(reason)}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, model: str, obj: str, created: int, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def embedding_response(model: str, vectors: np.ndarray, prompt_tokens: int, *,
                       as_base64: bool) -> dict[str, Any]:
    data = []
    for i, vec in enumerate(np.asarray(vectors, np.float32)):
        value: Any = (base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
                      if as_base64 else vec.tolist())
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def models_response(names: Sequence[str], created: int | None = None) -> dict[str, Any]:
    when = int(time.time()) if created is None else created
    return {"object": "list", "data": [{"id": n, "object": "model", "created": when,
                                        "owned_by": "jaxdist"} for n in names]}
