"""Peak rates of the GPUs the course knows, to turn times into % of peak and % of bandwidth.

Dense 16-bit tensor-core rate with fp32 accumulation (TFLOP/s) and memory bandwidth (TB/s), from
NVIDIA's datasheets. An unknown GPU still works: its report leaves the % columns empty.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    slug: str            # results/<slug>.json
    tflops_16bit: float
    bandwidth_tbs: float


# Matched in order against the driver's name, e.g. "NVIDIA H100 80GB HBM3" (the SXM part).
_TABLE = [
    (r"H100.*PCIe", GpuSpec("h100-pcie", 756.0, 2.0)),
    (r"H100.*NVL", GpuSpec("h100-nvl", 835.0, 3.9)),
    (r"H100", GpuSpec("h100-sxm", 989.4, 3.35)),
    (r"H200", GpuSpec("h200", 989.4, 4.8)),
    (r"A100.*40GB", GpuSpec("a100-40gb", 312.0, 1.555)),
    (r"A100.*80GB.*PCIe", GpuSpec("a100-80gb-pcie", 312.0, 1.935)),
    (r"A100", GpuSpec("a100-80gb", 312.0, 2.039)),
    (r"\bA10\b", GpuSpec("a10", 125.0, 0.6)),
    (r"L40S", GpuSpec("l40s", 362.0, 0.864)),
    (r"L40\b", GpuSpec("l40", 181.0, 0.864)),
    (r"\bL4\b", GpuSpec("l4", 121.0, 0.3)),
    (r"RTX 4090", GpuSpec("rtx-4090", 165.2, 1.008)),
    (r"RTX 3090", GpuSpec("rtx-3090", 71.0, 0.936)),
]


def spec_for(name: str) -> GpuSpec | None:
    for pattern, spec in _TABLE:
        if re.search(pattern, name):
            return spec
    return None


def slug_for(name: str) -> str:
    spec = spec_for(name)
    return spec.slug if spec else re.sub(r"[^a-z0-9]+", "-", name.lower().removeprefix("nvidia ")).strip("-")
