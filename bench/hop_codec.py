"""The coordinator-side codec cost of one Llama decode hop: per-step control as seven tensors
(before issue #12's control header) against the same control in the frame's typed header.

One hop of SmolLM2 at batch 1 carries ``x (1, 1, 576) float32``. Before, it also carried
``slot``, ``pos``, ``length``, ``temperature``, ``top_k``, ``top_p`` and ``seed`` as tensors; now
they are the ``StepControl`` header. Each way is timed as what a hop costs in Python on each
side: ``split_frame``, ``parse_frame``, ``FrameAssembler.add`` (and ``control.decode`` for the
header), interleaved round by round. No gRPC, no compute: this is the part of a hop the change
touches.

Usage::

    python bench/hop_codec.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cli, emit, machine, median, record  # noqa: E402

from jaxdist.core import control  # noqa: E402
from jaxdist.core.transport import frames  # noqa: E402


def _hop(x: np.ndarray, ctl: dict[str, np.ndarray], *, header: bool) -> Callable[[], int]:
    def run() -> int:
        if header:
            h = frames.FrameHeader("p", "s", 1, 1, 5, "r", control=control.encode(ctl))
            tensors = {"x": x}
        else:
            h = frames.FrameHeader("p", "s", 1, 1, 5, "r")
            tensors = {"x": x, **ctl}
        (msg,) = frames.split_frame(h, tensors)
        done = frames.FrameAssembler().add(frames.parse_frame(msg))
        assert done is not None
        if header:
            control.decode(done[0].control)
        return len(msg)
    return run


def run(opts: argparse.Namespace) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    x = np.zeros((1, 1, 576), np.float32)
    ctl = {k: np.zeros(1, dtype) for k, dtype in control.FIELDS.items()}
    ways = {"tensors": _hop(x, ctl, header=False), "header": _hop(x, ctl, header=True)}
    rounds, n = (5, 500) if opts.quick else (15, 2000)
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(rounds):
        for name in (list(ways) if r % 2 else list(ways)[::-1]):
            t0 = time.perf_counter()
            for _ in range(n):
                ways[name]()
            times[name].append((time.perf_counter() - t0) / n)
    old, new = median(times["tensors"]), median(times["header"])
    emit(record("hop_codec_us_control_header", new * 1e6, "us", "control as 7 tensors",
                old * 1e6, new / old, "< 1x", new < old,
                bytes_header=ways["header"](), bytes_tensors=ways["tensors"](), **machine()),
         records)
    return records


if __name__ == "__main__":
    sys.exit(cli(__doc__, run))
