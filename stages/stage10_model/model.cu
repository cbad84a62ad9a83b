// Stage 10 — the whole model: the small kernels that stand between the course's big ones.
//
// A decoder layer is mostly matrix products (cuBLAS here: stage 6 is a grouped GEMM, not a dense one),
// attention (stage 4 / 3) and, in the MoE model, stage 7's layer. Between them PyTorch would launch
// a chain of small memory-bound kernels, each reading and writing whole [tokens, width] tensors:
// the residual add, RMSNorm's mean of squares and scaling, the split of the fused QKV projection into
// heads, RoPE's multiplies, rotate-half and add, SwiGLU's SiLU and product. Each kernel below does
// one of those chains in a single pass: read once, write once.
//
// Rounding: each kernel computes in fp32 and rounds its results once, where PyTorch (and the library
// model, reference/model.py) rounds after every operation; the exceptions, kept to follow Hugging
// Face's RMSNorm exactly, are said in add_rmsnorm.
//
// Tensors are contiguous, token t = b·S + s the row of every [tokens, width] tensor. HEAD_DIM is
// compiled in (the grader passes the model's head dimension).
#include "attention.cuh"

#define ROPE_THREADS 256  // a thread per VECTOR pairs of a query or key head
#define SWIGLU_THREADS 256
#define VECTOR 8          // elements a thread moves at once: 16 bytes

// VECTOR neighbouring elements, moved as one 16-byte load or store.
struct __align__(2 * VECTOR) Vector {
    elem_t e[VECTOR];
};
static_assert(sizeof(Vector) == sizeof(uint4), "a Vector is one 16-byte load");

// A Vector read with __ldg, the read-only load (a pointer in a kernel's parameter struct is not __restrict__).
__device__ __forceinline__ Vector load_read_only(const elem_t* from) {
    const uint4 bits = __ldg(reinterpret_cast<const uint4*>(from));
    return *reinterpret_cast<const Vector*>(&bits);
}

// --8<-- [start:add_rmsnorm]
// A pre-norm layer ends each branch with h = h + delta and starts the next with a = RMSNorm(h) · weight:
// one block per row reads h and delta once and writes h and a once (PyTorch: the add, the fp32 mean of
// squares, the scaling, the weight: four passes), each thread VECTOR neighbouring elements of the row,
// kept in registers between the two halves. Rounded as Hugging Face's RMSNorm, which the library model
// follows: h + delta rounded to elem_t, its RMS and the normalization in fp32, rounded to elem_t, times
// the weight, rounded again. delta may be null (no add: the first layer's norm). The launch gives a block
// hidden / VECTOR threads rounded up to whole warps.
__device__ float block_sum(float value) {
    __shared__ float partial[32];  // one slot per warp
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
    if (lane == 0) partial[warp] = value;
    __syncthreads();
    value = lane < blockDim.x / 32 ? partial[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;  // every thread holds the block's sum
}

extern "C" __global__ void __launch_bounds__(1024)
add_rmsnorm(elem_t* h, const elem_t* delta, const elem_t* weight, elem_t* normed, int hidden, float eps) {
    const int i = threadIdx.x * VECTOR;  // this thread's first element of the row
    const bool mine = i < hidden;        // (the last warp may reach past the row)
    const long long at = (long long)blockIdx.x * hidden + i;
    // EXERCISE: the fused add and the row's inverse RMS, in one pass over this thread's VECTOR elements of
    // the row (16 bytes at h + at; none where !mine). Load them as one Vector; where delta is not null, add
    // delta's, each sum rounded to elem_t (from_float) as PyTorch's add rounds it, and store the sums to h.
    // Keep the row in registers for the scaling below: float x[VECTOR], h's values through to_float; add
    // up their squares. Then inv_rms = 1/sqrt(mean(h²) + eps): every thread's sum of squares added over
    // the block (block_sum, which every thread of the block calls and gets the total from, `mine` or not),
    // over hidden, plus eps, through rsqrtf.
    // STUB: float x[VECTOR] = {};  // nothing loaded, nothing added: normed comes out 0
    // STUB: const float inv_rms = 1.0f;
    float x[VECTOR];
    float squares = 0.0f;
    if (mine) {
        Vector value = *reinterpret_cast<const Vector*>(h + at);
        if (delta != nullptr) {  // the add, rounded as PyTorch's
            const Vector d = *reinterpret_cast<const Vector*>(delta + at);
#pragma unroll
            for (int j = 0; j < VECTOR; ++j) value.e[j] = from_float<elem_t>(to_float(value.e[j]) + to_float(d.e[j]));
            *reinterpret_cast<Vector*>(h + at) = value;
        }
#pragma unroll
        for (int j = 0; j < VECTOR; ++j) {
            x[j] = to_float(value.e[j]);
            squares += x[j] * x[j];
        }
    }
    const float inv_rms = rsqrtf(block_sum(squares) / hidden + eps);
    // END EXERCISE
    if (mine) {
        const Vector w = *reinterpret_cast<const Vector*>(weight + i);
        Vector out;
#pragma unroll
        for (int j = 0; j < VECTOR; ++j)
            out.e[j] = from_float<elem_t>(to_float(w.e[j]) * to_float(from_float<elem_t>(x[j] * inv_rms)));
        *reinterpret_cast<Vector*>(normed + at) = out;
    }
}
// --8<-- [end:add_rmsnorm]

// --8<-- [start:rope_split]
// qkv [tokens, (H + 2·KV)·D], the fused projection's output (H query heads, then KV key heads, then KV
// value heads) -> q [B, H, S, D] and k [B, KV, S, D], the attention's layout, turned by RoPE. The values
// are not moved: the attention reads them where they lie (a strided view of qkv).
// RoPE, Hugging Face's rotate-half form: for i < D/2, the pair (x_i, x_{i+D/2}) turns by the angle of
// position s and frequency i, so a thread handles elements i and their partners i + D/2 together:
//     out_i       = x_i · cos − x_{i+D/2} · sin        out_{i+D/2} = x_{i+D/2} · cos + x_i · sin
// cos and sin [S, D] are the library's tables (rounded to elem_t; both halves equal). A thread takes VECTOR
// neighbouring i (16-byte loads and stores), over one flat grid of every token's query and key heads:
// a short prompt's few tokens still fill the GPU. Its parameters (__init__.py's RopeParams packs them): the
// tensors, the sequence length, the heads of q and of k, and `items`, the work items of the flat grid.
struct RopeParams {
    const elem_t *qkv, *cos, *sin;
    elem_t *q, *k;
    int seq, heads, kv_heads;
    long long items;
};

extern "C" __global__ void __launch_bounds__(ROPE_THREADS)
rope_split(const __grid_constant__ RopeParams p) {
    constexpr int HALF = HEAD_DIM / 2, VECTORS = HALF / VECTOR;  // a head's work items
    const long long item = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (item >= p.items) return;
    const int turned = p.heads + p.kv_heads;  // the heads RoPE turns: the queries', then the keys'
    const long long token = item / (turned * VECTORS);
    const int rest = (int)(item % (turned * VECTORS)), head = rest / VECTORS, i = VECTOR * (rest % VECTORS);
    const int b = (int)(token / p.seq), s = (int)(token % p.seq);
    const elem_t* x = p.qkv + (token * (turned + p.kv_heads) + head) * HEAD_DIM + i;
    elem_t* to = head < p.heads ? p.q + (((long long)b * p.heads + head) * p.seq + s) * HEAD_DIM + i
                                : p.k + (((long long)b * p.kv_heads + head - p.heads) * p.seq + s) * HEAD_DIM + i;
    const Vector x1 = load_read_only(x), x2 = load_read_only(x + HALF);
    const Vector c = load_read_only(p.cos + s * HEAD_DIM + i);
    const Vector n = load_read_only(p.sin + s * HEAD_DIM + i);
    Vector out1, out2;
#pragma unroll
    for (int j = 0; j < VECTOR; ++j) {
        const float a = to_float(x1.e[j]), b2 = to_float(x2.e[j]), cj = to_float(c.e[j]), nj = to_float(n.e[j]);
        out1.e[j] = from_float<elem_t>(a * cj - b2 * nj);
        out2.e[j] = from_float<elem_t>(b2 * cj + a * nj);
    }
    *reinterpret_cast<Vector*>(to) = out1;
    *reinterpret_cast<Vector*>(to + HALF) = out2;
}
// --8<-- [end:rope_split]

// --8<-- [start:swiglu]
// act [tokens, I] = SiLU(gate) · up, from the MLP's first projection g [tokens, 2·I] (gate columns, then
// up columns): SiLU(x) = x / (1 + e^-x). A thread per VECTOR neighbouring columns.
extern "C" __global__ void __launch_bounds__(SWIGLU_THREADS)
swiglu(const elem_t* __restrict__ g, elem_t* __restrict__ act, int inter, long long vectors) {
    const long long v = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (v >= vectors) return;
    const int vectors_per_row = inter / VECTOR;
    const long long token = v / vectors_per_row;
    const int column = VECTOR * (int)(v % vectors_per_row);
    const elem_t* row = g + token * 2 * inter;
    const Vector gate = *reinterpret_cast<const Vector*>(row + column);
    const Vector up = *reinterpret_cast<const Vector*>(row + inter + column);
    Vector out;
#pragma unroll
    for (int j = 0; j < VECTOR; ++j) {
        const float x = to_float(gate.e[j]);
        out.e[j] = from_float<elem_t>(x / (1.0f + __expf(-x)) * to_float(up.e[j]));
    }
    *reinterpret_cast<Vector*>(act + token * inter + column) = out;
}
// --8<-- [end:swiglu]
