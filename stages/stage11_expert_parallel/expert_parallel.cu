// Stage 11 — expert parallelism: stage 7's layer with its experts sharded over the ranks of a process
// group. sm_90a (stage 6's GEMMs). The tokens travel by NCCL's all_to_all_single (torch.distributed, from
// Python: dispatch.py), or over NVLink by this stage's own kernels (nvlink.cuh); this file holds stage 7's
// kernels, the NVLink kernels and the regroup index.
//
// regroup_index: a rank receives its token-slots ordered by source rank, then by local expert (each rank
// sends its slots in expert order, and all_to_all_single lays the ranks' blocks end to end); the grouped
// GEMMs want each expert's rows together, its segment padded to BLOCK_M rows. From the received counts
// [ranks][experts] alone this kernel writes where every row goes, both ways, so that two gathers regroup
// the rows and put the results back: no host work, no index tensors built by a dozen small PyTorch
// launches (dispatch.regroup_index, the same maths in PyTorch, is what the CPU tests run).
#include "stage7_moe_layer/layer.cu"
#include "stage11_expert_parallel/nvlink.cuh"

#define REGROUP_THREADS 256

// --8<-- [start:regroup]
// Tables of the received counts, one bucket per (source rank s, local expert e), s-major as received.
struct Buckets {
    int count[MAX_EXPERTS];      // rows of bucket (s, e): ranks × experts = the layer's E <= MAX_EXPERTS
    int received[MAX_EXPERTS];   // where bucket (s, e) starts among the received rows
    int before[MAX_EXPERTS];     // expert e's rows from sources before s: where (s, e) starts in e's segment
    int total[MAX_EXPERTS];      // expert e's rows from every source
    int offsets[MAX_EXPERTS + 1];  // where expert e's segment starts, segments padded to `align` rows
};

// The kernel's parameters (__init__.py's RegroupParams packs them): the received counts [ranks][experts]
// in; the segments' offsets [experts + 1], each padded to `align` rows, and for each of the grouped_rows
// grouped rows its received row (source_row), and back (grouped_row), out.
struct RegroupParams {
    const int* counts;
    int ranks, experts, align, grouped_rows;
    int *expert_offsets, *source_row, *grouped_row;
};

// Every block builds the tables (E entries: one thread's serial scans cost less than a launch), then
// takes grouped rows in a grid-stride loop. Grouped row g of expert e's segment, at position i, copies
// received row source_row[g]; a padding row (i >= total[e]) copies the segment's last real row (stage 7's
// gather takes the first; zeros slowed the tensor cores). grouped_row is the inverse, for the real rows.
extern "C" __global__ void __launch_bounds__(REGROUP_THREADS)
regroup_index(const __grid_constant__ RegroupParams p) {
    __shared__ Buckets b;
    if (threadIdx.x == 0) {
        int received = 0;
        for (int i = 0; i < p.ranks * p.experts; ++i) {
            b.count[i] = __ldg(p.counts + i);
            b.received[i] = received;
            received += b.count[i];
        }
        b.offsets[0] = 0;
        for (int e = 0; e < p.experts; ++e) {
            int rows = 0;
            for (int s = 0; s < p.ranks; ++s) {
                b.before[s * p.experts + e] = rows;
                rows += b.count[s * p.experts + e];
            }
            b.total[e] = rows;
            b.offsets[e + 1] = b.offsets[e] + (rows + p.align - 1) / p.align * p.align;
        }
    }
    __syncthreads();
    if (blockIdx.x == 0)
        for (int e = threadIdx.x; e <= p.experts; e += blockDim.x) p.expert_offsets[e] = b.offsets[e];

    for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < p.grouped_rows; g += gridDim.x * blockDim.x) {
        // EXERCISE: find g's expert e (the last segment starting at or before g: empty segments start
        // where the next one does), its position in the segment (a padding row takes the segment's
        // last real row), the source rank s whose bucket (s, e) holds that position, and so the
        // received row; write source_row[g], and grouped_row[that row] = g for a real (unpadded) row.
        // STUB: continue;
        int lo = 0, hi = p.experts;  // invariant: offsets[lo] <= g < offsets[hi]
        while (hi - lo > 1) {
            const int mid = (lo + hi) / 2;
            if (b.offsets[mid] <= g) lo = mid; else hi = mid;
        }
        const int e = lo, position = g - b.offsets[e];
        const bool real = position < b.total[e];
        const int copied = real ? position : b.total[e] - 1;  // the position whose row g copies
        int s = 0;
        while (b.before[s * p.experts + e] + b.count[s * p.experts + e] <= copied) ++s;
        const int bucket = s * p.experts + e;
        const int row = b.received[bucket] + copied - b.before[bucket];
        p.source_row[g] = row;
        if (real) p.grouped_row[row] = g;
        // END EXERCISE
    }
}
// --8<-- [end:regroup]
