// cp.async, stage 3's copy engine: global -> shared memory without passing through registers.
//
// A thread issues copies of 16 bytes and goes on; it closes the ones issued so far into a "group"
// (commit), and later waits until at most N of its groups are still in flight. The copies of the
// next tiles thus load while this tile is computed: a ring of buffers in shared memory.
#pragma once

// --8<-- [start:cp_async_ptx]
// cp.async.cg: copy 16 bytes global -> shared asynchronously, through L2 only (.cg: the data
// is read once per block, caching it in L1 would only evict something useful). With
// `valid` false the source size is 0: nothing is read and the 16 bytes are zero-filled.
__device__ __forceinline__ void cp_async_16(unsigned destination, const void* source, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(destination), "l"(source), "r"(valid ? 16 : 0)
                 : "memory");
}

// Closes the group of the cp.async this thread issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `PENDING` of this thread's committed groups are still in flight. It says
// nothing about other threads' copies: a __syncthreads() must follow before reading them.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING) : "memory"); }
// --8<-- [end:cp_async_ptx]
