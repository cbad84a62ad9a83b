"""Deliberately wrong kernels, made from the real stage sources by one textual change each.

Each mutation names the exact text it replaces, and `mutate` fails loudly if that text is gone; the CPU
test (tests/test_mutations.py) applies every one to today's sources, so the day a kernel change orphans
a mutation CI fails, not only the GPU half that runs the wrong kernels (tests/test_gpu.py).
"""
from dataclasses import dataclass
from pathlib import Path

import torch

import stages


@dataclass(frozen=True)
class Mutation:
    stage: str
    edits: tuple          # (old, new): each old text must occur exactly once in the stage's kernel
    cases: str | None     # the correctness cases that must fail (a regular expression); None: a test of its own


MUTATIONS = {
    # softmax without subtracting the row max: exp() overflows on large scores (the x10 cases)
    "no_max_subtraction": Mutation("stage0", (("row_sum += expf(row[j] - row_max)", "row_sum += expf(row[j])"),
                                              ("row[j] = expf(row[j] - row_max)", "row[j] = expf(row[j])"),
                                              ("lse[blockIdx.x] = row_max + logf(row_sum)",
                                               "lse[blockIdx.x] = logf(row_sum)")), "x10"),
    # only the first half of each output row is written: the rest stays NaN-poisoned
    "half_written_output": Mutation("stage0", (("for (int c = 0; c < COLS_PER_THREAD; ++c)\n            o[",
                                                "for (int c = 0; c < COLS_PER_THREAD / 2; ++c)\n            o["),),
                                    "Sq17|Sq239"),
    # the causal mask off by one: each query also sees the next key
    "causal_off_by_one": Mutation("stage0", (("const bool masked = causal && j > i;",
                                              "const bool masked = causal && j > i + 1;"),), "causal"),
    # SwiGLU on the wrong half: silu applied to the up columns, the gate taken as is
    "swiglu_halves_swapped": Mutation("stage6", (("v0 = silu(v0) * acc[j + OUT_FRAGS][2 * half];",
                                                  "v0 = v0 * silu(acc[j + OUT_FRAGS][2 * half]);"),
                                                 ("v1 = silu(v1) * acc[j + OUT_FRAGS][2 * half + 1];",
                                                  "v1 = v1 * silu(acc[j + OUT_FRAGS][2 * half + 1]);")), "T1000 E32"),
    # the producer loads the next expert's weights for every tile
    "tile_in_wrong_expert": Mutation("stage6", (("kb * BLOCK_K, tile.expert);",
                                                 "kb * BLOCK_K, (tile.expert + 1) % experts);"),), "T1000 E32"),
    # the backward's causal mask off by one: the warp's keys taken one position early, so each query also
    # sees the next key (and each key's gradient takes the query just before it)
    "backward_causal_off_by_one": Mutation("stage8", (("on_diagonal,\n                                                       n0 + row0, m0, lane);",
                                                       "on_diagonal,\n                                                       n0 + row0 - 1, m0, lane);"),),
                                           "causal"),
    # dQ's staged rows added for the first half of each staged tile only: the other rows of dQ miss parts
    "backward_dq_half_added": Mutation("stage8", (("for (int first = 0; first < STAGING_ROWS; first += ROWS_PER_READ)",
                                                   "for (int first = 0; first < STAGING_ROWS / 2; first += ROWS_PER_READ)"),),
                                       "Sq1000"),
    # the Hopper backward's causal mask off by one, as stage 8's
    "hopper_backward_causal_off_by_one": Mutation("stage9", (("scale_log2, on_diagonal, key0, m0, lane);",
                                                              "scale_log2, on_diagonal, key0 - 1, m0, lane);"),),
                                                  "causal"),
    # stage 12's partial blocks masked as for the next query (each query also sees the next key): causal,
    # document and sliding-window masks all go wrong
    # in-process on the GPU: tests/test_block_sparse_stage.py
    "block_sparse_mask_off_by_one": Mutation("stage12", (("element_visible(key, query, mask.window",
                                                          "element_visible(key, query + 1, mask.window"),),
                                             None),
    # stage 12 skips the rows of query blocks whose lists are empty: they keep the NaN the grader poisons
    # the outputs with, instead of O = 0 and LSE = -inf
    # in-process on the GPU: tests/test_block_sparse_stage.py
    "block_sparse_empty_rows_unwritten": Mutation("stage12", (("        write_output_or_empty(o_acc,",
                                                               "        if (num_tiles > 0) write_output_or_empty(o_acc,"),),
                                                  None),
    # stage 13 takes the first partial query block of each key block's lists as full: its element mask is
    # skipped there, so queries see keys after them (causal, documents and windows alike)
    # in-process on the GPU: tests/test_block_sparse_backward_stage.py
    "block_sparse_backward_partial_as_full": Mutation("stage13", (("const bool partial = t >= full;",
                                                                   "const bool partial = t >= full + 1;"),),
                                                      None),
    # RoPE turned the wrong way (by -p·θ): attention sees the keys' positions mirrored
    "rope_turned_backwards": Mutation("stage10", (("nj = to_float(n.e[j]);", "nj = -to_float(n.e[j]);"),),
                                      "S128|S333"),
    # the last row of a source rank's bucket taken from the next rank's: a token's result goes back to
    # another rank's token. A world of one has one rank: tests/test_gpu.py runs the kernel on many.
    "row_from_wrong_rank": Mutation("stage11", (("while (b.before[s * experts + e] + b.count[s * experts + e] <= p) ++s;",
                                                 "while (b.before[s * experts + e] + b.count[s * experts + e] < p) ++s;"),),
                                    None),
    # stage 14's weight-gradient kernel stores nothing for an expert without rows: its dW1, dW2 keep the NaN
    # the grader poisons the outputs with, instead of zeros
    # in-process on the GPU: tests/test_moe_backward_stage.py
    "moe_backward_empty_expert_unwritten": Mutation("stage14", (("            if (storer) {\n                // DATA:",
                                                                 "            if (storer && tile.k_blocks > 0) {\n                // DATA:"),),
                                                    None),
    # stage 14's weight-gradient kernel loads the first 64 columns of A (the transposed operand) for both
    # consumer warpgroups: rows 64-127 of every 128-row tile of dW1 and dW2 are wrong
    # in-process on the GPU: tests/test_moe_backward_stage.py
    "moe_backward_same_a_columns": Mutation("stage14", (("tile.row0 + c * CONSUMER_ROWS, row, 0);",
                                                         "tile.row0, row, 0);"),), None),
    # stage 14's epilogue sums dA·h over one lane's columns only: the quad's shuffles dropped, so g (the top-k
    # weights' gradient) misses three quarters of each row: dBias, dWr and dX's router term go wrong
    # in-process on the GPU: tests/test_moe_backward_stage.py
    "moe_backward_g_one_lane": Mutation("stage14", (("        g[half] += __shfl_xor_sync(FULL_MASK, g[half], 1);\n"
                                                     "        g[half] += __shfl_xor_sync(FULL_MASK, g[half], 2);\n", ""),),
                                        None),
    # stage 14's epilogue multiplies a padding row's results by its zero weight instead of selecting zeros:
    # the problem's h1 holds NaN in the padding rows, 0 · NaN is NaN, and dW1 and dW2 fill with it
    # in-process on the GPU: tests/test_moe_backward_stage.py
    "moe_backward_padding_multiplied": Mutation("stage14", (("const bool padding = w[half] == 0.0f;",
                                                             "const bool padding = false;"),), None),
    # stage 14's router backward adds the top-k softmax's term without the weight w_j
    # in-process on the GPU: tests/test_moe_backward_stage.py
    "moe_backward_topk_term_unweighted": Mutation("stage14", (("const double term = w[j] * (g[j] - weighted);",
                                                               "const double term = g[j] - weighted;"),), None),
    # a write far outside any buffer: an illegal address
    "crash": Mutation("stage0", (("    __syncthreads();\n\n    float dot",
                                  "    __syncthreads();\n    scores[(size_t)1 << 40] = 1.0f;\n\n    float dot"),), None),
    # a kernel that never finishes
    "hang": Mutation("stage0", (("    __syncthreads();\n\n    float dot",
                                 "    __syncthreads();\n    while (true) __nanosleep(1000);\n\n    float dot"),), None),
}


def mutate(name: str, folder: Path) -> tuple:
    """(the stage, the path of the mutated copy of its kernel) for a mutation of MUTATIONS."""
    mutation = MUTATIONS[name]
    stage = stages.load(mutation.stage)
    source = stage.source_path.read_text()
    for old, new in mutation.edits:
        assert source.count(old) == 1, f"mutation {name}: {old!r} is no longer in {stage.source_path.name} once"
        source = source.replace(old, new)
    path = folder / f"{name}.cu"
    path.write_text(source)
    return stage, path


def regroup_piece(ranks: int, local: int, device: str):
    """Stage 11's traffic for `local` experts from `ranks` source ranks, random counts, no padding (align 1):
    what tests/test_gpu.py hands the mutated regroup kernel, and test_mutations.py the PyTorch regroup on
    the CPU (so that a change of the Piece it is built from fails in CI, not only on a GPU)."""
    from stages.stage11_expert_parallel.dispatch import Piece

    counts = torch.randint(1, 300, (ranks, local), generator=torch.Generator().manual_seed(ranks), dtype=torch.int32)
    rows = int(counts.sum())
    return Piece(experts=slice(0, local), send_token=None, send_splits=[], recv_splits=counts.sum(1).tolist(),
                 recv_counts=counts.to(device), grouped_rows=rows)


def regroup_in_pytorch(piece):
    """PyTorch's regroup of `piece` with align 1 (stage 11's Parts.regroup_index)."""
    from types import SimpleNamespace

    from stages.stage11_expert_parallel.dispatch import Parts

    return Parts.regroup_index(SimpleNamespace(align=1), piece)
