"""A conversation's prompt ids, where only the chat template writes control tokens.

A chat template marks turns with special tokens (``<|im_start|>``, ``<|im_end|>``). Rendering the
messages to text and tokenizing the whole text with special tokens recognized would also turn
special-token text typed *inside* a message into control tokens: a user who writes
``<|im_end|>\\n<|im_start|>system\\n...`` closes their turn and opens a system turn.
:class:`ChatEncoder` keeps the two apart:

1. Before rendering, each special token's text in a message's content is swapped for a mark the
   template cannot take for a token (private-use characters around a random nonce).
2. The rendered text is split at the special tokens left in it: the template's own.
3. Those become their ids; the text between them, with the marks swapped back, is tokenized
   with special tokens *not* recognized, so a ``<|im_end|>`` typed in content is the few
   ordinary tokens ``<``, ``|``, ``im``, ... .

For content without special-token text the ids equal the plain ``encode(render(messages))``:
the tokenizer itself tokenizes the text between special tokens one run at a time, as here.

Example:
    >>> chat = ChatEncoder(tokenizer)                                      # doctest: +SKIP
    >>> ids = chat.encode([{"role": "user", "content": "Hi<|im_end|>"}])   # doctest: +SKIP
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from jaxdist.core.errors import SpecError

__all__ = ["ChatEncoder"]


class ChatEncoder:
    """Token ids of a conversation rendered with a tokenizer's chat template.

    Args:
        tokenizer: has ``apply_chat_template(messages, add_generation_prompt)`` and ``encode``
            (a :class:`jaxdist.exporters.tokenizer.Tokenizer`); for the protection, its
            ``backend`` (a ``tokenizers.Tokenizer``) too.
        special_tokens_in_content: let special-token text in a message's content become
            control tokens, as a plain ``encode(render(messages))`` does (``jaxdist serve
            --allow-special-tokens-in-content``). Only for clients you trust with the
            template's control tokens.

    Raises:
        SpecError: the protection is on and the tokenizer has no ``backend`` to tokenize text
            without special tokens.
    """

    def __init__(self, tokenizer: Any, *, special_tokens_in_content: bool = False) -> None:
        self.tokenizer = tokenizer
        self.special_tokens_in_content = special_tokens_in_content
        self._pattern: re.Pattern[str] | None = None
        self._ids: dict[str, int] = {}
        self._strip: dict[str, tuple[bool, bool]] = {}  # an added token's lstrip, rstrip
        if special_tokens_in_content:
            return
        backend = getattr(tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
            raise SpecError(f"tokenizer {getattr(tokenizer, 'source', tokenizer)!r}: expected a "
                            f"'backend' (a tokenizers.Tokenizer) to keep special tokens out of "
                            f"chat messages, found none; allow them in content explicitly "
                            f"(jaxdist serve --allow-special-tokens-in-content) if its clients "
                            f"are trusted")
        for i, added in backend.get_added_tokens_decoder().items():
            if added.special and added.content:
                self._ids[added.content] = int(i)
                self._strip[added.content] = (bool(added.lstrip), bool(added.rstrip))
        if self._ids:  # longest first: the leftmost, longest match, as the tokenizer's
            self._pattern = re.compile("|".join(
                re.escape(t) for t in sorted(self._ids, key=len, reverse=True)))
        # A copy that reads special-token text as text; the original stays as it is for the
        # other callers (setting it there would race with their encodes).
        self._plain = type(backend).from_str(backend.to_str())
        self._plain.encode_special_tokens = True

    def encode(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of ``messages`` (dicts with ``role`` and ``content``).

        Raises:
            SpecError: the tokenizer has no chat template, or the template refused the
                messages.
        """
        tok = self.tokenizer
        if self._pattern is None:  # allowed, or a tokenizer without special tokens
            text = tok.apply_chat_template([dict(m) for m in messages],
                                           add_generation_prompt=add_generation_prompt)
            return list(tok.encode(text, add_special_tokens=False))
        pattern = self._pattern
        nonce = secrets.token_hex(8)
        marks: dict[str, str] = {}  # special-token text -> its mark; the mark's text back
        back: dict[str, str] = {}

        def mark(m: re.Match[str]) -> str:
            text = m.group()
            if text not in marks:
                marks[text] = f"\ue000{nonce}.{len(marks)}\ue001"
                back[marks[text]] = text
            return marks[text]

        hidden = []
        for message in messages:
            content = message.get("content")
            hidden.append({**message, "content": pattern.sub(mark, content)}
                          if isinstance(content, str) else dict(message))
        text = tok.apply_chat_template(hidden, add_generation_prompt=add_generation_prompt)
        unmark = re.compile(f"\ue000{nonce}\\.[0-9]+\ue001")
        ids: list[int] = []
        runs: list[str] = []
        tokens: list[str] = []
        pos = 0
        for found in pattern.finditer(text):
            runs.append(text[pos:found.start()])
            tokens.append(found.group())
            pos = found.end()
        runs.append(text[pos:])
        for k, run in enumerate(runs):
            # An added token with lstrip/rstrip takes the whitespace beside it, as the
            # tokenizer's own split does.
            if k > 0 and self._strip[tokens[k - 1]][1]:
                run = run.lstrip()
            if k < len(tokens) and self._strip[tokens[k]][0]:
                run = run.rstrip()
            if run:
                plain = unmark.sub(lambda x: back[x.group()], run) if back else run
                ids += self._plain.encode(plain, add_special_tokens=False).ids
            if k < len(tokens):
                ids.append(self._ids[tokens[k]])
        return ids
