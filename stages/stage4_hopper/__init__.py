"""Stage 4 — Hopper: TMA, wgmma and warp specialization (FlashAttention-3 style)

sm_90a only. A producer warpgroup copies Q, K and V tiles with TMA into 128-byte-swizzled shared
memory, through a ring of mbarrier-guarded slots; two consumer warpgroups multiply with wgmma (Q·Kᵀ
from shared memory, P·V with P from registers) and take turns on the tensor cores (ping-pong), each
overlapping its softmax with its own P·V product.

The tensor maps TMA needs are built here, on the host, by cuda.core (`as_tensor_map`) and passed by
value to the kernel as `const __grid_constant__` parameters.
"""
from stages import Goal, Stage
from stages.common.hopper import sm_count, tensor_map

BLOCK_M = 128   # query rows per block (2 consumer warpgroups × 64), as in attention.cu
BLOCK_N = {64: 192, 128: 128}   # keys per K/V tile, per head dimension
THREADS = 384   # producer warpgroup + 2 consumer warpgroups
ATOM_COLS = 64  # a TMA box with the 128-byte swizzle is at most 64 16-bit elements wide


def kv_stages(head_dim: int) -> int:
    return 3 if head_dim == 64 else 2


PERSISTENT = 1  # one block per SM looping over query tiles (attention.cu's Schedule; 0: a block per tile)


def shared_bytes(head_dim: int, element_size: int) -> int:
    """Q tile, the K and V rings, the mbarriers, and 1 KB to align the tiles to 1024 bytes (attention.cu)."""
    stages = kv_stages(head_dim)
    tiles = (BLOCK_M + 2 * stages * BLOCK_N[head_dim]) * head_dim * element_size
    return tiles + 8 * (2 + 4 * stages) + 1024


def _tensor_map(x, box_rows: int):
    """A TMA descriptor over x [B, H, S, D] viewed as 3-D [B·H, S, D]: boxes of 1 × box_rows × 64 with the
    128-byte swizzle. Rows past S inside a head read as zeros, so a box never mixes two heads."""
    batch, heads, seq, head_dim = x.shape
    return tensor_map(x.reshape(batch * heads, seq, head_dim), (1, box_rows, ATOM_COLS))


def launch(kernels, q, k, v, o, lse, scale, causal):
    batch, heads, seq_q, head_dim = q.shape
    seq_kv = k.shape[2]
    block_n = BLOCK_N[head_dim]
    q_map, k_map, v_map = _tensor_map(q, BLOCK_M), _tensor_map(k, block_n), _tensor_map(v, block_n)
    m_blocks = (seq_q + BLOCK_M - 1) // BLOCK_M
    units = m_blocks * batch * heads  # query tiles (the kernel pairs them when persistent and causal)
    grid = units
    if PERSISTENT:
        if causal:
            units = (m_blocks + 1) // 2 * batch * heads
        grid = min(units, sm_count(q.device))
    kernels.attention_fwd((grid,), (THREADS,), q_map, k_map, v_map, o, lse, seq_q, seq_kv, scale, int(causal),
                          batch * heads, PERSISTENT, smem=shared_bytes(head_dim, q.element_size()))


STAGE = Stage(
    name="stage4_hopper",
    problem="attention",
    source="attention.cu",
    kernels={"attention_fwd": "const TmaMap, const TmaMap, const TmaMap, elem_t*, float*, int, int, float, int, int, int"},
    launch=launch,
    archs=("sm_90a",),
    specializations={"HEAD_DIM": "D"},  # the head dimension, compiled in
    goal=Goal("cudnn", 1.0),
    # Long sequences at D128, B·H chosen to fill the 132 SMs with 128-row query tiles.
    extra_benchmarks=tuple(dict(B=B, H=16, Sq=S, Skv=S, D=128, causal=causal, dtype="float16")
                           for B, S in ((8, 4096), (2, 16384)) for causal in (False, True)),
)
