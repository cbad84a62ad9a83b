"""Grade one stage: compile, check on every case, time the benchmarks, grade. No printing here:
`report.py` shows what this returns, and `progress` (a callback) hears how far it is."""
from __future__ import annotations

import re
import time
from pathlib import Path

import reference
import stages
from stages import arch_for, variant_key
from stages.common.compiler import CompileError, compile_cubin
from grader import grading, sass
from grader.exercise import shown
from grader.gpus import spec_for
from grader.isolation import run_items
from grader.parallel_compile import compile_each
from grader.results import same_kernel, source_digest
from grader.protocol import PREVIOUS


class GraderError(Exception):
    """A one-line problem with what the learner asked for (unknown stage, missing file, ...)."""


def signature_checks(kernels: dict[str, str], param_structs=()) -> str:
    """C++ appended to the kernel's source: each kernel must have the parameter list the stage launches with,
    and each parameter struct the layout the launch packs (param_struct_checks)."""
    lines = ["template <class A, class B> struct grader_same_type { static constexpr bool value = false; };",
             "template <class A> struct grader_same_type<A, A> { static constexpr bool value = true; };"]
    for name, params in kernels.items():
        lines.append(f'static_assert(grader_same_type<decltype(&{name}), void (*)({params})>::value, '
                     f'"GRADER-SIGNATURE {name}");')
    return "\n".join(lines + param_struct_checks(param_structs))


def param_struct_checks(structs) -> list[str]:
    """The checks that each parameter struct a kernel takes (stage.param_structs) is laid out as the launch
    packs it (stages/common/launcher.py's param_struct): each field's type, the fields in the launch's order and
    no others, then the struct's size, which with C's rules of alignment make the launch's offsets. The order
    is a structured binding's (C++17: it names a struct's fields in their order, and wants a name for each),
    compared with the fields by name; NVRTC 13.0 has no offsetof."""
    lines = []
    for struct in structs:
        name = struct.__name__
        for field, c_type in struct._c_fields:
            lines.append(f'static_assert(grader_same_type<decltype({name}::{field}), {c_type}>::value, '
                         f'"GRADER-PARAMS {name}.{field} type");')
        bindings = ", ".join(f"grader_{i}" for i in range(len(struct._c_fields)))
        in_order = " && ".join(f"&grader_{i} == &s.{field}" for i, (field, _) in enumerate(struct._c_fields))
        lines.append(f"__device__ constexpr bool grader_in_order_{name}() {{ {name} s{{}}; auto& [{bindings}] = s; "
                     f'return {in_order}; }}  // "GRADER-PARAMS {name} order"')
        lines.append(f'static_assert(grader_in_order_{name}(), "GRADER-PARAMS {name} order");')
        lines.append(f'static_assert(sizeof({name}) == {struct._size}, "GRADER-PARAMS {name} size");')
    return lines


def geometry_checks(geometry: dict[str, int]) -> str:
    """C++ appended to the kernel's source: each constant the launch relies on (stage.geometry) must
    have, in the kernel, the value the launch uses."""
    return "\n".join(f'static_assert(({name}) == {value}, "GRADER-GEOMETRY {name}");' for name, value in geometry.items())


def stage_builds(stage) -> list[tuple[dict, str]]:
    """(the -D macros, the checks appended to the source) of each variant compile_stage compiles, in its
    order: what compile_cubin is called with, besides the kernel's path and the arch."""
    problem = reference.load(stage.problem)
    signatures = signature_checks(stage.kernels, stage.param_structs)
    return [(defines, signatures + "\n" + geometry_checks(stage.geometry(defines)))
            for defines in map(stage.defines, stage.variants(problem))]


def compile_stage(stage, kernel_path: Path, arch: str, with_sass: bool = True) -> dict:
    """{variant key: Cubin} for every dtype × specialization; GraderError for a signature or geometry problem.
    Every variant compiled at once on every CPU core (grader/parallel_compile.py; a cached one is found at
    once), the first failure in the variants' order said here, as soon as it is known. With with_sass (a grade's
    report, a record's runs digest), each cubin's SASS mix and machine-code digest are made there too: a caller
    that reads neither (a test that a kernel compiles) saves nvdisasm's half a second a cubin."""
    jobs = [(kernel_path, arch, defines, checks) for defines, checks in stage_builds(stage)]
    cubins = {}
    found = compile_each(jobs, stop_at_failure=True, with_sass=with_sass)
    for (_, _, defines, checks), (compiled, _) in zip(jobs, found):
        try:
            if isinstance(compiled, Exception):
                raise compiled
            cubins[variant_key(defines)] = compiled or compile_cubin(kernel_path, arch, defines, checks)
        except CompileError as error:
            raise (_explain_param_struct_error(error, checks, stage, kernel_path)
                   or _explain_signature_error(error, stage, kernel_path)
                   or _explain_geometry_error(error, checks, stage.geometry(defines), defines, kernel_path) or error)
    return cubins


def _explain_signature_error(error: CompileError, stage, kernel_path) -> GraderError | None:
    """A compile error in the grader's signature check, said in one line; None for the learner's own errors."""
    if _learners_own_errors(error):
        return None
    for name, params in stage.kernels.items():
        expected = f'extern "C" __global__ void {name}({params})'
        if re.search(rf'identifier "{name}" is undefined', error.log):
            return GraderError(f"{shown(kernel_path)}: no kernel named {name} (expected {expected})")
        if f'"GRADER-SIGNATURE {name}"' in error.log:
            return GraderError(f"{shown(kernel_path)}: kernel {name} does not have the signature the stage launches: {expected}")
        if f"kernel {name} has C++ linkage" in error.log:  # compiler.py's check of the entry functions
            return GraderError(f"{shown(kernel_path)}: kernel {name} must be declared {expected}")
    return None


def _explain_param_struct_error(error: CompileError, checks: str, stage, kernel_path) -> GraderError | None:
    """A parameter struct laid out otherwise than the launch packs it, in one line: its first field that
    differs (the fields after it are then often out of place too); None for other errors."""
    if _learners_own_errors(error):
        return None
    said = {}  # line of the checks -> what NVRTC says of it, errors and notes
    for line, message in re.findall(r"^grader-signature-check\((\d+)\): (?:error|note)[^:]*: (.*)$", error.log,
                                    re.MULTILINE):
        said[int(line)] = said.get(int(line), "") + message + "\n"
    check_lines, structs, found = checks.splitlines(), {s.__name__: s for s in stage.param_structs}, {}
    for line, messages in sorted(said.items()):
        if not (m := re.search(r'"GRADER-PARAMS (\w+)\.?(\w*) (type|order|size)"', check_lines[line - 1])):
            continue
        if m[1] not in found:
            found[m[1]] = _struct_problem(structs[m[1]], m[2], m[3], messages)
    if not found:
        return None
    return GraderError("\n".join(f"{shown(kernel_path)}: {problem}" for problem in found.values()))


def _struct_problem(struct, field: str, what: str, messages: str) -> str:
    """What NVRTC's `messages` on the check of `what` (type, order, size) of struct(.field) say, in words."""
    name, fields = struct.__name__, dict(struct._c_fields)
    layout = "{" + " ".join(f"{t} {f};" for f, t in struct._c_fields) + "}"
    if re.search(r"is undefined|is not a type name|must be a class", messages):
        return f"no struct {name}: the launch packs {layout}"
    if "has no member" in messages:
        return f"struct {name} has no field {field}: the launch packs {layout}"
    if what == "type":
        return f"{name}.{field} is not the {fields[field]} the launch packs: {layout}"
    if what == "order":
        if m := re.search(r"there are (more|fewer) elements than", messages):
            return f"struct {name} has {m[1]} fields than the launch packs: {layout}"
        return f"the fields of {name} are not in the order the launch packs them: {layout}"
    kernel_says = re.search(r"the final comparison was (\d+) ==", messages)
    size = f"{kernel_says[1]} bytes" if kernel_says else "of another size"  # NVRTC 13.0 does not say the value
    return f"struct {name} is {size}, the launch packs {struct._size} bytes: {layout}"


def _learners_own_errors(error: CompileError) -> bool:
    """Whether NVRTC's log has errors outside the grader's checks: NVRTC's log says them best."""
    return any("): error" in l and not l.startswith("grader-signature-check") for l in error.log.splitlines())


def _explain_geometry_error(error: CompileError, checks: str, geometry: dict, defines: dict,
                            kernel_path) -> GraderError | None:
    """A kernel constant that is not what the launch uses, one line each; None for other errors."""
    if _learners_own_errors(error):
        return None
    check_lines = checks.splitlines()
    failed = {}  # line of the checks -> [constant, what the kernel says]
    for line, message in re.findall(r"^grader-signature-check\((\d+)\): error: (.*)$", error.log, re.MULTILINE):
        if m := re.search(r'"GRADER-GEOMETRY (.+)"', check_lines[int(line) - 1]):
            name = m.group(1)
            failed[int(line)] = [name, f"the kernel does not define {name}" if "is undefined" in message else
                                 "the kernel says otherwise" if "static assertion failed" in message else
                                 f"the kernel's {name} is not a compile-time constant"]
    for line, value in re.findall(r"^grader-signature-check\((\d+)\): note.*the final comparison was (-?\d+) ==",
                                  error.log, re.MULTILINE):
        if int(line) in failed:  # EDG's note says both sides of a failed ==: the kernel's value first
            failed[int(line)][1] = f"the kernel says {value}"
    if not failed:
        return None
    return GraderError("\n".join(f"{shown(kernel_path)}: the launch uses {name} = {geometry[name]} for "
                                 f"{variant_key(defines)}; {kernel_says}" for name, kernel_says in failed.values()))


def resources(cubins: dict) -> dict:
    """{variant: {kernel: registers, shared memory, spills, key SASS instruction counts}}."""
    out = {}
    for key, cubin in cubins.items():
        mix = sass.instruction_mix(cubin.path)
        out[key] = {kernel: dict(info, sass=sass.key_counts(mix.get(kernel, {})))
                    for kernel, info in sass.resources(cubin.ptxas_log).items()}
    return out


def check_cases(stage, cubins, seed: int, trials: int, timeout_s: float, progress, only: str | None = None,
                first_failure: bool = False) -> dict:
    """The correctness cases' results (all of them; with `first_failure`, those up to the first that fails)."""
    problem = reference.load(stage.problem)
    cases = [c for c in problem.cases(seed) if only is None or re.search(only, c.name)]
    if not cases:
        raise GraderError(f"no correctness case matches {only!r}")
    results: dict[int, dict] = {}

    def on_done(event):
        results[event["index"]] = event
        progress("case", len(results), len(cases), cases[event["index"]].name, event["passed"])

    job = _job(stage, cubins, "correctness", trials=trials, first_failure=first_failure)
    failures = run_items(job, "cases", [(i, vars(c)) for i, c in enumerate(cases)], on_done, timeout_s,
                         stop_after_failure=first_failure)
    rows = []
    for i, case in enumerate(cases):
        if i in failures:
            progress("case", len(results) + 1, len(cases), case.name, False)
            rows.append({"name": case.name, "seed": case.seed, "passed": False,
                         "failure": f"{failures[i].kind}: {failures[i].message}"})
        elif i in results and "failure" in results[i]:
            rows.append({"name": case.name, "seed": case.seed, "passed": False, "failure": results[i]["failure"]})
        elif i in results:
            event = results[i]
            rows.append({"name": case.name, "seed": case.seed, "passed": event["passed"],
                         "inputs_unmodified": event["inputs_unmodified"], "checks": event["checks"]})
        elif not first_failure:
            rows.append({"name": case.name, "seed": case.seed, "passed": False, "failure": "not run"})
    passed = sum(r["passed"] for r in rows)
    result = {"passed": passed, "failed": len(rows) - passed, "seed": seed, "trials": trials, "cases": rows}
    if first_failure and len(rows) < len(cases):
        result["not_run"] = len(cases) - len(rows)  # the cases after the first failure
    return result


def previous_stage_job(stage, gpu) -> dict | None:
    """The course's own kernel of the stage before (stages.previous), compiled for this GPU, to time beside
    the kernel: what this stage's idea bought. None for a first stage, or where the previous one can't run."""
    before = stages.previous(stage)
    if before is None:
        return None
    try:
        arch = arch_for(gpu, before.archs)
    except ValueError:
        return None
    return {"stage": before.key, "cubins": _paths(compile_stage(before, before.source_path, arch))}


def forward_stage(problem, gpu):
    """The course's kernel for the forward of `problem` (its `forward`) on this GPU, the one the PyTorch ops
    run (stages.ops_stage); None where the problem has no forward, or none runs here."""
    if problem.forward is None:
        return None
    try:
        return stages.ops_stage(problem.forward, gpu)[0]
    except RuntimeError:
        return None


def forward_stage_job(problem, gpu) -> dict | None:
    """forward_stage compiled for this GPU, for the worker to time before this stage (forward + backward)."""
    stage = forward_stage(problem, gpu)
    if stage is None:
        return None
    return {"stage": stage.key, "cubins": _paths(compile_stage(stage, stage.source_path, arch_for(gpu, stage.archs)))}


def _forward_backward_figures(event: dict, shape: dict, problem) -> dict:
    """The forward stage then this kernel, against each library's forward + backward (event: the worker's)."""
    timings = event["timings"]
    ms = timings["kernel"]["ms"]
    baselines = {n: t["ms"] for n, t in timings.items() if n != "kernel"} | {n: None for n in event["skipped"]}
    flops = reference.load(problem.forward).flops(shape) + problem.flops(shape)
    return {"stage": event["stage"], "ms": ms, "baselines": baselines, "skipped": event["skipped"],
            "tflops": flops / ms / 1e9}


def _previous_stage_figures(timings: dict, previous: dict | None, ms: float) -> dict | None:
    if previous is None or PREVIOUS not in timings:
        return None
    before_ms = timings[PREVIOUS]["ms"]
    return {"stage": previous["stage"], "ms": before_ms, "speedup": before_ms / ms}


def benchmark_shapes(stage, only: str | None = None) -> list[dict]:
    """The shapes a stage is timed at: its problem's and its own extra ones; with `only`, those whose label
    matches that regular expression."""
    problem = reference.load(stage.problem)
    shapes = problem.benchmarks() + list(stage.extra_benchmarks)
    return [s for s in shapes if only is None or re.search(only, problem.shape_label(s))]


def merge_benchmarks(stage, recorded: dict | None, result: dict) -> dict:
    """`result` of a run timed at some shapes (--shapes), with the other shapes of the `recorded` entry
    where that measured the same kernel (results.same_kernel), in the stage's order of shapes, graded over
    all of them."""
    if not recorded or not same_kernel(recorded, result) or not result.get("benchmarks"):
        return result
    new = {b["label"]: b for b in result["benchmarks"]}
    rows = {b["label"]: b for b in recorded.get("benchmarks", [])} | new
    order = [reference.load(stage.problem).shape_label(s) for s in benchmark_shapes(stage)]
    return graded(stage, dict(result, benchmarks=[rows[label] for label in order if label in rows]))


def graded(stage, result: dict) -> dict:
    """`result` with the grade of its benchmarks: F if a shape crashed or hung."""
    timed = [b for b in result["benchmarks"] if "ms" in b]
    result.update(grading.grade(stage.goal, timed) if timed else {"grade": "?"})
    if len(timed) < len(result["benchmarks"]):
        result["grade"] = "F"  # a benchmark shape crashed or hung
    return result


def benchmark(stage, cubins, gpu, timeout_s: float, budget_s: float, progress, only: str | None = None) -> list[dict]:
    problem = reference.load(stage.problem)
    previous = previous_stage_job(stage, gpu)
    forward = forward_stage_job(problem, gpu)
    shapes = benchmark_shapes(stage, only)
    if not shapes:
        raise GraderError(f"no benchmark shape of {stage.key} matches --shapes {only!r}")
    spec = spec_for(gpu.name)
    rows: dict[int, dict] = {}

    def on_done(event):
        shape = shapes[event["index"]]
        timings = event["timings"]
        previous_stage = _previous_stage_figures(timings, previous, timings["kernel"]["ms"])
        timings = {n: t for n, t in timings.items() if n != PREVIOUS}
        baseline_ms = {n: t["ms"] for n, t in timings.items() if n != "kernel"}
        baseline_ms.update({n: None for n in event["skipped"]})
        kernel = timings["kernel"]
        row = {"shape": {k: v for k, v in shape.items() if k != "dtype"}, "label": problem.shape_label(shape),
               "dtype": shape["dtype"], "ms_min": kernel["ms_min"], "spread": kernel["spread"],
               "reps": kernel["reps"], "baselines": baseline_ms, "skipped": event["skipped"],
               "baseline_timings": {n: t for n, t in timings.items() if n != "kernel"},
               "extra_memory_bytes": event["memory"]["kernel"],
               "baseline_extra_memory_bytes": {n: m for n, m in event["memory"].items() if n != "kernel"},
               "output_written": event["output_written"], "launches": event["launches"]}
        row.update(grading.benchmark_figures(shape, kernel["ms"], baseline_ms, problem.flops(shape),
                                             problem.min_bytes(shape), spec))
        if previous_stage:
            row["previous_stage"] = previous_stage
        if "forward_backward" in event:
            row["forward_backward"] = _forward_backward_figures(event["forward_backward"], shape, problem)
        if notes := problem.notes(shape, kernel["ms"], baseline_ms):
            row["notes"] = notes
        if not event["output_written"]:
            row["flags"].append("output not fully written (NaN left) at this shape")
        rows[event["index"]] = row
        progress("bench", len(rows), len(shapes), row["label"], True)

    def on_progress(event):  # a shape starts, or the worker says what it is doing within it
        if "index" in event:
            started["shape"] = event["index"]
        index = started["shape"]
        label = problem.shape_label(shapes[index])
        progress("shape", index + 1, len(shapes), label if "index" in event else f"{label}: {event['text']}", True)

    started = {"shape": 0}
    job = _job(stage, cubins, "benchmark", l2_bytes=gpu.l2_bytes, budget_s=budget_s, previous=previous,
               forward=forward)
    failures = run_items(job, "shapes", list(enumerate(shapes)), on_done, timeout_s, on_progress=on_progress)
    for index, failure in failures.items():
        rows[index] = {"shape": {k: v for k, v in shapes[index].items() if k != "dtype"},
                       "label": problem.shape_label(shapes[index]), "dtype": shapes[index]["dtype"],
                       "failure": f"{failure.kind}: {failure.message}"}
    return [rows[i] for i in sorted(rows)]


def _paths(cubins: dict) -> dict:
    return {key: str(cubin.path) for key, cubin in cubins.items()}


def _job(stage, cubins, phase: str, **extra) -> dict:
    return {"stage": stage.key, "phase": phase, "cubins": _paths(cubins), **extra}


def grade_stage(stage, kernel_path: Path, gpu, arch: str, *, seed=0, trials=2, timeout_s=60.0,
                budget_s=4.0, bench=True, only: str | None = None, shapes: str | None = None,
                first_failure: bool = False, progress=lambda *a: None) -> dict:
    """Everything the report shows; without a GPU, compile only. `only` keeps the cases whose
    name matches that regular expression (and skips the benchmarks); `shapes`, the benchmark shapes
    whose label matches; `first_failure` stops the cases at the first that fails."""
    clock = PhaseClock()
    cubins = compile_stage(stage, kernel_path, arch)
    progress("compiled", len(cubins), len(cubins), arch, True)
    result = _compiled(stage, kernel_path, arch, cubins)
    result["phase_seconds"] = clock.phases  # filled in as the phases end
    clock.done("compile")
    if gpu is None:
        return result
    result["correctness"] = check_cases(stage, cubins, seed, trials, timeout_s, progress, only, first_failure)
    clock.done("correctness")
    if not bench or only or result["correctness"]["failed"]:
        result["benchmarks"] = []
        return result
    result["benchmarks"] = benchmark(stage, cubins, gpu, timeout_s=max(timeout_s, 120.0), budget_s=budget_s,
                                     progress=progress, only=shapes)
    clock.done("benchmarks")
    return graded(stage, result)


class PhaseClock:
    """The wall seconds of each phase of a stage's grading, as they end ({"compile": 3.1, ...})."""

    def __init__(self):
        self.phases, self._last = {}, time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = round(now - self._last, 1)
        self._last = now


def _compiled(stage, kernel_path: Path, arch: str, cubins: dict) -> dict:
    """What a run without a GPU reports: the stage, the file graded, its digest, each kernel's resources."""
    result = {"title": stage.title, "problem": stage.problem, **({"rung": stage.rung} if stage.rung else {}),
              "kernel_path": shown(kernel_path),
              "source_sha256": source_digest(stage, kernel_path), "arch": arch, "resources": resources(cubins)}
    if dynamic := dynamic_shared_bytes(stage, cubins):
        result["dynamic_shared_bytes"] = dynamic
    return result


def dynamic_shared_bytes(stage, cubins: dict) -> dict:
    """{variant: the dynamic shared memory per block its launch asks for}, for the variants whose geometry
    says (SHARED_BYTES): the cubin's resources hold only the static part."""
    sizes = {key: stage.geometry(dict(cubin.defines)).get("SHARED_BYTES") for key, cubin in cubins.items()}
    return {key: size for key, size in sizes.items() if size is not None}


def profile_stage(stage, kernel_path: Path, gpu, arch: str, shape: str | None, csv_path: Path,
                  timeout_s: float = 300.0, progress=lambda *a: None, beside: str | None = None) -> dict:
    """Compile, then profile the kernel beside the reference under Nsight Compute on one benchmark shape
    (grader/profile.py; `shape` as --profile takes it; `beside`: a baseline's name, else the fastest
    library baseline); no correctness cases, no timings. The result holds
    the profile under "profile"; profile.ProfileError says why there is none."""
    from grader import profile

    cubins = compile_stage(stage, kernel_path, arch)
    progress("compiled", len(cubins), len(cubins), arch, True)
    result = _compiled(stage, kernel_path, arch, cubins)
    progress("profile", 0, 1, "under Nsight Compute", True)
    result["profile"] = profile.run(stage, cubins, gpu, shape, csv_path, timeout_s=timeout_s, beside=beside)
    result["profile"]["source_sha256"] = result["source_sha256"]  # which kernel it profiled
    return result
