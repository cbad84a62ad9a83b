"""A stand-in for grader/worker.py that misbehaves on purpose: item "hang" hangs, "crash" dies,
"error" reports a CUDA error, anything else succeeds. Used by test_isolation.py on the CPU."""
import json
import os
import sys
import time

job = json.load(open(sys.argv[1]))
for index, item in job["items"]:
    print(json.dumps({"event": "item_start", "index": index}), flush=True)
    if item == "hang":
        time.sleep(60)
    if item == "crash":
        os._exit(139)
    if item == "error":
        print(json.dumps({"event": "error", "kind": "CUDAError", "message": "CUDA_ERROR_ILLEGAL_ADDRESS: boom"}), flush=True)
        sys.exit(3)
    print("some noise the kernel's launch code printed", flush=True)
    print(json.dumps({"event": "item_done", "index": index, "item": item}), flush=True)
