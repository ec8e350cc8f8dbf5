"""Failover timing: how long a killed worker takes to be named, and a failover to finish.

Two local workers and one spare run the 4-layer MLP of the tests as 2 stages. Each trial sends
session-less calls in a loop, SIGKILLs the worker of stage 1 (or stage 0, alternating), and
measures:

- ``failover_detect_s``: from the kill to the first call that fails with the dead worker's
  address (``Pipeline.submit`` used, so nothing fails over by itself). Target: within the
  heartbeat timeout (5 s), the product's promise; a broken TCP stream is usually seen in
  milliseconds.
- ``failover_recover_s``: ``Pipeline.recover()`` itself (probe, reload onto the spare,
  reconnect).

The tests assert what happens and in what order (tests/test_failover.py); this script is where
the time is measured, since timed asserts in tests fail on a loaded machine.

Usage::

    python bench/failover.py [--trials 5] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys
import tempfile
import time
from typing import Any

import _common as c

note = c.note("failover")


def _trial(root: pathlib.Path, victim_index: int) -> tuple[float, float]:
    import numpy as np
    from models import mlp  # noqa: PLC0415 - the tests' model maker, as in the tests

    from jaxdist.coordinator.cluster import Cluster  # noqa: PLC0415
    from jaxdist.core.errors import RemoteStageError  # noqa: PLC0415

    x = np.ones((4, 32), np.float32)
    with Cluster.local(2, weights_roots=[str(root)], spares=1) as cluster:
        victim = cluster.local_workers[victim_index]
        with cluster.deploy(mlp(), stages=2) as pipe:
            pipe.call(x=x)
            victim.process.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            while True:
                try:
                    pipe.submit({"x": x}).result(timeout=60)
                except RemoteStageError as exc:
                    if exc.address != victim.address:
                        raise
                    break
            detect = time.monotonic() - t0
            t1 = time.monotonic()
            pipe.recover()
            recover = time.monotonic() - t1
            pipe.call(x=x)
    return detect, recover


def run(opts: argparse.Namespace) -> list[dict[str, Any]]:
    import numpy as np
    from safetensors.numpy import save_file

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from models import D  # noqa: PLC0415 - the tests' MLP width

    trials = 2 if opts.quick else opts.trials
    records: list[dict[str, Any]] = []
    detects, recovers = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        rng = np.random.default_rng(1234)  # the weights of tests/conftest.py's mlp_root
        save_file({f"l{i}.w": (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)
                   for i in range(4)}, str(root / "mlp.safetensors"))
        for t in range(trials):
            d, r = _trial(root, 1 - t % 2)
            note(f"trial {t}: named after {d * 1000:.0f} ms, recovered in {r:.2f} s")
            detects.append(d)
            recovers.append(r)
    m = c.machine()
    c.emit(c.record("failover_detect_s", c.median(detects), "s", "heartbeat timeout", 5.0,
                    c.median(detects) / 5.0, "<= 5 s", max(detects) <= 5.0,
                    samples=[round(x, 4) for x in detects], **m), records)
    c.emit(c.record("failover_recover_s", c.median(recovers), "s", "", None, None, "", None,
                    samples=[round(x, 3) for x in recovers], **m), records)
    return records


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=5, help="kills to time (default 5)")


if __name__ == "__main__":
    sys.exit(c.cli(__doc__, run, add_args))
