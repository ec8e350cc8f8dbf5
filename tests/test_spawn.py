"""Local workers (``jaxdist.coordinator.spawn``) leave nothing behind but the log of a worker
that did not exit cleanly, die with a coordinator killed with SIGKILL, and run the installed
package whatever the working directory holds."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from jaxdist.coordinator.spawn import spawn_workers, stop_workers
from jaxdist.core.transport.client import WorkerClient
from jaxdist.launch.process import DIES_WITH_PARENT

linux_only = pytest.mark.skipif(not DIES_WITH_PARENT,
                                reason="a worker dies with its parent on Linux only (prctl)")


def test_clean_stop_removes_the_logs_and_the_artifact_cache() -> None:
    workers = spawn_workers(2)
    scratch = pathlib.Path(workers[0].log_path).parent
    assert {pathlib.Path(w.log_path).parent for w in workers} == {scratch}
    assert (scratch / "artifacts").is_dir()
    stop_workers(workers[:1])
    assert scratch.is_dir()  # the second worker still writes there
    stop_workers(workers[1:])
    assert [w.process.returncode for w in workers] == [0, 0]
    assert not scratch.exists()


def test_the_log_of_a_worker_that_died_is_kept_and_named(
        caplog: pytest.LogCaptureFixture) -> None:
    workers = spawn_workers(2)
    scratch = pathlib.Path(workers[0].log_path).parent
    try:
        workers[0].process.send_signal(signal.SIGKILL)
        workers[0].process.wait()
        with caplog.at_level(logging.WARNING, logger="jaxdist.coordinator.spawn"):
            stop_workers(workers)
        assert sorted(os.listdir(scratch)) == [os.path.basename(workers[0].log_path)]
        assert (f"local worker pid {workers[0].pid} exited with status -9; its log is kept at "
                f"{workers[0].log_path}") in caplog.text
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_an_artifact_cache_given_by_the_caller_is_left_alone(tmp_path: pathlib.Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "keep").write_text("mine")
    (w,) = spawn_workers(1, artifact_cache=str(cache))
    scratch = pathlib.Path(w.log_path).parent
    stop_workers([w])
    assert not scratch.exists()
    assert (cache / "keep").read_text() == "mine"


def _ended(pid: int, timeout: float = 60) -> bool:
    """Whether process ``pid`` ends within ``timeout`` s (polled; a zombie has ended: its
    parent, the init process, may not have reaped it yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
            proc.wait(timeout=0.2)
            return True
        except psutil.NoSuchProcess:
            return True
        except psutil.TimeoutExpired:
            continue
    return False


@linux_only
def test_workers_die_with_serve_killed_with_sigkill(tmp_path: pathlib.Path) -> None:
    """No clean-up runs in a coordinator killed with SIGKILL: the kernel ends its workers
    (PR_SET_PDEATHSIG). serve spawns them from its loader thread, which is alive here."""
    pytest.importorskip("uvicorn")
    proc = subprocess.Popen([sys.executable, "-m", "jaxdist.cli", "serve", "--local", "2",
                             "--port", "0", "--max-seq", "64", "--buckets", "16"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.stderr is not None
    try:
        lines = []
        for line in proc.stderr:  # the workers are up once the model is exported
            lines.append(line)
            if "export stage 0" in line:
                break
        else:
            pytest.fail(f"serve exited before it exported:\n{''.join(lines)}")
        workers = [p for p in psutil.Process(proc.pid).children()
                   if "jaxdist.worker" in p.cmdline()]
        assert len(workers) == 2, workers
    finally:
        proc.kill()
        proc.wait()
    assert all(_ended(w.pid) for w in workers), "a worker outlived its coordinator"


@linux_only
def test_a_worker_spawned_from_a_thread_outlives_the_thread() -> None:
    """The parent-death signal follows the thread that started a worker: workers spawned from
    a thread that then ends (serve's loader, a library user's pool) must live on."""
    spawned: list = []
    t = threading.Thread(target=lambda: spawned.extend(spawn_workers(1)))
    t.start()
    t.join(timeout=180)
    (w,) = spawned
    try:
        # Gone from the kernel too: the signal, had it been armed, was sent by now.
        task = pathlib.Path(f"/proc/self/task/{t.native_id}")
        deadline = time.monotonic() + 30
        while task.exists() and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        assert not task.exists()
        client = WorkerClient(w.address)
        try:
            assert client.info().address == w.address  # it answers: no SIGKILL came
        finally:
            client.close()
    finally:
        stop_workers([w])
    assert w.process.returncode == 0  # it drained on SIGTERM, not killed


def test_a_folder_named_jaxdist_in_the_working_directory_does_not_shadow_the_package(
        tmp_path: pathlib.Path) -> None:
    """Run from the directory that holds a clone, ``python -m jaxdist.worker`` imported the
    clone's folder instead of the installed package (Info: no attribute '__version__')."""
    (tmp_path / "jaxdist").mkdir()
    (tmp_path / "jaxdist" / "__init__.py").write_text('"""Not the package."""\n')
    script = pathlib.Path(sys.executable).with_name("jaxdist")  # as a user runs it
    assert script.is_file(), f"no jaxdist console script next to {sys.executable}"
    proc = subprocess.run([str(script), "demo", "--local", "1", "--width", "32", "--layers",
                           "2"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "ok"
