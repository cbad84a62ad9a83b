"""One stage's kernels run in the test process on one case at a time, for a stage's own GPU tests
(tests/test_block_sparse_stage.py and its kind): the grader's compile, the worker's way of loading, the
problem's check."""
from __future__ import annotations

import pytest
import torch

import reference
import stages
from conftest import gpu


class StageOnGpu:
    def __init__(self, name: str):
        self.stage = stages.load(name)
        self.problem = reference.load(self.stage.problem)
        self._loaded: dict = {}  # kernel path -> (its cubins, {variant key: KernelSet})

    def arch(self) -> str:
        """The arch the stage compiles for on this GPU; the test is skipped where it runs on none."""
        found, _ = gpu()
        try:
            return stages.arch_for(found, self.stage.archs)
        except ValueError as why:
            pytest.skip(str(why))

    def kernels(self, path, inputs: dict):
        """The KernelSet of the stage's kernels at `path` for these inputs (compiled once per path)."""
        from cuda.core import Device

        from grader.run import compile_stage
        from stages import variant_key
        from stages.common.launcher import KernelSet

        if path not in self._loaded:
            arch = self.arch()
            torch.cuda.init()
            Device().set_current()  # PyTorch's primary context, as the grader's worker loads kernels
            self._loaded[path] = (compile_stage(self.stage, path, arch), {})
        cubins, sets = self._loaded[path]
        key = variant_key(self.stage.defines(self.problem.variant(inputs)))
        if key not in sets:
            sets[key] = KernelSet(cubins[key].path, self.stage.kernels, self.stage.param_structs)
        return sets[key]

    def check(self, case, path=None, edit=lambda inputs: inputs) -> list:
        """The problem's check of the kernels at `path` (the stage's own by default) on `case`, the kernels
        given the inputs `edit` makes of the case's, the check made against the case's own."""
        self.arch()
        inputs = self.problem.make_inputs(case.shape, case.dtype, case.seed, case.input_scale)
        outputs = self.problem.allocate_outputs(inputs)  # poisoned with NaN
        self.problem.run_stage(self.stage, self.kernels(path or self.stage.source_path, inputs), edit(dict(inputs)),
                               outputs)
        torch.cuda.synchronize()
        return self.problem.check(outputs, self.problem.reference(inputs), self.problem.library_output(inputs))
