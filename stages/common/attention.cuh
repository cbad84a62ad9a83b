// What every attention kernel of the course shares: the element type and its conversions.
//
// The grader compiles each kernel once per element type with -DELEM_T=__half or
// -DELEM_T=__nv_bfloat16 (and, for most stages, -DHEAD_DIM=64 or 128), so a kernel is
// written once, for `elem_t`, and every loop over the head dimension has a compile-time bound.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef ELEM_T
#define ELEM_T __half
#endif
typedef ELEM_T elem_t;

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// NVRTC has no <math.h>: define the one constant of it we use.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// log2(e): kernels that compute exp(x) as exp2(x * LOG2E) use the fast ex2 instruction.
#define LOG2E 1.4426950408889634f

// Rows of a [B, H, S, D] tensor of any strides with D contiguous -- a dense one, a model's [B, S, H, D]
// buffer seen as [B, H, S, D], a slice of a fused QKV projection: row s of (batch, head) pair
// p = b·heads + h at data + b·batch_stride + h·head_stride + s·row_stride (in elements).
template <typename T>
struct HeadRows {
    T* data;
    long long batch_stride, head_stride;
    int row_stride, heads;
    __device__ T* row(int pair, int s) const {
        return data + (pair / heads) * batch_stride + (pair % heads) * head_stride + (long long)s * row_stride;
    }
};
