"""Compiling a kernel file of another checkout (tests/test_sass_identity.py's base trees) as it was there: its
#includes resolved in that checkout's stages/. Run as a script, one compile's machine code printed as JSON:
NVRTC's another draw, in a new process that imports neither PyTorch nor the test's stages.

    python tests/checkout_compile.py TREE SOURCE ARCH DEFINES_JSON
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from grader import sass
from stages.common import compiler
from stages.common.compiler import REPO


@contextlib.contextmanager
def headers_of(tree: Path):
    """The compiler resolving #includes in `tree`'s stages/ (a checkout of another commit)."""
    search = (tree / "stages" / "common", tree / "stages")
    toolkit = tuple(d for d in compiler.include_dirs() if not d.startswith(str(REPO / "stages")))
    saved = compiler.SEARCH_DIRS, compiler.include_dirs
    compiler.SEARCH_DIRS, compiler.include_dirs = search, lambda: (*map(str, search), *toolkit)
    try:
        yield
    finally:
        compiler.SEARCH_DIRS, compiler.include_dirs = saved


def compile_in(tree: Path, source: Path, arch: str, defines: dict) -> compiler.Cubin:
    """compile_cubin for `source` (relative to the repository) of the checkout at `tree`: its
    #includes resolve in that tree's stages/."""
    with headers_of(tree):
        return compiler.compile_cubin(tree / source, arch, defines)


if __name__ == "__main__":
    tree_arg, source_arg, arch_arg, defines_arg = sys.argv[1:]
    cubin = compile_in(Path(tree_arg), Path(source_arg), arch_arg, json.loads(defines_arg))
    print(json.dumps(sass.machine_code(cubin)))
