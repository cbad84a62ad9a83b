"""Stage 2 — tensor cores with mma.sync (FlashAttention-2 split)

One kernel: each warp owns 16 query rows and computes S = QKᵀ and O += PV with mma.sync on the
tensor cores, the online softmax on the accumulator fragments, P kept in registers.
"""
from stages import Goal
from stages.common.fused_attention import fused_stage

# What the launch uses, per head dimension, as attention.cu computes it (the grader checks each value
# against the kernel): 4 warps × 16 query rows; dynamic shared memory, Q, K and V tiles of 64 rows
# padded by 8 elements.
GEOMETRY = {64: {"BLOCK_M": 64, "NUM_THREADS": 128, "SHARED_BYTES": 27648},
            128: {"BLOCK_M": 64, "NUM_THREADS": 128, "SHARED_BYTES": 52224}}

STAGE = fused_stage("stage2_warp", GEOMETRY, Goal("flash", 0.6))
