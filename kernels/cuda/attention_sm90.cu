// Decode attention on Hopper (sm_90a) with warpgroup MMAs: the same op, arguments and outputs as
// di_attn_decode (attention.cu, which states the math), all <= 64 heads of a sequence in one block
// (or one cluster), so every key row is read from memory once.
//
// Two kernels share one body:
//   di_attn_decode_wg      a block per (sequence, split of its keys) over all 512 dims; one split
//                          writes the output, several write fp32 partials that
//                          di_attn_decode_combine merges.
//   di_attn_decode_wg_d2   a cluster of two blocks per sequence, block r owning dims 256r..256r+255
//                          of every key row over all of the sequence's keys: each computes the
//                          partial S over its dims, the two swap partials through distributed
//                          shared memory, both run the same softmax, and each writes its half of
//                          the output columns (V = K, so its dims are its output columns). Half
//                          the bytes per block and tile, twice the key stages in flight, no merge.
//
// Block: three warpgroups. Warpgroup 0 gathers: its 128 threads copy the block's query dims and
// then each 64-key tile (the rows named by key_rows) with cp.async into 128-byte-swizzled shared
// memory (8 KB column chunks of 64 rows x 64 bf16), signalled through mbarriers
// (cp.async.mbarrier.arrive). Warpgroups 1 and 2 take turns (FlashMLA's arrangement): the owner
// of tile t (warpgroup 1 + t % 2) computes
//   S = Q K^T   wgmma m64n64k16 over the whole 64-key tile (d2: its partial, swapped and added);
//   softmax     from the running max and sum the other warpgroup left after tile t - 1, writing
//               the bf16 probabilities into P[t % 2] and the new max, sum and rescale factor per
//               row into shared memory (an mbarrier says they are in place);
// then both run O = alpha O + P V, wgmma m64nNk16 on their half of the block's columns
// (N = 256, d2: 128), V = the same key tile read MN-major (the instruction transposes it). A
// warpgroup computes its next tile's S before the P V of the other's tile, so S (and in d2 the
// swap) overlaps the other's softmax; the chain from one softmax to the next is one P V. The key stage is released when both P V
// have completed. The probabilities are rounded to bf16 exactly as in di_attn_decode, and the
// sums add those rounded values. Outputs leave through shared memory as whole row pieces.
//
// History (benches/results/2026-11-30-attention-wgmma): the first version split every tile's keys
// between the warpgroups (n = 32 each, lock step); the second ran two key splits as a cluster
// merging 128 KB of fp32 partials through distributed shared memory; the third finalised half the
// columns in each block and staged the outputs (per-thread bf16 pairs straight to global memory
// had taken ~4 us of a 15 us call); the fourth took turns per tile.
#include <cuda_bf16.h>
#include <stdint.h>

#include "sm90.cuh"

constexpr int DI_ATTN_WG_THREADS = 3 * 128;  // gather warpgroup + two math warpgroups

#if DI_SM90
namespace {

constexpr int D = 512;           // head dimension (the single K=V head)
constexpr int HM = 64;           // query rows (heads) of a block; rows >= heads are zero
constexpr int KT = 64;           // keys per tile
constexpr int CHUNK = 64 * 128;  // 64 rows x 128 bytes (64 bf16 columns), swizzled

// The shape of one kernel: DS = split the dims over a cluster of two blocks.
template <bool DS>
struct Cfg {
    static constexpr int DH = DS ? 256 : 512;     // dims of a key row this block holds
    static constexpr int NCH = DH / 64;           // column chunks of a tile
    static constexpr int TILE = NCH * CHUNK;      // bytes of one 64-key tile (and of Q)
    static constexpr int STAGES = DS ? 4 : 2;     // key tiles in flight
    static constexpr int OC = DH / 2;             // output columns of a math warpgroup
    static constexpr int OREG = OC / 2;           // its fp32 accumulators a thread
    static constexpr int SX = DS ? 2 * HM * KT * 4 : 0;  // two swapped partial S tiles
    static constexpr int BARS = 2 * STAGES + 7;  // full, empty, pready, sx_full, sx_free, q
    // Dynamic shared memory (ATTN_WG_SMEM / ATTN_D2_SMEM in attention.rs): 1024 bytes of
    // alignment slack, Q, the key stages, two P tiles, the swapped partials, the max, sum and
    // rescale factor per row of two tiles, the key rows of each stage, the barriers.
    static constexpr int SMEM = 1024 + TILE + STAGES * TILE + 2 * HM * 128 + SX + 2 * 3 * HM * 4 + STAGES * KT * 4 + BARS * 8;
};
static_assert(Cfg<false>::SMEM == 216152, "attention.rs ATTN_WG_SMEM");
static_assert(Cfg<true>::SMEM == 216696, "attention.rs ATTN_D2_SMEM");

// Byte offset of the 16-byte unit (row r, columns 8v..8v+7) in a swizzled 64-row tile.
__device__ __forceinline__ uint32_t tile_off(uint32_t r, uint32_t v) {
    return (v / 8) * CHUNK + r * 128 + (((v % 8) ^ (r % 8)) * 16);
}

__device__ __forceinline__ void cp16(uint8_t* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

// Arrive on bar once this thread's earlier cp.async copies have landed (the arrival is counted in
// the barrier's expected count).
__device__ __forceinline__ void cp_arrive(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

template <int R>
__device__ __forceinline__ void pv_mma(float (&o)[R], uint64_t da, uint64_t db) {
    if constexpr (R == 128)
        wgmma_m64n256k16_bf16_bmn(o, da, db, 1);
    else
        wgmma_m64n128k16_bf16_bmn(o, da, db, 1);
}

template <bool DS>
__device__ __forceinline__ void attn_decode_wg(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv,
                                               const int32_t* __restrict__ key_rows,
                                               const int32_t* __restrict__ key_counts, const float* __restrict__ sink,
                                               __nv_bfloat16* __restrict__ out, float* __restrict__ o_part,
                                               float* __restrict__ ml_part, int32_t* __restrict__ status,
                                               uint32_t heads, uint32_t max_keys, uint32_t pool_rows,
                                               uint32_t tiles_per_split, float scale) {
    using C = Cfg<DS>;
    constexpr int STAGES = C::STAGES, TILE = C::TILE, NCH = C::NCH;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* base = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    uint8_t* q_s = base;
    uint8_t* k_s = q_s + TILE;
    uint8_t* p_s = k_s + STAGES * TILE;                    // [2] P tiles, 64 x 64 bf16
    float* sx = reinterpret_cast<float*>(p_s + 2 * HM * 128);  // [2] partial S from the other block
    float* stats = sx + C::SX / 4;                         // [2][m, l, alpha][HM] per tile
    int32_t* idx = reinterpret_cast<int32_t*>(stats + 2 * 3 * HM);  // [STAGES][KT] pool rows
    uint64_t* full = reinterpret_cast<uint64_t*>(idx + STAGES * KT);
    uint64_t* empty = full + STAGES;
    uint64_t* pready = empty + STAGES;  // [2]: P and the stats of tile t are in place
    uint64_t* sx_full = pready + 2;     // [2] (d2): the other block's partial S is in sx
    uint64_t* sx_free = sx_full + 2;    // [2] (d2): the other block has read what we sent it
    uint64_t* q_bar = sx_free + 2;
    const uint32_t b = blockIdx.x, split = DS ? 0 : blockIdx.y, splits = DS ? 1 : gridDim.y;
    const uint32_t half = DS ? cluster_ctarank() : 0;  // d2: this block's dims 256 half..
    const uint32_t count = min(static_cast<uint32_t>(max(key_counts[b], 0)), max_keys);
    const uint32_t k_begin = DS ? 0 : min(count, split * tiles_per_split * KT);
    const uint32_t k_end = DS ? count : min(count, (split + 1) * tiles_per_split * KT);
    const uint32_t tiles = (k_end - k_begin + KT - 1) / KT;
    const int32_t* rows = key_rows + static_cast<size_t>(b) * max_keys;
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 129);  // every gather thread's cp.async arrival + the key rows
            mbar_init(&empty[s], 8);   // lane 0 of each math warp
        }
        for (int j = 0; j < 2; ++j) {
            mbar_init(&pready[j], 128);   // every thread of the tile's owner warpgroup
            mbar_init(&sx_full[j], 128);  // every thread of the other block's owner warpgroup
            mbar_init(&sx_free[j], 128);
        }
        mbar_init(q_bar, 128);
        mbar_init_fence();
    }
    __syncthreads();
    if constexpr (DS) cluster_sync();  // both blocks' barriers exist before either arrives remotely

    if (wg == 0) {
        setmaxnreg_dec<40>();
        const uint32_t t = threadIdx.x;
        constexpr uint32_t UNITS = NCH * 8;  // 16-byte units of a row this block holds
        const uint32_t d0 = half * C::DH;
        // Q: 64 rows x UNITS units; thread t takes unit t % UNITS of rows t / UNITS, + 128 / UNITS, ...
        for (uint32_t i = 0; i < HM * UNITS / 128; ++i) {
            const uint32_t h = i * (128 / UNITS) + t / UNITS, v = t % UNITS;
            const bool ok = h < heads;
            cp16(q_s + tile_off(h, v), q + (static_cast<size_t>(b) * heads + (ok ? h : 0)) * D + d0 + v * 8, ok);
        }
        cp_arrive(q_bar);
        // The pool rows of a tile's keys go through shared memory (-1: no key), loaded one tile
        // ahead by threads 0-63, so the copies never wait on an index load. idx[s] also tells the
        // math warpgroups which keys are real: thread 0's plain arrival on full[s] (after the
        // barrier that orders the index stores) publishes it.
        auto row_of = [&](uint32_t key) -> int32_t {
            if (key >= k_end) return -1;
            const int32_t r = rows[key];
            if (r >= 0 && static_cast<uint32_t>(r) < pool_rows) return r;
            atomicExch(status, 1);
            return -1;
        };
        int32_t next = t < KT ? row_of(k_begin + t) : -1;
        for (uint32_t it = 0; it < tiles; ++it) {
            const uint32_t s = it % STAGES;
            mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
            int32_t* ix = idx + s * KT;
            if (t < KT) ix[t] = next;
            named_barrier(2, 128);
            if (t == 0) mbar_arrive(&full[s]);
            if (t < KT) next = row_of(k_begin + (it + 1) * KT + t);
            uint8_t* dst = k_s + s * TILE;
#pragma unroll 8
            for (uint32_t i = 0; i < KT * UNITS / 128; ++i) {
                const uint32_t j = i * (128 / UNITS) + t / UNITS, v = t % UNITS;
                const int32_t r = ix[j];
                cp16(dst + tile_off(j, v), kv + static_cast<size_t>(r < 0 ? 0 : r) * D + d0 + v * 8, r >= 0);
            }
            cp_arrive(&full[s]);
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        if constexpr (DS) cluster_sync();  // matches the math warpgroups' final cluster barrier
        return;
    }

    setmaxnreg_inc<232>();
    const int cw = wg - 1;  // S and softmax of the tiles t with t % 2 == cw; output columns OC cw..
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const uint32_t wt = threadIdx.x % 128;  // this thread in its warpgroup
    // Accumulator layout (wgmma m64nN): rows r0 = 16 warp + lane / 4 and r0 + 8, columns
    // 8 j + 2 (lane % 4) (+1) in registers 4 j (+1) and 4 j + 2 (+1).
    const int r0 = warp * 16 + lane / 4;
    const int rr[2] = {r0, r0 + 8};
    // Running max and sum before the first tile: the sink (split 0) as a key of value zero.
    float m_run[2], l_tot[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const bool with_sink = split == 0 && rr[e] < static_cast<int>(heads);
        m_run[e] = with_sink ? sink[rr[e]] : -INFINITY;
        l_tot[e] = with_sink ? 1.f : 0.f;
    }
    float o[C::OREG];
#pragma unroll
    for (int i = 0; i < C::OREG; ++i) o[i] = 0.f;
    const uint32_t q_a = smem_addr(q_s), k_a = smem_addr(k_s), p_a = smem_addr(p_s);
    // d2: the other block's partial-S buffers and barriers.
    const uint32_t peer = half ^ 1;
    const uint32_t sx_peer = DS ? mapa_shared(smem_addr(sx), peer) : 0;
    const uint32_t sx_full_peer = DS ? mapa_shared(smem_addr(sx_full), peer) : 0;
    const uint32_t sx_free_peer = DS ? mapa_shared(smem_addr(sx_free), peer) : 0;
    float sc[32];  // S of an owned tile (the first MMA overwrites it)
#pragma unroll
    for (int i = 0; i < 32; ++i) sc[i] = 0.f;
    mbar_wait(q_bar, 0);

    // S of tile u (this warpgroup owns it) into sc, and which of its key columns are real keys.
    uint32_t valid = 0;
    auto compute_s = [&](uint32_t u) {
        const uint32_t su = u % STAGES, ju = u % 2;
        mbar_wait(&full[su], (u / STAGES) & 1);
        valid = 0;  // which of this thread's 16 key columns are real keys
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (idx[su * KT + 8 * j + 2 * (lane % 4) + e] >= 0) valid |= 1u << (2 * j + e);
        fence_proxy_async_smem();  // the gathered rows (cp.async) before the tensor cores read them
        wgmma_fence_regs(sc);
        wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < NCH * 4; ++kc) {
            const uint32_t off = (kc / 4) * CHUNK + (kc % 4) * 32;
            wgmma_m64n64k16_bf16(sc, wgmma_desc_sw128(q_a + off), wgmma_desc_sw128(k_a + su * TILE + off), kc > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(sc);
        if constexpr (DS) {
            // Swap partials with the other block (float4 i of thread wt at (i * 128 + wt) * 16),
            // then add its partial: both blocks then hold the same S.
            const uint32_t use = u / 2;
            mbar_wait_cluster(&sx_free[ju], (use & 1) ^ 1);  // it has read our previous one
            const uint32_t dst = sx_peer + ju * HM * KT * 4;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                st_cluster_v4(dst + (i * 128 + wt) * 16, sc[4 * i], sc[4 * i + 1], sc[4 * i + 2], sc[4 * i + 3]);
            mbar_arrive_remote(sx_full_peer + ju * 8);
            mbar_wait_cluster(&sx_full[ju], use & 1);
            const float4* mine = reinterpret_cast<const float4*>(sx + ju * HM * KT);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float4 v = mine[i * 128 + wt];  // a + b = b + a: the same S in both blocks
                sc[4 * i] += v.x;
                sc[4 * i + 1] += v.y;
                sc[4 * i + 2] += v.z;
                sc[4 * i + 3] += v.w;
            }
            mbar_arrive_remote(sx_free_peer + ju * 8);
        }
    };
    if (cw == 0 && tiles > 0) compute_s(0);
    for (uint32_t t = 0; t < tiles; ++t) {
        const uint32_t s = t % STAGES, j2 = t % 2;
        float* st = stats + j2 * 3 * HM;  // m, l, alpha of tile t
        if (t % 2 != static_cast<uint32_t>(cw)) {
            // The other warpgroup's tile: first this warpgroup's next S (overlapping that one's
            // softmax), then its P V below.
            if (t + 1 < tiles) compute_s(t + 1);
        } else {
            // The online softmax of this warpgroup's tile from the previous tile's state (the
            // other warpgroup's, seen when this one waited for that tile's P).
            if (t > 0) {
                const float* prev = stats + ((t - 1) % 2) * 3 * HM;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    m_run[e] = prev[rr[e]];
                    l_tot[e] = prev[HM + rr[e]];
                }
            }
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const bool ok = (valid >> (2 * j + (e & 1))) & 1;
                    sc[4 * j + e] = ok ? sc[4 * j + e] * scale : -INFINITY;
                    mx[e / 2] = fmaxf(mx[e / 2], sc[4 * j + e]);
                }
            float alpha[2], sum[2] = {0.f, 0.f};
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
                mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
                const float m_new = fmaxf(m_run[e], mx[e]);
                // m_new = -inf only while a row has seen no key and no sink (splits > 0, skipped rows).
                alpha[e] = m_run[e] == -INFINITY ? 0.f : __expf(m_run[e] - m_new);
                m_run[e] = m_new;
            }
            uint8_t* pt = p_s + j2 * HM * 128;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float* v = sc + 4 * j + 2 * e;
                    const float x0 = v[0] == -INFINITY ? 0.f : __expf(v[0] - m_run[e]);
                    const float x1 = v[1] == -INFINITY ? 0.f : __expf(v[1] - m_run[e]);
                    const __nv_bfloat162 pb = __floats2bfloat162_rn(x0, x1);
                    sum[e] += __low2float(pb) + __high2float(pb);  // the sum of exactly what P V multiplies
                    *reinterpret_cast<__nv_bfloat162*>(pt + rr[e] * 128 + ((j ^ (rr[e] % 8)) * 16) + (lane % 4) * 4) = pb;
                }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                sum[e] += __shfl_xor_sync(0xffffffffu, sum[e], 1);
                sum[e] += __shfl_xor_sync(0xffffffffu, sum[e], 2);
                l_tot[e] = l_tot[e] * alpha[e] + sum[e];
                if (lane % 4 == 0) {
                    st[rr[e]] = m_run[e];
                    st[HM + rr[e]] = l_tot[e];
                    st[2 * HM + rr[e]] = alpha[e];
                }
            }
            fence_proxy_async_smem();  // P (st.shared) before the tensor cores read it
            mbar_arrive(&pready[j2]);
        }
        // O = alpha O + P V on this warpgroup's columns, V = the same key tile read MN-major.
        mbar_wait(&pready[j2], (t / 2) & 1);
        fence_proxy_async_smem();
        const float a0 = st[2 * HM + rr[0]], a1 = st[2 * HM + rr[1]];
#pragma unroll
        for (int j = 0; j < C::OREG / 4; ++j) {
            o[4 * j] *= a0;
            o[4 * j + 1] *= a0;
            o[4 * j + 2] *= a1;
            o[4 * j + 3] *= a1;
        }
        wgmma_fence_regs(o);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < KT / 16; ++ks)
            pv_mma(o, wgmma_desc_sw128(p_a + j2 * HM * 128 + ks * 32),
                   wgmma_desc_sw128_mn(k_a + s * TILE + cw * (NCH / 2) * CHUNK + ks * 16 * 128, CHUNK));
        wgmma_commit();
        // Waiting here (the other warpgroup keeps the tensor cores busy meanwhile): with a group
        // in flight across the loop edge ptxas serialises every wgmma of the loop (warning C7515).
        wgmma_wait<0>();
        wgmma_fence_regs(o);
        if (lane == 0) mbar_arrive(&empty[s]);
    }
    // The state after the last tile (the sink's, without tiles).
    if (tiles > 0) {
        const float* last = stats + ((tiles - 1) % 2) * 3 * HM;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            m_run[e] = last[rr[e]];
            l_tot[e] = last[HM + rr[e]];
        }
    }
    const uint32_t col0 = half * C::DH + cw * C::OC;  // this warpgroup's first output column

    if (splits == 1) {
        // Normalised rows to out[b, :, col0..col0 + OC) as bf16, staged through this warpgroup's
        // part of the free key stages (16-byte chunks XOR-swizzled by row: conflict-free both
        // ways), then whole row pieces with 16-byte stores.
        constexpr int RB = C::OC * 2;  // bytes of a staged row
        uint8_t* stage = k_s + cw * HM * RB;
        float f[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) f[e] = l_tot[e] > 0.f ? 1.f / l_tot[e] : 0.f;
#pragma unroll
        for (int j = 0; j < C::OREG / 4; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                *reinterpret_cast<__nv_bfloat162*>(stage + rr[e] * RB + ((j ^ (rr[e] % 8)) * 16) + (lane % 4) * 4) =
                    __floats2bfloat162_rn(o[4 * j + 2 * e] * f[e], o[4 * j + 2 * e + 1] * f[e]);
        named_barrier(3 + cw, 128);
        constexpr int LPR = RB / 16;  // lanes a row
        for (int r = warp * (32 / LPR) + lane / LPR; r < HM && r < static_cast<int>(heads); r += 4 * (32 / LPR)) {
            const int c = lane % LPR;
            *reinterpret_cast<uint4*>(out + (static_cast<size_t>(b) * heads + r) * D + col0 + c * 8) =
                *reinterpret_cast<const uint4*>(stage + r * RB + ((c ^ (r % 8)) * 16));
        }
    } else {
        // fp32 partials and (m, l) per row, merged by di_attn_decode_combine.
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int h = rr[e];
            if (h >= static_cast<int>(heads)) continue;
            float* dst = o_part + ((static_cast<size_t>(b) * splits + split) * heads + h) * D + col0 + 2 * (lane % 4);
#pragma unroll
            for (int j = 0; j < C::OREG / 4; ++j)
                *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[4 * j + 2 * e], o[4 * j + 2 * e + 1]);
            if (cw == 0 && lane % 4 == 0) {
                float* ml = ml_part + ((static_cast<size_t>(b) * splits + split) * heads + h) * 2;
                ml[0] = m_run[e];
                ml[1] = l_tot[e];
            }
        }
    }
    // d2: neither block leaves while the other may still write into its shared memory.
    if constexpr (DS) cluster_sync();
}

}  // namespace
#endif

#define DI_ATTN_WG_PARAMS                                                                                              \
    const __nv_bfloat16 *__restrict__ q, const __nv_bfloat16 *__restrict__ kv, const int32_t *__restrict__ key_rows,  \
        const int32_t *__restrict__ key_counts, const float *__restrict__ sink, __nv_bfloat16 *__restrict__ out,       \
        float *__restrict__ o_part, float *__restrict__ ml_part, int32_t *__restrict__ status, uint32_t heads,         \
        uint32_t max_keys, uint32_t pool_rows, uint32_t tiles_per_split, float scale
#define DI_ATTN_WG_ARGS \
    q, kv, key_rows, key_counts, sink, out, o_part, ml_part, status, heads, max_keys, pool_rows, tiles_per_split, scale

// Grid (batch, splits); any number of splits.
extern "C" __global__ void __launch_bounds__(DI_ATTN_WG_THREADS, 1) di_attn_decode_wg(DI_ATTN_WG_PARAMS) {
#if DI_SM90
    attn_decode_wg<false>(DI_ATTN_WG_ARGS);
#else
    __trap();  // sm_90a only; the launcher never picks it elsewhere
#endif
}

// Grid (batch, 2) as clusters of two blocks along y (the two halves of the dims); all keys of a
// sequence in each block; o_part, ml_part and tiles_per_split unused.
extern "C" __global__ void __cluster_dims__(1, 2, 1) __launch_bounds__(DI_ATTN_WG_THREADS, 1)
    di_attn_decode_wg_d2(DI_ATTN_WG_PARAMS) {
#if DI_SM90
    attn_decode_wg<true>(DI_ATTN_WG_ARGS);
#else
    __trap();
#endif
}
