"""Where an exporter's weights come from: a GGUF file or an HF directory, read for headers only.

Shared by the exporters: :func:`open_source` finds the file under the weight roots and reads its
tensor table and metadata (never the data), from every part of a split GGUF; :class:`WeightTable` turns logical weight names into
:class:`~jaxdist.export.model.Param` URIs, checking each tensor's shape against the model config.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxdist.core.errors import SpecError
from jaxdist.core.kernels import KERNEL_TYPES
from jaxdist.core.weights import WeightCache, WeightInfo
from jaxdist.export.model import Param
from jaxdist.export.plugins import Headers

__all__ = ["Headers", "Source", "WeightTable", "open_source"]

Roots = Sequence[str | os.PathLike[str]]

log = logging.getLogger(__name__)


class Source:
    """A model's files: ``scheme`` is ``"gguf"`` or ``"safetensors"``.

    Attributes:
        path: the path as given (relative to a root, or absolute): URIs keep it as is.
        metadata: GGUF key/values (empty for HF directories).
        directory: the HF checkpoint directory on this machine (``None`` for GGUF).
        infos: the tensor table, read on first use (so an exporter can refuse a config first).
    """

    def __init__(self, scheme: str, path: str, roots: Roots, metadata: Mapping[str, Any],
                 directory: Path | None, infos: Mapping[str, WeightInfo] | None = None,
                 parts: Mapping[str, str] | None = None) -> None:
        self.scheme, self.path, self.roots = scheme, path, roots
        self.metadata, self.directory = metadata, directory
        self._infos = infos
        self._parts = dict(parts or {})

    def file_of(self, tensor: str) -> str:
        """The file (as given, root-relative or absolute) that holds ``tensor``: the part of a
        split GGUF, else :attr:`path`."""
        return self._parts.get(tensor, self.path)

    @property
    def hf_directory(self) -> Path:
        """:attr:`directory`, for a source that is an HF checkpoint.

        Raises:
            SpecError: the source is a GGUF file (it has no checkpoint directory).
        """
        if self.directory is None:
            raise SpecError(f"'{self.path}' is a {self.scheme} file, not a Hugging Face "
                            f"checkpoint directory with config.json")
        return self.directory

    @property
    def infos(self) -> Mapping[str, WeightInfo]:
        if self._infos is None:
            with WeightCache(self.roots) as cache:
                self._infos = cache.describe(str(self.directory or self.path))
        return self._infos


def open_source(path: str, roots: Roots, headers: Headers | None = None) -> Source:
    """Find a ``.gguf`` file or an HF directory under ``roots`` and read its metadata.

    Args:
        path: as the URIs will write it.
        roots: this machine's weight roots.
        headers: read the headers there instead (a GGUF file only: an HF directory's
            ``config.json`` and tokenizer files are read from this machine).

    Raises:
        SpecError: neither a GGUF file nor a directory with ``config.json``, or ``headers``
            given for an HF directory.
        WeightError: the path is outside the roots or unreadable.
    """
    if headers is not None:
        if Path(path).suffix != ".gguf":
            raise SpecError(f"'{path}': a model planned from the workers' disks must be a .gguf "
                            f"file (its header holds the config and the tokenizer); an HF "
                            f"directory must also exist on this machine (pass --model)")
        return _gguf_source(path, roots, headers)
    if Path(path).suffix == ".gguf":
        with WeightCache(roots) as cache:
            return _gguf_source(path, roots, cache)
    dirs = [Path(path)] if Path(path).is_absolute() else [Path(r) / path for r in roots]
    directory = next((p for p in dirs if (p / "config.json").is_file()), None)
    if directory is None:
        raise SpecError(f"'{path}': expected a .gguf file or a Hugging Face directory with "
                        f"config.json under the weight roots {[os.fspath(r) for r in roots]}")
    return Source("safetensors", path, roots, {}, directory)


def _gguf_source(path: str, roots: Roots, headers: Headers) -> Source:
    """A GGUF file's metadata and tensor table, from every part of a split file."""
    meta = headers.metadata(path)
    files = split_parts(path, meta)
    infos: dict[str, WeightInfo] = {}
    parts: dict[str, str] = {}
    for part in files:
        for name, info in headers.describe(part).items():
            if name in infos:
                raise SpecError(f"split GGUF '{path}': tensor '{name}' is in both "
                                f"'{parts[name]}' and '{part}'")
            infos[name], parts[name] = info, part
    expected = meta.get("split.tensors.count")
    if len(files) > 1 and expected is not None and int(expected) != len(infos):
        raise SpecError(f"split GGUF '{path}': split.tensors.count is {expected}, the "
                        f"{len(files)} parts hold {len(infos)} tensors")
    return Source("gguf", path, roots, meta, None, infos, parts)


_SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def split_parts(path: str, metadata: Mapping[str, Any]) -> list[str]:
    """The files of a GGUF split by llama.cpp's gguf-split (``split.count`` > 1): ``path`` must
    be the first, ``PREFIX-00001-of-0000N.gguf``. A whole file gives ``[path]``.

    Raises:
        SpecError: ``path`` is a split GGUF but not named as its first part.
    """
    count = int(metadata.get("split.count", 1) or 1)
    if count <= 1:
        return [path]
    m = _SPLIT_NAME.search(path)
    if m is None or int(m.group(1)) != 1 or int(m.group(2)) != count:
        raise SpecError(f"'{path}' is part {int(metadata.get('split.no', 0)) + 1} of a GGUF "
                        f"split in {count} (split.count); give the first part, named "
                        f"PREFIX-00001-of-{count:05d}.gguf, with the others beside it")
    prefix = path[:m.start()]
    return [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


class WeightTable:
    """Builds Params from a source's tensor table by logical name.

    Args:
        source: the model's files.
        names: logical name -> tensor name template (``"blk.{i}.attn_q.weight"``).
        dtype: the dtype every param is bound as.
        family: for error messages ("llama-family", "GPT-2").
        fields: extra template fields (e.g. a name prefix).
        quantized: bind GGUF matrices whose type has a kernel (:data:`KERNEL_TYPES`) as
            stored, packed; other quantized types are dequantized when bound (logged once per
            type). ``False`` dequantizes everything.
    """

    def __init__(self, source: Source, names: Mapping[str, str], dtype: str, *, family: str,
                 fields: Mapping[str, str] | None = None, quantized: bool = False) -> None:
        self.source, self.names, self.dtype, self.family = source, names, dtype, family
        self.fields = dict(fields or {})
        self.quantized = quantized and source.scheme == "gguf"
        self._no_kernel: set[str] = set()

    @property
    def scheme(self) -> str:
        return self.source.scheme

    def name(self, logical: str, i: int = 0, j: int = 0) -> str:
        """The tensor name of a logical weight of layer ``i`` (and expert ``j``)."""
        return self.names[logical].format(i=i, j=j, **self.fields)

    def has(self, logical: str, i: int = 0) -> bool:
        return self.name(logical, i) in self.source.infos

    def param(self, logical: str, shape: tuple[int, ...], i: int = 0, *,
              transpose: bool = False, j: int = 0) -> Param:
        """The Param of one tensor (of layer ``i``, expert ``j``), bound with ``shape`` (after
        ``transpose``). Quantized 2-D matrices and stacks of them (3-D, as stored: the experts
        of a MoE layer) are bound packed.

        Raises:
            SpecError: the tensor is missing or its shape disagrees with the config.
        """
        src = self.source
        name = self.name(logical, i, j)
        info = src.infos.get(name)
        if info is None:
            raise SpecError(f"{src.scheme} '{src.path}': tensor '{name}' is missing; the file "
                            f"does not match its config (or is not a {self.family} model)")
        found = info.shape[::-1] if transpose else info.shape
        if tuple(found) != tuple(shape):
            raise SpecError(f"{src.scheme} '{src.path}': tensor '{name}' has shape "
                            f"{tuple(info.shape)}, expected {shape[::-1] if transpose else shape} "
                            f"from the config")
        qtype = info.storage_type
        packed = (self.quantized and qtype in KERNEL_TYPES
                  and (len(shape) == 2 or (len(shape) == 3 and not transpose)))
        if self.quantized and qtype is not None and qtype not in ("F32", *KERNEL_TYPES) and \
                qtype not in self._no_kernel:
            self._no_kernel.add(qtype)
            log.warning("%s '%s': GGML type %s has no kernel; its tensors (first: %s) are "
                        "dequantized to %s when bound", src.scheme, src.path, qtype, name,
                        self.dtype)
        return Param(f"{src.scheme}://{src.file_of(name)}#{name}", shape, self.dtype,
                     transpose=transpose, quant=qtype, packed=packed)
