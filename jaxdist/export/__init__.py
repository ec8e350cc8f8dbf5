"""The export side: a model description turned into stage artifacts.

:mod:`~jaxdist.export.model` (Model, Unit, Param) is what an exporter plugin returns;
:mod:`~jaxdist.export.plugins` finds the plugin for a checkpoint, and
:mod:`~jaxdist.export.causal_lm` is what a causal LM's plugin tells the generator;
:mod:`~jaxdist.export.partition` splits units into stages; :mod:`~jaxdist.export.stages` traces
each stage with ``jax.export`` into a StageSpec. Imports only the core, never gRPC.
"""
