"""Stage 4's ladder: the Hopper attention forward one idea at a time, graded like stage 4.

The three rungs compute what attention.cu computes, on its tiles (128 query rows, K/V tiles of 192 keys
at D = 64 and 128 at D = 128, in TMA's 128-byte swizzle) with its wgmma products, one block per query
tile (ladder/forward.cuh); each adds one idea to the rung below:
  wgmma             two warpgroups multiply with wgmma; every thread copies with cp.async (stage 3's)
  tma               one thread copies whole tiles with TMA, which land on mbarriers
  warp_specialized  a producer warpgroup copies, two consumer warpgroups compute (setmaxnreg)
and stage 4's own kernel adds the ping-pong of its consumers and the persistent grid. sm_90a only, as
stage 4: they are its steps, not a fallback for older GPUs.
"""
from stages import Goal, Stage
from stages.common.attention import ForwardParams, by_head_dim, forward_params
from stages.common.hopper import tensor_map
from stages.stage4_hopper import LONG_SEQUENCES

# What each rung's launch uses, per head dimension, as its .cu file computes it (the grader checks each
# value against the kernel): query rows per block, keys per K/V tile, threads (2 warpgroups; + the
# producer's), the TMA boxes' width and rows (tma.cuh's load_tile) where the rung copies with TMA, and
# dynamic shared memory: the Q tile, 2 K/V buffers (warp_specialized: attention.cu's ring, 3 at D = 64),
# the mbarriers, 1 KB to align the tiles to 1024 bytes.
TMA_BOXES = {"ATOM_COLS": 64, "TILE_BOX_ROWS": 64}
GEOMETRY = {
    "wgmma": {64: {"BLOCK_M": 128, "BLOCK_N": 192, "NUM_THREADS": 256, "SHARED_BYTES": 115712},
              128: {"BLOCK_M": 128, "BLOCK_N": 128, "NUM_THREADS": 256, "SHARED_BYTES": 164864}},
    "tma": {64: {"BLOCK_M": 128, "BLOCK_N": 192, "NUM_THREADS": 256, "SHARED_BYTES": 115752, **TMA_BOXES},
            128: {"BLOCK_M": 128, "BLOCK_N": 128, "NUM_THREADS": 256, "SHARED_BYTES": 164904, **TMA_BOXES}},
    "warp_specialized": {64: {"BLOCK_M": 128, "BLOCK_N": 192, "NUM_THREADS": 384, "SHARED_BYTES": 164968,
                              **TMA_BOXES},
                         128: {"BLOCK_M": 128, "BLOCK_N": 128, "NUM_THREADS": 384, "SHARED_BYTES": 164936,
                               **TMA_BOXES}},
}
KERNELS = {"wgmma": {"attention_fwd": "const elem_t*, const elem_t*, const elem_t*, const ForwardParams"},
           "tma": {"attention_fwd": "const TmaMap, const TmaMap, const TmaMap, const ForwardParams"},
           "warp_specialized": {"attention_fwd": "const TmaMap, const TmaMap, const TmaMap, const ForwardParams"}}


def operands(name: str, q, k, v, launched: dict) -> tuple:
    """Q, K and V as the rung's kernel takes them: dense tensors to copy from (wgmma), or TMA descriptors
    over any strides, boxes of TILE_BOX_ROWS × ATOM_COLS with the 128-byte swizzle (stage 4's)."""
    if name == "wgmma":
        return tuple(x.contiguous() for x in (q, k, v))  # a copy only where a view is not dense
    return tuple(tensor_map(x, (1, 1, launched["TILE_BOX_ROWS"], launched["ATOM_COLS"])) for x in (q, k, v))


def rung(name: str, goal: Goal) -> Stage:
    def launch(kernels, q, k, v, o, lse, scale, causal):
        batch, heads, seq_q, head_dim = q.shape
        launched = GEOMETRY[name][head_dim]
        grid = (seq_q + launched["BLOCK_M"] - 1) // launched["BLOCK_M"] * batch * heads  # a block per query tile
        kernels.attention_fwd((grid,), (launched["NUM_THREADS"],), *operands(name, q, k, v, launched),
                              forward_params(q, k, o, lse, scale, causal, persistent=0), smem=launched["SHARED_BYTES"])

    return Stage(name="stage4_hopper", problem="attention", source=f"ladder/{name}.cu", kernels=KERNELS[name],
                 launch=launch, param_structs=(ForwardParams,), archs=("sm_90a",), specializations={"HEAD_DIM": "D"},
                 geometry=by_head_dim(GEOMETRY[name]), goal=goal, rung=name,
                 extra_benchmarks=LONG_SEQUENCES)  # timed at stage 4's long shapes


# The goals scale to what each step can reach against cuDNN (stage 4's goal is cuDNN's speed): with a
# warpgroup waiting for each product, the tensor cores idle through every softmax (at D = 64 about as
# long as the products) -- a little more than half of cuDNN; the consumers, no longer synced as a
# block, hide some of one's softmax under the other's products.
RUNGS = (rung("warp_specialized", Goal("cudnn", 0.7)), rung("tma", Goal("cudnn", 0.6)),
         rung("wgmma", Goal("cudnn", 0.6)))
