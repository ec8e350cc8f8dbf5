"""The process's open-file limit, and how many connections a server may hold under it.

Linux starts most processes at a soft limit of 1024 open files, which a few hundred idle
connections exhaust. A server raises its soft limit to the hard one (:func:`raise_fd_limit`),
then holds at most the limit less :data:`FD_RESERVE` connections (:func:`connection_limit`), so
that accepting one never fails for want of a descriptor and the process keeps descriptors for
its own files, pipes and channels.

Example:
    >>> soft = raise_fd_limit()
    >>> connection_limit() == max(64, soft - FD_RESERVE)
    True
"""

from __future__ import annotations

import logging
import resource

__all__ = ["FD_RESERVE", "connection_limit", "raise_fd_limit"]

log = logging.getLogger(__name__)

FD_RESERVE = 256
"""File descriptors kept for the process's own use (weights, artifacts, peers, logs, pipes)
beyond the connections it accepts."""


def raise_fd_limit() -> int:
    """Raise the soft limit of open files to the hard one (capped at 65536); the new soft limit.

    The hard limit is the administrator's bound and stays. A limit that cannot be raised is
    logged (``WARNING``) and kept."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else 65536, 65536)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, exc)
    return soft


def connection_limit(reserve: int = FD_RESERVE) -> int:
    """Connections a server holds at once: the soft open-file limit less ``reserve`` (at least
    64)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, soft - reserve)
