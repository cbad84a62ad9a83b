"""What a compiled kernel is made of: resources from ptxas, instructions from the cubin.

Both work without a GPU: ptxas reports through NVRTC's log, and nvdisasm (from the
nvidia-cuda-nvdisasm wheel) lists the SASS of a cubin.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections import Counter
from functools import cache, lru_cache
from pathlib import Path

# The instructions a lesson is about, in the order the report lists them.
KEY_OPCODES = ("HGMMA", "HMMA", "FFMA", "MUFU", "LDSM", "LDGSTS", "UTMALDG", "LDG", "STG", "LDS", "STS",
               "SHFL", "BAR", "LDL", "STL")
MIX_FORMAT = 1  # the version of parse_listing's output: change it when the parser changes
CODE_FORMAT = 1  # the version of kernel_code's output: change it when it changes


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


@lru_cache(maxsize=16)  # a cubin's path names what it holds: its mix and its digest read one listing
def disassemble(cubin: Path) -> str:
    return subprocess.run([_nvdisasm(), "-c", str(cubin)], check=True, capture_output=True, text=True).stdout


def instruction_mix(cubin: Path) -> dict[str, Counter]:
    """{kernel: Counter of opcodes without modifiers, e.g. "HMMA", "LDGSTS"} of a cubin, kept beside it
    (<key>.sass<N>.json): nvdisasm takes about half a second a cubin, and a cubin's name is the hash of
    all that made it. N, MIX_FORMAT, changes with the parser, so that an older parser's counts are not read."""
    mix = kept_beside(Path(cubin), f".sass{MIX_FORMAT}.json", lambda: parse_listing(disassemble(cubin)))
    return {kernel: Counter(counts) for kernel, counts in mix.items()}


def code_digest(cubin) -> str:
    """The sha256 of a Cubin's machine_code. Two cubins with one digest run the same instructions with the same
    registers and shared memory, whatever the comments and the layout of the sources they came from. Kept
    beside the cubin (<key>.code<N>.json), as its instruction mix is; N, CODE_FORMAT, changes with kernel_code."""
    return kept_beside(cubin.path, f".code{CODE_FORMAT}.json", lambda: digest_of(machine_code(cubin)))


def digest_of(code: dict) -> str:
    """The sha256 of a machine_code (or of part of one: tests/test_sass_identity.py's kernels of a base)."""
    return hashlib.sha256(json.dumps(code, sort_keys=True).encode()).hexdigest()


def machine_code(cubin) -> dict:
    """{"sass": {kernel: its SASS (kernel_code)}, "resources": ptxas's, per kernel} of a Cubin."""
    return {"sass": kernel_code(disassemble(cubin.path)), "resources": resources(cubin.ptxas_log)}


def kept_beside(cubin: Path, suffix: str, make):
    """make()'s value (JSON), kept in the file beside the cubin with this suffix: read back if it is there."""
    kept = cubin.with_suffix(suffix)
    if kept.exists():
        return json.loads(kept.read_text())
    value = make()
    tmp = kept.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(value))
    tmp.replace(kept)  # atomic: a parallel run reads the whole file or none
    return value


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


def kernel_code(listing: str) -> dict[str, str]:
    """{kernel: its SASS} of an nvdisasm listing, without instruction addresses, each kernel's labels and
    internal functions numbered in its own order (renumbered): a kernel added to the cubin leaves the
    others' as they were."""
    kernels, current = {}, None
    for line in listing.splitlines():
        if m := re.match(r"\s*\.text\.(\w+):", line):
            current = kernels.setdefault(m.group(1), [])
        elif line.startswith("//----"):
            current = None
        elif current is not None:
            current.append(re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip())
    return {kernel: renumbered("\n".join(lines)) for kernel, lines in kernels.items()}


def renumbered(listing: str) -> str:
    """A kernel's SASS with its labels (.L_x_N) and internal functions ($__internal_N_$) numbered from 0 in
    their order of appearance in it, not across the cubin."""
    for pattern, name in ((r"\.L_x_(\d+)\b", ".L_x_{}"), (r"\$__internal_(\d+)_\$", "$__internal_{}_$")):
        numbers: dict = {}
        listing = re.sub(pattern, lambda m: name.format(numbers.setdefault(m.group(1), len(numbers))), listing)
    return listing
