"""The OpenAI HTTP API's requests: pydantic models in the shape of OpenAI's schema, and the
one handler that turns a body that does not fit into OpenAI's 400.

A request (:class:`CompletionRequest`, :class:`ChatRequest`, :class:`EmbeddingRequest`) is read
strictly: a JSON type is never coerced (``"5"`` is no integer). A bad body gets OpenAI's 400
with ``param`` naming the field by its path (``messages[1].content``; :func:`validation_error`),
not FastAPI's 422. Fields jaxdist cannot serve yet (``n`` > 1, ``logprobs``, penalties, tools,
...) are refused by name unless they ask for nothing (``n=1``, ``logprobs=false``); any other
field outside OpenAI's schema and jaxdist's two extensions (``top_k``, ``ignore_eos``) is
refused by name too, as OpenAI's own server does. A few of OpenAI's fields that change nothing
here (``user``, ``store``, ``metadata``, ...) are accepted.

The ranges of the sampling fields are the engine's (:class:`~jaxdist.coordinator.request.
SamplingParams`, through :func:`~jaxdist.serving.protocol.param_error`); only OpenAI's own
rules (``temperature`` <= 2, ``n`` = 1) are written here. The body comes from
:func:`~jaxdist.serving.protocol.parse_json`, which bounds an object's keys: pydantic makes an
error of each unknown field. Long lists are validated a slice at a time, and a list's first bad
item is its only error, so a 10 MB body neither holds the GIL for long nor makes an error per
item.

Example:
    >>> req = parse_completion({"model": "m", "prompt": "Hi", "max_tokens": 8, "stop": "."})
    >>> req.max_tokens, req.params(max_seq=512, prompt_len=2).stop_strings
    (8, ('.',))
    >>> parse_completion({"model": "m", "prompt": "Hi", "n": 2})
    Traceback (most recent call last):
    ...
    jaxdist.serving.protocol.APIError: n: only n=1 is supported, found 2
    >>> parse_completion({"model": "m", "prompt": "Hi", "best_of": 1, "repetition_penalty": 1})
    Traceback (most recent call last):
    ...
    jaxdist.serving.protocol.APIError: repetition_penalty: unrecognized or unsupported request
    argument
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
    with_config,
)
from pydantic_core import PydanticCustomError
from typing_extensions import NotRequired, TypedDict

from jaxdist.coordinator.request import ParamError, SamplingParams
from jaxdist.serving.protocol import APIError, param_error

__all__ = ["ChatRequest", "CompletionRequest", "EmbeddingRequest", "Message", "StreamOptions",
           "TextPart", "parse_chat", "parse_completion", "parse_embedding", "validation_error"]


# -- JSON's types, strictly ----------------------------------------------------------------------
# Strict: "5" is no integer and 1 no boolean. An integer field takes 3.0 (JSON does not tell
# them apart) and 1e20, which the range check then names; a number field takes an integer.

def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, Strict(), BeforeValidator(_integral)]
Float = Annotated[float, Strict()]
FAIL_FAST = Field(fail_fast=True)  # a list's first bad item is its error, not one per item
SLICE = 1024
"""A longer list is validated a slice at a time: between slices the thread can let the event
loop run (validating 300,000 messages at once holds the GIL for a second)."""

_REFUSED = "jaxdist_refused"  # the error type of this module's own refusals: a whole message


def _refuse(message: str) -> PydanticCustomError:
    return PydanticCustomError(_REFUSED, "{message}", {"message": message})


def _short(value: object, depth: int = 2) -> str:
    """``repr(value)``, short whatever its size: 4 items of a container, 60 characters of a
    value (``reprlib`` would sort a whole dict first)."""
    if isinstance(value, (dict, list)):
        if depth == 0:
            return "{...}" if isinstance(value, dict) else "[...]"
        items = (f"{_short(k, 0)}: {_short(v, depth - 1)}" for k, v in value.items()
                 ) if isinstance(value, dict) else (_short(v, depth - 1) for v in value)
        inner = ", ".join(itertools.islice(items, 4)) + (", ..." if len(value) > 4 else "")
        return f"{{{inner}}}" if isinstance(value, dict) else f"[{inner}]"
    text = repr(value[:61] if isinstance(value, str) else value)
    return text if len(text) <= 60 else text[:57] + "..."


def _found(value: object) -> str:
    """``value`` for a message: its type and :func:`_short`."""
    return "null" if value is None else f"{type(value).__name__} {_short(value)}"


def _sliced(item: Any) -> WrapValidator:
    """Validate a list of ``item`` in slices of :data:`SLICE`, its errors at their own index."""
    one = TypeAdapter(Annotated[list[item], FAIL_FAST])

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if not isinstance(value, list) or len(value) <= SLICE:
            return handler(value)
        out: list[Any] = []
        for start in range(0, len(value), SLICE):
            try:
                out += one.validate_python(value[start:start + SLICE])
            except ValidationError as exc:
                raise _moved(exc, start) from None
        return out

    return WrapValidator(validate)


def _moved(exc: ValidationError, start: int) -> ValidationError:
    """A slice's errors, at their index in the whole list."""
    errors: list[Any] = []
    for e in exc.errors(include_url=False):
        index, *rest = e["loc"]
        own = e["type"] == _REFUSED
        errors.append({"type": _refuse(e["msg"]) if own else e["type"],
                       "loc": (int(index) + start, *rest), "input": e["input"],
                       **({} if own or "ctx" not in e else {"ctx": e["ctx"]})})
    return ValidationError.from_exception_data(exc.title, errors)


def _by_type(expected: str, choices: Mapping[type, TypeAdapter[Any] | None]) -> WrapValidator:
    """A union picked by the value's JSON type (``None``: taken as it is): a value of another
    type is refused as not ``expected``, and a member's errors keep their own path."""
    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        kind = type(value)
        if kind not in choices:
            raise _refuse(f"expected {expected}, found {_found(value)}")
        adapter = choices[kind]
        return value if adapter is None else adapter.validate_python(value)

    return WrapValidator(validate)


def _only(allowed: tuple[Any, ...], what: str) -> AfterValidator:
    """A field jaxdist does not implement: refused by name unless absent, null or ``allowed``."""
    def check(value: Any) -> Any:
        if value is not None and value not in allowed:
            raise _refuse(f"{what}, found {_short(value)}")
        return value

    return AfterValidator(check)


def _within(lo: float, hi: float) -> AfterValidator:
    def check(value: float | None) -> float | None:
        if value is not None and not lo <= value <= hi:
            raise _refuse(f"expected a number in [{lo}, {hi}], found {value}")
        return value

    return AfterValidator(check)


_IDS = Annotated[list[StrictInt], Field(min_length=1), FAIL_FAST, _sliced(StrictInt)]
_STRS = Annotated[list[StrictStr], FAIL_FAST, _sliced(StrictStr)]
_TEXT = TypeAdapter(Annotated[str, Strict(), Field(min_length=1)])
_TEXT_OR_IDS = {str: _TEXT, list: TypeAdapter(_IDS)}
_NONE = type(None)
# An object or a list a field only refuses or ignores: not copied, nor its items read.
_OBJECT = _by_type("an object", {dict: None, _NONE: None})
_LIST = _by_type("a list", {list: None, _NONE: None})


# -- the validation handler ----------------------------------------------------------------------

_EXPECTED = {"string_type": "a string", "bool_type": "a boolean", "int_type": "an integer",
             "int_from_float": "an integer", "float_type": "a number", "list_type": "a list",
             "dict_type": "an object", "model_type": "an object",
             "model_attributes_type": "an object"}


def _path(loc: tuple[int | str, ...]) -> str:
    """pydantic's location as OpenAI's ``param``: ``messages[1].content``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part[:60]}" if out else part[:60]
    return out


def validation_error(exc: ValidationError) -> APIError:
    """The 400 for a body that does not fit its request: its first error, in OpenAI's body,
    ``param`` the field's dotted path (``messages[1].content``); every route reads its body
    through this.

    Example:
        >>> parse_chat({"model": "m", "messages": [{"role": "user", "content": 5}]}).model
        Traceback (most recent call last):
        ...
        jaxdist.serving.protocol.APIError: messages[0].content: expected a string or text
        parts, found int 5
    """
    first = exc.errors(include_url=False)[0]
    kind, ctx, path = first["type"], first.get("ctx") or {}, _path(first["loc"])
    if kind == _REFUSED:
        detail = first["msg"]
    elif kind == "missing":
        detail = "is required"
    elif kind == "extra_forbidden":
        detail = "unrecognized or unsupported request argument"
    elif kind in ("too_short", "string_too_short") and ctx.get("min_length") == 1:
        detail = "must not be empty"
    else:
        expected = _EXPECTED.get(kind) or (str(ctx["expected"]) if kind == "literal_error"
                                           else None)
        said = (f"expected {expected}" if expected is not None
                else first["msg"][:1].lower() + first["msg"][1:])  # pydantic's own words
        detail = f"{said}, found {_found(first['input'])}"
    return APIError(f"{path or 'the request body'}: {detail}", param=path or None)


# -- the requests --------------------------------------------------------------------------------

_FORBID = ConfigDict(extra="forbid")  # OpenAI's fields (and jaxdist's few): others refused


class _Body(BaseModel):
    model_config = _FORBID


class StreamOptions(_Body):
    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None  # accepted; nothing is obfuscated


_PENALTY = _only((0,), "penalties are not supported yet; send 0 or leave it out")


class _Sampling(_Body):
    """The fields both generation routes share. ``max_tokens`` is what was asked for:
    ``max_completion_tokens`` when given, as OpenAI reads them."""

    model: StrictStr
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    temperature: Annotated[Float | None, _within(0.0, 2.0)] = None  # OpenAI's range
    top_p: Float | None = None
    top_k: Int | None = None  # vLLM's and llama-server's extension; -1 is off, as 0
    seed: Int | None = None
    stop: Annotated[str | list[str] | None, _by_type("a string or a list of strings", {
        str: None, list: TypeAdapter(_STRS), _NONE: None})] = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool | None = None  # vLLM's and llama-server's extension, for benchmarks
    n: Annotated[Int | None, _only((1,), "only n=1 is supported")] = None
    presence_penalty: Annotated[Float | None, _PENALTY] = None
    frequency_penalty: Annotated[Float | None, _PENALTY] = None
    logit_bias: Annotated[dict[str, int] | None, _OBJECT,
                          _only(({},), "logit_bias is not supported yet")] = None
    user: StrictStr | None = None  # accepted; a label for OpenAI's abuse monitoring

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, value: StreamOptions | None, info: ValidationInfo
                       ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise _refuse("is only allowed when stream is true")
        return value

    @model_validator(mode="after")
    def _in_the_engines_ranges(self) -> Self:
        """The ranges are the engine's: checked by making its parameters, once, here."""
        renames = {}
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
            renames["max_tokens"] = "max_completion_tokens"
        try:
            self.params(max_seq=2, prompt_len=1)
        except ParamError as exc:
            raise param_error(exc, renames=renames) from None
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)

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
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=wanted,
                              temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=0 if self.top_k in (None, -1) else self.top_k,
                              seed=self.seed or 0, stop_strings=stop,
                              ignore_eos=bool(self.ignore_eos))


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text or token ids (a batch of one is taken as
    its prompt)."""

    prompt: Annotated[str | list[int], _by_type("a string or a list of token ids", _TEXT_OR_IDS)]
    best_of: Annotated[Int | None, _only((1,), "only best_of=1 is supported")] = None
    echo: Annotated[StrictBool | None, _only((False,), "echo is not supported yet")] = None
    suffix: Annotated[StrictStr | None, _only(("",), "suffix is not supported")] = None
    logprobs: Annotated[Int | None, _only((0,), "logprobs are not supported yet")] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) > 1:
                raise _refuse("a batch of several prompts is not supported; send one request "
                              "per prompt (they are batched on the workers)")
            return value[0]
        return value


def _text_part(value: Any) -> Any:
    if not isinstance(value, dict) or value.get("type") != "text":
        raise _refuse(f"only text parts are supported, found {_found(value)}")
    return value


# A chat's messages and their parts are TypedDicts, as in OpenAI's own client: validated
# into dicts, several times faster than into models, which counts for a body of 300,000.

@with_config(_FORBID)
class TextPart(TypedDict):
    type: Literal["text"]
    text: StrictStr


_PART = Annotated[TextPart, BeforeValidator(_text_part)]
_PARTS = TypeAdapter(Annotated[list[_PART], FAIL_FAST, _sliced(_PART)])


@with_config(_FORBID)
class Message(TypedDict):
    """A chat message: its content is text or text parts (joined); ``developer`` is
    ``system``; only an assistant's content may be null (:class:`ChatRequest` checks)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: NotRequired[Annotated[str | list[TextPart] | None, _by_type(
        "a string or text parts", {str: None, list: _PARTS, _NONE: None})]]
    name: NotRequired[StrictStr | None]  # accepted; the template does not show it


def _turn(message: Message) -> dict[str, str]:
    """A message as the chat template reads it."""
    content = message.get("content")
    text = (content if isinstance(content, str)
            else "".join(p["text"] for p in content or ()))
    role = message["role"]
    return {"role": "system" if role == "developer" else role, "content": text}


_TOOLS = "tool calls are not supported yet"


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1), FAIL_FAST, _sliced(Message)]
    logprobs: Annotated[StrictBool | None, _only((False,), "logprobs are not supported yet")
                        ] = None
    top_logprobs: Annotated[Int | None, _only((0,), "logprobs are not supported yet")] = None
    tools: Annotated[list[Any] | None, _LIST, _only(([],), _TOOLS)] = None
    functions: Annotated[list[Any] | None, _LIST, _only(([],), _TOOLS)] = None
    tool_choice: Annotated[str | dict[str, Any] | None, _by_type(
        "a string or an object", {str: None, dict: None, _NONE: None}),
        _only(("none",), _TOOLS)] = None
    parallel_tool_calls: StrictBool | None = None  # accepted; no tools are called
    response_format: Annotated[dict[str, Any] | None, _OBJECT, _only(
        ({"type": "text"},), "only {'type': 'text'} is supported")] = None
    store: StrictBool | None = None  # accepted; nothing is stored
    metadata: Annotated[dict[str, str] | None, _OBJECT] = None  # accepted, with store
    service_tier: StrictStr | None = None  # accepted; there is one tier

    @model_validator(mode="after")
    def _said(self) -> Self:
        """Only an assistant's content may be null. Checked here rather than in each message:
        a validator per message costs more than the message's own validation."""
        for i, m in enumerate(self.messages):
            if m.get("content") is None and m["role"] != "assistant":
                raise ValidationError.from_exception_data(type(self).__name__, [{
                    "type": _refuse("expected a string or text parts, found null"),
                    "loc": ("messages", i, "content"), "input": None}])
        return self

    def turns(self) -> list[dict[str, str]]:
        """The messages as the chat template reads them."""
        return [_turn(m) for m in self.messages]


def _inputs(value: Any) -> Any:
    """One text or one token list is a batch of one."""
    if isinstance(value, str) or (isinstance(value, list) and value
                                  and not isinstance(value[0], (str, list))):
        return [value]
    if not isinstance(value, list):
        raise _refuse(f"expected a string, a list of strings or token id lists, found "
                      f"{_found(value)}")
    return value


_INPUT = Annotated[str | list[int], _by_type("a non-empty string or token id list",
                                             _TEXT_OR_IDS)]


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``: ``input`` is read as a batch of texts or token id lists."""

    model: StrictStr
    input: Annotated[list[_INPUT], Field(min_length=1), FAIL_FAST, _sliced(_INPUT),
                     BeforeValidator(_inputs)]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[Int | None, _only(
        (), "is not supported (the model's own width is used)")] = None
    user: StrictStr | None = None  # accepted; a label for OpenAI's abuse monitoring


_Request = TypeVar("_Request", bound=_Body)


def _parse(kind: type[_Request], body: object) -> _Request:
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def parse_completion(body: object) -> CompletionRequest:
    """Read a completions request. Raises APIError (400) naming the bad field."""
    return _parse(CompletionRequest, body)


def parse_chat(body: object) -> ChatRequest:
    """Read a chat completions request. Raises APIError (400) naming the bad field."""
    return _parse(ChatRequest, body)


def parse_embedding(body: object) -> EmbeddingRequest:
    """Read an embeddings request. Raises APIError (400) naming the bad field."""
    return _parse(EmbeddingRequest, body)
