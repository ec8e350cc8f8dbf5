"""Weights: resolve ``gguf://``, ``safetensors://`` and ``file://`` URIs under the weight roots.

Workers bind through one long-lived :class:`WeightCache` (each file parsed once). The functions
below are conveniences for one-off use, each with a temporary cache.

Example:
    >>> from jaxdist.core.weights import describe_weights, resolve_weight
    >>> infos = describe_weights("m.gguf", roots=["/srv/models"])          # doctest: +SKIP
    >>> w = resolve_weight("gguf://m.gguf#output_norm.weight",              # doctest: +SKIP
    ...                    roots=["/srv/models"])
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxdist.core.weights.cache import WeightCache
from jaxdist.core.weights.uri import WeightInfo, WeightURI, parse_uri

__all__ = [
    "WeightCache",
    "WeightInfo",
    "WeightURI",
    "describe_weights",
    "parse_uri",
    "resolve_weight",
    "resolve_weight_bytes",
]

Roots = Sequence[str | os.PathLike[str]]


def resolve_weight(
    uri: str, *, roots: Roots, dtype: Any = None, shape: Sequence[int] | None = None
) -> np.ndarray:
    """Resolve one URI to an array (see :meth:`WeightCache.resolve`).

    Raises:
        WeightError: bad URI, path outside ``roots``, missing file or tensor, or a mismatch.

    Example:
        >>> import os, tempfile
        >>> import numpy as np
        >>> from safetensors.numpy import save_file
        >>> from jaxdist import resolve_weight
        >>> root = tempfile.mkdtemp()
        >>> save_file({"w": np.eye(2, dtype=np.float32)}, os.path.join(root, "m.safetensors"))
        >>> resolve_weight("safetensors://m.safetensors#w", roots=[root]).tolist()
        [[1.0, 0.0], [0.0, 1.0]]
    """
    with WeightCache(roots) as cache:
        return cache.resolve(uri, dtype=dtype, shape=shape)


def resolve_weight_bytes(uri: str, *, roots: Roots) -> tuple[np.ndarray, WeightInfo]:
    """The stored (packed) bytes of one tensor and its info (see :meth:`WeightCache.resolve_bytes`).

    Raises:
        WeightError: bad URI, path outside ``roots``, missing file or tensor.

    Example:
        >>> blocks, info = resolve_weight_bytes("gguf://smollm2.gguf#blk.0.attn_q.weight",
        ...                                     roots=["/srv/models"])  # doctest: +SKIP
        >>> blocks.dtype, blocks.shape, info.quant                      # doctest: +SKIP
        (dtype('uint8'), (576, 360), 'Q4_1')
    """
    with WeightCache(roots) as cache:
        return cache.resolve_bytes(uri)


def describe_weights(path: str | os.PathLike[str], *, roots: Roots) -> dict[str, WeightInfo]:
    """Every tensor of a file or checkpoint, from headers only (see :meth:`WeightCache.describe`).

    Raises:
        WeightError: path outside ``roots``, missing, or of unknown format.

    Example:
        >>> import os, tempfile
        >>> import numpy as np
        >>> from safetensors.numpy import save_file
        >>> from jaxdist import describe_weights
        >>> root = tempfile.mkdtemp()
        >>> save_file({"w": np.zeros((2, 3), np.float16)}, os.path.join(root, "m.safetensors"))
        >>> info = describe_weights("m.safetensors", roots=[root])["w"]
        >>> info.shape, info.dtype, info.nbytes
        ((2, 3), 'float16', 12)
    """
    with WeightCache(roots) as cache:
        return cache.describe(path)
