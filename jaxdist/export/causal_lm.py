"""The causal-LM contract: what a generator needs to know to drive an exported causal LM.

An exporter (``exporters/llama.py``, ``exporters/gpt2.py``) describes a model and returns a
:class:`CausalLM` beside it; :meth:`jaxdist.coordinator.generation.Generator.for_model` consumes
it. A manifest records it as its ``model.options`` mapping (:meth:`CausalLM.to_options`,
:meth:`CausalLM.from_options`), in exactly the form the exporters wrote before this contract
existed, so older manifests still read and a new export writes the same bytes.

The step inputs the generator feeds are those of :mod:`jaxdist.coordinator.generation`
(:data:`STEP_INPUTS`); their dtypes come from the model's input signature.

Example:
    >>> lm = CausalLM(max_slots=4, max_seq=512, prefill_buckets=(16, 64),
    ...               input_dtypes={"tokens": "int32", "slot": "int32", "pos": "int32",
    ...                             "length": "int32"}, eos_ids=(2,))
    >>> lm.to_options()
    {'max_slots': 4, 'max_seq': 512, 'prefill_buckets': (16, 64), 'eos_ids': (2,)}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TypeAlias, TypeGuard

from jaxdist.core.codec import SUPPORTED_DTYPES
from jaxdist.core.control import FIELDS
from jaxdist.core.errors import SpecError

__all__ = ["STEP_CONTROL", "STEP_INPUTS", "CausalLM", "JSONValue", "OptionValue",
           "step_signature"]

JSONValue: TypeAlias = "str | int | float | bool | None | list[JSONValue] | dict[str, JSONValue]"
"""A value JSON can hold."""

OptionValue: TypeAlias = "JSONValue | tuple[int, ...]"
"""A value of :meth:`CausalLM.to_options` (tuples where the manifest's JSON has lists)."""

STEP_INPUTS = ("tokens", "slot", "pos", "length", "temperature", "top_k", "top_p", "seed")
"""Every step input the generator knows how to fill, in the order it documents them."""

STEP_CONTROL = ("slot", "pos", "length", "temperature", "top_k", "top_p", "seed")
"""The step inputs that travel in each frame's control header (:mod:`jaxdist.core.control`),
read there by every stage, rather than as tensors forwarded from stage to stage."""

_REQUIRED_INPUTS = ("tokens", "slot", "pos", "length")  # the KV-cache protocol itself


def step_signature() -> dict[str, tuple[str, str]]:
    """The input signature of an exported causal LM's step: ``tokens (b, s)``, then the
    :data:`STEP_CONTROL` inputs, one value per row (the exporters' ``Model.inputs``).

    Example:
        >>> step_signature()["tokens"], step_signature()["seed"]
        (('b, s', 'int32'), ('b', 'uint32'))
    """
    return {"tokens": ("b, s", "int32"), **{k: ("b", FIELDS[k]) for k in STEP_CONTROL}}
_TYPED_OPTIONS = ("max_slots", "max_seq", "prefill_buckets", "prefill_rows", "eos_ids")  # keys with a field


@dataclasses.dataclass(frozen=True, kw_only=True)
class CausalLM:
    """How to drive an exported causal LM: its KV cache, its compiled prompt shapes, its stops.

    Attributes:
        max_slots: sequences the KV cache of every block holds at once (the slots the stages
            were exported with); the generator runs at most this many prompts together.
        max_seq: positions per slot; a prompt must be shorter, and a sequence ends
            (``"max_seq"``) when its cache is full.
        prefill_buckets: prompt chunk lengths the stages were compiled for, each in
            ``1..max_seq``, in the order exported (the generator uses them in ascending order).
        prefill_rows: the most prompts one prefill step may carry, in chunks of the smallest
            bucket (the stages compiled those shapes; see
            :func:`jaxdist.export.buckets.step_buckets`). 1, the value of manifests that do not
            record it: one prompt per prefill step.
        input_dtypes: step input name -> dtype, from the model's input signature. Each name is
            one of :data:`STEP_INPUTS`; ``tokens``, ``slot``, ``pos`` and ``length`` are
            required.
        eos_ids: ids that end generation (the config's and the tokenizer's), in the order
            recorded.
        extra: further keys of the manifest's ``model.options`` that no generator reads (the
            Llama exporter's informational ``bos_id``, or keys of a newer jaxdist), kept as
            found so that the options round-trip.

    Raises:
        SpecError: a field has a bad value; the message names the field, what was expected and
            what was found.
    """

    max_slots: int
    max_seq: int
    prefill_buckets: tuple[int, ...]
    input_dtypes: Mapping[str, str]
    prefill_rows: int = 1
    eos_ids: tuple[int, ...] = ()
    extra: Mapping[str, JSONValue] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Lists (from JSON, or untyped callers) become tuples; mappings are copied so that
        # the contract cannot change under its holder.
        for name in ("prefill_buckets", "eos_ids"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        for name in ("input_dtypes", "extra"):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, dict(value))
        _check(self, options="CausalLM.", inputs="CausalLM.input_dtypes",
               extra="CausalLM.extra")

    # -- the manifest's model.options (matched pair) -----------------------------------------

    def to_options(self) -> dict[str, OptionValue]:
        """The mapping a manifest records as ``model.options`` (and ``LoadedModel.options``).

        The keys come in the order the exporters wrote them before this contract, with the
        ``extra`` keys between ``prefill_buckets`` and ``eos_ids`` (where the Llama exporter
        put ``bos_id``). ``prefill_rows`` is written after ``prefill_buckets`` when it is not 1,
        so a contract without batched prefill writes the same manifest bytes as before it.
        """
        rows: dict[str, OptionValue] = ({"prefill_rows": self.prefill_rows}
                                        if self.prefill_rows != 1 else {})
        return {"max_slots": self.max_slots, "max_seq": self.max_seq,
                "prefill_buckets": self.prefill_buckets, **rows, **self.extra,
                "eos_ids": self.eos_ids}

    @classmethod
    def from_options(cls, options: Mapping[str, object], *,
                     inputs: Mapping[str, tuple[str, str]], source: str = "") -> CausalLM:
        """Read the contract back from a manifest's ``model.options`` (inverse of to_options).

        Args:
            options: the mapping, as :meth:`to_options` wrote it or as parsed from JSON
                (lists for tuples). ``max_slots``, ``max_seq`` and ``prefill_buckets`` are
                required; ``prefill_rows`` defaults to 1 and ``eos_ids`` to none; any other
                key goes to ``extra``.
            inputs: the model's input signature, name -> ``(dims, dtype)``
                (``ModelInfo.inputs`` of a manifest, or ``Model.inputs``).
            source: where the mapping is, for error messages (e.g. ``"manifest m.json: model"``
                makes ``"manifest m.json: model.options.max_seq: ..."``).

        Raises:
            SpecError: a key is missing or has a bad value; the message names it.
        """
        base = f"{source}." if source else ""
        if not isinstance(options, Mapping):
            raise SpecError(f"{base}options: expected a JSON object, found "
                            f"{type(options).__name__}")
        missing = [k for k in ("max_slots", "max_seq", "prefill_buckets") if k not in options]
        if missing:
            raise SpecError(f"{base}options: missing {', '.join(missing)}; a causal LM's options "
                            f"need max_slots, max_seq and prefill_buckets (export the model "
                            f"again with jaxdist export)")
        if not isinstance(inputs, Mapping):
            raise SpecError(f"{base}inputs: expected an object of name -> [dims, dtype], "
                            f"found {type(inputs).__name__}")
        dtypes: dict[str, object] = {}
        for name, sig in inputs.items():
            if not isinstance(sig, (list, tuple)) or len(sig) != 2:
                raise SpecError(f"{base}inputs[{name!r}]: expected [dims, dtype], found {sig!r}")
            dtypes[name] = sig[1]
        values = {"max_slots": options["max_slots"], "max_seq": options["max_seq"],
                  "prefill_buckets": _as_tuple(options["prefill_buckets"]),
                  "prefill_rows": options.get("prefill_rows", 1),
                  "eos_ids": _as_tuple(options.get("eos_ids", ())),
                  "input_dtypes": dtypes,
                  "extra": {k: v for k, v in options.items() if k not in _TYPED_OPTIONS}}
        # Checked here first, so that the message names the manifest's keys, not the fields.
        _check(_Values(**values), options=f"{base}options.", inputs=f"{base}inputs",
               extra=f"{base}options")
        return cls(**values)  # type: ignore[arg-type]  # checked just above


def _as_tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


@dataclasses.dataclass(frozen=True)
class _Values:
    """CausalLM's fields before they are known to be well typed."""

    max_slots: object
    max_seq: object
    prefill_buckets: object
    prefill_rows: object
    input_dtypes: object
    eos_ids: object
    extra: object


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _found(value: object) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:60] + "..."
    return f"{text} ({type(value).__name__})" if not _is_int(value) else text


def _is_json(value: object) -> bool:
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return False


def _check(lm: CausalLM | _Values, *, options: str, inputs: str, extra: str) -> None:
    """Raise SpecError naming the first bad field: ``options`` prefixes the typed fields'
    names, ``inputs`` and ``extra`` name the mappings."""

    def fail(field: str, expected: str, value: object) -> SpecError:
        return SpecError(f"{field}: expected {expected}, found {_found(value)}")

    max_slots, max_seq = lm.max_slots, lm.max_seq
    if not _is_int(max_slots) or max_slots < 1:
        raise fail(f"{options}max_slots", "an integer >= 1", max_slots)
    if not _is_int(max_seq) or max_seq < 1:
        raise fail(f"{options}max_seq", "an integer >= 1", max_seq)
    buckets = lm.prefill_buckets
    if not isinstance(buckets, tuple):
        raise fail(f"{options}prefill_buckets", "a list of prompt lengths", buckets)
    if not buckets:
        raise SpecError(f"{options}prefill_buckets: expected at least one prompt length in "
                        f"1..{max_seq} (max_seq), found none; the exporters drop buckets longer "
                        f"than max_seq, so pass a shorter bucket or a larger max_seq")
    for i, n in enumerate(buckets):
        if not _is_int(n) or not 1 <= n <= max_seq:
            raise SpecError(f"{options}prefill_buckets[{i}]: expected an integer in "
                            f"1..{max_seq} (max_seq), found {_found(n)}; export with prefill "
                            f"buckets no longer than max_seq")
    rows = lm.prefill_rows
    if not _is_int(rows) or not 1 <= rows <= max_slots:
        raise fail(f"{options}prefill_rows", f"an integer in 1..{max_slots} (max_slots)", rows)
    eos = lm.eos_ids
    if not isinstance(eos, tuple):
        raise fail(f"{options}eos_ids", "a list of token ids", eos)
    for i, t in enumerate(eos):
        if not _is_int(t) or t < 0:
            raise fail(f"{options}eos_ids[{i}]", "a token id (an integer >= 0)", t)
    dtypes = lm.input_dtypes
    if not isinstance(dtypes, Mapping):
        raise fail(inputs, "a mapping of step input name -> dtype", dtypes)
    for name, dtype in dtypes.items():
        if name not in STEP_INPUTS:
            raise SpecError(f"{inputs}[{name!r}]: the generator fills only the step inputs "
                            f"{list(STEP_INPUTS)}, found {name!r}; a causal LM's first stage "
                            f"takes no other input")
        if not isinstance(dtype, str) or dtype not in SUPPORTED_DTYPES:
            raise fail(f"{inputs}[{name!r}]", f"a dtype, one of {', '.join(SUPPORTED_DTYPES)}",
                       dtype)
    absent = [n for n in _REQUIRED_INPUTS if n not in dtypes]
    if absent:
        raise SpecError(f"{inputs}: expected the step inputs {list(_REQUIRED_INPUTS)} (at "
                        f"least), found {sorted(dtypes)}; missing {absent}")
    others = lm.extra
    if not isinstance(others, Mapping):
        raise fail(extra, "a mapping of option name -> JSON value", others)
    for key, value in others.items():
        if not isinstance(key, str):
            raise fail(extra, "option names that are strings", key)
        if key in _TYPED_OPTIONS:
            raise SpecError(f"{extra}[{key!r}]: {key!r} is a field of CausalLM; pass it as "
                            f"that field, not as an extra option")
        if not _is_json(value):
            raise fail(f"{extra}[{key!r}]", "a JSON value (a string, number, boolean, null, "
                                            "list or object)", value)
