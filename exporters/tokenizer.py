"""Text <-> token ids for exported models, from a GGUF file's vocabulary or a ``tokenizer.json``.

:class:`Tokenizer` is a thin wrapper over a ``tokenizers.Tokenizer`` (the Rust library does the
work) plus what a serving loop needs around it: the BOS id, the set of end-of-generation ids, and
a chat template rendered the way ``transformers`` renders it. Generated ids become text, a few at
a time and cut at stop strings, in :mod:`jaxdist.coordinator.detokenizer`.

A GGUF carries no ``tokenizer.json``; its tokenizer is rebuilt from llama.cpp's metadata keys,
following llama.cpp's own conventions (``src/llama-vocab.cpp``):

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from ``tokens`` and ``merges``. The text is
  first split by the regexes llama.cpp picks for ``tokenizer.ggml.pre`` (:data:`PRE_TOKENIZERS`).
- ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE. The merges are derived from
  ``scores`` (a pair merges with the score of the token it makes), unknown characters fall back
  to ``<0xXX>`` byte tokens, and a space is prefixed to every run of text at the start or after a
  special token, as llama.cpp does (``add_space_prefix``).

Tokens typed CONTROL or UNKNOWN are special (matched whole in the text, dropped by
``decode(skip_special_tokens=True)``); USER_DEFINED tokens are matched whole but kept.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from jaxdist.core.errors import SpecError
from jaxdist.core.weights.gguf import metadata as gguf_metadata

__all__ = ["PRE_TOKENIZERS", "Tokenizer", "gguf_tokenizer", "load_tokenizer"]

logger = logging.getLogger(__name__)

_K = gguf.Keys.Tokenizer
_TT = gguf.TokenType

# Split regexes, in the spelling of the models' own tokenizer.json (the `tokenizers` regex engine
# takes them as is; llama.cpp respells the case-insensitive groups for std::regex).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGIT = r"\p{N}"

# tokenizer.ggml.pre -> (split regexes applied in turn, ignore_merges, add_bos default).
# Each list is llama.cpp's regex_exprs for that pre-tokenizer type; ignore_merges (a word that is
# itself a token is not cut up) and the BOS default are also llama.cpp's.
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "mellum", "exaone4"),
                    ((_GPT2,), False, False)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), ((_DIGIT, _GPT2), False, False)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2"), ((_LLAMA3,), True, True)),
    **dict.fromkeys(("dbrx", "smaug-bpe"), ((_LLAMA3,), False, False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "megrez", "hunyuan"),
                    ((_QWEN2,), False, False)),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), ((_GPT4O,), False, False)),
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"), False, False),
    # What llama.cpp uses when `pre` is missing (older files); it warns of degraded quality.
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False, False),
}

# Texts llama.cpp treats as end-of-generation wherever they appear in a vocabulary.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})


class Tokenizer:
    """Encode, decode and chat-format text for one model.

    Build it with :meth:`from_gguf`, :meth:`from_dir` or :func:`load_tokenizer`.

    Attributes:
        backend: the wrapped ``tokenizers.Tokenizer`` (no padding, no truncation).
        bos_id: id of the beginning-of-sequence token, or ``None``.
        eos_ids: ids that end generation: EOS, EOT/EOM, and ``<|im_end|>``-like tokens.
        chat_template: the Jinja chat template, or ``None``.
        source: the file or directory it was built from (used in error messages).

    Example:
        >>> tok = load_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")            # doctest: +SKIP
        >>> prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])  # doctest: +SKIP
        >>> ids = tok.encode(prompt)                                            # doctest: +SKIP
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_id: int | None,
                 eos_ids: Iterable[int], chat_template: str | None, source: str,
                 special_tokens: Mapping[str, str] | None = None) -> None:
        backend.no_padding()
        backend.no_truncation()
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids: set[int] = {int(i) for i in eos_ids}
        self.chat_template = chat_template
        self.source = source
        self._special_tokens = dict(special_tokens or {})
        self._template: Any = None

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) become
        their ids; ``add_special_tokens`` adds what the model adds itself (BOS, [CLS]/[SEP])."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes that do not form valid UTF-8 become U+FFFD."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def with_chat_template(self, chat_template: str | None) -> Tokenizer:
        """The same tokenizer (sharing its backend) with another chat template."""
        return Tokenizer(self.backend, bos_id=self.bos_id, eos_ids=self.eos_ids,
                         chat_template=chat_template, source=self.source,
                         special_tokens=self._special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` with the model's chat template, as ``transformers`` does.

        The template sees ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``
        (and the other special tokens the model names), ``raise_exception`` and ``strftime_now``,
        plus ``kwargs`` (e.g. ``tools``). It runs in a sandboxed Jinja environment.

        Raises:
            SpecError: the model has no chat template, the template does not compile, or it
                rejected the messages (``raise_exception``).
        """
        import jinja2  # noqa: PLC0415 - only chat users need it

        if self.chat_template is None:
            raise SpecError(f"tokenizer '{self.source}' has no chat template; expected "
                            f"'tokenizer.chat_template' (GGUF) or 'chat_template' "
                            f"(tokenizer_config.json); format the prompt yourself")
        try:
            if self._template is None:
                self._template = _compile_template(self.chat_template)
            context = {**self._special_tokens, **kwargs}
            text: str = self._template.render(messages=messages,
                                              add_generation_prompt=add_generation_prompt,
                                              **context)
            return text
        except jinja2.TemplateError as exc:
            raise SpecError(f"chat template of '{self.source}' failed: "
                            f"{type(exc).__name__}: {exc}") from exc

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes (see the module docstring).

        Raises:
            WeightError: the file is missing or not GGUF.
            SpecError: a tokenizer key is missing, or the model type or pre-tokenizer is not
                supported; the message names the file and the key.
        """
        return cls.from_gguf_metadata(gguf_metadata(path), str(path))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], where: str) -> Tokenizer:
        """Rebuild the tokenizer from a GGUF file's key/value metadata, read already (on this
        machine, or by a worker's ``DescribeWeights``); ``where`` names the file in errors.

        Raises:
            SpecError: as :meth:`from_gguf`.
        """
        model = _require(meta, _K.MODEL, where)
        tokens = _require(meta, _K.LIST, where)
        types = meta.get(_K.TOKEN_TYPE) or [int(_TT.NORMAL)] * len(tokens)
        if len(types) != len(tokens):
            raise SpecError(f"GGUF '{where}': '{_K.TOKEN_TYPE}' has {len(types)} entries; "
                            f"expected one per token ({len(tokens)}); the file is inconsistent")
        if model == "gpt2":
            backend, add_bos = _byte_level_bpe(meta, tokens, where)
        elif model == "llama":
            backend, add_bos = _sentencepiece_bpe(meta, tokens, types, where)
        else:
            raise SpecError(f"GGUF '{where}': tokenizer model '{model}' ('{_K.MODEL}') is not "
                            f"supported; expected 'gpt2' (byte-level BPE) or 'llama' "
                            f"(SentencePiece); use a directory with tokenizer.json instead")
        eog = {i for i, t in enumerate(tokens) if t in _EOG_TEXTS}
        special = [AddedToken(t, special=True, normalized=False) for i, t in enumerate(tokens)
                   if types[i] in (_TT.CONTROL, _TT.UNKNOWN) or i in eog]
        user = [AddedToken(t, special=False, normalized=False) for i, t in enumerate(tokens)
                if types[i] == _TT.USER_DEFINED and i not in eog]
        backend.add_special_tokens(special)
        backend.add_tokens(user)
        bos_id = _token_id(meta, _K.BOS_ID, len(tokens), where)
        eos_id = _token_id(meta, _K.EOS_ID, len(tokens), where)
        add_bos = bool(meta.get(_K.ADD_BOS, add_bos))
        add_eos = bool(meta.get(_K.ADD_EOS, False))
        for flag, key, value in ((add_bos, _K.BOS_ID, bos_id), (add_eos, _K.EOS_ID, eos_id)):
            if flag and value is None:
                raise SpecError(f"GGUF '{where}': the tokenizer adds a token whose id "
                                f"'{key}' is missing; the file is inconsistent")
        _set_post_processor(backend, tokens, bos_id if add_bos else None,
                            eos_id if add_eos else None, where)
        for key in (_K.EOS_ID, _K.EOT_ID, _K.EOM_ID):
            if (i := _token_id(meta, key, len(tokens), where)) is not None:
                eog.add(i)
        named = {"bos_token": bos_id, "eos_token": eos_id,
                 "unk_token": _token_id(meta, _K.UNK_ID, len(tokens), where),
                 "pad_token": _token_id(meta, _K.PAD_ID, len(tokens), where)}
        logger.debug("tokenizer from %s: %s/%s, %d tokens, bos=%s eog=%s", where, model,
                     meta.get(_K.PRE), len(tokens), bos_id, sorted(eog))
        return cls(backend, bos_id=bos_id, eos_ids=eog, source=where,
                   chat_template=meta.get(_K.CHAT_TEMPLATE),
                   special_tokens={k: tokens[v] for k, v in named.items() if v is not None})

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load ``tokenizer.json`` from a Hugging Face model directory.

        The chat template comes from ``chat_template.jinja`` or ``tokenizer_config.json``; the
        BOS/EOS tokens from ``tokenizer_config.json``; more EOS ids from ``config.json`` and
        ``generation_config.json``. BOS/CLS/SEP are added by ``tokenizer.json``'s post-processor.

        Raises:
            SpecError: ``tokenizer.json`` is missing or unreadable, or a config is not JSON.
        """
        d = Path(path)
        file = d / "tokenizer.json"
        if not file.is_file():
            raise SpecError(f"tokenizer directory '{d}': 'tokenizer.json' not found; expected a "
                            f"Hugging Face model directory with a fast-tokenizer file")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises plain Exception
            raise SpecError(f"tokenizer file '{file}' could not be loaded: {exc}") from exc
        config = _read_json(d / "tokenizer_config.json")
        named: dict[str, str] = {}
        for key, value in config.items():
            if key.endswith("_token") and isinstance(value, (str, dict)):
                content = value if isinstance(value, str) else value.get("content")
                if isinstance(content, str):
                    named[key] = content
        bos_id = backend.token_to_id(named["bos_token"]) if "bos_token" in named else None
        eos: set[int] = set()
        if "eos_token" in named and (i := backend.token_to_id(named["eos_token"])) is not None:
            eos.add(i)
        for name in ("config.json", "generation_config.json"):
            value = _read_json(d / name).get("eos_token_id")  # an int or a list of ints
            eos.update(v for v in (value if isinstance(value, list) else [value])
                       if isinstance(v, int))
        eos.update(i for t, i in backend.get_vocab(with_added_tokens=True).items()
                   if t in _EOG_TEXTS)
        template_file = d / "chat_template.jinja"
        template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                    else config.get("chat_template"))
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        return cls(backend, bos_id=bos_id, eos_ids=eos, chat_template=template, source=str(d),
                   special_tokens=named)


def load_tokenizer(model_path: str | os.PathLike[str]) -> Tokenizer | None:
    """The tokenizer of a model: a ``.gguf`` file, or a directory holding ``tokenizer.json``.

    Returns:
        the tokenizer, or ``None`` if ``model_path`` is neither, or a GGUF that declares no
        vocabulary (``tokenizer.ggml.model = "none"``, which llama.cpp accepts).

    Raises:
        SpecError, WeightError: as :meth:`Tokenizer.from_gguf` / :meth:`Tokenizer.from_dir`.
    """
    p = Path(model_path)
    if p.is_file() and p.suffix == ".gguf":
        return gguf_tokenizer(gguf_metadata(p), str(p))
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return Tokenizer.from_dir(p)
    return None


def gguf_tokenizer(meta: Mapping[str, Any], where: str) -> Tokenizer | None:
    """The tokenizer a GGUF file's metadata describes; ``None`` for a file that declares no
    vocabulary (``tokenizer.ggml.model = "none"``, which llama.cpp accepts).

    Raises:
        SpecError: as :meth:`Tokenizer.from_gguf_metadata`.
    """
    if meta.get(_K.MODEL) == "none":  # llama.cpp's "no vocabulary"
        logger.info("GGUF '%s' has no tokenizer (tokenizer.ggml.model = none): pass token ids",
                    where)
        return None
    return Tokenizer.from_gguf_metadata(meta, where)


# --- GGUF vocabularies ----------------------------------------------------------------------


def _require(meta: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in meta:
        raise SpecError(f"GGUF '{where}': key '{key}' is missing; expected the tokenizer "
                        f"metadata llama.cpp's converter writes; reconvert the model")
    return meta[key]


def _token_id(meta: Mapping[str, Any], key: str, n: int, where: str) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if not 0 <= int(value) < n:
        raise SpecError(f"GGUF '{where}': '{key}' = {value} is outside the vocabulary "
                        f"(0..{n - 1}); the file is inconsistent")
    return int(value)


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str],
                    where: str) -> tuple[tokenizers.Tokenizer, bool]:
    merges = _require(meta, _K.MERGES, where)
    pre = meta.get(_K.PRE)
    if pre is None:
        logger.warning("GGUF %s has no '%s'; using llama.cpp's 'default' pre-tokenizer, as "
                       "llama.cpp does (tokenization may differ from the original model)",
                       where, _K.PRE)
        pre = "default"
    if pre not in PRE_TOKENIZERS:
        raise SpecError(f"GGUF '{where}': pre-tokenizer '{pre}' ('{_K.PRE}') is not supported; "
                        f"expected one of {sorted(PRE_TOKENIZERS)}; add its split regexes "
                        f"(llama.cpp src/llama-vocab.cpp) to PRE_TOKENIZERS")
    splits, ignore_merges, add_bos = PRE_TOKENIZERS[pre]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    # llama.cpp splits a merge at the first space after its first byte (a token may be " ").
    pairs = [(m[:k], m[k + 1:]) for m in merges if (k := m.find(" ", 1)) > 0]
    if len(pairs) != len(merges):
        raise SpecError(f"GGUF '{where}': {len(merges) - len(pairs)} entries of '{_K.MERGES}' "
                        f"are not 'left right' pairs; the file is corrupt")
    try:
        bpe = models.BPE(vocab, pairs, ignore_merges=ignore_merges)
    except Exception as exc:
        raise SpecError(f"GGUF '{where}': '{_K.MERGES}' does not fit '{_K.LIST}': {exc}") from exc
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, add_bos


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int],
                       where: str) -> tuple[tokenizers.Tokenizer, bool]:
    scores = _require(meta, _K.SCORES, where)
    if len(scores) != len(tokens):
        raise SpecError(f"GGUF '{where}': '{_K.SCORES}' has {len(scores)} entries; expected one "
                        f"per token ({len(tokens)}); the file is inconsistent")
    if meta.get(_K.REMOVE_EXTRA_WS):
        raise SpecError(f"GGUF '{where}': '{_K.REMOVE_EXTRA_WS}' = true is not supported")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    # A pair merges into the token it spells, ranked by that token's score (llama.cpp's SPM
    # tokenizer merges the best-scoring bigram first). Ties: longer left piece, then lower ids.
    mergeable = {t: i for i, t in enumerate(tokens) if types[i] in (_TT.NORMAL, _TT.USER_DEFINED)}
    ranked = []
    for t, i in mergeable.items():
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[i], -len(left), -len(right), mergeable[left],
                               mergeable[right], left, right))
    ranked.sort()
    unk = next((tokens[i] for i, ty in enumerate(types) if ty == _TT.UNKNOWN), None)
    bpe = models.BPE(vocab, [(r[5], r[6]) for r in ranked], unk_token=unk, fuse_unk=True,
                     byte_fallback=True)
    backend = tokenizers.Tokenizer(bpe)
    prefix = bool(meta.get(_K.ADD_PREFIX, True))
    # The normalizer runs once per run of text between special tokens, so the prefix space lands
    # at the start and after every special token, as in llama.cpp.
    replace = normalizers.Replace(" ", "\u2581")
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend("\u2581"), replace])
                          if prefix else replace)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend, True


def _set_post_processor(backend: tokenizers.Tokenizer, tokens: list[str], bos: int | None,
                        eos: int | None, where: str) -> None:
    pieces = [(tokens[i], i) for i in (bos, eos) if i is not None]
    if not pieces:
        return
    single = ([tokens[bos]] if bos is not None else []) + ["$A"] + (
        [tokens[eos]] if eos is not None else [])
    pair = single + ["$B" if s == "$A" else s for s in single]
    try:
        backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(dict.fromkeys(pieces)))
    except Exception as exc:
        raise SpecError(f"GGUF '{where}': BOS/EOS tokens {pieces} cannot be added: {exc}") from exc


# --- configs and chat templates ----------------------------------------------------------------


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpecError(f"'{file}' is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _compile_template(source: str) -> Any:
    """A Jinja template in the sandbox ``transformers`` uses for chat templates."""
    import jinja2  # noqa: PLC0415
    import jinja2.ext  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    class Generation(jinja2.ext.Extension):
        # transformers' {% generation %} marks assistant spans for training masks; rendering it
        # is rendering its body.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters, which templates do not expect.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
