"""Stage 6's ladder, compiled, checked and timed: the experts' grouped GEMM on CUDA cores (rung 1,
ladder/simt.cu), on tensor cores with mma.sync (rung 2, ladder/mma_sync.cu) and with wgmma + TMA
(rung 3, the stage's own experts.cu), beside the problem's baselines.

    python -m stages.stage6_grouped_gemm.ladder.run [--tokens 4096] [--budget 4] [--compile-only]

Compiles the two lower rungs for this GPU (with --compile-only: for sm_80 and sm_90a, no GPU needed)
and prints their registers, spills and key SASS instructions. Then, on the GPU, checks every rung by
the problem's own rule, as the grader's worker does (reference/moe_experts.py: valid rows poisoned
with NaN, the float64 FFN as the truth, PyTorch's error in the dtype as the yardstick), on three small
cases and on the seed configuration at --tokens tokens (bf16, as the benchmarks), and times the rungs
that pass and the problem's baselines there, side by side with a cold L2 (grader.timing). A rung that
fails is reported and left out of the timings. The two lower rungs are not graded stages: this is
the measurement behind the ladder of docs/stages/stage6.md. The SIMT rung is slow: at the default
4096 tokens (8192 token-slots, 2.2 TFLOP) the whole run takes about a minute on an H100.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import stages
from stages import variant_key
from grader.compiler import compile_cubin, nvrtc_version
from grader.run import compile_stage, relative, resources, signature_checks
from grader.worker import is_cuda_error
from reference import moe
from reference.moe_experts import PROBLEM

HERE = Path(__file__).resolve().parent
STAGE = stages.load("stage6")
SIGNATURE = "const elem_t*, const elem_t*, elem_t*, const int*, int, int, int"
KERNELS = {"expert_up_swiglu": SIGNATURE, "expert_down": SIGNATURE}
THREADS = 256                       # grouped.cuh's NUM_THREADS
OFFSETS_BYTES = 4 * (256 + 1)       # grouped.cuh: MAX_EXPERTS + 1 offsets
SMALL_CASES = ("T333 E16 k4 hidden200 inter136 fp16", "T4097 E32 k4 hidden72 inter104 skew3 bf16",
               "T500 E16 k4 hidden72 inter104 empty3,7 bf16")


@dataclass(frozen=True)
class Rung:
    name: str
    source: Path
    shared_bytes: dict   # kernel -> dynamic shared memory: the .cu's SHARED_BYTES<SWIGLU>
    blocks_per_sm: dict  # kernel -> blocks per SM in the persistent grid: its __launch_bounds__ minimum


# These must match the constants of the .cu files (up: SWIGLU, 256 B columns; down: 128).
RUNGS = (
    Rung("simt", HERE / "simt.cu",  # 2 slice buffers of fp32: 16 k × (128 rows of A + the B columns)
         {"expert_up_swiglu": 2 * 4 * 16 * (128 + 256) + OFFSETS_BYTES,
          "expert_down": 2 * 4 * 16 * (128 + 128) + OFFSETS_BYTES},
         {"expert_up_swiglu": 1, "expert_down": 2}),
    Rung("mma_sync", HERE / "mma_sync.cu",  # 2 stages of 16 bits: 128 rows × 64 k of A, 64 k × the B columns
         {"expert_up_swiglu": 2 * 2 * (128 * 64 + 64 * 256) + OFFSETS_BYTES,
          "expert_down": 2 * 2 * (128 * 64 + 64 * 128) + OFFSETS_BYTES},
         {"expert_up_swiglu": 1, "expert_down": 2}),
)
WGMMA = "wgmma"  # rung 3: the stage's kernels, launched by the stage's own launch()


def compile_rung(rung: Rung, arch: str) -> dict:
    """{variant key: Cubin} for fp16 and bf16, with the grader's check of the kernels' signatures."""
    checks = signature_checks(KERNELS)
    return {variant_key(d): compile_cubin(rung.source, arch, d, checks) for d in map(STAGE.defines, STAGE.variants(PROBLEM))}


def print_resources(label: str, arch: str, cubins: dict) -> None:
    for variant, kernels in resources(cubins).items():
        dtype = "bf16" if "bfloat16" in variant else "fp16"
        for kernel, info in sorted(kernels.items(), reverse=True):
            mix = " ".join(f"{op} {n}" for op, n in info["sass"].items())
            print(f"  {label:9} {arch:7} {dtype} {kernel:17} registers {info['registers']:3}  "
                  f"spills {info['spill_stores']}/{info['spill_loads']} bytes  {mix}")


def compile_all(archs: tuple[str, ...], wgmma: bool) -> dict:
    """{(name, arch): cubins} of the rungs (and of experts.cu for sm_90a), resources printed."""
    print("Compiled (registers, spill stores/loads, SASS instructions per kernel):")
    compiled = {}
    for arch in archs:
        for rung in RUNGS:
            compiled[rung.name, arch] = cubins = compile_rung(rung, arch)
            print_resources(rung.name, arch, cubins)
    if wgmma:
        compiled[WGMMA, "sm_90a"] = cubins = compile_stage(STAGE, STAGE.source_path, "sm_90a")
        print_resources(WGMMA, "sm_90a", cubins)
    return compiled


# ---------------------------------------------------------------- on the GPU

def rung_binder(rung: Rung, kernel_sets: dict):
    """bind(inputs, outputs) -> run(): the rung's two launches on a persistent grid, h allocated here."""
    import torch
    from stages.common.hopper import sm_count

    def bind(inputs: dict, outputs: dict):
        x, offsets, w1, w2 = (inputs[n] for n in ("x_perm", "expert_offsets", "w1", "w2"))
        experts, hidden, inter = w1.shape[0], w1.shape[1], w2.shape[1]
        h = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
        kernels = kernel_sets[variant_key(STAGE.defines(PROBLEM.variant(inputs)))]
        sms = sm_count(x.device)

        def launch(name, *args):
            getattr(kernels, name)((rung.blocks_per_sm[name] * sms,), (THREADS,), *args, smem=rung.shared_bytes[name])

        def run():
            launch("expert_up_swiglu", x, w1, h, offsets, experts, inter, hidden)
            launch("expert_down", h, w2, outputs["y_perm"], offsets, experts, hidden, inter)
        return run
    return bind


def stage_binder(kernel_sets: dict):
    """bind(inputs, outputs) -> run(): the stage's launch, exactly as the grader's worker calls it."""
    def bind(inputs: dict, outputs: dict):
        kernels = kernel_sets[variant_key(STAGE.defines(PROBLEM.variant(inputs)))]
        return lambda: PROBLEM.run_stage(STAGE, kernels, inputs, outputs)
    return bind


def check(bind, inputs: dict, exact: dict, library: dict) -> tuple[bool, str]:
    """Run once into NaN-poisoned outputs and judge y_perm's valid rows by the problem's rule."""
    import torch

    outputs = PROBLEM.allocate_outputs(inputs)
    try:
        bind(inputs, outputs)()
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001  (reported; a CUDA fault is re-raised: the context is lost)
        if is_cuda_error(error):
            raise
        return False, f"{type(error).__name__}: {error}"
    result = PROBLEM.check(outputs, exact, library)[0]
    return result.passed, (f"max |error| {result.kernel.max_abs:.3g}, tolerance {result.tolerance:.3g} "
                           f"(PyTorch's own error {result.library.max_abs:.3g})")


def check_all(binders: dict, inputs: dict, label: str) -> set:
    """The names of the binders whose output passes on these inputs; one line each."""
    exact, library = PROBLEM.reference(inputs), PROBLEM.library_output(inputs)
    passed = set()
    for name, bind in binders.items():
        try:
            ok, detail = check(bind, inputs, exact, library)
        except Exception:
            print(f"  {label:48} {name:9} CUDA FAULT: the CUDA context is lost, nothing more can run here")
            raise
        print(f"  {label:48} {name:9} {'pass' if ok else 'FAIL'}  {detail}")
        if ok:
            passed.add(name)
    return passed


def versions(gpu) -> str:
    import torch

    def version(package):
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "?"
    return (f"GPU: {gpu.name} ({gpu.arch}, {gpu.sms} SMs, L2 {gpu.l2_bytes >> 20} MB), driver CUDA {gpu.driver}; "
            f"torch {torch.__version__} (CUDA {torch.version.cuda}), NVRTC {nvrtc_version()}, "
            f"cuda-core {version('cuda-core')}, cuda-bindings {version('cuda-bindings')}")


def on_gpu(args) -> None:
    import torch
    from cuda.core import Device

    from grader.device import arch_for, probe
    from grader.launcher import KernelSet
    from grader.timing import time_side_by_side

    gpu, why = probe()
    if gpu is None:
        sys.exit(f"no GPU here ({why}): python -m stages.stage6_grouped_gemm.ladder.run --compile-only")
    torch.cuda.init()
    Device().set_current()  # the primary context, the one PyTorch uses (as grader/worker.py)
    print(versions(gpu))
    arch = arch_for(gpu, stages.ALL_ARCHS)
    try:
        arch_for(gpu, STAGE.archs)
        wgmma = True
    except ValueError as error:
        print(f"rung 3 (experts.cu) left out: {error}")
        wgmma = False
    compiled = compile_all((arch,), wgmma)

    binders, kernel_sets = {}, {}
    for rung in RUNGS:
        kernel_sets[rung.name] = {key: KernelSet(c.path, list(KERNELS)) for key, c in compiled[rung.name, arch].items()}
        binders[rung.name] = rung_binder(rung, kernel_sets[rung.name])
    if wgmma:
        kernel_sets[WGMMA] = {key: KernelSet(c.path, list(STAGE.kernels)) for key, c in compiled[WGMMA, "sm_90a"].items()}
        binders[WGMMA] = stage_binder(kernel_sets[WGMMA])

    print("\nCorrectness (reference/moe_experts.py's check of y_perm's valid rows):")
    cases = {c.name: c for c in PROBLEM.cases()}
    passing = set(binders)
    for name in SMALL_CASES:
        case = cases[name]
        inputs = PROBLEM.make_inputs(case.shape, case.dtype, case.seed * 100, case.input_scale)
        passing &= check_all(binders, inputs, name)
    config = moe.CONFIGS["seed"]
    shape = dict(tokens=args.tokens, experts=config["experts"], top_k=config["top_k"], hidden=config["hidden"],
                 inter=config["inter"])
    inputs = PROBLEM.make_inputs(shape, "bfloat16", seed=0)
    label = f"{PROBLEM.shape_label(shape)} bf16"
    passing &= check_all(binders, inputs, label)

    for rung in RUNGS:  # the persistent grids, and how many of their blocks an SM holds at once
        kernels = kernel_sets[rung.name][variant_key(STAGE.defines(PROBLEM.variant(inputs)))]
        print(f"  {rung.name}: " + ", ".join(
            f"{kernel} {kernels.launches[kernel].grid[0]} blocks, {kernels.occupancy(kernel)['blocks_per_sm']} per SM"
            for kernel in KERNELS if kernel in kernels.launches))

    rungs = [n for n in binders if n in passing]
    print(f"\nTimes at the seed configuration, {label}, {PROBLEM.flops(shape) / 1e12:.2f} TFLOP, "
          f"L2 flushed before each launch ({args.budget:g} s budget):")
    candidates = {n: binders[n](inputs, PROBLEM.allocate_outputs(inputs)) for n in rungs}
    for name, run in PROBLEM.baselines(inputs).items():
        try:
            run()
            torch.cuda.synchronize()
            candidates[name] = run
        except torch.cuda.OutOfMemoryError:
            print(f"  baseline {name}: out of memory, left out")
        torch.cuda.empty_cache()
    timings = time_side_by_side(candidates, gpu.l2_bytes, budget_s=args.budget)

    flops = PROBLEM.flops(shape)
    print(f"  {'':26} {'ms (median)':>11} {'TFLOP/s':>8} {'× rung below':>13} {'spread':>7} {'reps':>5}")
    below = None
    for name, timing in timings.items():
        title = {"simt": "1 CUDA cores (simt.cu)", "mma_sync": "2 mma.sync (mma_sync.cu)",
                 WGMMA: "3 wgmma + TMA (experts.cu)"}.get(name, f"baseline: {name}")
        faster = ""
        if name in rungs:
            faster = f"{below / timing.median_ms:.1f}×" if below else ""
            below = timing.median_ms
        print(f"  {title:26} {timing.median_ms:11.3f} {flops / timing.median_ms / 1e9:8.1f} {faster:>13} "
              f"{timing.spread:7.1%} {timing.reps:5d}")
    for name in binders:
        if name not in passing:
            print(f"  {name}: failed a check above, not timed")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the seed configuration (top-2: twice as many rows)")
    parser.add_argument("--budget", type=float, default=4.0, help="seconds of side-by-side timing")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_80 and sm_90a and stop (no GPU needed)")
    args = parser.parse_args(argv)
    print(f"Stage 6's ladder: {', '.join(relative(r.source) for r in RUNGS)}, {relative(STAGE.source_path)}")
    if args.compile_only:
        compile_all(("sm_80", "sm_90a"), wgmma=True)
    else:
        on_gpu(args)


if __name__ == "__main__":
    main()
