// Manifold-constrained hyper-connections and the token embedding (MODEL_V4.md §3-4), reproducing
// `kernels-ffi::cpu::hc` (issue #7). The residual X is [tokens, n, D] f32 (n <= 4 streams).
//
// di_hc_mix / di_hc_mix16: the mixes, i.e. the sums of squares of the flattened streams and their
//   (2+n)·n projections: for few tokens split over (4-token tile, range of the streams) blocks, for
//   many 16 tokens a block (the fn weights staged once per block, each stream value read once).
// di_hc_pre: a block per 4 tokens adds those partial sums (a fixed order), 16 lanes per token
//   derive pre/post/comb (Sinkhorn in the reference's order), and the block collapses the streams
//   and applies the sublayer's RMSNorm (fused: the collapsed row never goes to memory), writing the
//   bf16 sublayer input. With head = 1 the site has n mixes (pre only) and the norm is the model's
//   final norm: the input of the head GEMM. (With splits = 0 it computes the mixes itself.)
// di_hc_post: X'_k = post_k·y + Σ_j comb[j,k]·X_j, a thread per (token, coordinate), in the
//   reference's order without contractions.
// di_embed_streams: each token's embedding row into all n streams.
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int TOK = 4;        // tokens a di_hc_pre block
constexpr int THREADS = 256;
constexpr int MAXW = 24;      // most mixes a site has: (2 + 4)·4
constexpr int MAXN = 4;

__device__ __forceinline__ float sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

}  // namespace

// The mixes' partial sums over one range of the flattened streams, for the block's TOK tokens:
// acc[t][o] = sum_k fn_w[o, k]·x[t, k] and the sum of squares, reduced over the block (warps by
// shuffles, then the warps in order) into mix[t][0..width) and mix[t][MAXW].
__device__ void mix_partial(const float* __restrict__ x, const float* __restrict__ fn_w, uint32_t tokens, uint32_t nd,
                            uint32_t width, uint32_t t0, uint32_t kbeg, uint32_t kend,
                            float (&red)[THREADS / 32][TOK * (MAXW + 1)], float (&mix)[TOK][MAXW + 1]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc[TOK][MAXW];
    float ss[TOK];
#pragma unroll
    for (int t = 0; t < TOK; ++t) {
        ss[t] = 0.f;
#pragma unroll
        for (int o = 0; o < MAXW; ++o) acc[t][o] = 0.f;
    }
    for (uint32_t k = kbeg + threadIdx.x; k < kend; k += THREADS) {
        float xv[TOK];
#pragma unroll
        for (int t = 0; t < TOK; ++t) {
            xv[t] = (t0 + t < tokens) ? x[static_cast<size_t>(t0 + t) * nd + k] : 0.f;
            ss[t] += xv[t] * xv[t];
        }
#pragma unroll
        for (int o = 0; o < MAXW; ++o) {
            if (o < static_cast<int>(width)) {
                const float w = fn_w[static_cast<size_t>(o) * nd + k];
#pragma unroll
                for (int t = 0; t < TOK; ++t) acc[t][o] += w * xv[t];
            }
        }
    }
#pragma unroll
    for (int t = 0; t < TOK; ++t) {
#pragma unroll
        for (int o = 0; o <= MAXW; ++o) {
            float v = o < MAXW ? acc[t][o] : ss[t];
            if (o < MAXW && o >= static_cast<int>(width)) continue;
            for (int s = 16; s > 0; s >>= 1) v += __shfl_down_sync(0xffffffffu, v, s);
            if (lane == 0) red[warp][t * (MAXW + 1) + o] = v;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < TOK * (MAXW + 1); i += THREADS) {
        float v = 0.f;
        for (int w = 0; w < THREADS / 32; ++w) v += red[w][i];
        mix[i / (MAXW + 1)][i % (MAXW + 1)] = v;
    }
    __syncthreads();
}

// The mixes of many tokens: a block per 16 tokens (four di_hc_pre tiles), warp w owning tokens
// 2w, 2w + 1 and all their mixes, lanes striding over the flattened streams (4 consecutive values
// a lane when n·D % 4 == 0). The fn weights go through shared memory in chunks of MIX_KC, read
// once per block; each token's streams are read once (the earlier form, warps owning mixes, read
// them once per warp: 0.73 ms at 4096 tokens). Writes partial[0][tile][TOK][MAXW + 1] for the
// block's four tiles, the layout di_hc_pre reads with splits = 1.
constexpr int TOK16 = 16;
constexpr int MIX_KC = 256;  // flattened-stream values per shared-memory chunk of fn
extern "C" __global__ void __launch_bounds__(THREADS) di_hc_mix16(const float* __restrict__ x,
                                                                  const float* __restrict__ fn_w,
                                                                  float* __restrict__ partial, uint32_t tokens,
                                                                  uint32_t n, uint32_t dim, uint32_t head) {
    __shared__ __align__(16) float ws[MAXW * MIX_KC];
    const uint32_t nd = n * dim;
    const uint32_t width = head ? n : (2 + n) * n;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t t0 = blockIdx.x * TOK16 + 2 * warp;  // this warp's two tokens
    const bool vec = nd % 4 == 0;
    float acc[2][MAXW], ss[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        ss[t] = 0.f;
#pragma unroll
        for (int o = 0; o < MAXW; ++o) acc[t][o] = 0.f;
    }
    // acc[t][o] += fn[o][k .. k + V) . x[t][k .. k + V) for the V values at chunk offset kk.
    auto accumulate = [&](const float (&xv)[2][4], uint32_t kk, int v) {
#pragma unroll
        for (int t = 0; t < 2; ++t)
            for (int e = 0; e < v; ++e) ss[t] += xv[t][e] * xv[t][e];
#pragma unroll
        for (int o = 0; o < MAXW; ++o) {
            if (o >= static_cast<int>(width)) continue;
            float w[4];
            if (v == 4) {
                const float4 w4 = *reinterpret_cast<const float4*>(ws + o * MIX_KC + kk);
                w[0] = w4.x, w[1] = w4.y, w[2] = w4.z, w[3] = w4.w;
            } else {
                w[0] = ws[o * MIX_KC + kk];
            }
#pragma unroll
            for (int t = 0; t < 2; ++t)
                for (int e = 0; e < v; ++e) acc[t][o] += w[e] * xv[t][e];
        }
    };
    for (uint32_t c0 = 0; c0 < nd; c0 += MIX_KC) {
        const uint32_t kc = min(static_cast<uint32_t>(MIX_KC), nd - c0);
        __syncthreads();  // the previous chunk's weights are used
        for (uint32_t i = threadIdx.x; i < width * MIX_KC; i += THREADS) {
            const uint32_t o = i / MIX_KC, kk = i % MIX_KC;
            ws[i] = kk < kc ? fn_w[static_cast<size_t>(o) * nd + c0 + kk] : 0.f;
        }
        __syncthreads();
        if (vec) {
            for (uint32_t kk = 4 * lane; kk < kc; kk += 128) {
                float xv[2][4];
#pragma unroll
                for (int t = 0; t < 2; ++t) {
                    const float4 v4 = t0 + t < tokens ? *reinterpret_cast<const float4*>(x + static_cast<size_t>(t0 + t) * nd + c0 + kk)
                                                      : make_float4(0.f, 0.f, 0.f, 0.f);
                    xv[t][0] = v4.x, xv[t][1] = v4.y, xv[t][2] = v4.z, xv[t][3] = v4.w;
                }
                accumulate(xv, kk, 4);
            }
        } else {
            for (uint32_t kk = lane; kk < kc; kk += 32) {
                float xv[2][4] = {};
#pragma unroll
                for (int t = 0; t < 2; ++t) xv[t][0] = t0 + t < tokens ? x[static_cast<size_t>(t0 + t) * nd + c0 + kk] : 0.f;
                accumulate(xv, kk, 1);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const uint32_t tb = 2 * warp + t;  // token within the block
        // Tile (blockIdx.x * 4 + tb / TOK), token tb % TOK of it.
        float* out = partial + (static_cast<size_t>(blockIdx.x) * 4 + tb / TOK) * TOK * (MAXW + 1) +
                     static_cast<size_t>(tb % TOK) * (MAXW + 1);
#pragma unroll
        for (int o = 0; o <= MAXW; ++o) {  // every element, zeros past width
            float v = o < MAXW ? acc[t][o] : ss[t];
            for (int sh = 16; sh > 0; sh >>= 1) v += __shfl_down_sync(0xffffffffu, v, sh);
            if (lane == 0) out[o] = v;
        }
    }
}

// Split pass of the mixes: block (tile, split) sums the flattened streams' range split·chunk ..
// (split+1)·chunk for its TOK tokens into partial[split][tile][TOK][MAXW + 1] (few tokens spread
// the 16384-long sums over many blocks instead of one).
extern "C" __global__ void __launch_bounds__(THREADS) di_hc_mix(const float* __restrict__ x,
                                                                const float* __restrict__ fn_w,
                                                                float* __restrict__ partial, uint32_t tokens,
                                                                uint32_t n, uint32_t dim, uint32_t head,
                                                                uint32_t chunk) {
    __shared__ float red[THREADS / 32][TOK * (MAXW + 1)];
    __shared__ float mix[TOK][MAXW + 1];
    const uint32_t nd = n * dim;
    const uint32_t width = head ? n : (2 + n) * n;
    const uint32_t kbeg = blockIdx.y * chunk, kend = min(kbeg + chunk, nd);
    mix_partial(x, fn_w, tokens, nd, width, blockIdx.x * TOK, kbeg, kend, red, mix);
    float* out = partial + (static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x) * TOK * (MAXW + 1);
    for (int i = threadIdx.x; i < TOK * (MAXW + 1); i += THREADS) out[i] = mix[i / (MAXW + 1)][i % (MAXW + 1)];
}

// One token's weights from its raw mix sums (times the RMS factor `inv`): pre [N]; unless head,
// post [N] and comb [N, N] (Sinkhorn in the reference's order: row softmax + eps, a column pass,
// then iters - 1 row and column passes). Computed by 16 lanes of a warp (lane j·4 + k, j, k < 4:
// matrix element (j, k)): a row's (column's) sum gathers its N values by shuffles within the 16 and
// adds them in k (j) order, as a single thread would. Each pass costs a lane 4 shuffles, 3 adds and
// a division instead of a thread's N·N of each (one thread per token left the block waiting: 44 us
// for one token). `mixt` in shared memory; every lane of the 16 calls it.
template <int N>
__device__ void site_weights_lanes(const float* mixt, float inv, const float* __restrict__ base,
                                   const float* __restrict__ scale, uint32_t head, uint32_t iters, float hc_eps,
                                   float* pre, float* post, float* comb) {
    const int l = threadIdx.x & 15, j = l / 4, k = l % 4;
    const bool live = j < N && k < N;
    const unsigned mask = 0xffffu << (threadIdx.x & 16);
    if (j < N && k == 0) {
        pre[j] = sigmoid(mixt[j] * inv * scale[0] + base[j]) + hc_eps;
        if (!head) post[j] = 2.0f * sigmoid(mixt[N + j] * inv * scale[1] + base[N + j]);
    }
    if (head) return;
    // Shuffles of the whole 16 (every lane takes part; dead lanes carry zeros).
    auto row_sum = [&](float v) {
        float sum = 0.f;
#pragma unroll
        for (int kk = 0; kk < N; ++kk) sum += __shfl_sync(mask, v, j * 4 + kk, 16);
        return sum;
    };
    auto col_sum = [&](float v) {
        float sum = 0.f;
#pragma unroll
        for (int jj = 0; jj < N; ++jj) sum += __shfl_sync(mask, v, jj * 4 + k, 16);
        return sum;
    };
    float c = live ? __fadd_rn(__fmul_rn(mixt[2 * N + j * N + k] * inv, scale[2]), base[2 * N + j * N + k]) : -INFINITY;
    float mx = -INFINITY;
#pragma unroll
    for (int kk = 0; kk < N; ++kk) mx = fmaxf(mx, __shfl_sync(mask, c, j * 4 + kk, 16));
    c = live ? expf(c - mx) : 0.f;
    const float sum0 = row_sum(c);
    c = live ? __fadd_rn(__fdiv_rn(c, sum0), hc_eps) : 0.f;
    for (uint32_t it = 0; it < max(iters, 1u); ++it) {  // the column pass runs even for 0 iterations
        if (it > 0) {
            const float rs = row_sum(c);
            c = live ? __fdiv_rn(c, rs + hc_eps) : 0.f;
        }
        const float cs = col_sum(c);
        c = live ? __fdiv_rn(c, cs + hc_eps) : 0.f;
    }
    if (live) comb[j * N + k] = c;
}

// x [tokens, n, D]; fn_w [width, n·D]; base [width]; scale [3] (head: [1]); norm_w [D]; post
// [tokens, n], comb [tokens, n, n] (not written when head); out [tokens, D] bf16. With splits > 0
// the mixes come from di_hc_mix's partial sums (added in split order), else this block computes
// them. Dynamic shared memory: D floats.
extern "C" __global__ void __launch_bounds__(THREADS) di_hc_pre(
    const float* __restrict__ x, const float* __restrict__ fn_w, const float* __restrict__ base,
    const float* __restrict__ scale, const float* __restrict__ norm_w, float* __restrict__ post,
    float* __restrict__ comb, __nv_bfloat16* __restrict__ out, const float* __restrict__ partial, uint32_t splits,
    uint32_t tokens, uint32_t n, uint32_t dim, uint32_t head, uint32_t iters, float hc_eps, float norm_eps) {
    extern __shared__ float row[];  // [dim]: one collapsed token
    __shared__ float red[THREADS / 32][TOK * (MAXW + 1)];
    __shared__ float mix[TOK][MAXW + 1];
    __shared__ float pre[TOK][MAXN];
    __shared__ float part[THREADS / 32];
    const uint32_t t0 = blockIdx.x * TOK;
    const uint32_t nd = n * dim;
    const uint32_t width = head ? n : (2 + n) * n;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (splits == 0) {
        mix_partial(x, fn_w, tokens, nd, width, t0, 0, nd, red, mix);
    } else {
        // Warp w owns values w, w + 8, ..: lanes add the splits lane, lane + 32, .. in order for
        // all of them (every load in flight at once), then a fixed shuffle tree per value.
        constexpr int PER_WARP = (TOK * (MAXW + 1) + THREADS / 32 - 1) / (THREADS / 32);
        float v[PER_WARP];
#pragma unroll
        for (int r = 0; r < PER_WARP; ++r) v[r] = 0.f;
        for (uint32_t sp = lane; sp < splits; sp += 32) {
            const float* ps = partial + (static_cast<size_t>(sp) * gridDim.x + blockIdx.x) * TOK * (MAXW + 1);
#pragma unroll
            for (int r = 0; r < PER_WARP; ++r) {
                const int i = warp + r * (THREADS / 32);
                if (i < TOK * (MAXW + 1)) v[r] += ps[i];
            }
        }
#pragma unroll
        for (int r = 0; r < PER_WARP; ++r) {
            const int i = warp + r * (THREADS / 32);
            float t = v[r];
            for (int o = 16; o > 0; o >>= 1) t += __shfl_down_sync(0xffffffffu, t, o);
            if (lane == 0 && i < TOK * (MAXW + 1)) mix[i / (MAXW + 1)][i % (MAXW + 1)] = t;
        }
        __syncthreads();
    }
    // Weights, 16 lanes per token (n known at compile time).
    if (threadIdx.x < 16 * TOK && t0 + threadIdx.x / 16 < tokens) {
        const int t = threadIdx.x / 16;
        const float inv = 1.0f / sqrtf(mix[t][MAXW] / static_cast<float>(nd) + norm_eps);
        float* po = head ? nullptr : post + static_cast<size_t>(t0 + t) * n;
        float* co = head ? nullptr : comb + static_cast<size_t>(t0 + t) * n * n;
        switch (n) {
            case 1: site_weights_lanes<1>(mix[t], inv, base, scale, head, iters, hc_eps, pre[t], po, co); break;
            case 2: site_weights_lanes<2>(mix[t], inv, base, scale, head, iters, hc_eps, pre[t], po, co); break;
            case 3: site_weights_lanes<3>(mix[t], inv, base, scale, head, iters, hc_eps, pre[t], po, co); break;
            default: site_weights_lanes<4>(mix[t], inv, base, scale, head, iters, hc_eps, pre[t], po, co); break;
        }
    }
    __syncthreads();
    // Collapse and RMSNorm, token by token.
    for (int t = 0; t < TOK && t0 + t < tokens; ++t) {
        const float* xt = x + static_cast<size_t>(t0 + t) * nd;
        float sq = 0.f;
        for (uint32_t d = threadIdx.x; d < dim; d += THREADS) {
            float v = 0.f;
            for (uint32_t j = 0; j < n; ++j) v = __fadd_rn(v, __fmul_rn(pre[t][j], xt[j * dim + d]));
            row[d] = v;
            sq += v * v;
        }
        for (int s = 16; s > 0; s >>= 1) sq += __shfl_down_sync(0xffffffffu, sq, s);
        if (lane == 0) part[warp] = sq;
        __syncthreads();
        float total = 0.f;
        for (int w = 0; w < THREADS / 32; ++w) total += part[w];
        const float inv = 1.0f / sqrtf(total / static_cast<float>(dim) + norm_eps);
        __nv_bfloat16* o = out + static_cast<size_t>(t0 + t) * dim;
        for (uint32_t d = threadIdx.x; d < dim; d += THREADS) o[d] = __float2bfloat16(row[d] * inv * norm_w[d]);
        __syncthreads();
    }
}

// x [tokens, n, D] f32 in place; y [tokens, D] bf16 (the sublayer output); post [tokens, n]; comb
// [tokens, n, n].
extern "C" __global__ void __launch_bounds__(THREADS) di_hc_post(float* __restrict__ x,
                                                                 const __nv_bfloat16* __restrict__ y,
                                                                 const float* __restrict__ post,
                                                                 const float* __restrict__ comb, uint32_t tokens,
                                                                 uint32_t n, uint32_t dim) {
    const size_t i = static_cast<size_t>(blockIdx.x) * THREADS + threadIdx.x;
    if (i >= static_cast<size_t>(tokens) * dim) return;
    const uint32_t t = static_cast<uint32_t>(i / dim), d = static_cast<uint32_t>(i % dim);
    float* xt = x + static_cast<size_t>(t) * n * dim;
    float old[MAXN];
    for (uint32_t j = 0; j < n; ++j) old[j] = xt[j * dim + d];
    const float yv = __bfloat162float(y[i]);
    const float* c = comb + static_cast<size_t>(t) * n * n;
    for (uint32_t k = 0; k < n; ++k) {
        float mix = 0.f;
        for (uint32_t j = 0; j < n; ++j) mix = __fadd_rn(mix, __fmul_rn(c[j * n + k], old[j]));
        xt[k * dim + d] = __fadd_rn(__fmul_rn(post[t * n + k], yv), mix);
    }
}

// ids [tokens]; table [vocab, D] bf16; x [tokens, n, D] f32. An id outside the table gives a zero
// row and sets *status to 1.
extern "C" __global__ void __launch_bounds__(THREADS) di_embed_streams(const int32_t* __restrict__ ids,
                                                                       const __nv_bfloat16* __restrict__ table,
                                                                       float* __restrict__ x, uint32_t tokens,
                                                                       uint32_t n, uint32_t dim, uint32_t vocab,
                                                                       int32_t* __restrict__ status) {
    const size_t i = static_cast<size_t>(blockIdx.x) * THREADS + threadIdx.x;
    if (i >= static_cast<size_t>(tokens) * dim) return;
    const uint32_t t = static_cast<uint32_t>(i / dim), d = static_cast<uint32_t>(i % dim);
    const int32_t id = ids[t];
    const bool ok = id >= 0 && static_cast<uint32_t>(id) < vocab;
    if (!ok && d == 0) *status = 1;
    const float v = ok ? __bfloat162float(table[static_cast<size_t>(id) * dim + d]) : 0.f;
    for (uint32_t k = 0; k < n; ++k) x[(static_cast<size_t>(t) * n + k) * dim + d] = v;
}
