"""What a problem is: the interface every problem of reference/ implements and the grader relies on.

A problem says what to compute and how to judge it, never how a kernel computes it (that is a
stage's business, stages/): its cases and benchmark shapes, random inputs for them, outputs poisoned
before a kernel runs, the exact result in float64, the pass rule, library baselines to time beside a
kernel, and the work (FLOPs, fewest bytes) that turns a time into TFLOP/s and % of bandwidth.

A kernel may be compiled for some of a problem's parameters (a head dimension): `parameters` names
them with the values the cases take, and `variant(inputs)` says which the inputs need. Which -D
macro of a stage takes which parameter is the stage's own affair (stages.Stage.specializations).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

from reference import tolerance

DTYPES = ("float16", "bfloat16")  # the element types every problem's cases come in
INT_POISON = -(2**31) + 7          # what integer outputs hold before a kernel runs (-1 is a valid value)
FLOAT_POISON = float("nan")        # what floating-point outputs hold before a kernel runs


@dataclass(frozen=True)
class Case:
    """One correctness case: a shape, a dtype, an input scale (10 for large scores) and its own public seed."""
    name: str
    shape: dict
    dtype: str
    input_scale: float
    seed: int


class Problem(abc.ABC):
    name: str                       # the module's name in reference/, as stages name it
    outputs: tuple[str, ...]        # what a kernel writes, as allocate_outputs names them
    primary_input: str              # the input whose dtype is the problem's dtype
    dtypes: tuple[str, ...] = DTYPES
    parameters: dict[str, tuple] = {}  # parameters a kernel may be compiled for -> the values the cases take
    # The problem whose results are inputs of this one (a backward's forward; forward_for_backward says which,
    # under this one's names): the grader then also times the course's kernel for it followed by this one
    # (forward_backward_baselines).
    forward: str | None = None

    # ---- cases and shapes
    @abc.abstractmethod
    def cases(self, seed: int = 0) -> list[Case]: ...

    @abc.abstractmethod
    def benchmarks(self) -> list[dict]:
        """The shapes the grader times, each with its "dtype"."""

    @abc.abstractmethod
    def shape_label(self, shape: dict) -> str: ...

    # ---- inputs and outputs
    @abc.abstractmethod
    def make_inputs(self, shape: dict, dtype: str, seed: int, input_scale: float = 1.0, device="cuda") -> dict: ...

    @abc.abstractmethod
    def allocate_outputs(self, inputs: dict) -> dict:
        """The outputs, poisoned (FLOAT_POISON, INT_POISON), so that one a kernel does not write shows."""

    def variant(self, inputs: dict) -> dict:
        """What a kernel compiled for these inputs must be compiled for: their dtype and `parameters`' values."""
        dtype = str(inputs[self.primary_input].dtype).removeprefix("torch.")
        return {"dtype": dtype, **self.parameter_values(inputs)}

    def parameter_values(self, inputs: dict) -> dict:
        return {}

    @abc.abstractmethod
    def run_stage(self, stage, kernels, inputs: dict, outputs: dict) -> None:
        """Calls the stage's launch function with the problem's tensors."""

    def forward_for_backward(self, stage, kernels, inputs: dict, outputs: dict) -> dict:
        """Runs the stage for this (forward) problem and returns what a backward takes from it under the
        backward's input names: by default its outputs, named as the backward's inputs. A forward that also
        keeps what its kernels computed on the way (a backward's saved activations) returns those too."""
        self.run_stage(stage, kernels, inputs, outputs)
        return outputs

    # ---- the exact result and the check
    @abc.abstractmethod
    def reference(self, inputs: dict) -> dict:
        """The exact result, in float64."""

    @abc.abstractmethod
    def library_output(self, inputs: dict) -> dict:
        """PyTorch's own result in the inputs' dtype: the yardstick of the tolerance rule."""

    @abc.abstractmethod
    def check(self, outputs: dict, exact: dict, library: dict) -> list[tolerance.OutputCheck]: ...

    # ---- timings
    @abc.abstractmethod
    def baselines(self, inputs: dict) -> dict:
        """Library implementations (and "naive", plain PyTorch) to time beside a kernel: name -> callable."""

    def forward_backward_baselines(self, inputs: dict) -> dict:
        """Where `forward` is set: library implementations that run the forward and this problem on these
        inputs, to time beside the course's forward kernel followed by this one; name -> callable."""
        return {}

    def notes(self, shape: dict, ms: float, baseline_ms: dict) -> list[str]:
        """A problem's own remarks on one shape's timings (e.g. a share of the whole MoE layer)."""
        return []

    @abc.abstractmethod
    def flops(self, shape: dict) -> float: ...

    @abc.abstractmethod
    def min_bytes(self, shape: dict) -> float:
        """The fewest bytes a kernel must move: each input read once, each output written once."""
