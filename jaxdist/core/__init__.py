"""The shared core: what both the worker and the coordinator side use.

Stage specs (:mod:`~jaxdist.core.spec`), the tensor codec, frames and gRPC plumbing
(:mod:`~jaxdist.core.transport`), errors, device directives, weights, artifacts and their vetting,
the worker-side stage (:mod:`~jaxdist.core.stage`), the content-addressed artifact store and the
CPU kernels. Nothing here imports the coordinator, export or registry side.
"""
