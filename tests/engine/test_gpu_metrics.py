"""The GPU collector (backends/engine/gpu_metrics.py): a fake pynvml module
for devices present, the real import for this machine (and CI), where it
reports itself absent: one ``headrace_gpu_collector_up 0``, nothing else."""

from __future__ import annotations

import types
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backends.engine.gpu_metrics import GPUCollector
from frontend import metric_names as N


class NVMLError(Exception):
    pass


def fake_nvml(devices: list[dict[str, Any]], *, init_error: bool = False) -> types.SimpleNamespace:
    """The part of pynvml's surface the collector uses, over ``devices``;
    a device without a ``power`` reading raises NVMLError (not supported)."""

    def need(h: int, key: str) -> Any:
        if key not in devices[h]:
            raise NVMLError("Not Supported")
        return devices[h][key]

    def init() -> None:
        if init_error:
            raise NVMLError("Driver Not Loaded")

    return types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=init,
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: devices[h]["name"],
        nvmlDeviceGetUUID=lambda h: devices[h]["uuid"],
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=need(h, "util"), memory=0),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=need(h, "used"), total=need(h, "total"), free=0),
        nvmlDeviceGetPowerUsage=lambda h: need(h, "power_mw"),
        nvmlDeviceGetTemperature=lambda h, sensor: need(h, "temp"),
    )


def scrape(collector: GPUCollector) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    registry = CollectorRegistry()
    registry.register(collector)
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        assert family.name in N.FAMILIES and "engine" in N.FAMILIES[family.name].exporters
        out[family.name] = {tuple(sorted(s.labels.items())): s.value for s in family.samples}
    return out


H100 = {"name": b"NVIDIA H100 80GB HBM3", "uuid": "GPU-aaaa", "util": 87, "used": 60 * 2**30, "total": 80 * 2**30, "power_mw": 612_500, "temp": 71}
L4 = {"name": "NVIDIA L4", "uuid": "GPU-bbbb", "util": 0, "used": 2**20, "total": 24 * 2**30, "temp": 40}  # no power reading


def test_present_devices_are_reported_per_device_in_si_units() -> None:
    got = scrape(GPUCollector(fake_nvml([H100, L4])))
    assert got[N.GPU_COLLECTOR_UP.name] == {(): 1.0}
    a, b = (("gpu", "0"), ("uuid", "GPU-aaaa")), (("gpu", "1"), ("uuid", "GPU-bbbb"))
    assert got[N.GPU_INFO.name] == {(a[0], ("name", "NVIDIA H100 80GB HBM3"), a[1]): 1.0, (b[0], ("name", "NVIDIA L4"), b[1]): 1.0}
    assert got[N.GPU_UTILIZATION.name] == {a: 0.87, b: 0.0}  # a real 0 % is reported as 0
    assert got[N.GPU_MEMORY_USED.name] == {a: 60 * 2**30, b: 2**20}
    assert got[N.GPU_MEMORY_TOTAL.name] == {a: 80 * 2**30, b: 24 * 2**30}
    assert got[N.GPU_POWER.name] == {a: 612.5}  # the L4's unsupported reading is left out, not zero
    assert got[N.GPU_TEMPERATURE.name] == {a: 71.0, b: 40.0}


@pytest.mark.parametrize("nvml", [fake_nvml([], init_error=True), fake_nvml([])], ids=["no driver", "no device"])
def test_absent_is_one_up_zero_and_no_device_families(nvml: types.SimpleNamespace) -> None:
    assert scrape(GPUCollector(nvml)) == {N.GPU_COLLECTOR_UP.name: {(): 0.0}}


def test_on_this_machine_the_real_pynvml_reports_absent_without_errors() -> None:
    """The real import (nvidia-ml-py is a dependency): where NVML finds no
    library or device (this machine, CI) the collector is absent, cleanly."""
    import pynvml

    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError:
        count = 0
    got = scrape(GPUCollector())
    if count:
        assert got[N.GPU_COLLECTOR_UP.name] == {(): 1.0} and len(got[N.GPU_MEMORY_TOTAL.name]) == count
    else:
        assert got == {N.GPU_COLLECTOR_UP.name: {(): 0.0}}


def test_a_missing_pynvml_module_is_absent_too(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml now raises ImportError
    with pytest.raises(ImportError):
        __import__("pynvml")
    assert scrape(GPUCollector()) == {N.GPU_COLLECTOR_UP.name: {(): 0.0}}
