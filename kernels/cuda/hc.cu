// Manifold-constrained hyper-connections and the token embedding (MODEL_V4.md §3-4), reproducing
// `kernels-ffi::cpu::hc` (issue #7). The residual X is [tokens, n, D] f32 (n <= 4 streams).
//
// di_hc_mix / di_hc_mix16: the mixes, i.e. the sums of squares of the flattened streams and their
//   (2+n)·n projections: for few tokens split over (4-token tile, range of the streams) blocks, for
//   many 16 tokens a block (the fn weights read once per 16 tokens).
// di_hc_pre: a block per 4 tokens adds those partial sums (in split order), one thread per token
//   derives pre/post/comb (Sinkhorn in the reference's order), and the block collapses the streams
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

// The mixes of many tokens: a block per 16 tokens (four di_hc_pre tiles), warp w owning mixes
// 3w..3w+2 (24 = 8 warps x 3) for all 16 tokens, lanes striding over the flattened streams, warp 0
// also summing the squares. Each block reads the fn weights once for 16 tokens (the one-pass path
// re-reads them per 4). Writes partial[0][tile][TOK][MAXW + 1] for the block's four tiles, the
// layout di_hc_pre reads with splits = 1.
constexpr int TOK16 = 16;
extern "C" __global__ void __launch_bounds__(THREADS) di_hc_mix16(const float* __restrict__ x,
                                                                  const float* __restrict__ fn_w,
                                                                  float* __restrict__ partial, uint32_t tokens,
                                                                  uint32_t n, uint32_t dim, uint32_t head) {
    const uint32_t nd = n * dim;
    const uint32_t width = head ? n : (2 + n) * n;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t t0 = blockIdx.x * TOK16;
    const uint32_t live = min(static_cast<uint32_t>(TOK16), tokens - t0);
    float acc[TOK16][3];
    float ss[TOK16];
#pragma unroll
    for (int t = 0; t < TOK16; ++t) {
        ss[t] = 0.f;
#pragma unroll
        for (int j = 0; j < 3; ++j) acc[t][j] = 0.f;
    }
    for (uint32_t k = lane; k < nd; k += 32) {
        float w[3];
#pragma unroll
        for (int j = 0; j < 3; ++j) {
            const uint32_t o = 3 * warp + j;
            w[j] = o < width ? fn_w[static_cast<size_t>(o) * nd + k] : 0.f;
        }
#pragma unroll
        for (int t = 0; t < TOK16; ++t) {
            const float xv = static_cast<uint32_t>(t) < live ? x[static_cast<size_t>(t0 + t) * nd + k] : 0.f;
            if (warp == 0) ss[t] += xv * xv;
#pragma unroll
            for (int j = 0; j < 3; ++j) acc[t][j] += w[j] * xv;
        }
    }
#pragma unroll
    for (int t = 0; t < TOK16; ++t) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float v = j < 3 ? acc[t][j] : ss[t];
            for (int s = 16; s > 0; s >>= 1) v += __shfl_down_sync(0xffffffffu, v, s);
            if (lane != 0) continue;
            // Tile (blockIdx.x * 4 + t / TOK), token t % TOK of it.
            float* out = partial + (static_cast<size_t>(blockIdx.x) * 4 + t / TOK) * TOK * (MAXW + 1) +
                         static_cast<size_t>(t % TOK) * (MAXW + 1);
            if (j < 3) {
                const uint32_t o = 3 * warp + j;
                if (o < MAXW) out[o] = v;
            } else if (warp == 0) {
                out[MAXW] = v;
            }
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
// then iters - 1 row and column passes).
template <int N>
__device__ void site_weights(const float* mixt, float inv, const float* __restrict__ base,
                             const float* __restrict__ scale, uint32_t head, uint32_t iters, float hc_eps, float* pre,
                             float* post, float* comb) {
    float m[(2 + N) * N];
#pragma unroll
    for (int o = 0; o < (head ? N : (2 + N) * N); ++o) m[o] = mixt[o] * inv;
#pragma unroll
    for (int j = 0; j < N; ++j) pre[j] = sigmoid(m[j] * scale[0] + base[j]) + hc_eps;
    if (head) return;
#pragma unroll
    for (int j = 0; j < N; ++j) post[j] = 2.0f * sigmoid(m[N + j] * scale[1] + base[N + j]);
    float c[N][N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
        float mx = -INFINITY;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            c[j][k] = __fadd_rn(__fmul_rn(m[2 * N + j * N + k], scale[2]), base[2 * N + j * N + k]);
            mx = fmaxf(mx, c[j][k]);
        }
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            c[j][k] = expf(c[j][k] - mx);
            sum += c[j][k];
        }
#pragma unroll
        for (int k = 0; k < N; ++k) c[j][k] = __fadd_rn(__fdiv_rn(c[j][k], sum), hc_eps);
    }
    for (uint32_t it = 0; it < max(iters, 1u); ++it) {  // the column pass runs even for 0 iterations
        if (it > 0) {
#pragma unroll
            for (int j = 0; j < N; ++j) {
                float sum = 0.f;
#pragma unroll
                for (int k = 0; k < N; ++k) sum += c[j][k];
#pragma unroll
                for (int k = 0; k < N; ++k) c[j][k] = __fdiv_rn(c[j][k], sum + hc_eps);
            }
        }
#pragma unroll
        for (int k = 0; k < N; ++k) {
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < N; ++j) sum += c[j][k];
#pragma unroll
            for (int j = 0; j < N; ++j) c[j][k] = __fdiv_rn(c[j][k], sum + hc_eps);
        }
    }
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int k = 0; k < N; ++k) comb[j * N + k] = c[j][k];
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
        for (int i = threadIdx.x; i < TOK * (MAXW + 1); i += THREADS) {
            float v = 0.f;
            for (uint32_t sp = 0; sp < splits; ++sp)
                v += partial[(static_cast<size_t>(sp) * gridDim.x + blockIdx.x) * TOK * (MAXW + 1) + i];
            mix[i / (MAXW + 1)][i % (MAXW + 1)] = v;
        }
        __syncthreads();
    }
    // Weights, one thread per token (n known at compile time, so the matrices stay in registers).
    if (threadIdx.x < TOK && t0 + threadIdx.x < tokens) {
        const int t = threadIdx.x;
        const float inv = 1.0f / sqrtf(mix[t][MAXW] / static_cast<float>(nd) + norm_eps);
        float* po = head ? nullptr : post + static_cast<size_t>(t0 + t) * n;
        float* co = head ? nullptr : comb + static_cast<size_t>(t0 + t) * n * n;
        switch (n) {
            case 1: site_weights<1>(mix[t], inv, base, scale, head, iters, hc_eps, pre[t], po, co); break;
            case 2: site_weights<2>(mix[t], inv, base, scale, head, iters, hc_eps, pre[t], po, co); break;
            case 3: site_weights<3>(mix[t], inv, base, scale, head, iters, hc_eps, pre[t], po, co); break;
            default: site_weights<4>(mix[t], inv, base, scale, head, iters, hc_eps, pre[t], po, co); break;
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
