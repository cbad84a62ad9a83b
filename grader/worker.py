"""The child process that runs a kernel: `python -m grader.worker JOB.json` runs one job,
`python -m grader.worker --serve` runs the jobs whose files are named on its stdin, one after another.

It prints one JSON object per line (an "event") as it goes, so that the grader, reading them with
a time limit, knows which case was running if this process crashes or hangs. A CUDA error
is reported as an event, then the process exits: after an illegal address the CUDA context is
unusable, and the grader starts a new worker for the remaining cases. A serving worker also exits after
a job in which a case failed: a wrong kernel may have written outside its outputs.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

from grader.protocol import JOB_END, NOTE, PREVIOUS, RANGES, emit

# The MoE benchmarks allocate and free buffers of several GB next to 9-23 GB of weights: with fixed
# segments the cache fragments until an allocation fails with half the memory free.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def is_cuda_error(error: Exception) -> bool:
    """A fault of the kernel that leaves the CUDA context unusable (as opposed to a Python error)."""
    text = f"{type(error).__name__} {error}"
    return "CUDA" in text or "cuda" in text



def same_bits(before, after) -> bool:
    """Whether `after` holds exactly the bits of `before`: an input a kernel must not write may hold NaN on
    purpose (the MoE backward's h1 in its padding rows), and torch.equal calls NaN unequal to itself."""
    import torch

    if before.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[before.element_size()]
        return torch.equal(before.view(bits), after.view(bits))
    return torch.equal(before, after)

class Worker:
    def __init__(self, job: dict):
        import reference
        import stages

        warm_up()  # at once where a serving worker already did it
        self.job = job
        self.clean = True  # no case failed: this process can serve another job
        self.stage = stages.load(job["stage"])
        self.problem = reference.load(self.stage.problem)
        self._kernel_sets = {}
        previous = job.get("previous")
        self.previous = (stages.load(previous["stage"]), previous["cubins"]) if previous else None
        forward = job.get("forward")  # the course's kernel for the problem's forward (problem.forward)
        self.forward = (stages.load(forward["stage"]), forward["cubins"]) if forward else None

    def kernels_for(self, inputs: dict, stage=None, cubins: dict | None = None, problem=None):
        """The KernelSet these inputs need: of this stage, or of `stage` (solving `problem`, if not this
        stage's) compiled as `cubins`."""
        from stages.common.launcher import KernelSet
        from stages import variant_key

        stage, cubins, problem = stage or self.stage, cubins or self.job["cubins"], problem or self.problem
        key = variant_key(stage.defines(problem.variant(inputs)))
        if (stage.key, key) not in self._kernel_sets:
            if key not in cubins:
                raise ValueError(f"{stage.key} was not compiled for {key}")
            self._kernel_sets[stage.key, key] = KernelSet(cubins[key], stage.kernels, stage.param_structs)
        return self._kernel_sets[stage.key, key]

    def run_kernel(self, inputs: dict, outputs: dict):
        import torch

        kernels = self.kernels_for(inputs)
        self.problem.run_stage(self.stage, kernels, inputs, outputs)
        torch.cuda.synchronize()  # a fault in the kernel surfaces here
        return kernels

    # ---- correctness --------------------------------------------------------------------------
    def correctness(self) -> None:
        for index, case in self.job["cases"]:
            emit("case_start", index=index)
            passed = self.check_case(index, case)
            self.clean &= passed
            if not passed and self.job.get("first_failure"):
                return

    def check_case(self, index: int, case: dict) -> bool:
        """The case's trials, each on fresh inputs, then its "case_done" (the worst trial's checks); whether
        it passed."""
        worst, unmodified = None, True
        for trial in range(self.job["trials"]):
            try:
                checks, unmodified = self.check_once(case, case["seed"] * 100 + trial)
            except Exception as error:  # noqa: BLE001
                if is_cuda_error(error):
                    raise  # the CUDA context is gone: this worker cannot go on
                emit("case_done", index=index, passed=False, failure=f"{type(error).__name__}: {error}")
                return False
            if worst is None or not all(c["passed"] for c in checks):
                worst = checks
            if not unmodified:
                break  # the kernel wrote into its inputs: the case fails whatever its outputs
        passed = unmodified and all(c["passed"] for c in worst)
        emit("case_done", index=index, checks=worst, inputs_unmodified=unmodified, passed=passed)
        return passed

    def check_once(self, case: dict, seed: int):
        import torch
        from reference import tolerance

        inputs = self.problem.make_inputs(case["shape"], case["dtype"], seed, case["input_scale"])
        saved = {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        outputs = self.problem.allocate_outputs(inputs)  # poisoned with NaN
        self.run_kernel(inputs, outputs)
        exact = self.problem.reference(inputs)
        with tolerance.library_dispatch():
            library = self.problem.library_output(inputs)
        checks = [c.as_dict() for c in self.problem.check(outputs, exact, library)]
        unmodified = all(same_bits(saved[k], inputs[k]) for k in saved)
        return checks, unmodified

    # ---- benchmarks ---------------------------------------------------------------------------
    def benchmark(self) -> None:
        import torch

        for index, shape in self.job["shapes"]:
            emit("bench_start", index=index)
            emit("bench_done", index=index, **self.benchmark_shape(shape, seed=index))
            torch.cuda.empty_cache()  # this shape's tensors died with benchmark_shape's frame

    def benchmark_shape(self, shape: dict, seed: int) -> dict:
        import torch

        from grader.timing import extra_memory, time_side_by_side

        inputs = self.problem.make_inputs(shape, shape["dtype"], seed=seed)
        outputs = self.problem.allocate_outputs(inputs)
        kernels = self.run_kernel(inputs, outputs)
        written = all(bool(torch.isfinite(t).all()) for t in outputs.values())

        def ours():
            self.problem.run_stage(self.stage, kernels, inputs, outputs)

        others = dict(self.problem.baselines(inputs))
        if self.previous:
            others[PREVIOUS] = self.previous_stage_run(inputs)
        candidates, skipped = self.first_runs(others)
        candidates = {"kernel": ours, **candidates}
        memory = {name: extra_memory(run) for name, run in candidates.items() if name != PREVIOUS}
        emit(NOTE, text=f"timing {len(candidates)} side by side")
        timings = time_side_by_side(candidates, self.job["l2_bytes"], budget_s=self.job["budget_s"])
        occupancy = {name: kernels.occupancy(name) | vars(kernels.launches[name]) for name in kernels.launches}
        result = dict(timings={n: t.as_dict() for n, t in timings.items()}, memory=memory, skipped=skipped,
                      output_written=written, launches=occupancy)
        if self.forward:
            del others, candidates  # a backward baseline keeps its forward's graph: not beside the next ones
            result["forward_backward"] = self.forward_backward(inputs, outputs, kernels)
        return result

    def first_runs(self, runs: dict) -> tuple[dict, dict]:
        """The callables of `runs` whose first call succeeds, and {name: why} for those out of memory."""
        import torch

        ran, skipped = {}, {}
        for name, run in runs.items():
            emit(NOTE, text=f"first call of {name} (a compiled baseline compiles here)")
            try:
                run()
                torch.cuda.synchronize()
                ran[name] = run
            except torch.cuda.OutOfMemoryError:
                skipped[name] = "out of memory"
            torch.cuda.empty_cache()
        return ran, skipped

    def forward_backward(self, inputs: dict, outputs: dict, kernels) -> dict:
        """The forward stage's kernel, then this one on what the forward gives it (forward_for_backward: its
        outputs, and its saved activations where it keeps some), timed beside the library's forward + backward
        (problem.forward_backward_baselines): {"stage": the forward's key, "timings", "skipped"}."""
        import reference
        from grader.timing import time_side_by_side

        stage, cubins = self.forward
        forward_problem = reference.load(self.problem.forward)
        forward_kernels = self.kernels_for(inputs, stage, cubins, forward_problem)
        forward_outputs = forward_problem.allocate_outputs(inputs)

        def ours():  # what the forward gives the backward in place of the inputs' exact ones
            given = forward_problem.forward_for_backward(stage, forward_kernels, inputs, forward_outputs)
            self.problem.run_stage(self.stage, kernels, {**inputs, **given}, outputs)

        candidates, skipped = self.first_runs(self.problem.forward_backward_baselines(inputs))
        timings = time_side_by_side({"kernel": ours, **candidates}, self.job["l2_bytes"], budget_s=self.job["budget_s"])
        return {"stage": stage.key, "timings": {n: t.as_dict() for n, t in timings.items()}, "skipped": skipped}

    # ---- profile (run under ncu: grader/profile.py) -------------------------------------------
    def profile(self) -> None:
        """One benchmark shape: the kernel and the fastest library baseline (or the job's "beside"), each
        warmed up, then run once inside its NVTX range (protocol.RANGES), the only launches ncu profiles."""
        import torch

        from grader.grading import reference_of
        from grader.timing import time_side_by_side

        index, shape = self.job["shape"]
        emit("profile_start", index=index)
        inputs = self.problem.make_inputs(shape, shape["dtype"], seed=index)
        outputs = self.problem.allocate_outputs(inputs)
        kernels = self.run_kernel(inputs, outputs)  # loads the module: not in the profile

        def ours():
            self.problem.run_stage(self.stage, kernels, inputs, outputs)

        libraries = {n: run for n, run in self.problem.baselines(inputs).items() if n != "naive"}
        candidates, skipped = self.first_runs(libraries)
        timings = time_side_by_side(candidates, self.job["l2_bytes"], budget_s=0.5) if candidates else {}
        baselines_ms = {n: t.median_ms for n, t in timings.items()}
        beside = self.job.get("beside")
        if beside is not None and beside not in candidates:
            raise ValueError(f"--beside {beside}: no such baseline runs on this shape "
                             f"(there are: {', '.join(candidates) or 'none'})")
        chosen = (beside, baselines_ms[beside]) if beside else reference_of(baselines_ms)
        sides = {"kernel": ours}
        if chosen:
            sides["reference"] = candidates[chosen[0]]
        for run in sides.values():  # warm-up: library heuristics, allocator
            run()
        torch.cuda.synchronize()
        for side, run in sides.items():
            # Both kinds of NVTX range: a push/pop range is this thread's, a start/end range the process's,
            # which also holds what autograd's device thread launches (a backward baseline).
            started = torch.cuda.nvtx.range_start(RANGES[side])
            torch.cuda.nvtx.range_push(RANGES[side])
            run()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            torch.cuda.nvtx.range_end(started)
        emit("profile_done", index=index, baselines_ms=baselines_ms, skipped=skipped,
             reference={"name": chosen[0], "ms": chosen[1]} if chosen else None)

    def previous_stage_run(self, inputs: dict):
        """A callable that runs the previous stage's kernel on these inputs (its own outputs)."""
        stage, cubins = self.previous
        kernels = self.kernels_for(inputs, stage, cubins)
        outputs = self.problem.allocate_outputs(inputs)
        return lambda: self.problem.run_stage(stage, kernels, inputs, outputs)


def warm_up() -> None:
    """What every job needs first: PyTorch, the course's modules, and the CUDA context, made current as
    the primary context (the one PyTorch uses)."""
    import torch
    from cuda.core import Device

    import reference  # noqa: F401
    import stages  # noqa: F401

    torch.cuda.init()
    Device().set_current()


def main(path: str) -> bool | None:
    """Run the job in the file at `path`: None after an error (reported as an event), else whether the
    process is fit for another job."""
    job = json.loads(open(path).read())
    try:
        worker = Worker(job)
        emit("ready")
        getattr(worker, job["phase"])()
    except Exception as error:  # noqa: BLE001  (every failure goes back to the grader as an event)
        emit("error", kind=type(error).__name__, message=str(error).strip(), traceback=traceback.format_exc())
        return None
    return worker.clean


def serve() -> int:
    """Run the jobs named on stdin, one per line, each ended by a JOB_END event; between two jobs, give
    back what the last one held (its tensors, torch.compile's code for its baselines). The seconds of
    start-up (PyTorch, the CUDA context) are spent before the first job is read: a spare worker spends
    them while the grader is still busy with the job before."""
    import gc

    try:
        warm_up()
    except Exception:  # noqa: BLE001  (no GPU here: the first job meets the same error and reports it)
        pass
    for line in sys.stdin:
        clean = main(line.strip())
        if clean is None:
            return 3
        gc.collect()
        if "torch._dynamo" in sys.modules:  # compiled baselines: the next job compiles its own
            sys.modules["torch._dynamo"].reset()
        sys.modules["torch"].cuda.empty_cache()
        emit(JOB_END, clean=clean)
        if not clean:
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1] == "--serve" else 0 if main(sys.argv[1]) is not None else 3)
