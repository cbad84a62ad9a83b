"""The problems the course's kernels solve: what is computed, on which inputs, and how it is judged.

A problem module defines `PROBLEM`, an object with (see `attention.py`, the model):
  dtypes            {"float16": "__half", ...}: torch dtype names -> the ELEM_T macro a kernel is compiled with
  cases(seed)       the correctness cases (each with its own public seed)
  benchmarks()      the shapes the grader times
  make_inputs(...)  random inputs for a case; `allocate_outputs` the outputs, poisoned with NaN
  variant(inputs)   the -D macros of the compiled kernel these inputs need
  run_stage(...)    calls a stage's launch function with the problem's tensors
  reference(...)    the exact result (float64); `check(...)` applies the tolerance rule
  baselines(...)    library implementations to time beside the kernel (name -> callable)
  flops, min_bytes  the work and the fewest bytes a kernel must move, for TFLOP/s and roofline
"""
import importlib


def load(name: str):
    return importlib.import_module(f"reference.{name}").PROBLEM
