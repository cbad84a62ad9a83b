"""Compile CUDA C with NVRTC (through cuda.core) into cubins, cached on disk.

NVRTC needs no GPU and no driver to make a cubin, so the same code path serves a learner with a
GPU and CI without one. Errors keep NVRTC's own log, whose lines read `path/to/file.cu(42): error`,
so they point at the learner's file and line.

The grader compiles with it (grader/run.py appends its checks of signatures and geometry), and so do
the course's PyTorch ops (stages/ops/); it lives in stages/ because stages never import the grader.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from stages import STAGES_DIR

REPO = STAGES_DIR.parent
# Where `#include "..."` looks after the kernel's own folder: the shared headers, then the stages
# folder, so that a stage can build on another's kernels (#include "stage6_grouped_gemm/experts.cu").
SEARCH_DIRS = (STAGES_DIR / "common", STAGES_DIR)
CACHE_DIR = Path(os.environ.get("FLASHMOE_CACHE", Path.home() / ".cache" / "flashmoe-course")) / "cubin"


class CompileError(Exception):
    """NVRTC rejected the source; `log` is NVRTC's log (file(line): error: ...)."""

    def __init__(self, path: Path, arch: str, log: str):
        # NVRTC's log ends with the C string's NUL byte, which makes grep call the output binary.
        self.path, self.arch, self.log = path, arch, log.replace("\0", "").strip()
        super().__init__(f"{path} does not compile for {arch}:\n{self.log}")


@dataclass(frozen=True)
class Cubin:
    path: Path          # the cached .cubin file
    arch: str           # e.g. "sm_90a"
    defines: tuple      # (("ELEM_T", "__half"), ("HEAD_DIM", "64"))
    ptxas_log: str      # ptxas -v output: registers, spills, shared memory per kernel


@cache
def include_dirs() -> tuple[str, ...]:
    """The header folders NVRTC needs: ours (SEARCH_DIRS), cuda_fp16.h/cuda_bf16.h, and CCCL."""
    from cuda.pathfinder import find_nvidia_header_directory

    cudart = find_nvidia_header_directory("cudart")
    if cudart is None:
        raise RuntimeError("cuda_fp16.h not found: pip install nvidia-cuda-runtime")
    cccl = find_nvidia_header_directory("cccl")  # cuda/barrier, cuda/pipeline: only some kernels need it
    return tuple(str(d) for d in (*SEARCH_DIRS, cudart, cccl) if d)


@cache
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def included_files(path: Path) -> list[Path]:
    """The local files a kernel includes, recursively, each once, where NVRTC finds them: the first of
    the kernel's folder and SEARCH_DIRS that has the file. The compile cache and the results' source
    digest (grader/results.py) both follow them."""
    path = Path(path).resolve()
    found, todo = [], [path]
    while todo:
        for name in re.findall(r'^\s*#\s*include\s*"([^"]+)"', todo.pop().read_text(), re.MULTILINE):
            for base in (path.parent, *SEARCH_DIRS):
                candidate = (base / name).resolve()
                if candidate.is_file():
                    if candidate != path and candidate not in found:
                        found.append(candidate)
                        todo.append(candidate)
                    break
    return found


def compile_cubin(path: Path, arch: str, defines: dict[str, str] | None = None, extra_source: str = "") -> Cubin:
    """Compile `path` for `arch` (e.g. "sm_90a") with `-D` defines; returns the cached cubin.

    `extra_source` is appended after a `#line` directive (the grader's signature checks), so that an
    error in it is reported against the grader, not against a line of the learner's file.
    """
    from cuda.core import Program, ProgramOptions

    path = Path(path).resolve()
    source = path.read_text()
    if extra_source:
        source += f'\n#line 1 "grader-signature-check"\n{extra_source}\n'
    defines = tuple(sorted((defines or {}).items()))
    options = dict(arch=arch, std="c++17", include_path=list(include_dirs()), ptxas_options=["-v"],
                   define_macro=list(defines), name=_display_name(path))
    headers = "\n".join(p.read_text() for p in included_files(path))  # the key changes with them
    key_text = repr((source, headers, sorted(options.items(), key=str), nvrtc_version()))
    key = hashlib.sha256(key_text.encode()).hexdigest()[:24]
    cubin_path, log_path = CACHE_DIR / f"{key}.cubin", CACHE_DIR / f"{key}.log"
    if cubin_path.exists() and log_path.exists():
        return Cubin(cubin_path, arch, defines, _with_c_linkage(path, arch, log_path.read_text()))

    options["include_path"] = [str(path.parent), *options["include_path"]]
    log = io.StringIO()
    try:
        code = Program(source, "c++", ProgramOptions(**options)).compile("cubin", logs=log).code
    except Exception as error:  # cuda.core raises NVRTCError with the log in its message
        message = str(error)
        message = message.split("compilation log:", 1)[-1] if "compilation log:" in message else message
        raise CompileError(path, arch, message) from None
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = cubin_path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(code)
    log_path.write_text(log.getvalue())
    tmp.replace(cubin_path)
    return Cubin(cubin_path, arch, defines, _with_c_linkage(path, arch, log.getvalue()))


def _with_c_linkage(path: Path, arch: str, ptxas_log: str) -> str:
    """The log, if every kernel in it has C linkage; else CompileError. The launch code finds a kernel
    by its plain name, which a kernel declared without extern "C" does not have (it is mangled)."""
    mangled = re.findall(r"Compiling entry function '(_Z\w+)'", ptxas_log)
    if mangled:
        symbol, name = mangled[0], _demangled_name(mangled[0])
        raise CompileError(path, arch, f'{_display_name(path)}: error: kernel {name} has C++ linkage (symbol {symbol}): '
                                       f'declare it extern "C" __global__ so that it can be launched by name')
    return ptxas_log


def _demangled_name(symbol: str) -> str:
    """"_Z13attention_fwdPKfi" -> "attention_fwd"; a name inside a namespace is left mangled."""
    match = re.match(r"_Z(\d+)(\w+)", symbol)
    return match[2][:int(match[1])] if match else symbol


def _display_name(path: Path) -> str:
    """The file name NVRTC puts in its messages: relative to the current folder when it is below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
