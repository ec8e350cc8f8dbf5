"""The device of the workers jaxdist starts here (issue #37 item 3): ``--device`` and
``--gpu-memory-fraction`` on the commands that spawn local workers, ``device=`` and
``gpu_memory_fraction=`` in ``LLM`` and ``Cluster.local``, the device check before any worker
starts (``jaxdist.coordinator.spawn.check_device``), the worker's ``--gpu-memory-fraction``,
and the memory ``jaxdist status`` shows.

This machine has no GPU (neither has CI): a directive for one is the error path here, and the
GPU memory line of ``jaxdist status`` is checked with a faked device (said where it is).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from deploy_utils import assert_one_line_error, cli
from models import mlp, mlp_reference

from jaxdist import LLM
from jaxdist.cli.status import memory_line
from jaxdist.coordinator.cluster import Cluster
from jaxdist.core import config
from jaxdist.core.devices import available_devices, device_platform, resolve_device
from jaxdist.core.errors import DeviceError

PRESENT = sorted({f"{device_platform(d)}:0" for d in available_devices()})
MISSING = [p for p in ("cuda", "tpu", "rocm") if f"{p}:0" not in PRESENT]
AUTO = device_platform(resolve_device("auto"))  # what auto resolves to here

needs_missing = pytest.mark.skipif(not MISSING, reason="this machine has cuda, tpu and rocm")


def _present_named(message: str) -> bool:
    return all(p in message for p in PRESENT) and "Devices present: " in message


# -- a directive this machine cannot honour: one line, before any worker starts ------------------


@needs_missing
def test_error_generate_device_absent_is_one_line_without_traceback() -> None:
    """The real command, as a user runs it: a fresh process, the default model, local workers
    (no --workers). Nothing is printed before the error: no worker was spawned."""
    missing = MISSING[0]  # cuda here
    proc = subprocess.run([sys.executable, "-m", "jaxdist.cli", "generate", "--device", missing,
                           "--prompt", "Hello"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"jaxdist: error: --device {missing}: device directive "
                           f"'{missing}' cannot be honoured: no {missing} device is present"), line
    assert _present_named(line), line


@needs_missing
@pytest.mark.parametrize("command", [
    ("generate", "--prompt-ids", "1,2"),
    ("chat",),
    ("serve", "--port", "0"),
    ("embed", "--model", "no-such-encoder", "--text", "hi"),  # refused before it is looked for
    ("demo",),
])
def test_error_every_spawning_command_checks_its_device(command: tuple[str, ...]) -> None:
    missing = MISSING[-1]
    proc = cli(*command, "--device", f"{missing}:1")
    assert_one_line_error(proc, f"--device {missing}:1: device directive '{missing}:1' cannot "
                                f"be honoured")
    assert _present_named(proc.stderr)
    assert "spawning" not in proc.stderr and "listening" not in proc.stderr


def test_error_malformed_device_names_the_flag() -> None:
    proc = cli("demo", "--device", "gpu")
    assert_one_line_error(proc, "--device gpu: device directive 'gpu' is ambiguous")


@pytest.mark.parametrize("flag, value", [("--device", "cpu"), ("--gpu-memory-fraction", "0.5")])
def test_error_device_flags_with_running_workers(flag: str, value: str) -> None:
    proc = cli("generate", "--prompt-ids", "1,2", "--workers", "127.0.0.1:1", flag, value)
    assert_one_line_error(proc, f"{flag} {value}: it sets up the workers this command starts "
                                f"(--local, --ray); running --workers chose theirs")
    assert "connecting" not in proc.stderr


@needs_missing
def test_error_llm_and_cluster_local_name_the_directive_and_the_devices() -> None:
    missing = "tpu" if "tpu" in MISSING else MISSING[0]
    with pytest.raises(DeviceError, match=rf"'{missing}' cannot be honoured: no {missing} "
                                          rf"device is present") as exc:
        LLM(device=missing)  # before the model is read
    assert _present_named(str(exc.value))
    missing = MISSING[0]
    with pytest.raises(DeviceError, match=rf"'{missing}:1' cannot be honoured") as exc:
        Cluster.local(1, device=f"{missing}:1")
    assert _present_named(str(exc.value))


def test_error_cpu_index_out_of_range_before_any_worker_starts() -> None:
    n = sum(device_platform(d) == "cpu" for d in available_devices())
    with pytest.raises(DeviceError, match=rf"'cpu:{n}' cannot be honoured: index {n} is out of "
                                          rf"range, this machine has {n} cpu device"):
        Cluster.local(1, device=f"cpu:{n}")


def test_error_llm_device_with_running_workers() -> None:
    with pytest.raises(DeviceError, match=r"LLM: device='cpu' sets up local workers; the "
                                          r"running workers \['127.0.0.1:1'\] chose theirs"):
        LLM(workers=["127.0.0.1:1"], model_path="m.gguf", device="cpu")


# -- --gpu-memory-fraction, refused by name -------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "1.5", "abc", "nan"])
def test_error_cli_gpu_memory_fraction_out_of_range(value: str) -> None:
    proc = cli("demo", "--gpu-memory-fraction", value)
    assert_one_line_error(proc, f"--gpu-memory-fraction {value}: expected the fraction of the "
                                f"GPU's memory each worker preallocates, 0 < F <= 1")


def test_error_cli_gpu_memory_fraction_against_the_users_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5")
    proc = cli("demo", "--gpu-memory-fraction", "0.3")
    assert_one_line_error(proc, "--gpu-memory-fraction 0.3: the environment already sets "
                                "XLA_PYTHON_CLIENT_MEM_FRACTION=.5; unset it, or drop "
                                "--gpu-memory-fraction")


@pytest.mark.parametrize("value", [0, 1.5, -0.1])
def test_error_python_gpu_memory_fraction_out_of_range(value: float) -> None:
    with pytest.raises(DeviceError, match=rf"^gpu_memory_fraction={value!r}: expected"):
        Cluster.local(1, gpu_memory_fraction=value)


def _worker(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A worker that exits before it serves (its arguments are refused)."""
    return subprocess.run([sys.executable, "-m", "jaxdist.worker", "--listen", "127.0.0.1:0",
                           "--device", "cpu", *args], capture_output=True, text=True,
                          timeout=120, env=env, check=False)


@pytest.mark.parametrize("value", ["0", "1.5", "abc"])
def test_error_worker_gpu_memory_fraction_out_of_range(value: str) -> None:
    proc = _worker("--gpu-memory-fraction", value)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"jaxdist-worker: --gpu-memory-fraction {value}: expected "
                                   f"the fraction of the GPU's memory each worker "
                                   f"preallocates, 0 < F <= 1, such as 0.3")
    assert "listening" not in proc.stdout


def test_error_worker_gpu_memory_fraction_against_the_users_environment() -> None:
    env = {**config.inherited_environ(), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    proc = _worker("--gpu-memory-fraction", "0.3", env=env)
    assert proc.returncode == 2, proc.stderr
    assert "the environment already sets XLA_PYTHON_CLIENT_PREALLOCATE=false" in proc.stderr


# -- working local workers ------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_demo_on_local_workers_of_a_device(device: str) -> None:
    """The demo checks its pipeline against numpy itself, and says ok."""
    proc = cli("demo", "--local", "1", "--device", device, "--width", "32", "--layers", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "ok"


def test_workers_with_a_gpu_memory_fraction_run_and_status_shows_their_device(
        mlp_root: pathlib.Path) -> None:
    """On a cpu the fraction is harmless: the workers start, say what they chose, and run."""
    with Cluster.local(2, weights_roots=[str(mlp_root)], device="auto", gpu_memory_fraction=0.3,
                       log_level="INFO") as cluster:
        for w in cluster.local_workers:
            args = w.process.args
            assert isinstance(args, list)
            assert args[args.index("--gpu-memory-fraction") + 1] == "0.3"
            assert args[args.index("--device") + 1] == "auto"
            log = pathlib.Path(w.log_path).read_text()  # written before its ready line
            assert ("GPU memory: 30% of the GPU preallocated (XLA_PYTHON_CLIENT_PREALLOCATE=true, "
                    "XLA_PYTHON_CLIENT_MEM_FRACTION=0.3)") in log
        assert [w.device for w in cluster.local_workers] == [f"{AUTO}:0"] * 2
        x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
        with cluster.deploy(mlp()) as pipe:
            np.testing.assert_allclose(pipe.call(x=x)["x"], mlp_reference(mlp_root, x),
                                       rtol=1e-5, atol=1e-5)
        workers = ",".join(cluster.addresses)
        table, as_json = cli("status", "--workers", workers), cli("status", "--workers",
                                                                   workers, "--json")
    assert table.returncode == 0 and as_json.returncode == 0, table.stderr + as_json.stderr
    for reply in json.loads(as_json.stdout):
        assert reply["default_device"] == f"{AUTO}:0"
        (device,) = [d for d in reply["devices"] if d.get("index", 0) == 0]
        assert device["platform"] == AUTO
        if AUTO == "cpu":  # RAM, as before
            assert device["memory_source"] == "host"
            assert 0 < device["memory_free"] <= device["memory_total"]
    memory = [line for line in table.stdout.splitlines() if line.startswith("  memory: ")]
    assert len(memory) == 2, table.stdout
    if AUTO == "cpu":
        assert all(" free of " in line and "; worker RSS " in line for line in memory), memory


# -- what jaxdist status shows of a GPU worker ----------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _FakeClient:
    platform_version: str


@dataclasses.dataclass(frozen=True, eq=False)
class _FakeCuda:
    """A CUDA device as jax 0.10 reports one: faked, since this machine has no GPU. Its
    allocator has a 60 GiB limit and this process holds 1.5 GiB there."""

    id: int
    platform: str = "gpu"
    device_kind: str = "NVIDIA H100"
    client: _FakeClient = _FakeClient("PJRT C API\ncuda 12080")

    def memory_stats(self) -> dict[str, int]:
        return {"bytes_limit": 60 << 30, "bytes_in_use": 3 << 29}


def test_status_shows_what_a_gpu_worker_holds_on_its_device(tmp_path: pathlib.Path) -> None:
    """The worker's Info (a real servicer, over gRPC) carries the bytes its process holds on
    the device, and the table shows them, not the device's free memory."""
    from jaxdist.core.transport.client import WorkerClient
    from jaxdist.worker.config import WorkerConfig
    from jaxdist.worker.server import create_server

    config_ = WorkerConfig(artifact_cache=str(tmp_path), session_idle_timeout=0,
                           device="cuda:1", devices=[_FakeCuda(0), _FakeCuda(1)])
    server, servicer, address = create_server("127.0.0.1:0", config_, data_listen=None)
    client = WorkerClient(address)
    try:
        reply = client.info()
    finally:
        client.close()
        server.stop(grace=0).wait(10)
        servicer.close()
    assert reply.default_device == "cuda:1"
    device = next(d for d in reply.devices if d.index == 1)
    assert (device.memory_source, device.memory_used, device.memory_total) == \
        ("device", 3 << 29, 60 << 30)
    assert memory_line(reply) == (f"1.5 GB held on cuda:1 (weights, KV caches, executables) of "
                                  f"its allocator's 60.0 GB; worker RSS "
                                  f"{_fmt(reply.rss_bytes)}")


def _fmt(n: int) -> str:
    from jaxdist.cli.common import fmt_bytes

    return fmt_bytes(n)


def test_status_of_a_worker_without_memory_source_reads_as_before() -> None:
    """A worker from before ``memory_source`` (or a device without memory stats) shows free
    of total, as ``jaxdist status`` always did."""
    from jaxdist.proto import jaxdist_pb2 as pb

    reply = pb.InfoReply(default_device="cpu:0", rss_bytes=300 << 20, devices=[
        pb.DeviceInfo(platform="cpu", index=0, kind="cpu", memory_total=16 << 30,
                      memory_free=12 << 30)])
    assert memory_line(reply) == "12.0 GB free of 16.0 GB; worker RSS 300.0 MB"
    assert memory_line(pb.InfoReply(default_device="cpu:0")) is None
