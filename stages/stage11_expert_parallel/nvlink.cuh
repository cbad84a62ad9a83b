// Stage 11 over NVLink: dispatch and combine by the course's own kernels, as DeepEP does within a node.
// Every rank maps its peers' buffers (PyTorch's symmetric memory: nvlink.py), so a kernel stores a token's
// row straight into the rank that owns its expert, at the row where that rank's grouped GEMMs read it:
// no all-to-all, no regroup, and no host synchronization (nothing the host must read before it goes on).
//
//   ep_plan          one block: this rank's counts [E] into every peer's table, a flag per peer, then
//                    (all tables in) where each expert's rows start on its rank: shift, and this rank's
//                    segment offsets for its GEMMs
//   ep_dispatch      a warp per token: its row read once, stored into its k experts' ranks; each block
//                    then adds 1 to an arrival count per peer
//   signal_and_wait  one block: a flag to every peer (optional), then every peer's flag awaited
//   (stage 6's GEMMs on the grouped rows, into the results buffer that peers read)
//   ep_combine       a block per token: its k results read from the ranks that computed them
//
// Flags hold the call's epoch (1, 2, ...; counts: epoch × blocks), so that nothing is ever reset.
// Reuse is safe without more flags: a rank overwrites a peer's buffers in call n + 1 only after its
// combine of call n, which waited for that peer's results of call n, which came after the peer had read
// its rows and tables of call n.
#pragma once

#define MAX_RANKS 8              // the GPUs of one node
#define PEER_THREADS 256         // ep_plan: a thread per expert (MAX_EXPERTS); signal_and_wait: a rank each
#define DISPATCH_THREADS 256     // ep_dispatch: 8 warps, a token each at a time
#define WAIT_TIMEOUT_NS 5000000000ull  // 5 s: a flag that has not come by then never will (a peer failed)

// The control buffer, ints, one per rank, mapped by every peer (nvlink.py allocates CONTROL_INTS).
#define TABLE 0                                  // [MAX_RANKS][MAX_EXPERTS]: each source rank's counts
#define PLANNED (MAX_RANKS * MAX_EXPERTS)        // [MAX_RANKS] the epoch of the source's table
#define ARRIVED (PLANNED + MAX_RANKS)            // [MAX_RANKS] the source's dispatch blocks done, cumulated
#define READY (ARRIVED + MAX_RANKS)              // [MAX_RANKS] the epoch of the peer's results
#define TIMED_OUT (READY + MAX_RANKS)            // set when a wait gave up
#define CONTROL_INTS (TIMED_OUT + 1)

__device__ __forceinline__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release(int* p, int v) {
    asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Spins until *flag >= value; after WAIT_TIMEOUT_NS gives up and says so in control[TIMED_OUT] (the host
// reads it), rather than hang every rank on a peer that will never come.
__device__ void wait_at_least(const int* flag, int value, int* control) {
    const unsigned long long start = global_ns();
    while (load_acquire(flag) < value) {
        if (global_ns() - start > WAIT_TIMEOUT_NS) {
            atomicExch(control + TIMED_OUT, 1);
            return;
        }
    }
}

__device__ __forceinline__ int* peer_ints(const long long* peers, int rank) {
    return reinterpret_cast<int*>(peers[rank]);
}

// --8<-- [start:plan]
// counts[E]: this rank's token-slots per expert (stage 5, unpadded). Writes shift[e]: what to add to a
// token-slot's row in this rank's expert order (stage 5's dest) to get its row on the rank that owns e,
// whose grouped rows hold expert e's segment (padded to `align`) with the sources' rows end to end by
// rank; and offsets[E_l + 1], this rank's own segments, for its GEMMs.
extern "C" __global__ void __launch_bounds__(PEER_THREADS)
ep_plan(const int* __restrict__ counts, const long long* __restrict__ control_peers, int* control, int rank,
        int world, int experts, int align, int epoch, int* __restrict__ shift, int* __restrict__ offsets) {
    __shared__ int start[MAX_EXPERTS];   // where expert e's segment starts on its rank
    __shared__ int before[MAX_EXPERTS];  // expert e's rows from ranks before this one
    __shared__ int first[MAX_EXPERTS];   // where e's token-slots start in this rank's expert order
    const int e = threadIdx.x, local = experts / world;
    for (int d = 0; d < world && e < experts; ++d)
        peer_ints(control_peers, d)[TABLE + rank * MAX_EXPERTS + e] = counts[e];
    __syncthreads();
    if (e < world) {
        __threadfence_system();
        store_release(peer_ints(control_peers, e) + PLANNED + rank, epoch);
        wait_at_least(control + PLANNED + e, epoch, control);
    }
    __syncthreads();
    if (e < experts) {
        const volatile int* table = control + TABLE;
        int rows = 0, mine = 0;
        for (int s = 0; s < world; ++s) {
            const int n = table[s * MAX_EXPERTS + e];
            mine = s == rank ? rows : mine;
            rows += n;
        }
        before[e] = mine;
        start[e] = (rows + align - 1) / align * align;  // the padded segment's length, summed below
        first[e] = table[rank * MAX_EXPERTS + e];
    }
    __syncthreads();
    if (e < world) {  // each rank's segments, end to end from 0
        int at = 0;
        for (int i = e * local; i < (e + 1) * local; ++i) {
            const int length = start[i];
            start[i] = at;
            at += length;
        }
        if (e == rank) offsets[local] = at;
    }
    if (e == MAX_RANKS) {
        int at = 0;
        for (int i = 0; i < experts; ++i) {
            const int n = first[i];
            first[i] = at;
            at += n;
        }
    }
    __syncthreads();
    if (e < experts) shift[e] = start[e] + before[e] - first[e];
    if (e < local) offsets[e] = start[rank * local + e];
}
// --8<-- [end:plan]

// --8<-- [start:dispatch]
// A warp per token: lane j < k finds slot j's rank and row there (slot_row, for the combine); then the
// warp reads the row 16 bytes a lane at a time and stores each vector into the k ranks' grouped rows.
// The stores to a peer go over NVLink and nothing waits for them; each block then fences and adds 1 to
// its arrival count on every peer.
extern "C" __global__ void __launch_bounds__(DISPATCH_THREADS)
ep_dispatch(const elem_t* __restrict__ x, const int* __restrict__ topk_ids, const int* __restrict__ dest,
            const int* __restrict__ shift, const long long* __restrict__ rows_peers,
            const long long* __restrict__ control_peers, int* __restrict__ slot_row, int tokens, int hidden,
            int top_k, int local, int rank, int world) {
    const int lane = threadIdx.x % 32, warps = gridDim.x * DISPATCH_THREADS / 32;
    for (int t = (blockIdx.x * DISPATCH_THREADS + threadIdx.x) / 32; t < tokens; t += warps) {
        int to = 0, row = 0;
        if (lane < top_k) {
            const int expert = topk_ids[t * top_k + lane];
            to = expert / local;
            row = dest[t * top_k + lane] + shift[expert];
            slot_row[t * top_k + lane] = row;
        }
        uint4* target[MAX_TOP_K];  // slot j's row on its rank, in every lane
#pragma unroll
        for (int j = 0; j < MAX_TOP_K; ++j) {
            const int d = __shfl_sync(FULL_MASK, to, j), r = __shfl_sync(FULL_MASK, row, j);
            target[j] = reinterpret_cast<uint4*>(reinterpret_cast<elem_t*>(rows_peers[d]) + (size_t)r * hidden);
        }
        const uint4* source = reinterpret_cast<const uint4*>(x + (size_t)t * hidden);
        for (int c = lane; c < hidden / 8; c += 32) {
            const uint4 v = source[c];
#pragma unroll
            for (int j = 0; j < MAX_TOP_K; ++j)
                if (j < top_k) target[j][c] = v;
        }
    }
    __syncthreads();
    if (threadIdx.x < world) {
        __threadfence_system();
        atomicAdd_system(peer_ints(control_peers, threadIdx.x) + ARRIVED + rank, 1);
    }
}
// --8<-- [end:dispatch]

// Thread s < world: with signal > 0, stores it into peer s's flag `slot` + rank; then waits for this
// rank's flag `slot` + s to reach `wait`.
extern "C" __global__ void __launch_bounds__(PEER_THREADS)
signal_and_wait(const long long* __restrict__ control_peers, int* control, int slot, int rank, int world, int signal,
                int wait) {
    const int s = threadIdx.x;
    if (s >= world) return;
    if (signal > 0) {
        __threadfence_system();
        store_release(peer_ints(control_peers, s) + slot + rank, signal);
    }
    wait_at_least(control + slot + s, wait, control);
}

// --8<-- [start:combine]
// A block per token: out[t] = Σ_j w_j · y[row_j] on slot j's rank, in fp32 in the order of stage 5's
// moe_combine (so the result is its, bit for bit), 16-byte vectors; the k loads are issued together,
// so that k reads over NVLink are in flight at once.
extern "C" __global__ void ep_combine(const long long* __restrict__ y_peers, const int* __restrict__ topk_ids,
                                      const int* __restrict__ slot_row, const float* __restrict__ topk_weights,
                                      elem_t* __restrict__ out, int top_k, int hidden, int local) {
    const int token = blockIdx.x;
    const elem_t* row[MAX_TOP_K];
    float weight[MAX_TOP_K];
#pragma unroll
    for (int j = 0; j < MAX_TOP_K; ++j) {
        const int slot = token * top_k + j;
        const elem_t* y = j < top_k ? reinterpret_cast<const elem_t*>(y_peers[topk_ids[slot] / local]) : nullptr;
        row[j] = j < top_k ? y + (size_t)slot_row[slot] * hidden : nullptr;
        weight[j] = j < top_k ? topk_weights[slot] : 0.0f;
    }
    for (int c = threadIdx.x * 8; c < hidden; c += blockDim.x * 8) {
        float acc[8] = {};
#pragma unroll
        for (int j = 0; j < MAX_TOP_K; ++j) {
            if (j < top_k) {
                float v[8];
                load8(row[j] + c, v);
#pragma unroll
                for (int q = 0; q < 8; ++q) acc[q] += weight[j] * v[q];
            }
        }
        store8(out + (size_t)token * hidden + c, acc);
    }
}
// --8<-- [end:combine]
