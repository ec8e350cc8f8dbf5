"""The progress line the ``jaxdist`` subcommands draw on stderr while they export and deploy."""

from __future__ import annotations

import os
import sys
import threading
import time
from types import TracebackType
from typing import Any, Self

__all__ = ["ProgressBar"]

LIVE = "..."  # a part of the text that ends so is under way: it gets a moving timer


class ProgressBar:
    """A one-line progress display, for ``Cluster.deploy(progress=...)``.

    The text may hold several parts joined by ``" | "``, one per stage being loaded
    (:mod:`jaxdist.coordinator.loading`); a part that ends with ``...`` is under way. On a
    terminal the line is redrawn about twice a second, each part under way followed by the
    seconds since it began, so a long compile shows a moving timer. Off a terminal (a pipe, a
    log file) it writes one line per change of the text, never the same line twice.

    Use it in a ``with`` block (or call :meth:`close`): that stops the redrawing and ends the
    line, so nothing is drawn over what comes next.

    Example:
        >>> with ProgressBar() as bar:  # doctest: +SKIP
        ...     pipe = cluster.deploy(model, progress=bar)
    """

    REDRAW_S = 0.5
    WIDTH = 24

    def __init__(self, stream: Any = sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._shown: tuple[str, int, int] | None = None
        self._since: dict[str, float] = {}  # each part of the text: when it first read so
        self._open = False                  # a terminal line not ended yet
        self._closed = threading.Event()
        self._redraw: threading.Thread | None = None

    def __call__(self, what: str, done: int, total: int) -> None:
        with self._lock:
            if self._shown == (what, done, total):
                return
            now = time.perf_counter()
            self._since = {p: self._since.get(p, now) for p in what.split(" | ")}
            self._shown = (what, done, total)
            self._draw(now)
            if self.tty and LIVE in what and self._redraw is None and not self._closed.is_set():
                self._redraw = threading.Thread(target=self._redraw_loop, daemon=True,
                                                name="progress-redraw")
                self._redraw.start()

    def _draw(self, now: float) -> None:
        assert self._shown is not None  # drawn only once something was shown
        what, done, total = self._shown
        filled = int(self.WIDTH * done / max(total, 1))
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        if self.tty:
            what = " | ".join(f"{p} {now - self._since[p]:.0f}s" if p.endswith(LIVE) else p
                              for p in what.split(" | "))
        line = f"[{bar}] {done}/{total} {what} ({now - self.t0:.1f}s)"
        if self.tty:
            columns = self._columns()  # a line that wraps could not be redrawn in place
            self.stream.write("\r\033[K" + (line[:columns - 1] if columns > 1 else line))
            self._open = not (done >= total and total)
            if not self._open:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _columns(self) -> int:
        """The terminal's width, 0 when unknown."""
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            return 0

    def _redraw_loop(self) -> None:
        while not self._closed.wait(self.REDRAW_S):
            with self._lock:
                if self._open and self._shown is not None and LIVE in self._shown[0]:
                    self._draw(time.perf_counter())

    def close(self) -> None:
        """Stop redrawing, and end the line if it is open."""
        self._closed.set()
        if self._redraw is not None and self._redraw is not threading.current_thread():
            self._redraw.join()
        with self._lock:
            if self._open:
                self.stream.write("\n")
                self.stream.flush()
                self._open = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
