"""A model's headers read on a worker's disk, so the coordinator needs no copy of the model.

:class:`WorkerHeaders` answers :class:`jaxdist.export.plugins.Headers` through the worker's
``DescribeWeights``: the GGUF metadata (architecture, config, tokenizer) and the tensor table,
never the tensor data. :func:`jaxdist.export.plugins.load_model_from` plans a model with it.
The same call asks the workers, before anything is traced, shipped or compiled, whether they
hold a model's files: :func:`check_model_on` (a model traced now), :func:`check_stages_on`
(an exported model's stages, ``jaxdist deploy``).

Example:
    >>> cluster = Cluster.connect(["10.0.0.5:50051", "10.0.0.6:50051"])       # doctest: +SKIP
    >>> headers = WorkerHeaders(cluster.clients[0])                            # doctest: +SKIP
    >>> loaded = load_model_from(headers, "models/smollm2.gguf", max_seq=512)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jaxdist.core.errors import JaxdistError, SpecError
from jaxdist.core.spec import StageSpec
from jaxdist.core.transport.client import WorkerClient
from jaxdist.core.weights.uri import WeightInfo, parse_uri
from jaxdist.export.model import Model

__all__ = ["WorkerHeaders", "check_model_on", "check_stages_on"]


def check_model_on(clients: Sequence[WorkerClient], model: Model) -> None:
    """Refuse, before tracing and shipping, a model whose files a worker does not hold.

    Every file the weight URIs name is described (headers only) on every worker; the first
    that is missing or unreadable raises, naming the worker and the path.

    Raises:
        SpecError: a worker lacks a file, or cannot read it (the worker's own error inside).
    """
    files = [p.uri for u in model.units for p in u.params.values()]
    for client in clients:
        _check_files(client, files)


def check_stages_on(clients: Sequence[WorkerClient], specs: Sequence[StageSpec]) -> None:
    """Refuse, before any artifact is shipped or stage compiled, stages whose weight files
    their worker does not hold: stage k goes to ``clients[k % len(clients)]``, as
    :meth:`jaxdist.coordinator.cluster.Cluster.deploy_manifest` places it by default.

    Raises:
        SpecError: a worker lacks a file its stages bind, or cannot read it (naming the worker
            and the path; the worker's own error inside).
    """
    uris: dict[int, list[str]] = {}
    for k, spec in enumerate(specs):
        uris.setdefault(k % len(clients), []).extend(w.uri for w in spec.weights)
    for i, stage_uris in uris.items():
        _check_files(clients[i], stage_uris)


def _check_files(client: WorkerClient, uris: Sequence[str]) -> None:
    """Describe (headers only) each file the weight URIs name on the worker; a ``file://``
    weight, a raw array with no header, is found when its stage binds it."""
    for f in dict.fromkeys(parse_uri(u).path for u in uris if parse_uri(u).scheme != "file"):
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
