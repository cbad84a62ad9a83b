// Tensor-core helpers for the warp-level attention kernels (stage 2 onwards).
//
// Thin wrappers around two PTX instructions, chosen by elem_t where the type matters:
//   ldmatrix    shared memory -> the registers of an mma operand, 8×8 16-bit matrices at a time
//   mma.sync    D[16×8] += A[16×16] · B[16×8], fp32 accumulators, one warp
// and the pieces of FlashAttention-2 that work on mma fragments whatever the shared-memory
// layout: the quad reductions, the online softmax, P as the A operand of P·V, the epilogue.
//
// Fragment notation (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"):
// in a warp, lane = 4·g + t, with g = lane / 4 (the "group", 0..7) and t = lane % 4.
//   C/D (16×8 fp32, 4 floats): c[0], c[1] = row g,   columns 2t, 2t+1
//                              c[2], c[3] = row g+8, columns 2t, 2t+1
//   A (16×16, 4 registers of two 16-bit values, the lower column in the low half):
//                              a[0] = row g,   columns 2t, 2t+1      a[2] = row g,   columns 2t+8, 2t+9
//                              a[1] = row g+8, columns 2t, 2t+1      a[3] = row g+8, columns 2t+8, 2t+9
//   B (16×8, 2 registers):     b[0] = rows (k) 2t, 2t+1 of column (n) g;   b[1] = rows 2t+8, 2t+9
// So a thread owns two rows of every tile, g and g+8, and shares each row with the 3 other
// lanes of its quad (lanes 4g .. 4g+3): row-wise reductions are a 2-step shuffle in the quad.
#pragma once
#include "attention.cuh"

// The 32-bit shared-memory address the PTX instructions below take.
__device__ __forceinline__ unsigned shared_address(const void* pointer) {
    return (unsigned)__cvta_generic_to_shared(pointer);
}

// --8<-- [start:ldmatrix_ptx]
// ldmatrix.x4: the warp loads four 8×8 matrices of 16-bit values. Lanes 8i .. 8i+7 give the
// addresses of the 8 rows (16 bytes each) of matrix i; afterwards register i of lane 4g + t holds
// row g, columns 2t and 2t+1 of matrix i -- exactly a quarter of an A operand, or half of a B.
// .trans delivers each matrix transposed: register i holds rows 2t and 2t+1 of column g.
// ("memory": these read shared memory that ordinary stores or cp.async wrote; keep them after
// the barrier that publishes it.)
__device__ __forceinline__ void ldmatrix_x4(unsigned (&frag)[4], unsigned address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
                 : "r"(address)
                 : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&frag)[4], unsigned address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
                 : "r"(address)
                 : "memory");
}

// Which row of a 16-row tile, and which 16-byte chunk (8 columns) of a 16-column slice, lane
// `lane` gives ldmatrix_x4 the address of, for the two orders of the four 8×8 matrices we need.
//
// A order -- matrices (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15),
// (rows 8-15, cols 8-15) = registers a[0..3] of an A operand (Q). With .trans on a [key][d] tile
// (V) the same order gives b[0], b[1] of d columns 0-7, then b[0], b[1] of d columns 8-15.
__device__ __forceinline__ int a_order_row(int lane) { return lane % 16; }
__device__ __forceinline__ int a_order_chunk(int lane) { return lane / 16; }
// B order, on an [n][k] tile (K: n = key, k = d) -- matrices (n 0-7, k 0-7), (n 0-7, k 8-15),
// (n 8-15, k 0-7), (n 8-15, k 8-15) = b[0], b[1] of keys 0-7, then b[0], b[1] of keys 8-15.
__device__ __forceinline__ int b_order_row(int lane) { return lane % 8 + lane / 16 * 8; }
__device__ __forceinline__ int b_order_chunk(int lane) { return lane / 8 % 2; }
// --8<-- [end:ldmatrix_ptx]

// --8<-- [start:mma_ptx]
// acc[16×8] += a[16×16] · b[16×8] on the tensor cores, inputs elem_t, accumulation fp32. One
// instruction for both element types, which its name gives: PTX "f16" or "bf16".
template <typename T>
__device__ void mma_m16n8k16(float (&acc)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);

#define DEFINE_MMA_M16N8K16(T, PTX)                                                                         \
    template <>                                                                                             \
    __device__ __forceinline__ void mma_m16n8k16<T>(float (&acc)[4], const unsigned (&a)[4], unsigned b0,  \
                                                    unsigned b1) {                                         \
        asm("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 "                                    \
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                             \
            : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])                                        \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                                \
    }
DEFINE_MMA_M16N8K16(__half, "f16")
DEFINE_MMA_M16N8K16(__nv_bfloat16, "bf16")
#undef DEFINE_MMA_M16N8K16

// Two floats rounded to elem_t and packed into one register, `low` in the low 16 bits: the
// order of the two columns a thread holds in an operand register.
template <typename T> __device__ unsigned pack_pair(float low, float high);

template <>
__device__ __forceinline__ unsigned pack_pair<__half>(float low, float high) {
    __half2 pair = __floats2half2_rn(low, high);
    return *reinterpret_cast<unsigned*>(&pair);
}

template <>
__device__ __forceinline__ unsigned pack_pair<__nv_bfloat16>(float low, float high) {
    __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
    return *reinterpret_cast<unsigned*>(&pair);
}
// --8<-- [end:mma_ptx]

// --8<-- [start:quad_reduce]
// Max and sum over the 4 lanes of a quad, which hold the same two rows of every fragment.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
// --8<-- [end:quad_reduce]

// 2^x on the MUFU unit: ex2.approx, with results below 2^-126 flushed to 0. exp2f() compiles to
// the same instruction plus, without --use_fast_math, three more to keep such tiny results
// (an FSETP and two predicated FMULs per call); next to the row's largest term, exp2(0) = 1,
// they change nothing, and they would round to 0 in elem_t anyway. exp2(-inf) = 0.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Sets to -inf the scores of keys past the end (key >= seq_kv) and, if causal, above the
// diagonal (key > query), in a C fragment layout (mma.sync's m16n8, and each warp's 16 rows of
// wgmma's m64nN): `row` is the query row of c[0], c[1]; c[2], c[3] are row + 8.
template <int N_FRAGS>
__device__ __forceinline__ void apply_mask(float (&s)[N_FRAGS][4], int first_key, int row, int seq_kv, int causal,
                                           int lane) {
#pragma unroll
    for (int n = 0; n < N_FRAGS; ++n) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int key = first_key + 8 * n + 2 * (lane % 4) + c % 2;
            const int query = row + 8 * (c / 2);
            if (key >= seq_kv || (causal && key > query)) s[n][c] = -INFINITY;
        }
    }
}

// --8<-- [start:row_reductions]
// The max over the quad of the scores of row r of a tile (r = 0: row g, c[0] and c[1]; r = 1: row
// g+8, c[2] and c[3]).
template <int N_FRAGS>
__device__ __forceinline__ float tile_row_max(const float (&s)[N_FRAGS][4], int r) {
    float m = -INFINITY;
#pragma unroll
    for (int n = 0; n < N_FRAGS; ++n) m = fmaxf(m, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
    return quad_max(m);
}

// The running max of a row times scale_log2; 0 while the row has seen only masked keys (max =
// -inf), which keeps exp2(-inf - (-inf)) = NaN out (every p is then exp2(-inf) = 0).
__device__ __forceinline__ float scaled_max(float row_max, float scale_log2) {
    return row_max == -INFINITY ? 0.0f : row_max * scale_log2;
}

// p = 2^(s·scale_log2 - max_scaled), in place, for the thread's scores of row r; returns their
// sum. One FFMA and one MUFU.EX2 per score.
template <int N_FRAGS>
__device__ __forceinline__ float exponentiate_row(float (&s)[N_FRAGS][4], int r, float scale_log2, float max_scaled) {
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < N_FRAGS; ++n) {
#pragma unroll
        for (int c = 2 * r; c < 2 * r + 2; ++c) {
            s[n][c] = fast_exp2(s[n][c] * scale_log2 - max_scaled);
            sum += s[n][c];
        }
    }
    return sum;
}
// --8<-- [end:row_reductions]

// --8<-- [start:softmax_update]
// The online softmax of one warp over one tile of keys, on the accumulator fragments.
//   s[N_FRAGS][4]  raw scores q·k of the warp's 16 rows (masked ones -inf); becomes P
//   o[D_FRAGS][4]  the output accumulator, rescaled to the new running max
//   row_max[r]     running max of the raw scores of row g + 8r (quad-uniform)
//   row_sum[r]     running Σ exp of the row -- only over this thread's columns: the quad's
//                  4 partial sums share the same max, so they are added once, at the end
// exp(scale·(s - m)) = exp2(s·scale_log2 - m·scale_log2): log2(e) is folded into the scale so
// that the exponential is one FFMA and one MUFU.EX2 per score.
template <int N_FRAGS, int D_FRAGS>
__device__ __forceinline__ void online_softmax(float (&s)[N_FRAGS][4], float (&o)[D_FRAGS][4],
                                               float (&row_max)[2], float (&row_sum)[2], float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // r = 0: row g (c[0], c[1]); r = 1: row g+8 (c[2], c[3])
        const float new_max = fmaxf(row_max[r], tile_row_max(s, r));
        const float max_scaled = scaled_max(new_max, scale_log2);
        const float correction = fast_exp2(row_max[r] * scale_log2 - max_scaled);  // 0 on the first tile
        row_max[r] = new_max;
        row_sum[r] = row_sum[r] * correction + exponentiate_row(s, r, scale_log2, max_scaled);
#pragma unroll
        for (int d = 0; d < D_FRAGS; ++d) {
            o[d][2 * r] *= correction;
            o[d][2 * r + 1] *= correction;
        }
    }
}
// --8<-- [end:softmax_update]

// --8<-- [start:p_as_a]
// P never leaves the registers: the C fragments of S are, pairwise, the A fragment of P·V.
// The A operand of an m16n8k16 covers 16 keys (k = 16·k16 .. 16·k16+15) = two n8 fragments of
// S, s[2·k16] (keys +0..7) and s[2·k16+1] (keys +8..15). Thread (g, t) holds in them:
//   s[2·k16][0..1]   = row g,   keys 2t, 2t+1       ->  a[0] = row g,   k 2t, 2t+1
//   s[2·k16][2..3]   = row g+8, keys 2t, 2t+1       ->  a[1] = row g+8, k 2t, 2t+1
//   s[2·k16+1][0..1] = row g,   keys 8+2t, 8+2t+1   ->  a[2] = row g,   k 2t+8, 2t+9
//   s[2·k16+1][2..3] = row g+8, keys 8+2t, 8+2t+1   ->  a[3] = row g+8, k 2t+8, 2t+9
// Same thread, same rows, same columns: converting to 16 bits and packing pairs is all it takes,
// no shuffle and no trip through shared memory.
template <int N_FRAGS>
__device__ __forceinline__ void p_as_a_operand(const float (&p)[N_FRAGS][4], int k16, unsigned (&a)[4]) {
    a[0] = pack_pair<elem_t>(p[2 * k16][0], p[2 * k16][1]);
    a[1] = pack_pair<elem_t>(p[2 * k16][2], p[2 * k16][3]);
    a[2] = pack_pair<elem_t>(p[2 * k16 + 1][0], p[2 * k16 + 1][1]);
    a[3] = pack_pair<elem_t>(p[2 * k16 + 1][2], p[2 * k16 + 1][3]);
}
// --8<-- [end:p_as_a]

// --8<-- [start:epilogue]
// O = accumulator / row sum, and LSE = scale·max + log(sum), for the warp's 16 rows starting at
// global row `first_row` of this (batch, head); `o_head` and `lse_head` point at its row 0, O's rows
// `o_row_stride` elements apart (a dense head's D, unless the caller's O has another layout).
// Rows >= seq_q (the padding of the last block) are not written.
template <int D_FRAGS>
__device__ __forceinline__ void write_output(const float (&o)[D_FRAGS][4], const float (&row_max)[2],
                                             const float (&row_sum)[2], float scale, elem_t* o_head,
                                             float* lse_head, int first_row, int seq_q, int lane,
                                             int o_row_stride = D_FRAGS * 8) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float sum = quad_sum(row_sum[r]);  // all 32 lanes shuffle, before any lane leaves
        const int row = first_row + lane / 4 + 8 * r;
        if (row >= seq_q) continue;
        const float inv_sum = 1.0f / sum;  // sum >= 1: the row's max term is exp(0)
        elem_t* o_row = o_head + (size_t)row * o_row_stride + 2 * (lane % 4);
#pragma unroll
        for (int d = 0; d < D_FRAGS; ++d)
            *reinterpret_cast<unsigned*>(o_row + 8 * d) =
                pack_pair<elem_t>(o[d][2 * r] * inv_sum, o[d][2 * r + 1] * inv_sum);
        if (lane % 4 == 0) lse_head[row] = row_max[r] * scale + logf(sum);
    }
}
// --8<-- [end:epilogue]
