"""llama.cpp as a reference for tests: its Python bindings, run in their own venv.

``bench/llamacpp.py --setup-only`` builds them in ``bench/.venv-llamacpp`` (``make test-slow``
does, before the slow tier); ``JAXDIST_LLAMACPP_PYTHON`` names another interpreter that has
``llama_cpp``. Tests that need it are in the slow tier and skip (a failure in CI) without it.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from typing import Any

import pytest

NEAR_TIE = 0.25  # logits, with quantized activations: see tests/test_quantized_llm.py
LLAMACPP = pathlib.Path(os.environ.get(
    "JAXDIST_LLAMACPP_PYTHON",
    pathlib.Path(__file__).parents[1] / "bench" / ".venv-llamacpp" / "bin" / "python"))

_LLAMACPP_SCRIPT = """
import ctypes, json, sys
import numpy as np
import llama_cpp

args = json.loads(sys.argv[1])
out = {}
if "texts" in args:
    vocab = llama_cpp.Llama(model_path=args["model"], vocab_only=True, verbose=False)
    out["ids"] = [vocab.tokenize(t.encode(), add_bos=True, special=True) for t in args["texts"]]
    msgs = args["chat"]
    arr = (llama_cpp.llama_chat_message * len(msgs))(*[
        llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode())
        for m in msgs])
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(b"gemma", arr, len(msgs), True, buf, len(buf))
    out["chat"] = buf.raw[:n].decode()
if "prompts" in args:
    # f32 KV cache, as jaxdist's (llama.cpp's default is f16); every position's logits kept.
    # One thread: ggml's threads spin at a barrier after every op, which on a loaded 2-core
    # machine made a 24-token run take 5 s instead of 0.5.
    llm = llama_cpp.Llama(model_path=args["model"], n_ctx=args["n_ctx"], n_batch=args["n_ctx"],
                          n_threads=1, logits_all=True, type_k=0, type_v=0, verbose=False)
    out["greedy"] = []
    for prompt in args["prompts"]:
        llm.reset()
        llm.eval(prompt)
        tokens, margins = [], []
        for _ in range(args["n_new"]):
            z = np.asarray(llm.scores[llm.n_tokens - 1], np.float64)
            top2 = np.sort(z)[-2:]
            tokens.append(int(np.argmax(z)))
            margins.append(float(top2[1] - top2[0]))
            llm.eval([tokens[-1]])
        text = (llm.detokenize(tokens).decode("utf-8", "replace")
                if args.get("text", True) else None)  # False: a file without a vocabulary
        out["greedy"].append({"tokens": tokens, "margins": margins, "text": text})
if "forced" in args:
    # Teacher-forced: each row of "forced" (prompt + continuation) evaluated in one batch; the
    # logits after the prompt (args["n_prompt"] tokens) and after each later token.
    llm = llama_cpp.Llama(model_path=args["model"], n_ctx=args["n_ctx"], n_batch=args["n_ctx"],
                          n_threads=1, logits_all=True, type_k=0, type_v=0, verbose=False)
    out["logits"] = []
    for tokens in args["forced"]:
        llm.reset()
        llm.eval(tokens)
        out["logits"].append([np.asarray(llm.scores[p], np.float64).tolist()
                              for p in range(args["n_prompt"] - 1, len(tokens))])
print(json.dumps(out))
"""


def llamacpp(**args: Any) -> dict[str, Any]:
    """Run the script with ``args`` in llama.cpp's venv; its JSON result. ``model`` and:
    ``texts`` and ``chat`` (tokenizer and chat template), ``prompts``, ``n_new`` and ``n_ctx``
    (greedy runs with their top-2 margins and text; ``text=False`` for a file without a
    vocabulary), or ``forced``, ``n_prompt`` and ``n_ctx``
    (teacher-forced logits)."""
    if not LLAMACPP.is_file():
        pytest.skip(f"llama.cpp's Python bindings are not built at {LLAMACPP} (python "
                    f"bench/llamacpp.py --setup-only builds them)")
    done = subprocess.run([str(LLAMACPP), "-c", _LLAMACPP_SCRIPT, json.dumps(args)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"llama.cpp reference failed:\n{done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def check_tokens(got: list[int], want: dict[str, Any], where: str) -> None:
    """``got`` equals llama.cpp's greedy ``want`` up to its first near-tie, and differs only
    where llama.cpp's top-2 margin was under NEAR_TIE."""
    tokens, margins = want["tokens"], want["margins"]
    first_tie = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(tokens))
    assert got[:first_tie] == tokens[:first_tie], f"{where}: {got} != llama.cpp {tokens}"
    diff = next((i for i, (a, b) in enumerate(zip(got, tokens)) if a != b), None)
    if diff is not None:
        assert margins[diff] < NEAR_TIE, (f"{where}: token {diff} differs ({got[diff]} vs "
                                          f"{tokens[diff]}) where llama.cpp's margin was "
                                          f"{margins[diff]:.3f}")
