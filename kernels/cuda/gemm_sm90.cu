// FP8 x FP8 GEMM for prefill-sized batches on Hopper (sm_90a): y[m, n] = sum_k x[m, k] * W[n, k]
// with x already quantised to e4m3 bytes and power-of-two scales per 1x128 block
// (di_quantize_x_e4m3, the official activation quantisation) and W e4m3 with ue8m0 scales per
// 128x128 block (MODEL_V4.md §10.1). y bf16.
//
// Structure (the DeepGEMM form): a persistent grid of one 384-thread block per SM walks 256 x 128
// output tiles. Warpgroup 0 is the producer: one thread issues TMA loads of the x and W tiles
// (256 and 128 rows x 128 bytes of k, 128-byte swizzle) into a ring of STAGES shared-memory slots,
// signalled through mbarriers. Warpgroups 1 and 2 each own 128 rows of the tile, as two halves of
// 64: per 128-wide k block and half they run four wgmma m64n128k32 (raw e4m3 x e4m3, fp32
// accumulate) from the swizzled slots and add the sums times the x row scale and the W block scale
// into that half's running fp32 accumulator; then they release the slot. While one warpgroup
// scales, the other's MMAs run. Tiles go in groups of GROUP_M row tiles (W read about once from
// HBM), and outputs leave through shared memory by TMA stores. On the H200, 256 x 128 tiles ran
// 1.15x faster than 128 x 128 on long k (benches/results/2026-11-30-prefill-wgmma). Scaling per k
// block on the CUDA cores keeps the tensor cores' limited-precision accumulation to 128 products
// (DeepSeek-V3 §3.3.2).
#include <cuda_bf16.h>
#include <stdint.h>

#include "cpasync.cuh"
#include "lowp.cuh"
#include "sm90.cuh"

constexpr int DI_WGMMA_THREADS = 3 * 128;  // producer + two consumer warpgroups

#if DI_SM90
namespace {

constexpr int BM = 256;         // rows of x (tokens) per tile: 128 per consumer warpgroup
constexpr int BN = 128;         // rows of W (outputs) per tile: one 128-row scale block
constexpr int BK = 128;         // k per stage: one scale block, one 128-byte swizzle row
constexpr int STAGES = 4;       // ring depth
constexpr int X_TILE = BM * BK;  // bytes of one x tile
constexpr int W_TILE = BN * BK;  // bytes of one W tile
constexpr int OUT_STAGE = 64 * BN * 2;  // one 64-row half of a warpgroup's bf16 outputs
constexpr int GROUP_M = 8;  // tiles run in groups of 8 row tiles, rows fastest (L2 reuse of W)
// Dynamic shared memory (GEMM_WGMMA_SMEM in wgmma.rs): 1024 bytes of alignment slack, the two
// rings, an output staging half per consumer warpgroup, the full and empty barriers.
static_assert(1024 + STAGES * (X_TILE + W_TILE) + 2 * OUT_STAGE + 2 * STAGES * 8 == 230464,
              "wgmma.rs GEMM_WGMMA_SMEM");

// Tile t of a persistent walk: groups of GROUP_M row tiles; inside a group rows vary fastest, so
// the blocks in flight share a few W tiles (read once from HBM) and a few x tiles.
template <uint32_t GM = GROUP_M>
__device__ __forceinline__ void tile_coords(uint32_t t, uint32_t tiles_m, uint32_t tiles_n, uint32_t& mt,
                                            uint32_t& nt) {
    const uint32_t group = t / (GM * tiles_n), first = group * GM;
    const uint32_t gm = tiles_m - first < GM ? tiles_m - first : GM;
    const uint32_t local = t - group * GM * tiles_n;
    mt = first + local % gm;
    nt = local / gm;
}

}  // namespace
#endif

#if DI_SM90
namespace {

// A consumer warpgroup's 64 x 128 fp32 accumulator (rows warp * 16 + lane / 4 (+ 8), columns
// 8 j + 2 (lane % 4) (+ 1)) out as bf16 rows row0.. of y, columns n0..: written into this
// warpgroup's 16 KB staging as two 64 x 64 boxes in the 128-byte swizzle (conflict-free), then two
// TMA stores issued by the warpgroup's first thread (rows past m and columns past n are not
// written), which the warpgroup does not wait for: the staging is only written again once the
// previous stores have read it. bar: the warpgroup's named barrier.
__device__ __forceinline__ void store_rows_tma(uint8_t* stage, const float (&acc)[64], uint32_t bar, uint32_t row0,
                                               uint32_t n0, const DiTmaMap& map_y) {
    const uint32_t warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const bool issuer = threadIdx.x % 128 == 0;
    if (issuer) bulk_wait_read();
    named_barrier(bar, 128);  // the staging is free
    const uint32_t ra = warp * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const uint32_t r = ra + 8 * e;
            const uint32_t at = (j / 8) * 8192 + r * 128 + (((j % 8) ^ (r % 8)) * 16) + (lane % 4) * 4;
            *reinterpret_cast<__nv_bfloat162*>(stage + at) =
                __floats2bfloat162_rn(acc[4 * j + 2 * e], acc[4 * j + 2 * e + 1]);
        }
    }
    fence_proxy_async_smem();  // the staging writes before the TMA engine reads them
    named_barrier(bar, 128);
    if (issuer) {
        // Coordinates in bytes of a row (the map describes y as bytes: 2n columns).
        tma_store_2d(&map_y, stage, static_cast<int32_t>(2 * n0), static_cast<int32_t>(row0));
        tma_store_2d(&map_y, stage + 8192, static_cast<int32_t>(2 * n0 + 128), static_cast<int32_t>(row0));
        bulk_commit();
    }
}

// The same accumulator's fp32 sums straight into a split's partial [m, n].
__device__ __forceinline__ void store_rows_f32(float* __restrict__ part, const float (&acc)[64], uint32_t row0,
                                               uint32_t n0, uint32_t m, uint32_t n) {
    const uint32_t warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const uint32_t row = row0 + warp * 16 + lane / 4 + 8 * e;
            const uint32_t col = n0 + 8 * j + 2 * (lane % 4);
            if (row < m && col < n)
                *reinterpret_cast<float2*>(part + static_cast<size_t>(row) * n + col) =
                    make_float2(acc[4 * j + 2 * e], acc[4 * j + 2 * e + 1]);
        }
}

}  // namespace
#endif

#if DI_SM90
namespace {

// The shared memory, work items and producer of a persistent FP8 wgmma GEMM with TM-row x tiles,
// 128-row W tiles and NST stages: x_tiles [NST][TM x 128 bytes], w_tiles [NST][128 x 128 bytes],
// the two consumer warpgroups' 16 KB output staging, then the full and empty barriers. Item t is
// tile t % tiles (groups of GM row tiles, rows fastest) over split t / tiles of the k blocks.
template <int TM, int NST, uint32_t GM>
struct Fp8Ring {
    static constexpr int XT = TM * BK;  // bytes of one x tile
    uint8_t *x_tiles, *w_tiles, *out_stage;
    uint64_t *full, *empty;
    uint32_t nk, tiles_m, tiles_n, tiles, items, per_split;

    __device__ __forceinline__ Fp8Ring(uint8_t* base, uint32_t m, uint32_t n, uint32_t k, uint32_t splits) {
        x_tiles = base;
        w_tiles = base + NST * XT;
        out_stage = base + NST * (XT + W_TILE);
        full = reinterpret_cast<uint64_t*>(out_stage + 2 * OUT_STAGE);
        empty = full + NST;
        nk = k / BK;
        tiles_n = (n + BN - 1) / BN;
        tiles_m = (m + TM - 1) / TM;
        tiles = tiles_n * tiles_m;
        items = tiles * splits;
        per_split = (nk + splits - 1) / splits;
    }

    // Item t: its tile and its k blocks [kb0, kb1) (empty for splits past the end of k).
    __device__ __forceinline__ void item(uint32_t t, uint32_t& mt, uint32_t& nt, uint32_t& kb0, uint32_t& kb1) const {
        tile_coords<GM>(t % tiles, tiles_m, tiles_n, mt, nt);
        kb0 = min(t / tiles * per_split, nk);
        kb1 = min(kb0 + per_split, nk);
    }

    // Warpgroup 0: gives up its registers; its first thread loads every k block of this block's
    // items into the ring (slot it % NST, pass it / NST), the other threads leave.
    __device__ __forceinline__ void produce(const DiTmaMap& map_x, const DiTmaMap& map_w) const {
        setmaxnreg_dec<40>();
        if (threadIdx.x != 0) return;
        tma_prefetch_map(&map_x);
        tma_prefetch_map(&map_w);
        uint32_t it = 0;
        for (uint32_t t = blockIdx.x; t < items; t += gridDim.x) {
            uint32_t mt, nt, kb0, kb1;
            item(t, mt, nt, kb0, kb1);
            const int32_t m0 = static_cast<int32_t>(mt * TM), n0 = static_cast<int32_t>(nt * BN);
            for (uint32_t kb = kb0; kb < kb1; ++kb, ++it) {
                const uint32_t s = it % NST;
                mbar_wait(&empty[s], ((it / NST) & 1) ^ 1);
                mbar_arrive_expect_tx(&full[s], XT + W_TILE);
                tma_load_2d(x_tiles + s * XT, &map_x, static_cast<int32_t>(kb * BK), m0, &full[s]);
                tma_load_2d(w_tiles + s * W_TILE, &map_w, static_cast<int32_t>(kb * BK), n0, &full[s]);
            }
        }
    }
};

}  // namespace
#endif

// map_x: x as e4m3 bytes [m, k] (box 256 rows x 128, 128-byte swizzle); map_w: W bytes [n, k] (box 128
// x 128); map_y: y [m, n] bf16 as bytes [m, 2n] (box 64 rows x 128 bytes, 128-byte swizzle); sx
// [m, k / 128] f32; sw [ceil(n / 128), k / 128] ue8m0. k % 128 == 0, n % 16 == 0. Rows past m and
// outputs past n are read as zeros (TMA fill) and not written (the TMA stores clip them).
// splits > 1 (few tiles: batches of tens to hundreds of rows, where 256 x 128 tiles would leave
// most SMs idle): item t is tile t % tiles over split t / tiles of the k blocks, and its fp32
// sums go to partial[split][m][n] for di_gemm_splitk_reduce (split order: deterministic).
// ROWS (di_gemm_fp8_wgmma_rows, batches under 256 rows): halves of a tile wholly past m hold zeros
// and get no MMAs. A separate kernel: MMAs under a per-warpgroup test (or a second copy of the k
// loop in one kernel) took per-thread descriptors and barrier addresses and slowed the 4096-row
// GEMMs by ~10% on the H200.
template <bool ROWS>
__device__ __forceinline__ void fp8_wgmma(const DiTmaMap& map_x, const DiTmaMap& map_w, const DiTmaMap& map_y,
                                          const float* __restrict__ sx, const uint8_t* __restrict__ sw,
                                          float* __restrict__ partial, uint32_t m, uint32_t n, uint32_t k,
                                          uint32_t splits) {
#if DI_SM90
    extern __shared__ uint8_t smem_raw[];
    const Fp8Ring<BM, STAGES, GROUP_M> ring(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023), m, n, k, splits);
    uint8_t *x_tiles = ring.x_tiles, *w_tiles = ring.w_tiles, *out_stage = ring.out_stage;
    uint64_t *full = ring.full, *empty = ring.empty;
    const uint32_t nk = ring.nk, tiles = ring.tiles, items = ring.items;
    const int wg = threadIdx.x / 128;
    ring_init(full, empty, STAGES, 8);  // empty: lane 0 of each consumer warp

    if (wg == 0) {
        ring.produce(map_x, map_w);
        return;
    }

    setmaxnreg_inc<232>();
    const int cw = wg - 1;  // this warpgroup's 128 rows of the tile, as two halves of 64
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    uint32_t it = 0;
    for (uint32_t t = blockIdx.x; t < items; t += gridDim.x) {
        uint32_t mt, nt, kb0, kb1;
        ring.item(t, mt, nt, kb0, kb1);
        const uint32_t m0 = mt * BM, n0 = nt * BN;
        // Accumulator layout: rows warp * 16 + lane / 4 (+ 8) of each 64-row half, columns
        // 8 j + 2 (lane % 4) (+ 1).
        const uint32_t r0 = m0 + cw * 128 + warp * 16 + lane / 4;
        const uint32_t rows[4] = {r0, r0 + 8, r0 + 64, r0 + 72};  // the scale rows of both halves
        const float* sxr[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) sxr[i] = sx + static_cast<size_t>(rows[i] < m ? rows[i] : m - 1) * nk;
        const uint8_t* swt = sw + static_cast<size_t>(n0 / 128) * nk;
        float acc0[64], acc1[64], blk[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) acc0[i] = acc1[i] = 0.f;
        // The MMAs of one 64-row half for the k block in slot s, then their scaled sums into acc.
        auto half = [&](float(&acc)[64], uint32_t s, int h, float f0, float f1) {
            const uint32_t xa = smem_addr(x_tiles + s * X_TILE + (cw * 128 + h * 64) * BK);
            const uint32_t wa = smem_addr(w_tiles + s * W_TILE);
            wgmma_fence_regs(blk);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 32; ++kk)
                wgmma_m64n128k32_e4m3(blk, wgmma_desc_sw128(xa + kk * 32), wgmma_desc_sw128(wa + kk * 32), kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_regs(blk);
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                acc[4 * j] = fmaf(blk[4 * j], f0, acc[4 * j]);
                acc[4 * j + 1] = fmaf(blk[4 * j + 1], f0, acc[4 * j + 1]);
                acc[4 * j + 2] = fmaf(blk[4 * j + 2], f1, acc[4 * j + 2]);
                acc[4 * j + 3] = fmaf(blk[4 * j + 3], f1, acc[4 * j + 3]);
            }
        };
        for (uint32_t kb = kb0; kb < kb1; ++kb, ++it) {
            const uint32_t s = it % STAGES;
            const float sb = e8m0(swt[kb]);
            float f[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) f[i] = sxr[i][kb] * sb;
            mbar_wait(&full[s], (it / STAGES) & 1);
            if (!ROWS || m0 + cw * 128 < m) half(acc0, s, 0, f[0], f[1]);
            if (!ROWS || m0 + cw * 128 + 64 < m) half(acc1, s, 1, f[2], f[3]);
            if (lane == 0) mbar_arrive(&empty[s]);
        }
        // Outputs through this warpgroup's shared-memory staging by TMA stores, or one split's sums.
        const uint32_t row0 = m0 + cw * 128;
        if (splits == 1) {
            uint8_t* stage = out_stage + cw * OUT_STAGE;
            store_rows_tma(stage, acc0, 1 + cw, row0, n0, map_y);
            store_rows_tma(stage, acc1, 1 + cw, row0 + 64, n0, map_y);
        } else {
            float* part = partial + static_cast<size_t>(t / tiles) * m * n;
            store_rows_f32(part, acc0, row0, n0, m, n);
            store_rows_f32(part, acc1, row0 + 64, n0, m, n);
        }
    }
    if (threadIdx.x % 128 == 0) bulk_wait();  // the output stores are done before the block's memory goes
#else
    __trap();  // sm_90a only; the launcher never picks it elsewhere
#endif
}

#define DI_GEMM_FP8_WGMMA(NAME, ROWS)                                                                        \
    extern "C" __global__ void __launch_bounds__(DI_WGMMA_THREADS, 1)                                        \
        NAME(const __grid_constant__ DiTmaMap map_x, const __grid_constant__ DiTmaMap map_w,                 \
             const __grid_constant__ DiTmaMap map_y, const float* __restrict__ sx,                           \
             const uint8_t* __restrict__ sw, float* __restrict__ partial, uint32_t m, uint32_t n, uint32_t k, \
             uint32_t splits) {                                                                              \
        fp8_wgmma<ROWS>(map_x, map_w, map_y, sx, sw, partial, m, n, k, splits);                              \
    }
DI_GEMM_FP8_WGMMA(di_gemm_fp8_wgmma, false)
DI_GEMM_FP8_WGMMA(di_gemm_fp8_wgmma_rows, true)

// ---------------------------------------------------------------------------------------------
// di_gemm_fp8_wgmma_p: the same op on 128 x 128 tiles with the scaling pipelined. In the kernel
// above each consumer warpgroup owns two 64-row halves, and the registers (two 64-value running
// sums and one 64-value block sum) leave room for one k block's MMAs in flight: the warpgroup
// waits for them before scaling, and its tensor work stops while it scales. Here each consumer
// warpgroup owns one 64-row half of a 128 x 128 tile and keeps two block sums: the MMAs of k block
// b + 1 run while the sums of block b are scaled into the running sum (wgmma.wait_group 1), so a
// warpgroup always has MMAs queued. The cost: W tiles are shared by 128 rows instead of 256 (a
// third more bytes from L2 per FLOP); 32 KB stages allow six of them.
constexpr int DI_WGMMA_P_THREADS = 3 * 128;  // producer + two consumer warpgroups

#if DI_SM90
namespace {

constexpr int PBM = 128;                 // rows of x per tile: 64 per consumer warpgroup
constexpr int PSTAGES = 6;               // ring depth
constexpr int PX_TILE = PBM * BK;        // bytes of one x tile
constexpr uint32_t P_GROUP_M = 16;       // 2048 rows of x per tile group, as GROUP_M above
constexpr int PU = 4;                    // k blocks an iteration of the consumer loop
static_assert(1024 + PSTAGES * (PX_TILE + W_TILE) + 2 * OUT_STAGE + 2 * PSTAGES * 8 == 230496,
              "wgmma.rs GEMM_WGMMA_P_SMEM");

}  // namespace
#endif

__device__ __forceinline__ void fp8_wgmma_p(const DiTmaMap& map_x, const DiTmaMap& map_w, const DiTmaMap& map_y,
                                            const float* __restrict__ sx, const uint8_t* __restrict__ sw,
                                            float* __restrict__ partial, uint32_t m, uint32_t n, uint32_t k,
                                            uint32_t splits) {
#if DI_SM90
    extern __shared__ uint8_t smem_raw[];
    const Fp8Ring<PBM, PSTAGES, P_GROUP_M> ring(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023), m, n, k, splits);
    uint8_t *x_tiles = ring.x_tiles, *w_tiles = ring.w_tiles, *out_stage = ring.out_stage;
    uint64_t *full = ring.full, *empty = ring.empty;
    const uint32_t nk = ring.nk, tiles = ring.tiles, items = ring.items;
    const int wg = threadIdx.x / 128;
    ring_init(full, empty, PSTAGES, 8);  // empty: lane 0 of each consumer warp

    if (wg == 0) {
        ring.produce(map_x, map_w);
        return;
    }

    setmaxnreg_inc<232>();
    const int cw = wg - 1;  // this warpgroup's 64 rows of the tile
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    uint32_t it = 0;  // k blocks consumed so far: slot it % PSTAGES, pass it / PSTAGES
    for (uint32_t t = blockIdx.x; t < items; t += gridDim.x) {
        uint32_t mt, nt, kb0, kb1;
        ring.item(t, mt, nt, kb0, kb1);
        const uint32_t m0 = mt * PBM, n0 = nt * BN;
        const uint32_t r0 = m0 + cw * 64 + warp * 16 + lane / 4;
        const float* sx0 = sx + static_cast<size_t>(r0 < m ? r0 : m - 1) * nk;
        const float* sx1 = sx + static_cast<size_t>(r0 + 8 < m ? r0 + 8 : m - 1) * nk;
        const uint8_t* swt = sw + static_cast<size_t>(n0 / 128) * nk;
        float acc[64], ba[64], bb[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.f;
        // Queue the MMAs of the k block in slot `it % PSTAGES` into blk (one commit group).
        auto issue = [&](float(&blk)[64], uint32_t at) {
            const uint32_t s = at % PSTAGES;
            mbar_wait(&full[s], (at / PSTAGES) & 1);
            const uint32_t xa = smem_addr(x_tiles + s * PX_TILE + cw * 64 * BK);
            const uint32_t wa = smem_addr(w_tiles + s * W_TILE);
            wgmma_fence_regs(blk);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 32; ++kk)
                wgmma_m64n128k32_e4m3(blk, wgmma_desc_sw128(xa + kk * 32), wgmma_desc_sw128(wa + kk * 32), kk > 0);
            wgmma_commit();
        };
        // The factors of block kb: the x row scales times the W block scale.
        auto factors = [&](uint32_t kb, float(&f)[2]) {
            const float sb = e8m0(swt[kb]);
            f[0] = sx0[kb] * sb;
            f[1] = sx1[kb] * sb;
        };
        // A block's sums (complete) times its factors into acc; then its slot is free.
        auto scale = [&](float(&blk)[64], const float(&f)[2], uint32_t at) {
            wgmma_fence_regs(blk);
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                acc[4 * j] = fmaf(blk[4 * j], f[0], acc[4 * j]);
                acc[4 * j + 1] = fmaf(blk[4 * j + 1], f[0], acc[4 * j + 1]);
                acc[4 * j + 2] = fmaf(blk[4 * j + 2], f[1], acc[4 * j + 2]);
                acc[4 * j + 3] = fmaf(blk[4 * j + 3], f[1], acc[4 * j + 3]);
            }
            if (lane == 0) mbar_arrive(&empty[at % PSTAGES]);
        };
        // Blocks alternate between ba and bb: block kb + 1's MMAs are queued before block kb is
        // scaled. PU blocks an iteration with nothing in flight across the loop edge (ptxas
        // otherwise waits there and serialises every MMA), so one scaling in PU is exposed; the
        // remainder one block at a time. An iteration's factors are loaded during the one before.
        float f[PU][2];
        auto load_factors = [&](uint32_t from, float(&g)[PU][2]) {
#pragma unroll
            for (int i = 0; i < PU; ++i)
                if (from + i < kb1) factors(from + i, g[i]);
        };
        uint32_t kb = kb0;
        load_factors(kb, f);
        for (; kb + PU <= kb1; kb += PU, it += PU) {
            float g[PU][2];
            load_factors(kb + PU, g);
            issue(ba, it);
#pragma unroll
            for (int i = 0; i < PU; ++i) {
                float(&cur)[64] = i % 2 ? bb : ba;
                if (i + 1 < PU) {
                    issue(i % 2 ? ba : bb, it + i + 1);
                    wgmma_wait<1>();
                } else {
                    wgmma_wait<0>();
                }
                scale(cur, f[i], it + i);
            }
#pragma unroll
            for (int i = 0; i < PU; ++i) f[i][0] = g[i][0], f[i][1] = g[i][1];
        }
        for (; kb < kb1; ++kb, ++it) {
            float h[2];
            factors(kb, h);
            issue(ba, it);
            wgmma_wait<0>();
            scale(ba, h, it);
        }
        const uint32_t row0 = m0 + cw * 64;
        if (splits == 1)
            store_rows_tma(out_stage + cw * OUT_STAGE, acc, 1 + cw, row0, n0, map_y);
        else
            store_rows_f32(partial + static_cast<size_t>(t / tiles) * m * n, acc, row0, n0, m, n);
    }
    if (threadIdx.x % 128 == 0) bulk_wait();
#else
    __trap();  // sm_90a only; the launcher never picks it elsewhere
#endif
}

extern "C" __global__ void __launch_bounds__(DI_WGMMA_P_THREADS, 1)
    di_gemm_fp8_wgmma_p(const __grid_constant__ DiTmaMap map_x, const __grid_constant__ DiTmaMap map_w,
                        const __grid_constant__ DiTmaMap map_y, const float* __restrict__ sx,
                        const uint8_t* __restrict__ sw, float* __restrict__ partial, uint32_t m, uint32_t n,
                        uint32_t k, uint32_t splits) {
    fp8_wgmma_p(map_x, map_w, map_y, sx, sw, partial, m, n, k, splits);
}

// ---------------------------------------------------------------------------------------------
// Grouped FP4 GEMM for MoE prefill on Hopper: y[r, :] = W_e . x_r for the rows r of each expert's
// chunks of up to 128 rows (a dispatch with tile 128), x in permuted row order and already on the
// FP8 grid (bf16 values: the official activation quantisation), W e2m1 with a ue8m0 scale per 1x32
// (MODEL_V4.md §10.2). y bf16.
//
// Hopper has no FP4 tensor cores, and an e4m3 MMA cannot apply a scale per 32 of k that differs
// per output. So W is widened to bf16 with its group's scale folded in (e2m1 x 2^s is exact in
// bf16), x's values (e4m3 times a power of two) are exact in bf16 too, and bf16 wgmma forms the
// exact products and accumulates them in fp32 with no promotion step.
//
// The operands are swapped (y^T = W . x^T): W is the A operand, widened by the math warps straight
// into registers (wgmma's register-A form), x the B operand from shared memory with N = the chunk's
// rows rounded up to 32 (experts average ~96 rows at prefill: less padding than 64-row M tiles).
// Widening in registers keeps shared memory to the TMA tiles (an earlier form widened W into a
// shared tile: ~160 KB of shared-memory traffic a k step against ~96 KB now, and it was the bound).
// Each math thread's 16 codes of a row for a k step are one 8-byte read and one scale group, in an
// order of k that the launcher's pass over x (gather, FP8 rounding, this permutation) matches:
// within each 64-wide block of k, x position 16 kk + 2 q + e + 8 h holds k = 16 q + kk + 4 e + 8 h
// (quant::fp4_wgmma_x_position, with its test against the fragment slots).
//
// A persistent 512-thread block per SM walks items (chunk, 192 outputs), chunk-major (the blocks in
// flight share a chunk's x rows in L2). Warpgroups 0-2 own 64 outputs each: per k step they run
// the step's four wgmma m64nNk16 from A fragments widened during the previous step's MMAs, then
// widen the next step; the three take turns on the tensor cores. Warpgroup 3: one thread issues
// TMA loads of the x tile (128 rows x 64 k bf16, 128-byte swizzle) and the raw W tile (192 rows x
// 32 bytes) into a ring. Outputs leave transposed through shared memory as whole rows of y. Rows
// of the N past the chunk (the next expert's, or zeros past the end) are computed and not written.
// (Four math warpgroups would not fit: 640 threads cap ptxas at 96 registers.)
constexpr int G4_MATH = 3;  // di_gemm_fp4_wgmma's math warpgroups (plus a producer warpgroup)

#if DI_SM90
namespace {

constexpr int G4_BM = 128;                 // rows of x (tokens) per item at most
constexpr int G4_BN = 64 * G4_MATH;        // outputs per item: 64 per math warpgroup
constexpr int G4_STAGES = 6;               // ring depth
constexpr int G4_X = G4_BM * 128;          // x tile: 128 rows x 64 bf16
constexpr int G4_WQ = G4_BN * 32;          // raw W tile: 192 rows x 64 e2m1
constexpr int G4_OUT = G4_BM * 128;        // a math warpgroup's staging: 128 rows x 64 outputs bf16
// Dynamic shared memory (GEMM_FP4_WGMMA_SMEM in wgmma.rs): alignment slack, the ring's x and raw W
// tiles, the two staging blocks, the full and empty barriers.
constexpr int G4_SMEM = 1024 + G4_STAGES * (G4_X + G4_WQ) + G4_MATH * G4_OUT + 2 * G4_STAGES * 8;
static_assert(G4_SMEM == 185440, "wgmma.rs GEMM_FP4_WGMMA_SMEM");
static_assert(G4_X % 1024 == 0, "swizzled tiles 1024-byte aligned");

// Eight e2m1 codes (low nibble first) -> bf16 pairs (n0, n4), (n1, n5), (n2, n6), (n3, n7), each
// code's value times `scale`: the bf16 with a code's magnitude bits (e1 e0 m) at bits 8..6 and its
// sign at 15 is exactly e2m1 x 2^-126 (0.5 lands on a subnormal, which bf16 multiplies keep), and
// nibbles i and i + 4 sit 16 bits apart, so one shift and mask places both of a pair; then one
// multiply by 2^(s - 1) (for ue8m0 s <= 128) gives e2m1 x 2^(s - 127), exactly. CPU statement and
// test: quant::fp4x8_to_bf16_pairs_lo126.
__device__ __forceinline__ void fp4x8_to_bf16_pairs(uint32_t w, uint32_t scale, uint32_t (&p)[4]) {
    const uint32_t q[4] = {((w << 6) & 0x01C001C0u) | ((w << 12) & 0x80008000u),
                           ((w << 2) & 0x01C001C0u) | ((w << 8) & 0x80008000u),
                           ((w >> 2) & 0x01C001C0u) | ((w << 4) & 0x80008000u),
                           ((w >> 6) & 0x01C001C0u) | (w & 0x80008000u)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 b = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&q[i]),
                                         *reinterpret_cast<const __nv_bfloat162*>(&scale));
        p[i] = *reinterpret_cast<const uint32_t*>(&b);
    }
}

// The same pairs for any ue8m0 scale s (2^(s - 1) overflows bf16 from s = 129): the byte-permute
// table of the code values, multiplied by 2^(s - 127), then paired as above.
__device__ __forceinline__ void fp4x8_to_bf16_pairs_any(uint32_t w, uint32_t s, uint32_t (&p)[4]) {
    const float f = e8m0(static_cast<uint8_t>(s));
    uint32_t o[4];  // (n0, n1), (n2, n3), (n4, n5), (n6, n7)
    fp4x8_to_bf16(w, __floats2bfloat162_rn(f, f), o);
    p[0] = __byte_perm(o[0], o[2], 0x5410);
    p[1] = __byte_perm(o[0], o[2], 0x7632);
    p[2] = __byte_perm(o[1], o[3], 0x5410);
    p[3] = __byte_perm(o[1], o[3], 0x7632);
}

// One math warpgroup's k loop and outputs for an item with N (32 .. 128) rows of x computed.
// wrow: this thread's W rows g and g + 8 of warp w's 16 in the warpgroup's 64 (of the raw tile's
// 192); srow: their scale rows (null past n).
template <int N>
__device__ __forceinline__ void fp4_wgmma_item(const uint8_t* ring_x, const uint8_t* ring_q, uint64_t* full,
                                               uint64_t* empty, uint32_t& it, uint32_t nk, const uint8_t* const (&srow)[2],
                                               uint32_t wrow, uint8_t* stage, uint32_t cw, __nv_bfloat16* __restrict__ y,
                                               uint32_t n, uint32_t n0, uint32_t rows) {
    const uint32_t lane = threadIdx.x % 32, q = lane % 4;
    float acc[N / 2];
#pragma unroll
    for (int j = 0; j < N / 2; ++j) acc[j] = 0.f;
    // Scales of rows g, g + 8: group q / 2 of a k step's two. (Loading 16 steps' scales at once,
    // words picked per step, measured ~8% slower.)
    auto scales = [&](uint32_t kb, uint32_t (&out)[2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) out[h] = srow[h] ? srow[h][2 * kb + q / 2] : 0u;
    };
    // Widen the k step in ring slot it_k % STAGES into A fragments: frag[kk] = {(g, 2q..), (g + 8,
    // 2q..), (g, 2q + 8..), (g + 8, 2q + 8..)} of k block kk.
    auto widen = [&](uint32_t it_k, const uint32_t (&sc)[2], uint32_t (&frag)[4][4]) {
        const uint32_t s = it_k % G4_STAGES;
        mbar_wait(&full[s], (it_k / G4_STAGES) & 1);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint2 raw = *reinterpret_cast<const uint2*>(ring_q + s * G4_WQ + (wrow + 8 * h) * 32 + 8 * q);
            uint32_t lo[4], hi[4];
            if (sc[h] <= 128) {
                const uint32_t f = ((sc[h] + 126u) << 7) * 0x10001u;  // 2^(s - 1) twice, as bf16
                fp4x8_to_bf16_pairs(raw.x, f, lo);
                fp4x8_to_bf16_pairs(raw.y, f, hi);
            } else {
                fp4x8_to_bf16_pairs_any(raw.x, sc[h], lo);
                fp4x8_to_bf16_pairs_any(raw.y, sc[h], hi);
            }
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                frag[kk][h] = lo[kk];
                frag[kk][2 + h] = hi[kk];
            }
        }
    };
    // k step kb's MMAs from `cur`, then (while they run) step kb + 1 widened into `nxt`, whose
    // previous MMAs (step kb - 1) are waited for first; step kb - 1's slot is then released.
    uint32_t sc[2];
    auto step = [&](uint32_t kb, const uint32_t (&cur)[4][4], uint32_t (&nxt)[4][4]) {
        const uint32_t xa = smem_addr(ring_x + (it % G4_STAGES) * G4_X);
        wgmma_fence_regs(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_rs_bf16<N>(acc, cur[kk], wgmma_desc_sw128(xa + kk * 32));
        wgmma_commit();
        wgmma_wait<1>();
        wgmma_fence_regs(acc);
        if (kb > 0 && lane == 0) mbar_arrive(&empty[(it - 1) % G4_STAGES]);
        if (kb + 1 < nk) {
            widen(it + 1, sc, nxt);
            if (kb + 2 < nk) scales(kb + 2, sc);
        }
        ++it;
    };
    uint32_t fa[4][4], fb[4][4];
    scales(0, sc);
    widen(it, sc, fa);
    if (nk > 1) scales(1, sc);
    for (uint32_t kb = 0; kb < nk; kb += 2) {
        step(kb, fa, fb);
        if (kb + 1 < nk) step(kb + 1, fb, fa);
    }
    wgmma_wait<0>();
    wgmma_fence_regs(acc);
    if (lane == 0) mbar_arrive(&empty[(it - 1) % G4_STAGES]);
    // acc[4 j + i] is y^T at output o = 16 w + g + 8 (i / 2), token t = 8 j + 2 q + i % 2.
    // Transposed into the staging as [token][64 outputs] bf16, 16-byte chunks XOR-swizzled by
    // (t / 2) % 8 (conflict-free stores), then whole 128-byte rows out with 16-byte stores.
    const uint32_t warp = (threadIdx.x / 32) % 4, g = lane / 4;
    named_barrier(1 + cw, 128);  // the previous item's rows are out
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t o = 16 * warp + g + 8 * (i / 2), t = 8 * j + 2 * q + i % 2;
            const uint32_t at = t * 128 + (((o / 8) ^ ((t / 2) % 8)) * 16) + (o % 8) * 2;
            *reinterpret_cast<__nv_bfloat16*>(stage + at) = __float2bfloat16_rn(acc[4 * j + i]);
        }
    named_barrier(1 + cw, 128);
    const uint32_t tid = threadIdx.x % 128, cols = n > n0 + 64 * cw ? n - n0 - 64 * cw : 0;
    for (uint32_t v = tid; v < rows * 8; v += 128) {
        const uint32_t t = v / 8, c = v % 8;
        if (c * 8 < cols)
            *reinterpret_cast<uint4*>(y + static_cast<size_t>(t) * n + n0 + 64 * cw + c * 8) =
                *reinterpret_cast<const uint4*>(stage + t * 128 + ((c ^ ((t / 2) % 8)) * 16));
    }
}

}  // namespace
#endif

// map_x: x bf16 [rows, k] as bytes, permuted in k as above (box 128 rows x 128 bytes, 128-byte
// swizzle); map_w: the experts' W bytes [experts * n, k / 2] back to back (box 192 rows x 32
// bytes); sw: their scales [experts * n, k / 32]; y [rows, n]; chunks (expert, first row, rows <=
// 128, 0), num_chunks[0] of them. k % 64 == 0, n % 8 == 0.
extern "C" __global__ void __launch_bounds__(128 * (1 + G4_MATH), 1)
    di_gemm_fp4_wgmma(const __grid_constant__ DiTmaMap map_x, const __grid_constant__ DiTmaMap map_w,
                      const uint8_t* __restrict__ sw, __nv_bfloat16* __restrict__ y, const int4* __restrict__ chunks,
                      const int32_t* __restrict__ num_chunks, uint32_t n, uint32_t k) {
#if DI_SM90
    extern __shared__ uint8_t g4_smem[];
    uint8_t* base = g4_smem + ((1024 - (smem_addr(g4_smem) & 1023)) & 1023);
    uint8_t* ring_x = base;                        // x tiles
    uint8_t* ring_q = ring_x + G4_STAGES * G4_X;   // raw W tiles
    uint8_t* out_stage = ring_q + G4_STAGES * G4_WQ;
    uint64_t* full = reinterpret_cast<uint64_t*>(out_stage + G4_MATH * G4_OUT);
    uint64_t* empty = full + G4_STAGES;
    const uint32_t nk = k / 64, tiles_n = (n + G4_BN - 1) / G4_BN;
    const uint32_t items = static_cast<uint32_t>(*num_chunks) * tiles_n;
    ring_init(full, empty, G4_STAGES, 4 * G4_MATH);  // empty: lane 0 of each math warp
    const uint32_t wg = threadIdx.x / 128;  // math warpgroups 0 .. G4_MATH - 1, then the producer

    if (wg == G4_MATH) {
        setmaxnreg_dec<24>();
        if (threadIdx.x != 128 * G4_MATH) return;
        tma_prefetch_map(&map_x);
        tma_prefetch_map(&map_w);
        uint32_t it = 0;  // k steps loaded so far: slot it % STAGES, pass it / STAGES
        for (uint32_t t = blockIdx.x; t < items; t += gridDim.x) {
            const int4 c = chunks[t / tiles_n];
            const int32_t wrow = static_cast<int32_t>(static_cast<uint32_t>(c.x) * n + (t % tiles_n) * G4_BN);
            for (uint32_t kb = 0; kb < nk; ++kb, ++it) {
                const uint32_t s = it % G4_STAGES;
                mbar_wait(&empty[s], ((it / G4_STAGES) & 1) ^ 1);
                mbar_arrive_expect_tx(&full[s], G4_X + G4_WQ);
                tma_load_2d(ring_x + s * G4_X, &map_x, static_cast<int32_t>(kb * 128), c.y, &full[s]);
                tma_load_2d(ring_q + s * G4_WQ, &map_w, static_cast<int32_t>(kb * 32), wrow, &full[s]);
            }
        }
        return;
    }

    setmaxnreg_inc<160>();
    const uint32_t cw = wg;  // outputs 64 cw .. + 64 of each item
    const uint32_t lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const uint32_t wrow = 64 * cw + 16 * warp + lane / 4, groups = k / 32;
    uint8_t* stage = out_stage + cw * G4_OUT;
    uint32_t it = 0;
    for (uint32_t t = blockIdx.x; t < items; t += gridDim.x) {
        const int4 c = chunks[t / tiles_n];
        const uint32_t n0 = (t % tiles_n) * G4_BN, rows = static_cast<uint32_t>(c.z);
        const uint8_t* srow[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t row = n0 + wrow + 8 * h;
            srow[h] = row < n ? sw + (static_cast<size_t>(c.x) * n + row) * groups : nullptr;
        }
        __nv_bfloat16* yr = y + static_cast<size_t>(c.y) * n;
        switch ((rows + 31) / 32) {
            case 1: fp4_wgmma_item<32>(ring_x, ring_q, full, empty, it, nk, srow, wrow, stage, cw, yr, n, n0, rows); break;
            case 2: fp4_wgmma_item<64>(ring_x, ring_q, full, empty, it, nk, srow, wrow, stage, cw, yr, n, n0, rows); break;
            case 3: fp4_wgmma_item<96>(ring_x, ring_q, full, empty, it, nk, srow, wrow, stage, cw, yr, n, n0, rows); break;
            default: fp4_wgmma_item<128>(ring_x, ring_q, full, empty, it, nk, srow, wrow, stage, cw, yr, n, n0, rows); break;
        }
    }
#else
    __trap();  // sm_90a only; the launcher never picks it elsewhere
#endif
}

// ---------------------------------------------------------------------------------------------
// Decode FP8 GEMM on wgmma with the operands swapped (m <= 16): y[t, r] = sum_k x[t, k] W[r, k].
// W is the 64-row A operand streamed by TMA through a shared-memory ring (the op is bound by
// reading W once), x the 8- or 16-column B operand. A block owns 128 rows of W (one scale block) and
// all of k, so the op is one launch for shapes with enough rows to fill the GPU (wq_b): each block
// quantises x to e4m3 with 1x128 power-of-two scales (the official activation quantisation)
// straight into the swizzled B layout while the first W tiles are in flight.
//
// Block (row block blockIdx.x, k split blockIdx.y): warp 0 lane 0 issues the W loads; warps 1-7
// quantise x; warpgroup 1 (warps 4-7) runs per k block two m64nNk32 x 4 MMAs (rows 0-63, 64-127),
// releases the slot and adds the sums times the W block scale and each token's x scale.
// With one split the block writes y. With several (W with few row blocks) each block writes its fp32
// partial sums to global memory and the last block of a row block to finish (a counter per row
// block) adds the partials in split order and writes y, so the sums do not depend on which block
// finishes last, and the op is still one launch. (Splitting k over clusters of 2-8 blocks that added
// their partials through distributed shared memory was slower than the mma.sync kernel:
// benches/results/2026-11-30-gemm-decode/wgmma.)
// Programmatic dependent launch: the blocks let the next grid start at once and stream their W
// tiles before waiting for the grid before them (W and its scales are weights, written by no
// kernel); x, the partials, the counters and y are touched only after pdl_wait.
#if DI_SM90
namespace {

constexpr int DEC_ROWS = 128;             // rows of W per block: one scale block
constexpr int DEC_TILE = DEC_ROWS * 128;  // bytes of one W tile (128 rows x one 128-wide k block)

template <int N> __device__ __forceinline__ void wgmma_dec(float (&d)[N / 2], uint64_t da, uint64_t db, uint32_t sd);
template <> __device__ __forceinline__ void wgmma_dec<8>(float (&d)[4], uint64_t da, uint64_t db, uint32_t sd) {
    wgmma_m64n8k32_e4m3(d, da, db, sd);
}
template <> __device__ __forceinline__ void wgmma_dec<16>(float (&d)[8], uint64_t da, uint64_t db, uint32_t sd) {
    wgmma_m64n16k32_e4m3(d, da, db, sd);
}

// The sum of `count` >= 1 partials load(0), load(1), ... (the split scratch, in L2) added in
// that order from 0 (the same bits as a plain loop), their loads issued 16 at a time without
// branches (past the last, the last is loaded again and not added) so that one round trip covers
// up to 16 splits (a rolled loop waits for each few in turn).
template <typename Load> __device__ __forceinline__ float sum_splits(uint32_t count, Load load) {
    float sum = 0.f;
    for (uint32_t s0 = 0; s0 < count; s0 += 16) {
        float v[16];
#pragma unroll
        for (uint32_t i = 0; i < 16; ++i) v[i] = load(min(s0 + i, count - 1));
#pragma unroll
        for (uint32_t i = 0; i < 16; ++i)
            if (s0 + i < count) sum += v[i];
    }
    return sum;
}

// x rows t < m, k blocks 0 .. cnt, as e4m3 bytes with one power-of-two scale per 1x128
// block (the official activation quantisation, as di_quantize_x_e4m3) into xs in the 128-byte
// swizzled B layout (16-byte chunk c of row t at chunk c ^ (t % 8)) and scales into sxs[j * N + t];
// rows m .. N are zero_x_rows'. Warps 1-7 (w = 0..6): a half-warp per (row, block), 8 values a
// lane. The 14 half-warps take the tasks in turn (half-warp w + 7 h takes tasks w + 7 h + 14 u),
// so the rounding is spread over every warp however few the tasks; each warp issues its (up to
// U) loads of a round before using any (U = 10 makes 16 rows x 8 blocks one round), and skips
// the steps where neither half has a task.
// With `signal`, each warp arrives at barrier 3 (256 threads: warp 0 waits there) once its first
// loads are issued, so the W tiles warp 0 issues after that queue behind x, not x behind them.
template <int N>
__device__ __forceinline__ void quantize_x_slice(const __nv_bfloat16* __restrict__ x, uint32_t m, uint32_t k,
                                                 uint32_t cnt, uint8_t* xs, float* sxs, uint32_t w,
                                                 int lane, bool signal) {
    constexpr int U = 10, HALVES = 14;
    const uint32_t tasks = m * cnt, h = lane / 16, l = lane % 16, hw = w + 7 * h;
    // task = (block j, row t) = (task / m, task % m): m <= 16 and tasks <= 16 * 512 keep
    // task * m under div_small's 2^22.
    const float inv_m = 1.f / static_cast<float>(m);
    if (signal && w >= tasks) named_barrier_arrive(3, 256);
    for (uint32_t first = 0; first + w < tasks; first += HALVES * U) {
        // Steps u where this warp's first half has a task (the second half's are a subset).
        const uint32_t steps = min(static_cast<uint32_t>(U), (tasks - first - w + HALVES - 1) / HALVES);
        uint4 raw[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t task = first + hw + HALVES * u;
            raw[u] = make_uint4(0, 0, 0, 0);
            if (task < tasks) {
                const DivSmall jt = div_small(task, m, inv_m);
                raw[u] = *reinterpret_cast<const uint4*>(x + static_cast<size_t>(jt.r) * k + jt.q * 128 + l * 8);
            }
        }
        if (signal && first == 0) named_barrier_arrive(3, 256);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (static_cast<uint32_t>(u) >= steps) break;  // warp-uniform
            const uint32_t task = first + hw + HALVES * u;
            float v[8];
            const float amax = half_warp_block_amax(raw[u], v);
            if (task >= tasks) continue;
            const DivSmall jt = div_small(task, m, inv_m);
            const uint32_t t = jt.r, j = jt.q;
            const float s = pow2_scale(amax);
            const uint32_t chunk = (l / 2) ^ (t & 7);
            *reinterpret_cast<uint2*>(xs + j * N * 128 + t * 128 + chunk * 16 + (l % 2) * 8) = e4m3x8(v, pow2_recip(s));
            if (l == 0) sxs[j * N + t] = s;
        }
    }
}

// Rows m .. N of quantize_x_slice's tiles and scales: zeros (16 bytes a thread of warps 1-7, w =
// 0..6). They depend on no input, so the blocks write them before waiting for the grid before.
template <int N>
__device__ __forceinline__ void zero_x_rows(uint32_t m, uint32_t cnt, uint8_t* xs, float* sxs, uint32_t w, int lane) {
    for (uint32_t i = w * 32 + lane; i < (N - m) * cnt * 8; i += 7 * 32) {
        const uint32_t t = m + (i / 8) % (N - m), j = i / 8 / (N - m);
        *reinterpret_cast<uint4*>(xs + j * N * 128 + t * 128 + (i % 8) * 16) = make_uint4(0, 0, 0, 0);
        if (i % 8 == 0) sxs[j * N + t] = 0.f;
    }
}

// x already quantised (xq e4m3 [m, k], sx [m, k / 128], as di_quantize_x_e4m3 writes them: the
// codes and scales quantize_x_slice would make), rows t < m, k blocks 0 .. cnt, copied into xs in
// the same swizzled layout (cp.async, 16 bytes a thread of warps 1-7 in turn, w = 0..6) and their
// scales into sxs[j * N + t]: no rounding on the path from the wait to the first MMA, and half the
// bytes. The copies are waited for here. With `signal`, as quantize_x_slice: each warp arrives at
// barrier 3 once its copies are issued.
template <int N>
__device__ __forceinline__ void copy_x_fp8(const uint8_t* __restrict__ xq, const float* __restrict__ sx, uint32_t m,
                                           uint32_t k, uint32_t cnt, uint8_t* xs, float* sxs, uint32_t w, int lane,
                                           bool signal) {
    const uint32_t units = m * cnt * 8, nk = k / 128;
    const float inv_m = 1.f / static_cast<float>(m);
    for (uint32_t u = w * 32 + lane; u < units; u += 7 * 32) {
        // unit = (task, chunk c), task = (block j, row t) = (task / m, task % m) as quantize_x_slice.
        const uint32_t task = u / 8, c = u % 8;
        const DivSmall jt = div_small(task, m, inv_m);
        const uint32_t t = jt.r, j = jt.q;
        cp_async16(xs + j * N * 128 + t * 128 + ((c ^ (t & 7)) * 16), xq + static_cast<size_t>(t) * k + j * 128 + c * 16, true);
    }
    cp_async_commit();
    if (signal) named_barrier_arrive(3, 256);
    for (uint32_t task = w * 32 + lane; task < m * cnt; task += 7 * 32) {
        const DivSmall jt = div_small(task, m, inv_m);
        sxs[jt.q * N + jt.r] = sx[static_cast<size_t>(jt.r) * nk + jt.q];
    }
    cp_async_wait_all();
}

// N: tokens a block multiplies (8 or 16, m <= N). per: k blocks a split (gridDim.y splits).
// xq, sx: null (x bf16, quantised here), or x already quantised (x unused).
template <int N>
__device__ __forceinline__ void decode_body(const DiTmaMap& map_w, const __nv_bfloat16* __restrict__ x,
                                            const uint8_t* __restrict__ sw, __nv_bfloat16* __restrict__ y,
                                            float* __restrict__ part, uint32_t* __restrict__ counters, uint32_t m,
                                            uint32_t n, uint32_t k, uint32_t stages, uint32_t per, uint32_t pdl,
                                            uint32_t pre, uint32_t cluster, const uint8_t* __restrict__ xq,
                                            const float* __restrict__ sx) {
    extern __shared__ uint8_t smem_raw[];
    __shared__ uint32_t last_split;
    pdl_trigger(pdl);
    const uint32_t nk = k / 128, j0 = blockIdx.y * per, cnt = min(per, nk - j0);
    const uint32_t rb = blockIdx.x;  // this block's 128-row block of W
    uint8_t* base = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    uint8_t* ring = base;                                  // stages x DEC_TILE
    uint8_t* xs = ring + stages * DEC_TILE;                    // per x N rows x 128 bytes, swizzled
    float* sxs = reinterpret_cast<float*>(xs + per * N * 128);  // [per][N] x scales
    float* red = reinterpret_cast<float*>(ring);                // [128][N] outputs, once the ring is done
    uint64_t* full = reinterpret_cast<uint64_t*>(sxs + per * N);
    uint64_t* empty = full + stages;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    ring_init(full, empty, stages, 4);  // empty: lane 0 of each consumer warp

    // `pre` tiles are issued before the wait for the grid before this one; when that is fewer than
    // cnt, the rest follow once the x loads are issued (barrier 3).
    const bool split_issue = pre < cnt;
    if (warp == 0) {
        auto issue_tiles = [&](uint32_t from, uint32_t to) {
            for (uint32_t j = from; j < to; ++j) {
                const uint32_t s = j % stages;
                mbar_wait(&empty[s], ((j / stages) & 1) ^ 1);
                mbar_arrive_expect_tx(&full[s], DEC_TILE);
                tma_load_2d(ring + s * DEC_TILE, &map_w, static_cast<int32_t>((j0 + j) * 128),
                            static_cast<int32_t>(rb * DEC_ROWS), &full[s]);
            }
        };
        if (lane == 0) {
            tma_prefetch_map(&map_w);
            issue_tiles(0, split_issue ? pre : cnt);
        }
        __syncwarp();  // warp 0 reconverges before the block-wide barriers below
        pdl_wait();    // before warp 0 writes outputs below
        if (split_issue) {
            named_barrier(3, 256);  // warps 1-7 have issued their x loads
            if (lane == 0) issue_tiles(pre, cnt);
            __syncwarp();
        }
    } else {
        // The W block scales are weights: the consumer warps load theirs (up to 64 a block; more
        // are read in the loop) before waiting for the grid before this one.
        const uint8_t* swr = sw + static_cast<size_t>(rb) * nk + j0;
        uint32_t sc_lo = 0, sc_hi = 0;
        if (warp >= 4) {
            if (static_cast<uint32_t>(lane) < cnt) sc_lo = swr[lane];
            if (static_cast<uint32_t>(lane) + 32 < cnt) sc_hi = swr[lane + 32];
        }
        zero_x_rows<N>(m, cnt, xs, sxs, warp - 1, lane);
        pdl_wait();
        if (sx != nullptr)
            copy_x_fp8<N>(xq + j0 * 128, sx + j0, m, k, cnt, xs, sxs, warp - 1, lane, split_issue);
        else
            quantize_x_slice<N>(x + j0 * 128, m, k, cnt, xs, sxs, warp - 1, lane, split_issue);
        fence_proxy_async_smem();
        named_barrier(1, 224);  // warps 1-7: x is in place

        if (warp >= 4) {
            const int cwarp = warp - 4;
            float acc0[N / 2], acc1[N / 2], a0[N / 2], a1[N / 2], b0[N / 2], b1[N / 2];
#pragma unroll
            for (int i = 0; i < N / 2; ++i) acc0[i] = acc1[i] = 0.f;
            // Tile j's MMAs into (d0, d1): rows 0-63 and 64-127 of W against the tokens.
            auto issue = [&](uint32_t j, float (&d0)[N / 2], float (&d1)[N / 2]) {
                const uint32_t s = j % stages;
                mbar_wait(&full[s], (j / stages) & 1);
                const uint32_t wa = smem_addr(ring + s * DEC_TILE), xa = smem_addr(xs + j * N * 128);
                wgmma_fence_regs(d0);
                wgmma_fence_regs(d1);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                    const uint64_t db = wgmma_desc_sw128(xa + kk * 32);
                    wgmma_dec<N>(d0, wgmma_desc_sw128(wa + kk * 32), db, kk > 0);
                    wgmma_dec<N>(d1, wgmma_desc_sw128(wa + 64 * 128 + kk * 32), db, kk > 0);
                }
                wgmma_commit();
            };
            // Tile j's sums (done) times its W block scale and each token's x scale, and its slot freed.
            auto add = [&](uint32_t j, float (&d0)[N / 2], float (&d1)[N / 2]) {
                wgmma_fence_regs(d0);
                wgmma_fence_regs(d1);
                if (lane == 0) mbar_arrive(&empty[j % stages]);
                const uint32_t code = j < 32 ? __shfl_sync(0xffffffffu, sc_lo, j) : j < 64 ? __shfl_sync(0xffffffffu, sc_hi, j - 32) : swr[j];
                const float sb = e8m0(static_cast<uint8_t>(code));
                // Columns (tokens) of accumulator i: 8 (i / 4) + 2 (lane % 4) + (i % 2).
#pragma unroll
                for (int i = 0; i < N / 2; ++i) {
                    const float f = sb * sxs[j * N + 8 * (i / 4) + 2 * (lane % 4) + (i % 2)];
                    acc0[i] = fmaf(d0[i], f, acc0[i]);
                    acc1[i] = fmaf(d1[i], f, acc1[i]);
                }
            };
            // Two tiles an iteration: the second's MMAs run while the first is scaled; nothing is
            // in flight across the loop edge (else ptxas serialises the wgmma).
            for (uint32_t j = 0; j < cnt; j += 2) {
                issue(j, a0, a1);
                if (j + 1 < cnt) {
                    issue(j + 1, b0, b1);
                    wgmma_wait<1>();
                    add(j, a0, a1);
                    wgmma_wait<0>();
                    add(j + 1, b0, b1);
                } else {
                    wgmma_wait<0>();
                    add(j, a0, a1);
                }
            }
            // Every tile has landed and been read: the ring's first bytes take the outputs.
            named_barrier(2, 128);
            // Rows (W) of accumulator i: 16 cwarp + lane / 4 (+ 8 for i % 4 >= 2), + 64 for acc1.
#pragma unroll
            for (int i = 0; i < N / 2; ++i) {
                const uint32_t r = 16 * cwarp + lane / 4 + ((i % 4) >= 2 ? 8 : 0);
                const uint32_t t = 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
                red[r * N + t] = acc0[i];
                red[(r + 64) * N + t] = acc1[i];
            }
        }
    }
    __syncthreads();
    // Out through shared memory: consecutive threads write consecutive rows of y (or of the partial),
    // token t < m of row r at q = 128 t + r.
    if (gridDim.y == 1) {
        for (uint32_t q = threadIdx.x; q < DEC_ROWS * m; q += blockDim.x) {
            const uint32_t r = q % DEC_ROWS, t = q / DEC_ROWS, row = rb * DEC_ROWS + r;
            if (row < n) y[static_cast<size_t>(t) * n + row] = __float2bfloat16_rn(red[r * N + t]);
        }
        return;
    }
    if (cluster > 1) {
        // The row block's splits are one cluster (rank = blockIdx.y). Each block adds its share of
        // the 128 rows over every split's outputs, read from the blocks' shared memory in split
        // order: the scratch path's sums, bit for bit, without its round trips through L2.
        cluster_sync();  // every split's outputs are in its shared memory
        const uint32_t share = (DEC_ROWS + gridDim.y - 1) / gridDim.y, r0 = blockIdx.y * share;
        const uint32_t red_addr = smem_addr(red);
        for (uint32_t q = threadIdx.x; q < share * m; q += blockDim.x) {
            const uint32_t r = r0 + q % share, t = q / share, row = rb * DEC_ROWS + r;
            if (r >= DEC_ROWS || row >= n) continue;
            // One load a split: loads past the last (sum_splits) cost here (w13's 8 splits: 0.49 ->
            // 0.40 of the floor), and batching 16 gained nothing at 16 splits.
            float sum = 0.f;
            for (uint32_t sp = 0; sp < gridDim.y; ++sp) sum += ld_cluster_f32(mapa_shared(red_addr + (r * N + t) * 4, sp));
            y[static_cast<size_t>(t) * n + row] = __float2bfloat16_rn(sum);
        }
        cluster_sync();  // no block leaves while another reads its shared memory
        return;
    }
    for (uint32_t q = threadIdx.x; q < DEC_ROWS * m; q += blockDim.x) {
        const uint32_t r = q % DEC_ROWS, t = q / DEC_ROWS, row = rb * DEC_ROWS + r;
        if (row < n) part[(static_cast<size_t>(blockIdx.y) * m + t) * n + row] = red[r * N + t];
    }
    // The block's partials are published by thread 0's fence after the barrier, and the other
    // splits' read after its fence that follows the count (cooperative groups' grid barrier).
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last_split = atomicAdd(&counters[rb], 1u) == gridDim.y - 1;
        __threadfence();
    }
    __syncthreads();
    if (!last_split) return;
    for (uint32_t q = threadIdx.x; q < DEC_ROWS * m; q += blockDim.x) {
        const uint32_t r = q % DEC_ROWS, t = q / DEC_ROWS, row = rb * DEC_ROWS + r;
        if (row >= n) continue;
        const float* at = part + static_cast<size_t>(t) * n + row;
        const size_t stride = static_cast<size_t>(m) * n;
        const float sum = sum_splits(gridDim.y, [&](uint32_t sp) { return __ldcg(at + sp * stride); });
        y[static_cast<size_t>(t) * n + row] = __float2bfloat16_rn(sum);
    }
    if (threadIdx.x == 0) counters[rb] = 0;  // ready for the next launch (which waits for this grid)
}

}  // namespace
#endif

#if DI_SM90
#define DI_DEC_BODY(N) decode_body<N>(map_w, x, sw, y, part, counters, m, n, k, stages, per, pdl, pre, cluster, xq, sx)
#else
#define DI_DEC_BODY(N) __trap()
#endif

// map_w: W bytes [n, k] (box 128 rows x 128, 128-byte swizzle); x bf16 [m, k]; sw [ceil(n / 128),
// k / 128] ue8m0; y [m, n]. m <= N, k % 128 == 0, n % 16 == 0. Grid (ceil(n / 128), splits): a block
// per 128 rows of W and `per` k blocks (splits = ceil(k / 128 / per)); `stages` W tiles in flight
// (the launcher sizes shared memory). With splits > 1 and cluster == splits (launched in clusters
// of the splits along y): the splits add up in the cluster's shared memory; with splits > 1 and
// cluster == 1: part [splits, m, n] fp32 scratch and counters [ceil(n / 128)] zeros (left zero).
// pdl: launched with programmatic dependent launch (pdl_trigger). pre: W tiles issued before the
// wait for the grid before (all of them when >= the block's k blocks; else the rest once x's loads
// are issued). xq, sx: null, or x already quantised (e4m3 [m, k] and [m, k / 128] scales; x unused).
#define DI_GEMM_FP8_DEC(N)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 1) di_gemm_fp8_dec_n##N(                                  \
        const __grid_constant__ DiTmaMap map_w, const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ sw, \
        __nv_bfloat16* __restrict__ y, float* __restrict__ part, uint32_t* __restrict__ counters, uint32_t m,      \
        uint32_t n, uint32_t k, uint32_t stages, uint32_t per, uint32_t pdl, uint32_t pre, uint32_t cluster,      \
        const uint8_t* __restrict__ xq, const float* __restrict__ sx) {                                           \
        DI_DEC_BODY(N);                                                                                          \
    }

DI_GEMM_FP8_DEC(8)
DI_GEMM_FP8_DEC(16)

// HBM streaming probe for the decode benchmarks: reads n16 16-byte words (four loads in flight a
// thread, grid-stride, evict-first), all issued before waiting for the grid before it (programmatic
// dependent launch), then xors them into *out. A batch of these over rotating buffers times what
// merely reading a weight's bytes costs, with or without the launch overlap the decode GEMMs use.
extern "C" __global__ void __launch_bounds__(512) di_probe_read(const uint4* __restrict__ p, uint64_t n16,
                                                               uint32_t* __restrict__ out, uint32_t pdl) {
    pdl_trigger(pdl);
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    uint32_t acc = 0;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
        for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n16; i += stride) {
        const uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    __shared__ uint32_t warps[16];
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = acc;
    __syncthreads();
    pdl_wait();
    if (threadIdx.x == 0) {  // one atomic a block (one a warp queued ~8k on one L2 address: ~5 us)
        for (uint32_t w = 1; w < blockDim.x / 32; ++w) acc ^= warps[w];
        atomicXor(out, acc);
    }
}

// Tensor-pipe probe for decode-shaped MMAs (benchmarks; issue #7's FP4 decode design): each of the
// block's warpgroups runs `iters` rounds of 16 `wgmma m64nNk32` e4m3 from shared memory (A 64 rows
// x 512 bytes of k as four 64 x 128-byte blocks, then B N rows likewise, 128-byte swizzle; byte o
// holds 0, +-0.5 or +-1 by a hash of o, as ops::probe_wgmma states), chained on one accumulator
// (the round's first overwrites it; the 16 cover k 0..511 once) and waited for once a round.
// cycles[block] = thread 0's clock cycles for the rounds; sums[tid] = the total of warpgroup 0's
// thread tid's sums in block 0, all N columns (the CPU computes it through the same swizzle).
// (Summing over all rounds instead stalls at 2^14: the FP8 tensor cores add with limited
// precision.)
#if DI_SM90
namespace {
template <int N>
__device__ __forceinline__ void probe_wgmma_body(uint32_t iters, int32_t* __restrict__ cycles,
                                                 float* __restrict__ sums) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t* base = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    uint8_t* a = base;           // 4 x (64 rows x 128 bytes)
    uint8_t* b = base + 32768;   // 4 x (N rows x 128 bytes) (N at most 128)
    for (uint32_t o = threadIdx.x; o < 32768 + 4 * N * 128; o += blockDim.x) {
        const uint32_t h = (o * 2654435761u) >> 29;  // 0..7 -> 0, 0.5, 1, -0.5, -1, 0.5, 1, 0
        const uint8_t table[8] = {0x00, 0x30, 0x38, 0xB0, 0xB8, 0x30, 0x38, 0x00};
        a[o] = table[h];
    }
    fence_proxy_async_smem();
    __syncthreads();
    float acc[N / 2];
#pragma unroll
    for (int j = 0; j < N / 2; ++j) acc[j] = 0.f;
    const uint32_t aa = smem_addr(a), ba = smem_addr(b);
    const long long start = clock64();
    for (uint32_t it = 0; it < iters; ++it) {
        wgmma_fence_regs(acc);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const uint64_t da = wgmma_desc_sw128(aa + (j / 4) * 8192 + (j % 4) * 32),
                           db = wgmma_desc_sw128(ba + (j / 4) * N * 128 + (j % 4) * 32);
            if constexpr (N == 8) wgmma_m64n8k32_e4m3(acc, da, db, j > 0);
            else if constexpr (N == 16) wgmma_m64n16k32_e4m3(acc, da, db, j > 0);
            else wgmma_m64n128k32_e4m3(acc, da, db, j > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(acc);
    }
    const long long end = clock64();
    if (threadIdx.x == 0) cycles[blockIdx.x] = static_cast<int32_t>(end - start);
    if (blockIdx.x == 0 && threadIdx.x < 128) {  // every sum of the thread (all N columns)
        float all = 0.f;
#pragma unroll
        for (int j = 0; j < N / 2; ++j) all += acc[j];
        sums[threadIdx.x] = all;
    }
}
}  // namespace
#define DI_PROBE_WGMMA_BODY(N) probe_wgmma_body<N>(iters, cycles, sums)
#else
#define DI_PROBE_WGMMA_BODY(N) __trap()
#endif
#define DI_PROBE_WGMMA(N)                                                                                     \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                      \
        di_probe_wgmma_n##N(uint32_t iters, int32_t* __restrict__ cycles, float* __restrict__ sums) {          \
        DI_PROBE_WGMMA_BODY(N);                                                                               \
    }
DI_PROBE_WGMMA(8)
DI_PROBE_WGMMA(16)
DI_PROBE_WGMMA(128)

// ---------------------------------------------------------------------------------------------
// Grouped FP4 decode GEMM on the FP8 tensor cores (sm_90a): the MoE decode jobs of
// di_gemm_fp4q_stream_n* (chunks of up to N = 8 or 16 rows, x rounded to e4m3 with 1x128 scales),
// with W widened to e4m3 in registers as the A operand of wgmma m64nNk32 instead of to f16 for
// mma.sync (about 14 bit operations for 8 values, 3.4 instructions a weight in all): here 7 for 8
// values, and one wgmma per warpgroup covers 64 rows x 32 k.
// Math: a 32-wide scale group of a W row is one k32 step. Thread (g = lane / 4, q = lane % 4) of
// warp w holds, for rows 16 w + g and + 8 of the item, bytes 16 st + 4 q .. + 3 of each row's
// 64 bytes of a 128-wide k block (step st: codes 32 st + 8 q ..), widened by fp4x8_to_e4m3_lo6 to
// their values times 2^-6: the even codes in fragment slots 4 q.., the odd ones in 16 + 4 q... x
// is stored with each group's evens first (`quant::fp4_dec_x_position`), so the slots pair up. Every
// step's wgmma starts from zero; its sums times the two rows' group scales are added on the CUDA
// cores, and each k block's sum times the token's x scale (stored times 2^6) joins the total. No
// scale is folded into an operand, so any ue8m0 scales work, and the tensor cores'
// limited-precision accumulation spans 32 products.
// Block: warps 0-3 (one warpgroup) compute; warp 4 lane 0 streams W: per pair of k blocks (a slot)
// a TMA load of the item's 64-row x 128-byte W tile (128-byte swizzle: 16-byte unit u of row r at
// u ^ (r % 8), so the warp's 4-byte reads hit 32 banks) into a ring of F4D_STAGES slots; a k block
// past k (odd k / 128) reads zeros and is skipped. The compute warps round the chunk's x rows
// (through the gather) to e4m3 for all of k into shared memory once per chunk the block visits (the
// wgmma B layout: a 128-byte swizzled N-row tile per k block; columns past the chunk's rows hold
// whatever was there: products in columns never stored). Items (chunk, 64-row tile) go to blocks in
// contiguous runs, so a block rounds one or two chunks' x. The two k blocks of a slot: the second's
// wgmmas run while the first's are scaled; nothing is in flight across the loop edge (else ptxas
// serialises the wgmma).
// Programmatic dependent launch: the blocks set up their barriers and let the next grid start before
// waiting for the grid before (which may write the chunks, x or read y); over settled chunks (flags
// bit 2) the TMA warp reads them and issues W without waiting, and only the compute warps wait.
#if DI_SM90
namespace {

constexpr uint32_t F4D_W = 64 * 128;  // a slot: 64 rows x 128 bytes of W (two 128-wide k blocks)
constexpr uint32_t F4D_STAGES = 5;

// The chunk's rows row0 .. + m (m <= N; row r of x is gather[r] / gather_div, or r without a
// gather) of x [.., k] as e4m3 with one power-of-two scale per 1x128 block (the official activation
// quantisation, the same bits as di_quantize_x_e4m3), each 32-wide group evens first, into xs (block
// j: an N-row x 128-byte tile at j N 128, 16-byte unit u of row t at u ^ (t % 8)) and the scales
// times 2^6 into sxs[j N + t]. The four compute warps: a half-warp per (row, block), 8 values a lane;
// the 8 half-warps take the tasks in turn (half-warp w + 4 h takes tasks w + 4 h + 8 u), each warp
// issues its (up to U) loads of a round before using any, and skips the steps where neither half
// has a task (as quantize_x_slice).
// With `signal`, each warp arrives at barrier 2 (160 threads: the TMA warp waits there) once its
// first loads of x are issued, so the W slots issued after that queue behind x.
template <int N>
__device__ __forceinline__ void f4d_round_x(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ gather,
                                            uint32_t gather_div, uint32_t row0, uint32_t m, uint32_t k, uint8_t* xs,
                                            float* sxs, uint32_t warp, uint32_t lane, bool signal) {
    constexpr int U = 8, HALVES = 8;
    const uint32_t kc = k / 128, tasks = m * kc, h = lane / 16, l = lane % 16, hw = warp + 4 * h;
    // task = (row t, block j) = (task / kc, task % kc): m <= 16 and kc <= 512 keep task * kc under
    // div_small's 2^22.
    const float inv_kc = 1.f / static_cast<float>(kc);
    if (signal && warp >= tasks) named_barrier_arrive(2, 160);
    for (uint32_t first = 0; first + warp < tasks; first += HALVES * U) {
        // Steps u where this warp's first half has a task (the second half's are a subset).
        const uint32_t steps = min(static_cast<uint32_t>(U), (tasks - first - warp + HALVES - 1) / HALVES);
        uint4 raw[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t task = first + hw + HALVES * u;
            raw[u] = make_uint4(0, 0, 0, 0);
            if (task < tasks) {
                const DivSmall tj = div_small(task, kc, inv_kc);
                const uint32_t r = row0 + tj.q;
                const uint32_t src = gather ? static_cast<uint32_t>(__ldg(gather + r)) / gather_div : r;
                raw[u] = __ldg(reinterpret_cast<const uint4*>(x + static_cast<size_t>(src) * k + tj.r * 128 + l * 8));
            }
        }
        if (signal && first == 0) named_barrier_arrive(2, 160);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (static_cast<uint32_t>(u) >= steps) break;  // warp-uniform
            const uint32_t task = first + hw + HALVES * u;
            float v[8];
            const float amax = half_warp_block_amax(raw[u], v);
            if (task >= tasks) continue;
            const DivSmall tj = div_small(task, kc, inv_kc);
            const uint32_t t = tj.q, j = tj.r;
            const float s = pow2_scale(amax), inv = pow2_recip(s);
            // Lane l holds k = 128 j + 8 l + i: group l / 4, element 8 (l % 4) + i; the evens go to
            // slots 4 (l % 4).. of the group, the odds to 16 + 4 (l % 4)...
            uint32_t ev = 0, od = 0;
#pragma unroll
            for (int i = 0; i < 8; i += 4) {
                ev |= static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(v[i] * inv, v[i + 2] * inv), __NV_SATFINITE,
                                                                     __NV_E4M3))
                      << (8 * (i / 2));
                od |= static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(v[i + 1] * inv, v[i + 3] * inv),
                                                                     __NV_SATFINITE, __NV_E4M3))
                      << (8 * (i / 2));
            }
            uint8_t* row = xs + j * N * 128 + t * 128 + 4 * (l % 4);
            *reinterpret_cast<uint32_t*>(row + (((2 * (l / 4)) ^ (t % 8)) * 16)) = ev;
            *reinterpret_cast<uint32_t*>(row + (((2 * (l / 4) + 1) ^ (t % 8)) * 16)) = od;
            if (l == 0) sxs[j * N + t] = 64.f * s;
        }
    }
}

// Shared memory of the kernel for k: alignment slack, x (k / 128 tiles of N x 128 bytes), its
// scales (padded to 1 KiB), the W ring and its barriers (fp4q_wg_smem in wgmma.rs).
template <int N> __host__ __device__ constexpr uint32_t f4d_smem(uint32_t k) {
    return 1024 + (k / 128) * N * 128 + ((k / 128) * N * 4 + 1023) / 1024 * 1024 + F4D_STAGES * F4D_W + 2 * F4D_STAGES * 8;
}

template <int N>
__device__ __forceinline__ void fp4q_wg_body(const DiTmaMap& map_w, const __nv_bfloat16* __restrict__ x,
                                             const int32_t* __restrict__ gather, uint32_t gather_div,
                                             const uint8_t* __restrict__ sw, __nv_bfloat16* __restrict__ y,
                                             const int4* __restrict__ chunks, const int32_t* __restrict__ num_chunks,
                                             uint32_t n, uint32_t k, uint32_t pdl, uint32_t pre, uint32_t flags) {
    extern __shared__ uint8_t f4d_smem_raw[];
    pdl_trigger(pdl);
    const uint32_t tiles = n / 64, kc = k / 128, groups = k / 32, pairs = (kc + 1) / 2;
    uint8_t* base = f4d_smem_raw + ((1024 - (smem_addr(f4d_smem_raw) & 1023)) & 1023);
    uint8_t* xs = base;                                                   // [kc][N x 128 bytes]
    float* sxs = reinterpret_cast<float*>(xs + kc * N * 128);             // [kc][N]
    uint8_t* ring = xs + kc * N * 128 + (kc * N * 4 + 1023) / 1024 * 1024;  // F4D_STAGES x F4D_W
    uint64_t* full = reinterpret_cast<uint64_t*>(ring + F4D_STAGES * F4D_W);
    uint64_t* empty = full + F4D_STAGES;
    ring_init(full, empty, F4D_STAGES, 4);  // empty: lane 0 of each compute warp
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 4 && lane == 0) tma_prefetch_map(&map_w);
    // Settled chunks (bit 2): the grid that wrote them had completed before the grid before this one
    // started, so the chunks are read, and the block's W slots issued, before the wait (from L2:
    // ld.global.cg, no L1 line of an earlier read); only the compute warps wait, for x and y.
    const bool one_each = flags & 1u, x_single = flags & 2u, settled = flags & 4u;
    if (!settled) pdl_wait();  // the chunks, x and y belong to the grids before
    auto chunk_at = [&](uint32_t z) { return settled ? __ldcg(chunks + z) : __ldg(chunks + z); };
    // A block an item (the grid covers every item the dispatch can hold): block b's item is b
    // whatever the count, so its chunk is read together with the count, not after it.
    const int32_t count = settled ? __ldcg(num_chunks) : *num_chunks;
    const int4 c_first = one_each ? chunk_at(blockIdx.x / tiles) : make_int4(0, 0, 0, 0);
    const uint32_t items = static_cast<uint32_t>(max(count, 0)) * tiles;
    const uint32_t per = one_each ? 1u : (items + gridDim.x - 1) / gridDim.x;
    const uint32_t i0 = min(blockIdx.x * per, items), i1 = min(i0 + per, items);
    // The block's slots. A block of one or two items (a one-token batch: all of its W at once)
    // issues `pre` of them before its x loads and the rest after (barrier 2), so x does not queue
    // behind every block's slots; a block of more items keeps the slots first (its x is read once
    // for many slots).
    const uint32_t total = (i1 - i0) * pairs;
    const bool split_issue = pre < total && i1 - i0 <= 2;

    if (warp == 4) {
        // Slot j of the block's run: item i0 + j / pairs, k blocks 2 (j % pairs) and + 1.
        auto issue_slots = [&](uint32_t from, uint32_t to) {
            int32_t wrow = 0;
            for (uint32_t j = from; j < to; ++j) {
                const uint32_t it = i0 + j / pairs, p = j % pairs;
                if (j == from || p == 0) {
                    const int4 c = one_each ? c_first : chunk_at(it / tiles);
                    wrow = static_cast<int32_t>(static_cast<uint32_t>(c.x) * n + (it % tiles) * 64);
                }
                const uint32_t s = j % F4D_STAGES;
                mbar_wait(&empty[s], ((j / F4D_STAGES) & 1) ^ 1);
                mbar_arrive_expect_tx(&full[s], F4D_W);
                tma_load_2d(ring + s * F4D_W, &map_w, static_cast<int32_t>(p * 128), wrow, &full[s]);
            }
        };
        if (lane == 0) issue_slots(0, split_issue ? pre : total);
        __syncwarp();
        if (split_issue) {
            named_barrier(2, 160);  // the compute warps have issued their first x loads
            if (lane == 0) issue_slots(pre, total);
            __syncwarp();
        }
        return;
    }

    if (settled) pdl_wait();  // x and y belong to the grids before
    const uint32_t g = lane / 4, q = lane % 4;
    // This thread's W words: row 16 warp + g (+ 8 rows: 1024 bytes on, same swizzle), unit u at
    // u ^ g, word q.
    const uint32_t w_off = (16 * warp + g) * 128 + 4 * q;
    // k block 0's x tile; only the descriptor's low word (the start address) moves, so offsets are
    // 32-bit adds (a 64-bit add and its carry cost twice the instructions in the loop).
    const uint64_t x_desc0 = wgmma_desc_sw128(smem_addr(xs));
    const uint32_t x_lo0 = static_cast<uint32_t>(x_desc0);
    const uint64_t x_hi = x_desc0 & 0xFFFFFFFF00000000ull;
    // The slots' W words a step ahead: this thread's 16 words of slot jj (k block h, step st at
    // 8 h + 2 st, row + 8 next), read once the slot has landed; the slot is free again once they
    // are widened.
    uint32_t wv[16];
    auto fetch = [&](uint32_t jj) {
        mbar_wait(&full[jj % F4D_STAGES], (jj / F4D_STAGES) & 1);
        const uint8_t* wt = ring + (jj % F4D_STAGES) * F4D_W + w_off;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint32_t u = ((i ^ g) % 8) * 16;  // unit i = 4 h + st of the row, swizzled
            wv[2 * i] = *reinterpret_cast<const uint32_t*>(wt + u);
            wv[2 * i + 1] = *reinterpret_cast<const uint32_t*>(wt + 8 * 128 + u);
        }
    };
    if (total > 0 && !split_issue) fetch(0);
    uint32_t j = 0, rounded = ~0u;  // slots consumed so far; the chunk whose x is in xs
    // x of one row (a one-token batch): every row of every chunk is x's row 0 (the caller
    // checked), so it is rounded before any chunk is known, as a one-row chunk's x.
    const bool single_ready = x_single && i0 < i1;
    if (single_ready) {
        f4d_round_x<N>(x, nullptr, 1, 0, 1, k, xs, sxs, warp, lane, split_issue);
        fence_proxy_async_smem();  // written by the threads, read by the wgmmas
        named_barrier(1, 128);
    }
    for (uint32_t it = i0; it < i1; ++it) {
        const uint32_t z = it / tiles;
        const int4 c = one_each ? c_first : chunk_at(z);
        const uint32_t row0 = static_cast<uint32_t>(c.y), m = static_cast<uint32_t>(c.z);
        const uint32_t rg = (it % tiles) * 64 + 16 * warp + g;
        const uint8_t* sg = sw + (static_cast<size_t>(c.x) * n + rg) * groups;
        const uint8_t* sh = sg + 8 * static_cast<size_t>(groups);
        // W's group scales are read a k-block pair ahead of their use (the words of pair kb / 2:
        // rows rg and rg + 8, k blocks kb and kb + 1), so the loop's reads do not wait on memory:
        // read where they were used, each fourth pair's missed its L1 sector and stalled the
        // block's ring for a memory latency. (Bringing the item's scale rows into L2 first as well
        // changed nothing: benches/results/2026-12-05-fp4-scale-variants.)
        auto scales_at = [&](uint32_t kb) {
            const bool two = kb + 1 < kc;
            return make_uint4(__ldg(reinterpret_cast<const uint32_t*>(sg + 4 * kb)),
                              __ldg(reinterpret_cast<const uint32_t*>(sh + 4 * kb)),
                              two ? __ldg(reinterpret_cast<const uint32_t*>(sg + 4 * kb + 4)) : 0u,
                              two ? __ldg(reinterpret_cast<const uint32_t*>(sh + 4 * kb + 4)) : 0u);
        };
        uint4 sc_next = scales_at(0);
        if (z != rounded && !(single_ready && m == 1)) {
            named_barrier(1, 128);  // every warp is done with the previous chunk's x and scales
            f4d_round_x<N>(x, gather, gather_div, row0, m, k, xs, sxs, warp, lane,
                           split_issue && rounded == ~0u && !single_ready);
            fence_proxy_async_smem();  // written by the threads, read by the wgmmas
            named_barrier(1, 128);
            rounded = z;
        }
        if (it == i0 && split_issue) fetch(0);  // the first slot's words, after x's loads went out
        float acc[N / 2];
#pragma unroll
        for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
        uint32_t fa[4][4], fb[4][4];
        float da[4][N / 2], db[4][N / 2];
        // The fetched words of k block h, widened into fragments f.
        auto widen = [&](uint32_t h, uint32_t (&f)[4][4]) {
#pragma unroll
            for (int st = 0; st < 4; ++st) {
                fp4x8_to_e4m3_lo6(wv[8 * h + 2 * st], f[st][0], f[st][2]);
                fp4x8_to_e4m3_lo6(wv[8 * h + 2 * st + 1], f[st][1], f[st][3]);
            }
        };
        auto mma = [&](uint32_t xlo, const uint32_t (&f)[4][4], float (&d)[4][N / 2]) {
#pragma unroll
            for (int st = 0; st < 4; ++st) wgmma_fence_regs(d[st]);
            wgmma_fence();
#pragma unroll
            for (int st = 0; st < 4; ++st) wgmma_rs_e4m3<N>(d[st], f[st], x_hi | (xlo + 2 * st));  // + 32 bytes a step
            wgmma_commit();
        };
        // k block kb's sums (done) times the rows' group scales (words scg, sch: 4 ue8m0 bytes each),
        // then the columns' x scales (2 q, 2 q + 1, + 8 ...).
        auto add = [&](uint32_t kb, float (&d)[4][N / 2], uint32_t scg, uint32_t sch) {
#pragma unroll
            for (int st = 0; st < 4; ++st) wgmma_fence_regs(d[st]);
            float blk[N / 2];
#pragma unroll
            for (int st = 0; st < 4; ++st) {
                const float fg = __uint_as_float((scg >> (8 * st) & 0xFFu) << 23);
                const float fh = __uint_as_float((sch >> (8 * st) & 0xFFu) << 23);
#pragma unroll
                for (int i = 0; i < N / 2; ++i) {
                    const float f = (i % 4) < 2 ? fg : fh;
                    blk[i] = st == 0 ? d[st][i] * f : fmaf(d[st][i], f, blk[i]);
                }
            }
#pragma unroll
            for (int i = 0; i < N / 8; ++i) {
                const float2 xsc = *reinterpret_cast<const float2*>(sxs + kb * N + 8 * i + 2 * q);
                acc[4 * i] = fmaf(blk[4 * i], xsc.x, acc[4 * i]);
                acc[4 * i + 1] = fmaf(blk[4 * i + 1], xsc.y, acc[4 * i + 1]);
                acc[4 * i + 2] = fmaf(blk[4 * i + 2], xsc.x, acc[4 * i + 2]);
                acc[4 * i + 3] = fmaf(blk[4 * i + 3], xsc.y, acc[4 * i + 3]);
            }
        };
        for (uint32_t kb = 0; kb < kc; kb += 2, ++j) {
            const uint4 sc = sc_next;
            if (kb + 2 < kc) sc_next = scales_at(kb + 2);
            const uint32_t sg0 = sc.x, sh0 = sc.y, sg1 = sc.z, sh1 = sc.w;
            const bool two = kb + 1 < kc;
            const uint32_t xd = x_lo0 + kb * (N * 128 / 16);
            widen(0, fa);
            if (two) widen(1, fb);
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[j % F4D_STAGES]);  // the slot's words are in registers
            // The next slot's words load under this slot's MMAs (its wait comes first: a wait loop
            // with a wgmma in flight serialises them, C7520).
            if (j + 1 < total) fetch(j + 1);
            if (two) {
                mma(xd, fa, da);
                mma(xd + N * 128 / 16, fb, db);
                wgmma_wait<1>();
                add(kb, da, sg0, sh0);
                wgmma_wait<0>();
                add(kb + 1, db, sg1, sh1);
            } else {
                mma(xd, fa, da);
                wgmma_wait<0>();
                add(kb, da, sg0, sh0);
            }
        }
        // acc[i]: row rg (+ 8 for i % 4 >= 2), column 8 (i / 4) + 2 q + i % 2.
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const uint32_t row = rg + ((i % 4) >= 2 ? 8 : 0), col = 8 * (i / 4) + 2 * q + (i % 2);
            if (col < m) y[static_cast<size_t>(row0 + col) * n + row] = __float2bfloat16_rn(acc[i]);
        }
    }
}

}  // namespace
#define DI_FP4Q_WG_BODY(N) \
    fp4q_wg_body<N>(map_w, x, gather, gather_div, sw, y, chunks, num_chunks, n, k, pdl, pre, flags)
#else
#define DI_FP4Q_WG_BODY(N) __trap()
#endif

// map_w: the experts' W bytes [experts * n, k / 2] back to back (box 64 rows x 128 bytes, 128-byte
// swizzle); x bf16 [.., k], row r of the dispatch at gather[r] / gather_div (gather null: row r);
// sw: W's ue8m0 scales [experts * n, k / 32]; y [rows, n]; chunks (expert, first row, rows <= N, 0),
// num_chunks[0] of them. k % 128 == 0, n % 64 == 0; the shared memory of f4d_smem<N>(k). 160
// threads; MINB blocks an SM (registers). pdl: launched with programmatic dependent launch
// (pdl_trigger). pre: W slots a block issues before its first x loads (all of them when >= its
// slots; else the rest once those loads are out). flags: bit 0, the grid has a block for every
// item the chunks' buffer can hold (block b takes item b); bit 1, x has one row, which every
// dispatch row reads (a one-token batch); bit 2, the chunks are settled: the grid that wrote them
// completed before the grid before this one started (a grouped GEMM over the same dispatch came
// between), so they are read, and W issued, before the wait for that grid.
#define DI_GEMM_FP4Q_WG(N, MINB)                                                                                \
    extern "C" __global__ void __launch_bounds__(160, MINB) di_gemm_fp4q_wg_n##N(                              \
        const __grid_constant__ DiTmaMap map_w, const __nv_bfloat16* __restrict__ x,                           \
        const int32_t* __restrict__ gather, uint32_t gather_div, const uint8_t* __restrict__ sw,               \
        __nv_bfloat16* __restrict__ y, const int4* __restrict__ chunks, const int32_t* __restrict__ num_chunks, \
        uint32_t n, uint32_t k, uint32_t pdl, uint32_t pre, uint32_t flags) {                                  \
        DI_FP4Q_WG_BODY(N);                                                                                    \
    }
DI_GEMM_FP4Q_WG(8, 3)
DI_GEMM_FP4Q_WG(16, 2)
#if DI_SM90
static_assert(f4d_smem<8>(4096) == 75856 && f4d_smem<16>(4096) == 109648, "wgmma.rs fp4q_wg_smem");
#endif
