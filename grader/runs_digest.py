"""A record keyed on what runs: whether a results entry still holds for the tree.

An entry's `source_sha256` (grader/results.py) changes with any byte of its sources, a comment's too.
Its `runs_digest` holds, per NVRTC version, what of them runs:

    "runs_digest": {"13.0": {"launch": digest, "machine_code": {stage key: {variant: digest}}}}

"launch": the launch modules (results.source_files' Python files) as Python runs them, their syntax
trees without docstrings (comments are not in them) and without the shapes a stage is timed at (a Stage's
extra_benchmarks, and the names only they use: a shape added there changes no launch, and
tests/test_results.py wants each current entry timed at every shape), and each variant's -D macros and
geometry, of the stage and of the stages it launches (its `uses`); "machine_code": each variant's cubin, as the grade
compiles it for the entry's arch (the stages it launches: for the arch they take on that GPU), by
grader/sass.py's code_digest (the SASS, addresses aside, labels renumbered; ptxas's resources).

An entry is current if its sources are the tree's, or else if its runs digest for this machine's NVRTC
version is the tree's (is_current). NVRTC is not deterministic: now and then a compile of the same
source comes out as other machine code (stage 1 at sm_90a, 2026-11-28, each variant in new processes:
7 compiles in 56 side by side, 1 in 32 one after the other, with shared memory addressed from another
base). So a variant whose code differs from the entry's is compiled again, each time in a new process,
up to FRESH_DRAWS times, and counts as the same if one of those compiles is (as
tests/test_sass_identity.py does). An entry whose digest came from a rare draw may so be found stale
where it is not: the safe side. Machine code from two NVRTC versions is never compared: an entry
without a digest for this version is judged by its sources alone.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import stages
from grader import results, sass
from grader.run import compile_stage, stage_builds
from stages import variant_key
from stages.common.compiler import REPO, compile_cubin, nvrtc_version

FRESH_DRAWS = 3  # compiles in new processes of a variant whose machine code differs from the entry's


def runs_digest(stage, arch: str, kernel_path: Path | None = None) -> dict:
    """{"launch": ..., "machine_code": {stage key: {variant: ...}}} of a grade of `stage` at `arch`."""
    return {"launch": launch_digest(stage, arch, kernel_path),
            "machine_code": {part.key: {variant: sass.code_digest(cubin) for variant, cubin in
                                        compile_stage(part, path, part_arch).items()}
                             for part, path, part_arch in launched(stage, arch, kernel_path)}}


def is_current(entry: dict, stage, kernel_path: Path | None = None) -> bool:
    """Whether a results entry holds for `stage` as the tree has it (the module's docstring says when)."""
    if entry.get("source_sha256") == results.source_digest(stage, kernel_path):
        return True
    recorded = entry.get("runs_digest", {}).get(nvrtc_version())
    if recorded is None or recorded["launch"] != launch_digest(stage, entry["arch"], kernel_path):
        return False
    for part, path, arch in launched(stage, entry["arch"], kernel_path):
        cubins, codes = compile_stage(part, path, arch), recorded["machine_code"].get(part.key, {})
        if set(cubins) != set(codes):
            return False
        for variant, cubin in cubins.items():
            if sass.code_digest(cubin) != codes[variant] and not drawn_again(part, path, arch, variant, codes[variant]):
                return False
    return True


def rekey(path: Path) -> dict[str, str]:
    """Give each entry of a results file whose sources are the tree's its runs digest made with this
    machine's NVRTC, beside any other version's; an entry marked stale, or whose sources changed since,
    is left as it is. {stage key: what was done}."""
    data, done = json.loads(Path(path).read_text()), {}
    for key, entry in data["stages"].items():
        stage = stages.load(key)
        if entry.get("stale"):
            done[key] = "marked stale: left as it is"
        elif entry["source_sha256"] != results.source_digest(stage):
            done[key] = "its sources changed since it was measured: left as it is"
        else:
            entry.setdefault("runs_digest", {})[nvrtc_version()] = runs_digest(stage, entry["arch"])
            done[key] = f"runs digest of NVRTC {nvrtc_version()} written"
    results.save(Path(path), data)
    return done


def launched(stage, arch: str, kernel_path: Path | None = None) -> list[tuple]:
    """(stage, its kernel's path, arch) of `stage` and of the stages it launches (its `uses`, recursively),
    each at the arch it takes on a GPU of `arch`'s generation."""
    found = [(stage, Path(kernel_path or stage.source_path), arch)]
    for key in stage.uses:
        used = stages.load(key)
        found += launched(used, stages.arch_for(gpu_of(arch), used.archs))
    return found


def gpu_of(arch: str) -> SimpleNamespace:
    """A GPU of `arch`'s generation, as stages.arch_for takes one: "sm_90a" -> compute capability 9.0."""
    number = int(arch[3:].rstrip("a"))
    return SimpleNamespace(name=arch, major=number // 10, minor=number % 10)


def launch_digest(stage, arch: str, kernel_path: Path | None = None) -> str:
    """The digest of the launch: its modules as Python runs them (a module that the others import only for
    the shapes they are timed at left out), each variant's -D macros and geometry."""
    files = [path for path in results.source_files(stage, kernel_path) if path.suffix == ".py"]
    trees = {path: launch_tree(path) for path in files}
    imported_as_written = {module for path in files for module in results.imported_stage_modules(path)}
    imported = {module for tree in trees.values() for module in results.stage_modules_imported_by(tree)}
    modules = [json.dumps(syntax(tree)) for path, tree in trees.items()
               if path in imported or path not in imported_as_written]
    geometry = {part.key: {variant_key(defines): part.geometry(defines) for defines, _ in stage_builds(part)}
                for part, _, _ in launched(stage, arch, kernel_path)}
    text = json.dumps({"modules": modules, "geometry": geometry}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def launch_tree(path: Path) -> ast.Module:
    """A Python module as it runs: its syntax tree without docstrings (comments are not in it) and without
    the shapes it is timed at (without_timed_shapes). `syntax` writes it out."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and ast.get_docstring(node, clean=False) is not None:
            node.body = node.body[1:] or [ast.Pass()]
    return without_timed_shapes(tree)


TIMED_SHAPES = "extra_benchmarks"  # the Stage field of the shapes it is timed at beside its problem's


def without_timed_shapes(tree: ast.Module) -> ast.Module:
    """`tree` without the TIMED_SHAPES keyword of its Stage(...) calls, and without the module-level
    imports and assignments of names that only that keyword used."""
    shape_names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Stage":
            for keyword in node.keywords:
                if keyword.arg == TIMED_SHAPES:
                    shape_names |= {n.id for n in ast.walk(keyword.value) if isinstance(n, ast.Name)}
            node.keywords = [keyword for keyword in node.keywords if keyword.arg != TIMED_SHAPES]
    unused = shape_names - {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    body = []
    for statement in tree.body:
        if isinstance(statement, ast.ImportFrom):
            statement.names = [alias for alias in statement.names if (alias.asname or alias.name) not in unused]
            if not statement.names:
                continue
        elif isinstance(statement, ast.Assign) and all(isinstance(t, ast.Name) and t.id in unused
                                                       for t in statement.targets):
            continue
        body.append(statement)
    tree.body = body
    return tree


def syntax(node) -> object:
    """A syntax tree as nested lists: each node's type, then its fields that are not None or empty."""
    if isinstance(node, ast.AST):
        fields = {name: syntax(value) for name, value in ast.iter_fields(node) if value is not None and value != []}
        return [type(node).__name__, fields]
    if isinstance(node, list):
        return [syntax(item) for item in node]
    return repr(node)


def drawn_again(stage, path: Path, arch: str, variant: str, digest: str) -> bool:
    """Whether one of FRESH_DRAWS compiles of the variant, each in a new process with an empty compile
    cache (another draw of NVRTC), makes machine code of this digest."""
    return any(fresh_code_digest(stage, path, arch, variant) == digest for _ in range(FRESH_DRAWS))


def fresh_code_digest(stage, path: Path, arch: str, variant: str) -> str:
    """The code digest of one variant compiled in a new process with an empty compile cache. The process is given
    the compile itself (compiled_job), not the stage: loading a stage imports its launch and with it PyTorch,
    seconds of each draw's time, which the compile does not need."""
    defines, checks = next(build for build in stage_builds(stage) if variant_key(build[0]) == variant)
    job = json.dumps([str(path), arch, defines, checks])
    with tempfile.TemporaryDirectory() as cache:
        command = [sys.executable, "-m", "grader.runs_digest", job]
        return subprocess.run(command, cwd=REPO, env=dict(os.environ, FLASHMOE_CACHE=cache), check=True,
                              capture_output=True, text=True).stdout.strip()


def compiled_job(job: str) -> str:
    """The code digest of a compile_cubin call given as JSON, [kernel, arch, -D macros, checks] (fresh_code_digest's)."""
    path, arch, defines, checks = json.loads(job)
    return sass.code_digest(compile_cubin(Path(path), arch, defines, checks))


if __name__ == "__main__":  # a compile as JSON, [KERNEL, ARCH, DEFINES, CHECKS]: for fresh_code_digest
    print(compiled_job(sys.argv[1]))
