"""Profile a stage's kernel with Nsight Compute (ncu), side by side with the fastest library baseline.

`python -m grader stage3 --profile [SHAPE]` compiles the stage, then runs the worker (grader/worker.py,
phase "profile") under ncu on one benchmark shape (SHAPE: its index among the stage's benchmark shapes,
default 0, or a regular expression matched against their labels). The worker makes the shape's inputs,
warms up the kernel and every library baseline, picks the fastest baseline by a short timing (the
reference, as the grade's), warms both up once more, then runs each ONCE inside an NVTX range,
RANGES["kernel"] and RANGES["reference"]. ncu profiles only the launches inside those two ranges. Each
is opened as both a push/pop range (this thread's: "NAME/" in ncu's filter) and a start/end range (the
process's: "NAME"), since a backward baseline's kernels are launched by autograd's own device thread.

The command line (ncu_command), and why:

    ncu --target-processes all --nvtx --nvtx-include flashmoe_kernel/ --nvtx-include flashmoe_kernel
        --nvtx-include flashmoe_reference/ --nvtx-include flashmoe_reference
        --replay-mode kernel --cache-control all --clock-control base
        --metrics <METRICS then the stall reasons, one list> --csv --page raw --print-units base
        --log-file <CSV> python -m grader.worker <JOB.json>

- `--replay-mode kernel`: each profiled launch is replayed (its memory saved and restored) until every
  metric is collected, so one launch per side is enough and nothing else runs in between.
- `--clock-control base`: the GPU is locked to its base clocks while profiling, so a kernel profiled
  after a hot one is not slower for it: durations are comparable between kernels and between runs
  (they are longer than the grader's timings, which run at boost clocks).
- `--cache-control all`: L1 and L2 are flushed before each replay pass, so no kernel finds its inputs
  left in L2 by the one before (the grader's timings flush L2 too).
  (Both are ncu's defaults; they are written out so that a changed default cannot change the figures.)
- `--page raw --csv --metrics <list>` rather than `--section` sets with `--page details`: the raw page
  has one row per launch and one column per metric, named by the metric itself (stable across ncu
  versions, unlike the details page's display names), with a units row; and ncu collects exactly
  the metrics listed (fewer replay passes than the full set). `--print-units base`: no auto-scaling
  (nsecond, byte), so a figure's unit never depends on its size.
- `--log-file`: ncu's output goes to a file, so the worker's own JSON events stay on stdout.

The metrics are listed once, in METRICS (and STALL_REASONS): the report, the JSON and the verdicts
read them by their keys there.

The owner's recipe, on the GPU machine (every stage, their committed profiles and fixtures):

    python -m grader all --profile --json results/h100-sxm.json
    # writes, per stage, the profile into the stage's entry (under "profile") and ncu's raw CSV to
    # results/profiles/h100-sxm/<stage>.csv (next to the JSON); the CPU tests parse every such CSV.
    cp results/profiles/h100-sxm/stage3_pipeline.csv tests/fixtures/ncu/h100_stage3_pipeline.csv  # a fixture
    # To check the metric names on a GPU first:
    ncu --query-metrics | grep -E "pipe_tensor_op|issue_stalled_.*per_issue_active|compute_memory_throughput"

Nothing here needs a GPU but `run`: parsing, verdicts and the report run on recorded ncu output.
"""
from __future__ import annotations

import csv
import io
import os
import re
import shutil
import sys
from pathlib import Path

from grader.protocol import RANGES  # the NVTX ranges the worker wraps each side's launches in

SIDES = ("kernel", "reference")

# The settings that make figures comparable between kernels (see the module's docstring).
SETTINGS = {"replay_mode": "kernel", "clock_control": "base", "cache_control": "all"}
SETTINGS_TEXT = "kernel replay, base clocks, caches flushed before each pass"

# key -> (ncu metric, label in the report, kind). Kinds: "ns" a time, "pct" a percentage, "bytes",
# "count". The only list of metrics: the command line, the parser and the report all read it.
METRICS = {
    "duration": ("gpu__time_duration.sum", "duration", "ns"),
    "sm_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "SM throughput", "pct"),
    "memory_pct": ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", "memory throughput", "pct"),
    "tensor_hmma_pct": ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
                        "tensor pipe (HMMA)", "pct"),
    # sm_90's tensor pipe with wgmma's HGMMA counted too (ncu 2025.3: no metric of HGMMA alone)
    "tensor_gmma_pct": ("sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
                        "tensor pipe (HMMA + HGMMA)", "pct"),
    "issue_pct": ("smsp__issue_active.avg.pct_of_peak_sustained_active", "issue slots busy", "pct"),
    "dram_pct": ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "DRAM throughput", "pct"),
    "dram_read_bytes": ("dram__bytes_read.sum", "DRAM read", "bytes"),
    "dram_write_bytes": ("dram__bytes_write.sum", "DRAM written", "bytes"),
    "l1_hit_pct": ("l1tex__t_sector_hit_rate.pct", "L1 hit rate", "pct"),
    "l2_hit_pct": ("lts__t_sector_hit_rate.pct", "L2 hit rate", "pct"),
    "achieved_occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active", "achieved occupancy", "pct"),
    "theoretical_occupancy_pct": ("sm__maximum_warps_per_active_cycle_pct", "theoretical occupancy", "pct"),
    "registers": ("launch__registers_per_thread", "registers/thread", "count"),
    "smem_static_bytes": ("launch__shared_mem_per_block_static", "static smem/block", "bytes"),
    "smem_dynamic_bytes": ("launch__shared_mem_per_block_dynamic", "dynamic smem/block", "bytes"),
    "block_size": ("launch__block_size", "threads/block", "count"),
    "grid_size": ("launch__grid_size", "blocks", "count"),
    "waves": ("launch__waves_per_multiprocessor", "waves per SM", "count"),
    "limit_registers": ("launch__occupancy_limit_registers", "blocks/SM by registers", "count"),
    "limit_shared": ("launch__occupancy_limit_shared_mem", "blocks/SM by smem", "count"),
    "limit_warps": ("launch__occupancy_limit_warps", "blocks/SM by warps", "count"),
    "limit_blocks": ("launch__occupancy_limit_blocks", "blocks/SM by block limit", "count"),
}
# Metrics only some GPUs have: wgmma is sm_90's (an unknown metric stops ncu).
ONLY_ON = {"tensor_gmma_pct": lambda major: major == 9}

# Why a warp did not issue, per issued instruction (ncu's Warp State section): reason -> what to do.
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
STALL_REASONS = {
    "long_scoreboard": "waiting for a global or local memory load (L1TEX): prefetch earlier (cp.async, TMA) or keep more warps or loads in flight",
    "barrier": "waiting at __syncthreads for the other warps of the block: uneven work between warps, or too many barriers",
    "short_scoreboard": "waiting for shared memory or a MUFU (exp, rsqrt) result: bank conflicts or a chain of dependent shared loads",
    "mio_throttle": "the shared-memory/MIO queue is full: too many shared loads (ldmatrix, bank conflicts) or special-function instructions",
    "math_pipe_throttle": "a math pipe (tensor, FMA) is busy: the kernel is compute-bound on that pipe, which is good if it is the tensor pipe",
    "wait": "a fixed-latency dependency (an ALU result, or an explicit wait such as wgmma.wait_group): more independent instructions between",
    "not_selected": "ready, but another warp was picked: enough warps are ready (benign)",
    "selected": "issuing an instruction (not a stall)",
    "dispatch_stall": "the dispatcher could not issue the picked instruction (pipeline conflict): rare; look at register bank pressure",
    "lg_throttle": "the global/local memory queue is full: too many separate global accesses; vectorize or use cp.async/TMA",
    "drain": "waiting at exit for the block's memory writes to drain: a long epilogue of stores",
    "membar": "waiting at a memory barrier (__threadfence, fence.proxy): fences on the hot path",
    "branch_resolving": "waiting for a branch target or a divergent branch to resolve: simplify control flow in the inner loop",
    "no_instruction": "no instruction fetched yet (instruction cache miss, or after a branch): a large unrolled loop",
    "sleeping": "the warp sleeps (nanosleep, or all its threads wait at a barrier or mbarrier try_wait)",
    "tex_throttle": "the texture/L1TEX queue is full: too many texture or surface requests",
    "imc_miss": "waiting for the immediate-constant cache: constants missed in cache (first use or many kernel parameters)",
    "misc": "another reason, not broken down by the hardware",
    "gmma": "waiting for a wgmma to finish or for its operands (sm_90): overlap wgmma with other work (ping-pong, pipelining)",
}
STALLS_ONLY_ON = {"gmma": lambda major: major == 9}
NOT_A_STALL = ("selected",)
TOP_STALLS = 3
COLUMNS_PER_SIDE = 3  # a side's longest kernels shown in the table; the rest are summed into "other"

# Where ncu may be, after PATH: the CUDA toolkit's folders.
NCU_FOLDERS = ("$FLASHMOE_NCU_DIR", "$CUDA_HOME/bin", "$CUDA_PATH/bin", "/usr/local/cuda/bin")
NOT_FOUND = ("Nsight Compute (ncu) not found on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin: it comes with the "
             "CUDA toolkit (or apt install nsight-compute; https://developer.nvidia.com/nsight-compute); put its folder "
             "on PATH or set FLASHMOE_NCU to the ncu binary")
NO_PERMISSION = ("ncu may not read this GPU's performance counters (ERR_NVGPUCTRPERM): run as root, or let every user "
                 "profile with the driver option NVreg_RestrictProfilingToAdminUsers=0 (a line 'options nvidia "
                 "NVreg_RestrictProfilingToAdminUsers=0' in /etc/modprobe.d/, then reboot); "
                 "see https://developer.nvidia.com/ERR_NVGPUCTRPERM")


class ProfileError(Exception):
    """A one-line reason the profile could not be taken (no ncu, no permission, the run failed)."""


# ---- ncu: where it is, its command line --------------------------------------------------------------

def find_ncu(env: dict | None = None) -> str | None:
    """The ncu binary: FLASHMOE_NCU, else on PATH, else in NCU_FOLDERS; None where there is none."""
    env = os.environ if env is None else env
    if env.get("FLASHMOE_NCU"):
        path = Path(env["FLASHMOE_NCU"])
        return str(path) if path.is_file() else None
    found = shutil.which("ncu", path=env.get("PATH", ""))
    if found:
        return found
    for folder in NCU_FOLDERS:
        name = re.match(r"\$(\w+)", folder)
        if name and not env.get(name[1]):
            continue
        path = Path(re.sub(r"\$(\w+)", lambda m: env.get(m[1], ""), folder)) / "ncu"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def metric_names(major: int) -> list[str]:
    """Every ncu metric to collect on a GPU of compute capability `major`.x, in METRICS' order then the stalls."""
    names = [name for key, (name, _, _) in METRICS.items() if ONLY_ON.get(key, lambda m: True)(major)]
    return names + [STALL_METRIC.format(reason) for reason in STALL_REASONS
                    if STALLS_ONLY_ON.get(reason, lambda m: True)(major)]


def ncu_command(ncu: str, csv_path: Path, major: int) -> list[str]:
    """The ncu command line that profiles the worker run which follows it (the worker's argv is appended)."""
    # "NAME/": the push/pop range NAME; "NAME": the start/end range NAME (a launch matching either is profiled once).
    includes = [arg for side in SIDES for pattern in (f"{RANGES[side]}/", RANGES[side]) for arg in ("--nvtx-include", pattern)]
    return [ncu, "--target-processes", "all", "--nvtx", *includes,
            "--replay-mode", SETTINGS["replay_mode"], "--cache-control", SETTINGS["cache_control"],
            "--clock-control", SETTINGS["clock_control"],
            "--metrics", ",".join(metric_names(major)), "--csv", "--page", "raw", "--print-units", "base",
            "--log-file", str(csv_path)]


def ncu_problem(text: str) -> str | None:
    """What ncu's output says went wrong, in one line; None if nothing we know of."""
    if "ERR_NVGPUCTRPERM" in text:
        return NO_PERMISSION
    missing = re.search(r"==ERROR==.*?(?:[Ff]ailed to find metric|[Uu]nknown metric)s?:?\s*'?([\w.]+)", text)
    if missing:
        return (f"this ncu does not know the metric {missing[1]} on this GPU: remove or rename it in grader/profile.py "
                "(METRICS; ncu --query-metrics lists the names)")
    error = re.search(r"^==ERROR== (.+)$", text, re.MULTILINE)
    return f"ncu: {error[1].strip()}" if error else None


def ncu_version(ncu: str) -> str | None:
    import subprocess
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"Version\s+(\S+)", out)
    return found[1] if found else None


# ---- the shape ---------------------------------------------------------------------------------------

def shape_problem(spec: str | None) -> str | None:
    """What is wrong with --profile's SHAPE whatever the stage (an index or a regular expression); None if nothing."""
    if spec is None or spec.isdigit():
        return None
    try:
        re.compile(spec)
    except re.error as error:
        return f"--profile {spec!r}: neither a shape's index nor a regular expression ({error})"
    return None


def pick_shape(spec: str | None, labels: list[str]) -> int:
    """The index of the benchmark shape --profile names: an index (default 0), else the first label the
    regular expression matches; ValueError (one line) if there is none."""
    if spec is None or spec.isdigit():
        index = int(spec or 0)
        if index >= len(labels):
            raise ValueError(f"--profile {index}: there are {len(labels)} benchmark shapes (0 to {len(labels) - 1}): "
                             + "; ".join(f"{i} {label}" for i, label in enumerate(labels)))
        return index
    for index, label in enumerate(labels):
        if re.search(spec, label):
            return index
    raise ValueError(f"--profile {spec!r} matches no benchmark shape: " + "; ".join(labels))


# ---- parsing ncu's raw CSV ---------------------------------------------------------------------------

_TIME_NS = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "s": 1e9, "second": 1e9}
_BYTES = {"byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,  # ncu's prefixes are decimal
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _number(cell: str | None) -> float | None:
    if cell is None:
        return None
    text = cell.strip().replace(",", "")
    try:
        return float(text.split(" (", 1)[0])
    except ValueError:
        return None  # "n/a", ""


def _scaled(value: float | None, unit: str, kind: str) -> float | None:
    unit = unit.strip().lower().split("/")[0]  # "byte/block" -> "byte"
    if value is None:
        return None
    if kind == "ns" and unit in _TIME_NS:
        return value * _TIME_NS[unit]
    if kind == "bytes" and unit in _BYTES:
        return value * _BYTES[unit]
    return value


def _table(text: str) -> tuple[list[str], list[str], list[list[str]]]:
    """(header, units, rows) of the raw page; ncu's own lines (==PROF==, ==WARNING==) around it are left out."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("==")]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    start = next((i for i, row in enumerate(rows) if row and row[0].strip() == "ID"), None)
    if start is None or len(rows) < start + 2:
        raise ValueError("not ncu's raw CSV page: no header row starting with \"ID\" followed by a units row")
    header = rows[start]
    return header, rows[start + 1], [row for row in rows[start + 2:] if len(row) == len(header)]


def _side(nvtx: str, name: str, our_kernels: tuple) -> str:
    if RANGES["reference"] in nvtx:
        return "reference"
    if RANGES["kernel"] in nvtx:
        return "kernel"
    if our_kernels:  # no NVTX column (an older ncu): ours are the stage's kernels by name
        return "kernel" if any(re.search(rf"\b{re.escape(k)}\b", name) for k in our_kernels) else "reference"
    return "unknown"


def parse_raw_csv(text: str, our_kernels: tuple = ()) -> list[dict]:
    """One record per profiled launch, in launch order: {"id", "side", "name", "metrics": {key: value},
    "stalls": {reason: warps stalled per issued instruction}}. Durations in ns, sizes in bytes."""
    header, units, rows = _table(text)
    nvtx_columns = [i for i, column in enumerate(header) if "Range" in column or "NVTX" in column]
    name_column = header.index("Kernel Name") if "Kernel Name" in header else None
    by_metric = {name: key for key, (name, _, _) in METRICS.items()}
    stall_pattern = re.compile(STALL_METRIC.format(r"(\w+?)").replace(".", r"\.") + "$")
    records = []
    for row in rows:
        name = row[name_column] if name_column is not None else "?"
        nvtx = " ".join(row[i] for i in nvtx_columns)
        record = {"id": row[0], "side": _side(nvtx, name, tuple(our_kernels)), "name": name, "metrics": {}, "stalls": {}}
        for column, unit, cell in zip(header, units, row):
            if column in by_metric:
                key = by_metric[column]
                record["metrics"][key] = _scaled(_number(cell), unit, METRICS[key][2])
            elif found := stall_pattern.match(column):
                value = _number(cell)
                if value is not None:
                    record["stalls"][found[1]] = value
        records.append(record)
    return records


# ---- per kernel: grouping, stalls, verdicts ----------------------------------------------------------

def short_name(name: str, width: int = 30) -> str:
    """A kernel's name for a column heading: no return type, template arguments, parameters or namespaces."""
    text = re.sub(r"^void\s+", "", name.strip())
    depth, kept = 0, []
    for char in text:  # drop <...> and (...) with what they nest
        if char in "<(":
            depth += 1
        elif char in ">)":
            depth = max(depth - 1, 0)
        elif depth == 0:
            kept.append(char)
    text = "".join(kept).strip().split("::")[-1] or name
    return text if len(text) <= width else text[:width - 1] + "…"


_SUMMED = ("duration", "dram_read_bytes", "dram_write_bytes")
_LAUNCH = ("registers", "smem_static_bytes", "smem_dynamic_bytes", "block_size", "grid_size", "waves",
           "limit_registers", "limit_shared", "limit_warps", "limit_blocks", "theoretical_occupancy_pct")


def combine(records: list[dict], name: str) -> dict:
    """Several launches as one column: times and bytes summed, rates weighted by duration, launch figures
    (registers, shared memory) the longest launch's."""
    weights = [r["metrics"].get("duration") or 0.0 for r in records]
    total = sum(weights) or 1.0
    longest = max(records, key=lambda r: r["metrics"].get("duration") or 0.0)
    metrics = {}
    for key in METRICS:
        values = [(r["metrics"].get(key), w) for r, w in zip(records, weights) if r["metrics"].get(key) is not None]
        if not values:
            metrics[key] = None
        elif key in _SUMMED:
            metrics[key] = sum(v for v, _ in values)
        elif key in _LAUNCH:
            metrics[key] = longest["metrics"].get(key)
        else:
            metrics[key] = sum(v * w for v, w in values) / total if sum(weights) else sum(v for v, _ in values) / len(values)
    stalls = {}
    for reason in {s for r in records for s in r["stalls"]}:
        stalls[reason] = sum(r["stalls"].get(reason, 0.0) * w for r, w in zip(records, weights)) / total \
            if sum(weights) else sum(r["stalls"].get(reason, 0.0) for r in records) / len(records)
    return {"side": records[0]["side"], "name": name, "short": short_name(name), "launches": len(records),
            "metrics": metrics, "stalls": stalls}


def kernels_of(records: list[dict], side: str, columns: int = COLUMNS_PER_SIDE) -> list[dict]:
    """A side's kernels, one per name (repeated launches combined), longest first; past `columns`, the
    rest combined into one "other" column."""
    names: dict[str, list[dict]] = {}
    for record in records:
        if record["side"] == side:
            names.setdefault(record["name"], []).append(record)
    kernels = sorted((combine(group, name) for name, group in names.items()),
                     key=lambda k: -(k["metrics"].get("duration") or 0.0))
    if len(kernels) > columns:
        rest = [r for k in kernels[columns - 1:] for r in names[k["name"]]]
        other = combine(rest, f"other ({len(kernels) - columns + 1} kernels)")
        other["short"] = other["name"]
        kernels = kernels[:columns - 1] + [other]
    return kernels


def top_stalls(stalls: dict, top: int = TOP_STALLS) -> list[dict]:
    """The largest stall reasons (issuing, "selected", left out): {reason, per_instruction, share (%), why}."""
    real = {r: v for r, v in stalls.items() if r not in NOT_A_STALL and v > 0}
    total = sum(real.values()) or 1.0
    ranked = sorted(real.items(), key=lambda item: -item[1])[:top]
    return [{"reason": r, "per_instruction": v, "share": 100 * v / total,
             "why": STALL_REASONS.get(r, "(no explanation recorded)")} for r, v in ranked]


COMPUTE, MEMORY = 60.0, 60.0  # % of peak (speed of light) above which a unit counts as the bound


def occupancy_limit(metrics: dict) -> str | None:
    """What limits the blocks per SM: "registers", "shared memory", "warps" or "blocks"; None if unknown."""
    limits = {"registers": metrics.get("limit_registers"), "shared memory": metrics.get("limit_shared"),
              "warps": metrics.get("limit_warps"), "the block limit": metrics.get("limit_blocks")}
    known = {k: v for k, v in limits.items() if v is not None}
    return min(known, key=known.get) if known else None


def verdict(metrics: dict, stalls: dict) -> dict:
    """From the speed-of-light figures: {"bound": "compute" | "memory" | "latency", "why": the figures,
    "first": the one thing to look at first}."""
    sm, memory = metrics.get("sm_pct") or 0.0, metrics.get("memory_pct") or 0.0
    tensor = max((metrics.get(k) or 0.0) for k in ("tensor_hmma_pct", "tensor_gmma_pct"))
    dram = metrics.get("dram_pct") or 0.0
    figures = f"SM {sm:.0f}%, memory {memory:.0f}% of peak"
    stall = top_stalls(stalls, 1)
    if sm >= COMPUTE and sm >= memory:
        if tensor >= 50:
            first = (f"the tensor pipe is busy {tensor:.0f}% of the time: near what this design can do; what is left "
                     "is overlapping the non-MMA work (softmax, epilogue) with the MMAs")
        elif tensor > 0:
            first = (f"the SM is busy but the tensor pipe only {tensor:.0f}%: other instructions (address arithmetic, "
                     "conversions, exp) take the issue slots; look at the SASS mix")
        else:
            first = "busy on CUDA cores without tensor cores: look at the instruction mix, and whether MMAs could do the work"
        return {"bound": "compute", "why": figures, "first": first}
    if memory >= MEMORY and memory > sm:
        moved = ((metrics.get("dram_read_bytes") or 0) + (metrics.get("dram_write_bytes") or 0)) / 1e6
        if dram >= MEMORY:
            first = (f"DRAM at {dram:.0f}% of its bandwidth, {moved:,.1f} MB moved: move fewer bytes (reuse each tile "
                     "longer from shared memory or registers; compare the bytes with the reference's)")
        else:
            first = (f"bound on on-chip memory (DRAM only {dram:.0f}%): shared-memory bank conflicts or L1/L2 traffic; "
                     "look at the mio_throttle and short_scoreboard stalls")
        return {"bound": "memory", "why": figures, "first": first}
    achieved, theoretical = metrics.get("achieved_occupancy_pct"), metrics.get("theoretical_occupancy_pct")
    waves = metrics.get("waves")
    if waves is not None and waves < 1:
        first = f"the grid fills {100 * waves:.0f}% of one wave of blocks: too few blocks to keep every SM busy"
    elif achieved is not None and theoretical and achieved < 0.7 * theoretical:
        first = (f"achieved occupancy {achieved:.0f}% of a theoretical {theoretical:.0f}%: blocks end unevenly "
                 "(a tail) or the grid is small")
    elif theoretical is not None and theoretical <= 25 and (limit := occupancy_limit(metrics)):
        first = f"theoretical occupancy {theoretical:.0f}%, limited by {limit}: few warps to hide latency"
    elif stall:
        first = f"the top stall, {stall[0]['reason']} ({stall[0]['share']:.0f}% of stalls): {stall[0]['why']}"
    else:
        first = "neither compute nor memory is busy: look at the warp stalls and the occupancy"
    return {"bound": "latency", "why": figures, "first": first}


# ---- the profile: records -> what the report and the JSON hold -----------------------------------------

def summarize(records: list[dict]) -> dict:
    """{"kernels": one entry per column (side, name, short, launches, metrics, stalls, top_stalls, verdict),
    "totals": {side: {"duration", "dram_bytes", "launches"}}}."""
    kernels = []
    for side in SIDES:
        for kernel in kernels_of(records, side):
            kernel["top_stalls"] = top_stalls(kernel["stalls"])
            kernel["verdict"] = verdict(kernel["metrics"], kernel["stalls"])
            kernels.append(kernel)
    totals = {}
    for side in SIDES:
        mine = [r for r in records if r["side"] == side]
        totals[side] = {"launches": len(mine),
                        "duration": sum(r["metrics"].get("duration") or 0.0 for r in mine),
                        "dram_bytes": sum((r["metrics"].get("dram_read_bytes") or 0.0)
                                          + (r["metrics"].get("dram_write_bytes") or 0.0) for r in mine)}
    return {"kernels": kernels, "totals": totals}


# ---- running it (the only part that needs a GPU) -----------------------------------------------------

def csv_path_for(stage_key: str, json_path: Path | None) -> Path:
    """Where ncu's raw CSV goes: next to the results file (results/profiles/<its stem>/<stage>.csv), or a
    temporary folder without one."""
    name = stage_key.replace(":", "_") + ".csv"
    if json_path is not None:
        return Path(json_path).parent / "profiles" / Path(json_path).stem / name
    import tempfile
    return Path(tempfile.gettempdir()) / "flashmoe-profiles" / name


def run(stage, cubins: dict, gpu, spec: str | None, csv_path: Path, timeout_s: float = 300.0,
        ncu: str | None = None, worker: list[str] | None = None, beside: str | None = None) -> dict:
    """Profile `stage`'s kernel (compiled as `cubins`) and the reference (the fastest library baseline, or
    the one named `beside`) on one benchmark shape; the profile (as the report and the JSON hold it), or
    ProfileError. `worker` replaces the worker's argv (tests)."""
    import reference
    from grader.exercise import shown
    from grader.isolation import WORKER, run_job

    ncu = ncu or find_ncu()
    if ncu is None:
        raise ProfileError(NOT_FOUND)
    problem = reference.load(stage.problem)
    shapes = problem.benchmarks() + list(stage.extra_benchmarks)
    index = pick_shape(spec, [problem.shape_label(s) for s in shapes])
    shape = shapes[index]
    csv_path = Path(csv_path)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    if csv_path.exists():
        csv_path.unlink()
    command = ncu_command(ncu, csv_path, gpu.major)
    job = {"stage": stage.key, "phase": "profile", "cubins": {k: str(getattr(c, "path", c)) for k, c in cubins.items()},
           "shape": [index, shape], "l2_bytes": gpu.l2_bytes, "beside": beside}
    events = {}
    failure = run_job(job, lambda event: events.setdefault(event["event"], event), timeout_s,
                      worker=[*command, *(worker or WORKER)])
    log = csv_path.read_text(errors="replace") if csv_path.exists() else ""
    problem_text = ncu_problem(log + "\n" + (failure.message if failure else ""))
    if problem_text and (failure or "ERR_NVGPUCTRPERM" in log or "profile_done" not in events):
        raise ProfileError(problem_text)
    if failure:
        raise ProfileError(f"the profiled run failed: {failure.kind}: {failure.message}")
    done = events.get("profile_done")
    if done is None:
        raise ProfileError("the profiled run ended before profiling (no profile_done event)")
    try:
        records = parse_raw_csv(log, tuple(stage.kernels))
    except ValueError as error:
        raise ProfileError(f"ncu wrote no results to {csv_path} ({error}){': ' + problem_text if problem_text else ''}")
    if not any(r["side"] == "kernel" for r in records):
        raise ProfileError(f"ncu profiled none of the kernel's launches (see {csv_path}): is NVTX filtering working?")
    profile = {"shape_index": index, "label": problem.shape_label(shape), "dtype": shape["dtype"],
               "shape": {k: v for k, v in shape.items() if k != "dtype"},
               "reference": done["reference"], "baselines_ms": done.get("baselines_ms", {}),
               "skipped": done.get("skipped", {}),
               "settings": dict(SETTINGS, text=SETTINGS_TEXT, ncu=ncu_version(ncu),
                                command=[Path(command[0]).name, *command[1:-1], "<CSV>"]),
               "raw_csv": shown(csv_path), **summarize(records)}
    return profile


# ---- the report ----------------------------------------------------------------------------------------

def _cell(value, kind: str) -> str:
    if value is None:
        return "—"
    if kind == "ns":
        return f"{value / 1e3:,.1f} µs" if value < 1e6 else f"{value / 1e6:,.3f} ms"
    if kind == "pct":
        return f"{value:.1f}%"
    if kind == "bytes":
        return f"{value / 1e6:,.2f} MB" if value >= 1e5 else f"{value:,.0f} B"
    return f"{value:,.2f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)


def _kib(value) -> str:
    return "—" if value is None else ("0" if value == 0 else f"{value / 1024:,.1f} KiB".replace(".0 KiB", " KiB"))


def table_rows(metrics: dict) -> list[tuple[str, str]]:
    """A kernel's column of the side-by-side table: (row label, cell), the same rows for every kernel."""
    m = metrics
    # One figure: on sm_90 ncu's HMMA counter already counts wgmma's HGMMA too (the two are equal for a wgmma
    # kernel), so which instructions kept the pipe busy is the SASS's business, not this row's.
    hmma, gmma = m.get("tensor_hmma_pct"), m.get("tensor_gmma_pct")
    tensor = "—" if hmma is None and gmma is None else f"{max(hmma or 0.0, gmma or 0.0):.1f}%"
    read, written = m.get("dram_read_bytes"), m.get("dram_write_bytes")
    dram_bytes = "—" if read is None and written is None else \
        f"{_cell((read or 0) + (written or 0), 'bytes')} ({_cell(read, 'bytes')} read)"
    static, dynamic = m.get("smem_static_bytes"), m.get("smem_dynamic_bytes")
    shared = "—" if static is None and dynamic is None else _kib((static or 0) + (dynamic or 0))
    limit = occupancy_limit(m)
    limits = [m.get(k) for k in ("limit_registers", "limit_shared", "limit_warps", "limit_blocks") if m.get(k) is not None]
    blocks = "—" if not limits else f"{_cell(min(limits), 'count')} ({limit})"
    achieved, theoretical = m.get("achieved_occupancy_pct"), m.get("theoretical_occupancy_pct")
    return [("duration", _cell(m.get("duration"), "ns")),
            ("SM throughput", _cell(m.get("sm_pct"), "pct")),
            ("memory throughput", _cell(m.get("memory_pct"), "pct")),
            ("tensor pipe", tensor),
            ("issue slots busy", _cell(m.get("issue_pct"), "pct")),
            ("DRAM throughput", _cell(m.get("dram_pct"), "pct")),
            ("DRAM bytes", dram_bytes),
            ("L1 / L2 hit rate", f"{_cell(m.get('l1_hit_pct'), 'pct')} / {_cell(m.get('l2_hit_pct'), 'pct')}"),
            ("occupancy achieved / theoretical", f"{_cell(achieved, 'pct')} / {_cell(theoretical, 'pct')}"),
            ("blocks per SM (limited by)", blocks),
            ("registers per thread", _cell(m.get("registers"), "count")),
            ("shared memory per block", shared),
            ("threads × blocks", f"{_cell(m.get('block_size'), 'count')} × {_cell(m.get('grid_size'), 'count')}"),
            ("waves", _cell(m.get("waves"), "count"))]


def heading(kernel: dict, reference_name: str | None) -> str:
    who = "ours" if kernel["side"] == "kernel" else (reference_name or "reference")
    launches = f" ×{kernel['launches']}" if kernel["launches"] > 1 and not kernel["name"].startswith("other") else ""
    return f"{who}: {kernel['short']}{launches}"


def print_profile(profile: dict, stage_key: str, gpu_name: str | None) -> None:
    """The side-by-side table (rows: metrics; columns: our kernels, then the reference's), the stalls, the verdicts."""
    from rich.text import Text

    from grader.report import console, show

    ref = profile.get("reference") or {}
    kernels = profile["kernels"]
    columns = ["metric", *[heading(k, ref.get("name")) for k in kernels]]
    cells = [table_rows(k["metrics"]) for k in kernels]
    rows = [[label, *[column[i][1] for column in cells]] for i, (label, _) in enumerate(cells[0])] if cells else []
    totals = profile["totals"]
    show(f"Nsight Compute on {gpu_name or 'this GPU'}: {stage_key} at {profile['label']} {profile['dtype']} "
         f"beside {ref.get('name', 'the reference')} ({profile['settings']['text']})", columns, rows,
         right=tuple(columns[1:]))
    ours, theirs = totals["kernel"]["duration"], totals["reference"]["duration"]
    if ours and theirs:
        console.print(Text(f"Profiled time: ours {_cell(ours, 'ns')} in {totals['kernel']['launches']} launch(es), "
                           f"{ref.get('name', 'reference')} {_cell(theirs, 'ns')} in "
                           f"{totals['reference']['launches']}: {theirs / ours:.2f}x the reference's speed "
                           "(base clocks; the grader's timings run at boost)."))
    stall_rows = [[heading(k, ref.get("name")), " · ".join(f"{s['reason']} {s['share']:.0f}%" for s in k["top_stalls"]) or "—"]
                  for k in kernels]
    show("Top warp stalls (share of the stalled cycles per issued instruction)", ["kernel", "stalls"], stall_rows)
    seen = list(dict.fromkeys(s["reason"] for k in kernels for s in k["top_stalls"]))
    for reason in seen:
        console.print(Text.assemble("  ", (reason, "bold"), f": {STALL_REASONS.get(reason, '')}"))
    for k in kernels:
        v = k["verdict"]
        console.print(Text.assemble((heading(k, ref.get("name")), "bold"),
                                    f": {v['bound']}-bound ({v['why']}). First: {v['first']}."))
    console.print(Text(f"ncu's raw CSV: {profile['raw_csv']}"))
