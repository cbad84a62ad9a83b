#!/usr/bin/env bash
# The GPU half of the tests, and the results: run on a machine with an NVIDIA GPU, from the repo root.
#   bash tests/gpu_run.sh [OUTDIR] [STAGES...]    (default: all stages; results/<gpu>.json in OUTDIR)
set -uo pipefail
out=${1:-results}; shift || true
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
$python -c "import torch, cuda.core, cuda.bindings; print('torch', torch.__version__, 'cuda-core', cuda.core.__version__, 'bindings', cuda.bindings.__version__)"
slug=$($python -c "from grader import device, gpus; g, _ = device.probe(); print(gpus.slug_for(g.name))")
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(all)
for s in "${stages[@]}"; do
    $python -m grader "$s" --json "$out/$slug.json" 2>&1 | tee -a "$out/grader.log"
done
$python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
