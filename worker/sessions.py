"""Per-session resident state (a KV cache) for the stages on one worker, evicted LRU."""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from jaxdist.errors import SessionError

__all__ = ["SessionStore", "Session"]

log = logging.getLogger(__name__)

_EVICTED_MEMORY = 4096  # how many evicted ids we remember, to tell "evicted" from "unknown"


@dataclass
class Session:
    """One session's state on one stage, and the last step it ran."""

    state: dict[str, Any]
    step: int
    nbytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class SessionStore:
    """Sessions of every stage on this worker, keyed by ``(stage_id, session_id)``.

    A session is created at step 0, must then see steps 1, 2, ... in order, and is freed by
    :meth:`end` or evicted least-recently-used once more than ``max_sessions`` exist.

    Args:
        max_sessions: most sessions kept at once across all stages of the worker.
    """

    def __init__(self, max_sessions: int) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self._live: collections.OrderedDict[tuple[str, str], Session] = collections.OrderedDict()
        self._evicted: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._live)

    def count(self, stage_id: str) -> int:
        with self._lock:
            return sum(1 for sid, _ in self._live if sid == stage_id)

    def take(self, stage_id: str, session_id: str, step: int) -> Session | None:
        """Return the session for a step (``None`` at step 0: the caller creates it).

        Raises:
            SessionError: the session was evicted, was never started, or the step is out of order.
        """
        key = (stage_id, session_id)
        with self._lock:
            sess = self._live.get(key)
            if step == 0:
                if sess is not None:
                    raise SessionError(f"session {session_id!r} already exists on stage {stage_id}; "
                                       f"step 0 starts a session (end it first, or use a new id)")
                return None
            if sess is None:
                if key in self._evicted:
                    raise SessionError(
                        f"session {session_id!r} was evicted from stage {stage_id} (least recently "
                        f"used, over --max-sessions={self.max_sessions}); start it again")
                raise SessionError(f"unknown session {session_id!r} on stage {stage_id}: step "
                                   f"{step} of a session that never started here or has ended")
            if step != sess.step + 1:
                raise SessionError(f"session {session_id!r} on stage {stage_id}: expected step "
                                   f"{sess.step + 1}, found step {step}")
            self._live.move_to_end(key)
            return sess

    def put(self, stage_id: str, session_id: str, session: Session) -> list[str]:
        """Store a session; evict LRU sessions beyond the limit. Returns the evicted ids."""
        key = (stage_id, session_id)
        evicted = []
        with self._lock:
            self._live[key] = session
            self._live.move_to_end(key)
            self._evicted.pop(key, None)
            while len(self._live) > self.max_sessions:
                old, _ = self._live.popitem(last=False)
                self._remember(old)
                evicted.append(old[1])
        for sid in evicted:
            log.info("evicted session %r (over max_sessions=%d)", sid, self.max_sessions)
        return evicted

    def _remember(self, key: tuple[str, str]) -> None:
        self._evicted[key] = None
        while len(self._evicted) > _EVICTED_MEMORY:
            self._evicted.popitem(last=False)

    def end(self, session_id: str, stage_ids: list[str] | None = None) -> tuple[int, int]:
        """Free a session on the given stages (default: all). Returns (stages freed, bytes freed)."""
        with self._lock:
            keys = [k for k in self._live
                    if k[1] == session_id and (stage_ids is None or k[0] in stage_ids)]
            sessions = [self._live.pop(k) for k in keys]
        return len(sessions), sum(s.nbytes for s in sessions)

    def drop_stage(self, stage_id: str) -> int:
        with self._lock:
            keys = [k for k in self._live if k[0] == stage_id]
            for k in keys:
                del self._live[k]
        return len(keys)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._live.values())
