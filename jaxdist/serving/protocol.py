"""The OpenAI HTTP API's bodies but for its requests' schema (:mod:`jaxdist.serving.schema`):
its errors, the strict JSON a request is read from, and the responses.

An error is OpenAI's: an HTTP status and ``{"error": {"message", "type", "param", "code"}}``
(:class:`APIError`). The body is strict JSON (:func:`parse_json`): nesting, integer digits,
keys per object and non-finite numbers are bounded, and every string must be valid Unicode, so
no body makes the server fail later, when it prints or encodes a value, or makes an error per
key. The sampling fields' ranges are the engine's own
(:class:`~jaxdist.coordinator.request.SamplingParams`): one check for the HTTP and the Python
API, reported with the HTTP field's name (:func:`param_error`).

Example:
    >>> parse_json(b'{"model": "m", "n": NaN}')
    Traceback (most recent call last):
    ...
    jaxdist.serving.protocol.APIError: the request body has NaN, which is not JSON; expected a
    finite number
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxdist.coordinator.request import ParamError

__all__ = ["MAX_OBJECT_KEYS", "PROMPT_BYTES_PER_TOKEN", "APIError", "chat_chunk", "chat_response",
           "completion_chunk", "completion_response", "embedding_response", "error_body",
           "finish_reason", "models_response", "param_error", "parse_json", "usage"]

MAX_JSON_DEPTH = 64  # arrays and objects inside each other; a request needs 4
MAX_INT_DIGITS = 64  # digits of a JSON integer (Python refuses to read more than 4300)
MAX_OBJECT_KEYS = 1024  # keys of a JSON object (a request's has 30 at most): so a body
# with a million unknown fields is one error, not a million (pydantic makes one of each)
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
                       param=_field(path))


def _field(path: str) -> str | None:
    """The request's field a path is in (``messages`` for ``messages[0].content``)."""
    return path.split("[")[0].split(".")[0] or None


def _check_json(value: object) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH`, objects of more than
    :data:`MAX_OBJECT_KEYS` keys, and strings (keys included) that are not valid Unicode: a
    lone surrogate (``"\\ud800"``) decodes but cannot be encoded again. A path is made only
    for a container, so a list of a million ids costs no strings."""
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
        if isinstance(item, dict) and len(item) > MAX_OBJECT_KEYS:
            raise APIError(f"{_where(path)}: expected an object of at most {MAX_OBJECT_KEYS} "
                           f"keys, found {len(item)}", param=_field(path))
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
    number is finite (no ``NaN``, ``Infinity`` or ``1e999``); an object has at most
    :data:`MAX_OBJECT_KEYS` keys; and every string, keys included, is valid Unicode (no lone
    surrogate).

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
