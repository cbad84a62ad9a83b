"""The FlashMoE Course grader: compile a stage's kernel, check it, time it, grade it.

`python -m grader --help` lists the commands. The pieces, in the order a run uses them:

- `exercise.py` writes and finds the learner's copy of a kernel;
- `run.py`      compiles it (NVRTC, cached: stages/common/compiler.py) with checks of its signatures and
  geometry, then drives the rest; `sass.py` reads the cubin back;
- `device.py`   asks the driver which GPU is here (stages.arch_for: what to compile for), `gpus.py` knows
  its peak rates;
- `isolation.py` runs the GPU work in a child process (`worker.py`, which launches the kernels with
  stages/common/launcher.py) with a time limit;
- the problem (reference/) applies the tolerance rule, `timing.py` times launches, `grading.py` turns
  times into a grade, `report.py` prints the table and `results.py` writes the JSON.
"""
