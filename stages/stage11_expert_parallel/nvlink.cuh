// Stage 11 over NVLink: dispatch and combine by the course's own kernels, as DeepEP does within a node.
// Every rank maps its peers' buffers (PyTorch's symmetric memory: nvlink.py), so a kernel stores a token's
// row straight into the rank that owns its expert, at the row where that rank's grouped GEMMs read it, and
// stores each result straight back into the rank that sent the row: no all-to-all, no regroup, and no host
// synchronization (nothing the host must read before it goes on). Every transfer is a store, none a load:
// a load over NVLink waits for its answer, a store does not.
//
//   ep_plan         one block: this rank's counts [E] into every peer's table, a flag per peer, then (all
//                   tables in) where each expert's rows start on its rank: shift; this rank's segment
//                   offsets for its GEMMs, piece by piece; and each local expert's real rows (filled)
//   ep_dispatch     a warp per token: its row read once, stored into the ranks of those of its k experts
//                   that lie in one piece of the local experts (all of them: one piece), with the row's
//                   origin (rank, token-slot); each block then adds 1 to an arrival count on every peer
//   (stage 6's GEMMs on one piece's grouped rows, into this rank's results)
//   ep_return       a warp per grouped row of one piece: a real row's result stored into the returned
//                   buffer of the rank it came from, at its token-slot; the same count per block
//   wait_for_peers  one block: every peer's count awaited
//   (stage 5's weighted sum over the returned buffer, local: the combine)
//
// PLANNED holds the call's epoch (1, 2, ...); ARRIVED and RETURNED the blocks each source launched so far
// (the hosts count them alike), so that nothing is ever reset. Reuse is safe without more flags: a rank
// writes a peer's buffers in call n + 1 only after its ep_plan of call n + 1 saw that peer's flag, which the
// peer raised once its call n was over (its streams joined).
#pragma once

#define MAX_RANKS 8              // the GPUs of one node
#define PEER_THREADS 256         // ep_plan: a thread per expert (MAX_EXPERTS); wait_for_peers: a rank each
#define COPY_THREADS 1024        // ep_dispatch, ep_return: 32 warps of up to 64 registers, a block fills its
                                 // SM: n blocks take n SMs and leave the rest to the GEMMs
#define RETURN_LOADS 4           // ep_return: 16-byte loads in flight per lane
#define WAIT_TIMEOUT_NS 5000000000ull  // 5 s: a flag that has not come by then never will (a peer failed)

// The control buffer, ints, one per rank, mapped by every peer (nvlink.py allocates CONTROL_INTS).
#define TABLE 0                                  // [MAX_RANKS][MAX_EXPERTS]: each source rank's counts
#define PLANNED (MAX_RANKS * MAX_EXPERTS)        // [MAX_RANKS] the epoch of the source's table
#define ARRIVED (PLANNED + MAX_RANKS)            // [MAX_RANKS] the source's dispatch blocks done, cumulated
#define RETURNED (ARRIVED + MAX_RANKS)           // [MAX_RANKS] the source's return blocks done, cumulated
#define TIMED_OUT (RETURNED + MAX_RANKS)         // set when a wait gave up
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
// ep_plan's parameters (nvlink.py's EpPlanParams packs them): `control` is this rank's control buffer,
// control_peers every rank's (their addresses), epoch this call's; the others as the kernel says.
struct EpPlanParams {
    const int* counts;
    const long long* control_peers;
    int* control;
    int rank, world, experts, align, pieces, piece_rows, epoch;
    int *shift, *offsets, *filled;
};

// counts[E]: this rank's token-slots per expert (stage 5, unpadded). Every rank's grouped rows hold `pieces`
// regions of piece_rows rows; piece p holds local experts local·p/pieces .. local·(p+1)/pieces - 1, each
// expert's segment padded to `align`, the sources' rows end to end by rank within it. Writes shift[e]: what
// to add to a token-slot's row in this rank's expert order (stage 5's dest) to get its row on the rank that
// owns e; offsets[E_l + pieces], this rank's segments for its GEMMs, piece p's from 0 at entries lo + p ..
// hi + p; filled[E_l], the real rows of each local expert (the rest of its segment is padding).
extern "C" __global__ void __launch_bounds__(PEER_THREADS)
ep_plan(const __grid_constant__ EpPlanParams p) {
    __shared__ int start[MAX_EXPERTS];   // where expert e's segment starts on its rank
    __shared__ int before[MAX_EXPERTS];  // expert e's rows from ranks before this one
    __shared__ int first[MAX_EXPERTS];   // where e's token-slots start in this rank's expert order
    const int e = threadIdx.x, local = p.experts / p.world;
    for (int d = 0; d < p.world && e < p.experts; ++d)
        peer_ints(p.control_peers, d)[TABLE + p.rank * MAX_EXPERTS + e] = __ldg(p.counts + e);
    __syncthreads();
    if (e < p.world) {
        __threadfence_system();
        store_release(peer_ints(p.control_peers, e) + PLANNED + p.rank, p.epoch);
        wait_at_least(p.control + PLANNED + e, p.epoch, p.control);
    }
    __syncthreads();
    if (e < p.experts) {
        const volatile int* table = p.control + TABLE;
        int rows = 0, mine = 0;
        for (int s = 0; s < p.world; ++s) {
            const int n = table[s * MAX_EXPERTS + e];
            mine = s == p.rank ? rows : mine;
            rows += n;
        }
        before[e] = mine;
        start[e] = (rows + p.align - 1) / p.align * p.align;  // the padded segment's length, summed below
        first[e] = table[p.rank * MAX_EXPERTS + e];
        if (e / local == p.rank) p.filled[e % local] = rows;
    }
    __syncthreads();
    if (e < p.world) {  // rank e's segments, end to end from each piece's first row
        for (int piece = 0; piece < p.pieces; ++piece) {
            const int lo = local * piece / p.pieces, hi = local * (piece + 1) / p.pieces;
            int at = 0;
            for (int i = lo; i < hi; ++i) {
                const int length = start[e * local + i];
                if (e == p.rank) p.offsets[i + piece] = at;
                start[e * local + i] = piece * p.piece_rows + at;
                at += length;
            }
            if (e == p.rank) p.offsets[hi + piece] = at;
        }
    }
    if (e == MAX_RANKS) {
        int at = 0;
        for (int i = 0; i < p.experts; ++i) {
            const int n = first[i];
            first[i] = at;
            at += n;
        }
    }
    __syncthreads();
    if (e < p.experts) p.shift[e] = start[e] + before[e] - first[e];
}
// --8<-- [end:plan]

// Each block, once its stores are issued: fenced, then 1 added to this rank's count at `slot` on every peer.
__device__ __forceinline__ void arrive(const long long* control_peers, int slot, int rank, int world) {
    __syncthreads();
    if (threadIdx.x < world) {
        __threadfence_system();
        atomicAdd_system(peer_ints(control_peers, threadIdx.x) + slot + rank, 1);
    }
}

// --8<-- [start:dispatch]
// ep_dispatch's parameters (nvlink.py's EpDispatchParams packs them): the *_peers, every rank's buffers'
// addresses; this piece's local experts first .. last - 1 of `local`; `slots` token-slots a rank at most.
struct EpDispatchParams {
    const elem_t* x;
    const int *topk_ids, *dest, *shift;
    const long long *rows_peers, *origin_peers, *control_peers;
    int tokens, hidden, top_k, local, first, last, slots, rank, world;
};

// A warp per token: lane j < k finds slot j's rank and row there, and whether its local expert lies in
// [first, last) (this piece); the warp then reads the row 16 bytes a lane at a time and stores each vector
// into the piece's slots' rows. Lane j also stores the slot's origin (this rank, the token-slot) beside its
// row, for ep_return. The stores to a peer go over NVLink and nothing waits for them.
extern "C" __global__ void __launch_bounds__(COPY_THREADS, 1)
ep_dispatch(const __grid_constant__ EpDispatchParams p) {
    const int lane = threadIdx.x % 32, warps = gridDim.x * COPY_THREADS / 32;
    for (int t = (blockIdx.x * COPY_THREADS + threadIdx.x) / 32; t < p.tokens; t += warps) {
        int to = 0, row = 0;
        bool wanted = false;
        if (lane < p.top_k) {
            const int slot = t * p.top_k + lane, expert = __ldg(p.topk_ids + slot);
            to = expert / p.local;
            row = __ldg(p.dest + slot) + __ldg(p.shift + expert);
            wanted = expert % p.local >= p.first && expert % p.local < p.last;
            if (wanted) reinterpret_cast<int*>(__ldg(p.origin_peers + to))[row] = p.rank * p.slots + slot;
        }
        const unsigned stored = __ballot_sync(FULL_MASK, wanted);  // bit j: slot j is this piece's
        if (stored == 0) continue;
        uint4* target[MAX_TOP_K];  // slot j's row on its rank, in every lane
#pragma unroll
        for (int j = 0; j < MAX_TOP_K; ++j) {
            const int d = __shfl_sync(FULL_MASK, to, j), r = __shfl_sync(FULL_MASK, row, j);
            target[j] = reinterpret_cast<uint4*>(reinterpret_cast<elem_t*>(__ldg(p.rows_peers + d)) +
                                                 (size_t)r * p.hidden);
        }
        const uint4* source = reinterpret_cast<const uint4*>(p.x + (size_t)t * p.hidden);
        for (int c = lane; c < p.hidden / 8; c += 32) {
            const uint4 v = source[c];  // not __ldg: with it NVRTC made the stores below generic, not global
#pragma unroll
            for (int j = 0; j < MAX_TOP_K; ++j)
                if (stored >> j & 1) target[j][c] = v;
        }
    }
    arrive(p.control_peers, ARRIVED, p.rank, p.world);
}
// --8<-- [end:dispatch]

// --8<-- [start:return]
// ep_return's parameters (nvlink.py's EpReturnParams packs them), as ep_dispatch's.
struct EpReturnParams {
    const elem_t* y;
    const int *offsets, *filled, *origin;
    const long long *returned_peers, *control_peers;
    int hidden, experts, slots, rank, world;
};

// One piece: y, offsets, filled and origin start at the piece's first row and expert. A warp per grouped row
// r: its expert e (rows only grow along a warp's walk, so e only moves forward), and unless r is its
// segment's padding, the result stored whole into the returned buffer of the rank the row came from, at its
// token-slot. A lane loads RETURN_LOADS vectors before it stores them: a load waits for its answer, and
// where the dispatch stores each load k times, this stores it once.
extern "C" __global__ void __launch_bounds__(COPY_THREADS, 1)
ep_return(const __grid_constant__ EpReturnParams p) {
    const int lane = threadIdx.x % 32, warps = gridDim.x * COPY_THREADS / 32;
    int e = 0;
    for (int r = (blockIdx.x * COPY_THREADS + threadIdx.x) / 32; r < __ldg(p.offsets + p.experts); r += warps) {
        while (r >= __ldg(p.offsets + e + 1)) ++e;
        if (r - __ldg(p.offsets + e) >= __ldg(p.filled + e)) continue;
        const int from = __ldg(p.origin + r);
        const uint4* source = reinterpret_cast<const uint4*>(p.y + (size_t)r * p.hidden);
        elem_t* returned = reinterpret_cast<elem_t*>(__ldg(p.returned_peers + from / p.slots));  // on rank from / slots
        uint4* target = reinterpret_cast<uint4*>(returned + (size_t)(from % p.slots) * p.hidden);
        for (int c = lane; c < p.hidden / 8; c += 32 * RETURN_LOADS) {  // the loads first, then the stores
            uint4 v[RETURN_LOADS];
#pragma unroll
            for (int u = 0; u < RETURN_LOADS; ++u)
                if (c + 32 * u < p.hidden / 8) v[u] = source[c + 32 * u];  // not __ldg, as in ep_dispatch
#pragma unroll
            for (int u = 0; u < RETURN_LOADS; ++u)
                if (c + 32 * u < p.hidden / 8) target[c + 32 * u] = v[u];
        }
    }
    arrive(p.control_peers, RETURNED, p.rank, p.world);
}
// --8<-- [end:return]

// Thread s < world waits for this rank's count `slot` + s to reach `value`.
extern "C" __global__ void __launch_bounds__(PEER_THREADS)
wait_for_peers(int* control, int slot, int world, int value) {
    if (threadIdx.x < world) wait_at_least(control + slot + threadIdx.x, value, control);
}
