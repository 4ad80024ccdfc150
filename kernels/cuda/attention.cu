// Decode attention of DeepSeek-V4 (MODEL_V4.md §5, §7): per sequence one query row of H <= 64
// heads, and one shared K=V head of dimension D = 512, over a list of key rows gathered from a
// paged pool (the window ring and the compressed rows the layer sees: CSA's indexer top-k or all
// of HCA's), with a learned sink logit per head in the softmax denominator.
//
//   s_hj = scale * q_h . k_j,   p_hj = exp(s_hj) / (sum_j' exp(s_hj') + exp(sink_h)),   o_h = sum_j p_hj k_j
//
// A block handles one (sequence, split of its keys) with all heads, so each key row is read from
// memory once for every head. Keys stream through shared memory 64 at a time (cp.async, two
// stages); S = Q K^T and O += P V run on mma.sync m16n8k16 (bf16 in, fp32 accumulate) from
// ldmatrix fragments: for S each warp takes 16 heads x 32 keys over all of D; for O each warp owns
// D / 8 output columns of every head. The softmax is online (running max and sum per head); the
// sink starts each head's sum at exp(sink - m) with m = sink, as a key whose value is zero. With
// several splits, each writes unnormalised fp32 partials and di_attn_decode_combine merges them.
#include <cuda_bf16.h>
#include <stdint.h>

#include "cpasync.cuh"
#include "mma.cuh"

namespace {

constexpr int D = 512;         // head dimension (V4: the single K=V head)
constexpr int HM = 64;         // heads a block computes (query rows; unused rows are zero)
constexpr int KT = 64;         // keys per tile
constexpr int LD = D + 8;      // shared row stride of Q and K tiles (bf16): 1040 bytes, conflict-free ldmatrix
constexpr int PLD = KT + 8;    // shared row stride of P (bf16)
constexpr int SLD = KT + 1;    // shared row stride of S (f32)
constexpr int THREADS = 256;

struct Smem {
    __nv_bfloat16 q[HM * LD];
    __nv_bfloat16 k[2][KT * LD];
    __nv_bfloat16 p[HM * PLD];
    float s[HM * SLD];
    float m[HM], l[HM], alpha[HM];
    int32_t rows[2][KT];  // pool rows of the keys of the tiles in the two stages (-1: no key)
};
// Must equal ATTN_SMEM_BYTES in crates/kernels-ffi/src/cuda/attention.rs (the launcher's dynamic
// shared memory).
static_assert(sizeof(Smem) == 226816, "attention.rs ATTN_SMEM_BYTES");

}  // namespace

// q [B, heads, D] bf16; kv [pool_rows, D] bf16 (the pool); key_rows [B, max_keys] (pool rows, the
// first key_counts[b] used); sink [heads] f32. A key row outside the pool is skipped and sets
// *status to 1. Grid (B, splits); split s takes keys [s * tiles_per_split * KT, ...) of its
// sequence. splits == 1: out [B, heads, D] bf16 normalised. splits > 1: o_part [B, splits, heads,
// D] f32 (unnormalised, relative to m), ml_part [B, splits, heads, 2] (m, l), merged by
// di_attn_decode_combine. Split 0 carries the sink; a split without keys writes m = -inf, l = 0.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    di_attn_decode(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv,
                   const int32_t* __restrict__ key_rows, const int32_t* __restrict__ key_counts,
                   const float* __restrict__ sink, __nv_bfloat16* __restrict__ out, float* __restrict__ o_part,
                   float* __restrict__ ml_part, int32_t* __restrict__ status, uint32_t heads, uint32_t max_keys,
                   uint32_t pool_rows, uint32_t tiles_per_split, float scale) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t b = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const uint32_t count = min(static_cast<uint32_t>(max(key_counts[b], 0)), max_keys);
    const uint32_t k_begin = min(count, split * tiles_per_split * KT);
    const uint32_t k_end = min(count, (split + 1) * tiles_per_split * KT);
    const int32_t* rows = key_rows + static_cast<size_t>(b) * max_keys;
    // The pool row of key `key` of this split, -1 when out of range or naming no pool row (then
    // reported). Loaded a tile ahead into sm.rows by threads 0..KT-1, so no copy waits on its own
    // index load (benches/results/2026-11-30-attention-wgmma).
    auto row_of = [&](uint32_t key) { return gather_row(rows, key, k_end, pool_rows, status); };

    // Q (rows >= heads zero), running stats.
    for (int c = tid; c < HM * (D / 8); c += THREADS) {
        const int h = c / (D / 8), v = c % (D / 8);
        const bool ok = h < static_cast<int>(heads);
        cp_async16(sm.q + h * LD + v * 8, q + (static_cast<size_t>(b) * heads + (ok ? h : 0)) * D + v * 8, ok);
    }
    if (tid < HM) {
        const bool with_sink = split == 0 && tid < static_cast<int>(heads);
        sm.m[tid] = with_sink ? sink[tid] : -INFINITY;
        sm.l[tid] = with_sink ? 1.f : 0.f;
    }
    // Copies of the tile whose key rows are in sm.rows[stage].
    auto load_tile = [&](int stage) {
        for (int c = tid; c < KT * (D / 8); c += THREADS) {
            const int j = c / (D / 8), v = c % (D / 8);
            const int32_t r = sm.rows[stage][j];
            cp_async16(sm.k[stage] + j * LD + v * 8, kv + static_cast<size_t>(r < 0 ? 0 : r) * D + v * 8, r >= 0);
        }
        cp_async_commit();
    };
    int32_t next_row = -1;  // threads < KT: the row of their key in the tile after the next
    if (tid < KT) {
        sm.rows[0][tid] = row_of(k_begin + tid);
        sm.rows[1][tid] = row_of(k_begin + KT + tid);
    }
    __syncthreads();
    if (k_begin < k_end) load_tile(0);

    // O accumulators: warp w owns columns [w * 64, w * 64 + 64) of every head: 4 head tiles x 8 column tiles.
    float o[4][8][4];
    #pragma unroll
    for (int mi = 0; mi < 4; ++mi)
        #pragma unroll
        for (int ni = 0; ni < 8; ++ni) o[mi][ni][0] = o[mi][ni][1] = o[mi][ni][2] = o[mi][ni][3] = 0.f;
    const int g = lane >> 2, qd = lane & 3;

    int stage = 0;
    for (uint32_t k0 = k_begin; k0 < k_end; k0 += KT, stage ^= 1) {
        cp_async_wait_groups();
        __syncthreads();  // tile `stage` (and Q) landed; the previous tile's P and stats are consumed
        if (k0 + KT < k_end) load_tile(stage ^ 1);
        if (tid < KT) next_row = row_of(k0 + 2 * KT + tid);  // lands while this tile computes
        const __nv_bfloat16* kt = sm.k[stage];
        // S = scale * Q K^T: warp (wm, wn) computes heads 16 wm.. x keys 32 wn.. over all of D.
        {
            const int wm = warp & 3, wn = warp >> 2;
            float s[4][4];
            #pragma unroll
            for (int ni = 0; ni < 4; ++ni) s[ni][0] = s[ni][1] = s[ni][2] = s[ni][3] = 0.f;
            #pragma unroll 4
            for (int kk = 0; kk < D; kk += 16) {
                uint32_t a[4];
                ldmatrix_x4(a, sm.q + (wm * 16 + (lane % 16)) * LD + kk + (lane / 16) * 8);
                #pragma unroll
                for (int nj = 0; nj < 2; ++nj) {
                    uint32_t bb[4];
                    ldmatrix_x4(bb, kt + (wn * 32 + nj * 16 + (lane / 16) * 8 + (lane % 8)) * LD + kk + ((lane / 8) % 2) * 8);
                    mma_bf16(s[2 * nj], a, bb[0], bb[1]);
                    mma_bf16(s[2 * nj + 1], a, bb[2], bb[3]);
                }
            }
            #pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const int h = wm * 16 + g, j = wn * 32 + ni * 8 + 2 * qd;
                sm.s[h * SLD + j] = s[ni][0] * scale;
                sm.s[h * SLD + j + 1] = s[ni][1] * scale;
                sm.s[(h + 8) * SLD + j] = s[ni][2] * scale;
                sm.s[(h + 8) * SLD + j + 1] = s[ni][3] * scale;
            }
        }
        __syncthreads();
        // Online softmax: 4 threads a head, 16 keys each.
        {
            const int h = tid >> 2, j0 = (tid & 3) * (KT / 4);
            float v[KT / 4], mx = -INFINITY;
            #pragma unroll
            for (int j = 0; j < KT / 4; ++j) {
                v[j] = sm.rows[stage][j0 + j] >= 0 ? sm.s[h * SLD + j0 + j] : -INFINITY;
                mx = fmaxf(mx, v[j]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_old = sm.m[h];
            const float m_new = fmaxf(m_old, mx);
            // m_new = -inf only while a head has seen no key and no sink (splits > 0, skipped rows).
            float sum = 0.f;
            #pragma unroll
            for (int j = 0; j < KT / 4; ++j) {
                const float e = v[j] == -INFINITY ? 0.f : __expf(v[j] - m_new);
                const __nv_bfloat16 eb = __float2bfloat16_rn(e);
                sm.p[h * PLD + j0 + j] = eb;
                sum += __bfloat162float(eb);  // the sum of exactly what P·V multiplies
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            __syncwarp();
            if ((tid & 3) == 0) {
                const float a = m_old == -INFINITY ? 0.f : __expf(m_old - m_new);  // m_new >= m_old > -inf
                sm.alpha[h] = a;
                sm.l[h] = sm.l[h] * a + sum;
                sm.m[h] = m_new;
            }
        }
        __syncthreads();
        // O = alpha * O + P V, V = the same key rows.
        {
            #pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                const float a0 = sm.alpha[mi * 16 + g], a1 = sm.alpha[mi * 16 + g + 8];
                #pragma unroll
                for (int ni = 0; ni < 8; ++ni) {
                    o[mi][ni][0] *= a0;
                    o[mi][ni][1] *= a0;
                    o[mi][ni][2] *= a1;
                    o[mi][ni][3] *= a1;
                }
            }
            #pragma unroll
            for (int ks = 0; ks < KT; ks += 16) {
                uint32_t a[4][4];
                #pragma unroll
                for (int mi = 0; mi < 4; ++mi) ldmatrix_x4(a[mi], sm.p + (mi * 16 + (lane % 16)) * PLD + ks + (lane / 16) * 8);
                #pragma unroll
                for (int nj = 0; nj < 4; ++nj) {
                    uint32_t bb[4];
                    ldmatrix_x4_trans(bb, kt + (ks + (lane % 8) + ((lane / 8) % 2) * 8) * LD + warp * 64 + nj * 16 + (lane / 16) * 8);
                    #pragma unroll
                    for (int mi = 0; mi < 4; ++mi) {
                        mma_bf16(o[mi][2 * nj], a[mi], bb[0], bb[1]);
                        mma_bf16(o[mi][2 * nj + 1], a[mi], bb[2], bb[3]);
                    }
                }
            }
        }
        // The rows of the tile after the next go where this tile's were (read by the next
        // iteration's copies after its barrier; this tile's softmax is done with them).
        if (tid < KT) sm.rows[stage][tid] = next_row;
    }
    cp_async_wait_groups();  // Q's copies, when this split had no keys
    __syncthreads();
    // Rows h = mi*16 + g (+8), columns warp*64 + ni*8 + 2qd (+1). One split: the normalised rows
    // staged in the free key tiles (row stride LD: conflict-free), then whole rows out with
    // 16-byte stores (the pairs straight to global memory were 16-byte pieces of 8 rows a store).
    __nv_bfloat16* staged = sm.k[0];
    #pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int h = mi * 16 + g + 8 * hh;
            if (h >= static_cast<int>(heads)) continue;
            if (splits == 1) {
                const float inv = sm.l[h] > 0.f ? 1.f / sm.l[h] : 0.f;
                #pragma unroll
                for (int ni = 0; ni < 8; ++ni)
                    *reinterpret_cast<__nv_bfloat162*>(staged + h * LD + warp * 64 + ni * 8 + 2 * qd) =
                        __floats2bfloat162_rn(o[mi][ni][2 * hh] * inv, o[mi][ni][2 * hh + 1] * inv);
            } else {
                float* dst = o_part + ((static_cast<size_t>(b) * splits + split) * heads + h) * D + warp * 64 + 2 * qd;
                #pragma unroll
                for (int ni = 0; ni < 8; ++ni)
                    *reinterpret_cast<float2*>(dst + ni * 8) = make_float2(o[mi][ni][2 * hh], o[mi][ni][2 * hh + 1]);
            }
        }
    }
    if (splits == 1) {
        __syncthreads();
        for (int h = warp; h < static_cast<int>(heads); h += THREADS / 32)
            for (int c = lane; c < D / 8; c += 32)
                *reinterpret_cast<uint4*>(out + (static_cast<size_t>(b) * heads + h) * D + c * 8) =
                    *reinterpret_cast<const uint4*>(staged + h * LD + c * 8);
    }
    if (splits > 1 && tid < static_cast<int>(heads)) {
        float* ml = ml_part + ((static_cast<size_t>(b) * splits + split) * heads + tid) * 2;
        ml[0] = sm.m[tid];
        ml[1] = sm.l[tid];
    }
}

// out[b, h, :] = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s over the splits (M = max m_s).
// A block of 128 threads per (b, h), 4 columns each.
extern "C" __global__ void __launch_bounds__(128) di_attn_decode_combine(const float* __restrict__ o_part,
                                                                         const float* __restrict__ ml_part,
                                                                         __nv_bfloat16* __restrict__ out,
                                                                         uint32_t heads, uint32_t splits) {
    const uint32_t b = blockIdx.x / heads, h = blockIdx.x % heads;
    float mx = -INFINITY;
    for (uint32_t s = 0; s < splits; ++s) mx = fmaxf(mx, ml_part[((static_cast<size_t>(b) * splits + s) * heads + h) * 2]);
    float den = 0.f;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (uint32_t s = 0; s < splits; ++s) {
        const float* ml = ml_part + ((static_cast<size_t>(b) * splits + s) * heads + h) * 2;
        if (ml[1] == 0.f) continue;  // no keys and no sink in this split
        const float w = __expf(ml[0] - mx);
        den += w * ml[1];
        const float4 v = *reinterpret_cast<const float4*>(o_part + ((static_cast<size_t>(b) * splits + s) * heads + h) * D + threadIdx.x * 4);
        acc[0] += w * v.x;
        acc[1] += w * v.y;
        acc[2] += w * v.z;
        acc[3] += w * v.w;
    }
    const float inv = 1.f / den;
    __nv_bfloat16* dst = out + (static_cast<size_t>(b) * heads + h) * D + threadIdx.x * 4;
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(acc[0] * inv, acc[1] * inv);
    *reinterpret_cast<__nv_bfloat162*>(dst + 2) = __floats2bfloat162_rn(acc[2] * inv, acc[3] * inv);
}
