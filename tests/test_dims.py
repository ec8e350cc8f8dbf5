"""Dims that are expressions of symbols (``2*b``, ``b + 1``): jax.export writes them, a
StageSpec carries them, and a worker binds and checks them.

Before, a stage whose output was ``2*b`` exported, then was refused at LoadStage ("expected an
integer or a symbol name"). The end-to-end test runs such a model on real workers and compares
it with a single-process ``jax.jit`` of the same function.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.inprocess import InProcessPipeline
from jaxdist.core.dims import check_dim, evaluate, parse_dim, symbols_of
from jaxdist.core.errors import SpecError
from jaxdist.export.model import Model, Param, Unit

D = 32


# --- the dim language, against jax's own printer and parser


@pytest.mark.parametrize("make", [
    lambda b, s: 2 * b, lambda b, s: b + 1, lambda b, s: 3 - b, lambda b, s: b * s,
    lambda b, s: b // 2, lambda b, s: b % 3, lambda b, s: (b + 1) * (s + 2),
    lambda b, s: 2 * b // 3, lambda b, s: b * b * s - 2 * b * s + b,
], ids=["2b", "b+1", "3-b", "bs", "floordiv", "mod", "product", "floordiv-2b", "power"])
def test_every_expression_jax_prints_is_a_dim(make) -> None:
    """The text jax writes for a symbolic dim parses, and evaluates to what jax computes."""
    b, s = jax.export.symbolic_shape("b, s")
    expr = make(b, s)
    text = str(expr)
    assert check_dim(parse_dim(text)) is None, text
    assert symbols_of(text) <= {"b", "s"}
    for env in ({"b": 5, "s": 7}, {"b": 12, "s": 3}):
        # jax's own evaluation of the same expression is the reference (a private method:
        # jax has no public one; the python arithmetic below is a second reference).
        want = int(expr._evaluate(env))
        assert evaluate(text, env) == want == make(env["b"], env["s"]), text


def test_jax_max_min_parse() -> None:
    for text in ("max(b - 4, 0)", "min(b, 4)"):
        (expr,) = jax.export.symbolic_shape(text)
        assert check_dim(str(expr)) is None
    assert evaluate("max(b - 4, 0)", {"b": 2}) == 0 and evaluate("min(b, 4)", {"b": 9}) == 4


@pytest.mark.parametrize("bad, why", [
    ("b +", "it ends early"), ("", "it is empty"), ("2b", "unexpected 'b'"),
    ("foo(b)", "unknown function 'foo'"), ("max(b)", "max() takes 2 arguments, found 1"),
    ("b^9", "an exponent must be an integer from 1 to 8"), ("b\n", "whitespace"),
    ("(" * 40 + "b" + ")" * 40, "nested deeper than 32"), ("b + " * 100 + "1", "longer than 256"),
])
def test_bad_dims_say_why(bad: str, why: str) -> None:
    problem = check_dim(bad)
    assert problem is not None and problem.startswith("expected an integer or a symbol name")
    assert why in problem, problem
    assert len(problem) < 300  # a hostile dim is clipped


def test_evaluate_names_an_unbound_symbol() -> None:
    with pytest.raises(KeyError, match="s"):
        evaluate("b + s", {"b": 1})
    with pytest.raises(ValueError, match="divides by zero"):
        evaluate("floordiv(b, s)", {"b": 1, "s": 0})


# --- end to end: 2*b and 2*b + 1 between stages


def _double(p, st, c):  # (b, D) -> (2*b, D)
    x = c["x"] @ p["w"]
    return {"x": jnp.concatenate([x, 2 * x], axis=0)}, {}


def _pad_row(p, st, c):  # (2*b, D) -> (2*b + 1, D)
    x = jnp.tanh(c["x"] @ p["w"])
    return {"x": jnp.pad(x, ((0, 1), (0, 0)))}, {}


def _dense(p, st, c):  # (2*b + 1, D) -> (2*b + 1, D)
    return {"y": jnp.tanh(c["x"] @ p["w"])}, {}


def expression_model() -> Model:
    w = [Param(f"safetensors://mlp.safetensors#l{i}.w", (D, D)) for i in range(3)]
    return Model("dims", [Unit("double", _double, {"w": w[0]}),
                          Unit("pad", _pad_row, {"w": w[1]}),
                          Unit("dense", _dense, {"w": w[2]})],
                 inputs={"x": (f"b, {D}", "float32")}, buckets=[{"b": 2}],
                 any_shape=True)  # b=3 too: each stage solves b from another shape


def _reference(root: pathlib.Path, x: np.ndarray) -> np.ndarray:
    ws = load_file(str(root / "mlp.safetensors"))
    p = [{"w": ws[f"l{i}.w"]} for i in range(3)]

    @jax.jit
    def whole(x):
        (h,) = _double(p[0], {}, {"x": x})[0].values()
        (h,) = _pad_row(p[1], {}, {"x": h})[0].values()
        return _dense(p[2], {}, {"x": h})[0]["y"]
    return np.asarray(whole(x))


def test_expression_dims_between_stages_on_workers(cluster3: Cluster,
                                                   mlp_root: pathlib.Path) -> None:
    """Stage 1 takes ``2*b`` and stage 2 ``2*b + 1``: each worker solves ``b`` from its input
    and the result matches the single-process jit."""
    with cluster3.deploy(expression_model(), stages=3, platforms=("cpu",)) as pipe:
        assert [[str(d) for d in s.inputs[0].dims] for s in pipe.specs] == [
            ["b", str(D)], ["2*b", str(D)], ["2*b + 1", str(D)]]
        assert [str(d) for d in pipe.specs[2].outputs[0].dims] == ["2*b + 1", str(D)]
        for b in (2, 3):  # the bucket, and a shape compiled on first use
            x = np.random.default_rng(b).standard_normal((b, D)).astype(np.float32)
            out = pipe.call({"x": x})
            assert out["y"].shape == (2 * b + 1, D)
            np.testing.assert_allclose(out["y"], _reference(mlp_root, x), rtol=1e-5, atol=1e-5)


def test_expression_dims_in_process_and_a_shape_that_cannot_be_solved(
        mlp_root: pathlib.Path) -> None:
    with InProcessPipeline(expression_model(), weights_roots=[mlp_root], stages=3) as pipe:
        x = np.random.default_rng(0).standard_normal((2, D)).astype(np.float32)
        np.testing.assert_allclose(pipe.call({"x": x})["y"], _reference(mlp_root, x),
                                   rtol=1e-5, atol=1e-5)
        # 6 rows cannot be 2*b + 1: the stage names the input, the axis and the size.
        with pytest.raises(SpecError, match=r"^stage 2: input 'x': cannot solve symbol 'b' from "
                                            r"the axis '2\*b \+ 1' of size 6$"):
            pipe.stages[2].check_inputs({"x": np.zeros((6, D), np.float32)})
