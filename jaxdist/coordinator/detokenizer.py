"""Text of generated tokens, a few tokens at a time, and stop strings on it.

Decoding a whole sequence at every step costs O(sequence) per token, O(n^2) per request. Here
each step decodes a short window: the tokens since the text emitted before last (the
*prefix offset*) to the end, against the same window without the new tokens (up to the *read
offset*); the difference is the new text. The window starts one emission back so that decoders
that look at neighbouring tokens (SentencePiece's leading space, WordPiece ``##``) see the same
context as a full decode. Text that ends in U+FFFD (a UTF-8 character whose bytes are split
over several tokens) is held back until a later token completes it.

Stop strings are searched in the new text plus the characters held back before it: the longest
end of the text that could be the start of a stop string (at most ``longest stop string - 1``
characters) is not emitted until later text shows it is not one; the text held back before an
incomplete character is searched too, so a stop string is found at the token that completes
it. So the emitted text is always cut before the first stop string, and no text after it is
ever emitted, at a cost of O(new text + (longest stop string)^2) per step, independent of the
sequence length.

This is jaxdist's one incremental detokenizer: the engine gives each delta its text with it,
and ``jaxdist generate``, ``chat`` and ``serve`` print or send those texts. It needs only a
``decode`` (:class:`Detokenizer`), so a tokenizer of any kind, or a stand-in, serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["Detokenizer", "IncrementalDetokenizer", "TextStream"]


class Detokenizer(Protocol):
    """What the engine needs of a tokenizer: ids -> text (invalid UTF-8 becomes U+FFFD)."""

    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """Turns ids, fed as they come, into text that later ids cannot change.

    The texts :meth:`push` returns, followed by :meth:`flush`, concatenate to
    ``tokenizer.decode(all_ids)`` for tokenizers whose decode of a longer window extends that of
    a shorter one (byte-level BPE, SentencePiece).

    Example:
        >>> class Bytes:  # a tokenizer whose ids are UTF-8 bytes
        ...     def decode(self, ids):
        ...         return bytes(ids).decode("utf-8", errors="replace")
        >>> d = IncrementalDetokenizer(Bytes())
        >>> [d.push([b]) for b in "hé".encode()]  # é is two bytes: held back until whole
        ['h', '', 'é']
    """

    def __init__(self, tokenizer: Detokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # the window starts here: context, already emitted
        self._read = 0    # ids before this are emitted
        self.held = ""    # text of the ids after the read offset, up to an incomplete character

    def _delta(self, *, final: bool) -> str:
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        after = self._tokenizer.decode(self._ids[self._prefix:])
        if len(after) <= len(before) or (not final and after.endswith("\ufffd")):
            # What precedes the incomplete character is final already, only not released:
            # a stop string may end in it.
            self.held = after[len(before):].rstrip("\ufffd")
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        self.held = ""
        return after[len(before):]

    def push(self, ids: Sequence[int]) -> str:
        """Add ids; return the new text that is final (possibly ``""``)."""
        self._ids.extend(int(i) for i in ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """Return the text held back, even if it ends in an incomplete character."""
        return self._delta(final=True)


class TextStream:
    """The text of one sequence: incremental decoding, then stop strings, then what to emit.

    Args:
        tokenizer: ids -> text.
        stop_strings: texts that end the sequence; the text is cut before the first one.

    Example:
        >>> class Letters:
        ...     def decode(self, ids):
        ...         return "".join(chr(97 + i) for i in ids)
        >>> t = TextStream(Letters(), stop_strings=("cd",))
        >>> [t.push([i]) for i in range(5)]  # "c" is held back: it may start "cd"
        [('a', False), ('b', False), ('', False), ('', True), ('', True)]
        >>> t.text
        'ab'
    """

    def __init__(self, tokenizer: Detokenizer, stop_strings: Sequence[str] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = tuple(stop_strings)
        self._held = ""  # decoded, not emitted: it may be the start of a stop string
        self._parts: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._parts)

    def _open_stop(self, text: str) -> int:
        """Length of the longest end of ``text`` that is the start of a stop string."""
        return max((k for s in self._stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)

    def _emit(self, new: str, *, final: bool, ahead: str = "") -> tuple[str, bool]:
        """Emit ``new`` after the held text, up to a stop string. ``ahead``: text that is final
        but not released yet by the detokenizer (before an incomplete character); a stop
        string found there ends the text too, one token sooner."""
        if self.stopped:
            return "", True
        window = self._held + new
        seen = window + ahead
        cut = min((i for i in (seen.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self._held, self.stopped = seen[:cut], "", True
        else:
            keep = 0 if final else self._open_stop(window)
            out, self._held = window[:len(window) - keep], window[len(window) - keep:]
        if out:
            self._parts.append(out)
        return out, self.stopped

    def push(self, ids: Sequence[int]) -> tuple[str, bool]:
        """Add ids. Returns the text to emit now and whether a stop string was reached."""
        new = self._detok.push(ids)
        return self._emit(new, final=False, ahead=self._detok.held)

    def finish(self) -> tuple[str, bool]:
        """The sequence ended: emit what was held back (up to a stop string in it)."""
        return self._emit(self._detok.flush(), final=True)
