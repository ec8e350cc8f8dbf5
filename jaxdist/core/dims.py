"""Dims of a stage's activations: an integer, a symbol, or an expression of symbols.

A dim is what ``jax.export`` records for one axis of an argument or result, written as text the
way jax prints it:

* an integer: ``576``;
* a symbol, bound by the inputs at run time: ``b``, ``s``;
* an expression of symbols: ``2*b``, ``b + 1``, ``- b + 3``, ``b^2``, ``floordiv(s, 2)``,
  ``mod(s, 4)``, ``max(b, 4)``, ``min(b, s)``.

:func:`parse_dim` reads one from the wire; :func:`check_dim` says what is wrong with a bad one;
:func:`symbols_of` and :func:`evaluate` are what a worker needs to bind the symbols from the
inputs' shapes and compute every other dim. The grammar is a small, bounded subset of jax's
(no recursion deeper than :data:`MAX_DEPTH`, no text longer than :data:`MAX_LENGTH`), since a
spec may come from anyone holding a worker token.

Example:
    >>> evaluate(parse_dim("2*b + 1"), {"b": 3})
    7
    >>> sorted(symbols_of("floordiv(s, 2) + b"))
    ['b', 's']
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping

__all__ = ["MAX_DEPTH", "MAX_LENGTH", "Dim", "check_dim", "evaluate", "is_symbol", "parse_dim",
           "symbols_of"]

Dim = int | str
"""One dim: an ``int``, or the text of a symbol or an expression (``"b"``, ``"2*b"``)."""

MAX_LENGTH = 256
MAX_DEPTH = 32

# Matched with fullmatch: "$" would also accept a trailing newline. ASCII only: str.isdigit()
# and "\d" accept other scripts' digits ("²", "٣"), which int() refuses or reads differently.
_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
# A constant dim: at most 18 digits, so it fits an int64 (and stays far below int()'s limit).
_INT_DIM = re.compile(r"-?[0-9]{1,18}", re.ASCII)
_TOKEN = re.compile(r"\s*(?:([0-9]{1,18})|([A-Za-z_][A-Za-z0-9_]*)|(\S))", re.ASCII)
_FUNCTIONS: dict[str, tuple[int, Callable[..., int]]] = {
    "floordiv": (2, lambda a, b: a // b),
    "mod": (2, lambda a, b: a % b),
    "max": (2, max),
    "min": (2, min),
}

_Eval = Callable[[Mapping[str, int]], int]


def parse_dim(text: str) -> Dim:
    """A dim as written in text (a ``TensorSig`` on the wire, an artifact's metadata).

    Returns:
        an ``int`` for an ASCII decimal integer of at most 18 digits with an optional ``-``
        (``"32"``, ``"-4"``); anything else unchanged: a symbol or an expression, which
        :func:`check_dim` accepts or explains.

    Example:
        >>> parse_dim("32"), parse_dim("b"), parse_dim("2*b"), parse_dim("²")
        (32, 'b', '2*b', '²')
    """
    return int(text) if _INT_DIM.fullmatch(text) else text


@functools.lru_cache(maxsize=4096)  # asked per axis of every frame a worker checks
def is_symbol(dim: Dim) -> bool:
    """Whether ``dim`` is a bare symbol (``"b"``), the only kind an input's shape can bind."""
    return isinstance(dim, str) and _SYMBOL.fullmatch(dim) is not None


class _Parser:
    """Recursive descent over jax's printed dim expressions (see the module docstring)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[str] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:  # only trailing whitespace is left
                break
            self.tokens.append(m.group(0).strip())
            pos = m.end()
        self.i = 0
        self.symbols: set[str] = set()

    def _peek(self) -> str:
        return self.tokens[self.i] if self.i < len(self.tokens) else ""

    def _take(self, expected: str | None = None) -> str:
        tok = self._peek()
        if expected is not None and tok != expected:
            found = repr(tok) if tok else "the end"
            raise ValueError(f"expected {expected!r} at token {self.i + 1}, found {found}")
        self.i += 1
        return tok

    def parse(self) -> _Eval:
        fn = self._expr(0)
        if self.i != len(self.tokens):
            raise ValueError(f"unexpected {self._peek()!r} at token {self.i + 1}")
        return fn

    def _expr(self, depth: int) -> _Eval:
        if depth > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH}")
        terms: list[tuple[int, _Eval]] = []
        sign = 1
        if self._peek() == "-":
            self._take()
            sign = -1
        terms.append((sign, self._term(depth)))
        while self._peek() in ("+", "-"):
            sign = 1 if self._take() == "+" else -1
            terms.append((sign, self._term(depth)))
        if len(terms) == 1 and terms[0][0] == 1:
            return terms[0][1]
        return lambda env: sum(s * t(env) for s, t in terms)

    def _term(self, depth: int) -> _Eval:
        factors = [self._power(depth)]
        while self._peek() == "*":
            self._take()
            factors.append(self._power(depth))
        if len(factors) == 1:
            return factors[0]

        def product(env: Mapping[str, int]) -> int:
            out = 1
            for f in factors:
                out *= f(env)
            return out
        return product

    def _power(self, depth: int) -> _Eval:
        base = self._atom(depth)
        if self._peek() != "^":
            return base
        self._take()
        exp_tok = self._take()
        if not exp_tok.isascii() or not exp_tok.isdigit() or not 1 <= int(exp_tok) <= 8:
            raise ValueError(f"an exponent must be an integer from 1 to 8, found {exp_tok!r}")
        n = int(exp_tok)
        return lambda env: base(env) ** n

    def _atom(self, depth: int) -> _Eval:
        tok = self._take()
        if tok == "(":
            inner = self._expr(depth + 1)
            self._take(")")
            return inner
        if tok.isascii() and tok.isdigit():
            value = int(tok)
            return lambda env: value
        if _SYMBOL.fullmatch(tok):
            if self._peek() == "(":
                if tok not in _FUNCTIONS:
                    raise ValueError(f"unknown function {tok!r}; jax writes "
                                     f"{', '.join(sorted(_FUNCTIONS))}")
                arity, op = _FUNCTIONS[tok]
                self._take("(")
                args = [self._expr(depth + 1)]
                while self._peek() == ",":
                    self._take()
                    args.append(self._expr(depth + 1))
                self._take(")")
                if len(args) != arity:
                    raise ValueError(f"{tok}() takes {arity} arguments, found {len(args)}")
                return lambda env: op(*(a(env) for a in args))
            self.symbols.add(tok)
            name = tok
            return lambda env: env[name]
        if not tok:
            raise ValueError("it ends early" if self.tokens else "it is empty")
        raise ValueError(f"unexpected {tok!r} at token {self.i}")


@functools.lru_cache(maxsize=4096)
def _compile(text: str) -> tuple[_Eval, frozenset[str]]:
    if len(text) > MAX_LENGTH:
        raise ValueError(f"longer than {MAX_LENGTH} characters ({len(text)})")
    if text != text.strip(" ") or any(c.isspace() and c != " " for c in text):
        raise ValueError("jax writes no whitespace but single spaces inside an expression")
    parser = _Parser(text)
    return parser.parse(), frozenset(parser.symbols)


def check_dim(dim: Dim) -> str | None:
    """What is wrong with ``dim``, or ``None`` if it is a valid dim.

    Example:
        >>> check_dim("2*b") is None
        True
        >>> check_dim("b +")
        "expected an integer or a symbol name, found 'b +', which is no expression of symbols such as '2*b' either: it ends early"
    """
    if isinstance(dim, int):
        return f"negative size {dim}" if dim < 0 else None
    try:
        _compile(dim)
    except ValueError as exc:
        shown = dim if len(dim) <= 40 else f"{dim[:40]}... ({len(dim)} characters)"
        return (f"expected an integer or a symbol name, found {shown!r}, which is no expression "
                f"of symbols such as '2*b' either: {exc}")
    return None


def symbols_of(dim: Dim) -> frozenset[str]:
    """The symbols ``dim`` uses (none for an integer).

    Raises:
        ValueError: ``dim`` is not a valid dim (:func:`check_dim` says why).
    """
    return frozenset() if isinstance(dim, int) else _compile(dim)[1]


def evaluate(dim: Dim, bindings: Mapping[str, int]) -> int:
    """The size ``dim`` stands for once its symbols are bound.

    Raises:
        KeyError: a symbol of ``dim`` is not in ``bindings`` (the key is the symbol).
        ValueError: ``dim`` is not a valid dim, or divides by zero.
    """
    if isinstance(dim, int):
        return dim
    fn, _ = _compile(dim)
    try:
        return int(fn(bindings))
    except ZeroDivisionError:
        raise ValueError(f"dim {dim!r} divides by zero with {dict(bindings)}") from None
