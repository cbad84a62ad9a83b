"""Deliberately wrong kernels, made from the real stage sources by one textual change each.

Each mutation names the exact text it replaces, and `mutate` fails loudly if that text is gone,
so a changed kernel cannot silently turn a wrong-kernel test into one that checks nothing.
"""
from pathlib import Path

import stages

MUTATIONS = {
    # softmax without subtracting the row max: exp() overflows on large scores (the x10 cases)
    "no_max_subtraction": ("stage0", [("row_sum += expf(row[j] - row_max)", "row_sum += expf(row[j])"),
                                      ("row[j] = expf(row[j] - row_max)", "row[j] = expf(row[j])"),
                                      ("lse[blockIdx.x] = row_max + logf(row_sum)", "lse[blockIdx.x] = logf(row_sum)")]),
    # only the first half of each output row is written: the rest stays NaN-poisoned
    "half_written_output": ("stage0", [("for (int c = 0; c < COLS_PER_THREAD; ++c)\n            o[",
                                        "for (int c = 0; c < COLS_PER_THREAD / 2; ++c)\n            o[")]),
    # the causal mask off by one: each query also sees the next key
    "causal_off_by_one": ("stage0", [("const bool masked = causal && j > i;", "const bool masked = causal && j > i + 1;")]),
    # SwiGLU on the wrong half: silu applied to the up columns, the gate taken as is
    "swiglu_halves_swapped": ("stage6", [("v0 = silu(v0) * acc[j + OUT_FRAGS][2 * half];", "v0 = v0 * silu(acc[j + OUT_FRAGS][2 * half]);"),
                                         ("v1 = silu(v1) * acc[j + OUT_FRAGS][2 * half + 1];", "v1 = v1 * silu(acc[j + OUT_FRAGS][2 * half + 1]);")]),
    # the producer loads the next expert's weights for every tile
    "tile_in_wrong_expert": ("stage6", [("kb * BLOCK_K, tile.expert);", "kb * BLOCK_K, (tile.expert + 1) % experts);")]),
    # the backward's causal mask off by one: each key's gradient also takes the query just before it
    "backward_causal_off_by_one": ("stage8", [("s[n][c] = mask && ahead + 8 * (c / 2) - c % 2 > 8 * n ? 0.0f : p;",
                                               "s[n][c] = mask && ahead + 8 * (c / 2) - c % 2 > 8 * n + 1 ? 0.0f : p;")]),
    # dQ's parts added for half of each row only: the other half of dQ stays 0
    "backward_dq_half_added": ("stage8", [("        if (row >= rows) continue;\n        float* to",
                                           "        if (row >= rows || chunk >= CHUNKS / 2) continue;\n        float* to")]),
    # a write far outside any buffer: an illegal address
    "crash": ("stage0", [("    __syncthreads();\n\n    float dot", "    __syncthreads();\n    scores[(size_t)1 << 40] = 1.0f;\n\n    float dot")]),
    # a kernel that never finishes
    "hang": ("stage0", [("    __syncthreads();\n\n    float dot", "    __syncthreads();\n    while (true) __nanosleep(1000);\n\n    float dot")]),
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
