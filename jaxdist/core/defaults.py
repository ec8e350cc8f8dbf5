"""Defaults shared by the coordinator's classes and the CLI, written once.

Example:
    >>> HEARTBEAT_TIMEOUT_S
    5.0
"""

from __future__ import annotations

__all__ = ["HEARTBEAT_TIMEOUT_S"]

HEARTBEAT_TIMEOUT_S = 5.0
"""A worker silent this long on a pipeline's subscription (no heartbeat, no result) is declared
frozen, and the pipeline fails over or fails. Workers send a heartbeat every 0.5 s while idle."""
