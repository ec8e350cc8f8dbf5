"""bench/gpu.py --tiny: issue #37's GPU benchmark runs end to end on the CPU, so it cannot rot.

Its rows are real clusters of local workers started with ``--device``; here the device is the
CPU (no accelerator on these machines), so half-precision rows run in float32. The numbers are
not checked (no timed asserts); what is checked is that every row ran, produced tokens and a
record, that the step breakdown adds up, and that the RESULTS section renders.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"

pytestmark = pytest.mark.slow


def test_gpu_bench_tiny_runs_every_row(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "gpu.py", "--tiny", "--device", "cpu", "--tokens", "8",
         "--models-dir", str(tmp_path / "models"), "--out", str(out)],
        cwd=BENCH, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    by = {r["metric"]: r for r in records}
    for row in ("bf16_1w", "bf16_2w", "f32_2w", "q4_0_1w", "bf16_batch16"):
        rec = by[f"gpu_{row}_tokens_per_s"]
        assert rec["value"] > 0 and rec["dtype"] == "float32", rec
        assert all(w.endswith("cpu:0") for w in rec["workers"]), rec["workers"]
    assert len(by["gpu_bf16_2w_tokens_per_s"]["workers"]) == 2
    assert by["gpu_bf16_batch16_tokens_per_s"]["batch"] == 16
    assert "gpu_f32_mixed_tokens_per_s" not in by  # the device is the CPU: nothing to mix
    split = by["gpu_step_breakdown_ms"]
    assert split["step_ms"] > 0 and split["in_process_step_ms"] > 0
    assert split["coordinator_and_transport_ms"] == pytest.approx(
        split["step_ms"] - split["in_process_step_ms"], abs=1e-3)
    assert split["worker_dispatch_ms"] > 0
    assert by["gpu_transformers_batch1_tokens_per_s"]["torch_device"] == "cpu"
    assert "| bf16_batch16 | float32 | cpu |" in proc.stderr
    assert "Step of bf16_1w" in proc.stderr
