"""Stage 0 — naive attention: scores in global memory, a row softmax, then P·V.

Three kernels and an O(S²) workspace: the baseline every later stage improves on.
"""
import torch

from stages import Goal, Stage


def launch(kernels, q, k, v, o, lse, scale, causal):
    batch, heads, seq_q, head_dim = q.shape
    seq_kv = k.shape[2]
    rows = batch * heads * seq_q
    scores = torch.empty(rows * seq_kv, dtype=torch.float32, device=q.device)  # the O(S²) workspace

    tile = 16
    grid = ((seq_kv + tile - 1) // tile, (seq_q + tile - 1) // tile, batch * heads)
    kernels.attention_scores(grid, (tile, tile), q, k, scores, seq_q, seq_kv, scale, int(causal))
    kernels.attention_softmax((rows,), (256,), scores, lse, seq_kv)
    kernels.attention_pv((rows,), (head_dim,), scores, v, o, seq_q, seq_kv)


STAGE = Stage(
    name="stage0_naive",
    problem="attention",
    source="attention.cu",
    kernels={
        "attention_scores": "const elem_t*, const elem_t*, float*, int, int, float, int",
        "attention_softmax": "float*, float*, int",
        "attention_pv": "const float*, const elem_t*, elem_t*, int, int",
    },
    launch=launch,
    specializations={"HEAD_DIM": (64, 128)},
    goal=Goal("naive", 1.0),  # the same O(S²) algorithm as naive PyTorch: match its speed
)
