// The lightning indexer's scores for a prefill chunk on Hopper (sm_90a), the op of
// di_indexer_scores (indexer.cu) with one row list shared by the chunk's tokens:
//
//   scores[t, j] = scale * sum_h w[t, h] * ReLU(q[t, h] . K[list[j]])   for j < counts[t], else -inf
//
// The decode kernel gives each (token, 64 rows) block its token's 64 x 128 query and runs the
// products on mma.sync; for a chunk that re-reads every token's query per row tile and reaches
// 0.13 of the bf16 floor (benches/results/2026-11-30-indexer-prefill). Here a block owns 64 tokens x
// 256 rows: the 256 key rows (64 KB) stay in shared memory for all 64 heads, and per head the 64
// tokens' query rows (16 KB) stream through a ring. Per head, math warpgroup c (rows 128c..) runs
// D = Q_h K^T as wgmma m64n128k16 (k = 128 dims) and adds w[t, h] * ReLU(D) into its fp32 scores;
// while one warpgroup applies ReLU and weights, the other's MMAs run.
//
// Block: warpgroup 0 gathers with cp.async into 128-byte-swizzled tiles (the key rows named by the
// list, then the query rows head by head); warpgroups 1 and 2 compute. Rows past the list or
// outside the pool are zero-filled and score -inf; a pool row outside the pool that a token of the
// block could see sets *status to 1.
#include <cuda_bf16.h>
#include <stdint.h>

#include "cpasync.cuh"
#include "sm90.cuh"

constexpr int DI_IDX_WG_THREADS = 3 * 128;

#if DI_SM90
namespace {

constexpr int IH = 64;             // index heads
constexpr int ID = 128;            // index head dimension
constexpr int TT = 64;             // tokens a block
constexpr int RT = 256;            // rows a block (128 per math warpgroup)
constexpr int QSTAGES = 4;         // query tiles in flight
constexpr int CH = 128;            // bytes of a swizzled row piece (64 bf16)
constexpr int KCHUNK = RT * CH;    // one 64-dim chunk of the key tile: 32 KB
constexpr int QCHUNK = TT * CH;    // one 64-dim chunk of a query tile: 8 KB
constexpr int KTILE = 2 * KCHUNK;  // 64 KB
constexpr int QTILE = 2 * QCHUNK;  // 16 KB
// Dynamic shared memory (IDX_WG_SMEM in indexer.rs): 1024 bytes of alignment slack, the key tile,
// the query ring, the weights [head][token], the block's list entries, the barriers.
constexpr int SMEM = 1024 + KTILE + QSTAGES * QTILE + IH * TT * 4 + RT * 4 + (1 + 2 * QSTAGES) * 8;
static_assert(SMEM == 149576, "indexer.rs IDX_WG_SMEM");

// Byte offset of the 16-byte unit v (dims 8v..8v+7 of 128) of row r in a swizzled tile of chunks
// `chunk` bytes apart.
__device__ __forceinline__ uint32_t swz(uint32_t r, uint32_t v, uint32_t chunk) {
    return (v / 8) * chunk + r * CH + (((v % 8) ^ (r % 8)) * 16);
}

}  // namespace
#endif

// q [T, 64, 128] bf16; w [T, 64] f32; keys [pool_rows, 128] bf16; list [max_rows] (pool rows of the
// sequence's compressed indexer keys, shared by the chunk); counts [T]; scores [T, max_rows] f32.
// Grid (ceil(T / 64), ceil(max_rows / 256)), 384 threads.
extern "C" __global__ void __launch_bounds__(DI_IDX_WG_THREADS, 1)
    di_indexer_scores_prefill_wg(const __nv_bfloat16* __restrict__ q, const float* __restrict__ w,
                                 const __nv_bfloat16* __restrict__ keys, const int32_t* __restrict__ list,
                                 const int32_t* __restrict__ counts, float* __restrict__ scores,
                                 int32_t* __restrict__ status, uint32_t tokens, uint32_t max_rows, uint32_t pool_rows,
                                 float scale) {
#if DI_SM90
    extern __shared__ uint8_t smem_raw[];
    uint8_t* base = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    uint8_t* k_s = base;
    uint8_t* q_s = k_s + KTILE;
    float* w_s = reinterpret_cast<float*>(q_s + QSTAGES * QTILE);  // [head][token]
    int32_t* rows_s = reinterpret_cast<int32_t*>(w_s + IH * TT);   // pool row of each of the block's rows, -1: none
    uint64_t* k_full = reinterpret_cast<uint64_t*>(rows_s + RT);
    uint64_t* q_full = k_full + 1;
    uint64_t* q_empty = q_full + QSTAGES;
    const uint32_t t0 = blockIdx.x * TT, j0 = blockIdx.y * RT;
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        mbar_init(k_full, 129);  // every gather thread's copies + the list entries
        for (int s = 0; s < QSTAGES; ++s) {
            mbar_init(&q_full[s], 128);
            mbar_init(&q_empty[s], 8);  // lane 0 of each math warp
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) {
        setmaxnreg_dec<40>();
        const uint32_t t = threadIdx.x;
        // The block's list entries; a bad one counts when some token of the block sees it.
        uint32_t seen = 0;  // the most rows any token of the block sees
        for (uint32_t i = 0; i < TT; ++i)
            if (t0 + i < tokens) seen = max(seen, static_cast<uint32_t>(max(counts[t0 + i], 0)));
        for (uint32_t j = t; j < RT; j += 128) {
            const uint32_t pos = j0 + j;
            int32_t r = pos < max_rows ? list[pos] : -1;
            const bool ok = r >= 0 && static_cast<uint32_t>(r) < pool_rows;
            if (pos < max_rows && pos < seen && !ok) atomicExch(status, 1);
            rows_s[j] = ok ? r : -1;
        }
        named_barrier(1, 128);
        if (t == 0) mbar_arrive(k_full);
        // Key tile: 256 rows x 16 units.
        for (uint32_t i = 0; i < RT * 16 / 128; ++i) {
            const uint32_t c = i * 128 + t, j = c / 16, v = c % 16;
            const int32_t r = rows_s[j];
            cp_async16(k_s + swz(j, v, KCHUNK), keys + static_cast<size_t>(r < 0 ? 0 : r) * ID + v * 8, r >= 0);
        }
        cp_async_arrive_noinc(k_full);
        // Query tiles, head by head: 64 tokens x 16 units.
        for (uint32_t h = 0; h < IH; ++h) {
            const uint32_t s = h % QSTAGES;
            mbar_wait(&q_empty[s], ((h / QSTAGES) & 1) ^ 1);
            uint8_t* dst = q_s + s * QTILE;
            for (uint32_t i = 0; i < TT * 16 / 128; ++i) {
                const uint32_t c = i * 128 + t, r = c / 16, v = c % 16;
                const bool ok = t0 + r < tokens;
                cp_async16(dst + swz(r, v, QCHUNK), q + (static_cast<size_t>(ok ? t0 + r : 0) * IH + h) * ID + v * 8, ok);
            }
            cp_async_arrive_noinc(&q_full[s]);
        }
        cp_async_wait_all();
        return;
    }

    setmaxnreg_inc<232>();
    const int cw = wg - 1;  // rows 128cw.. of the block
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const uint32_t mt = threadIdx.x - 128;
    // Weights, transposed to [head][token].
    for (uint32_t i = mt; i < IH * TT; i += 256) {
        const uint32_t tk = i / IH, h = i % IH;
        w_s[h * TT + tk] = t0 + tk < tokens ? w[static_cast<size_t>(t0 + tk) * IH + h] : 0.f;
    }
    named_barrier(2, 256);
    // Accumulator layout (wgmma m64n128): tokens r0 = 16 warp + lane / 4 and r0 + 8, rows
    // 8 j + 2 (lane % 4) (+1) of this warpgroup's 128, in registers 4 j (+1) and 4 j + 2 (+1).
    const int r0 = warp * 16 + lane / 4;
    float acc[64], d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = d[i] = 0.f;
    const uint32_t k_a = smem_addr(k_s) + cw * 128 * CH, q_a = smem_addr(q_s);
    mbar_wait(k_full, 0);
    fence_proxy_async_smem();
    for (uint32_t h = 0; h < IH; ++h) {
        const uint32_t s = h % QSTAGES;
        mbar_wait(&q_full[s], (h / QSTAGES) & 1);
        fence_proxy_async_smem();
        wgmma_fence_regs(d);
        wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < ID / 16; ++kc) {
            const uint32_t off = (kc % 4) * 32;  // 16 dims inside the 128-byte row piece
            wgmma_m64n128k16_bf16(d, wgmma_desc_sw128(q_a + s * QTILE + (kc / 4) * QCHUNK + off),
                                  wgmma_desc_sw128(k_a + (kc / 4) * KCHUNK + off), kc > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(d);
        if (lane == 0) mbar_arrive(&q_empty[s]);
        const float w0 = w_s[h * TT + r0], w1 = w_s[h * TT + r0 + 8];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            acc[4 * j] = fmaf(w0, fmaxf(d[4 * j], 0.f), acc[4 * j]);
            acc[4 * j + 1] = fmaf(w0, fmaxf(d[4 * j + 1], 0.f), acc[4 * j + 1]);
            acc[4 * j + 2] = fmaf(w1, fmaxf(d[4 * j + 2], 0.f), acc[4 * j + 2]);
            acc[4 * j + 3] = fmaf(w1, fmaxf(d[4 * j + 3], 0.f), acc[4 * j + 3]);
        }
    }
    // Scores: -inf past each token's count and for rows without a key.
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const uint32_t tk = t0 + r0 + 8 * e;
        if (tk >= tokens) continue;
        const uint32_t count = min(static_cast<uint32_t>(max(counts[tk], 0)), max_rows);
        float* dst = scores + static_cast<size_t>(tk) * max_rows;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const uint32_t jl = cw * 128 + 8 * j + 2 * (lane % 4) + u, pos = j0 + jl;
                if (pos >= max_rows) continue;
                dst[pos] = pos < count && rows_s[jl] >= 0 ? acc[4 * j + 2 * e + u] * scale : -INFINITY;
            }
        }
    }
#else
    __trap();  // sm_90a only; the launcher never picks it elsewhere
#endif
}
