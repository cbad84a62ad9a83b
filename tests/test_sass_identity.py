"""Refactors that must not change machine code: every kernel compiles to the same SASS as at a base commit.

For each stage (and stage 6's two ladder rungs) the current sources and the sources at the stage's base
commit are compiled for the architecture the stage runs on on an H100 (sm_90a), and for sm_80 where the
stage runs there too; each kernel's SASS (nvdisasm's listing, instruction addresses aside) and its ptxas
resources must be the same. The base tree comes from `git archive BASE stages`, so that its kernels
include their own headers, as they were.

NVRTC is not deterministic across processes: its optimizer sometimes takes another, equivalent path
(stage 1 at sm_80: about one compile in ten differs, in the PTX already, with the same source). So a
mismatch is not the verdict: both sides are then compiled again, each in fresh processes, and the
machine code counts as unchanged when some compile of the current source equals some compile of the base.

Where the kernel and every header it includes are at the base what they are now, byte for byte, NVRTC is
given the same input: nothing is compiled. Elsewhere each current variant's machine code is compared with the
base's as RECORD keeps it: the digests (grader/sass.py's) of the machine code of RECORD_DRAWS compiles of the
base, written by `python tests/test_sass_identity.py record` for the BASES and the NVRTC version it names. The
current variant's digest is kept beside its cubin (tests/test_compile.py made it), so an unchanged variant takes
no compile and no nvdisasm; one that is another draw is compiled again in new processes first. A variant still
unlike the record, or one the record lacks (another NVRTC version, a base moved since), is compared with
compiles of the base made here: its variants compiled at once, on every core, then kernel by kernel.

The base's kernels are compared: a kernel added since (stage 6's saving up GEMM, in every cubin that
includes experts.cu) has no base, as a stage written later has none. Its labels and internal functions
are numbered across the cubin, so it shifts the numbers of the kernels after it: each kernel's are
renumbered in its own order of appearance, which leaves its machine code as it is.

When a later change alters a stage's machine code on purpose, move that stage's entry in BASES to the
commit that did, or drop it, and write RECORD again.
"""
from __future__ import annotations

import difflib
import functools
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as a script (record): this checkout's packages, before any installed copy's
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import checkout_compile
import reference
import stages
from checkout_compile import headers_of
from grader import sass
from grader.parallel_compile import compile_each
from grader.run import compile_stage
from stages import variant_key
from stages.common import compiler
from stages.common.compiler import REPO

BEFORE_ONE_HOME = "b70e0f1"  # before "one home for each idea": headers split, geometry checked, notes moved


def existed_at(commit: str, name: str) -> bool:
    """Whether stages/<name>/ was in the tree at `commit` (a stage written later has no base to compare with)."""
    return subprocess.run(["git", "cat-file", "-e", f"{commit}:stages/{name}/__init__.py"], cwd=REPO,
                          capture_output=True).returncode == 0


BASES = {name: BEFORE_ONE_HOME for name in stages.stage_names() if existed_at(BEFORE_ONE_HOME, name)}
GQA = "f3bbd5b"  # K, V with H_kv heads: stage 0 and 4 take the group size, stages 1-3 a 3-D grid (group, KV pairs)
BASES.update({name: GQA for name in ("stage0_naive", "stage1_tiled", "stage2_warp", "stage3_pipeline")})
# Measured at 11f2b51: stage 4 copies tiles as 64-row TMA boxes (tma.cuh's load_tile).
BASES["stage4_hopper"] = "11f2b51"
# Measured at da22e03: stage 8's loop as one function (key_tile_backward) and the stream-K tail kernel;
# at 538c872: stage 9 adds whole tiles to the padded dQ accumulator.
BASES["stage8_backward"] = "da22e03"
BASES["stage9_hopper_backward"] = "538c872"
# Measured at b4501e5: stages 4, 8 and 9 address Q, K, V, O, dO and the gradients by their strides (4-D
# tensor maps, HeadRows); stage 8 through the shared preprocess and dQ conversion.
BASES.update({name: "b4501e5" for name in ("stage4_hopper", "stage8_backward", "stage9_hopper_backward")})
# Measured at 58fd728: stage 7's router down to one chunk per block (router_sum a warp per logit, a null
# bias allowed), gather_rows' binary search for a padding row's token.
BASES["stage7_moe_layer"] = "58fd728"
# At 95d9176: stage 7's router on the tensor cores (mma.sync, a cp.async ring).
BASES["stage7_moe_layer"] = "95d9176"
# At 3d5f9f2: stage 13 with its own copy of stage 9's tile machinery (since then in wgmma_attention_backward.cuh).
BASES["stage13_block_sparse_backward"] = "3d5f9f2"
# At 6287281: stage 9 starts its blocks in chunks of KV pairs, key tile by key tile (key_tile_and_pair).
BASES["stage9_hopper_backward"] = "6287281"
# At d978042: stage 12 masks a tile without branches (element_visible selected), full tiles unmasked.
BASES["stage12_block_sparse"] = "d978042"
# At 758fcdc: stage 13 selects its masked probabilities (the document mask without branches).
BASES["stage13_block_sparse_backward"] = "758fcdc"
# At 1be0ba3: stage 4 compiles the causal mask in, with 128-key tiles for the causal kernel at D = 64.
BASES["stage4_hopper"] = "1be0ba3"
# At 4dc0f38: stages 9 and 13 take their steps per query tile from wgmma_attention_backward.cuh (start_tile ...).
BASES.update({name: "4dc0f38" for name in ("stage9_hopper_backward", "stage13_block_sparse_backward")})
# At 5b20b73: the kernels of stages 4-15 (and the rungs of 4, 6 and 7) take their parameters as one struct each.
BASES.update({name: "5b20b73" for name in stages.stage_names() if int(name[5:].split("_")[0]) >= 4})
LADDER = {"ladder/simt.cu": "stage6_grouped_gemm", "ladder/mma_sync.cu": "stage6_grouped_gemm"}
FRESH_COMPILES = 3  # per side, after a mismatch
RECORD_DRAWS = 4  # compiles of each base variant whose machine code the record keeps
RECORD = Path(__file__).with_name("fixtures") / "base_machine_code.json"


def archs(stage) -> tuple[str, ...]:
    return ("sm_90a", "sm_80") if "sm_80" in stage.archs else ("sm_90a",)


def sources() -> list[tuple[str, str, str]]:
    """(stage, source relative to the stage's folder, arch) of every kernel file checked."""
    found = []
    for name in BASES:
        stage = stages.load(name)
        found += [(name, stage.source, arch) for arch in archs(stage)]
    found += [(name, source, arch) for source, name in LADDER.items() for arch in ("sm_90a", "sm_80")]
    return found


SOURCES = sources()


@functools.cache
def recorded_sources() -> list[tuple[str, str, str]]:
    """The SOURCES that RECORD holds: those not, with every file they include, their base's byte for byte (whose
    machine code the test does not compile: the same input, the same code)."""
    return [(name, source, arch) for name, source, arch in SOURCES
            if not same_sources(base_tree(BASES[name]), relative_path(name, source))]


# ---------------------------------------------------------------- compiling and reading machine code

def compile_each_in(tree: Path, source: Path, arch: str, variants: list[dict]) -> list[compiler.Cubin]:
    """checkout_compile.compile_in for every variant at once, on every CPU core (grader/parallel_compile.py)."""
    with headers_of(tree):
        found = [cubin for cubin, _ in compile_each([(tree / source, arch, defines, "") for defines in variants])]
    for failure in (f for f in found if isinstance(f, Exception)):
        raise failure
    return found


def same_sources(tree: Path, source: Path) -> bool:
    """Whether `source` (relative to the repository) and every file it includes are in `tree` what they are
    in the repository, byte for byte: then NVRTC is given the same input, and the machine code is the same
    by construction (its differences from draw to draw aside): nothing to compile."""
    with headers_of(tree):
        theirs = [p.relative_to(tree) for p in (tree / source, *compiler.included_files(tree / source))]
    ours = [p.relative_to(REPO) for p in (REPO / source, *compiler.included_files(REPO / source))]
    return theirs == ours and all((tree / p).read_bytes() == (REPO / p).read_bytes() for p in ours)


def of_base_kernels(current: dict, base: dict) -> dict:
    """current's machine code of the kernels the base has (a kernel added since has nothing to compare with)."""
    return {part: {k: v for k, v in current[part].items() if k in base["sass"]} for part in current}


def unchanged(current: dict, base: dict) -> bool:
    return of_base_kernels(current, base) == base


def fresh_machine_code(tree: Path, source: Path, arch: str, defines: dict, cache: Path) -> dict:
    """sass.machine_code of a compile in a new process, with an empty cache: another draw of NVRTC."""
    cache.mkdir(parents=True, exist_ok=True)
    environment = dict(os.environ, FLASHMOE_CACHE=str(cache), PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, checkout_compile.__file__, str(tree), str(source), arch, json.dumps(defines)],
                         check=True, capture_output=True, text=True, env=environment).stdout
    return json.loads(out)


# ---------------------------------------------------------------- the record of the bases' machine code

def record_key(relative: Path, arch: str) -> str:
    return f"{relative.as_posix()} {arch}"


@functools.cache
def recorded() -> dict:
    """RECORD: {"nvrtc": version, "sources": {"<kernel file> <arch>": {"base": commit, "variants": {variant:
    {"digests": the machine code's of RECORD_DRAWS compiles of the base, each other one once, "kernels": the
    base's}}}}}."""
    return json.loads(RECORD.read_text()) if RECORD.is_file() else {"nvrtc": None, "sources": {}}


def recorded_variants(name: str, relative: Path, arch: str) -> dict:
    """The record's variants of `relative` at `arch`, where it was made by this NVRTC from the base BASES names;
    else none."""
    entry = recorded()["sources"].get(record_key(relative, arch), {})
    if recorded()["nvrtc"] != compiler.nvrtc_version() or entry.get("base") != BASES[name]:
        return {}
    return entry["variants"]


def is_recorded(current: compiler.Cubin, base: dict | None, source: Path, arch: str, defines: dict, tmp_path) -> bool:
    """Whether the current source's machine code, of the kernels the base has, is one the record has of the base
    (`base`; None where it has none): the current cubin's, or, NVRTC drawing other machine code now and then, a
    compile's in a new process."""
    if base is None:
        return False
    if sass.code_digest(current) in base["digests"]:
        return True  # the whole cubin's, kept beside it: no nvdisasm
    for draw in range(FRESH_COMPILES + 1):
        code = sass.machine_code(current) if draw == 0 else \
            fresh_machine_code(REPO, source, arch, defines, tmp_path / f"recorded{draw}")
        if sass.digest_of(of_base_kernels(code, {"sass": dict.fromkeys(base["kernels"])})) in base["digests"]:
            return True
    return False


def record_bases() -> None:
    """Writes RECORD's entries that are not the bases' (a base moved, a kernel file checked since, another NVRTC),
    keeping the others; an entry for a kernel file no longer checked, or now its base's byte for byte, is dropped."""
    nvrtc = compiler.nvrtc_version()
    sources = dict(recorded()["sources"]) if recorded()["nvrtc"] == nvrtc else {}
    for name, source, arch in recorded_sources():
        relative = relative_path(name, source)
        if not recorded_variants(name, relative, arch):
            sources[record_key(relative, arch)] = {"base": BASES[name], "variants": base_draws(name, relative, arch)}
    checked = {record_key(relative_path(name, source), arch) for name, source, arch in recorded_sources()}
    record = {"nvrtc": nvrtc, "sources": {key: entry for key, entry in sources.items() if key in checked}}
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def base_draws(name: str, relative: Path, arch: str) -> dict:
    """{variant: {"digests", "kernels"}} of RECORD_DRAWS compiles of each variant of the base's `relative` at `arch`:
    the first in this process, all at once, the others each in a new process, on every core."""
    tree, every = base_tree(BASES[name]), variants(stages.load(name))
    codes = {variant_key(defines): [sass.machine_code(cubin)]
             for defines, cubin in zip(every, compile_each_in(tree, relative, arch, every))}
    later = [defines for defines in every for _ in range(RECORD_DRAWS - 1)]
    with tempfile.TemporaryDirectory() as caches, ThreadPoolExecutor(os.cpu_count()) as pool:
        drawn = pool.map(lambda job: fresh_machine_code(tree, relative, arch, job[1], Path(caches) / str(job[0])),
                         enumerate(later))
        for defines, code in zip(later, drawn):
            codes[variant_key(defines)].append(code)
    return {variant: {"digests": sorted({sass.digest_of(code) for code in drawn_codes}),
                      "kernels": sorted(drawn_codes[0]["sass"])} for variant, drawn_codes in codes.items()}


def difference(before: dict, after: dict) -> str:
    after = of_base_kernels(after, before)
    for kernel in sorted(set(before["sass"]) | set(after["sass"])):
        old, new = before["sass"].get(kernel, ""), after["sass"].get(kernel, "")
        if old != new:
            diff = difflib.unified_diff(old.splitlines(), new.splitlines(), "base", "current", lineterm="", n=1)
            return f"{kernel}:\n" + "\n".join(list(diff)[:40])
    return f"resources: {before['resources']} -> {after['resources']}"


# ---------------------------------------------------------------- the base trees

def _has_commit(commit: str) -> bool:
    return subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"],
                          capture_output=True).returncode == 0


def base_tree(commit: str) -> Path:
    """A folder holding `commit`'s stages/, what its kernels compile from: extracted once, beside the
    compile cache, so that its cubins are cached too (the cache key holds the kernel's path)."""
    tree = compiler.CACHE_DIR.parent / "trees" / commit
    if not tree.is_dir():
        if not _has_commit(commit):
            pytest.skip(f"commit {commit} is not in this clone (a shallow clone?): git fetch --unshallow")
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "stages"], check=True,
                                 capture_output=True).stdout
        partial = tree.with_name(f"{commit}.tmp{os.getpid()}")
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(partial, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        try:
            partial.rename(tree)
        except OSError:  # another process extracted it first
            shutil.rmtree(partial)
    return tree


def current_cubins(stage, source: str, arch: str) -> dict:
    """{variant key: Cubin} of the current source as the grader compiles it (its signature and geometry checks
    are static_asserts: no code), a ladder rung as its rung: the cubins tests/test_compile.py made."""
    graded = next(s for s in stages.with_rungs(stage.name) if s.source_path == stage.folder / source)
    return compile_stage(graded, graded.source_path, arch, with_sass=False)


def relative_path(name: str, source: str) -> Path:
    """A stage's kernel file, relative to the repository (as in the base trees)."""
    return stages.load(name).folder.relative_to(REPO) / source


def variants(stage) -> list[dict]:
    return [stage.defines(variant) for variant in stage.variants(reference.load(stage.problem))]


@pytest.mark.parametrize("name,source,arch", SOURCES, ids=[f"{n}-{s}-{a}" for n, s, a in SOURCES])
def test_machine_code_is_unchanged(name, source, arch, tmp_path):
    stage, relative = stages.load(name), relative_path(name, source)
    base = base_tree(BASES[name])
    if same_sources(base, relative):
        return  # the same source and headers: the same machine code
    current = current_cubins(stage, source, arch)
    record = recorded_variants(name, relative, arch)
    unmatched = [defines for defines in variants(stage) if not is_recorded(
        current[variant_key(defines)], record.get(variant_key(defines)), relative, arch, defines, tmp_path)]
    for defines, base_cubin in zip(unmatched, compile_each_in(base, relative, arch, unmatched)):
        current_cubin = current[variant_key(defines)]
        if sass.code_digest(current_cubin) == sass.code_digest(base_cubin):
            continue  # the same machine code, kernel for kernel
        befores, afters = [sass.machine_code(base_cubin)], [sass.machine_code(current_cubin)]
        for draw in range(FRESH_COMPILES):
            if any(unchanged(a, b) for a in afters for b in befores):
                break
            befores.append(fresh_machine_code(base, relative, arch, defines, tmp_path / f"base{draw}"))
            afters.append(fresh_machine_code(REPO, relative, arch, defines, tmp_path / f"current{draw}"))
        assert any(unchanged(a, b) for a in afters for b in befores), (
            f"{relative} {arch} {variant_key(defines)}: the machine code differs from {BASES[name]}'s in "
            f"{len(befores)} × {len(afters)} compiles; the first difference, " + difference(befores[0], afters[0]))


def test_the_record_holds_every_variant_checked_at_its_base():
    """RECORD has each kernel file and arch checked whose sources are not their base's, every variant, made from the
    base BASES names now: a base moved without writing it again would leave the test above compiling that base on
    every run."""
    expected = {record_key(relative_path(name, source), arch): (BASES[name], {variant_key(defines) for defines in
                                                                           variants(stages.load(name))})
                for name, source, arch in recorded_sources()}
    found = {key: (entry["base"], set(entry["variants"])) for key, entry in recorded()["sources"].items()}
    assert found == expected, f"{RECORD.relative_to(REPO)} is not the bases': python tests/test_sass_identity.py record"


if __name__ == "__main__":
    if sys.argv[1:] != ["record"]:
        sys.exit(f"usage: python tests/test_sass_identity.py record   (writes {RECORD.relative_to(REPO)})")
    record_bases()
