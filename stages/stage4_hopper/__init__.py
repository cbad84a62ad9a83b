"""Stage 4 — Hopper: TMA, wgmma and warp specialization (FlashAttention-3 style)

sm_90a only. A producer warpgroup copies Q, K and V tiles with TMA into 128-byte-swizzled shared
memory, through a ring of mbarrier-guarded slots; two consumer warpgroups multiply with wgmma (Q·Kᵀ
from shared memory, P·V with P from registers) and take turns on the tensor cores (ping-pong), each
overlapping its softmax with its own P·V product.

The tensor maps TMA needs are built on the host (stages/common/hopper.py), 4-D over q, k and v with
their own strides, so that a model's [B, S, H, D] views are read where they lie, and passed by value to
the kernel as `const __grid_constant__` parameters.
"""
from stages import Goal, Stage
from stages.common.attention import ForwardParams, forward_params
from stages.common.hopper import sm_count, tensor_map
from stages.common.prompts import SHORT_PROMPTS

# What the launch uses, per head dimension and causal mask (both compiled in), as attention.cu computes
# it (the grader checks each value against the kernel): query rows per tile (2 consumer warpgroups × 64),
# keys per K/V tile, threads (a producer warpgroup + 2 consumer warpgroups), the width of a TMA box (64
# 16-bit elements, the 128-byte swizzle's) and its rows (tiles are copied as boxes of 64 rows: tma.cuh's
# load_tile), and dynamic shared memory: the Q tile, the K and V rings, the mbarriers and 1 KB to align
# the tiles to 1024 bytes.
_SHARED = {"BLOCK_M": 128, "NUM_THREADS": 384, "ATOM_COLS": 64, "TILE_BOX_ROWS": 64}
GEOMETRY = {(64, 0): {**_SHARED, "BLOCK_N": 192, "SHARED_BYTES": 164976},
            (64, 1): {**_SHARED, "BLOCK_N": 128, "SHARED_BYTES": 148624},
            (128, 0): {**_SHARED, "BLOCK_N": 128, "SHARED_BYTES": 164944},
            (128, 1): {**_SHARED, "BLOCK_N": 128, "SHARED_BYTES": 164944}}
# Long sequences at D128, B·H chosen to fill the 132 SMs with 128-row query tiles (the ladder's rungs are
# timed at the problem's shapes and these).
LONG_SEQUENCES = tuple(dict(B=B, H=16, Sq=S, Skv=S, D=128, causal=causal, dtype="float16")
                       for B, S in ((8, 4096), (2, 16384)) for causal in (False, True))
PERSISTENT = 1  # one block per SM looping over query tiles (attention.cu's Schedule; 0: a block per tile)


def _tensor_map(x, box_rows: int, box_cols: int):
    """A TMA descriptor over x [B, H, S, D] (K and V: [B, H_kv, S, D]), any strides with D contiguous:
    boxes of 1 × 1 × box_rows × box_cols with the 128-byte swizzle. Rows past S read as zeros, so a box
    never mixes two heads."""
    return tensor_map(x, (1, 1, box_rows, box_cols))


def launch(kernels, q, k, v, o, lse, scale, causal):
    batch, heads, seq_q, head_dim = q.shape
    launched = GEOMETRY[head_dim, int(causal)]
    block_m, box_rows, box_cols = launched["BLOCK_M"], launched["TILE_BOX_ROWS"], launched["ATOM_COLS"]
    q_map, k_map, v_map = (_tensor_map(x, box_rows, box_cols) for x in (q, k, v))
    m_blocks = (seq_q + block_m - 1) // block_m
    units = m_blocks * batch * heads  # query tiles (the kernel pairs them when persistent and causal)
    grid = units
    if PERSISTENT:
        if causal:
            units = (m_blocks + 1) // 2 * batch * heads
        grid = min(units, sm_count(q.device))
    # o: any [B, H, S, D] view with d contiguous (ops' [B, S, H, D] buffer)
    kernels.attention_fwd((grid,), (launched["NUM_THREADS"],), q_map, k_map, v_map,
                          forward_params(q, k, o, lse, scale, causal, PERSISTENT), smem=launched["SHARED_BYTES"])


STAGE = Stage(
    name="stage4_hopper",
    problem="attention",
    source="attention.cu",
    kernels={"attention_fwd": "const TmaMap, const TmaMap, const TmaMap, const ForwardParams"},
    launch=launch,
    param_structs=(ForwardParams,),
    archs=("sm_90a",),
    specializations={"HEAD_DIM": "D", "CAUSAL": "causal"},  # the head dimension and the mask, compiled in
    geometry=lambda defines: GEOMETRY[int(defines["HEAD_DIM"]), int(defines["CAUSAL"])],
    goal=Goal("cudnn", 1.0),
    extra_benchmarks=LONG_SEQUENCES + SHORT_PROMPTS,
)
