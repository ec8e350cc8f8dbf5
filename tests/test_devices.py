"""Tests for jaxdist.core.devices: parsing, resolution on this machine and on faked machines."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from jaxdist.core.devices import (
    DeviceDirective,
    available_devices,
    describe_device,
    device_platform,
    parse_directive,
    resolve_device,
)
from jaxdist.core.errors import DeviceError

# --- fakes: only what devices.py reads (platform, id, device_kind, client.platform_version)


@dataclasses.dataclass(frozen=True)
class FakeClient:
    platform_version: str


@dataclasses.dataclass(frozen=True, eq=False)
class FakeDevice:
    platform: str
    id: int
    device_kind: str
    client: FakeClient = FakeClient("")

    def memory_stats(self) -> dict[str, int] | None:
        if self.platform == "cpu":
            return None
        return {"bytes_limit": 16 << 30, "bytes_in_use": 1 << 30}


def cpu(i: int = 0) -> FakeDevice:
    return FakeDevice("cpu", i, "cpu", FakeClient("cpu"))


def cuda(i: int) -> FakeDevice:
    # What jax 0.10 reports for a CUDA device: platform "gpu", vendor in platform_version.
    return FakeDevice("gpu", i, "NVIDIA H100", FakeClient("PJRT C API\ncuda 12080"))


def rocm(i: int) -> FakeDevice:
    return FakeDevice("gpu", i, "AMD MI300X", FakeClient("PJRT C API\nrocm 60300"))


def tpu(i: int) -> FakeDevice:
    return FakeDevice("tpu", i, "TPU v5 lite", FakeClient("TFRT TPU v5 lite"))


def metal(i: int) -> FakeDevice:
    return FakeDevice("METAL", i, "Metal", FakeClient("metal_0.1"))


# --- parsing


@pytest.mark.parametrize(
    ("text", "platform", "index"),
    [
        ("auto", "auto", None),
        ("cpu", "cpu", None),
        ("cuda", "cuda", None),
        ("cuda:1", "cuda", 1),
        ("rocm", "rocm", None),
        ("tpu:3", "tpu", 3),
        ("metal", "metal", None),
        ("  CUDA:0 \n", "cuda", 0),
        ("Auto", "auto", None),
        ("cpu:0", "cpu", 0),
    ],
)
def test_parse_valid(text: str, platform: str, index: int | None) -> None:
    directive = parse_directive(text)
    assert directive == DeviceDirective(platform, index)


def test_directive_str_round_trips() -> None:
    for text in ("auto", "cpu", "cuda:1", "tpu"):
        assert str(parse_directive(text)) == text
        assert parse_directive(str(parse_directive(text))) == parse_directive(text)


@pytest.mark.parametrize(
    "text", ["cuda:x", "cuda:-1", "npu", "", "   ", "cuda:", "cuda:1:2", "cpu 1", "cuda:١"]
)
def test_error_malformed(text: str) -> None:
    with pytest.raises(DeviceError) as info:
        parse_directive(text)
    message = str(info.value)
    assert repr(text) in message
    assert "expected one of: auto, cpu, cuda, rocm, tpu, metal" in message
    assert "cuda:1" in message


def test_error_gpu_is_ambiguous() -> None:
    with pytest.raises(DeviceError, match=r"'gpu:1' is ambiguous.*write cuda:1 or rocm:1"):
        parse_directive("gpu:1")


def test_error_auto_with_index() -> None:
    with pytest.raises(DeviceError, match="auto takes no index"):
        parse_directive("auto:0")


def test_error_not_a_string() -> None:
    with pytest.raises(DeviceError, match="must be a string, got int"):
        parse_directive(1)  # type: ignore[arg-type]


def test_error_directive_constructed_with_bad_fields() -> None:
    with pytest.raises(DeviceError, match="'gpu' is not known"):
        DeviceDirective("gpu")
    with pytest.raises(DeviceError, match="non-negative integer"):
        DeviceDirective("cuda", -1)


# --- platform mapping


def test_device_platform_mapping() -> None:
    assert device_platform(cpu()) == "cpu"
    assert device_platform(cuda(0)) == "cuda"
    assert device_platform(rocm(0)) == "rocm"
    assert device_platform(tpu(0)) == "tpu"
    assert device_platform(metal(0)) == "metal"
    unknown_gpu = FakeDevice("gpu", 0, "?", FakeClient("oneapi 2025"))
    assert device_platform(unknown_gpu) == "gpu"


def test_device_platform_real_cpu() -> None:
    assert device_platform(jax.devices("cpu")[0]) == "cpu"


# --- resolution on the real machine (cpu only here)


def test_resolve_real_cpu() -> None:
    device = resolve_device("cpu")
    assert device == jax.local_devices(backend="cpu")[0]
    assert resolve_device("cpu:0") == device
    assert resolve_device(DeviceDirective("cpu", 0)) == device


def test_resolve_real_auto_is_best_present() -> None:
    present = {device_platform(d) for d in available_devices()}
    expected = next(p for p in ("tpu", "cuda", "rocm", "cpu") if p in present)
    assert device_platform(resolve_device("auto")) == expected


def test_error_real_missing_platform_lists_present() -> None:
    present = {device_platform(d) for d in available_devices()}
    missing = next(p for p in ("tpu", "rocm", "cuda", "metal") if p not in present)
    with pytest.raises(DeviceError) as info:
        resolve_device(missing)
    message = str(info.value)
    assert f"no {missing} device is present" in message
    assert "Devices present: " in message and "cpu:0" in message


def test_error_real_cpu_index_out_of_range() -> None:
    n = len(jax.local_devices(backend="cpu"))
    with pytest.raises(DeviceError, match=rf"index {n} is out of range.*{n} cpu device"):
        resolve_device(f"cpu:{n}")


def test_describe_real_cpu_round_trips() -> None:
    device = resolve_device("cpu")
    info = describe_device(device)
    assert info["platform"] == "cpu"
    assert info["index"] == 0
    assert info["kind"] == device.device_kind
    # XLA:CPU has no memory_stats, so host RAM (psutil) is reported.
    assert info["memory_source"] == "host"
    assert info["memory_total"] > info["memory_used"] > 0
    assert info["memory_used"] + info["memory_free"] == info["memory_total"]
    assert resolve_device(f"{info['platform']}:{info['index']}") is device


# --- resolution on faked machines


def test_resolve_fake_cuda_index() -> None:
    devices = [cpu(), cuda(0), cuda(1)]
    assert resolve_device("cuda:1", devices) is devices[2]
    assert resolve_device("cuda", devices) is devices[1]
    assert resolve_device("cpu", devices) is devices[0]


def test_resolve_fake_rocm_not_confused_with_cuda() -> None:
    devices = [cpu(), rocm(0), rocm(1)]
    assert resolve_device("rocm:1", devices) is devices[2]
    with pytest.raises(DeviceError, match="no cuda device is present"):
        resolve_device("cuda", devices)


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ([cpu(), cuda(0), tpu(0), rocm(0)], "tpu"),
        ([cpu(), rocm(0), cuda(0)], "cuda"),
        ([rocm(0), cpu()], "rocm"),
        ([cpu()], "cpu"),
        ([metal(0), cpu()], "cpu"),  # auto never picks metal
    ],
)
def test_resolve_fake_auto_preference(devices: list[FakeDevice], expected: str) -> None:
    assert device_platform(resolve_device("auto", devices)) == expected


def test_resolve_fake_metal_by_name() -> None:
    devices = [cpu(), metal(0)]
    assert resolve_device("METAL", devices) is devices[1]


def test_error_fake_missing_platform() -> None:
    devices = [cpu(), cuda(0)]
    with pytest.raises(DeviceError) as info:
        resolve_device("tpu", devices)
    message = str(info.value)
    assert "'tpu' cannot be honoured: no tpu device is present" in message
    assert "Devices present: cpu:0 (cpu), cuda:0 (NVIDIA H100)" in message


def test_error_fake_index_out_of_range() -> None:
    devices = [cpu(), cuda(0), cuda(1)]
    with pytest.raises(DeviceError) as info:
        resolve_device("cuda:2", devices)
    message = str(info.value)
    assert "'cuda:2' cannot be honoured: index 2 is out of range" in message
    assert "2 cuda device(s) (cuda:0..cuda:1)" in message
    assert "cuda:1 (NVIDIA H100)" in message


def test_error_fake_auto_nothing_usable() -> None:
    with pytest.raises(DeviceError, match=r"'auto' cannot be honoured.*Devices present: metal:0"):
        resolve_device("auto", [metal(0)])
    with pytest.raises(DeviceError, match="Devices present: no devices"):
        resolve_device("auto", [])


def test_describe_fake_without_device_list_has_no_index() -> None:
    # A device that is not among this machine's devices has no directive index.
    assert describe_device(cuda(0))["index"] is None


def test_describe_fake_cuda_uses_device_memory() -> None:
    devices = [cpu(), cuda(0), cuda(1)]
    info = describe_device(devices[2], devices)
    assert info == {
        "platform": "cuda",
        "index": 1,
        "id": 1,
        "kind": "NVIDIA H100",
        "memory_total": 16 << 30,
        "memory_used": 1 << 30,
        "memory_free": 15 << 30,
        "memory_source": "device",
    }


# --- InProcessPipeline exports for the platform its directive resolves to


def test_inprocess_pipeline_exports_for_its_device() -> None:
    """With its defaults (``auto``) it runs on any machine: its stages are lowered for the
    platform ``auto`` picks here, not for cpu whatever the device."""
    import numpy as np

    from jaxdist.coordinator.inprocess import InProcessPipeline
    from jaxdist.export.model import Model, Unit

    double = Unit("double", lambda params, state, carry: ({"x": carry["x"] * 2}, {}))
    model = Model("double", [double], inputs={"x": ("b, 4", "float32")})
    platform = device_platform(resolve_device("auto"))
    with InProcessPipeline(model, weights_roots=[]) as pipe:
        assert [s.spec.platforms for s in pipe.stages] == [(platform,)]
        np.testing.assert_array_equal(pipe.call(x=np.ones((1, 4), np.float32))["x"],
                                      np.full((1, 4), 2, np.float32))


def test_inprocess_pipeline_missing_device_is_refused_by_name() -> None:
    from jaxdist.coordinator.inprocess import InProcessPipeline
    from jaxdist.export.model import Model, Unit

    present = {device_platform(d) for d in available_devices()}
    missing = next(p for p in ("tpu", "cuda", "rocm") if p not in present)
    model = Model("m", [Unit("u", lambda p, s, c: (c, {}))], inputs={"x": ("b, 4", "float32")})
    with pytest.raises(DeviceError, match=missing):
        InProcessPipeline(model, weights_roots=[], device=missing)
