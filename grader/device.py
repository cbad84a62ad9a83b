"""Which GPU is here, asked of the driver without creating a CUDA context.

The grader's own process never runs a kernel (a child process does), so a crash in a learner's
kernel cannot take it down; it only needs the GPU's name and compute capability to compile.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GpuInfo:
    name: str
    major: int
    minor: int
    sms: int
    l2_bytes: int
    sm_clock_mhz: int
    memory_bytes: int
    driver: str          # the CUDA version the driver supports, e.g. "13.0"

    @property
    def arch(self) -> str:
        return f"sm_{self.major}{self.minor}"

    def as_dict(self) -> dict:
        return asdict(self)


def probe() -> tuple[GpuInfo | None, str]:
    """(the first GPU, "") or (None, why there is none). FLASHMOE_NO_GPU=1 pretends there is none (0 or
    empty does not)."""
    if os.environ.get("FLASHMOE_NO_GPU", "") not in ("", "0"):
        return None, "FLASHMOE_NO_GPU is set"
    try:
        from cuda.bindings import driver
    except ImportError as error:
        return None, f"cuda-bindings is not installed ({error})"
    try:
        (err,) = driver.cuInit(0)
    except RuntimeError as error:  # no libcuda.so: no driver on this machine
        return None, "no NVIDIA driver found"
    if err != driver.CUresult.CUDA_SUCCESS:
        return None, f"no usable GPU (cuInit: {err.name})"
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count == 0:
        return None, "the driver sees no GPU"
    _, dev = driver.cuDeviceGet(0)

    def attribute(name: str) -> int:
        return driver.cuDeviceGetAttribute(getattr(driver.CUdevice_attribute, name), dev)[1]

    _, raw_name = driver.cuDeviceGetName(256, dev)
    _, memory = driver.cuDeviceTotalMem(dev)
    _, version = driver.cuDriverGetVersion()
    return GpuInfo(
        name=raw_name.split(b"\0")[0].decode(),
        major=attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
        minor=attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"),
        sms=attribute("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
        l2_bytes=attribute("CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE"),
        sm_clock_mhz=attribute("CU_DEVICE_ATTRIBUTE_CLOCK_RATE") // 1000,
        memory_bytes=int(memory),
        driver=f"{version // 1000}.{version % 1000 // 10}",
    ), ""
