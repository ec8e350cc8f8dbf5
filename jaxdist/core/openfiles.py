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
import os
import resource
import socket

__all__ = ["DEFER_ACCEPT_S", "FD_RESERVE", "connection_limit", "defer_accept", "raise_fd_limit"]

log = logging.getLogger(__name__)

FD_RESERVE = 256
"""File descriptors kept for the process's own use (weights, artifacts, peers, logs, pipes)
beyond the connections it accepts."""


DEFER_ACCEPT_S = 3600
"""How long the kernel keeps a connection that has sent nothing away from a listener that
defers accepts (:func:`defer_accept`). Long, because the connections of a flood held that long
reach the server together when it ends, and then hold places until the handshake timeout
closes them: measured with 60 s, a new caller waited 2.6 s once, at the 66th second of a
held flood of 1100 (bench/NOTES.md, "Silent connections"). Such a connection costs the
kernel a few hundred bytes meanwhile, and gRPC and TLS clients send at once, so none waits."""


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


def defer_accept(port: int, seconds: int = DEFER_ACCEPT_S) -> int:
    """Have the kernel hand this process's listening TCP sockets on ``port`` a connection only
    once the client has sent data (Linux's ``TCP_DEFER_ACCEPT``); the number of listeners set.

    A connection that stays silent then takes no descriptor and no slot of the server's
    connection bound for ``seconds`` (it waits in the kernel's SYN queue, of
    ``net.ipv4.tcp_max_syn_backlog`` entries); one that speaks first, as gRPC and TLS clients
    do, is accepted at once. After ``seconds`` the kernel hands a silent connection over, and
    the server's handshake timeout closes it. Only for protocols in which the client speaks
    first: a server that sends a greeting first would wait ``seconds`` for every client.

    The listeners are found among the process's descriptors (``/proc/self/fd``), so it works
    on a socket a library opened (gRPC's). Returns 0 where the platform has neither: macOS,
    Windows.
    """
    option = getattr(socket, "TCP_DEFER_ACCEPT", None)
    if option is None or not os.path.isdir("/proc/self/fd"):
        return 0
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = os.dup(int(name))  # a copy: closing it keeps the original open
        except OSError:
            continue  # closed meanwhile
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            continue  # not a socket
        with sock:
            try:
                if (sock.family in (socket.AF_INET, socket.AF_INET6)
                        and sock.type == socket.SOCK_STREAM
                        and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                        and sock.getsockname()[1] == port):
                    sock.setsockopt(socket.IPPROTO_TCP, option, seconds)
                    n += 1
            except OSError:
                continue
    return n
