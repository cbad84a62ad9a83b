"""The results files, results/<gpu>.json: what a grader run measured, with where and on what.

A stage's entry records `source_sha256`, the digest of everything that decides what its kernel
does and how fast (the .cu file, the local headers it includes, the stage's launch code and the
shared launch code it imports from stages.common), and `runs_digest`, the digest of what of it runs
(grader/runs_digest.py); a test fails when a committed entry matches the tree by neither, so a
changed kernel is measured again.
"""
from __future__ import annotations

import ast
import datetime
import hashlib
import inspect
import json
import os
import re
import subprocess
from importlib import metadata
from pathlib import Path

import stages
from stages.common.compiler import REPO, included_files, nvrtc_version

STAGES_DIR = REPO / "stages"

RESULTS_DIR = REPO / "results"


def source_files(stage, kernel_path: Path | None = None) -> list[Path]:
    kernel_path = Path(kernel_path or stage.source_path)
    files = [kernel_path, stage.folder / "__init__.py"]
    if stage.rung:  # a rung's launch code: the module that defines it, its ladder's (stages.rungs)
        files += [path for path in [Path(inspect.getfile(stage.launch))] if path not in files]
    python = files[1:]
    while python:  # the launch code, and the stage modules it imports, recursively
        for path in imported_stage_modules(python.pop()):
            if path not in files:
                files.append(path)
                python.append(path)
    files += [path for path in included_files(kernel_path) if path not in files]  # the headers, recursively
    for key in stage.uses:  # the stages it launches through stages.ops (stage 10: the attention, the MoE layer)
        files += [path for path in source_files(stages.load(key)) if path not in files]
    return files


def imported_stage_modules(path: Path) -> list[Path]:
    """The modules of stages/ a launch file imports, at its top or inside a function: shared launch
    code (stages.common.hopper), another stage's (stages.stage6_grouped_gemm) or the ops (`from stages
    import ops`), whose changes change what the stage runs too."""
    return stage_modules_imported_by(ast.parse(path.read_text()))


def stage_modules_imported_by(tree: ast.Module) -> list[Path]:
    """The files of the modules of stages/ that a module's syntax tree imports: those of `from stages.X
    import ...` in the order they are written, then those of `from stages import X, Y`."""
    imports = sorted((node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module),
                     key=lambda node: (node.lineno, node.col_offset))
    names = [node.module.removeprefix("stages.") for node in imports if node.module.startswith("stages.")]
    names += [alias.name for node in imports if node.module == "stages" for alias in node.names]
    modules = [STAGES_DIR / name.replace(".", "/") for name in names]
    return [module / "__init__.py" if module.is_dir() else module.with_suffix(".py") for module in modules
            if module.is_dir() or module.with_suffix(".py").is_file()]


def source_digest(stage, kernel_path: Path | None = None) -> str:
    digest = hashlib.sha256()
    for path in sorted(source_files(stage, kernel_path), key=lambda p: p.name):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def same_kernel(recorded: dict, entry: dict) -> bool:
    """Whether two entries of a stage measured the same kernel: the same sources, or the same runs
    digest (grader/runs_digest.py) from one NVRTC version."""
    if recorded.get("source_sha256") == entry.get("source_sha256"):
        return True
    runs = recorded.get("runs_digest", {})
    return any(runs.get(version) == digest for version, digest in entry.get("runs_digest", {}).items())


def provenance(gpu) -> dict:
    def version(package):
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    import torch
    return {
        "gpu": gpu.name if gpu else None,
        "compute_capability": f"{gpu.major}.{gpu.minor}" if gpu else None,
        "sms": gpu.sms if gpu else None,
        "sm_clock_mhz": gpu.sm_clock_mhz if gpu else None,
        "driver_cuda": gpu.driver if gpu else None,
        "driver": _driver_version(),
        "nvrtc": nvrtc_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_core": version("cuda-core"),
        "cuda_bindings": version("cuda-bindings"),
        # FLASHMOE_COMMIT names the commit a copied working tree came from (a copy's .git may be stale).
        "commit": os.environ.get("FLASHMOE_COMMIT") or git("rev-parse", "HEAD"),
        "dirty": None if os.environ.get("FLASHMOE_COMMIT") else bool(git("status", "--porcelain", "--untracked-files=no")),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def load_all() -> dict[str, dict]:
    """{file stem: results} for every results/*.json."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS_DIR.glob("*.json"))}


def write(path: Path, gpu_name: str, prov: dict, stage_results: dict) -> None:
    """Write (or update: other stages' entries are kept when the GPU is the same) a results file. A file may
    name, under "not_measured", stages the GPU runs that it holds no entry for, each with the reason."""
    path = Path(path)
    data = {"gpu": gpu_name, "provenance": prov, "stages": {}}
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("gpu") == gpu_name:  # the stages' entries and the rest ("ops") are kept
            data = {**old, "provenance": prov, "stages": old.get("stages", {})}
    for key, entry in stage_results.items():  # a profile of the same kernel stays valid: kept
        old_entry = data["stages"].get(key) or {}
        if "profile" not in entry and "profile" in old_entry and same_kernel(old_entry, entry):
            entry["profile"] = old_entry["profile"]
    data["stages"].update(stage_results)
    if not_measured := {k: why for k, why in data.get("not_measured", {}).items() if k not in data["stages"]}:
        data["not_measured"] = not_measured  # a stage recorded now is no longer missing here
    else:
        data.pop("not_measured", None)
    data["stages"] = dict(sorted(data["stages"].items(), key=lambda kv: int(re.match(r"stage(\d+)", kv[0]).group(1))))
    save(path, data)


def recorded_entries(path: Path, gpu_name: str) -> dict:
    """The stages' entries a results file holds for this GPU ({} if none)."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {}
    return data.get("stages", {}) if data.get("gpu") == gpu_name else {}


def add_profile(path: Path, gpu_name: str, stage_key: str, profile: dict) -> None:
    """Put a stage's profile (grader/profile.py) into its entry of a results file, under "profile",
    leaving the rest as it was; ValueError (one line) where the file has no entry for it on this GPU."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {}
    entry = data.get("stages", {}).get(stage_key) if data.get("gpu") == gpu_name else None
    if entry is None:
        raise ValueError(f"{path} has no results for {stage_key} on {gpu_name}, to put its profile in: grade it "
                         f"first (python -m grader {stage_key} --json {path})")
    entry["profile"] = profile
    save(path, data)


def add_ops(path: Path, gpu_name: str, prov: dict, measured: dict) -> None:
    """Put `python -m grader ops`'s figures under "ops" of a results file (with the provenance they were
    measured with), leaving the stages' entries as they were; ValueError (one line) for another GPU's file."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {"gpu": gpu_name, "provenance": prov, "stages": {}}
    if data.get("gpu") != gpu_name:
        raise ValueError(f"{path} holds results of {data.get('gpu')}, not of this {gpu_name}")
    data["ops"] = {"provenance": prov, **measured}
    save(path, data)


def save(path: Path, data: dict) -> None:
    """Write a results file, as every writer here does (one line per value: diffs show what changed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")
