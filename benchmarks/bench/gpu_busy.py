"""How busy the GPU was over a stretch of wall time, from the driver's own utilisation samples.

Whether a row is host-bound or GPU-bound decides which work is worth cutting. The scheduler's
CPU use cannot tell (SGLang's scheduler spins at one core while it waits for the GPU), and a
snapshot of `nvidia-smi` at the end of a row describes the last moment only. NVML keeps a
buffer of utilisation samples (the share of each sample period, about 1/6 s, in which a kernel
ran), readable after the fact with `nvmlDeviceGetSamples` from a timestamp on; so a row's mean
needs one call at its end, with no thread and no process of ours polling beside the engine.

Read through ctypes from the driver's `libnvidia-ml.so.1` (no Python package needed); None
where there is no driver (CI) or the driver does not keep samples.
"""

from __future__ import annotations

import ctypes
import time

GPU_UTILIZATION_SAMPLES = 1  # nvmlSamplingType_t
MAX_SAMPLES = 1024


class _Sample(ctypes.Structure):  # nvmlSample_t: timestamp (us), then an 8-byte value union
    _fields_ = [("ts", ctypes.c_ulonglong), ("value", ctypes.c_ulonglong)]


_NVML: dict = {}


def _device():
    """NVML's handle of GPU 0, initialised once; None without a driver."""
    if "dev" not in _NVML:
        _NVML["dev"] = None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            dev = ctypes.c_void_p()
            if lib.nvmlInit_v2() == 0 and lib.nvmlDeviceGetHandleByIndex_v2(
                    0, ctypes.byref(dev)) == 0:
                _NVML.update(lib=lib, dev=dev)
        except OSError:
            pass
    return _NVML["dev"]


def now_us() -> int:
    """The clock NVML stamps its samples with (microseconds since the epoch)."""
    return int(time.time() * 1e6)


def samples_since(since_us: int) -> list[tuple[int, int]] | None:
    """[(timestamp us, percent busy)] the driver holds after `since_us`; None without NVML."""
    dev = _device()
    if dev is None:
        return None
    lib, kind, count = _NVML["lib"], ctypes.c_int(), ctypes.c_uint(MAX_SAMPLES)
    buf = (_Sample * MAX_SAMPLES)()
    rc = lib.nvmlDeviceGetSamples(dev, GPU_UTILIZATION_SAMPLES, ctypes.c_ulonglong(since_us),
                                  ctypes.byref(kind), ctypes.byref(count), buf)
    if rc != 0:  # e.g. NVML_ERROR_NOT_FOUND: no sample after since_us
        return [] if rc == 6 else None
    # the value is an unsigned int (NVML_VALUE_TYPE_UNSIGNED_INT) in the union's low bytes
    return [(buf[i].ts, buf[i].value & 0xFFFFFFFF) for i in range(count.value)]


def mean_busy(samples: list[tuple[int, int]] | None, start_us: int, end_us: int) -> float | None:
    """The mean busy share (0-1) of the samples stamped in (start_us, end_us]; None without
    samples there."""
    inside = [v for ts, v in samples or [] if start_us < ts <= end_us]
    return round(sum(inside) / len(inside) / 100, 3) if inside else None
