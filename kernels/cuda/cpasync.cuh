// cp.async helpers shared by the kernels that gather rows by index into shared memory (attention,
// the indexer): 16-byte copies with zero fill, groups, mbarrier completion, and the check of a
// gather list's entry.
#pragma once
#include <stdint.h>

// 16 bytes global -> shared, zero-filled when !valid (a source size of 0).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// 16 bytes global -> shared at shared-window address `sa`, zeros instead where `zero` (the
// ignore-src predicate: one compare where a source size of 0 took three instructions).
__device__ __forceinline__ void cp_async16_sa(uint32_t sa, const void* src, bool zero) {
    asm volatile(
        "{\n .reg .pred z;\n setp.ne.b32 z, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, z;\n}\n" ::"r"(sa), "l"(src),
        "r"(static_cast<uint32_t>(zero))
        : "memory");
}

// 4 bytes global -> shared (cp.async.ca: copies under 16 bytes go through L1).
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Every committed group has landed.
__device__ __forceinline__ void cp_async_wait_groups() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// All but the newest N committed groups have landed.
template <int N>
__device__ __forceinline__ void cp_async_wait_pending() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Every copy this thread issued has landed, committed or not (copies tracked by mbarriers).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Arrive on the mbarrier at `bar` once this thread's earlier cp.async copies have landed; the
// arrival is counted in the barrier's expected count (sm_80+).
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
    const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(b) : "memory");
}

// A gather list's entry r as a pool row: r itself when it names a row of the pool's `pool_rows`,
// else -1 with *status = 1 (the caller's "row skipped" report).
__device__ __forceinline__ int32_t checked_row(int32_t r, uint32_t pool_rows, int32_t* status) {
    if (r >= 0 && static_cast<uint32_t>(r) < pool_rows) return r;
    atomicExch(status, 1);
    return -1;
}

// The pool row named by entry `pos` of a gather list: -1 at or past `end`, else checked_row.
__device__ __forceinline__ int32_t gather_row(const int32_t* list, uint32_t pos, uint32_t end, uint32_t pool_rows,
                                              int32_t* status) {
    if (pos >= end) return -1;
    return checked_row(list[pos], pool_rows, status);
}
