"""The WeightCache: resolve weight URIs under the weight roots, parsing each file once.

A worker binds a stage by calling :meth:`WeightCache.load` once per weight of its spec. Files are
memory-mapped and their headers parsed on first use; the reader objects are kept by real path, so
binding 30 layers from one GGUF parses it once. All layout work happens here, once per bind:
GGUF's reversed dims, dequantization, transposition and dtype casts.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import numpy as np

from jaxdist.core.errors import WeightError
from jaxdist.core.quant import PACKABLE_TYPES, dequantize, packed_shape
from jaxdist.core.weights.convert import (
    aligned_empty,
    as_dtype,
    byte_shape,
    check_cast,
    check_int_range,
    convert,
    drop_pages,
)
from jaxdist.core.weights.gguf import GGUFFile
from jaxdist.core.weights.rawfile import map_fd, read_raw
from jaxdist.core.weights.safetensors import (
    SafetensorsFile,
    find_checkpoint,
    read_config,
    read_index,
)
from jaxdist.core.weights.uri import WeightInfo, WeightURI, clip, open_checked, parse_uri, resolve_path

__all__ = ["WeightCache", "WeightInfo"]

logger = logging.getLogger(__name__)

_Reader = GGUFFile | SafetensorsFile
_R = TypeVar("_R", GGUFFile, SafetensorsFile)
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


@dataclass(frozen=True)
class _Located:
    """Where a URI points: a parsed file and tensor name, or (file://) a raw file."""

    uri: WeightURI
    path: Path
    reader: _Reader | None = None
    tensor: str | None = None
    data: np.ndarray | None = None  # file://: the bytes mapped once, hashed and bound alike


BIND_BLOCK_BYTES = 4 << 20
""":meth:`WeightCache.load` converts a tensor in blocks of rows of about this many bytes (as
float32), so that it holds one block's temporaries at a time (dequantizing makes several
float32 arrays the size of its input) besides the result, never a whole tensor's."""

class WeightCache:
    """Resolves weight URIs under a set of roots, keeping one parsed reader per file.

    Thread-safe: a lock guards the reader table, so concurrent binds parse each file once.

    Args:
        roots: the directories weights may be read from (the worker's ``--weights-root``).
            Relative URI paths are tried against each root in order.

    Example:
        >>> with WeightCache(["/srv/models"]) as cache:                     # doctest: +SKIP
        ...     wq = cache.load("gguf://smollm2.gguf#blk.0.attn_q.weight",
        ...                     param="blocks.0.wq", shape=(576, 576), dtype="float32",
        ...                     transpose=True)
    """

    def __init__(self, roots: Sequence[str | os.PathLike[str]]) -> None:
        self._roots = tuple(Path(r) for r in roots)
        self._lock = threading.Lock()
        self._opening: dict[Path, threading.Lock] = {}  # one per file being opened
        self._readers: dict[Path, _Reader] = {}
        self._indexes: dict[Path, dict[str, str]] = {}
        self._closed = False

    @property
    def roots(self) -> tuple[Path, ...]:
        """The weight roots, as given."""
        return self._roots

    def open_files(self) -> tuple[str, ...]:
        """Real paths of the files whose readers are cached (each parsed exactly once)."""
        with self._lock:
            return tuple(str(p) for p in self._readers)

    # -- locating ---------------------------------------------------------------------------

    def _cached(self, path: Path, kind: type[_R]) -> _R | None:
        with self._lock:
            if self._closed:
                raise WeightError("WeightCache is closed; create a new one to resolve weights")
            reader = self._readers.get(path)
            if reader is not None and not isinstance(reader, kind):
                raise WeightError(
                    f"file '{path}' was opened as {type(reader).__name__}, now requested as "
                    f"{kind.__name__}; use one URI scheme per file"
                )
            return reader

    def _read(self, path: Path, kind: type[_R]) -> _R:
        """Parse a file, opened once and checked (:func:`open_checked`); no lock is held."""
        return kind(path, fd=open_checked(path, self._roots, where=str(path)))

    def _open(self, path: Path, kind: type[_R]) -> _R:
        """The cached reader of ``path``, parsed once. The file is opened and parsed outside the
        cache's lock (under a lock of its own), so a slow or odd file never stalls the others."""
        reader = self._cached(path, kind)
        if reader is not None:
            return reader
        with self._lock:
            opening = self._opening.setdefault(path, threading.Lock())
        with opening:
            reader = self._cached(path, kind)
            if reader is None:
                reader = self._read(path, kind)
                with self._lock:
                    self._readers[path] = reader
                    self._opening.pop(path, None)
            return reader

    @contextlib.contextmanager
    def _peek(self, path: Path, kind: type[_R]) -> Iterator[_R]:
        """A reader for a look at the headers: the cached one, else a fresh one closed on
        leaving the block, so nothing stays open after a describe."""
        reader = self._cached(path, kind)
        if reader is not None:
            yield reader
            return
        reader = self._read(path, kind)
        try:
            yield reader
        finally:
            with self._lock:
                cached = self._readers.get(path) is reader
            if not cached:
                reader.close()

    def _index(self, path: Path) -> dict[str, str]:
        with self._lock:
            index = self._indexes.get(path)
        if index is None:  # read outside the lock, from the file opened and checked
            index = read_index(path, fd=open_checked(path, self._roots, where=str(path)))
            with self._lock:
                self._indexes[path] = index
        return index

    def _checkpoint_file(self, u: WeightURI) -> Path:
        """The safetensors file or index a ``safetensors://`` path stands for."""
        real = resolve_path(u.path, self._roots, uri=str(u))
        if real.is_dir():
            real = resolve_path(find_checkpoint(real), self._roots, uri=str(u))
        return real

    def _locate(self, uri: str | WeightURI) -> _Located:
        u = uri if isinstance(uri, WeightURI) else parse_uri(uri)
        if u.scheme == "file":
            path = resolve_path(u.path, self._roots, uri=str(u))
            return _Located(u, path, data=map_fd(open_checked(path, self._roots, where=str(u)),
                                                 path))
        tensor = u.require_tensor()
        if u.scheme == "gguf":
            path = resolve_path(u.path, self._roots, uri=str(u))
            return _Located(u, path, self._open(path, GGUFFile), tensor)
        path = self._checkpoint_file(u)
        if path.suffix == ".json":
            shard = self._index(path).get(tensor)
            if shard is None:
                raise WeightError(
                    f"weight '{u}': tensor '{tensor}' is not in the weight_map of '{path}'; "
                    f"check the tensor name (list them with describe_weights)"
                )
            path = resolve_path(path.parent / shard, self._roots, uri=str(u))
        return _Located(u, path, self._open(path, SafetensorsFile), tensor)

    # -- reading ----------------------------------------------------------------------------

    def info(self, uri: str) -> WeightInfo:
        """Header info of the tensor a ``gguf://`` or ``safetensors://`` URI names.

        Raises:
            WeightError: bad URI, path outside the roots, missing file or tensor, or ``file://``.
        """
        loc = self._locate(uri)
        if loc.reader is None:
            raise WeightError(
                f"weight '{loc.uri}': a file:// weight has no header to describe; the spec gives "
                f"its shape and dtype"
            )
        return loc.reader.info(loc.tensor or "")

    def _stored(self, loc: _Located) -> np.ndarray:
        if loc.reader is None:
            assert loc.data is not None
            return loc.data
        return loc.reader.stored_bytes(loc.tensor or "")

    def _natural(
        self, loc: _Located, shape: Sequence[int] | None, dtype: np.dtype[Any] | None
    ) -> np.ndarray:
        if loc.reader is not None:
            return loc.reader.read(loc.tensor or "")
        if shape is None or dtype is None:
            raise WeightError(
                f"weight '{loc.uri}': a file:// weight needs its shape and dtype from the caller, "
                f"found shape={shape}, dtype={dtype}; pass both"
            )
        return read_raw(loc.path, shape=shape, dtype=dtype, uri=str(loc.uri), data=loc.data)

    def resolve(
        self, uri: str, *, dtype: Any = None, shape: Sequence[int] | None = None
    ) -> np.ndarray:
        """The tensor a URI names, dequantized, in NumPy order.

        Args:
            uri: a weight URI.
            dtype: cast to this dtype (float to any float, int to any int); ``None`` keeps the
                stored dtype (float32 for quantized tensors). Required for ``file://``.
            shape: the expected shape, checked when given. Required for ``file://``.

        Returns:
            The array. Without a cast it may be a read-only view of the memory-mapped file.

        Raises:
            WeightError: bad URI, path outside the roots, missing file or tensor, mismatch.
        """
        loc = self._locate(uri)
        where = f"weight '{loc.uri}'"
        dt = as_dtype(dtype, where) if dtype is not None else None
        if shape is not None:
            want = tuple(int(d) for d in shape)
            found = loc.reader.info(loc.tensor or "").shape if loc.reader else want
            if found != want:  # checked from the header, before any data is read
                raise WeightError(f"{where}: shape mismatch: expected {want}, found {found}")
        arr = self._natural(loc, shape, dt)
        if dt is None:
            return np.asarray(arr)
        return convert(arr, dt, transpose=False, where=where)

    def resolve_bytes(self, uri: str) -> tuple[np.ndarray, WeightInfo]:
        """The tensor's stored bytes, not dequantized, and its info.

        Returns:
            ``(bytes, info)``: uint8 shaped ``info.shape`` with the last dim replaced by bytes per
            row (so ``jaxdist.core.quant.dequantize(bytes, info.storage_type, info.shape)`` decodes
            it). For ``file://``, the whole file as 1-D bytes with ``info.dtype == "uint8"``.

        Raises:
            WeightError: bad URI, path outside the roots, missing file or tensor.
        """
        loc = self._locate(uri)
        raw = np.asarray(self._stored(loc))
        if loc.reader is None:
            info = WeightInfo(str(loc.path), (raw.size,), "uint8", None, raw.size, str(loc.path))
            return raw, info
        info = loc.reader.info(loc.tensor or "")
        return raw.reshape(byte_shape(info)), info

    def describe(self, path: str | os.PathLike[str]) -> dict[str, WeightInfo]:
        """Names, shapes, dtypes, quant types and sizes of every tensor, from headers only.

        Args:
            path: a GGUF or safetensors file, a sharded index, a checkpoint directory, or such a
                URI without ``#TENSOR`` (``gguf://m.gguf``). Resolved under the roots.

        Raises:
            WeightError: path outside the roots, missing, of unknown format, or ``file://``.
        """
        text = os.fspath(path)
        u = parse_uri(text) if "://" in text else WeightURI(self._guess_scheme(text), text)
        if u.scheme == "file":
            raise WeightError(f"'{text}': a file:// weight has no header to describe")
        if u.scheme == "gguf":
            real = resolve_path(u.path, self._roots, uri=text)
            with self._peek(real, GGUFFile) as gguf:
                return gguf.describe()
        real = self._checkpoint_file(u)
        paths: dict[Path, list[str]] = {}
        if real.suffix != ".json":
            paths[real] = []
        else:
            for name, shard in self._index(real).items():
                shard_path = resolve_path(real.parent / shard, self._roots, uri=text)
                paths.setdefault(shard_path, []).append(name)
        out: dict[str, WeightInfo] = {}
        for p, names in paths.items():  # one shard open at a time
            with self._peek(p, SafetensorsFile) as st:
                out.update(st.describe() if not names else {n: st.info(n) for n in names})
        return out

    def _guess_scheme(self, path: str) -> str:
        if path.endswith(".gguf"):
            return "gguf"
        if path.endswith((".safetensors", ".json")):
            return "safetensors"
        real = resolve_path(path, self._roots)
        if real.is_dir():
            return "safetensors"
        fd = open_checked(real, self._roots, where=path)
        try:
            return "gguf" if os.read(fd, 4) == b"GGUF" else "safetensors"
        finally:
            os.close(fd)

    def metadata(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Model metadata of a file or checkpoint under the roots, from headers only.

        GGUF: its key/value metadata (see :func:`weights.gguf.metadata`). Safetensors (a file, an
        index or a directory): the ``config.json`` beside it, if any, under ``"config"``, plus the
        header's ``__metadata__`` strings.

        Raises:
            WeightError: path outside the roots (the ``config.json`` too), missing, or a malformed
                header, ``__metadata__`` or ``config.json``.
        """
        text = os.fspath(path)
        u = parse_uri(text) if "://" in text else WeightURI(self._guess_scheme(text), text)
        if u.scheme == "gguf":
            real = resolve_path(u.path, self._roots, uri=text)
            with self._peek(real, GGUFFile) as gguf:
                return gguf.metadata()
        if u.scheme == "file":
            raise WeightError(f"'{text}': a file:// weight has no metadata")
        real = self._checkpoint_file(u)
        out: dict[str, Any] = {}
        config = real.parent / "config.json"
        if config.exists():
            checked = resolve_path(config, self._roots, uri=text)
            out["config"] = read_config(checked, fd=open_checked(checked, self._roots,
                                                                 where=text))
        if real.suffix != ".json":
            with self._peek(real, SafetensorsFile) as st:
                out.update(st.metadata)
        return out

    # -- binding ----------------------------------------------------------------------------

    def load(
        self,
        uri: str,
        *,
        param: str,
        shape: Sequence[int],
        dtype: Any,
        sha256: str | None = None,
        packed: bool = False,
        transpose: bool = False,
        quant: str | None = None,
    ) -> np.ndarray:
        """Bind one WeightRef: verify, resolve, lay out and check a weight.

        In order: the sha256 of the stored bytes (if given); the stored type against ``quant``
        (if given); the final shape against ``shape`` (from the header, before reading data);
        then the data is read, dequantized unless ``packed``, transposed and cast in one copy.

        Args:
            uri: the weight URI.
            param: the parameter name in the stage function, for error messages.
            shape: the shape the stage expects after transposition (packed: the byte shape, the
                logical shape with the last dim replaced by bytes per row).
            dtype: the dtype the stage expects (packed: ``"uint8"``).
            sha256: hex sha256 of the tensor's stored bytes, verified before anything else.
            packed: bind the raw stored blocks (uint8) for in-graph dequantization.
            transpose: reverse the axes (e.g. to bind ``(out, in)`` weights as ``(in, out)``).
            quant: the expected stored GGML type (``"Q4_1"``, ``"F16"``), checked when given.

        Returns:
            A new C-contiguous array of ``shape`` and ``dtype``, on a 64-byte boundary (so
            ``jax.device_put(a, cpu, may_alias=True)`` uses it in place), never a view of the
            file. The file pages it was read from are released (``MADV_DONTNEED``): they leave
            this process's RSS and stay in the page cache.

        Raises:
            WeightError: any mismatch; the message names ``param``, the URI, expected and found.
        """
        try:
            return self._load(uri, param=param, shape=shape, dtype=dtype, sha256=sha256,
                              packed=packed, transpose=transpose, quant=quant)
        except MemoryError:
            n = math.prod(int(d) for d in shape) * as_dtype(dtype, param).itemsize
            raise WeightError(f"weight '{param}' ({clip(uri)}): {n} bytes ({list(shape)} "
                              f"{dtype}) could not be allocated on this worker",
                              code="RESOURCE_EXHAUSTED") from None

    def _load(self, uri: str, *, param: str, shape: Sequence[int], dtype: Any,
              sha256: str | None, packed: bool, transpose: bool, quant: str | None
              ) -> np.ndarray:
        loc = self._locate(uri)
        where = f"weight '{param}' ({loc.uri})"
        if sha256 is not None:
            self._verify(loc, sha256, where)
        want = tuple(int(d) for d in shape)
        dt = as_dtype(dtype, where)
        if loc.reader is None:
            if packed:
                raise WeightError(
                    f"{where}: a file:// weight carries no GGML type, so it cannot be bound "
                    f"packed; bind it unpacked or store it in a GGUF file"
                )
            stored_shape = want[::-1] if transpose else want
            info = WeightInfo(str(loc.path), stored_shape, dt.name, None, 0, str(loc.path))
        else:
            info = loc.reader.info(loc.tensor or "")
        found_type = info.storage_type or info.dtype
        if quant is not None and quant != found_type:
            raise WeightError(f"{where}: quant mismatch: expected {quant}, found {found_type}")
        if packed:
            return self._load_packed(loc, info, want, dt, transpose, where)
        found = info.shape[::-1] if transpose else info.shape
        if found != want:
            note = f" (stored {info.shape}, transpose=True)" if transpose else ""
            raise WeightError(f"{where}: shape mismatch: expected {want}, found {found}{note}")
        out = self._bind(loc, info, dt, transpose, where)
        logger.debug("bound %s: %s %s", where, out.dtype.name, out.shape)
        return out

    def _bind(self, loc: _Located, info: WeightInfo, dt: np.dtype[Any], transpose: bool,
              where: str) -> np.ndarray:
        """Read, dequantize, transpose and cast a tensor into a new aligned array, in blocks of
        rows (:data:`BIND_BLOCK_BYTES`), releasing each block's file pages once it is read."""
        shape = info.shape
        out = aligned_empty(shape[::-1] if transpose else shape, dt)
        dest = out.T if transpose else out  # indexed like the stored tensor
        qtype = info.quant
        if qtype is not None and qtype in PACKABLE_TYPES and len(shape) >= 2:
            check_cast(np.dtype(np.float32), dt, where)
            stored = self._stored(loc).reshape(packed_shape(qtype, shape))

            def block(i: int, j: int) -> np.ndarray:
                rows: np.ndarray = dequantize(stored[i:j], qtype, (j - i, *shape[1:]))
                return rows
        else:  # plain types: a view of the file; the rare gguf.quants types: whole, at once
            stored = self._natural(loc, shape, dt)
            check_cast(stored.dtype, dt, where)
            check_int_range(stored, dt, where)

            def block(i: int, j: int) -> np.ndarray:
                return stored[i:j]
        if len(shape) < 2:  # small (norms, biases), or a scalar
            dest[...] = stored
        else:
            step = max(1, BIND_BLOCK_BYTES // max(1, 4 * math.prod(shape[1:])))
            for i in range(0, shape[0], step):
                j = min(i + step, shape[0])
                dest[i:j] = block(i, j)
                drop_pages(stored[i:j])
        if loc.reader is not None:  # what the checksum or the header checks read
            drop_pages(self._stored(loc))
        return out

    def _verify(self, loc: _Located, sha256: str, where: str) -> None:
        if not _SHA256.fullmatch(sha256):
            raise WeightError(
                f"{where}: sha256 must be 64 hex digits, found {sha256!r}; fix the spec"
            )
        digest = hashlib.sha256(np.ascontiguousarray(self._stored(loc)).data).hexdigest()
        if digest != sha256.lower():
            raise WeightError(
                f"{where}: checksum mismatch: expected sha256 {sha256.lower()}, found {digest}; "
                f"the file on this worker differs from the one the stage was planned with"
            )

    def _load_packed(
        self,
        loc: _Located,
        info: WeightInfo,
        want: tuple[int, ...],
        dt: np.dtype[Any],
        transpose: bool,
        where: str,
    ) -> np.ndarray:
        stype = info.storage_type
        if stype is None or stype not in PACKABLE_TYPES:
            raise WeightError(
                f"{where}: cannot bind packed: stored type {info.quant or info.dtype} has no "
                f"in-graph dequantizer (packable: {', '.join(PACKABLE_TYPES)}); "
                f"bind it unpacked"
            )
        if transpose:
            raise WeightError(
                f"{where}: transpose=True cannot apply to packed blocks (they run along the last "
                f"axis); transpose in-graph after dequantizing, or bind unpacked"
            )
        if dt != np.uint8:
            raise WeightError(
                f"{where}: dtype mismatch: expected {dt.name}, found uint8 (a packed weight binds "
                f"its raw {stype} blocks); set dtype 'uint8' in the spec or bind unpacked"
            )
        found = packed_shape(stype, info.shape)
        if found != want:
            raise WeightError(
                f"{where}: shape mismatch: expected {want}, found {found} (packed {stype} bytes "
                f"of logical shape {info.shape})"
            )
        raw = np.asarray(self._stored(loc)).reshape(found)
        out = aligned_empty(found, dt)
        out[...] = raw
        drop_pages(raw)
        logger.debug("bound %s packed: %s %s", where, stype, found)
        return out

    # -- lifetime ---------------------------------------------------------------------------

    def drop_readers(self) -> None:
        """Forget the parsed files and their memory maps, but stay usable.

        A worker calls this once a stage is bound: the maps (and the header pages and parsed
        metadata they hold) go once no array views of them remain, and the next bind parses the
        files again. Unlike :meth:`close`, later calls resolve weights as before.
        """
        with self._lock:
            self._readers.clear()
            self._indexes.clear()

    def close(self) -> None:
        """Drop every reader. Arrays already returned stay valid (they keep their maps alive)."""
        with self._lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()
            self._indexes.clear()
            self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        roots = [str(r) for r in self._roots]
        return f"WeightCache(roots={roots}, open_files={len(self._readers)})"

