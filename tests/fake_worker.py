"""A stand-in for grader/worker.py that misbehaves on purpose: item "hang" hangs, "crash" dies,
"error" reports a CUDA error, "wrong" fails, anything else succeeds. Used by test_isolation.py on the CPU.
`fake_worker.py JOB.json` runs one job; `fake_worker.py --serve` the jobs named on stdin, as the grader's
worker does, each ended by "job_end" with the process's id."""
import json
import os
import sys
import time


def run(path: str) -> bool:
    """The job at `path`; whether every item passed."""
    clean = True
    for index, item in json.load(open(path))["items"]:
        print(json.dumps({"event": "item_start", "index": index}), flush=True)
        if item == "hang":
            time.sleep(60)
        if item == "crash":
            os._exit(139)
        if item == "error":
            print(json.dumps({"event": "error", "kind": "CUDAError", "message": "CUDA_ERROR_ILLEGAL_ADDRESS: boom"}), flush=True)
            sys.exit(3)
        print("some noise the kernel's launch code printed", flush=True)
        clean &= item != "wrong"
        print(json.dumps({"event": "item_done", "index": index, "item": item, "pid": os.getpid()}), flush=True)
    return clean


if sys.argv[1] == "--serve":
    for line in sys.stdin:
        clean = run(line.strip())
        print(json.dumps({"event": "job_end", "clean": clean}), flush=True)
        if not clean:
            break
else:
    run(sys.argv[1])
