"""Ctrl-C of the ``jaxdist`` command (``jaxdist.cli.main``): one line, exit 130, whatever it
was doing, and its local workers stopped.

Each test runs the real command in a subprocess, waits until its output shows the phase under
test, and sends SIGINT. The command ignores nothing: a suite run as a background job has SIGINT
ignored, and a child inherits that, so the command is started with Python's own SIGINT handler
installed first (see :func:`_start`). The interrupt during a compile is in
``tests/test_load_progress.py``.
"""

from __future__ import annotations

import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

import psutil
import pytest

SMOLLM2_PROMPT = "The capital of France is"  # the default prompt of jaxdist generate


class _Command:
    """The command as a subprocess, its stdout and stderr read as they come."""

    def __init__(self, args: list[str], tmp: pathlib.Path) -> None:
        launcher = ("import runpy, signal, sys\n"
                    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                    f"sys.argv = ['jaxdist', *{args!r}]\n"
                    "runpy.run_module('jaxdist.cli', run_name='__main__')\n")
        # TMPDIR: the local workers' logs and artifact cache go under the test's directory.
        self.proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "TMPDIR": str(tmp)})
        self.stdout = ""
        self.stderr: list[str] = []
        self._changed: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._readers = [threading.Thread(target=self._read_out, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for t in self._readers:
            t.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        while chunk := self.proc.stdout.read(1):  # a streamed token ends no line
            self.stdout += chunk
            self._changed.put(None)
        self._changed.put(None)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)
            self._changed.put(None)
        self._changed.put(None)

    def wait_for(self, seen: Callable[[], bool], what: str, timeout: float = 400) -> None:
        """Until ``seen()`` holds; fails naming ``what`` if the command exits first."""
        while not seen():
            if self.proc.poll() is not None and not any(t.is_alive() for t in self._readers):
                pytest.fail(f"the command exited ({self.proc.returncode}) before {what}:\n"
                            + "".join(self.stderr))
            try:
                self._changed.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"no output for {timeout:g} s while waiting for {what}:\n"
                            + "".join(self.stderr))

    def interrupt(self, timeout: float = 20) -> list[str]:
        """SIGINT; waits (at most ``timeout`` s) for the exit, then returns the stderr lines
        written after the signal."""
        before = len(self.stderr)
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {timeout:g} s after SIGINT:\n" + "".join(self.stderr))
        for t in self._readers:
            t.join(timeout=30)
        return self.stderr[before:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def command(tmp_path: pathlib.Path) -> Callable[..., _Command]:
    started: list[_Command] = []

    def start(*args: str) -> _Command:
        started.append(_Command(list(args), tmp_path))
        return started[-1]

    yield start
    for c in started:
        c.close()


def _workers(c: _Command) -> list[psutil.Process]:
    return [p for p in psutil.Process(c.proc.pid).children() if "jaxdist.worker" in p.cmdline()]


def test_ctrl_c_while_generating_prints_one_line_and_stops_the_workers(command) -> None:
    c = command("generate", "--local", "1", "--max-seq", "512", "--slots", "1", "--buckets",
                "16", "--max-tokens", "480")
    # The prompt is echoed first; text past it is generated.
    c.wait_for(lambda: len(c.stdout) > len(SMOLLM2_PROMPT) + 3, "the first generated text")
    workers = _workers(c)
    assert len(workers) == 1
    after = c.interrupt()
    assert c.proc.returncode == 130, "".join(c.stderr)
    assert after == ["jaxdist: interrupted\n"], after  # no traceback, no warning
    assert c.stdout.endswith("\n")  # the partial text ends its line
    assert not any(psutil.pid_exists(w.pid) for w in workers)  # stopped, and reaped


def test_ctrl_c_during_export_says_interrupted(command, tmp_path: pathlib.Path) -> None:
    c = command("export", "--registry", str(tmp_path / "reg"), "--platforms", "cpu",
                "--max-seq", "64", "--buckets", "16")
    c.wait_for(lambda: any("export stage 0" in line for line in c.stderr), "the export")
    after = c.interrupt()
    assert c.proc.returncode == 130, "".join(c.stderr)
    assert after == ["jaxdist: interrupted\n"], after  # once a bare "jaxdist: "


def test_ctrl_c_while_serve_exports_stops_the_export(command) -> None:
    """jaxdist serve exports in its loader thread, where Ctrl-C does not land: Cluster.interrupt
    stops the export there. Had it waited for the export to end, the deploy would have been
    stopped before loading instead, and the message would say so."""
    pytest.importorskip("uvicorn")
    c = command("serve", "--port", "0", "--local", "1", "--stages", "2", "--max-seq", "64",
                "--buckets", "16")
    c.wait_for(lambda: any("export stage 0" in line for line in c.stderr), "the export")
    workers = _workers(c)
    assert len(workers) == 1
    after = c.interrupt()
    assert c.proc.returncode == 130, "".join(c.stderr)
    assert len(after) == 1 and re.fullmatch(r"jaxdist: interrupted while exporting stage [01]\n",
                                            after[0]), after
    assert "unloading the model" not in "".join(c.stderr)  # nothing was loaded
    assert not any(psutil.pid_exists(w.pid) for w in workers)
