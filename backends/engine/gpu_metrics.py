"""Per-device GPU metrics through NVML (``pynvml``, from the ``nvidia-ml-py``
distribution), for the engine server's /metrics.

::

    scrape ──> GPUCollector.collect()
                 first scrape: import pynvml, nvmlInit, one handle per device
                   (no module, no library, no driver, no device: absent for good)
                 headrace_gpu_collector_up  1 | 0
                 present: per device (gpu = NVML index, uuid)
                   headrace_gpu_info{name}, utilization_ratio, memory_used_bytes,
                   memory_total_bytes, power_watts, temperature_celsius

Absent is one sample, ``headrace_gpu_collector_up 0``, and no other
``headrace_gpu_*`` family: a dashboard tells "no GPU here" from "a GPU at
0 %", and nothing is made up. A reading a device does not support (power on
some boards) or that fails leaves that one sample out, never a zero. NVML
sees every device of the machine or container, whatever
``CUDA_VISIBLE_DEVICES`` says (in a Kubernetes pod: the devices it was
given). Names come from :mod:`frontend.metric_names`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from frontend import metric_names as N

__all__ = ["GPUCollector"]

log = logging.getLogger(__name__)


class _Device:
    __slots__ = ("handle", "index", "name", "uuid")

    def __init__(self, index: int, handle: Any, name: str, uuid: str) -> None:
        self.index, self.handle, self.name, self.uuid = index, handle, name, uuid


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class GPUCollector(Collector):
    """NVML's view of the devices, read on each scrape. ``nvml``: the pynvml
    module (tests pass a fake); None imports the real one on first use."""

    def __init__(self, nvml: ModuleType | Any | None = None) -> None:
        self._nvml = nvml
        self._devices: list[_Device] | None = None  # None: not looked yet; []: absent

    @property
    def up(self) -> bool:
        return bool(self._open())

    def _open(self) -> list[_Device]:
        if self._devices is not None:
            return self._devices
        self._devices = []
        try:
            nvml = self._nvml if self._nvml is not None else importlib.import_module("pynvml")
        except ImportError:
            log.info("GPU metrics off: pynvml (nvidia-ml-py) is not installed")
            return self._devices
        self._nvml = nvml
        try:
            nvml.nvmlInit()
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                name, uuid = _text(nvml.nvmlDeviceGetName(handle)), _text(nvml.nvmlDeviceGetUUID(handle))
                self._devices.append(_Device(i, handle, name, uuid))
        except nvml.NVMLError as exc:  # no library, no driver, no device
            log.info("GPU metrics off: NVML: %s", exc)
            self._devices = []
        return self._devices

    def collect(self) -> Iterable[Metric]:
        devices = self._open()
        yield N.GPU_COLLECTOR_UP.collected(1.0 if devices else 0.0)
        if not devices:
            return
        nvml = self._nvml
        info = N.GPU_INFO.collected()
        families: list[tuple[GaugeMetricFamily, Callable[[Any], float]]] = [
            (N.GPU_UTILIZATION.collected(), lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
            (N.GPU_MEMORY_USED.collected(), lambda h: float(nvml.nvmlDeviceGetMemoryInfo(h).used)),
            (N.GPU_MEMORY_TOTAL.collected(), lambda h: float(nvml.nvmlDeviceGetMemoryInfo(h).total)),
            (N.GPU_POWER.collected(), lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),  # milliwatts
            (N.GPU_TEMPERATURE.collected(), lambda h: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))),
        ]  # fmt: skip
        for d in devices:
            labels = [str(d.index), d.uuid]
            info.add_metric([*labels, d.name], 1.0)
            for family, read in families:
                try:
                    family.add_metric(labels, read(d.handle))
                except nvml.NVMLError:  # not supported on this board, or it failed: no sample
                    continue
        yield info
        for family, _ in families:
            yield family
