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
    "row_from_wrong_rank": Mutation("stage11", (("b.count[s * p.experts + e] <= copied) ++s;",
                                                 "b.count[s * p.experts + e] < copied) ++s;"),),
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
    # stage 15's combine weighs every split that saw a key alike, without exp(lse_s - max): O is the plain mean
    # of the splits' O, and LSE = max + log(their count). The last new token of sequence 0 sees all its S keys:
    # with S >= 130 they span 2 splits or more (split_keys, on any GPU of 48 SMs or more), whose LSEs differ;
    # one split (64 keys or more at D = 128, 128 at D = 64) holds S <= 50 and S = 100 at D = 64: no change
    "decode_combine_unweighted": Mutation("stage15", (("const float weight = lse_s == -INFINITY ? 0.0f : exp2f((lse_s - m) * LOG2E);",
                                                       "const float weight = lse_s == -INFINITY ? 0.0f : 1.0f;"),),
                                          r"S\d{3}"),
    # stage 15's merge of a split's warps weighs each warp that saw a key alike, its sum and O taken against
    # its own max: wrong wherever a row sees keys of two warps (16 keys each) of one split: the last new token
    # of sequence 0 sees keys 0-15 (warp 0) and 16 on (warp 1) of its first split wherever S >= 17 (40 and
    # more here; S = 1 and 3 fill part of warp 0's keys)
    "decode_warps_merged_unweighted": Mutation("stage15", (("return merged_max == -INFINITY ? 0.0f : fast_exp2((warp_max - merged_max) * scale_log2);",
                                                            "return warp_max == -INFINITY ? 0.0f : 1.0f;"),),
                                               r"S\d\d"),
    # stage 15 reads every key from its sequence's first page (its slot key % page_size): right while a
    # sequence fits in one page; wrong wherever sequence 0's S keys outgrow it (every case with S >= 40, its
    # pages of 1 to 64 tokens; S = 1 and 3 fit in their pages of 16 and 64). Page 0 always exists: no stray read
    "decode_first_page_only": Mutation("stage15", (("return __ldg(pages + page) * page_size + (key - page * page_size);",
                                                    "return __ldg(pages) * page_size + (key - page * page_size);"),),
                                       r"S\d\d"),
    # stage 15's causal rule among the new tokens off by one: new token i also sees new token i + 1 (the
    # last sees no more: key_end stops it). With Sq = 1 it changes nothing; with Sq > 1 the last sequence
    # (Sq keys, the ragged cases) or the only one (S = Sq) has token 0 see 2 keys instead of 1
    "decode_causal_off_by_one": Mutation("stage15", (("if (key >= key_end || key > position[c / 2]) s[n][c] = -INFINITY;",
                                                      "if (key >= key_end || key > position[c / 2] + 1) s[n][c] = -INFINITY;"),),
                                         r"Sq[2-8]"),
    # stage 15's block reads KV head h % H_kv of its first query head h = kv_head · group (an interleaved
    # head layout's mapping) instead of h / group = kv_head: the same where H_kv = 1 or H_kv = H; where
    # 1 < H_kv < H, KV head 1's group reads KV head group % H_kv, not 1 (group = 2, 4 or 8 here)
    "decode_kv_head_interleaved": Mutation("stage15", (("p.kv_heads, kv_head, key_row0, lane);",
                                                        "p.kv_heads, kv_head * group % p.kv_heads, key_row0, lane);"),),
                                           r"Hkv[2-9]"),
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
