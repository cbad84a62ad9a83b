"""Deliberately wrong kernels, made from the real stage sources by one textual change each.

Each mutation names the exact text it replaces, and `mutate` fails loudly if that text is gone,
so a changed kernel cannot silently turn a wrong-kernel test into one that checks nothing.
"""
from pathlib import Path

import stages

MUTATIONS = {
    # softmax without subtracting the row max: exp() overflows on large scores (the x10 cases)
    "no_max_subtraction": ("stage0", [("expf(row[j] - row_max)", "expf(row[j])"),
                                      ("lse[blockIdx.x] = row_max + logf(row_sum)", "lse[blockIdx.x] = logf(row_sum)")]),
    # only the first half of each output row is written: the rest stays NaN-poisoned
    "half_written_output": ("stage0", [("for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x)",
                                        "for (int d = threadIdx.x; d < HEAD_DIM / 2; d += blockDim.x)")]),
    # the causal mask off by one: each query also sees the next key
    "causal_off_by_one": ("stage0", [("const bool masked = causal && j > i;", "const bool masked = causal && j > i + 1;")]),
    # a write far outside any buffer: an illegal address
    "crash": ("stage0", [("    if (i >= seq_q || j >= seq_kv) return;\n",
                          "    if (i >= seq_q || j >= seq_kv) return;\n    scores[(size_t)1 << 40] = 1.0f;\n")]),
    # a kernel that never finishes
    "hang": ("stage0", [("    if (i >= seq_q || j >= seq_kv) return;\n",
                         "    if (i >= seq_q || j >= seq_kv) return;\n    volatile int spin = 1;\n    while (spin) {}\n")]),
}


def mutate(name: str, folder: Path) -> tuple:
    """(the stage, the path of the mutated copy of its kernel) for a mutation of MUTATIONS."""
    stage_name, edits = MUTATIONS[name]
    stage = stages.load(stage_name)
    source = stage.source_path.read_text()
    for old, new in edits:
        assert source.count(old) == 1, f"mutation {name}: {old!r} is no longer in {stage.source_path.name} once"
        source = source.replace(old, new)
    path = folder / f"{name}.cu"
    path.write_text(source)
    return stage, path
