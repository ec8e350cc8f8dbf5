"""Model exporters: read a model's metadata and build pure JAX stage functions plus a weight table.

Installed as ``jaxdist.exporters``. Exporters import ``jaxdist``; ``jaxdist`` never imports them.
"""
