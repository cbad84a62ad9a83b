"""A stand-in for Nsight Compute's ncu, for test_profile.py on the CPU: it answers --version, and for a
profiling command line writes to --log-file what FAKE_NCU says (a recorded raw CSV, or ncu's
ERR_NVGPUCTRPERM error), then plays the worker's "profile" phase events on stdout."""
import json
import os
import shutil
import sys

args = sys.argv[1:]
if args == ["--version"]:
    print("NVIDIA (R) Nsight Compute Command Line Profiler\nVersion 2025.3.1.0 (build 36398880) (public-release)")
    sys.exit(0)
log = args[args.index("--log-file") + 1]
mode = os.environ.get("FAKE_NCU", "ok")
job = json.load(open(args[-1]))
print(json.dumps({"event": "ready"}), flush=True)
print(json.dumps({"event": "profile_start", "index": job["shape"][0]}), flush=True)
if mode == "noperm":
    with open(log, "w") as f:
        f.write("==PROF== Connected to process 4242 (/usr/bin/python3)\n"
                "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance "
                "Counters on the target device 0. For instructions on enabling permissions and to get more "
                "information see https://developer.nvidia.com/ERR_NVGPUCTRPERM\n")
else:
    shutil.copy(os.environ["FAKE_NCU_CSV"], log)
print(json.dumps({"event": "profile_done", "index": job["shape"][0], "baselines_ms": {"cudnn": 0.63, "flash": 0.81},
                  "skipped": {}, "reference": {"name": "cudnn", "ms": 0.63}}), flush=True)
sys.exit(1 if mode == "noperm" else 0)
