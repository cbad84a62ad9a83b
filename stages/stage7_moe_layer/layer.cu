// Stage 7 — the whole MoE layer from the course's kernels. sm_90a (stage 6's GEMMs).
//
// out = Σ_j w[t, j] · SwiGLU-FFN_{ids[t, j]}(x[t]), in eight launches (nine when the router splits) and no
// host synchronization:
//   router_logits      logits = x · Wr + bias in fp32                         (here; with few tokens,
//   router_sum         split over hidden into partial sums, then their sum)
//   moe_topk, moe_align, moe_scatter   top-k, padded offsets, permutation     (stage 5)
//   gather_rows        x_perm[r] = x[source_token[r]] (padding: a copy)       (here)
//   expert_up_swiglu, expert_down      the grouped GEMMs                      (stage 6)
//   moe_combine        out[t] = Σ_j w[t, j] · y_perm[dest[t, j]]              (stage 5)
// Every launch is sized from what the host knows without looking at the routing: T, E, k and the
// padded capacity T·k + E·(BLOCK_M - 1) of the permuted buffers. The GEMMs read the offsets on the
// device; gather_rows skips the rows past offsets[E].
//
// Almost all of the time is the GEMMs (the estimates on paper: results/NOTES.md).
// Not fused, and why: the gather into the up GEMM's A loads needs a TMA gather (Blackwell has one,
// Hopper does not; cp.async gathers would cost the producer warp its simplicity) for 1.4% of the
// time; the combine into the down GEMM's epilogue needs fp32 atomics into an fp32 copy of out (k
// experts add to each token) for ~1%.
#include "stage5_moe_routing/routing.cu"
#ifdef MMA_SYNC_EXPERTS  // the layer's mma_sync rung (sm_80+): stage 6's mma.sync GEMMs, for GPUs without wgmma
#include "stage6_grouped_gemm/ladder/mma_sync.cu"
#else
#include "stage6_grouped_gemm/experts.cu"
#endif

constexpr int ROUTER_THREADS = 256;                     // 16 token groups × 16 expert groups
constexpr int ROUTER_TOKENS = 64;                       // tokens per block: 4 per thread
constexpr int ROUTER_K = 32;                            // hidden elements per shared-memory chunk

// --8<-- [start:router]
// Router logits, fp32: block (b, s) computes tokens 64b .. 64b+63 × all E experts over the hidden
// elements [s·per_split, (s+1)·per_split). Thread (token group tg, expert group eg) accumulates tokens
// 4tg .. 4tg+3 × experts eg, eg + 16, ... (EPT of them) -- a 4 × EPT register tile, as stage 1's -- over
// chunks of 32 hidden elements staged in shared memory in fp32 (x transposed, so that a thread's 4
// tokens are one float4). With one split (gridDim.y = 1) it writes logits + bias (a null bias adds
// nothing); with several, each writes its partial sums to its own [tokens, E] slice of `out`, and
// router_sum adds them: a few tokens (a 128-token prefill: 2 blocks of 64) would otherwise leave all but
// two SMs idle while two blocks walk all of hidden, chunk after chunk, each chunk a round trip to
// memory. The order of the sum is fixed, so the logits, and the routing, are the same on every run.
struct RouterShared {
    float xs[ROUTER_K][ROUTER_TOKENS];  // x chunk, transposed
    float ws[ROUTER_K][MAX_EXPERTS];    // Wr chunk
};

template <int EPT>
__device__ void router_tile(const elem_t* __restrict__ x, const elem_t* __restrict__ wr, const float* __restrict__ bias,
                            float* __restrict__ out, int tokens, int hidden, int experts, int per_split,
                            RouterShared& sh) {
    auto& xs = sh.xs;
    auto& ws = sh.ws;
    const int tg = threadIdx.x / 16, eg = threadIdx.x % 16, token0 = blockIdx.x * ROUTER_TOKENS;
    const int k_begin = blockIdx.y * per_split, k_end = min(hidden, k_begin + per_split);
    float* logits = out + (size_t)blockIdx.y * tokens * experts;  // this split's slice
    float acc[4][EPT] = {};
    for (int k0 = k_begin; k0 < k_end; k0 += ROUTER_K) {
        {   // x: 64 tokens × 32 elements = 256 vectors of 8, one per thread (hidden % 8 == 0)
            const int t = threadIdx.x / 4, k = 8 * (threadIdx.x % 4);
            float v[8] = {};
            if (token0 + t < tokens && k0 + k < hidden) load8(x + (size_t)(token0 + t) * hidden + k0 + k, v);
#pragma unroll
            for (int i = 0; i < 8; ++i) xs[k + i][t] = v[i];
        }
        for (int i = threadIdx.x; i < ROUTER_K * experts; i += ROUTER_THREADS) {
            const int k = i / experts, e = i % experts;
            ws[k][e] = k0 + k < hidden ? to_float(wr[(size_t)(k0 + k) * experts + e]) : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < ROUTER_K; ++k) {
            const float4 xv = *reinterpret_cast<const float4*>(&xs[k][4 * tg]);
            const float xk[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
            for (int j = 0; j < EPT; ++j) {
                const float w = ws[k][eg + 16 * j];  // columns past E: stale, never stored
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[i][j] = fmaf(xk[i], w, acc[i][j]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int t = token0 + 4 * tg + i;
#pragma unroll
        for (int j = 0; j < EPT; ++j) {
            const int e = eg + 16 * j;
            if (t < tokens && e < experts)
                logits[(size_t)t * experts + e] = acc[i][j] + (gridDim.y == 1 && bias ? bias[e] : 0.0f);
        }
    }
}

// EPT = experts per thread, rounded up to a power of two so that few variants are compiled and no
// thread runs idle multiply-adds for experts that do not exist (E = 32: EPT = 2, not 16).
// per_split: hidden elements per split, a multiple of ROUTER_K (the launch rounds it).
extern "C" __global__ void __launch_bounds__(ROUTER_THREADS)
router_logits(const elem_t* __restrict__ x, const elem_t* __restrict__ wr, const float* __restrict__ bias,
              float* __restrict__ out, int tokens, int hidden, int experts, int per_split) {
    __shared__ __align__(16) RouterShared sh;  // 40 KB
    const int per_thread = (experts + 15) / 16;
    if (per_thread <= 1) router_tile<1>(x, wr, bias, out, tokens, hidden, experts, per_split, sh);
    else if (per_thread <= 2) router_tile<2>(x, wr, bias, out, tokens, hidden, experts, per_split, sh);
    else if (per_thread <= 4) router_tile<4>(x, wr, bias, out, tokens, hidden, experts, per_split, sh);
    else if (per_thread <= 8) router_tile<8>(x, wr, bias, out, tokens, hidden, experts, per_split, sh);
    else router_tile<16>(x, wr, bias, out, tokens, hidden, experts, per_split, sh);
}

// logits[t, e] = bias[e] + the splits' partial sums of (t, e): a warp per logit, lane l adding splits l,
// l + 32, ... in order, then the 32 lane sums in a fixed tree (the shuffles), so that every run adds in
// the same order; the lanes' loads are all in flight at once (a thread walking 128 splits would wait on
// 128 loads one after the other).
extern "C" __global__ void router_sum(const float* __restrict__ partials, const float* __restrict__ bias,
                                      float* __restrict__ logits, int tokens, int experts, int splits) {
    const int i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (i >= tokens * experts) return;  // the whole warp: i is the same for its lanes
    float sum = 0.0f;
    for (int s = lane; s < splits; s += 32) sum += partials[(size_t)s * tokens * experts + i];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) logits[i] = sum + (bias ? bias[i % experts] : 0.0f);
}
// --8<-- [end:router]

// --8<-- [start:gather]
// The permutation applied: row r of x_perm is token source_token[r]'s x. A padding row (source_token
// -1) repeats the first token-slot of its segment: its outputs are never read, but zeros there -- the
// obvious choice -- ran stage 6's tensor cores at half speed on the H100 (a few all-zero rows in a
// tile; results/NOTES.md). One block per row of the capacity; the rows past offsets[E] (unused this
// time) return at once. 16-byte vectors.
extern "C" __global__ void gather_rows(const elem_t* __restrict__ x, const int* __restrict__ source_token,
                                       const int* __restrict__ expert_offsets, int experts,
                                       elem_t* __restrict__ x_perm, int hidden) {
    const int row = blockIdx.x;
    if (row >= expert_offsets[experts]) return;
    // EXERCISE: copy token source_token[row]'s row of x into row `row` of x_perm, 8 elements (one
    // uint4) per thread and step; a padding row (source_token -1) takes the token of its segment's
    // first row, expert_offsets[e] for the expert e whose segment holds `row` (a segment starts with
    // its token-slots; a binary search over the offsets, as stage 6's scheduler finds a tile's expert).
    // STUB: return;
    int token = source_token[row];
    if (token < 0) {
        int lo = 0, hi = experts - 1;  // the last e with expert_offsets[e] <= row (empty segments skipped)
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (expert_offsets[mid] <= row) lo = mid;
            else hi = mid - 1;
        }
        token = source_token[expert_offsets[lo]];
    }
    uint4* to = reinterpret_cast<uint4*>(x_perm + (size_t)row * hidden);
    const uint4* from = reinterpret_cast<const uint4*>(x + (size_t)token * hidden);
    for (int v = threadIdx.x; v < hidden / 8; v += blockDim.x) to[v] = from[v];
    // END EXERCISE
}
// --8<-- [end:gather]
