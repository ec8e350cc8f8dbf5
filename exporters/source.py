"""Where an exporter's weights come from: a GGUF file or an HF directory, read for headers only.

Shared by the exporters: :func:`open_source` finds the file under the weight roots and reads its
tensor table and metadata (never the data); :class:`WeightTable` turns logical weight names into
:class:`~jaxdist.model.Param` URIs, checking each tensor's shape against the model config.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxdist.errors import SpecError
from jaxdist.model import Param
from jaxdist.weights import WeightCache, WeightInfo

__all__ = ["Source", "WeightTable", "open_source"]

Roots = Sequence[str | os.PathLike[str]]


class Source:
    """A model's files: ``scheme`` is ``"gguf"`` or ``"safetensors"``.

    Attributes:
        path: the path as given (relative to a root, or absolute): URIs keep it as is.
        metadata: GGUF key/values (empty for HF directories).
        directory: the HF checkpoint directory on this machine (``None`` for GGUF).
        infos: the tensor table, read on first use (so an exporter can refuse a config first).
    """

    def __init__(self, scheme: str, path: str, roots: Roots, metadata: Mapping[str, Any],
                 directory: Path | None, infos: Mapping[str, WeightInfo] | None = None) -> None:
        self.scheme, self.path, self.roots = scheme, path, roots
        self.metadata, self.directory = metadata, directory
        self._infos = infos

    @property
    def infos(self) -> Mapping[str, WeightInfo]:
        if self._infos is None:
            with WeightCache(self.roots) as cache:
                self._infos = cache.describe(str(self.directory or self.path))
        return self._infos


def open_source(path: str, roots: Roots) -> Source:
    """Find a ``.gguf`` file or an HF directory under ``roots`` and read its metadata.

    Raises:
        SpecError: neither a GGUF file nor a directory with ``config.json``.
        WeightError: the path is outside the roots or unreadable.
    """
    if Path(path).suffix == ".gguf":
        with WeightCache(roots) as cache:
            return Source("gguf", path, roots, cache.metadata(path), None, cache.describe(path))
    dirs = [Path(path)] if Path(path).is_absolute() else [Path(r) / path for r in roots]
    directory = next((p for p in dirs if (p / "config.json").is_file()), None)
    if directory is None:
        raise SpecError(f"'{path}': expected a .gguf file or a Hugging Face directory with "
                        f"config.json under the weight roots {[os.fspath(r) for r in roots]}")
    return Source("safetensors", path, roots, {}, directory)


class WeightTable:
    """Builds Params from a source's tensor table by logical name.

    Args:
        source: the model's files.
        names: logical name -> tensor name template (``"blk.{i}.attn_q.weight"``).
        dtype: the dtype every param is bound as.
        family: for error messages ("llama-family", "GPT-2").
        fields: extra template fields (e.g. a name prefix).
    """

    def __init__(self, source: Source, names: Mapping[str, str], dtype: str, *, family: str,
                 fields: Mapping[str, str] | None = None) -> None:
        self.source, self.names, self.dtype, self.family = source, names, dtype, family
        self.fields = dict(fields or {})

    @property
    def scheme(self) -> str:
        return self.source.scheme

    def name(self, logical: str, i: int = 0) -> str:
        return self.names[logical].format(i=i, **self.fields)

    def has(self, logical: str, i: int = 0) -> bool:
        return self.name(logical, i) in self.source.infos

    def param(self, logical: str, shape: tuple[int, ...], i: int = 0, *,
              transpose: bool = False) -> Param:
        """The Param of one tensor, bound with ``shape`` (after ``transpose``).

        Raises:
            SpecError: the tensor is missing or its shape disagrees with the config.
        """
        src = self.source
        name = self.name(logical, i)
        info = src.infos.get(name)
        if info is None:
            raise SpecError(f"{src.scheme} '{src.path}': tensor '{name}' is missing; the file "
                            f"does not match its config (or is not a {self.family} model)")
        found = info.shape[::-1] if transpose else info.shape
        if tuple(found) != tuple(shape):
            raise SpecError(f"{src.scheme} '{src.path}': tensor '{name}' has shape "
                            f"{tuple(info.shape)}, expected {shape[::-1] if transpose else shape} "
                            f"from the config")
        return Param(f"{src.scheme}://{src.path}#{name}", shape, self.dtype,
                     transpose=transpose, quant=info.storage_type)
