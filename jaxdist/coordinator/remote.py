"""A model's headers read on a worker's disk, so the coordinator needs no copy of the model.

:class:`WorkerHeaders` answers :class:`jaxdist.export.plugins.Headers` through the worker's
``DescribeWeights``: the GGUF metadata (architecture, config, tokenizer) and the tensor table,
never the tensor data. :func:`jaxdist.export.plugins.load_model_from` plans a model with it.

Example:
    >>> cluster = Cluster.connect(["10.0.0.5:50051", "10.0.0.6:50051"])       # doctest: +SKIP
    >>> headers = WorkerHeaders(cluster.clients[0])                            # doctest: +SKIP
    >>> loaded = load_model_from(headers, "models/smollm2.gguf", max_seq=512)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jaxdist.core.errors import JaxdistError, SpecError
from jaxdist.core.transport.client import WorkerClient
from jaxdist.core.weights.uri import WeightInfo, parse_uri
from jaxdist.export.model import Model

__all__ = ["WorkerHeaders", "check_model_on"]


def check_model_on(clients: Sequence[WorkerClient], model: Model) -> None:
    """Refuse, before tracing and shipping, a model whose files a worker does not hold.

    Every file the weight URIs name is described (headers only) on every worker; the first
    that is missing or unreadable raises, naming the worker and the path.

    Raises:
        SpecError: a worker lacks a file, or cannot read it (the worker's own error inside).
    """
    files = list(dict.fromkeys(parse_uri(p.uri).path for u in model.units
                               for p in u.params.values()))
    for client in clients:
        for f in files:
            try:
                client.describe_weights(f)
            except JaxdistError as exc:
                raise SpecError(f"{exc}. The workers read the model at '{f}' (relative to "
                                f"their --weights-root); pass model_path= (--model-path) with "
                                f"where they keep it") from None


class WorkerHeaders:
    """:class:`~jaxdist.export.plugins.Headers` of the files under one worker's weights roots.

    Each file is described once (one ``DescribeWeights`` call gives its metadata and its tensor
    table together); errors are the worker's, naming it and the path (a ``WeightError`` for a
    missing file or one outside its roots).
    """

    def __init__(self, client: WorkerClient) -> None:
        self.client = client
        self._files: dict[str, tuple[dict[str, WeightInfo], dict[str, Any]]] = {}

    def _describe(self, path: str) -> tuple[dict[str, WeightInfo], dict[str, Any]]:
        if path not in self._files:
            tensors, meta = self.client.describe_weights(path)
            infos = {t.name: WeightInfo(t.name, tuple(int(d) for d in t.shape), t.dtype,
                                        t.quant or None, int(t.nbytes),
                                        f"{self.client.address}:{path}")
                     for t in tensors}
            self._files[path] = infos, meta
        return self._files[path]

    def metadata(self, path: str) -> Mapping[str, Any]:
        return self._describe(path)[1]

    def describe(self, path: str) -> Mapping[str, WeightInfo]:
        return self._describe(path)[0]
