"""jaxdist.core.weights: URIs, roots, GGUF/safetensors/raw readers and the WeightCache.

Test files are written with the formats' own writers (gguf.GGUFWriter, safetensors.numpy.save_file)
and expected values come from the independent references (gguf.quants, safetensors.safe_open).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as ref
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxdist.core import quant
from jaxdist.core.errors import JaxdistError, WeightError
from jaxdist.core.weights import (
    WeightCache,
    WeightInfo,
    WeightURI,
    describe_weights,
    parse_uri,
    resolve_weight,
    resolve_weight_bytes,
)
from jaxdist.core.weights import gguf as wgguf
from jaxdist.core.weights.gguf import GGUFFile
from jaxdist.core.weights.safetensors import SafetensorsFile
from jaxdist.core.weights.uri import resolve_path

RNG = np.random.default_rng(0)
F32 = RNG.standard_normal((4, 64)).astype(np.float32)
F16 = RNG.standard_normal((3, 32)).astype(np.float16)
BF16 = RNG.standard_normal((2, 3, 32)).astype(ml_dtypes.bfloat16)
Q_SRC = RNG.standard_normal((8, 64)).astype(np.float32)  # (out, in), non-square on purpose
QUANTIZED = {"q8": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1}
Q4K_SHAPE = (3, 512)


def _k_blocks(qtype: T, shape: tuple[int, ...], f16_offsets: tuple[int, ...]) -> np.ndarray:
    """Random valid blocks of a K-quant (gguf.quants cannot quantize these), finite f16 scales."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_elems
    blocks = np.random.default_rng(1).integers(0, 256, (n_blocks, block_bytes), np.uint8)
    for off in f16_offsets:
        blocks[:, off : off + 2] = np.full(n_blocks, 0.01, np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(shape[0], -1)


Q4K = _k_blocks(T.Q4_K, Q4K_SHAPE, (0, 2))
IQ4NL = _k_blocks(T.IQ4_NL, (2, 64), (0,))


def write_gguf(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "hello", "world"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.0, -2.0])
    w.add_tensor("f32", F32)
    w.add_tensor("f16", F16)
    w.add_tensor("bf16", BF16.view(np.uint8).reshape(2, 3, 64), raw_dtype=T.BF16)
    for name, qtype in QUANTIZED.items():
        w.add_tensor(name, ref.quantize(Q_SRC, qtype), raw_dtype=qtype)
    w.add_tensor("q4_k", Q4K, raw_dtype=T.Q4_K)
    w.add_tensor("iq4_nl", IQ4NL, raw_dtype=T.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


ST = {
    "f32": RNG.standard_normal((5, 7)).astype(np.float32),
    "f16": RNG.standard_normal((6,)).astype(np.float16),
    "bf16": RNG.standard_normal((4, 8)).astype(ml_dtypes.bfloat16),
    "i64": np.arange(-3, 9, dtype=np.int64).reshape(3, 4),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("root")
    write_gguf(root / "m.gguf")
    save_file(ST, str(root / "model.safetensors"))
    ckpt = root / "ckpt"
    ckpt.mkdir()
    save_file({"a": ST["f32"], "b": ST["i64"]}, str(ckpt / "model-00001-of-00002.safetensors"))
    save_file({"c": ST["bf16"]}, str(ckpt / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00001-of-00002.safetensors",
                                            "c": "model-00002-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    ST["f32"].tofile(root / "raw.bin")
    return root


@pytest.fixture
def cache(root: Path) -> Iterator[WeightCache]:
    with WeightCache([root]) as c:
        yield c


# -- URIs ---------------------------------------------------------------------------------------


def test_parse_uri() -> None:
    got = parse_uri("gguf://a/m.gguf#blk.0.attn_q.weight")
    assert got == WeightURI("gguf", "a/m.gguf", "blk.0.attn_q.weight")
    got = parse_uri("safetensors:///abs/x.safetensors#w")
    assert got == WeightURI("safetensors", "/abs/x.safetensors", "w")
    assert parse_uri("file://w.bin") == WeightURI("file", "w.bin", None)
    assert str(parse_uri("gguf://m.gguf#t")) == "gguf://m.gguf#t"


# -- GGUF ---------------------------------------------------------------------------------------


def test_gguf_plain_round_trip(cache: WeightCache) -> None:
    np.testing.assert_array_equal(cache.resolve("gguf://m.gguf#f32"), F32)
    f16 = cache.resolve("gguf://m.gguf#f16")
    assert f16.dtype == np.float16
    np.testing.assert_array_equal(f16, F16)
    bf16 = cache.resolve("gguf://m.gguf#bf16")
    assert bf16.dtype == ml_dtypes.bfloat16 and bf16.shape == (2, 3, 32)
    np.testing.assert_array_equal(bf16, BF16)


@pytest.mark.parametrize("name", [*QUANTIZED, "q4_k"])
def test_gguf_quantized_round_trip(cache: WeightCache, name: str) -> None:
    qtype = QUANTIZED.get(name, T.Q4_K)
    stored = ref.quantize(Q_SRC, qtype) if name in QUANTIZED else Q4K
    expected = ref.dequantize(stored, qtype)
    got = cache.resolve(f"gguf://m.gguf#{name}", dtype="float32")
    assert got.shape == expected.shape == ((8, 64) if name in QUANTIZED else Q4K_SHAPE)
    np.testing.assert_array_equal(got, expected)


def test_gguf_other_types_use_gguf_quants(cache: WeightCache) -> None:
    got = cache.resolve("gguf://m.gguf#iq4_nl")
    np.testing.assert_array_equal(got, ref.dequantize(IQ4NL, T.IQ4_NL))


def test_gguf_describe_reads_no_data(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: object, **_k: object) -> None:
        raise AssertionError("describe read tensor data")

    monkeypatch.setattr(GGUFFile, "read", boom)
    monkeypatch.setattr(GGUFFile, "stored_bytes", boom)
    monkeypatch.setattr(quant, "dequantize", boom)
    infos = describe_weights("m.gguf", roots=[root])
    assert list(infos)[:3] == ["f32", "f16", "bf16"]
    real = str(root.resolve() / "m.gguf")
    assert infos["f32"] == WeightInfo("f32", (4, 64), "float32", None, F32.nbytes, real)
    assert infos["bf16"] == WeightInfo("bf16", (2, 3, 32), "bfloat16", None, BF16.nbytes, real)
    assert infos["q4_1"] == WeightInfo("q4_1", (8, 64), "float32", "Q4_1", 8 * 2 * 20, real)
    assert infos["q4_k"].quant == "Q4_K" and infos["q4_k"].nbytes == Q4K.nbytes
    assert describe_weights("gguf://m.gguf", roots=[root]) == infos


def test_gguf_metadata(root: Path) -> None:
    meta = wgguf.metadata(root / "m.gguf")
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 2
    assert meta["tokenizer.ggml.tokens"] == ["<s>", "hello", "world"]
    assert meta["tokenizer.ggml.scores"] == [0.0, -1.0, -2.0]
    assert "GGUF.version" not in meta
    with WeightCache([root]) as cache:
        assert cache.metadata("m.gguf") == meta


# -- GGUF header parser: parity with gguf.GGUFReader (the independent reference) ----------------

V = gguf.GGUFValueType
# One value per GGUF value type (all but ARRAY), at the edge of its range.
EDGE = {
    V.UINT8: 255, V.INT8: -128, V.UINT16: 65535, V.INT16: -32768, V.UINT32: 2**32 - 1,
    V.INT32: -(2**31), V.FLOAT32: 0.1, V.BOOL: True, V.STRING: "héllo ✓", V.UINT64: 2**64 - 1,
    V.INT64: -(2**63), V.FLOAT64: 1 / 3,
}
NESTED = {"nested.ints": [[1, 2], [3]], "nested.strings": [["a"], ["b", "c"]],
          "nested.deep": [[[1]], [[2, 3], [4]]]}


def write_all_types_gguf(path: Path) -> None:
    """Every value type as a scalar and as an array, nested and large arrays, plain and
    quantized tensors (a 0-d one too), at a non-default alignment."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    for vtype, value in EDGE.items():
        zero = "" if vtype == V.STRING else False if vtype == V.BOOL else 0
        w.add_key_value(f"scalar.{vtype.name}", value, vtype)
        w.add_key_value(f"array.{vtype.name}", [value, zero, value], V.ARRAY, sub_type=vtype)
    for key, value in NESTED.items():
        w.add_key_value(key, value, V.ARRAY)
    w.add_key_value("array.large", list(range(-5000, 5000)), V.ARRAY, sub_type=V.INT32)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}·" * (i % 4) for i in range(20000)])
    rng = np.random.default_rng(2)
    for dtype in (np.float32, np.float16, np.float64, np.int8, np.int16, np.int32, np.int64):
        values = (rng.standard_normal((3, 5)) * 99).astype(dtype)
        w.add_tensor(f"plain.{np.dtype(dtype).name}", values)
    w.add_tensor("plain.scalar", np.array(1.5, np.float32))
    w.add_tensor("plain.bf16", BF16.view(np.uint8).reshape(2, 3, 64), raw_dtype=T.BF16)
    for qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        w.add_tensor(f"quant.{qtype.name}", ref.quantize(Q_SRC, qtype), raw_dtype=qtype)
    w.add_tensor("quant.Q4_K", Q4K, raw_dtype=T.Q4_K)
    w.add_tensor("quant.IQ4_NL", IQ4NL, raw_dtype=T.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _flatten(value: Any) -> Any:
    """GGUFReader flattens arrays of arrays (a FIXME in gguf-py); GGUFFile keeps the nesting."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [x for item in value for x in _flatten(item)]
    return value


def assert_matches_reader(path: Path, reader: gguf.GGUFReader | None = None) -> GGUFFile:
    """GGUFFile's metadata, tensor infos and tensor bytes equal gguf.GGUFReader's."""
    reader = reader or gguf.GGUFReader(str(path))
    f = GGUFFile(path)
    meta = f.metadata()
    ref_meta = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(meta) == list(ref_meta)
    # repr, not ==: a bool must stay a bool and a float a float, in scalars and inside lists
    assert repr({k: _flatten(v) for k, v in meta.items()}) == repr(ref_meta)
    infos = f.describe()
    got = [(n, i.shape, f._tensors[n].ggml_type, f._tensors[n].offset, i.nbytes)
           for n, i in infos.items()]
    want = [(t.name, tuple(reversed(t.shape.tolist())), t.tensor_type, t.data_offset, t.n_bytes)
            for t in reader.tensors]
    assert got == want
    for t in reader.tensors:
        raw = f.stored_bytes(t.name)
        assert raw.dtype == np.uint8 and raw.ndim == 1
        np.testing.assert_array_equal(raw, t.data.reshape(-1).view(np.uint8))
        if t.data.dtype != np.uint8:  # the types GGUFReader decodes itself
            assert f.read(t.name).dtype == t.data.dtype
            np.testing.assert_array_equal(f.read(t.name), t.data)
    return f


def test_gguf_header_matches_reader(root: Path, tmp_path: Path) -> None:
    write_all_types_gguf(tmp_path / "all.gguf")
    f = assert_matches_reader(tmp_path / "all.gguf")
    meta = f.metadata()
    for vtype, value in EDGE.items():
        want = float(np.float32(value)) if vtype == V.FLOAT32 else value
        assert meta[f"scalar.{vtype.name}"] == want
    assert {k: meta[k] for k in NESTED} == NESTED
    assert f._header.alignment == 64
    assert all(t.offset % 64 == 0 for t in f._tensors.values())
    assert_matches_reader(root / "m.gguf")


def test_gguf_header_v2_matches_reader(tmp_path: Path) -> None:
    write_all_types_gguf(tmp_path / "v3.gguf")
    data = bytearray((tmp_path / "v3.gguf").read_bytes())
    struct.pack_into("<I", data, 4, 2)  # v2 has the v3 layout; v3 only added big-endian files
    (tmp_path / "v2.gguf").write_bytes(data)
    assert assert_matches_reader(tmp_path / "v2.gguf")._header.version == 2


def test_gguf_header_matches_reader_smollm2(smollm2: Path) -> None:
    start = time.perf_counter()
    reader = gguf.GGUFReader(str(smollm2))
    t_reader = time.perf_counter() - start
    start = time.perf_counter()
    meta = wgguf.metadata(smollm2)
    t_ours = time.perf_counter() - start
    f = assert_matches_reader(smollm2, reader)
    assert len(meta["tokenizer.ggml.tokens"]) == meta["llama.vocab_size"] == len(
        reader.fields["tokenizer.ggml.tokens"].data)
    assert len(f.names()) == len(reader.tensors)
    # the point of the parser: GGUFReader builds numpy objects per tokenizer entry (seconds)
    assert t_ours * 5 < t_reader, f"open+metadata {t_ours:.3f}s vs GGUFReader {t_reader:.3f}s"


# -- safetensors --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ST))
def test_safetensors_round_trip(cache: WeightCache, root: Path, name: str) -> None:
    got = cache.resolve(f"safetensors://model.safetensors#{name}")
    assert got.dtype == ST[name].dtype and got.shape == ST[name].shape
    np.testing.assert_array_equal(got, ST[name])
    if name != "bf16":  # the independent reader
        with safe_open(str(root / "model.safetensors"), framework="numpy") as f:
            np.testing.assert_array_equal(got, f.get_tensor(name))


def test_safetensors_sharded(cache: WeightCache, root: Path) -> None:
    for uri in ("safetensors://ckpt#c", "safetensors://ckpt/model.safetensors.index.json#c"):
        np.testing.assert_array_equal(cache.resolve(uri), ST["bf16"])
    np.testing.assert_array_equal(cache.resolve("safetensors://ckpt#b"), ST["i64"])
    infos = cache.describe("ckpt")
    assert sorted(infos) == ["a", "b", "c"]
    assert infos["c"].path.endswith("model-00002-of-00002.safetensors")
    assert infos["b"] == WeightInfo("b", (3, 4), "int64", None, 96, infos["a"].path)


def test_safetensors_describe_reads_no_data(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: object, **_k: object) -> None:
        raise AssertionError("describe read tensor data")

    monkeypatch.setattr(SafetensorsFile, "stored_bytes", boom)
    monkeypatch.setattr(SafetensorsFile, "read", boom)
    infos = describe_weights("model.safetensors", roots=[root])
    assert infos["bf16"].dtype == "bfloat16" and infos["bf16"].shape == (4, 8)
    assert infos["f16"].nbytes == 12 and infos["i64"].quant is None


# -- file:// ------------------------------------------------------------------------------------


def test_raw_file_round_trip(cache: WeightCache) -> None:
    got = cache.resolve("file://raw.bin", dtype="float32", shape=(5, 7))
    np.testing.assert_array_equal(got, ST["f32"])


# -- the cache ----------------------------------------------------------------------------------


def test_parse_once(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real_parse = wgguf._parse_header

    def counting(buf: memoryview, path: str) -> object:
        opened.append(path)
        return real_parse(buf, path)

    monkeypatch.setattr(wgguf, "_parse_header", counting)
    with WeightCache([root]) as cache:
        uris = [f"gguf://m.gguf#{n}" for n in ("f32", "q8", "q4_1", "q4_k")] * 4
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(cache.resolve, uris))
        cache.resolve_bytes("gguf://m.gguf#q8")
        cache.describe("m.gguf")
        cache.resolve("safetensors://model.safetensors#f32")
        cache.resolve("safetensors://model.safetensors#i64")
        assert len(opened) == 1
        assert sorted(Path(p).name for p in cache.open_files()) == ["m.gguf", "model.safetensors"]


@pytest.mark.parametrize("uri", ["gguf://m.gguf#q4_1", "gguf://m.gguf#q4_k", "gguf://m.gguf#bf16",
                                 "safetensors://model.safetensors#f16"])
def test_packed_bytes_round_trip(cache: WeightCache, uri: str) -> None:
    raw, info = cache.resolve_bytes(uri)
    assert raw.dtype == np.uint8 and raw.nbytes == info.nbytes
    assert raw.shape == quant.packed_shape(info.storage_type, info.shape)
    np.testing.assert_array_equal(
        quant.dequantize(raw, info.storage_type, info.shape), cache.resolve(uri, dtype="float32")
    )
    assert resolve_weight_bytes(uri, roots=cache.roots)[1] == info


def test_load_transpose_and_cast(cache: WeightCache) -> None:
    expected = ref.dequantize(ref.quantize(Q_SRC, T.Q8_0), T.Q8_0)
    got = cache.load(
        "gguf://m.gguf#q8", param="wq", shape=(64, 8), dtype="bfloat16", transpose=True
    )
    assert got.dtype == ml_dtypes.bfloat16 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, expected.T.astype(ml_dtypes.bfloat16))
    f32 = cache.load("gguf://m.gguf#f32", param="w", shape=(64, 4), dtype="float32", transpose=True)
    assert f32.flags.c_contiguous
    np.testing.assert_array_equal(f32, F32.T)
    uri = "safetensors://model.safetensors#i64"
    ids = cache.load(uri, param="ids", shape=(3, 4), dtype="int32")
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, ST["i64"])
    raw = cache.load("file://raw.bin", param="r", shape=(7, 5), dtype="float32", transpose=True)
    np.testing.assert_array_equal(raw, ST["f32"].T)


def test_load_packed_and_checksum(cache: WeightCache) -> None:
    raw, info = cache.resolve_bytes("gguf://m.gguf#q4_1")
    digest = hashlib.sha256(raw.tobytes()).hexdigest()
    got = cache.load("gguf://m.gguf#q4_1", param="w", shape=(8, 40), dtype="uint8", packed=True,
                     quant="Q4_1", sha256=digest.upper())
    np.testing.assert_array_equal(got, raw)
    resolved = resolve_weight("gguf://m.gguf#q4_1", roots=cache.roots, shape=(8, 64))
    np.testing.assert_array_equal(quant.dequantize(got, info.storage_type, info.shape), resolved)


def test_symlink_inside_roots_is_followed(root: Path, tmp_path: Path) -> None:
    (tmp_path / "link.gguf").symlink_to(root / "m.gguf")
    got = resolve_weight("gguf://link.gguf#f32", roots=[tmp_path, root])
    np.testing.assert_array_equal(got, F32)


def test_relative_paths_try_roots_in_order(root: Path, tmp_path: Path) -> None:
    assert resolve_path("m.gguf", [tmp_path, root]) == (root / "m.gguf").resolve()


# -- errors -------------------------------------------------------------------------------------


def test_error_weight_error_is_jaxdist_error() -> None:
    assert issubclass(WeightError, JaxdistError)


def test_error_bad_scheme(cache: WeightCache) -> None:
    msg = (
        r"weight URI 'hdf5://m.h5#w': expected a scheme of gguf://, safetensors://, file://, "
        r"found scheme 'hdf5'"
    )
    with pytest.raises(WeightError, match=msg):
        cache.resolve("hdf5://m.h5#w")
    with pytest.raises(WeightError, match="found no scheme"):
        parse_uri("m.gguf#w")


def test_error_missing_tensor_name(cache: WeightCache) -> None:
    with pytest.raises(WeightError, match=r"weight URI 'gguf://m.gguf' names no tensor"):
        cache.resolve("gguf://m.gguf")


def test_error_missing_file(cache: WeightCache, root: Path) -> None:
    msg = r"weight 'gguf://nope.gguf#w': file not found; looked for .*nope.gguf"
    with pytest.raises(WeightError, match=msg):
        cache.resolve("gguf://nope.gguf#w")


def test_error_missing_tensor(cache: WeightCache) -> None:
    msg = r"tensor 'q4_2' not found in GGUF file .*m.gguf.*close matches: .*'q4_0'"
    with pytest.raises(WeightError, match=msg):
        cache.resolve("gguf://m.gguf#q4_2")
    with pytest.raises(WeightError, match=r"tensor 'zz' is not in the weight_map"):
        cache.resolve("safetensors://ckpt#zz")


def test_error_absolute_path_outside_roots(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "m.gguf"
    outside.write_bytes((root / "m.gguf").read_bytes())
    with pytest.raises(WeightError, match=r"resolves to .* which is outside the weight roots"):
        resolve_weight(f"gguf://{outside}#f32", roots=[root])


def test_error_dotdot_outside_roots(root: Path, tmp_path: Path) -> None:
    inner = tmp_path / "inner"
    inner.mkdir()
    (tmp_path / "m.gguf").write_bytes((root / "m.gguf").read_bytes())  # exists, but outside
    msg = (
        r"weight 'gguf://\.\./m.gguf#f32': path '\.\./m.gguf' resolves to .* outside the "
        r"weight roots"
    )
    with pytest.raises(WeightError, match=msg):
        resolve_weight("gguf://../m.gguf#f32", roots=[inner])


def test_error_escaping_symlink(root: Path, tmp_path: Path) -> None:
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "escape.gguf").symlink_to(root / "m.gguf")
    msg = r"outside the weight roots .*links must not point outside"
    with pytest.raises(WeightError, match=msg):
        resolve_weight("gguf://escape.gguf#f32", roots=[inner])


def test_error_shard_outside_roots(root: Path, tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": os.path.relpath(root / "model.safetensors", tmp_path)}})
    )
    with pytest.raises(WeightError, match="outside the weight roots"):
        resolve_weight("safetensors://model.safetensors.index.json#w", roots=[tmp_path])


def test_error_no_roots() -> None:
    with pytest.raises(WeightError, match=r"no weight roots are configured.*pass --weights-root"):
        WeightCache([]).resolve("gguf://m.gguf#f32")


def test_error_shape_mismatch(cache: WeightCache) -> None:
    msg = "weight 'gguf://m.gguf#f16': shape mismatch: expected (32, 3), found (3, 32)"
    with pytest.raises(WeightError, match=re.escape(msg)):
        cache.resolve("gguf://m.gguf#f16", shape=(32, 3))
    msg = "weight 'blocks.0.wq' (gguf://m.gguf#q8): shape mismatch: expected (8, 8), found (8, 64)"
    with pytest.raises(WeightError, match=re.escape(msg)):
        cache.load("gguf://m.gguf#q8", param="blocks.0.wq", shape=(8, 8), dtype="float32")
    msg = "shape mismatch: expected (8, 64), found (64, 8) (stored (8, 64), transpose=True)"
    with pytest.raises(WeightError, match=re.escape(msg)):
        cache.load("gguf://m.gguf#q8", param="w", shape=(8, 64), dtype="float32", transpose=True)
    msg = "shape mismatch: expected (8, 64), found (8, 40)"
    with pytest.raises(WeightError, match=re.escape(msg)):
        cache.load("gguf://m.gguf#q4_1", param="w", shape=(8, 64), dtype="uint8", packed=True)


def test_error_packed_quant_mismatch(cache: WeightCache) -> None:
    msg = "weight 'blk.wk' (gguf://m.gguf#q4_1): quant mismatch: expected Q8_0, found Q4_1"
    with pytest.raises(WeightError, match=re.escape(msg)):
        cache.load(
            "gguf://m.gguf#q4_1", param="blk.wk", shape=(8, 40), dtype="uint8", packed=True,
            quant="Q8_0",
        )


def test_error_packed_dtype_mismatch(cache: WeightCache) -> None:
    msg = r"dtype mismatch: expected float32, found uint8 \(a packed weight"
    with pytest.raises(WeightError, match=msg):
        cache.load("gguf://m.gguf#q4_1", param="w", shape=(8, 40), dtype="float32", packed=True)


def test_error_packed_unsupported_type(cache: WeightCache) -> None:
    msg = r"cannot bind packed: stored type IQ4_NL has no in-graph dequantizer"
    with pytest.raises(WeightError, match=msg):
        cache.load("gguf://m.gguf#iq4_nl", param="w", shape=(2, 36), dtype="uint8", packed=True)


def test_error_float_to_int(cache: WeightCache) -> None:
    msg = r"weight 'w' \(gguf://m.gguf#f32\): dtype mismatch: expected int64, found float32"
    with pytest.raises(WeightError, match=msg):
        cache.load("gguf://m.gguf#f32", param="w", shape=(4, 64), dtype="int64")


def test_error_int_out_of_range(cache: WeightCache) -> None:
    with pytest.raises(WeightError, match=r"expected uint8, found int64 values in \[-3, 8\]"):
        cache.resolve("safetensors://model.safetensors#i64", dtype="uint8")


def test_error_raw_size_mismatch(cache: WeightCache) -> None:
    msg = (
        "raw weight 'file://raw.bin': size mismatch: expected 280 bytes (float64 (5, 7)), "
        "found 140 bytes"
    )
    with pytest.raises(WeightError, match=re.escape(msg)):
        cache.load("file://raw.bin", param="w", shape=(5, 7), dtype="float64")


def test_error_raw_needs_shape_and_dtype(cache: WeightCache) -> None:
    with pytest.raises(WeightError, match=r"file:// weight needs its shape and dtype"):
        cache.resolve("file://raw.bin")


def test_error_checksum_mismatch(cache: WeightCache) -> None:
    bad = "0" * 64
    msg = (
        rf"weight 'w' \(gguf://m.gguf#f32\): checksum mismatch: expected sha256 {bad}, found "
        rf"[0-9a-f]{{64}}"
    )
    with pytest.raises(WeightError, match=msg):
        cache.load("gguf://m.gguf#f32", param="w", shape=(4, 64), dtype="float32", sha256=bad)
    with pytest.raises(WeightError, match="sha256 must be 64 hex digits"):
        cache.load("gguf://m.gguf#f32", param="w", shape=(4, 64), dtype="float32", sha256="abc")


def test_error_not_gguf(root: Path) -> None:
    with pytest.raises(WeightError, match=r"GGUF file .*raw.bin' could not be read"):
        resolve_weight("gguf://raw.bin#w", roots=[root])


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A small GGUF file's bytes, to corrupt: three keys, two tensors with equal-length names."""
    path = tmp_path_factory.mktemp("small") / "s.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", ["<s>", "hello", "wörld"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.0, -2.0])
    w.add_uint32("llama.block_count", 2)
    w.add_tensor("tensor.q80", ref.quantize(Q_SRC, T.Q8_0), raw_dtype=T.Q8_0)
    w.add_tensor("tensor.f32", F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _after_name(data: bytes, name: str) -> int:
    """Offset just past a key's or tensor's name (its u64 length, then its bytes) in ``data``."""
    raw = name.encode()
    return data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)


def _patched(tmp_path: Path, data: bytes, at: int, fmt: str, value: Any) -> Path:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    (tmp_path / "bad.gguf").write_bytes(out)
    return tmp_path / "bad.gguf"


def _gguf_error(path: Path, message: str) -> None:
    """Opening ``path`` raises WeightError: "GGUF file '<path>' could not be read: <message>"."""
    with pytest.raises(WeightError, match=re.escape(f"GGUF file '{path}' could not be read: ")
                       + message):
        GGUFFile(path)


def test_error_gguf_bad_magic(tmp_path: Path, small: bytes) -> None:
    path = _patched(tmp_path, small, 0, "4s", b"GGUX")
    _gguf_error(path, re.escape("bad magic b'GGUX' at offset 0, expected b'GGUF'; expected a "
                                "GGUF v2/v3 file (check the file is complete and really GGUF)"))


def test_error_gguf_truncated(tmp_path: Path, small: bytes) -> None:
    strings = _after_name(small, "tokenizer.ggml.tokens") + 4 + 4 + 8  # type, item type, count
    (tmp_path / "cut.gguf").write_bytes(small[: strings + 9])
    _gguf_error(tmp_path / "cut.gguf", re.escape(
        f"truncated or corrupt header: reading the 3 strings of the value of key "
        f"'tokenizer.ggml.tokens' needs 24 bytes at offset {strings}, but the file has only "
        f"{strings + 9} bytes; expected a GGUF v2/v3 file (check the file is complete"))
    third = small.index("wörld".encode())
    (tmp_path / "cut.gguf").write_bytes(small[: third + 2])
    _gguf_error(tmp_path / "cut.gguf", re.escape(
        f"truncated or corrupt header: reading the value of key 'tokenizer.ggml.tokens'[2] "
        f"needs 6 bytes at offset {third}, but the file has only {third + 2} bytes"))
    (tmp_path / "empty.gguf").write_bytes(b"")
    _gguf_error(tmp_path / "empty.gguf", re.escape(
        "truncated or corrupt header: reading the magic needs 4 bytes at offset 0, but the file "
        "has only 0 bytes"))
    whole = GGUFFile(_patched(tmp_path, small, 0, "4s", b"GGUF"))
    end = max(t.offset + t.nbytes for t in whole._tensors.values())
    for cut in range(end):  # every cut, in the header or the data, is caught and explained
        (tmp_path / "cut.gguf").write_bytes(small[:cut])
        _gguf_error(tmp_path / "cut.gguf",
                    rf"(truncated or corrupt header: .* but the file has only {cut} bytes"
                    rf"|tensor '.*' \(.*\) needs bytes \[\d+, \d+\), but the file has only "
                    rf"{cut} bytes)")


def test_error_gguf_bad_version(tmp_path: Path, small: bytes) -> None:
    _gguf_error(_patched(tmp_path, small, 4, "<I", 1), re.escape(
        "unsupported GGUF version 1, expected one of (2, 3); convert the file with a current "
        "llama.cpp"))


def test_error_gguf_big_endian(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "be.gguf"), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_tensor("a", np.ones(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    msg = "is big-endian; expected little-endian, found the opposite byte order; convert it"
    with pytest.raises(WeightError, match=re.escape(f"GGUF file '{tmp_path / 'be.gguf'}' {msg}")):
        GGUFFile(tmp_path / "be.gguf")


def test_error_gguf_unknown_value_type(tmp_path: Path, small: bytes) -> None:
    at = _after_name(small, "llama.block_count")
    _gguf_error(_patched(tmp_path, small, at, "<I", 13), re.escape(
        "the value of key 'llama.block_count' has unknown value type 13; expected 0..12 (UINT8, "))
    at = _after_name(small, "tokenizer.ggml.tokens") + 4
    _gguf_error(_patched(tmp_path, small, at, "<I", 99), re.escape(
        "the value of key 'tokenizer.ggml.tokens' has unknown element type 99; expected 0..12"))


@pytest.mark.parametrize(("where", "fmt", "value", "message"), [
    ("tensor count", "<Q", 2**64 - 1, "reading 18446744073709551615 tensor infos needs"),
    ("kv count", "<Q", 2**63, "reading 9223372036854775808 key/value pairs needs"),
    ("key length", "<Q", 2**64 - 1, "reading the name of key #0 needs 18446744073709551615 "),
    ("strings", "<Q", 2**62, "reading the 4611686018427387904 strings of the value of key "
                             "'tokenizer.ggml.tokens' needs 36893488147419103232 bytes"),
    ("string length", "<Q", 2**63, "reading the value of key 'tokenizer.ggml.tokens'[0] needs "
                                   "9223372036854775808 bytes"),
    ("floats", "<Q", 2**61, "reading the 2305843009213693952 FLOAT32 elements of the value of "
                            "key 'tokenizer.ggml.scores' needs 9223372036854775808 bytes"),
    ("n_dims", "<I", 2**32 - 1, "reading the 4294967295 dims of tensor 'tensor.f32' needs"),
])
def test_error_gguf_hostile_count(tmp_path: Path, small: bytes, where: str, fmt: str,
                                  value: int, message: str) -> None:
    at = {"tensor count": 8, "kv count": 16, "key length": 24,
          "strings": _after_name(small, "tokenizer.ggml.tokens") + 8,
          "string length": _after_name(small, "tokenizer.ggml.tokens") + 16,
          "floats": _after_name(small, "tokenizer.ggml.scores") + 8,
          "n_dims": _after_name(small, "tensor.f32")}[where]
    # a count is checked against the file size before any loop or allocation
    _gguf_error(_patched(tmp_path, small, at, fmt, value),
                "truncated or corrupt header: " + re.escape(message))


def test_error_gguf_tensor_past_end(tmp_path: Path, small: bytes) -> None:
    at = _after_name(small, "tensor.f32") + 4 + 2 * 8 + 4  # n_dims, 2 dims, type -> offset
    data_start = GGUFFile(_patched(tmp_path, small, 0, "4s", b"GGUF"))._header.data_offset
    begin = data_start + 2**40
    _gguf_error(_patched(tmp_path, small, at, "<Q", 2**40), re.escape(
        f"tensor 'tensor.f32' (F32, shape (4, 64)) needs bytes [{begin}, {begin + 1024}), but "
        f"the file has only {len(small)} bytes"))


def test_error_gguf_bad_tensor_type(tmp_path: Path, small: bytes) -> None:
    at = _after_name(small, "tensor.f32") + 4 + 2 * 8
    _gguf_error(_patched(tmp_path, small, at, "<I", 99),
                re.escape("tensor 'tensor.f32' has unknown GGML type 99; the file may need"))
    at = _after_name(small, "tensor.q80") + 4  # ne0
    _gguf_error(_patched(tmp_path, small, at, "<Q", 33), re.escape(
        "tensor 'tensor.q80' (Q8_0, shape (8, 33)) has rows of 33 elements, expected a multiple "
        "of the Q8_0 block size 32"))


def test_error_gguf_bad_utf8(tmp_path: Path, small: bytes) -> None:
    at = small.index("wörld".encode())
    _gguf_error(_patched(tmp_path, small, at, "B", 0xFF), re.escape(
        f"the value of key 'tokenizer.ggml.tokens'[2] at offset {at} is not valid UTF-8 "
        f"(invalid start byte)"))
    at = small.index(b"llama.block_count")
    _gguf_error(_patched(tmp_path, small, at, "B", 0xFF),
                r"the name of key #\d+ at offset \d+ is not valid UTF-8")


def test_error_gguf_duplicate(tmp_path: Path, small: bytes) -> None:
    at = small.index(b"tensor.q80")
    _gguf_error(_patched(tmp_path, small, at, "10s", b"tensor.f32"),
                re.escape("tensor 'tensor.f32' appears twice"))
    at = small.index(b"tokenizer.ggml.scores")
    _gguf_error(_patched(tmp_path, small, at, "21s", b"tokenizer.ggml.tokens"),
                re.escape("key 'tokenizer.ggml.tokens' appears twice (the second time as key #"))


@pytest.mark.parametrize(("vtype", "value"), [(V.UINT32, 48), (V.UINT32, 0), (V.UINT64, 64)])
def test_error_gguf_bad_alignment(tmp_path: Path, vtype: gguf.GGUFValueType, value: int) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    w.add_key_value("general.alignment", value, vtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    _gguf_error(tmp_path / "a.gguf", re.escape(
        f"'general.alignment' is {value} ({vtype.name}), expected a UINT32 power of two"))


def test_error_gguf_deep_nesting(tmp_path: Path) -> None:
    value: Any = [1]
    for _ in range(8):
        value = [value]
    w = gguf.GGUFWriter(str(tmp_path / "deep.gguf"), "llama")
    w.add_key_value("deep", value, V.ARRAY)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    _gguf_error(tmp_path / "deep.gguf", re.escape(
        "the value of key 'deep'[0][0][0][0][0][0][0][0] nests arrays more than 8 deep"))


def test_error_gguf_random_corruption(tmp_path: Path, small: bytes) -> None:
    """Random bytes in the header: a WeightError or a consistent file, never anything else."""
    rng = np.random.default_rng(7)
    header_end = small.index(struct.pack("<Q", 10) + b"tensor.f32") + 64
    opened = 0
    for _ in range(400):
        out = bytearray(small)
        for at in rng.integers(4, header_end, rng.integers(1, 4)):
            out[at] = rng.integers(0, 256)
        (tmp_path / "fuzz.gguf").write_bytes(out)
        try:
            f = GGUFFile(tmp_path / "fuzz.gguf")
        except WeightError as exc:
            assert str(exc).startswith(f"GGUF file '{tmp_path / 'fuzz.gguf'}' ")
            continue
        opened += 1
        f.metadata()
        for name, info in f.describe().items():
            assert f.stored_bytes(name).nbytes == info.nbytes
    assert 0 < opened < 400  # both outcomes were exercised


def test_error_truncated_safetensors(tmp_path: Path) -> None:
    save_file({"w": np.zeros((64,), np.float32)}, str(tmp_path / "t.safetensors"))
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[:-8])
    msg = r"is malformed: tensor 'w' \(float32 \(64,\)\): expected 256 bytes within 248"
    with pytest.raises(WeightError, match=msg):
        describe_weights("t.safetensors", roots=[tmp_path])


def test_error_closed_cache(root: Path) -> None:
    cache = WeightCache([root])
    cache.close()
    with pytest.raises(WeightError, match="WeightCache is closed"):
        cache.resolve("gguf://m.gguf#f32")
