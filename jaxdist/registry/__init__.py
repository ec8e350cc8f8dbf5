"""The registry side: exported artifacts and manifests, stored and published.

:mod:`~jaxdist.registry.local` (LocalRegistry, a directory), :mod:`~jaxdist.registry.url`
(UrlRegistry, any fsspec URL), :mod:`~jaxdist.registry.layout` (what both share),
:mod:`~jaxdist.registry.manifest` (a deployable model) and :mod:`~jaxdist.registry.publish`
(export a model into a registry, offline). A worker's own artifact cache is the core's
:class:`jaxdist.core.store.LocalStore`, so a worker loads nothing from here.
"""
