"""jaxdist.coordinator.detokenizer: generated ids become text a few at a time, and stop strings
are found in it, with real tokenizers: SmolLM2's byte-level BPE (its GGUF) and a SentencePiece
vocabulary with byte fallback (``<0xXX>`` tokens; a GGUF written here, as in test_tokenizer).

The reference is the tokenizer's decode of all the ids at once, and ``str.find`` of a stop
string in it. The engine streaming this text, and the CLI printing it, are tested in
test_engine and test_cli.
"""

from __future__ import annotations

import pytest
from test_tokenizer import write_spm_gguf

from jaxdist.coordinator.detokenizer import IncrementalDetokenizer, TextStream
from jaxdist.exporters.tokenizer import Tokenizer

# The first two have characters whose UTF-8 bytes each tokenizer splits over several tokens;
# the last is mostly whole words of the SentencePiece vocabulary.
TEXTS = ["héllo wörld 你好 🙂 naïve — ok", "Ünïcödé ∑ 𝄞 ends in a four-byte char 𝄞",
         "plain ascii, nothing to hold back", "the world and  the 12 é"]
CHAT = "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_gguf(write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf"))


@pytest.fixture(params=["smollm", "spm"])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    """Each tokenizer kind: byte-level BPE, and SentencePiece with byte fallback."""
    t = request.getfixturevalue(request.param)
    assert isinstance(t, Tokenizer)
    return t


class KeepSpecials:
    """A tokenizer's decode that keeps special tokens' text (``<|im_end|>``)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def _ids(tok: Tokenizer, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # the tokenizer round-trips it: the reference holds
    return ids


def _split_characters(tok: Tokenizer, ids: list[int]) -> bool:
    """Whether some character's UTF-8 bytes are split over several of ``ids``."""
    return any("\ufffd" in tok.decode([i]) for i in ids)


# --- incremental decoding -----------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_pushed_text_equals_full_decode(tok: Tokenizer, text: str, chunk: int) -> None:
    ids = _ids(tok, text)
    if text in TEXTS[:2]:  # the case only means something if a character is split
        assert _split_characters(tok, ids)
    d = IncrementalDetokenizer(tok)
    parts = [d.push(ids[k:k + chunk]) for k in range(0, len(ids), chunk)]
    parts.append(d.flush())
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)  # split characters were held, not mangled


def test_byte_fallback_characters_are_held_until_whole(spm: Tokenizer) -> None:
    """A character SentencePiece spells as ``<0xXX>`` byte tokens (a four-byte emoji) comes out
    only with its last byte, and whole."""
    ids = _ids(spm, "a 🙂")
    assert len([i for i in ids if spm.backend.id_to_token(i).startswith("<0x")]) == 4
    d = IncrementalDetokenizer(spm)
    outs = [d.push([i]) for i in ids]
    assert outs[-4:] == ["", "", "", "🙂"]
    assert "".join(outs) + d.flush() == "a 🙂"


def test_flush_releases_an_incomplete_character(tok: Tokenizer) -> None:
    """Ids that end inside a character (a sequence cut by max_tokens): what is held comes out
    at flush, the incomplete bytes as U+FFFD, as the full decode has them."""
    ids = _ids(tok, TEXTS[0])
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    d = IncrementalDetokenizer(tok)
    held = d.push(ids[:cut])
    assert not held.endswith("\ufffd")
    rest = d.flush()
    assert rest.endswith("\ufffd")
    assert held + rest == tok.decode(ids[:cut])


def test_special_tokens_skipped_or_kept(smollm: Tokenizer) -> None:
    ids = smollm.encode(CHAT)
    for decoder, want in ((smollm, smollm.decode(ids)), (KeepSpecials(smollm), CHAT)):
        d = IncrementalDetokenizer(decoder)
        assert "".join(d.push([i]) for i in ids) + d.flush() == want
    assert "<|im_end|>" not in smollm.decode(ids)
    # A special token's text, when kept, ends the text as a stop string like any other.
    t = TextStream(KeepSpecials(smollm), stop_strings=("<|im_end|>",))
    outs = [t.push([i]) for i in ids]
    assert t.text == CHAT[:CHAT.find("<|im_end|>")]
    assert [stopped for _, stopped in outs].index(True) == ids.index(
        smollm.backend.token_to_id("<|im_end|>"))


# --- stop strings ---------------------------------------------------------------------------------


def _stops_of(text: str) -> list[str]:
    """Stop strings to try: characters and pairs (multi-byte ones too), and longer runs."""
    found = {text[i:i + n] for n in (1, 2, 5) for i in range(0, len(text) - n + 1, 3)}
    return sorted(s for s in found if s.strip())


def _within_one_token(tok: Tokenizer, ids: list[int], text: str, stop: str) -> bool:
    """Whether the first ``stop`` in ``text`` lies in the text of a single token."""
    start = text.find(stop)
    ends = [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]
    return any(ends[k] <= start and start + len(stop) <= ends[k + 1] for k in range(len(ids)))


@pytest.mark.parametrize("text", TEXTS)
def test_stop_strings_cut_as_a_full_text_search(tok: Tokenizer, text: str) -> None:
    ids = _ids(tok, text)
    across = 0
    for stop in _stops_of(text):
        across += not _within_one_token(tok, ids, text, stop)
        t = TextStream(tok, stop_strings=("never-there", stop))
        emitted, stopped_at = [], None
        for k, i in enumerate(ids):
            out, stopped = t.push([i])
            emitted.append(out)
            if stopped and stopped_at is None:
                stopped_at = k
        emitted.append(t.finish()[0])
        want = text[:text.find(stop)]
        assert "".join(emitted) == t.text == want, stop
        # It stopped at the token that completed the stop string, not later.
        assert stopped_at is not None
        assert stop in tok.decode(ids[:stopped_at + 1])
        assert stop not in tok.decode(ids[:stopped_at])
    assert across > 0  # some stop strings span token boundaries


def test_text_that_may_start_a_stop_string_is_held_back(smollm: Tokenizer) -> None:
    """``" Paris"`` could be the start of ``"Paris!"``: only the space goes out until ``"."``
    shows it is not; a stop string never found costs nothing at the end."""
    ids = _ids(smollm, " Paris. Rome")
    assert [smollm.decode([i]) for i in ids] == [" Paris", ".", " Rome"]
    t = TextStream(smollm, stop_strings=("Paris!", "Rome?"))
    assert [t.push([i]) for i in ids] == [(" ", False), ("Paris.", False), (" ", False)]
    assert t.finish() == ("Rome", False)
    assert t.text == " Paris. Rome"
