// Decode attention on Hopper (sm_90a) with warpgroup MMAs: the same op, arguments and outputs as
// di_attn_decode (attention.cu, which states the math): per (sequence, split of its keys) one block
// with all <= 64 heads, so every key row is read from memory once. Two splits run as a cluster of
// two blocks that merge through distributed shared memory (the _c2 kernels); more write fp32
// partials that di_attn_decode_combine merges. Two kernel families (the launcher picks, see
// attention.rs's decode_kernel):
// - the turn-taking kernels (attn_decode_wg: di_attn_decode_wg, persistent for prefill and many
//   sequences, and di_attn_decode_wg_c2), described here;
// - the S-warpgroup kernels (attn_decode_sp: di_attn_decode_sp, one split, and
//   di_attn_decode_sp_c2), described at attn_decode_sp: one warpgroup holds Q in registers and
//   does S and the softmax, two do P V, three key stages.
//
// Turn-taking block: three warpgroups. Warpgroup 0 gathers: one thread loads the query rows by TMA, then its
// 128 threads copy each 64-key tile (the rows named by key_rows, 1 KB each) with cp.async into
// 128-byte-swizzled shared memory (eight 8 KB column chunks of 64 rows x 64 bf16), two stages,
// signalled through mbarriers (cp.async.mbarrier.arrive). In the persistent form (a block looping
// over sequences: prefill) the Q buffer and the two stages rotate (Bufs), so the next Q loads as
// soon as the stage of the sequence's last-but-one tile is done, not after its last S. A tile
// whose 64 rows are consecutive in the pool (a whole page of a paged cache: HCA's compressed rows)
// is instead eight TMA boxes issued by one thread (map_kv: the pool as bytes [pool_rows, 1024],
// boxes of 64 rows x 128 bytes), when the flags' kFlagTmaRuns is set. Warpgroups 1 and 2 take
// turns (FlashMLA's arrangement): the owner of tile t (warpgroup 1 + t % 2) computes
//   S = Q K^T   wgmma m64n64k16 over the whole 64-key tile and all 512 dims;
//   softmax     from the running max and sum the other warpgroup left after tile t - 1, writing
//               the bf16 probabilities into P[t % 2] and the new max, sum and rescale factor per
//               row into shared memory (an mbarrier says they are in place);
// then both run O = alpha O + P V, wgmma m64n256k16, warpgroup c owning output columns
// 256c..256c+255 (128 fp32 accumulators a thread), V = the same key tile read MN-major (the
// instruction transposes it). While one warpgroup does its softmax the other's MMAs run.
// (The first version split every tile's keys between the two warpgroups, n = 32 each, in lock
// step: S read Q from shared memory twice as often and the tensor cores idled during softmax.)
// The softmax works in base 2 (kLog2e) and O is rescaled only when a row's max moved.
// The key stage is released when its P V has completed. The probabilities are rounded to bf16
// exactly as in di_attn_decode, and the sums add those rounded values. Outputs leave through
// shared memory as whole 512-byte row pieces (per-thread bf16 pairs straight to global memory
// wrote 16-byte pieces of 8 rows per warp store and took ~4 us of a 15 us call), by TMA stores
// from the last tile's stage, which is given back once they have read it: where the next sequence
// has its first MMAs in flight or waits anyway (release).
//
// Measured on the H200: benches/results/2026-11-30-attention-wgmma (the versions and the
// experiments that were not kept), 2026-12-01-attention-decode-costs (where a decode call's time
// goes: the loads alone reach 0.77-0.85 of the floor, the math adds 8-10 us, the merge 4.3-4.6 us)
// and 2026-12-01-attention-s-warpgroup (the S-warpgroup kernels; the head dims split between the
// math warpgroups, not kept: the partial-S swap and the doubled softmax on every tile's chain).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cpasync.cuh"
#include "mma.cuh"
#include "sm90.cuh"

constexpr int DI_ATTN_WG_THREADS = 3 * 128;  // gather warpgroup + two math warpgroups
constexpr int SP_THREADS_HOST = 4 * 128;     // di_attn_decode_sp(_c2): gather, S, two P V warpgroups

#if DI_SM90
namespace {

constexpr int D = 512;                 // head dimension (the single K=V head)
constexpr int HM = 64;                 // query rows (heads) of a block; rows >= heads are zero
constexpr int KT = 64;                 // keys per tile
constexpr int STAGES = 2;              // key tiles in flight
constexpr int CHUNK = 64 * 128;        // 64 rows x 128 bytes (64 bf16 columns), swizzled
constexpr int TILE = (D / 64) * CHUNK;  // one 64-row x 512 bf16 tile: 64 KB
// Dynamic shared memory (ATTN_WG_SMEM in attention.rs): 1024 bytes of alignment slack, Q, the key
// stages, two P tiles, the max, sum and rescale factor per row of two tiles, the cluster merge's
// max and sum per row, the key rows of two tiles, the barriers (full, empty, pready, Q, Q free).
constexpr int SMEM = 1024 + TILE + STAGES * TILE + 2 * HM * 128 + 2 * 3 * HM * 4 + 2 * HM * 4 + 2 * KT * 4 + (3 * STAGES + 2) * 8;
static_assert(SMEM == 216640, "attention.rs ATTN_WG_SMEM");

// Which of the three 64 KB buffers at base + i * TILE holds Q and which each key stage: between two
// sequences of a persistent block the next Q goes into the stage that does not hold the last key
// tile (free once that stage's last P V is done, earlier than Q's own buffer, which waits for the
// last S), and Q's old buffer becomes that stage.
struct Bufs {
    uint32_t q = 0, st0 = 1, st1 = 2;
    __device__ __forceinline__ uint32_t stage(uint32_t s) const { return s ? st1 : st0; }
    __device__ __forceinline__ void swap_q(uint32_t s) {
        const uint32_t t = stage(s);
        if (s)
            st1 = q;
        else
            st0 = q;
        q = t;
    }
};

// Whether Bufs rotate before a persistent block's sequence qi (tiles key tiles) after one of
// prev_tiles: the gather warpgroup and the math warpgroups apply the same rule (see the gather).
__device__ __forceinline__ bool bufs_rotate(bool c2, uint32_t qi, uint32_t prev_tiles, uint32_t tiles) {
    return !c2 && qi > 0 && prev_tiles > 1 && tiles > 0;
}

// The softmax runs in base 2: scores times scale log2(e) against a running max kept the same way
// (exp(x) = 2^(x log2 e)), so a probability is one subtraction and one ex2.
constexpr float kLog2e = 1.4426950408889634f;
// 2^x (ex2.approx.ftz: 2^-inf = 0), what __expf uses after scaling by log2(e).
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Which of a thread's 16 key columns of a tile (8j + 2 (lane % 4) + e, bit 2j + e) are real keys:
// the tile's pool rows ix (-1: no key).
__device__ __forceinline__ uint32_t tile_valid(const int32_t* ix, int lane) {
    uint32_t valid = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
            if (ix[8 * j + 2 * (lane % 4) + e] >= 0) valid |= 1u << (2 * j + e);
    return valid;
}

// The online softmax of a 64-key tile held as a wgmma m64n64 accumulator (a thread's rows rr[e],
// its 16 key columns; `valid` says which are real keys), in base 2. tile_max masks and scales sc in
// place (a masked key is -inf), moves the running max m_run and gives each row's rescale factor
// alpha and what its probabilities subtract (msub: a row with no key yet, no sink either, subtracts
// 0 instead of -inf, and all its keys are -inf, so 2^-inf = 0).
__device__ __forceinline__ void tile_max(float (&sc)[32], uint32_t valid, float scale2, float (&m_run)[2], float (&alpha)[2],
                                         float (&msub)[2]) {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const bool ok = (valid >> (2 * j + (e & 1))) & 1;
            sc[4 * j + e] = ok ? sc[4 * j + e] * scale2 : -INFINITY;
            mx[e / 2] = fmaxf(mx[e / 2], sc[4 * j + e]);
        }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
        mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
        const float m_new = fmaxf(m_run[e], mx[e]);
        alpha[e] = m_run[e] == -INFINITY ? 0.f : ex2_approx(m_run[e] - m_new);
        m_run[e] = m_new;
        msub[e] = m_new == -INFINITY ? 0.f : m_new;
    }
}

// The tile's probabilities rounded to bf16 (key columns 8j + 2 (lane % 4) and + 1 of row rr[e] in
// pb[j][e]) and each row's sum over the tile of exactly those rounded values (what P V multiplies).
__device__ __forceinline__ void tile_probs(const float (&sc)[32], const float (&msub)[2], uint32_t (&pb)[8][2], float (&sum)[2]) {
    sum[0] = sum[1] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float* v = sc + 4 * j + 2 * e;
            const __nv_bfloat162 p2 = __floats2bfloat162_rn(ex2_approx(v[0] - msub[e]), ex2_approx(v[1] - msub[e]));
            sum[e] += __low2float(p2) + __high2float(p2);
            pb[j][e] = *reinterpret_cast<const uint32_t*>(&p2);
        }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        sum[e] += __shfl_xor_sync(0xffffffffu, sum[e], 1);
        sum[e] += __shfl_xor_sync(0xffffffffu, sum[e], 2);
    }
}

// P (pb of tile_probs) into a 64 x 64 bf16 tile at pt in the 128-byte swizzle, as wgmma reads it.
__device__ __forceinline__ void store_p(uint8_t* pt, const uint32_t (&pb)[8][2], const int (&rr)[2], int lane) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) *reinterpret_cast<uint32_t*>(pt + rr[e] * 128 + ((j ^ (rr[e] % 8)) * 16) + (lane % 4) * 4) = pb[j][e];
}

// The running sum after a tile (l = l alpha + the tile's sum) and, from the first thread of each
// row's four, the row's max, sum and rescale factor into the stats at st ([m, l, alpha][HM]).
__device__ __forceinline__ void tile_stats(float* st, float (&l_tot)[2], const float (&m_run)[2], const float (&alpha)[2],
                                           const float (&sum)[2], const int (&rr)[2], int lane) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        l_tot[e] = l_tot[e] * alpha[e] + sum[e];
        if (lane % 4 == 0) {
            st[rr[e]] = m_run[e];
            st[HM + rr[e]] = l_tot[e];
            st[2 * HM + rr[e]] = alpha[e];
        }
    }
}

// The launch's flags word: kFlagTmaRuns, page tiles by TMA (publish_rows); kFlagMergeF32, the
// cluster merge sends its partial as fp32 instead of scaled f16 (c2_merge); kFlagPdl, the grid was
// launched with programmatic dependent launch (pdl_start); kFlagHeadHalves, the one-split S-warpgroup
// kernel's grid covers each sequence twice, block b taking sequence b / 2's heads (b % 2) * heads..
// + heads (the launch passes half the heads, and Q and out as [2 batch, heads / 2, 512]).
// kFlagSHalfFirst, the S-warpgroup kernels' S starts on a tile's first half of dims before its
// second half has landed (attn_decode_sp).
constexpr uint32_t kFlagTmaRuns = 1, kFlagMergeF32 = 2, kFlagPdl = 4, kFlagHeadHalves = 8, kFlagSHalfFirst = 16;

// Programmatic dependent launch (sm90.cuh): a block sets up its barriers and shared memory while
// the grid before it in the stream still runs, waits for that grid here, before its first read of
// anything (Q, the key rows and counts, the pool: the kernels before attention write this step's
// rows), and lets the grid after it launch at once: no block of that grid fits beside one of these
// (one block an SM), so it only takes SMs as these blocks leave, and does its own setup (a GEMM's
// first weight tiles) under this grid's tail instead of after it.
__device__ __forceinline__ void pdl_start(uint32_t flags) {
    pdl_wait();
    pdl_trigger(flags & kFlagPdl);
}

// The gather warpgroup's thread t publishes the pool row of key t of the next tile in ix (threads
// 0-63; -1: no key) and all 128 agree (barrier 2) whether the tile's 64 rows are one run of
// consecutive pool rows (a page of a paged cache), which then loads by TMA when the flags'
// kFlagTmaRuns is set.
__device__ __forceinline__ bool publish_rows(int32_t* ix, uint32_t t, int32_t next, int32_t next0, uint32_t flags) {
    if (t < KT) ix[t] = next;
    const bool mine = t >= KT || (next >= 0 && next == next0 + static_cast<int32_t>(t));
    return named_barrier_and(2, 128, mine) && (flags & kFlagTmaRuns) != 0;
}

// Column chunks c0..c0 + NC - 1 (64 bf16 each) of a key tile into dst (the 128-byte-swizzled tile
// layout), signalled on bar: a run of pool rows starting at `first` as NC TMA boxes of 64 rows x 128
// bytes issued by thread 0 (the bytes counted on bar), any other tile row by row, 8 NC consecutive
// threads a row's 16-byte pieces by cp.async (a row with no key: zeros); every gather thread's
// cp.async arrival plus thread 0's plain one complete bar.
template <int NC>
__device__ __forceinline__ void load_tile_chunks(uint8_t* dst, uint64_t* bar, const int32_t* ix, bool run, int32_t first,
                                                 uint32_t t, uint32_t c0, const __nv_bfloat16* __restrict__ kv,
                                                 const DiTmaMap& map_kv) {
    if (t == 0) {
        if (run) mbar_expect_tx(bar, NC * CHUNK);
        mbar_arrive(bar);
    }
    if (run) {
        if (t == 0)
            for (uint32_t c = c0; c < c0 + NC; ++c) tma_load_2d(dst + c * CHUNK, &map_kv, c * 128, first, bar);
    } else {
        // Thread t copies unit v of rows PER w .. PER w + PER - 1 (w = t / U): their pool rows
        // come four at a time (one 16-byte shared load), the source column and destination chunk
        // are fixed, and row PER w + i's swizzle (v % 8) ^ (i % 8) is an XOR into bits 4-6 of a
        // per-thread shared address (rows PER w are 8-row aligned), its row a constant offset:
        // a compare, a clamp, a multiply-add and the copy (computing each unit's swizzled offset
        // afresh took ~18 instructions a copy, and the gather warpgroup's issue was on the S
        // warpgroup's critical path: ncu, H100; benches/results/2026-12-05-attention-index-ring).
        constexpr uint32_t U = 8 * NC;     // 16-byte units of a row this call copies
        constexpr uint32_t PER = KT * U / 128;  // rows a thread copies
        static_assert(PER % 8 == 0, "a thread's rows start 8-row aligned");
        const uint32_t v = 8 * c0 + t % U, w = t / U;
        const uint32_t a0 = smem_addr(dst) + (v / 8) * CHUNK + PER * w * 128 + (v % 8) * 16;
        const uint8_t* s0 = reinterpret_cast<const uint8_t*>(kv) + v * 16;
        const int4* ixw = reinterpret_cast<const int4*>(ix + PER * w);
#pragma unroll
        for (uint32_t q = 0; q < PER / 4; ++q) {
            const int4 r4 = ixw[q];
            const int32_t rs[4] = {r4.x, r4.y, r4.z, r4.w};
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) {
                const uint32_t i = 4 * q + e;
                const int32_t r = rs[e];
                const uint32_t rr = r < 0 ? 0u : static_cast<uint32_t>(r);
                cp_async16_sa((a0 ^ ((i % 8) * 16)) + i * 128, s0 + static_cast<size_t>(rr) * (D * 2), r < 0);
            }
        }
    }
    cp_async_arrive_noinc(bar);
}

// A math warpgroup's 64 rows x 256 output columns (O in the m64n256 accumulator layout) times fin
// per row, as bf16, to out[b, :, col0..col0 + 256): staged at `stage` as four 64-row x 64-column
// boxes in the 128-byte swizzle (conflict-free), then four TMA stores by the warpgroup's first
// thread (rows past the head count are not written: map_out), which returns true: its stores read
// the staging later (bulk_wait_read before the stage is reused or the block ends).
__device__ __forceinline__ bool store_out(uint8_t* stage, const float (&o)[128], const float (&fin)[2], uint32_t col0, uint32_t b,
                                          const DiTmaMap& map_out, const int (&rr)[2], int lane, uint32_t wt, int cw) {
#pragma unroll
    for (int j = 0; j < 32; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const uint32_t at = (j / 8) * 8192 + rr[e] * 128 + (((j % 8) ^ (rr[e] % 8)) * 16) + (lane % 4) * 4;
            *reinterpret_cast<__nv_bfloat162*>(stage + at) = __floats2bfloat162_rn(o[4 * j + 2 * e] * fin[e], o[4 * j + 2 * e + 1] * fin[e]);
        }
    fence_proxy_async_smem();  // the staging writes before the TMA engine reads them
    named_barrier(3 + cw, 128);
    if (wt != 0) return false;
#pragma unroll
    for (int c = 0; c < 4; ++c) tma_store_3d(&map_out, stage + c * 8192, static_cast<int32_t>(2 * col0 + 128 * c), 0, static_cast<int32_t>(b));
    bulk_commit();
    return true;
}

// The power of two 2^k that brings a row's largest magnitude amax into [2^13, 2^14) (k = 0 for a
// row of zeros, and k within +-100 so that 2^k and 2^-k are normal floats).
__device__ __forceinline__ int f16_shift(float amax) {
    if (!(amax > 0.f)) return 0;
    const int e = static_cast<int>((__float_as_uint(amax) >> 23) & 0xffu) - 127;  // floor(log2 amax)
    return min(max(13 - e, -100), 100);
}

// Two floats as the bits of an f16 pair (a in the low half), and back.
__device__ __forceinline__ uint32_t f16x2_bits(float a, float b) {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float2 f16x2_floats(uint32_t u) {
    return __half22float2(*reinterpret_cast<const __half2*>(&u));
}

// Two splits as a cluster of two blocks: block r finalises output columns 256r..256r + 255. Math
// warpgroup cw != r of each block sends its unnormalised O into the other block's buffer xo (a free
// 64 KB stage) and its row max and sum (base 2) into the other block's `red`, and returns false;
// warpgroup r merges them into its O, out = (o 2^(m - M) + v 2^(m1 - M)) / (l 2^(m - M) + l1 2^(m1 -
// M)) with M = max(m, m1), and returns true with the 1 / denominator per row in fin. Both cluster
// barriers need every thread of both blocks (the other warpgroups call cluster_sync twice); the
// first waits until both blocks are done with their stages.
// The partial goes, by default, as f16 scaled per row: each row's values times 2^k (f16_shift of
// the row's largest magnitude, so no value overflows f16 and each keeps 11 significant bits), with
// l1 2^k and m1 - k in place of l1 and m1, which leaves the merge's formula as it is (2^k cancels).
// Eight values a uint4, uint4 j of thread wt at (j * 128 + wt) * 16 (conflict-free): 32 KB through
// distributed shared memory, whose ~34 GB/s a block made the 64 KB of fp32 ~1.9 us of a call
// (benches/results/2026-12-01-attention-decode-costs). With f32 (kFlagMergeF32) it goes as fp32,
// float4 i at (i * 128 + wt) * 16. (A bf16 partial saved as much but added an error the size of the
// output's own rounding: benches/results/2026-12-01-attention-merge-ab.)
__device__ __forceinline__ bool c2_merge(float (&o)[128], const float (&m_run)[2], const float (&l_tot)[2], int cw, uint32_t wt,
                                         int lane, const int (&rr)[2], uint8_t* xo, float* red, float (&fin)[2], bool f32) {
    const uint32_t rank = cluster_ctarank();
    cluster_sync();
    if (cw != static_cast<int>(rank)) {
        const uint32_t o_remote = mapa_shared(smem_addr(xo), rank ^ 1), red_remote = mapa_shared(smem_addr(red), rank ^ 1);
        float m_send[2] = {m_run[0], m_run[1]}, l_send[2] = {l_tot[0], l_tot[1]};
        if (f32) {
#pragma unroll
            for (int i = 0; i < 32; ++i) st_cluster_v4(o_remote + (i * 128 + wt) * 16, o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]);
        } else {
            // A row's 256 columns lie in the four threads of a quad (o[4i + 2e], o[4i + 2e + 1]: row rr[e]).
            float amax[2] = {0.f, 0.f};
#pragma unroll
            for (int i = 0; i < 32; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) amax[e] = fmaxf(amax[e], fmaxf(fabsf(o[4 * i + 2 * e]), fabsf(o[4 * i + 2 * e + 1])));
            float sc[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                amax[e] = fmaxf(amax[e], __shfl_xor_sync(0xffffffffu, amax[e], 1));
                amax[e] = fmaxf(amax[e], __shfl_xor_sync(0xffffffffu, amax[e], 2));
                const int k = f16_shift(amax[e]);
                sc[e] = __uint_as_float(static_cast<uint32_t>(127 + k) << 23);
                m_send[e] -= static_cast<float>(k);
                l_send[e] *= sc[e];
            }
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                uint32_t w[4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int i = 2 * j + h;
                    w[2 * h] = f16x2_bits(o[4 * i] * sc[0], o[4 * i + 1] * sc[0]);
                    w[2 * h + 1] = f16x2_bits(o[4 * i + 2] * sc[1], o[4 * i + 3] * sc[1]);
                }
                st_cluster_v4_u32(o_remote + (j * 128 + wt) * 16, make_uint4(w[0], w[1], w[2], w[3]));
            }
        }
        if (lane % 4 == 0)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                st_cluster_f32(red_remote + rr[e] * 4, m_send[e]);
                st_cluster_f32(red_remote + (HM + rr[e]) * 4, l_send[e]);
            }
    }
    cluster_sync();
    if (cw != static_cast<int>(rank)) return false;
    float w[2], w1[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const float m1 = red[rr[e]], l1 = red[HM + rr[e]];
        const float mx = fmaxf(m_run[e], m1);
        w[e] = m_run[e] == -INFINITY ? 0.f : ex2_approx(m_run[e] - mx);
        w1[e] = m1 == -INFINITY ? 0.f : ex2_approx(m1 - mx);
        const float den = l_tot[e] * w[e] + l1 * w1[e];
        fin[e] = den > 0.f ? 1.f / den : 0.f;
    }
    if (f32) {
        const float4* other = reinterpret_cast<const float4*>(xo);
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const float4 v = other[i * 128 + wt];
            o[4 * i] = o[4 * i] * w[0] + v.x * w1[0];
            o[4 * i + 1] = o[4 * i + 1] * w[0] + v.y * w1[0];
            o[4 * i + 2] = o[4 * i + 2] * w[1] + v.z * w1[1];
            o[4 * i + 3] = o[4 * i + 3] * w[1] + v.w * w1[1];
        }
        return true;
    }
    const uint4* other = reinterpret_cast<const uint4*>(xo);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const uint4 u = other[j * 128 + wt];
        const uint32_t uv[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int i = 2 * j + h;
            const float2 a = f16x2_floats(uv[2 * h]), c = f16x2_floats(uv[2 * h + 1]);
            o[4 * i] = o[4 * i] * w[0] + a.x * w1[0];
            o[4 * i + 1] = o[4 * i + 1] * w[0] + a.y * w1[0];
            o[4 * i + 2] = o[4 * i + 2] * w[1] + c.x * w1[1];
            o[4 * i + 3] = o[4 * i + 3] * w[1] + c.y * w1[1];
        }
    }
    return true;
}

// O times the rescale factor alpha of its rows (the stats at st), only in a warp where some row's
// max moved (most tiles once the maxima settle).
__device__ __forceinline__ void rescale_o(float (&o)[128], const float* st, const int (&rr)[2]) {
    const float a0 = st[2 * HM + rr[0]], a1 = st[2 * HM + rr[1]];
    if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            o[4 * j] *= a0;
            o[4 * j + 1] *= a0;
            o[4 * j + 2] *= a1;
            o[4 * j + 3] *= a1;
        }
    }
}

// The running max (base 2) and sum of rows rr before any key: split 0 counts the sink as a key of
// value zero (weight 2^(sink log2 e - m) = 1 at m = the sink's), other splits start empty.
__device__ __forceinline__ void sink_state(bool split0, const int (&rr)[2], uint32_t heads, const float* __restrict__ sink,
                                           float (&m_run)[2], float (&l_tot)[2]) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const bool with_sink = split0 && rr[e] < static_cast<int>(heads);
        m_run[e] = with_sink ? sink[rr[e]] * kLog2e : -INFINITY;
        l_tot[e] = with_sink ? 1.f : 0.f;
    }
}
}  // namespace
#endif

#if DI_SM90
namespace {

// The whole op for one block; C2: the grid's two splits of a sequence run as a cluster of two
// blocks, each finalising half of the output columns with the other's partial for them received
// through distributed shared memory (no fp32 partials in global memory, no combine launch).
template <bool C2>
__device__ __forceinline__ void attn_decode_wg(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv,
                                               const int32_t* __restrict__ key_rows,
                                               const int32_t* __restrict__ key_counts, const float* __restrict__ sink,
                                               __nv_bfloat16* __restrict__ out, float* __restrict__ o_part,
                                               float* __restrict__ ml_part, int32_t* __restrict__ status,
                                               uint32_t heads, uint32_t max_keys, uint32_t pool_rows,
                                               uint32_t tiles_per_split, float scale, uint32_t seqs,
                                               const DiTmaMap& map_out, const DiTmaMap& map_kv, const DiTmaMap& map_q, uint32_t flags) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t* base = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    uint8_t* k_s = base + TILE;
    uint8_t* p_s = k_s + STAGES * TILE;                        // [2] P tiles, 64 x 64 bf16
    float* stats = reinterpret_cast<float*>(p_s + 2 * HM * 128);  // [2][m, l, alpha][HM] per tile
    float* red = stats + 2 * 3 * HM;                              // [2][HM]: the cluster merge's m, l
    int32_t* idx = reinterpret_cast<int32_t*>(red + 2 * HM);      // [2][KT] pool rows of the next tiles
    uint64_t* full = reinterpret_cast<uint64_t*>(idx + 2 * KT);
    uint64_t* empty = full + STAGES;
    uint64_t* pready = empty + STAGES;  // [2]: P and the stats of tile t are in place
    uint64_t* q_bar = pready + 2;
    uint64_t* q_free = q_bar + 1;  // the last S of a sequence has read Q
    const uint32_t split = blockIdx.y, splits = gridDim.y;
    // Sequence b's keys of this split: [k_begin, k_end), in tiles of KT.
    auto keys_of = [&](uint32_t b, uint32_t& k_begin, uint32_t& k_end, uint32_t& tiles) {
        const uint32_t count = min(static_cast<uint32_t>(max(key_counts[b], 0)), max_keys);
        k_begin = min(count, split * tiles_per_split * KT);
        k_end = min(count, (split + 1) * tiles_per_split * KT);
        tiles = (k_end - k_begin + KT - 1) / KT;
    };
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 129);  // every gather thread's cp.async arrival + the key rows
            mbar_init(&empty[s], 8);   // lane 0 of each math warp
        }
        for (int j = 0; j < 2; ++j) mbar_init(&pready[j], 128);  // every thread of the tile's owner warpgroup
        mbar_init(q_bar, 1);  // thread 0 of the gather warpgroup, with Q's bytes
        mbar_init(q_free, 1);  // thread 0 of the warpgroup that ran the sequence's last S
        mbar_init_fence();
        tma_prefetch_map(&map_kv);
        tma_prefetch_map(&map_q);
    }
    __syncthreads();
    pdl_start(flags);

    if (wg == 0) {
        setmaxnreg_dec<40>();
        const uint32_t t = threadIdx.x;
        uint32_t g = 0;  // key tiles of this block so far (all its sequences): stage g % STAGES
        Bufs bufs;
        uint32_t prev_tiles = 0, ew0 = 0, ew1 = 0;  // waits on empty[0], empty[1] so far
        auto wait_empty = [&](uint32_t s) {
            const uint32_t n = s ? ew1++ : ew0++;
            mbar_wait(&empty[s], (n & 1) ^ 1);
        };
        for (uint32_t b = blockIdx.x, qi = 0; b < seqs; b += gridDim.x, ++qi) {
            uint32_t k_begin, k_end, tiles;
            keys_of(b, k_begin, k_end, tiles);
            const int32_t* rows = key_rows + static_cast<size_t>(b) * max_keys;
            // Q into the stage that does not hold the previous sequence's last tile (Bufs), once
            // its last P V is done; that stage's next tile (this sequence's first) then goes into
            // Q's old buffer once the previous sequence's last S has read it. Only when the
            // previous sequence had two tiles or more (then that P V came after every math
            // thread's wait for the previous Q, so q_bar's phase is used up) and this one has a
            // tile; otherwise Q stays in its buffer and waits for that S. Q by TMA: eight boxes of
            // 64 heads x 128 bytes (heads past the count read as zeros), one thread.
            const bool rot = bufs_rotate(C2, qi, prev_tiles, tiles);
            if (rot) {
                wait_empty(g % STAGES);
                bufs.swap_q(g % STAGES);
            } else if (qi > 0) {
                mbar_wait(q_free, (qi - 1) & 1);
            }
            uint8_t* q_dst = base + bufs.q * TILE;
            if (t == 0) {
                mbar_arrive_expect_tx(q_bar, TILE);
                for (int c = 0; c < D / 64; ++c) tma_load_3d(q_dst + c * CHUNK, &map_q, c * 128, 0, b, q_bar);
            }
            // The pool rows of a tile's keys go through shared memory (-1: no key), loaded one
            // tile ahead by threads 0-63, so the copies never wait on an index load.
            auto row_of = [&](uint32_t key) { return gather_row(rows, key, k_end, pool_rows, status); };
            // idx[s] also tells the math warpgroups which keys are real: thread 0's plain arrival
            // on full[s] (after the barrier that orders the index stores) publishes it.
            // next0: the tile's first row, which threads 0-63 also load (one address a warp).
            int32_t next = t < KT ? row_of(k_begin + t) : -1;
            int32_t next0 = t < KT ? row_of(k_begin) : -1;
            for (uint32_t it = 0; it < tiles; ++it, ++g) {
                const uint32_t s = g % STAGES;
                if (rot && it == 0)
                    mbar_wait(q_free, (qi - 1) & 1);
                else
                    wait_empty(s);
                // A tile of 64 consecutive pool rows (a page of a paged cache) loads by TMA, any
                // other row by row (load_tile_chunks).
                const bool run = publish_rows(idx + s * KT, t, next, next0, flags);
                const int32_t first = next0;
                if (t < KT) {
                    next = row_of(k_begin + (it + 1) * KT + t);
                    next0 = row_of(k_begin + (it + 1) * KT);
                }
                load_tile_chunks<D / 64>(base + bufs.stage(s) * TILE, &full[s], idx + s * KT, run, first, t, 0, kv, map_kv);
            }
            prev_tiles = tiles;
        }
        cp_async_wait_all();
        if constexpr (C2) {  // every thread of both blocks takes part in the cluster barriers
            cluster_sync();
            cluster_sync();
        }
        return;
    }

    setmaxnreg_inc<232>();
    const int cw = wg - 1;  // S and softmax of the tiles t with t % 2 == cw; output columns 256cw..
    const float scale2 = scale * kLog2e;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    // Accumulator layout (wgmma m64nN): rows r0 = 16 warp + lane / 4 and r0 + 8, columns
    // 8 j + 2 (lane % 4) (+1) in registers 4 j (+1) and 4 j + 2 (+1).
    const int r0 = warp * 16 + lane / 4;
    const int rr[2] = {r0, r0 + 8};
    const uint32_t base_a = smem_addr(base), p_a = smem_addr(p_s);
    Bufs bufs;  // as the gather warpgroup rotates them
    uint32_t prev_tiles = 0;
    uint32_t g = 0;  // key tiles of this block so far: stage g % STAGES, owner warpgroup 1 + g % 2
    // The warpgroup's first thread issues its output stores from a key stage and gives that stage
    // back only once the TMA engine has read it: not right after the stores, but where the next
    // sequence has other work in flight or nothing to do (after its first S is issued, or before
    // waiting for the other warpgroup's P), so the read-out overlaps the next sequence.
    int32_t pending = -1;
    auto release = [&]() {
        if (pending >= 0) {
            bulk_wait_read();
            mbar_arrive(&empty[pending]);
            pending = -1;
        }
    };
    for (uint32_t b = blockIdx.x, qi = 0; b < seqs; b += gridDim.x, ++qi) {
        uint32_t k_begin, k_end, tiles;
        keys_of(b, k_begin, k_end, tiles);
        if (bufs_rotate(C2, qi, prev_tiles, tiles)) bufs.swap_q(g % STAGES);
        prev_tiles = tiles;
        const uint32_t q_a = base_a + bufs.q * TILE;
        // Running max and sum before the first tile: the sink (split 0) as a key of value zero.
        float m_run[2], l_tot[2];
        sink_state(split == 0, rr, heads, sink, m_run, l_tot);
        float o[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) o[i] = 0.f;
        float sc[32];  // S of an owned tile (the first MMA overwrites it)
#pragma unroll
        for (int i = 0; i < 32; ++i) sc[i] = 0.f;
        mbar_wait(q_bar, qi & 1);

        for (uint32_t t = 0; t < tiles; ++t, ++g) {
            const uint32_t s = g % STAGES;
            float* st = stats + (g % 2) * 3 * HM;  // m, l, alpha of tile t
            if (g % 2 == static_cast<uint32_t>(cw)) {
                // S = Q K^T over the whole tile, then the online softmax from the previous tile's
                // state (the other warpgroup's tile, seen when this one waited for its P).
                mbar_wait(&full[s], (g / STAGES) & 1);
                const uint32_t valid = tile_valid(idx + s * KT, lane);
                fence_proxy_async_smem();  // the gathered rows (cp.async) before the tensor cores read them
                wgmma_fence_regs(sc);
                wgmma_fence();
#pragma unroll
                for (int kc = 0; kc < D / 16; ++kc) {
                    const uint32_t off = (kc / 4) * CHUNK + (kc % 4) * 32;
                    wgmma_m64n64k16_bf16(sc, wgmma_desc_sw128(q_a + off), wgmma_desc_sw128(base_a + bufs.stage(s) * TILE + off), kc > 0);
                }
                wgmma_commit();
                release();
                wgmma_wait<0>();
                wgmma_fence_regs(sc);
                // After the sequence's last S, Q may take the next sequence's rows.
                if (t + 1 == tiles && threadIdx.x % 128 == 0) mbar_arrive(q_free);
                if (t > 0) {
                    const float* prev = stats + ((g - 1) % 2) * 3 * HM;
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        m_run[e] = prev[rr[e]];
                        l_tot[e] = prev[HM + rr[e]];
                    }
                }
                float alpha[2], msub[2], sum[2];
                uint32_t pb[8][2];
                tile_max(sc, valid, scale2, m_run, alpha, msub);
                tile_probs(sc, msub, pb, sum);
                store_p(p_s + (g % 2) * HM * 128, pb, rr, lane);
                tile_stats(st, l_tot, m_run, alpha, sum, rr, lane);
                fence_proxy_async_smem();  // P (st.shared) before the tensor cores read it
                mbar_arrive(&pready[g % 2]);
            }
            // O = alpha O + P V on this warpgroup's 256 columns, V = the same key tile read MN-major.
            release();
            mbar_wait(&pready[g % 2], (g / 2) & 1);
            fence_proxy_async_smem();
            rescale_o(o, st, rr);
            wgmma_fence_regs(o);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < KT / 16; ++ks)
                wgmma_m64n256k16_bf16_bmn(o, wgmma_desc_sw128(p_a + (g % 2) * HM * 128 + ks * 32),
                                          wgmma_desc_sw128_mn(base_a + bufs.stage(s) * TILE + cw * 4 * CHUNK + ks * 16 * 128, CHUNK), 1);
            wgmma_commit();
            // Waiting here (the other warpgroup keeps the tensor cores busy meanwhile): with a group
            // in flight across the loop edge ptxas serialises every wgmma of the loop (warning C7515).
            wgmma_wait<0>();
            wgmma_fence_regs(o);
            // The last tile's stage stays this block's until its outputs have left through it.
            if (lane == 0 && t + 1 < tiles) mbar_arrive(&empty[s]);
        }
        if (tiles == 0 && threadIdx.x == 128) mbar_arrive(q_free);  // no S read Q
        // The state after the last tile (the sink's, without tiles).
        if (tiles > 0) {
            const float* last = stats + ((g - 1) % 2) * 3 * HM;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                m_run[e] = last[rr[e]];
                l_tot[e] = last[HM + rr[e]];
            }
        }

        const uint32_t c0 = cw * 256 + 2 * (lane % 4);
        const uint32_t wt = threadIdx.x % 128;  // this thread in its warpgroup

        bool stored = false;  // this thread has output stores in flight from a stage (store_out)
        if constexpr (C2) {
            // The other block's O arrives in this block's first key stage; the outputs leave through
            // the second.
            float f[2];
            if (!c2_merge(o, m_run, l_tot, cw, wt, lane, rr, k_s, red, f, (flags & kFlagMergeF32) != 0)) return;
            stored = store_out(k_s + TILE, o, f, cluster_ctarank() * 256, b, map_out, rr, lane, wt, cw);
        } else if (splits == 1) {
            const float f[2] = {l_tot[0] > 0.f ? 1.f / l_tot[0] : 0.f, l_tot[1] > 0.f ? 1.f / l_tot[1] : 0.f};
            if (tiles > 0) {
                // Through the last tile's stage: this warpgroup's half of it holds the V columns only
                // its own P V read.
                stored = store_out(base + bufs.stage((g - 1) % STAGES) * TILE + cw * HM * 512, o, f, cw * 256, b, map_out, rr, lane, wt, cw);
            } else {
                // No keys (no stage of this sequence): zeros (or the sink's) straight from registers.
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (rr[e] < static_cast<int>(heads))
#pragma unroll
                        for (int j = 0; j < 32; ++j)
                            *reinterpret_cast<__nv_bfloat162*>(out + (static_cast<size_t>(b) * heads + rr[e]) * D + c0 + 8 * j) =
                                __floats2bfloat162_rn(o[4 * j + 2 * e] * f[e], o[4 * j + 2 * e + 1] * f[e]);
            }
        } else {
            // fp32 partials and (m, l) per row, merged by di_attn_decode_combine.
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int h = rr[e];
                if (h >= static_cast<int>(heads)) continue;
                float* dst = o_part + ((static_cast<size_t>(b) * splits + split) * heads + h) * D + c0;
#pragma unroll
                for (int j = 0; j < 32; ++j) *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[4 * j + 2 * e], o[4 * j + 2 * e + 1]);
                if (cw == 0 && lane % 4 == 0) {
                    float* ml = ml_part + ((static_cast<size_t>(b) * splits + split) * heads + h) * 2;
                    ml[0] = m_run[e] / kLog2e;  // the combine works in base e
                    ml[1] = l_tot[e];
                }
            }
        }
        if (lane == 0 && tiles > 0) {
            if (stored)
                pending = static_cast<int32_t>((g - 1) % STAGES);
            else
                mbar_arrive(&empty[(g - 1) % STAGES]);
        }
    }  // sequences
    release();
    if (threadIdx.x % 128 == 0) bulk_wait();  // the output stores are done before the block's memory goes
}

}  // namespace
#endif

#if DI_SM90
namespace {

// Decode with one warpgroup for S (di_attn_decode_sp: one split, a block per sequence;
// di_attn_decode_sp_c2: two, as a cluster that merges like di_attn_decode_wg_c2; the launcher takes
// them for one split and for two splits of four tiles or more): warpgroup 1 holds Q's first 384
// dims in registers (24 A fragments, 96 registers; the last 128 dims stay in shared memory) and for
// every key tile computes S = Q K^T (wgmma m64n64k16) and the softmax, writing P (bf16) and the
// tile's max, sum and rescale factor per row into shared memory; warpgroups 2 and 3 each own 256
// output columns and run O = alpha O + P V on them (wgmma m64n128k16 pairs, shared-memory operands).
// So S and the softmax of tile t + 1 run while P V of tile t does (only the store of P waits for
// it), and with most of Q out of shared memory there are three 64 KB key stages (Q arrives by TMA in
// the third, is taken into registers, then that stage is freed). A key stage is freed half by half:
// columns 256c.. once warpgroup 2 + c's P V is done (S came before it). Registers: 24 (gather), 168
// (S), 160 + 160 (P V) a thread: the whole file for 512 threads.
constexpr int SP_STAGES = 3;
constexpr int SP_QREG = 24;  // k16 steps whose Q fragments the S warpgroup holds; the other 8 (two chunks) in shared memory
static_assert(SP_QREG % 4 == 0 && 32 - SP_QREG == 8, "qs holds exactly two 64-column chunks of Q");
// The gather's ring of key-list entries: two slots of SP_RING_TILES tiles' entries (see the gather).
constexpr int SP_RING_TILES = 4;
constexpr int SP_RING = 2 * SP_RING_TILES * KT;
constexpr int SP_SMEM = 1024 + SP_STAGES * TILE + 2 * CHUNK + HM * 128 + 3 * HM * 4 + 2 * HM * 4 + SP_STAGES * KT * 4 + SP_RING * 4 +
                        (4 * SP_STAGES + 2) * 8;
static_assert(SP_SMEM == 226416, "attention.rs ATTN_SP_SMEM");

// The S-warpgroup kernels' gather reads a sequence's key-list entries k_begin..k_end through a ring
// in shared memory (two slots of SP_RING_TILES tiles' entries), copied by cp.async (two entries a
// thread) one chunk ahead: read from global memory one tile ahead, each tile's entries waited behind
// the previous tile's row copies in the SM's memory pipeline, so one tile's rows were in flight at a
// time (ncu: the gather never waited for a free stage; the S warpgroup waited for keys). Chunk c is
// committed as its own cp.async group at tile (c - 1) * SP_RING_TILES (chunks 0 and 1 at the start:
// start()) and waited for one chunk later (wait_group 1: the group holds only copies of tiles long
// consumed besides), then a barrier of the 128 gather threads (2) makes every thread's entries
// visible (at_tile). Slot c % 2 held chunk c - 2, whose last reads came before the previous tile's
// publish barrier. t: the gather thread (0..127).
struct KeyRing {
    int32_t* ring;
    const int32_t* rows;
    uint32_t k_begin, k_end, pool_rows;
    int32_t* status;
    uint32_t t;
    __device__ __forceinline__ void fetch(uint32_t c) const {
        int32_t* slot = ring + (c % 2) * (SP_RING_TILES * KT);
        for (uint32_t e = t; e < SP_RING_TILES * KT; e += 128) {
            const uint32_t key = k_begin + c * (SP_RING_TILES * KT) + e;
            if (key < k_end) cp_async4(slot + e, rows + key);
        }
        cp_async_commit();
    }
    __device__ __forceinline__ void start() const {
        fetch(0);
        fetch(1);
    }
    // Before tile it's entries are read.
    __device__ __forceinline__ void at_tile(uint32_t it) const {
        if (it % SP_RING_TILES == 0) {
            if (it > 0) fetch(it / SP_RING_TILES + 1);
            cp_async_wait_pending<1>();
            named_barrier(2, 128);
        }
    }
    // Key j of tile it as a checked pool row (-1: past the list, or outside the pool: reported).
    __device__ __forceinline__ int32_t row_of(uint32_t it, uint32_t j) const {
        const uint32_t key = k_begin + it * KT + j;
        if (key >= k_end) return -1;
        return checked_row(ring[((it / SP_RING_TILES) % 2) * (SP_RING_TILES * KT) + (it % SP_RING_TILES) * KT + j], pool_rows, status);
    }
};

template <bool C2>
__device__ __forceinline__ void attn_decode_sp(const __nv_bfloat16* __restrict__ kv, const int32_t* __restrict__ key_rows,
                                               const int32_t* __restrict__ key_counts, const float* __restrict__ sink,
                                               int32_t* __restrict__ status, uint32_t heads, uint32_t max_keys,
                                               uint32_t pool_rows, uint32_t tiles_per_split, float scale, uint32_t seqs,
                                               const DiTmaMap& map_out, const DiTmaMap& map_kv, const DiTmaMap& map_q,
                                               uint32_t flags) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t* base = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    uint8_t* qs = base + SP_STAGES * TILE;                        // Q's chunks SP_QREG / 4.. (dims 384..511)
    uint8_t* p_s = qs + 2 * CHUNK;                                // P, 64 x 64 bf16
    float* stats = reinterpret_cast<float*>(p_s + HM * 128);      // [m, l, alpha][HM] of the last tile
    float* red = stats + 3 * HM;                                  // [2][HM]: the cluster merge's m, l
    int32_t* idx = reinterpret_cast<int32_t*>(red + 2 * HM);      // [SP_STAGES][KT] pool rows of each stage
    int32_t* ring = idx + SP_STAGES * KT;                         // [2][SP_RING_TILES * KT] key-list entries
    uint64_t* full = reinterpret_cast<uint64_t*>(ring + SP_RING);  // [stage][half]
    uint64_t* empty = full + 2 * SP_STAGES;                              // [stage][half]
    uint64_t* pready = empty + 2 * SP_STAGES;                            // P and the stats of a tile in place
    uint64_t* pfree = pready + 1;                                        // both P V of that tile done
    const uint32_t b = blockIdx.x, split = blockIdx.y;
    if (b >= seqs) return;  // the grid's x is the batch: never taken
    // With head halves (one split only), block b is sequence b / 2's heads (b % 2) * heads..: its
    // key list, count and sinks; Q and out are addressed by b (the maps are [2 batch, heads]).
    const bool halves = !C2 && (flags & kFlagHeadHalves) != 0;
    const uint32_t seq = halves ? b / 2 : b;
    if (halves) sink += (b % 2) * heads;
    if (threadIdx.x == 0) {
        for (int i = 0; i < 2 * SP_STAGES; ++i) {
            mbar_init(&full[i], 129);  // every gather thread's cp.async arrival + thread 0's (rows, bytes)
            mbar_init(&empty[i], 4);   // lane 0 of each warp of the warpgroup that frees the half
        }
        mbar_init(pready, 128);  // every thread of the S warpgroup
        mbar_init(pfree, 8);     // lane 0 of each P V warp
        mbar_init_fence();
        tma_prefetch_map(&map_kv);
        tma_prefetch_map(&map_q);
    }
    __syncthreads();
    pdl_start(flags);
    const uint32_t count = min(static_cast<uint32_t>(max(key_counts[seq], 0)), max_keys);
    const uint32_t k_begin = min(count, split * tiles_per_split * KT);
    const uint32_t k_end = min(count, (split + 1) * tiles_per_split * KT);
    const uint32_t tiles = (k_end - k_begin + KT - 1) / KT;
    // Tile t goes into stage t % 3 as that stage's fill t / 3 (+1 in stage 2, whose fill 0 is Q).
    auto fill_of = [](uint32_t t) { return t / SP_STAGES + (t % SP_STAGES == 2); };
    const int wg = threadIdx.x / 128;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int r0 = warp * 16 + lane / 4;
    const int rr[2] = {r0, r0 + 8};

    if (wg == 0) {
        setmaxnreg_dec<24>();
        const uint32_t t = threadIdx.x;
        if (t == 0) {
            // Q into stage 2, each half on its own barrier: eight boxes of 64 heads x 128 bytes.
            for (int h = 0; h < 2; ++h) {
                mbar_arrive_expect_tx(&full[2 * 2 + h], TILE / 2);
                for (int c = 4 * h; c < 4 * h + 4; ++c)
                    tma_load_3d(c < SP_QREG / 4 ? base + 2 * TILE + c * CHUNK : qs + (c - SP_QREG / 4) * CHUNK, &map_q, c * 128, 0, b,
                                &full[2 * 2 + h]);
            }
        }
        for (int h = 0; h < 2; ++h) cp_async_arrive_noinc(&full[2 * 2 + h]);
        // The key-list entries through the ring (KeyRing).
        const KeyRing kr{ring, key_rows + static_cast<size_t>(seq) * max_keys, k_begin, k_end, pool_rows, status, t};
        auto row_of = [&](uint32_t it, uint32_t j) { return kr.row_of(it, j); };
        kr.start();
        for (uint32_t it = 0; it < tiles; ++it) {
            const uint32_t s = it % SP_STAGES, f = fill_of(it);
            uint8_t* dst = base + s * TILE;
            kr.at_tile(it);
            // Half 0 frees after warpgroup 2's P V of the stage's last tile, which came after the S
            // warpgroup read that tile's rows: so the rows may be rewritten then.
            if (f > 0) mbar_wait(&empty[2 * s], (f - 1) & 1);
            // The tile's first row (threads 0-63, one address a warp): its run test and TMA origin.
            const int32_t first = t < KT ? row_of(it, 0) : -1;
            const bool run = publish_rows(idx + s * KT, t, t < KT ? row_of(it, t) : -1, first, flags);
            // Half h (column chunks 4h..4h + 3) once its warpgroup freed it. (Rows by one-row TMA
            // boxes instead of cp.async, 512 a tile: ten times slower.)
            for (uint32_t h = 0; h < 2; ++h) {
                if (h == 1 && f > 0) mbar_wait(&empty[2 * s + 1], (f - 1) & 1);
                load_tile_chunks<4>(dst, &full[2 * s + h], idx + s * KT, run, first, t, 4 * h, kv, map_kv);
            }
        }
        cp_async_wait_all();
        if constexpr (C2) {  // every thread of both blocks takes part in the merge's cluster barriers
            cluster_sync();
            cluster_sync();
        }
        return;
    }

    const uint32_t base_a = smem_addr(base), p_a = smem_addr(p_s), qs_a = smem_addr(qs);
    if (wg == 1) {
        // The S warpgroup: Q's first SP_QREG k16 steps as A fragments (ldmatrix from the swizzled
        // chunks), then stage 2 is free for keys.
        setmaxnreg_inc<168>();
        uint32_t qa[SP_QREG][4];
        mbar_wait(&full[2 * 2], 0);
        mbar_wait(&full[2 * 2 + 1], 0);
#pragma unroll
        for (int kk = 0; kk < SP_QREG; ++kk) {
            const uint32_t r = 16 * warp + (lane % 8) + 8 * ((lane / 8) % 2), v = (kk % 4) * 2 + lane / 16;
            ldmatrix_x4(qa[kk], reinterpret_cast<const __nv_bfloat16*>(base + 2 * TILE + (kk / 4) * CHUNK + r * 128 + ((v ^ (r % 8)) * 16)));
        }
        __syncwarp();
        if (lane == 0) {
            mbar_arrive(&empty[2 * 2]);
            mbar_arrive(&empty[2 * 2 + 1]);
        }
        float m_run[2], l_tot[2];
        sink_state(split == 0, rr, heads, sink, m_run, l_tot);
        const float scale2 = scale * kLog2e;
        const bool half_first = (flags & kFlagSHalfFirst) != 0;
        for (uint32_t t = 0; t < tiles; ++t) {
            const uint32_t s = t % SP_STAGES, f = fill_of(t);
            const uint32_t stage_a = base_a + s * TILE;
            // With kFlagSHalfFirst, S starts on the tile's dims 0..255 (half 0, which the gather
            // loads first) while half 1 still lands: the last tile's chain, and each stage's hold,
            // shorten by about half of S.
            mbar_wait(&full[2 * s], f & 1);
            if (!half_first) mbar_wait(&full[2 * s + 1], f & 1);
            const uint32_t valid = tile_valid(idx + s * KT, lane);
            fence_proxy_async_smem();  // the gathered rows (cp.async) before the tensor cores read them
            float sc[32];
#pragma unroll
            for (int i = 0; i < 32; ++i) sc[i] = 0.f;
            wgmma_fence_regs(sc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 16; ++kk)
                wgmma_rs_bf16<64>(sc, qa[kk], wgmma_desc_sw128(stage_a + (kk / 4) * CHUNK + (kk % 4) * 32));
            if (half_first) {
                mbar_wait(&full[2 * s + 1], f & 1);
                fence_proxy_async_smem();
            }
#pragma unroll
            for (int kk = 16; kk < SP_QREG; ++kk)
                wgmma_rs_bf16<64>(sc, qa[kk], wgmma_desc_sw128(stage_a + (kk / 4) * CHUNK + (kk % 4) * 32));
#pragma unroll
            for (int kk = SP_QREG; kk < 32; ++kk)
                wgmma_m64n64k16_bf16(sc, wgmma_desc_sw128(qs_a + (kk / 4 - SP_QREG / 4) * CHUNK + (kk % 4) * 32),
                                     wgmma_desc_sw128(stage_a + (kk / 4) * CHUNK + (kk % 4) * 32), 1);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_regs(sc);
            // The softmax (registers), then P and the stats once P V of tile t - 1 is done.
            float alpha[2], msub[2], sum[2];
            uint32_t pb[8][2];
            tile_max(sc, valid, scale2, m_run, alpha, msub);
            tile_probs(sc, msub, pb, sum);
            if (t >= 1) mbar_wait(pfree, (t - 1) & 1);
            store_p(p_s, pb, rr, lane);
            tile_stats(stats, l_tot, m_run, alpha, sum, rr, lane);
            fence_proxy_async_smem();  // P (st.shared) before the tensor cores read it
            mbar_arrive(pready);
        }
        if constexpr (C2) {
            cluster_sync();
            cluster_sync();
        }
        return;
    }

    // A P V warpgroup: output columns 256cw..256cw + 255.
    setmaxnreg_inc<160>();
    const int cw = wg - 2;
    const uint32_t wt = threadIdx.x % 128;
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    for (uint32_t t = 0; t < tiles; ++t) {
        const uint32_t s = t % SP_STAGES;
        mbar_wait(pready, t & 1);
        fence_proxy_async_smem();
        rescale_o(o, stats, rr);
        wgmma_fence_regs(o);
        wgmma_fence();
        // As two m64n128 halves (o[0..63]: columns 256cw..+127, o[64..127] the next 128): an m64n256
        // instruction needs more registers than a 512-thread block has before setmaxnreg.
        float(&o_lo)[64] = *reinterpret_cast<float(*)[64]>(o);
        float(&o_hi)[64] = *reinterpret_cast<float(*)[64]>(o + 64);
#pragma unroll
        for (int ks = 0; ks < KT / 16; ++ks) {
            const uint64_t dp = wgmma_desc_sw128(p_a + ks * 32);
            const uint32_t v_a = base_a + s * TILE + cw * 4 * CHUNK + ks * 16 * 128;
            wgmma_m64n128k16_bf16<1>(o_lo, dp, wgmma_desc_sw128_mn(v_a, CHUNK), 1);
            wgmma_m64n128k16_bf16<1>(o_hi, dp, wgmma_desc_sw128_mn(v_a + 2 * CHUNK, CHUNK), 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(o);
        __syncwarp();
        if (lane == 0) {
            mbar_arrive(&empty[2 * s + cw]);
            mbar_arrive(pfree);
        }
    }
    // The state after the last tile (the sink's, or nothing, without tiles).
    float m_run[2], l_tot[2];
    sink_state(split == 0, rr, heads, sink, m_run, l_tot);
    if (tiles > 0)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            m_run[e] = stats[rr[e]];
            l_tot[e] = stats[HM + rr[e]];
        }

    // One split: this warpgroup's columns, normalised. Two: the cluster merge (c2_merge: the other
    // block's O arrives in stage 0). The outputs are staged in this warpgroup's own half of stage 1,
    // which no one reads once its last P V is done (with one split the other warpgroup's last P V
    // may still be reading its half of the last tile's stage).
    float fin[2];
    uint32_t col_half = cw;
    if constexpr (C2) {
        if (!c2_merge(o, m_run, l_tot, cw, wt, lane, rr, base, red, fin, (flags & kFlagMergeF32) != 0)) return;
        col_half = cluster_ctarank();
    } else {
#pragma unroll
        for (int e = 0; e < 2; ++e) fin[e] = l_tot[e] > 0.f ? 1.f / l_tot[e] : 0.f;
    }
    if (store_out(base + TILE + cw * 4 * CHUNK, o, fin, col_half * 256, b, map_out, rr, lane, wt, cw)) bulk_wait();
}


// ---------------------------------------------------------------------------------------------
// Head halves, transposed (di_attn_decode_hs): block b is sequence b / 2's heads (b % 2) heads..
// + heads (heads <= 32: the launch passes half the head count, and Q and out as [2 batch, heads,
// 512]), over all of the sequence's keys. No split of the keys, so no merge, and twice the blocks
// of a batch; the two blocks of a sequence read the same key rows (the second mostly from L2).
// With 32 heads a wgmma's M = 64 would be half idle, so both products run transposed:
//   S^T = K Q^T    wgmma m64n32k16: A = the key tile (64 keys x 512, K-major, as gathered),
//                  B = Q (32 heads x 512, K-major, by TMA); the S warpgroup.
//   softmax        per head over the keys, which are rows: a thread holds 2 keys x 8 heads; the
//                  tile's max per head goes through shared memory between the four warps, the
//                  sums stay per thread (a head's rescale factor is the same in every thread) and
//                  are added up once at the end.
//   O^T += V^T P^T wgmma m64n32k16 with A = the key tile read MN-major (dims are its rows) and B =
//                  P (32 heads x 64 keys, K-major); P V warpgroup c owns dims 256c.. (four m64
//                  blocks, 64 accumulators a thread).
// The tiles come in halves (dims 0..255, 256..511) through five 32 KB slots, tile t's half h in
// slot (2t + h) % 5 (two and a half tiles: Q takes the room of a third stage); half h is freed by
// P V warpgroup h (S came before it). P is double-buffered, so S and the softmax of tile t + 1 run
// while tile t's P V does. The gather warpgroup is attn_decode_sp's (key-list ring, page tiles by
// TMA, lean row copies). Registers 24 / 168 / 160 / 160.
constexpr int HS_HM = 32;                 // heads of a block
constexpr int HS_QCHUNK = HS_HM * 128;    // 32 rows x 128 bytes: Q's 64 columns c
constexpr int HS_SLOTS = 5;               // 32 KB half-tile slots
constexpr int HS_HALF = 4 * CHUNK;        // a half tile: 4 column chunks of 64 rows
constexpr int HS_P = HS_HM * 128;         // P: 32 heads x 64 keys bf16
constexpr int HS_SMEM = 1024 + 8 * HS_QCHUNK + HS_SLOTS * HS_HALF + 2 * HS_P + 2 * HS_HM * 4 + 2 * 4 * HS_HM * 4 + HS_HM * 4 +
                        3 * KT * 4 + SP_RING * 4 + (2 * HS_SLOTS + 6) * 8;
static_assert(HS_SMEM == 210176, "attention.rs ATTN_HS_SMEM");

__device__ __forceinline__ void attn_decode_hs(const __nv_bfloat16* __restrict__ kv, const int32_t* __restrict__ key_rows,
                                               const int32_t* __restrict__ key_counts, const float* __restrict__ sink,
                                               int32_t* __restrict__ status, uint32_t heads, uint32_t max_keys,
                                               uint32_t pool_rows, float scale, uint32_t seqs, const DiTmaMap& map_out,
                                               const DiTmaMap& map_kv, const DiTmaMap& map_q, uint32_t flags) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t* base = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    uint8_t* q_s = base;                                            // Q: 8 chunks of 32 rows x 128 bytes
    uint8_t* slots = q_s + 8 * HS_QCHUNK;                           // HS_SLOTS half tiles
    uint8_t* p_s = slots + HS_SLOTS * HS_HALF;                      // [2] P
    float* astat = reinterpret_cast<float*>(p_s + 2 * HS_P);        // [2][HS_HM] rescale factor per head
    float* redm = astat + 2 * HS_HM;                                // [2][4 warps][HS_HM] tile max per head
    float* fin = redm + 2 * 4 * HS_HM;                              // [HS_HM] 1 / sum per head
    int32_t* idx = reinterpret_cast<int32_t*>(fin + HS_HM);         // [3][KT] pool rows of a tile
    int32_t* ring = idx + 3 * KT;                                   // [2][SP_RING_TILES * KT] key-list entries
    uint64_t* full = reinterpret_cast<uint64_t*>(ring + SP_RING);  // [HS_SLOTS]
    uint64_t* empty = full + HS_SLOTS;                              // [HS_SLOTS]
    uint64_t* pready = empty + HS_SLOTS;                            // [2] P and alpha of a tile in place
    uint64_t* pfree = pready + 2;                                   // [2] both P V of that tile done
    uint64_t* qfull = pfree + 2;                                    // Q landed
    uint64_t* sdone = qfull + 1;                                    // the sums' reciprocals in fin
    const uint32_t b = blockIdx.x;
    if (b >= seqs) return;  // the grid's x is 2 batch: never taken
    const uint32_t seq = b / 2;
    sink += (b % 2) * heads;
    if (threadIdx.x == 0) {
        for (int i = 0; i < HS_SLOTS; ++i) {
            mbar_init(&full[i], 129);  // every gather thread's cp.async arrival + thread 0's (rows, bytes)
            mbar_init(&empty[i], 4);   // lane 0 of each warp of the P V warpgroup that frees the half
        }
        for (int i = 0; i < 2; ++i) {
            mbar_init(&pready[i], 128);  // every thread of the S warpgroup
            mbar_init(&pfree[i], 8);     // lane 0 of each P V warp
        }
        mbar_init(qfull, 1);
        mbar_init(sdone, 128);
        mbar_init_fence();
        tma_prefetch_map(&map_kv);
        tma_prefetch_map(&map_q);
    }
    __syncthreads();
    pdl_start(flags);
    const uint32_t count = min(static_cast<uint32_t>(max(key_counts[seq], 0)), max_keys);
    const uint32_t tiles = (count + KT - 1) / KT;
    auto slot_of = [&](uint32_t t, uint32_t h) { return slots + ((2 * t + h) % HS_SLOTS) * HS_HALF; };
    const int wg = threadIdx.x / 128;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, qd = lane % 4;
    // A thread's heads in the m64n32 accumulator layout: column 8j + 2 qd + e is head hd(2j + e).
    auto hd = [&](int i) { return 8 * (i / 2) + 2 * qd + (i % 2); };

    if (wg == 0) {
        setmaxnreg_dec<24>();
        const uint32_t t = threadIdx.x;
        if (t == 0) {
            mbar_arrive_expect_tx(qfull, 8 * HS_QCHUNK);
            for (int c = 0; c < 8; ++c) tma_load_3d(q_s + c * HS_QCHUNK, &map_q, c * 128, 0, b, qfull);
        }
        // The key-list entries through the ring (KeyRing), all of the sequence's.
        const KeyRing kr{ring, key_rows + static_cast<size_t>(seq) * max_keys, 0, count, pool_rows, status, t};
        auto row_of = [&](uint32_t it, uint32_t j) { return kr.row_of(it, j); };
        kr.start();
        for (uint32_t it = 0; it < tiles; ++it) {
            kr.at_tile(it);
            int32_t* ix = idx + (it % 3) * KT;
            int32_t first = -1;
            bool run = false;
            for (uint32_t h = 0; h < 2; ++h) {
                // Slot (2 it + h) % 5 last held half (2 it + h - 5): half 1 of tile it - 3 (for h =
                // 0: its S, which read ix, came before) or half 0 of tile it - 2.
                const uint32_t hs = 2 * it + h;
                if (hs >= HS_SLOTS) mbar_wait(&empty[hs % HS_SLOTS], (hs / HS_SLOTS - 1) & 1);
                if (h == 0) {
                    first = t < KT ? row_of(it, 0) : -1;
                    run = publish_rows(ix, t, t < KT ? row_of(it, t) : -1, first, flags);
                }
                // load_tile_chunks puts column chunk c at dst + c * CHUNK: half h's chunks 4h..4h + 3
                // at the slot's start (for h = 1 dst is 32 KB before it, inside Q's room).
                load_tile_chunks<4>(slot_of(it, h) - h * HS_HALF, &full[hs % HS_SLOTS], ix, run, first, t, 4 * h, kv, map_kv);
            }
        }
        cp_async_wait_all();
        return;
    }

    const uint32_t q_a = smem_addr(q_s), p_a = smem_addr(p_s);
    if (wg == 1) {
        // The S warpgroup: a thread's keys are rows r0 and r0 + 8 of the tile.
        setmaxnreg_inc<168>();
        const int r0 = 16 * warp + lane / 4;
        float m_run[8], l_part[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const bool with_sink = hd(i) < static_cast<int>(heads);
            m_run[i] = with_sink ? sink[hd(i)] * kLog2e : -INFINITY;
            // The sink counts once a head: in the four threads that hold keys 0 and 8.
            l_part[i] = with_sink && warp == 0 && lane < 4 ? 1.f : 0.f;
        }
        const float scale2 = scale * kLog2e;
        mbar_wait(qfull, 0);
        for (uint32_t t = 0; t < tiles; ++t) {
            const uint32_t h0 = 2 * t, h1 = 2 * t + 1;
            const uint32_t s0_a = smem_addr(slot_of(t, 0)), s1_a = smem_addr(slot_of(t, 1));
            mbar_wait(&full[h0 % HS_SLOTS], (h0 / HS_SLOTS) & 1);
            const int32_t* ix = idx + (t % 3) * KT;
            const bool ok0 = ix[r0] >= 0, ok1 = ix[r0 + 8] >= 0;
            fence_proxy_async_smem();  // the gathered rows (cp.async) before the tensor cores read them
            float sc[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) sc[i] = 0.f;
            wgmma_fence_regs(sc);
            wgmma_fence();
            // Dims 0..255 (half 0) while half 1 may still land.
#pragma unroll
            for (int kk = 0; kk < 16; ++kk)
                wgmma_m64n32k16_bf16<0>(sc, wgmma_desc_sw128(s0_a + (kk / 4) * CHUNK + (kk % 4) * 32),
                                        wgmma_desc_sw128(q_a + (kk / 4) * HS_QCHUNK + (kk % 4) * 32), 1);
            mbar_wait(&full[h1 % HS_SLOTS], (h1 / HS_SLOTS) & 1);
            fence_proxy_async_smem();
#pragma unroll
            for (int kk = 16; kk < 32; ++kk)
                wgmma_m64n32k16_bf16<0>(sc, wgmma_desc_sw128(s1_a + (kk / 4 - 4) * CHUNK + (kk % 4) * 32),
                                        wgmma_desc_sw128(q_a + (kk / 4) * HS_QCHUNK + (kk % 4) * 32), 1);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_regs(sc);
            // sc[4j + 2g + e]: key r0 + 8g, head hd(2j + e). Masked keys -inf; the tile's max per
            // head: the thread's two keys, the eight lanes of its head (xor 4, 8, 16), the warps.
            float mx[8];
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& v0 = sc[4 * j + e];
                    float& v1 = sc[4 * j + 2 + e];
                    v0 = ok0 ? v0 * scale2 : -INFINITY;
                    v1 = ok1 ? v1 * scale2 : -INFINITY;
                    mx[2 * j + e] = fmaxf(v0, v1);
                }
            float* rm = redm + (t % 2) * 4 * HS_HM;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 4));
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 8));
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 16));
                if (lane < 4) rm[warp * HS_HM + hd(i)] = mx[i];
            }
            // (rm alternates by tile: a warp writes tile t + 2's only after every warp passed this
            // barrier at tile t + 1, so after their reads of tile t's.)
            named_barrier(5, 128);
            float alpha[8], msub[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float tm = fmaxf(fmaxf(rm[hd(i)], rm[HS_HM + hd(i)]), fmaxf(rm[2 * HS_HM + hd(i)], rm[3 * HS_HM + hd(i)]));
                const float m_new = fmaxf(m_run[i], tm);
                alpha[i] = m_run[i] == -INFINITY ? 0.f : ex2_approx(m_run[i] - m_new);
                m_run[i] = m_new;
                msub[i] = m_new == -INFINITY ? 0.f : m_new;
            }
            // P rounded to bf16, the sums of exactly those values, into P[t % 2] (head rows of 64
            // keys, 128-byte swizzle) once that buffer's P V (tile t - 2) is done.
            const uint32_t pb = t % 2;
            if (t >= 2) mbar_wait(&pfree[pb], (t / 2 - 1) & 1);
            uint8_t* pt = p_s + pb * HS_P;
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int i = 2 * j + e, h = hd(i);
                    const __nv_bfloat16 p0 = __float2bfloat16_rn(ex2_approx(sc[4 * j + e] - msub[i]));
                    const __nv_bfloat16 p1 = __float2bfloat16_rn(ex2_approx(sc[4 * j + 2 + e] - msub[i]));
                    l_part[i] = l_part[i] * alpha[i] + (__bfloat162float(p0) + __bfloat162float(p1));
#pragma unroll
                    for (int g = 0; g < 2; ++g) {
                        const int r = r0 + 8 * g;
                        *reinterpret_cast<__nv_bfloat16*>(pt + h * 128 + (((r / 8) ^ (h % 8)) * 16) + (r % 8) * 2) = g ? p1 : p0;
                    }
                }
            if (warp == 0 && lane < 4)
#pragma unroll
                for (int i = 0; i < 8; ++i) astat[pb * HS_HM + hd(i)] = alpha[i];
            fence_proxy_async_smem();  // P (st.shared) before the tensor cores read it
            mbar_arrive(&pready[pb]);
        }
        // The sums: the eight lanes of a head, then the warps (through the max buffer the next tile
        // would have used), then 1 / sum per head for the P V warpgroups.
        float* rl = redm + (tiles % 2) * 4 * HS_HM;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            l_part[i] += __shfl_xor_sync(0xffffffffu, l_part[i], 4);
            l_part[i] += __shfl_xor_sync(0xffffffffu, l_part[i], 8);
            l_part[i] += __shfl_xor_sync(0xffffffffu, l_part[i], 16);
            if (lane < 4) rl[warp * HS_HM + hd(i)] = l_part[i];
        }
        named_barrier(5, 128);
        if (warp == 0 && lane < 4)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float l = (rl[hd(i)] + rl[HS_HM + hd(i)]) + (rl[2 * HS_HM + hd(i)] + rl[3 * HS_HM + hd(i)]);
                fin[hd(i)] = l > 0.f ? 1.f / l : 0.f;
            }
        mbar_arrive(sdone);
        return;
    }

    // A P V warpgroup: dims 256cw..256cw + 255 as four m64 blocks of O^T (rows: dims, columns: heads).
    setmaxnreg_inc<160>();
    const int cw = wg - 2;
    const uint32_t wt = threadIdx.x % 128;
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    for (uint32_t t = 0; t < tiles; ++t) {
        const uint32_t pb = t % 2;
        mbar_wait(&pready[pb], (t / 2) & 1);
        fence_proxy_async_smem();
        float al[8];
        bool moved = false;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            al[i] = astat[pb * HS_HM + hd(i)];
            moved |= al[i] != 1.f;
        }
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int mb = 0; mb < 4; ++mb)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int g = 0; g < 2; ++g)
#pragma unroll
                        for (int e = 0; e < 2; ++e) o[16 * mb + 4 * j + 2 * g + e] *= al[2 * j + e];
        }
        wgmma_fence_regs(o);
        wgmma_fence();
        const uint32_t v_a = smem_addr(slot_of(t, cw));
#pragma unroll
        for (int ks = 0; ks < KT / 16; ++ks) {
            const uint64_t db = wgmma_desc_sw128(p_a + pb * HS_P + ks * 32);
#pragma unroll
            for (int mb = 0; mb < 4; ++mb)
                wgmma_m64n32k16_bf16<1>(*reinterpret_cast<float(*)[16]>(o + 16 * mb),
                                        wgmma_desc_sw128_mn(v_a + mb * CHUNK + ks * 16 * 128, CHUNK), db, 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(o);
        __syncwarp();
        if (lane == 0) {
            mbar_arrive(&empty[(2 * t + cw) % HS_SLOTS]);
            mbar_arrive(&pfree[pb]);
        }
    }
    mbar_wait(sdone, 0);
    float fn[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) fn[i] = fin[hd(i)];
    // O (heads x this warpgroup's 256 dims) as bf16 into this warpgroup's half of the last tile
    // (no one else reads it now; any slot when there were no tiles), as four boxes of 32 heads x 64
    // dims in the 128-byte swizzle, then out by TMA (heads past the count are not written).
    uint8_t* stg = tiles > 0 ? slot_of(tiles - 1, cw) : slots + cw * HS_HALF;
#pragma unroll
    for (int mb = 0; mb < 4; ++mb)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int g = 0; g < 2; ++g)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int dr = 16 * warp + lane / 4 + 8 * g, h = hd(2 * j + e);
                    *reinterpret_cast<__nv_bfloat16*>(stg + mb * HS_QCHUNK + h * 128 + (((dr / 8) ^ (h % 8)) * 16) + (dr % 8) * 2) =
                        __float2bfloat16_rn(o[16 * mb + 4 * j + 2 * g + e] * fn[2 * j + e]);
                }
    fence_proxy_async_smem();  // the staging writes before the TMA engine reads them
    named_barrier(3 + cw, 128);
    if (wt == 0) {
#pragma unroll
        for (int mb = 0; mb < 4; ++mb)
            tma_store_3d(&map_out, stg + mb * HS_QCHUNK, static_cast<int32_t>(2 * (256 * cw + 64 * mb)), 0, static_cast<int32_t>(b));
        bulk_commit();
        bulk_wait();
    }
}

}  // namespace
#endif

#define DI_ATTN_WG_PARAMS                                                                                              \
    const __nv_bfloat16 *__restrict__ q, const __nv_bfloat16 *__restrict__ kv, const int32_t *__restrict__ key_rows,  \
        const int32_t *__restrict__ key_counts, const float *__restrict__ sink, __nv_bfloat16 *__restrict__ out,       \
        float *__restrict__ o_part, float *__restrict__ ml_part, int32_t *__restrict__ status, uint32_t heads,         \
        uint32_t max_keys, uint32_t pool_rows, uint32_t tiles_per_split, float scale, uint32_t seqs,                 \
        const __grid_constant__ DiTmaMap map_out, const __grid_constant__ DiTmaMap map_kv,                      \
        const __grid_constant__ DiTmaMap map_q, uint32_t flags
#define DI_ATTN_WG_ARGS                                                                                          \
    q, kv, key_rows, key_counts, sink, out, o_part, ml_part, status, heads, max_keys, pool_rows, tiles_per_split, \
        scale, seqs, map_out, map_kv, map_q, flags
#define DI_ATTN_SP_ARGS                                                                                            \
    kv, key_rows, key_counts, sink, status, heads, max_keys, pool_rows, tiles_per_split, scale, seqs, map_out, map_kv, \
        map_q, flags

// Any number of splits (several: fp32 partials merged by di_attn_decode_combine).
extern "C" __global__ void __launch_bounds__(DI_ATTN_WG_THREADS, 1) di_attn_decode_wg(DI_ATTN_WG_PARAMS) {
#if DI_SM90
    attn_decode_wg<false>(DI_ATTN_WG_ARGS);
#else
    __trap();  // sm_90a only; the launcher never picks it elsewhere
#endif
}

// Exactly two splits, launched as clusters of two blocks along y; writes out directly.
extern "C" __global__ void __cluster_dims__(1, 2, 1) __launch_bounds__(DI_ATTN_WG_THREADS, 1)
    di_attn_decode_wg_c2(DI_ATTN_WG_PARAMS) {
#if DI_SM90
    attn_decode_wg<true>(DI_ATTN_WG_ARGS);
#else
    __trap();
#endif
}

// Exactly two splits with one S warpgroup and two P V warpgroups (attn_decode_sp), launched as
// clusters of two blocks along y over a grid whose x is the batch; writes out directly.
extern "C" __global__ void __cluster_dims__(1, 2, 1) __launch_bounds__(SP_THREADS_HOST, 1)
    di_attn_decode_sp_c2(DI_ATTN_WG_PARAMS) {
#if DI_SM90
    attn_decode_sp<true>(DI_ATTN_SP_ARGS);
#else
    __trap();
#endif
}

// Each sequence's heads as two blocks over all of its keys, the products transposed
// (attn_decode_hs): a grid of 2 batch, heads = half the head count (<= 32); writes out directly.
extern "C" __global__ void __launch_bounds__(SP_THREADS_HOST, 1) di_attn_decode_hs(DI_ATTN_WG_PARAMS) {
#if DI_SM90
    attn_decode_hs(kv, key_rows, key_counts, sink, status, heads, max_keys, pool_rows, scale, seqs, map_out, map_kv, map_q, flags);
#else
    __trap();
#endif
}

// One split (a block per sequence, the grid's x the batch) with attn_decode_sp's warpgroups: no merge.
extern "C" __global__ void __launch_bounds__(SP_THREADS_HOST, 1) di_attn_decode_sp(DI_ATTN_WG_PARAMS) {
#if DI_SM90
    attn_decode_sp<false>(DI_ATTN_SP_ARGS);
#else
    __trap();
#endif
}
