// What the MoE kernels share: the element type (that of attention.cuh: the grader compiles every
// kernel with -DELEM_T=__half or __nv_bfloat16), the limits of the routing (stages/common/moe.py
// declares them to the grader), 16-byte vectors of elem_t converted to and from fp32 with bit
// operations, so that they never leave registers, the experts' activation, and the parameter structs
// of the kernels that several stages compile (moe.py's classes pack them: the grader checks that
// both agree).
#pragma once
#include "attention.cuh"

#define MAX_EXPERTS 256    // a lane of a warp holds at most MAX_EXPERTS / 32 logits of a token
#define MAX_TOP_K 8
#define FULL_MASK 0xffffffffu

// The 16 bits of an element, and back.
__device__ __forceinline__ unsigned short elem_bits(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ unsigned short elem_bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }

template <typename T> __device__ __forceinline__ float bits_to_float(unsigned bits);
template <> __device__ __forceinline__ float bits_to_float<__half>(unsigned bits) {
    return __half2float(__ushort_as_half((unsigned short)bits));
}
template <> __device__ __forceinline__ float bits_to_float<__nv_bfloat16>(unsigned bits) {
    return __uint_as_float(bits << 16);  // a bfloat16 is the top half of a float
}

// 8 consecutive elements (16 bytes, so `p` must be 16-byte aligned) as fp32, in one load.
__device__ __forceinline__ void load8(const elem_t* p, float (&out)[8]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = bits_to_float<elem_t>(words[i] & 0xffffu);  // the lower address in the low half
        out[2 * i + 1] = bits_to_float<elem_t>(words[i] >> 16);
    }
}

// 8 fp32 values rounded to elem_t and stored in one 16-byte store.
__device__ __forceinline__ void store8(elem_t* p, const float (&in)[8]) {
    unsigned words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        words[i] = elem_bits(from_float<elem_t>(in[2 * i])) | ((unsigned)elem_bits(from_float<elem_t>(in[2 * i + 1])) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
}

// SiLU, the gate's activation in an expert's SwiGLU: silu(gate) · up.
__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

// A pointer in a struct is not __restrict__ to the compiler: what a kernel streams read-only through one,
// it reads with __ldg, the read-only loads a __restrict__ parameter would get.

// moe_topk's (stage 5's routing.cu): the fp32 logits [T, E] in; each token-slot's expert, weight and rank
// among its expert's slots out; expert_counts and prob_sums [E], zero before the launch, added to.
struct TopkParams {
    const float* logits;
    int* topk_ids;
    float* topk_weights;
    int *rank, *expert_counts;
    float* prob_sums;
    int tokens, experts, top_k, group, tokens_per_group;
};

// moe_align's (routing.cu): moe_topk's counts and probability sums in; the counts, the offsets [E + 1]
// padded to `block`, -1 in source_token's padding rows (`rows` of them in all), and the balance loss
// (its coefficient alpha) and usage variance out.
struct AlignParams {
    const int* counts;
    const float* prob_sums;
    int *expert_counts, *expert_offsets, *source_token;
    float *aux_loss, *usage_var;
    int tokens, experts, top_k, block, rows;
    float alpha;
};

// The grouped GEMMs' besides their operands (stage 6's experts.cu and its ladder's grouped.cuh), one for
// the up and the down kernel: the experts' padded offsets [E + 1], E, the intermediate and hidden sizes
// (the up GEMM's n and k, the down GEMM's k and n).
struct ExpertParams {
    const int* offsets;
    int experts, inter, hidden;
};

// router_logits' (stage 7's layer.cu): x [T, hidden], Wr [hidden, E] and the bias [E] (null: none) in;
// out, the logits [T, E] or, with hidden split, each split's partial sums [splits, T, E]; per_split:
// hidden elements per split.
struct RouterParams {
    const elem_t *x, *wr;
    const float* bias;
    float* out;
    int tokens, hidden, experts, per_split;
};
