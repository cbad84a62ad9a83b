"""What a compiled kernel is made of: resources from ptxas, instructions from the cubin.

Both work without a GPU: ptxas reports through NVRTC's log, and nvdisasm (from the
nvidia-cuda-nvdisasm wheel) lists the SASS of a cubin.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections import Counter
from functools import cache
from pathlib import Path

# The instructions a lesson is about, in the order the report lists them.
KEY_OPCODES = ("HGMMA", "HMMA", "FFMA", "MUFU", "LDSM", "LDGSTS", "UTMALDG", "LDG", "STG", "LDS", "STS",
               "SHFL", "BAR", "LDL", "STL")
MIX_FORMAT = 1  # the version of parse_listing's output: change it when the parser changes


def resources(ptxas_log: str) -> dict[str, dict]:
    """{kernel: {registers, shared_bytes, stack_bytes, spill_stores, spill_loads}} from `ptxas -v`."""
    found, current = {}, None
    for line in ptxas_log.splitlines():
        if m := re.search(r"Function properties for (\w+)", line):
            current = found.setdefault(m.group(1), {"registers": 0, "shared_bytes": 0, "stack_bytes": 0,
                                                     "spill_stores": 0, "spill_loads": 0})
        elif m := re.search(r"Compiling entry function '(\w+)'", line):
            current = found.setdefault(m.group(1), {"registers": 0, "shared_bytes": 0, "stack_bytes": 0,
                                                     "spill_stores": 0, "spill_loads": 0})
        elif current is not None:
            if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
                current.update(stack_bytes=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
            if m := re.search(r"Used (\d+) registers", line):
                current["registers"] = int(m[1])
            if m := re.search(r"(\d+) bytes smem", line):
                current["shared_bytes"] = int(m[1])
    return found


@cache
def _nvdisasm() -> str:
    from cuda.pathfinder import find_nvidia_binary_utility

    path = find_nvidia_binary_utility("nvdisasm") or shutil.which("nvdisasm")
    if path is None:
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    return path


def disassemble(cubin: Path) -> str:
    return subprocess.run([_nvdisasm(), "-c", str(cubin)], check=True, capture_output=True, text=True).stdout


def instruction_mix(cubin: Path) -> dict[str, Counter]:
    """{kernel: Counter of opcodes without modifiers, e.g. "HMMA", "LDGSTS"} of a cubin, kept beside it
    (<key>.sass<N>.json): nvdisasm takes about half a second a cubin, and a cubin's name is the hash of
    all that made it. N, MIX_FORMAT, changes with the parser, so that an older parser's counts are not read."""
    cached = Path(cubin).with_suffix(f".sass{MIX_FORMAT}.json")
    if cached.exists():
        return {kernel: Counter(counts) for kernel, counts in json.loads(cached.read_text()).items()}
    mix = parse_listing(disassemble(cubin))
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(mix))
    tmp.replace(cached)  # atomic: a parallel run reads the whole file or none
    return mix


def parse_listing(listing: str) -> dict[str, Counter]:
    """The instruction mix of an nvdisasm listing (see instruction_mix)."""
    mix, current = {}, None
    for line in listing.splitlines():
        if m := re.match(r"\s*\.text\.(\w+):", line):
            current = mix.setdefault(m.group(1), Counter())
        elif current is not None and (m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)):
            current[m.group(1)] += 1
    return mix


def key_counts(mix: Counter) -> dict[str, int]:
    return {op: mix[op] for op in KEY_OPCODES if mix.get(op)}
