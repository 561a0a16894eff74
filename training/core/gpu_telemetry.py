"""GPU health through NVML: utilisation, memory, temperature, clocks and throttle reasons.

A slow step on a big job is as often a hot, throttled or memory-starved GPU as a slow kernel, so the
trainer records the device's state next to the loss. NVML comes from `nvidia-ml-py` (the `gpu` extra);
without it, or without a CUDA device, `GpuMonitor.open` returns None and nothing is recorded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kiln.progress import log

# nvmlClocksThrottleReason* bits (nvml.h), named as a person reading a log would want them
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def throttle_reasons(mask: int) -> list[str]:
    """The named reasons set in an NVML throttle bitmask; unknown bits are kept as hex."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    return names + ([hex(rest)] if rest else [])


@dataclass(frozen=True)
class GpuSample:
    index: int
    utilization_pct: int
    memory_used_gb: float
    memory_total_gb: float
    temperature_c: int
    sm_clock_mhz: int
    memory_clock_mhz: int
    power_w: float
    throttle: list[str]

    def to_dict(self) -> dict:
        return {f"gpu_{k}": v for k, v in asdict(self).items()}


class GpuMonitor:
    """Reads one device's NVML counters; `open()` is None where NVML or the device is missing."""

    def __init__(self, nvml, handle, index: int):
        self.nvml, self.handle, self.index = nvml, handle, index

    @classmethod
    def open(cls, device_index: int) -> "GpuMonitor | None":
        import torch

        if not torch.cuda.is_available():
            return None
        try:
            import pynvml as nvml
        except ImportError:
            log.warning("GPU telemetry: nvidia-ml-py is not installed (pip install 'kiln[gpu]'): not recorded")
            return None
        try:
            nvml.nvmlInit()
            return cls(nvml, nvml.nvmlDeviceGetHandleByIndex(device_index), device_index)
        except nvml.NVMLError as e:  # a container without the driver's NVML library
            log.warning("GPU telemetry: NVML unavailable (%s): not recorded", e)
            return None

    def sample(self) -> GpuSample:
        n, h = self.nvml, self.handle
        mem = n.nvmlDeviceGetMemoryInfo(h)
        return GpuSample(
            index=self.index,
            utilization_pct=int(n.nvmlDeviceGetUtilizationRates(h).gpu),
            memory_used_gb=round(mem.used / 2**30, 3),
            memory_total_gb=round(mem.total / 2**30, 3),
            temperature_c=int(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
            sm_clock_mhz=int(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
            memory_clock_mhz=int(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM)),
            power_w=round(n.nvmlDeviceGetPowerUsage(h) / 1000.0, 1),
            throttle=throttle_reasons(int(n.nvmlDeviceGetCurrentClocksThrottleReasons(h))),
        )


# dense bf16 tensor-core peaks (TFLOP/s) by device name, for MFU when train.telemetry.peak_tflops is unset
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "B200": 2250.0,
    "GH200": 989.0,
}


def peak_tflops(device_type: str, configured: float | None) -> float | None:
    """Peak FLOP/s of one device for MFU: the configured value, else the table for known GPUs, else None."""
    if configured:
        return configured
    if device_type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name().upper()
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    return None
