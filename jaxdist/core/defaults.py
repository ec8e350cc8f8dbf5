"""Defaults shared by the coordinator's classes and the CLI, written once.

Example:
    >>> HEARTBEAT_TIMEOUT_S
    5.0
"""

from __future__ import annotations

__all__ = ["HEARTBEAT_TIMEOUT_S", "LEASE_S"]

HEARTBEAT_TIMEOUT_S = 5.0
"""A worker silent this long on a pipeline's subscription (no heartbeat, no result) is declared
frozen, and the pipeline fails over or fails. Workers send a heartbeat every 0.5 s while idle."""

LEASE_S = 30.0
"""Stages a coordinator loads for its own run are leased: a worker unloads them once no
coordinator has subscribed to their pipeline for this long (the coordinator died or was cut off).
``jaxdist deploy`` pins its stages instead (``Cluster.deploy_manifest(..., pin=True)``)."""
