"""Stage 10's training records, results/training/<gpu>.json: the sizes `python -m stages.stage10_model.train`
trains, its ways' names, and the records its --json writes. Plain JSON and the standard library: the docs'
hook loads this file by itself (no torch).

A records file holds one GPU's runs:

    {"gpu": "NVIDIA H200", "runs": [run, ...]}

and a run, one model trained every way from the same weights on the same batches:

    model      a name of TRAINED          label    its dimensions in words ("llama L4 hidden2048 ... B4 S2048")
    batch, seq, steps, every, lr          the run's settings (losses logged every `every` steps and at the last)
    gpu, torch, commit, dirty, date, command
                                          where and from what it ran (dirty: the tree had uncommitted changes;
                                          null where the commit came from $FLASHMOE_COMMIT)
    ways       {way: {"losses": [...], "tokens_per_s": ..., "warmup_s": ...}}, for a compiled way also
               "graphs" (the graphs Dynamo compiled) and "cudagraph_skips" (the graphs inductor ran without
               CUDA graphs)
    skipped    {way: why}: the course's ops refused the GPU (one line)
    failed     {way: the error's line}

Runs recorded before the compiled course way have a "compile" way: torch.compile in its default mode (no
CUDA graphs), and may name a "machine" (what else ran on the host).
"""
from __future__ import annotations

import json
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[2] / "results" / "training"

# name -> how it is trained: reference/model.py's CONFIGS entry `base` with `changes` to its dimensions, the
# batch, the sequence, the steps and AdamW's learning rate. small: small's widths on 2 layers (14.2 M weights
# in the decoder); moe: Mixtral's 8 experts, top-2, GQA 4:1 and RoPE theta on 2 narrower layers (26.5 M);
# llama: a Llama-like 4 layers of medium's hidden 2048 and SwiGLU 5632, 32 query and 8 KV heads of 64 (180 M);
# moe-llama: the same attention, medium's MLP as 8 experts of top-2 (1.15 G, 0.32 G a token meets).
TRAINED = {
    "small": dict(base="small", changes=dict(layers=2), batch=8, seq=256, steps=200, lr=1e-3),
    "moe": dict(base="moe", changes=dict(layers=2, hidden=512, heads=8, kv_heads=2, inter=1024),
                batch=8, seq=256, steps=200, lr=1e-3),
    "llama": dict(base="medium", changes=dict(layers=4, heads=32, kv_heads=8), batch=4, seq=2048, steps=200,
                  lr=3e-4),
    "moe-llama": dict(base="medium", changes=dict(layers=4, heads=32, kv_heads=8, experts=8, top_k=2),
                      batch=4, seq=2048, steps=200, lr=3e-4),
}

# way -> what the lesson calls it, in the order its tables list them
WAYS = {
    "course": "course",
    "course-compiled": "course, compiled",
    "pytorch": "PyTorch eager",
    "pytorch-compiled": "PyTorch compiled",
    "compile": "torch.compile, no CUDA graphs",
}
BASELINE = "pytorch"  # the way the others' speed and losses are compared with
SAME_RUN = ("model", "batch", "seq")  # a new run replaces a recorded one that agrees on these


def load(folder: Path = FOLDER) -> list[dict]:
    """Every records file in the folder, by file name, each with "_file": its name."""
    return [dict(json.loads(p.read_text()), _file=p.name) for p in sorted(Path(folder).glob("*.json"))]


def merge(path: Path, run: dict, same: tuple = SAME_RUN) -> dict:
    """The records file at `path` (a new one if there is none) with `run` in it, in place of a run that agrees
    with it on `same` (a training run's model, batch and sequence); written back. ValueError where the file
    holds another GPU's runs."""
    path = Path(path)
    found = json.loads(path.read_text()) if path.exists() else {"gpu": run["gpu"], "runs": []}
    if found.get("gpu") != run["gpu"]:
        raise ValueError(f"{path} holds the runs of the {found.get('gpu')}; this run is on the {run['gpu']}")
    found["runs"] = [r for r in found["runs"] if [r.get(k) for k in same] != [run[k] for k in same]] + [run]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(found, indent=1) + "\n")
    return found


def describe(name: str) -> str:
    """A size of TRAINED in words: "medium's dimensions with layers 4, heads 32, kv_heads 8; 4 × 2048 tokens"."""
    t = TRAINED[name]
    changes = ", ".join(f"{k} {v}" for k, v in t["changes"].items())
    return f"{t['base']}'s dimensions with {changes}; {t['batch']} × {t['seq']} tokens a step"


def unmeasured(runs: list[dict]) -> list[str]:
    """The sizes of TRAINED that no run holds at their own batch and sequence."""
    return [name for name, t in TRAINED.items()
            if not any((r.get("model"), r.get("batch"), r.get("seq")) == (name, t["batch"], t["seq"]) for r in runs)]
