"""Stage 0 — naive attention: scores in global memory, a row softmax, then P·V.

Three kernels and an O(S²) workspace: the baseline every later stage improves on.
"""
import torch

from stages import Goal, Stage
from stages.common.attention import head_slices, kv_group


# attention.cu's tiling, which the grader checks the launch against: blocks of TILE × THREADS_Y
# threads, each for TILE × TILE scores or TILE query rows of P·V.
TILE, THREADS_Y = 32, 8
SOFTMAX_THREADS = 256  # a block per row of scores; block_reduce takes any multiple of 32 up to 1024


def launch(kernels, q, k, v, o, lse, scale, causal):
    batch, heads, seq_q, _ = q.shape
    seq_kv, group = k.shape[2], kv_group(q, k)  # query heads per KV head
    scores = torch.empty(batch, heads, seq_q * seq_kv, dtype=torch.float32, device=q.device)  # the O(S²) workspace

    query_tiles, key_tiles = -(-seq_q // TILE), -(-seq_kv // TILE)
    # B·H in grid.z / grid.y, whole groups of query heads a launch, with the KV heads they use
    for q_, o_, lse_, scores_, k_, v_ in head_slices(q, o, lse, scores, kv=(k, v), group=group):
        pairs = q_.shape[0]
        kernels.attention_scores((key_tiles, query_tiles, pairs), (TILE, THREADS_Y), q_, k_, scores_, seq_q, seq_kv,
                                 scale, int(causal), group)
        kernels.attention_softmax((pairs * seq_q,), (SOFTMAX_THREADS,), scores_, lse_, seq_kv)
        kernels.attention_pv((query_tiles, pairs), (TILE, THREADS_Y), scores_, v_, o_, seq_q, seq_kv, group)


STAGE = Stage(
    name="stage0_naive",
    problem="attention",
    source="attention.cu",
    kernels={
        "attention_scores": "const elem_t*, const elem_t*, float*, int, int, float, int, int",
        "attention_softmax": "float*, float*, int",
        "attention_pv": "const float*, const elem_t*, elem_t*, int, int, int",
    },
    launch=launch,
    specializations={"HEAD_DIM": "D"},  # the head dimension, compiled in
    geometry=lambda defines: {"TILE": TILE, "THREADS_Y": THREADS_Y},
    # The same O(S²) algorithm as naive PyTorch, but on CUDA cores in fp32 (67 TFLOP/s on an H100, against
    # the 989 of the tensor cores naive PyTorch's matmuls use) and with fp32 scores (twice the bytes):
    # its floor is about twice naive PyTorch's time, so half of naive PyTorch's speed counts as 100%.
    goal=Goal("naive", 0.5),
)
