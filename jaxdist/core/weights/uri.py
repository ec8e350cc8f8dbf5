"""Weight addresses: URIs, what they point at, and the roots they must stay under.

A weight URI names one tensor in a file on the worker's disk:

* ``gguf://PATH#TENSOR`` - a tensor of a GGUF file,
* ``safetensors://PATH#TENSOR`` - a tensor of a ``.safetensors`` file, of a sharded checkpoint's
  ``model.safetensors.index.json``, or of a checkpoint directory,
* ``file://PATH`` - a raw little-endian array whose shape and dtype the spec gives.

``PATH`` is relative to a weights root (``gguf://models/m.gguf#tok_embd.weight``) or absolute
(``gguf:///srv/models/m.gguf#tok_embd.weight``); either way it must resolve, after following
symlinks, to a file under one of the worker's ``--weights-root`` directories. The first ``#``
separates the path from the tensor name, so a path cannot contain ``#``. No percent-decoding is
done: the path is used as written.

:class:`WeightInfo` lives here rather than in ``cache.py`` because every format reader builds it and
the cache imports the readers; keeping it beside the URI keeps imports one-way.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jaxdist.core.errors import WeightError

__all__ = ["MAX_PATH_CHARS", "SCHEMES", "WeightInfo", "WeightURI", "clip", "open_checked",
           "parse_uri", "relocate_uri", "resolve_path"]

logger = logging.getLogger(__name__)

SCHEMES: tuple[str, ...] = ("gguf", "safetensors", "file")

MAX_PATH_CHARS = 4096
"""The longest weight path accepted (Linux's PATH_MAX); a longer one is refused, clipped."""


def clip(text: str, limit: int = 160) -> str:
    """``text`` cut to ``limit`` characters for an error message, saying how much was cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more chars)"

# Element dtypes that a packed bind can carry, by numpy name -> GGML type name.
_PLAIN_STORAGE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass(frozen=True)
class WeightURI:
    """A parsed weight URI.

    Attributes:
        scheme: ``"gguf"``, ``"safetensors"`` or ``"file"``.
        path: the path as written in the URI (relative to a root, or absolute).
        tensor: the tensor name after ``#``; ``None`` for ``file://`` or a bare file reference.
    """

    scheme: str
    path: str
    tensor: str | None = None

    def __str__(self) -> str:
        tail = f"#{self.tensor}" if self.tensor is not None else ""
        return f"{self.scheme}://{self.path}{tail}"

    def require_tensor(self) -> str:
        """Return the tensor name, or raise if the URI has none.

        Raises:
            WeightError: the URI has no ``#TENSOR`` part.
        """
        if not self.tensor:
            raise WeightError(
                f"weight URI '{self}' names no tensor: expected '{self.scheme}://PATH#TENSOR'; "
                f"add '#' and the tensor name (list them with describe_weights)"
            )
        return self.tensor


@dataclass(frozen=True)
class WeightInfo:
    """What a file says about one stored tensor (read from headers only).

    Attributes:
        name: the tensor name inside its file.
        shape: logical element shape in NumPy (row-major) order; GGUF's reversed dims are undone.
        dtype: NumPy name of the stored element type (``"float16"``, ``"bfloat16"``, ``"int64"``);
            ``"float32"`` for quantized GGUF tensors, which dequantize to float32.
        quant: GGML type name of a quantized tensor (``"Q4_1"``), ``None`` for plain element types.
        nbytes: bytes the tensor occupies in the file.
        path: real path of the file holding the tensor.

    Example:
        >>> from jaxdist import describe_weights
        >>> infos = describe_weights("smollm2.gguf", roots=["/srv/models"])  # doctest: +SKIP
        >>> info = infos["blk.0.attn_q.weight"]                               # doctest: +SKIP
        >>> info.shape, info.dtype, info.quant, info.nbytes                   # doctest: +SKIP
        ((576, 576), 'float32', 'Q4_1', 207360)
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    quant: str | None
    nbytes: int
    path: str

    @property
    def storage_type(self) -> str | None:
        """The GGML type name of the stored bytes (``"Q8_0"``, ``"F16"``), or ``None`` if not float.

        This is the ``qtype`` to pass to :func:`jaxdist.core.quant.dequantize` for packed bytes.
        """
        return self.quant if self.quant is not None else _PLAIN_STORAGE.get(self.dtype)


def parse_uri(uri: str) -> WeightURI:
    """Parse ``gguf://PATH#TENSOR``, ``safetensors://PATH#TENSOR`` or ``file://PATH``.

    Args:
        uri: the URI text.

    Returns:
        The parsed :class:`WeightURI`. The tensor part may be absent; readers that need one call
        :meth:`WeightURI.require_tensor`.

    Raises:
        WeightError: unknown scheme, empty path, empty tensor after ``#``, or a tensor on
            ``file://``.

    Example:
        >>> parse_uri("gguf://models/m.gguf#blk.0.attn_q.weight")
        WeightURI(scheme='gguf', path='models/m.gguf', tensor='blk.0.attn_q.weight')
    """
    if not isinstance(uri, str):
        raise WeightError(f"weight URI must be a string, found {type(uri).__name__}: {uri!r}")
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in SCHEMES:
        found = f"scheme '{scheme}'" if sep else "no scheme"
        raise WeightError(
            f"weight URI '{uri}': expected a scheme of {', '.join(s + '://' for s in SCHEMES)}, "
            f"found {found}; write e.g. 'gguf://model.gguf#token_embd.weight'"
        )
    path, hash_sign, tensor = rest.partition("#")
    if not path:
        raise WeightError(f"weight URI '{uri}': the path is empty; expected '{scheme}://PATH...'")
    if scheme == "file" and hash_sign:
        raise WeightError(
            f"weight URI '{uri}': file:// holds one raw array and takes no '#TENSOR' part, "
            f"found '#{tensor}'; remove it"
        )
    if hash_sign and not tensor:
        raise WeightError(
            f"weight URI '{uri}': the tensor name after '#' is empty; "
            f"expected '{scheme}://PATH#TENSOR'"
        )
    return WeightURI(scheme, path, tensor if hash_sign else None)


def relocate_uri(uri: str, old: str, new: str) -> str:
    """Move ``uri`` from the model at ``old`` to the model at ``new``: its path prefix swapped.

    The prefix matches at a path boundary only (``old`` exactly, or followed by ``#`` or ``/``),
    so ``m.gguf`` does not match ``m.gguf.bak``. A URI outside ``old`` is returned unchanged.

    Example:
        >>> relocate_uri("gguf://m.gguf#tok_embd.weight", "m.gguf", "models/m.gguf")
        'gguf://models/m.gguf#tok_embd.weight'
        >>> relocate_uri("safetensors://bert/model.safetensors#w", "bert", "/srv/bert")
        'safetensors:///srv/bert/model.safetensors#w'
    """
    scheme, sep, rest = uri.partition("://")
    base = old.rstrip("/")
    if sep and base and (rest == base or rest.startswith((base + "#", base + "/"))):
        return f"{scheme}://{new.rstrip('/')}{rest[len(base):]}"
    return uri


def _real_roots(roots: Sequence[str | os.PathLike[str]]) -> list[Path]:
    return [Path(os.path.realpath(r)) for r in roots]


def resolve_path(
    path: str | os.PathLike[str],
    roots: Sequence[str | os.PathLike[str]],
    *,
    uri: str | None = None,
) -> Path:
    """Resolve ``path`` to a real path that lies under one of ``roots``.

    A relative path is tried against each root in order and the first existing candidate wins. An
    absolute path is taken as is. In both cases the real path (symlinks and ``..`` resolved) must
    lie under the real path of some root; otherwise the path is refused, whether or not it exists,
    so refusals reveal nothing about files outside the roots.

    Args:
        path: the path from a URI.
        roots: the allowed weight roots (the worker's ``--weights-root`` directories).
        uri: the URI the path came from, for error messages (defaults to ``path``).

    Returns:
        The real path of the file or directory.

    Raises:
        WeightError: no roots, a path that escapes every root, or no such file.
    """
    where = clip(uri if uri is not None else str(path))
    _check_path_text(os.fspath(path), where)
    if not roots:
        raise WeightError(
            f"weight '{where}': no weight roots are configured, so every path is refused; "
            f"pass --weights-root DIR to the worker (or roots=[DIR] to WeightCache)",
            code="PERMISSION_DENIED",
        )
    real_roots = _real_roots(roots)
    given = Path(path)
    candidates = [given] if given.is_absolute() else [Path(r) / given for r in roots]
    for candidate in candidates:
        try:
            real = Path(os.path.realpath(candidate))
        except OSError as exc:  # a link swapped for a directory while it was read, say
            raise WeightError(f"weight '{where}': path '{clip(str(path))}' changed while it was "
                              f"resolved ({exc.strerror}); refused", code="FAILED_PRECONDITION"
                              ) from None
        if not any(real.is_relative_to(root) for root in real_roots):
            raise WeightError(
                f"weight '{where}': path '{path}' resolves to '{real}', which is outside the "
                f"weight roots {[str(r) for r in real_roots]}; move or link the file under a root "
                f"(links must not point outside it) or add its directory with --weights-root",
                code="PERMISSION_DENIED",
            )
        try:
            exists = real.exists()
        except OSError as exc:
            raise WeightError(f"weight '{where}': '{real}' cannot be examined: {exc.strerror}",
                              code="FAILED_PRECONDITION") from None
        if exists:
            logger.debug("resolved %s -> %s", where, real)
            return real
    looked = ", ".join(str(c) for c in candidates)
    raise WeightError(
        f"weight '{where}': file not found; looked for {looked}; check the path in the URI and "
        f"the --weights-root directories",
        code="NOT_FOUND",
    )


def _check_path_text(path: str, where: str) -> None:
    """Refuse what no file system opens, before it reaches one (and an error message)."""
    if "\x00" in path:
        raise WeightError(f"weight '{where}': the path holds a NUL byte; paths cannot",
                          code="INVALID_ARGUMENT")
    if len(path) > MAX_PATH_CHARS:
        raise WeightError(f"weight '{where}': the path has {len(path)} characters, more than "
                          f"{MAX_PATH_CHARS}", code="INVALID_ARGUMENT")
    long = next((c for c in path.split("/") if len(os.fsencode(c)) > 255), None)
    if long is not None:
        raise WeightError(f"weight '{where}': the path component '{clip(long, 40)}' has "
                          f"{len(os.fsencode(long))} bytes, more than a file name may (255)",
                          code="INVALID_ARGUMENT")


def _opened_path(fd: int) -> Path | None:
    """The real path of what ``fd`` opened (Linux's ``/proc/self/fd``), or ``None``."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


def open_checked(real: Path, roots: Sequence[str | os.PathLike[str]], *, where: str) -> int:
    """Open a file :func:`resolve_path` resolved, once, and check what was opened.

    The file is opened without blocking (a FIFO cannot hang the caller) and without following a
    link in its last component; then it must be a regular file, and the file actually opened
    (``/proc/self/fd``; else its device and inode against ``real``) must still lie under a root.
    So a directory swapped for a link between the check and the open (a ``renameat2`` exchange)
    serves nothing outside the roots. Read the data through the returned descriptor only.

    Returns:
        A read-only file descriptor; the caller closes it.

    Raises:
        WeightError: not a regular file, gone, or no longer under a root.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(real, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise WeightError(f"weight '{where}': '{real}' became a symbolic link while it was "
                              f"opened; refused", code="PERMISSION_DENIED") from None
        code = "NOT_FOUND" if exc.errno == errno.ENOENT else "FAILED_PRECONDITION"
        raise WeightError(f"weight '{where}': '{real}' could not be opened: {exc.strerror}",
                          code=code) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory"
                    if stat.S_ISDIR(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                    or stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                    else "not a regular file")
            raise WeightError(f"weight '{where}': '{real}' is {kind}; weights are read from "
                              f"regular files only", code="FAILED_PRECONDITION")
        opened = _opened_path(fd)
        real_roots = _real_roots(roots)
        if opened is not None:
            inside = any(opened.is_relative_to(r) for r in real_roots)
        else:  # no /proc: the inode must be the one the checked path names
            now = os.stat(real)
            inside = (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)
        if not inside:
            raise WeightError(f"weight '{where}': '{real}' changed while it was opened (it now "
                              f"leads outside the weight roots); refused",
                              code="PERMISSION_DENIED")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
