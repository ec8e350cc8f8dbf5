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
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from types import TracebackType
from typing import Self

from jaxdist.core.errors import SpecError

__all__ = ["Delta", "GenerationResult", "RequestStream", "SamplingParams"]

log = logging.getLogger(__name__)

FINISH_REASONS = ("eos", "stop", "length", "max_seq", "abort")
"""Why a sequence ended: an EOS id, a stop id or stop string, ``max_tokens``, the KV cache
length, or an abort (:meth:`RequestStream.abort`, :meth:`Engine.abort`, :meth:`Engine.close`)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick and when to stop.

    Attributes:
        max_tokens: most new tokens.
        temperature: 0 is greedy.
        top_k: keep the k most likely tokens (0: off).
        top_p: nucleus sampling mass (1.0: off).
        seed: makes sampling reproducible.
        stop_ids: token ids that end generation (added to the model's EOS ids).
        stop_strings: texts that end generation (needs an engine with a tokenizer); the text is
            cut before the stop string.
        ignore_eos: do not stop at the model's EOS ids.

    Example:
        >>> from jaxdist import SamplingParams
        >>> SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, stop_strings=("\\n",)).top_p
        0.9
        >>> SamplingParams(temperature=-1)
        Traceback (most recent call last):
        ...
        jaxdist.core.errors.SpecError: ...
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
        if self.max_tokens < 1:
            raise SpecError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise SpecError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpecError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop_strings):
            raise SpecError(f"stop_strings must not contain an empty string, got "
                            f"{self.stop_strings!r}")


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
