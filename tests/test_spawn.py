"""Local workers (``jaxdist.coordinator.spawn``) leave nothing behind but the log of a worker
that did not exit cleanly."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import signal

import pytest

from jaxdist.coordinator.spawn import spawn_workers, stop_workers


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
