// Stage 10 — the whole model, v0: the one kernel of its own so far, the residual add fused with RMSNorm.
//
// A pre-norm decoder layer ends each branch with h = h + delta and starts the next with
// a = RMSNorm(h) · weight: two memory-bound passes over [T, hidden] (three in PyTorch: the add, the
// fp32 mean of squares, the scaling), fused here into one block per row that reads h and delta once and
// writes h and a once. The rounding is Hugging Face's, which the library model (reference/model.py) follows:
// h + delta rounded to elem_t, then its RMS and the normalization in fp32, rounded to elem_t, times the
// weight (rounded again).
//
// Tensors: h, delta, normed [rows, hidden], weight [hidden], contiguous; delta may be null (no add: the
// first layer's norm, or the final one). HEAD_DIM is compiled in for the model's attention (the stage's
// later kernels); this kernel does not use it.
#include "attention.cuh"

#define NORM_THREADS 256  // one block per row; block_sum takes any multiple of 32 up to 1024

// --8<-- [start:add_rmsnorm]
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

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
add_rmsnorm(elem_t* h, const elem_t* delta, const elem_t* weight, elem_t* normed, int hidden, float eps) {
    const long long row = (long long)blockIdx.x * hidden;
    float squares = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {  // pass 1: the add, rounded as PyTorch's
        elem_t value = h[row + i];
        if (delta != nullptr) {
            value = from_float<elem_t>(to_float(value) + to_float(delta[row + i]));
            h[row + i] = value;
        }
        const float v = to_float(value);
        squares += v * v;
    }
    // EXERCISE: the row's inverse RMS, 1/sqrt(mean(h²) + eps): add up every thread's `squares` over the
    // block (block_sum), divide by hidden, add eps (rsqrtf gives the inverse square root).
    // STUB: const float inv_rms = 1.0f;
    const float inv_rms = rsqrtf(block_sum(squares) / hidden + eps);
    // END EXERCISE
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {  // pass 2: this thread's own elements, from L1/L2
        const elem_t scaled = from_float<elem_t>(to_float(h[row + i]) * inv_rms);
        normed[row + i] = from_float<elem_t>(to_float(weight[i]) * to_float(scaled));
    }
}
// --8<-- [end:add_rmsnorm]
