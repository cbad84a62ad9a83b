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
// Almost all of the time is the GEMMs (the estimates on paper: docs/stages/stage7.md, where the time goes).
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

#include "cp_async.cuh"
#include "mma.cuh"

constexpr int ROUTER_THREADS = 512;                     // 16 warps: 4 groups of 16 tokens × 4 quarters of the experts
constexpr int ROUTER_TOKENS = 64;                       // tokens per block
constexpr int ROUTER_K = 32;                            // hidden elements per shared-memory chunk: two mma k-steps
constexpr int ROUTER_STAGES = 4;                        // chunks in shared memory: 3 loading while one is used
constexpr int ROUTER_X_STRIDE = ROUTER_K + 8;           // elements per row in shared memory: the 8 rows an
constexpr int ROUTER_W_STRIDE = MAX_EXPERTS + 8;        // ldmatrix reads land in distinct banks

// --8<-- [start:router]
// Router logits, fp32, on the tensor cores: a thin GEMM (E is 8 to 256 columns, hidden 4096 to 7168
// deep; 15 GFLOP at 4096 tokens × 256 experts, a few hundred µs of CUDA cores' FMAs). Block (b, s)
// computes tokens 64b .. 64b+63 × all E experts over the hidden elements [s·per_split, (s+1)·per_split),
// in chunks of 32: x's rows as they are (the A operand, hidden contiguous) and Wr's (the B operand,
// experts contiguous: ldmatrix.trans turns it, as V in stage 2). So little is computed per chunk that
// the loop waits on memory: ROUTER_STAGES chunks are in shared memory, the next three loading by
// cp.async while one is used (stage 3's ring). Warp w holds tokens 16·(w % 4) .. +15 × its quarter of
// the experts, 8·N_FRAGS columns from (w / 4)·8·N_FRAGS, in N_FRAGS fp32 fragments. The tensor cores
// add in fp32 but truncate (not IEEE): summed over 4096 elements in one accumulator, a logit drifted 2e-5
// from the exact one on the H100, twice the routing check's tie tolerance; so each chunk's 32 products
// go into a fresh fragment, added to the running sum in ordinary fp32 (as DeepGEMM promotes its fp8
// sums). With one split (gridDim.y = 1) it writes logits + bias (a null bias adds nothing); with
// several, each writes its partial sums to its own [tokens, E] slice of `out`, and router_sum adds them:
// a few tokens (a 128-token prefill: 2 blocks of 64) would otherwise leave all but two SMs idle while two
// blocks walk all of hidden. The order of the sum is fixed, so the logits, and the routing, are the same
// on every run.
struct RouterShared {
    elem_t xs[ROUTER_TOKENS][ROUTER_X_STRIDE];  // x chunk
    elem_t ws[ROUTER_K][ROUTER_W_STRIDE];       // Wr chunk; columns past E are never stored from
};
constexpr int ROUTER_SHARED_BYTES = ROUTER_STAGES * sizeof(RouterShared);

// One chunk of x and Wr on its way into shared memory (cp.async); rows past `tokens` or `hidden` as
// zeros (0 · garbage could be NaN). hidden % 8 == 0: x in 16-byte vectors; Wr too when E % 8 == 0, else
// element by element, stored by the threads themselves (also visible after the loop's barrier).
__device__ void router_load_chunk(const elem_t* __restrict__ x, const elem_t* __restrict__ wr, int token0, int k0,
                                  int tokens, int hidden, int experts, RouterShared& sh) {
    if (threadIdx.x < ROUTER_TOKENS * ROUTER_K / 8) {  // x: a 16-byte vector per thread
        const int t = threadIdx.x / 4, k = 8 * (threadIdx.x % 4);
        const bool inside = token0 + t < tokens && k0 + k < hidden;
        cp_async_16(shared_address(&sh.xs[t][k]), inside ? x + (size_t)(token0 + t) * hidden + k0 + k : x, inside);
    }
    if (experts % 8 == 0) {
        const int vectors = experts / 8;
        for (int i = threadIdx.x; i < ROUTER_K * vectors; i += ROUTER_THREADS) {
            const int k = i / vectors, e = 8 * (i % vectors);
            const bool inside = k0 + k < hidden;
            cp_async_16(shared_address(&sh.ws[k][e]), inside ? wr + (size_t)(k0 + k) * experts + e : wr, inside);
        }
    } else {  // 16-bit values as bits: zero is 0 in both element types
        const auto* bits = reinterpret_cast<const unsigned short*>(wr);
        auto* ws = reinterpret_cast<unsigned short(*)[ROUTER_W_STRIDE]>(sh.ws);
        for (int i = threadIdx.x; i < ROUTER_K * experts; i += ROUTER_THREADS) {
            const int k = i / experts, e = i % experts;
            ws[k][e] = k0 + k < hidden ? bits[(size_t)(k0 + k) * experts + e] : 0;
        }
    }
}

// chunk[16 × 8·N_FRAGS] = this warp's tokens × experts over one staged chunk of hidden.
template <int N_FRAGS>
__device__ void router_chunk_mma(const RouterShared& sh, int row0, int column0, int lane, float (&chunk)[N_FRAGS][4]) {
#pragma unroll 1  // one k-step's operands in registers at a time: 512 threads leave 128 registers each
    for (int kk = 0; kk < ROUTER_K / 16; ++kk) {
        unsigned a[4];
        ldmatrix_x4(a, shared_address(&sh.xs[row0 + a_order_row(lane)][16 * kk + 8 * a_order_chunk(lane)]));
#pragma unroll
        for (int n16 = 0; n16 < N_FRAGS / 2; ++n16) {
            unsigned b[4];  // b[0], b[1] of experts +0..7, then b[0], b[1] of experts +8..15
            ldmatrix_x4_trans(b, shared_address(&sh.ws[16 * kk + a_order_row(lane)]
                                                      [column0 + 16 * n16 + 8 * a_order_chunk(lane)]));
            mma_m16n8k16<elem_t>(chunk[2 * n16], a, b[0], b[1]);
            mma_m16n8k16<elem_t>(chunk[2 * n16 + 1], a, b[2], b[3]);
        }
    }
}

template <int N_FRAGS>
__device__ void router_tile(const elem_t* __restrict__ x, const elem_t* __restrict__ wr, const float* __restrict__ bias,
                            float* __restrict__ out, int tokens, int hidden, int experts, int per_split,
                            RouterShared* ring) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = 16 * (warp % 4), column0 = warp / 4 * 8 * N_FRAGS;  // the warp's tokens and experts
    const int token0 = blockIdx.x * ROUTER_TOKENS;
    const int k_begin = blockIdx.y * per_split, k_end = min(hidden, k_begin + per_split);
    const int chunks = (k_end - k_begin + ROUTER_K - 1) / ROUTER_K;
    float* logits = out + (size_t)blockIdx.y * tokens * experts;  // this split's slice
    for (int c = 0; c < ROUTER_STAGES - 1; ++c) {  // the ring's first chunks, a cp.async group each
        if (c < chunks) router_load_chunk(x, wr, token0, k_begin + c * ROUTER_K, tokens, hidden, experts, ring[c]);
        cp_async_commit();
    }
    float acc[N_FRAGS][4] = {};
    for (int c = 0; c < chunks; ++c) {
        cp_async_wait<ROUTER_STAGES - 2>();  // chunk c is in (this thread's copies) ...
        __syncthreads();                     // ... everyone's, and nobody still reads chunk c - 1's buffer
        const int next = c + ROUTER_STAGES - 1;
        if (next < chunks)
            router_load_chunk(x, wr, token0, k_begin + next * ROUTER_K, tokens, hidden, experts,
                              ring[next % ROUTER_STAGES]);
        cp_async_commit();
        if (column0 < experts) {  // with few experts the last quarters have none
            float chunk[N_FRAGS][4] = {};
            router_chunk_mma<N_FRAGS>(ring[c % ROUTER_STAGES], row0, column0, lane, chunk);
#pragma unroll
            for (int f = 0; f < N_FRAGS; ++f)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[f][i] += chunk[f][i];
        }
    }
    // Fragment f, register 2r + c: token row0 + lane / 4 + 8r, expert column0 + 8f + 2·(lane % 4) + c.
#pragma unroll
    for (int f = 0; f < N_FRAGS; ++f) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int t = token0 + row0 + lane / 4 + 8 * r, e = column0 + 8 * f + 2 * (lane % 4) + c;
                if (t < tokens && e < experts)  // bias by __ldg: the kernel's struct cannot say __restrict__
                    logits[(size_t)t * experts + e] =
                        acc[f][2 * r + c] + (gridDim.y == 1 && bias ? __ldg(bias + e) : 0.0f);
            }
        }
    }
}

// N_FRAGS = 8-column fragments per warp: a quarter of E, rounded up to a power of two of at least 16
// columns (ldmatrix.trans reads 16), so that few variants are compiled.
// Its parameters: moe.cuh's RouterParams (stage 11 compiles this kernel too); p.per_split: hidden elements
// per split, a multiple of ROUTER_K (the launch rounds it). Dynamic shared memory: ROUTER_SHARED_BYTES.
extern "C" __global__ void __launch_bounds__(ROUTER_THREADS)
router_logits(const __grid_constant__ RouterParams p) {
    extern __shared__ __align__(16) unsigned char router_shared[];
    RouterShared* ring = reinterpret_cast<RouterShared*>(router_shared);
    if (p.experts <= 64) router_tile<2>(p.x, p.wr, p.bias, p.out, p.tokens, p.hidden, p.experts, p.per_split, ring);
    else if (p.experts <= 128)
        router_tile<4>(p.x, p.wr, p.bias, p.out, p.tokens, p.hidden, p.experts, p.per_split, ring);
    else router_tile<8>(p.x, p.wr, p.bias, p.out, p.tokens, p.hidden, p.experts, p.per_split, ring);
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
// tile; docs/notebook/stage6.md). One block per row of the capacity; the rows past offsets[E] (unused this
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
