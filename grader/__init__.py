"""The FlashMoE Course grader: compile a stage's kernel, check it, time it, grade it.

`python -m grader --help` lists the commands. The pieces, in the order a run uses them:

- `stages.py`   finds the stages and the learner's copy of a kernel;
- `compiler.py` compiles a `.cu` file with NVRTC (cached), `sass.py` reads the cubin back;
- `device.py`   asks the driver which GPU is here, `gpus.py` knows its peak rates;
- `isolation.py` runs the GPU work in a child process (`worker.py`) with a time limit;
- `checking.py` applies the tolerance rule, `timing.py` times launches, `grading.py` turns
  times into a grade, `report.py` prints the table and writes the JSON.
"""
