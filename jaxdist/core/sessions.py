"""Per-session resident state (a KV cache) for the stages on one worker, under the worker's limits.

A session that would cross a limit is refused when it starts, never made room for by dropping
another session's state: dropping it silently would lose that session's KV cache. Sessions a
coordinator forgot (it crashed, or lost its connection) are reclaimed once idle for longer than
the idle timeout. A session that is gone (reclaimed, failed, or dropped with its stage) and used
again gets a :class:`SessionError` that says why; it never restarts from empty state.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jaxdist.core.errors import LimitError, SessionError

__all__ = ["Session", "SessionStore"]

log = logging.getLogger(__name__)

_GONE_MEMORY = 4096  # how many gone ids we remember, to tell "reclaimed" from "unknown"


@dataclass
class Session:
    """One session's state on one stage, and the last step it ran (-1: started, not run yet)."""

    state: dict[str, Any]
    step: int
    nbytes: int = 0
    last_used: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class SessionStore:
    """Sessions of every stage on this worker, keyed by ``(stage_id, session_id)``.

    A session is opened at step 0 (:meth:`open`), must then see steps 1, 2, ... in order
    (:meth:`take`), and is freed by :meth:`end`, by :meth:`drop_stage`, or by :meth:`reclaim_idle`
    once idle for longer than ``idle_timeout`` seconds.

    Args:
        max_sessions: most sessions held at once across all stages of the worker
            (``--max-sessions``).
        max_kv_bytes: most bytes of session state held at once across all sessions and stages
            (``--max-kv-bytes``); 0 means no limit.
        idle_timeout: seconds without a step after which a session is reclaimed
            (``--session-idle-timeout``); 0 means never.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, max_sessions: int, *, max_kv_bytes: int = 0, idle_timeout: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if max_kv_bytes < 0:
            raise ValueError(f"max_kv_bytes must be >= 0 (0: no limit), got {max_kv_bytes}")
        if idle_timeout < 0:
            raise ValueError(f"idle_timeout must be >= 0 (0: never), got {idle_timeout}")
        self.max_sessions = max_sessions
        self.max_kv_bytes = max_kv_bytes
        self.idle_timeout = idle_timeout
        self._clock = clock
        self._live: dict[tuple[str, str], Session] = {}
        self._held = 0  # sum of nbytes of the live sessions
        self._gone: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._live)

    def count(self, stage_id: str) -> int:
        with self._lock:
            return sum(1 for sid, _ in self._live if sid == stage_id)

    @property
    def nbytes(self) -> int:
        """Bytes of session state held now, across all sessions and stages."""
        with self._lock:
            return self._held

    def open(self, stage_id: str, session_id: str, nbytes: int) -> Session:
        """Start a session (step 0): reserve its place and its ``nbytes`` under the limits.

        The caller fills ``state`` and sets ``step`` once the step ran; if the step fails, it
        calls :meth:`end` (or :meth:`lose`).

        Raises:
            SessionError: the session exists already.
            LimitError: the worker holds ``max_sessions`` sessions, or the new session's state
                would take the held bytes over ``max_kv_bytes``.
        """
        key = (stage_id, session_id)
        now = self._clock()
        self.reclaim_idle(now)
        with self._lock:
            if key in self._live:
                raise SessionError(f"session {session_id!r} already exists on stage {stage_id}; "
                                   f"step 0 starts a session (end it first, or use a new id)")
            n = len(self._live)
            if n >= self.max_sessions:
                raise LimitError(
                    f"session {session_id!r} on stage {stage_id} refused: this worker holds {n} "
                    f"sessions, the limit (--max-sessions={self.max_sessions}); end sessions "
                    f"that are done (EndSession), or raise --max-sessions")
            if self.max_kv_bytes and self._held + nbytes > self.max_kv_bytes:
                raise LimitError(
                    f"session {session_id!r} on stage {stage_id} refused: it needs {nbytes} bytes "
                    f"({_mb(nbytes)}) of state, and this worker holds {self._held} bytes "
                    f"({_mb(self._held)}) in {n} sessions, so {self._held + nbytes} bytes would "
                    f"cross the limit (--max-kv-bytes={self.max_kv_bytes}, "
                    f"{_mb(self.max_kv_bytes)}); end sessions that are done, or raise "
                    f"--max-kv-bytes")
            sess = Session({}, -1, nbytes, now)
            self._live[key] = sess
            self._held += nbytes
            self._gone.pop(key, None)
            return sess

    def take(self, stage_id: str, session_id: str, step: int) -> Session:
        """The session for step ``step`` (>= 1), which must follow the last step it ran.

        Raises:
            SessionError: the session is gone (reclaimed, failed, stage unloaded), was never
                started, or the step is out of order.
        """
        key = (stage_id, session_id)
        now = self._clock()
        with self._lock:
            sess = self._live.get(key)
            if sess is None:
                why = self._gone.get(key)
                if why is not None:
                    raise SessionError(f"session {session_id!r} on stage {stage_id} {why}; "
                                       f"start it again from step 0 with its whole history")
                raise SessionError(f"unknown session {session_id!r} on stage {stage_id}: step "
                                   f"{step} of a session that never started here or has ended")
            if step != sess.step + 1:
                raise SessionError(f"session {session_id!r} on stage {stage_id}: expected step "
                                   f"{sess.step + 1}, found step {step}")
            sess.last_used = now
            return sess

    def lose(self, stage_id: str, session_id: str, why: str) -> None:
        """Drop a session whose state is lost, and remember ``why`` for its next step."""
        key = (stage_id, session_id)
        with self._lock:
            sess = self._live.pop(key, None)
            if sess is not None:
                self._held -= sess.nbytes
                self._remember(key, why)

    def end(self, session_id: str, stage_ids: list[str] | None = None) -> tuple[int, int]:
        """Free a session on the given stages (default: all). Returns (stages freed, bytes freed)."""
        with self._lock:
            keys = [k for k in self._live
                    if k[1] == session_id and (stage_ids is None or k[0] in stage_ids)]
            sessions = [self._live.pop(k) for k in keys]
            freed = sum(s.nbytes for s in sessions)
            self._held -= freed
        return len(sessions), freed

    def drop_stage(self, stage_id: str) -> int:
        """Drop the sessions of a stage being unloaded or replaced. Returns how many."""
        with self._lock:
            keys = [k for k in self._live if k[0] == stage_id]
            for k in keys:
                self._held -= self._live.pop(k).nbytes
                self._remember(k, f"was dropped when stage {stage_id} was unloaded or replaced")
        return len(keys)

    def reclaim_idle(self, now: float | None = None) -> list[tuple[str, str]]:
        """Free the sessions idle for longer than ``idle_timeout``. Returns their keys."""
        if not self.idle_timeout:
            return []
        now = self._clock() if now is None else now
        limit = now - self.idle_timeout
        with self._lock:
            keys = [k for k, s in self._live.items() if s.last_used < limit]
            freed = []
            for k in keys:
                sess = self._live.pop(k)
                self._held -= sess.nbytes
                idle = now - sess.last_used
                self._remember(k, f"was reclaimed after {idle:.0f} s without a step "
                                  f"(--session-idle-timeout={self.idle_timeout:g})")
                freed.append((k, idle, sess.nbytes))
        for (stage_id, session_id), idle, nbytes in freed:
            log.warning("reclaimed session %r on stage %s: idle %.0f s, over "
                        "--session-idle-timeout=%g; freed %d bytes of state", session_id,
                        stage_id, idle, self.idle_timeout, nbytes)
        return [k for k, _, _ in freed]

    def _remember(self, key: tuple[str, str], why: str) -> None:
        self._gone[key] = why
        self._gone.move_to_end(key)
        while len(self._gone) > _GONE_MEMORY:
            self._gone.popitem(last=False)
