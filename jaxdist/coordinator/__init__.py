"""The coordinator side: a cluster of workers, the pipelines deployed on it, and generation.

:mod:`~jaxdist.coordinator.cluster` (Cluster: dial, place, deploy, spares),
:mod:`~jaxdist.coordinator.pipeline` (Pipeline, Session, failover),
:mod:`~jaxdist.coordinator.engine` (Engine: the long-lived generation loop; its requests in
:mod:`~jaxdist.coordinator.request`, their text in :mod:`~jaxdist.coordinator.detokenizer`),
:mod:`~jaxdist.coordinator.generation` (Generator), :mod:`~jaxdist.coordinator.spawn` (local
worker processes) and :mod:`~jaxdist.coordinator.inprocess` (the same pipeline in one process).
"""
