"""The generic jaxdist worker. Installed as ``jaxdist.worker``; run with ``python -m jaxdist.worker``."""
