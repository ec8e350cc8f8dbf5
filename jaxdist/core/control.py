"""Per-step control: the typed header of a frame, which every stage reads and none forwards.

A step of a causal LM carries, per row, its KV-cache slot, position, true length and sampling
parameters. They are not activations: no stage computes them, and every stage may need them.
So they travel once per frame in its ``StepControl`` header (``jaxdist/proto/jaxdist.proto``),
which each worker forwards as it came, and a stage names the fields it reads in
``StageSpec.control``; the runtime binds them to those inputs. The tensors of a frame are only
what the previous stage computed.

Each field is a packed array of 4-byte values, so the header's bytes are little-endian arrays
that :func:`decode` reads in place:

    >>> import numpy as np
    >>> data = encode({"slot": [0, 3], "pos": np.array([5, 0]), "temperature": [0.0, 0.7]})
    >>> ctl = decode(data)
    >>> ctl["slot"].dtype, ctl["slot"].tolist(), bool(ctl["temperature"][1] == np.float32(0.7))
    (dtype('int32'), [0, 3], True)
    >>> split({"tokens": [[1, 2]], "slot": [0]}, ("slot", "pos"))[0]
    {'tokens': [[1, 2]]}
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxdist.core import protowire
from jaxdist.core.errors import CodecError, SpecError
from jaxdist.proto import jaxdist_pb2 as pb

__all__ = ["FIELDS", "check_control", "decode", "encode", "split"]

FIELDS: dict[str, str] = {"slot": "int32", "pos": "int32", "length": "int32",
                          "temperature": "float32", "top_k": "int32", "top_p": "float32",
                          "seed": "uint32"}
"""Field name -> dtype of each ``StepControl`` field (each value is one row of a step)."""


def _wire_dtype(name: str) -> np.dtype[Any]:
    """The field's dtype in wire byte order (little-endian; native on the usual machines)."""
    dtype = np.dtype(FIELDS[name])
    return dtype if sys.byteorder == "little" else dtype.newbyteorder("<")


_NUMBER = {f.name: f.number for f in pb.StepControl.DESCRIPTOR.fields}
_BY_NUMBER = {n: (name, _wire_dtype(name)) for name, n in _NUMBER.items()}
assert set(_NUMBER) == set(FIELDS), "FIELDS must name the StepControl fields of the proto"

_INT_RANGE = {"int32": (-(1 << 31), (1 << 31) - 1), "uint32": (0, (1 << 32) - 1)}


def encode(values: Mapping[str, Any]) -> bytes:
    """The serialized ``StepControl`` of one step: each value a 1-D array of rows.

    Raises:
        SpecError: an unknown field, a value that is not 1-D, or an integer out of its field's
            range; the message names the field.
    """
    out = []
    for name, value in values.items():
        number = _NUMBER.get(name)
        if number is None:
            raise SpecError(f"step control {name!r}: not a StepControl field; the fields are "
                            f"{', '.join(FIELDS)}")
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise SpecError(f"step control {name!r}: expected one value per row (1-D), found "
                            f"shape {arr.shape}")
        dtype = FIELDS[name]
        bounds = _INT_RANGE.get(dtype)
        if bounds is not None and arr.size:
            if arr.dtype.kind not in "iub":
                raise SpecError(f"step control {name!r}: expected integers ({dtype}), found "
                                f"{arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < bounds[0] or hi > bounds[1]:
                bad = lo if lo < bounds[0] else hi
                raise SpecError(f"step control {name!r}: {bad} is out of the range of {dtype}")
        data = arr.astype(_wire_dtype(name), copy=False).tobytes()
        out.append(protowire.field_prefix(number, len(data)) + data)
    return b"".join(out)


def decode(data: bytes | memoryview) -> dict[str, np.ndarray]:
    """The fields of a serialized ``StepControl``, as arrays (views of ``data`` when packed).

    Raises:
        CodecError: malformed bytes, or a packed field whose length is not a whole number of
            values.
    """
    view = memoryview(data)
    out: dict[str, np.ndarray] = {}
    try:
        for number, wire_type, _, value, end in protowire.fields(view):
            known = _BY_NUMBER.get(number)
            if known is None:
                continue  # a field of a newer jaxdist: not read here
            if wire_type != protowire.LEN:  # valid protobuf, not what jaxdist writes
                return _decode_unpacked(bytes(data))
            name, dtype = known
            if (end - value) % dtype.itemsize:
                raise CodecError(f"step control {name!r}: {end - value} bytes is not a whole "
                                 f"number of {dtype.itemsize}-byte values")
            if name in out:
                raise CodecError(f"step control {name!r}: field given twice")
            out[name] = np.frombuffer(view[value:end], dtype=dtype)
    except CodecError as exc:
        raise CodecError(f"malformed step control header ({len(view)} bytes): {exc}") from None
    return out


def _decode_unpacked(data: bytes) -> dict[str, np.ndarray]:
    try:
        msg = pb.StepControl.FromString(data)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise CodecError(f"malformed step control header ({len(data)} bytes): {exc}") from None
    return {name: np.asarray(getattr(msg, name), dtype=FIELDS[name])
            for name in FIELDS if len(getattr(msg, name))}


def split(inputs: Mapping[str, Any], names: Sequence[str]) -> tuple[dict[str, Any], bytes]:
    """A step's inputs as (the tensors of its frame, its serialized control header).

    ``names`` are the inputs the pipeline reads from the control header
    (``StageSpec.control``); the rest are tensors. Nothing is control when ``names`` is empty
    (a pipeline exported before the header existed).
    """
    if not names:
        return dict(inputs), b""
    tensors = {k: v for k, v in inputs.items() if k not in names}
    return tensors, encode({k: inputs[k] for k in names if k in inputs})


def check_control(name: str, dtype: str, dims: Sequence[object]) -> str | None:
    """Why an input cannot be read from the control header, or None when it can."""
    expected = FIELDS.get(name)
    if expected is None:
        return f"{name!r} is not a StepControl field ({', '.join(FIELDS)})"
    if dtype != expected:
        return f"control input {name!r} must be {expected}, found {dtype}"
    if len(dims) != 1:
        return f"control input {name!r} must have one axis (a value per row), found {len(dims)}"
    return None
