"""Small models for the worker and coordinator tests (not LLMs)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxdist.export.model import Model, Param, Unit

D = 32


def _dense(params, state, carry):
    return {"x": jnp.tanh(carry["x"] @ params["w"])}, {}


def mlp(n_layers: int = 4, d: int = D, name: str = "mlp", any_shape: bool = True) -> Model:
    """An MLP whose weights live in ``mlp.safetensors`` under the weights root.

    Its bucket, ``b=4``, is compiled when it loads; ``any_shape`` (the default here, since the
    tests send many batch sizes) lets it take other batch sizes too, each compiled on first
    use. ``any_shape=False``: a frame of another batch size is refused."""
    units = [Unit(f"l{i}", _dense, {"w": Param(f"safetensors://mlp.safetensors#l{i}.w", (d, d))})
             for i in range(n_layers)]
    return Model(name, units, inputs={"x": ("b, %d" % d, "float32")}, buckets=[{"b": 4}],
                 any_shape=any_shape)


def save_mlp_weights(root, d: int = D, seed: int = 1234, n_layers: int = 4) -> None:
    """``root/mlp.safetensors``: ``n_layers`` random (d, d) layers ``l0.w`` ... for :func:`mlp`."""
    rng = np.random.default_rng(seed)
    save_file({f"l{i}.w": (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)
               for i in range(n_layers)}, str(root / "mlp.safetensors"))


def mlp_reference(root, x: np.ndarray, n_layers: int = 4) -> np.ndarray:
    """The same MLP in plain numpy, from the file read independently."""
    ws = load_file(str(root / "mlp.safetensors"))
    for i in range(n_layers):
        x = np.tanh(x @ ws[f"l{i}.w"])
    return x


def mlp_jit(root, model: Model):
    """The units of ``model`` (an :func:`mlp`) in one process under one ``jax.jit``: the
    single-process reference of a deployed pipeline."""
    import jax

    ws = load_file(str(root / "mlp.safetensors"))

    def whole(x):
        carry = {"x": x}
        for i, unit in enumerate(model.units):
            carry, _ = unit.fn({"w": ws[f"l{i}.w"]}, {}, carry)
        return carry["x"]

    return jax.jit(whole)


def save_tiny_llama(path, *, layers: int = 4, vocab: int = 256, hidden: int = 64,
                    intermediate: int = 128, init: float = 0.1):
    """A small random Llama from transformers (seed 0), saved as safetensors in directory
    ``path`` without a tokenizer; returns the transformers model, the reference."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden,
                                      intermediate_size=intermediate, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      initializer_range=init, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _accumulate(params, state, carry):
    total = state["acc"] + carry["x"].sum(axis=0)
    return {"x": carry["x"], "total": total}, {"acc": total}


def _passthrough(params, state, carry):
    total = state["acc"] + carry["total"]
    return {"total": total}, {"acc": total}


def accumulator(d: int = 4) -> Model:
    """Two stateful units: each keeps a running sum, so a session's output depends on its past."""
    return Model("acc", [Unit("a", _accumulate, state={"acc": ((d,), "float32")}),
                         Unit("b", _passthrough, state={"acc": ((d,), "float32")})],
                 inputs={"x": ("b, %d" % d, "float32")})


def _identity(params, state, carry):
    return {"x": carry["x"] + 0}, {}


def identity(n_units: int, dims: str = "b, n", dtype: str = "float32") -> Model:
    """Units that pass the activation through: for transport tests and benchmarks."""
    return Model("identity", [Unit(f"id{i}", _identity) for i in range(n_units)],
                 inputs={"x": (dims, dtype)})
