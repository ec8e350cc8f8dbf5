"""One generation request as its caller sees it: how to sample, the deltas, the final result.

A :class:`RequestStream` is what :meth:`jaxdist.coordinator.engine.Engine.submit` returns. The
engine's step loop pushes :class:`Delta` objects into it from its own thread; the caller reads
them synchronously (``for d in stream``), from an asyncio loop (``async for d in stream``), or
waits for the end (:meth:`RequestStream.result`). Each delta is handed over exactly once, to
one consumer; :meth:`RequestStream.result` does not consume them.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import numbers
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from types import TracebackType
from typing import Self

from jaxdist.core.errors import SpecError

__all__ = ["Delta", "GenerationResult", "ParamError", "RequestStream", "SamplingParams",
           "check_token_ids"]

log = logging.getLogger(__name__)

FINISH_REASONS = ("eos", "stop", "length", "max_seq", "abort")
"""Why a sequence ended: an EOS id, a stop id or stop string, ``max_tokens``, the KV cache
length, or an abort (:meth:`RequestStream.abort`, :meth:`Engine.abort`, :meth:`Engine.close`)."""


INT32_MAX = (1 << 31) - 1
UINT32_MAX = (1 << 32) - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: the wire's temperature
MAX_STOP_STRINGS = 8  # stop strings per request: the text is searched for each at every token
MAX_STOP_CHARS = 128  # characters per stop string: that much text may be held back


class ParamError(SpecError):
    """A request parameter is out of its range. The message names the field, the range and the
    value found; :attr:`field` and :attr:`detail` carry them apart, for a front end that names
    the field in its own way (``jaxdist serve``'s 400 bodies).

    Attributes:
        field: the parameter (``"top_k"``, ``"prompt"``, ...).
        detail: what was expected and what was found, without the field.
    """

    def __init__(self, field: str, detail: str, *, context: str = "") -> None:
        super().__init__(f"{context}{field}: {detail}")
        self.field = field
        self.detail = detail


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _found(value: object) -> str:
    """``value`` for a message: short, and never a 5000-digit integer (Python refuses to
    print one)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 192:
        return f"an integer of {value.bit_length()} bits"
    text = str(value) if _is_real(value) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _id_range(vocab_size: int | None) -> tuple[int, str]:
    if vocab_size is None:
        return INT32_MAX, "the step's int32"
    return vocab_size - 1, f"the vocabulary of {vocab_size} tokens"


def check_token_ids(ids: Sequence[int], vocab_size: int | None, *, field: str = "prompt",
                    context: str = "") -> None:
    """Refuse a token id the model does not know: each must be an integer in
    ``0..vocab_size - 1`` (in the int32 range when the vocabulary is not known).

    Raises:
        ParamError: naming ``field[i]``, ``i`` the index of the first bad id.

    Example:
        >>> check_token_ids([5, 49152], 49152)
        Traceback (most recent call last):
        ...
        jaxdist.coordinator.request.ParamError: prompt[1]: expected a token id in 0..49151 (the
        vocabulary of 49152 tokens), found 49152
    """
    hi, what = _id_range(vocab_size)
    for i, t in enumerate(ids):
        if not _is_int(t) or not 0 <= t <= hi:
            raise ParamError(f"{field}[{i}]", f"expected a token id in 0..{hi} ({what}), "
                             f"found {_found(t)}", context=context)


def _check_stop_ids(ids: frozenset[int], vocab_size: int | None, context: str = "") -> None:
    hi, what = _id_range(vocab_size)
    bad = next((t for t in ids if not _is_int(t) or not 0 <= t <= hi), None)
    if bad is not None:
        raise ParamError("stop_ids", f"expected token ids in 0..{hi} ({what}), found "
                                     f"{_found(bad)}", context=context)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick and when to stop.

    Every field is checked when the parameters are made: a value outside its range raises
    :class:`ParamError` naming the field. The limits that depend on the model (``top_k`` and
    ``stop_ids`` within the vocabulary) are checked by :meth:`check_model`, which the engine
    calls when a request is submitted. ``jaxdist serve`` builds its requests' parameters here
    too, so the HTTP API and the Python API refuse the same values with the same words.

    Attributes:
        max_tokens: most new tokens (>= 1).
        temperature: 0 is greedy; finite, >= 0.
        top_k: keep the k most likely tokens (0: off); at most the vocabulary size.
        top_p: nucleus sampling mass in (0, 1] (1.0: off).
        seed: makes sampling reproducible; 0..2**32-1 (the step's uint32).
        stop_ids: token ids that end generation (added to the model's EOS ids).
        stop_strings: texts that end generation (needs an engine with a tokenizer); the text is
            cut before the stop string. At most :data:`MAX_STOP_STRINGS`, each of 1 to
            :data:`MAX_STOP_CHARS` characters.
        ignore_eos: do not stop at the model's EOS ids.

    Example:
        >>> from jaxdist import SamplingParams
        >>> SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, stop_strings=("\\n",)).top_p
        0.9
        >>> SamplingParams(top_k=10**20)
        Traceback (most recent call last):
        ...
        jaxdist.coordinator.request.ParamError: top_k: expected an integer in 0..2147483647 ...
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ParamError("max_tokens", f"expected an integer >= 1, found "
                                           f"{_found(self.max_tokens)}")
        t = self.temperature
        if not _is_real(t) or not 0 <= t <= FLOAT32_MAX:  # also refuses nan and inf
            raise ParamError("temperature", f"expected a finite number >= 0, found {_found(t)}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"expected a number in (0, 1], found {_found(self.top_p)}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            raise ParamError("top_k", f"expected an integer in 0..{INT32_MAX} (0: off; the "
                                      f"model's vocabulary bounds it further), found "
                                      f"{_found(self.top_k)}")
        if not _is_int(self.seed) or not 0 <= self.seed <= UINT32_MAX:
            raise ParamError("seed", f"expected an integer in 0..{UINT32_MAX}, found "
                                     f"{_found(self.seed)}")
        # A list or set from an untyped caller becomes the field's own type, so the
        # parameters cannot change under the engine.
        try:
            if not isinstance(self.stop_ids, (frozenset, set, list, tuple)):
                raise TypeError
            object.__setattr__(self, "stop_ids", frozenset(self.stop_ids))
        except TypeError:  # not a collection, or of unhashable items
            raise ParamError("stop_ids", f"expected a set of token ids, found "
                                         f"{_found(self.stop_ids)}") from None
        _check_stop_ids(self.stop_ids, None)
        if not isinstance(self.stop_strings, (tuple, list)):
            raise ParamError("stop_strings", f"expected a tuple of strings, found "
                                             f"{type(self.stop_strings).__name__}")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS:
            raise ParamError("stop_strings", f"expected at most {MAX_STOP_STRINGS} stop "
                                             f"strings, found {len(stops)}")
        for i, s in enumerate(stops):
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
                found = (f"{len(s)} characters" if isinstance(s, str)
                         else type(s).__name__)
                raise ParamError(f"stop_strings[{i}]", f"expected a string of 1 to "
                                                       f"{MAX_STOP_CHARS} characters, found "
                                                       f"{found}")

    def check_model(self, vocab_size: int | None, *, context: str = "") -> None:
        """Refuse what the model cannot take: ``top_k`` and ``stop_ids`` beyond its vocabulary
        (``None``: not known, nothing to check).

        Raises:
            ParamError: naming the field, the vocabulary and the value.
        """
        if vocab_size is None:
            return
        if self.top_k > vocab_size:
            raise ParamError("top_k", f"expected an integer in 0..{vocab_size} (0: off; the "
                                      f"vocabulary has {vocab_size} tokens), found {self.top_k}",
                             context=context)
        _check_stop_ids(self.stop_ids, vocab_size, context)


@dataclasses.dataclass
class GenerationResult:
    """One finished sequence.

    Attributes:
        prompt_ids: the prompt.
        tokens: the new tokens; on a stop string, those before the token that completed it.
        finish_reason: one of ``"eos"``, ``"stop"``, ``"length"``, ``"max_seq"``, ``"abort"``.
        ttft_s: time from submission to the first new token (0 when there was none).
        decode_s: time from the first to the last new token.
        text: the new text, cut before a stop string (``None``: the engine has no tokenizer).
        request_id: the engine's id of the request.
        completion_tokens: tokens the model produced, the one that completed a stop string
            included (what the request cost).

    Example:
        >>> r = GenerationResult([1, 2], [7, 8, 9], "length", ttft_s=0.05, decode_s=0.02)
        >>> r.finish_reason, r.tokens_per_s  # 2 decode steps after the first token
        ('length', 100.0)
    """

    prompt_ids: list[int]
    tokens: list[int]
    finish_reason: str
    ttft_s: float
    decode_s: float
    text: str | None = None
    request_id: str = ""
    completion_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Decode steps after the first token, per second."""
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Delta:
    """What one step added to a request.

    Attributes:
        request_id: the request.
        token_ids: the new token ids (every token sampled, also one that completed a stop
            string or is an EOS id).
        text: the new text; ``""`` when the text is held back (an incomplete UTF-8 character,
            or the possible start of a stop string) or the engine has no tokenizer. The texts of
            all deltas concatenate to :attr:`GenerationResult.text`.
        finish_reason: ``None`` until the last delta, then why the request ended.
        prompt_tokens: length of the prompt.
        completion_tokens: tokens produced so far.
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


_Item = Delta | BaseException


class RequestStream:
    """The deltas of one request, as the engine produces them. Thread-safe.

    Iterate it in a thread (``for delta in stream``) or in an asyncio task
    (``async for delta in stream``); each delta goes to one consumer. The last delta has a
    ``finish_reason``; an error of the pipeline (a dead worker with no spare, say) is raised to
    the consumer instead, with its original message. As a context manager it aborts the request
    on exit if it has not finished (a client that went away).

    Example:
        >>> stream = engine.submit(prompt_ids, SamplingParams(max_tokens=16))  # doctest: +SKIP
        >>> for delta in stream:                                              # doctest: +SKIP
        ...     print(delta.text, end="")
        >>> stream.result().finish_reason                                     # doctest: +SKIP
        'length'
    """

    def __init__(self, request_id: str, prompt_ids: list[int],
                 abort: Callable[[str], bool]) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self._abort = abort
        self._cond = threading.Condition()
        self._items: collections.deque[_Item] = collections.deque()
        self._done = threading.Event()
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._on_push: Callable[[], None] | None = None

    # -- the engine's side ------------------------------------------------------------------

    def _push(self, item: _Item, *, result: GenerationResult | None = None) -> None:
        """Hand ``item`` to the consumer; with ``result`` (or an error) the request is over."""
        with self._cond:
            if self._done.is_set():
                return  # already ended (an error raced an abort): the first end stands
            self._items.append(item)
            if isinstance(item, BaseException):
                self._error = item
            if result is not None:
                self._result = result
            if result is not None or isinstance(item, BaseException):
                self._done.set()
            self._cond.notify_all()
            waker, hook = self._waker, self._on_push
        if waker is not None:
            loop, event = waker
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the consumer's loop closed: nobody is reading any more
                log.debug("request %s: the consumer's event loop is closed", self.request_id)
        if hook is not None:
            hook()

    def _take(self) -> list[_Item]:
        """Every item not yet consumed, without waiting."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
        return items

    # -- the consumer's side ----------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Whether the request has ended (finished, aborted or failed)."""
        return self._done.is_set()

    def __iter__(self) -> Iterator[Delta]:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                item = self._items.popleft()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[Delta]:
        event = asyncio.Event()
        waker = (asyncio.get_running_loop(), event)
        with self._cond:
            # The newest consumer is woken: an earlier one left (a ``break`` does not close an
            # async generator at once), or it is a misuse, and each delta still goes to one.
            self._waker = waker
        try:
            while True:
                with self._cond:
                    item = self._items.popleft() if self._items else None
                    if item is None:
                        event.clear()  # under the lock: a push after this sets it again
                if item is None:
                    await event.wait()
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            with self._cond:
                if self._waker is waker:
                    self._waker = None

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the end and return the whole sequence (deltas need not be read).

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
            JaxdistError: the error that ended the request (a pipeline failure).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None  # set with _done unless _error is
        return self._result

    def abort(self) -> bool:
        """End the request with finish reason ``"abort"``; see :meth:`Engine.abort`."""
        return self._abort(self.request_id)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.done:
            self.abort()
