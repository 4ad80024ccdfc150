// Token choice on the device (issue #7): temperature, top-k, top-p, min-p, a draw from the
// counter-based uniform keyed by (seed, position), and log-probabilities, reproducing
// `kernels-ffi::cpu::sampling::choose` (its doc comment is the definition).
//
// One block of 1024 threads per row. Candidates are ordered by a 64-bit key: the order-preserving
// bits of the logit above the complement of the token id, so descending key = descending logit,
// ties to the lower id (the CPU's candidate order). Probabilities relative to the best token,
// exp((l - max) / t) in f64, are held as integers in units of 2^-40 ("mass"), so every sum is exact
// and independent of thread order: the result depends on the row alone (no batch or scheduling
// dependence). Positions in the candidate order are found by an 8-bit radix descent over the key
// with a mass (or count) histogram per digit. The CPU sums f64 in candidate order; the two agree on
// the token unless a top-p boundary or the draw falls within about vocab x 2^-40 of a candidate
// boundary (the parity test measures that margin).
#include <stdint.h>
#include <math.h>

namespace {

constexpr int T = 1024;           // threads a block
constexpr double MASS_ONE = 1099511627776.0;  // 2^40

__device__ __forceinline__ uint32_t order_key(float f) {
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Finite or +inf; -inf (masked) and NaN are never candidates.
__device__ __forceinline__ bool usable(float f) { return f > -INFINITY; }

__device__ __forceinline__ uint64_t cand_key(float f, uint32_t id) {
    return (static_cast<uint64_t>(order_key(f)) << 32) | static_cast<uint64_t>(0xFFFFFFFFu - id);
}

__device__ __forceinline__ uint32_t key_id(uint64_t k) { return 0xFFFFFFFFu - static_cast<uint32_t>(k); }

// The CPU's `uniform(seed, position)`: two SplitMix64 rounds, 53 bits.
__device__ double uniform(uint64_t seed, uint64_t position) {
    uint64_t z = seed ^ (position * 0x9E3779B97F4A7C15ull) ^ 0xD1B54A32D192ED03ull;
    for (int i = 0; i < 2; ++i) {
        z += 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
    }
    return static_cast<double>(z >> 11) / 9007199254740992.0;
}

// Histogram counters: a mass (< 2^41) is added as four 10-bit parts to u32 counters (native shared
// atomics; each part's sum stays below 2^31 for vocabularies up to 2^21), reassembled exactly.
constexpr int PARTS = 4;
constexpr int FD_UNROLL = 8;  // entries a thread loads at once in find_desc's passes

struct Shared {
    uint32_t hist[PARTS][256];
    uint32_t cnt[256];  // entries per digit (mass descents, from level 1)
    unsigned long long red[32];
    unsigned long long prefix, rem, key;
    int found, single;
    uint64_t top[20];
    int ntop_found;
    uint32_t pick;
};

struct Max {
    __device__ uint64_t operator()(uint64_t a, uint64_t b) const { return a > b ? a : b; }
};
struct Min {
    __device__ uint64_t operator()(uint64_t a, uint64_t b) const { return a < b ? a : b; }
};
struct Add {
    __device__ uint64_t operator()(uint64_t a, uint64_t b) const { return a + b; }
};

// A reduction over the block in a fixed tree (deterministic for f64 sums), result on every thread.
template <typename V, typename Op>
__device__ V block_reduce(V v, Op op, Shared& sh) {
    V* red = reinterpret_cast<V*>(sh.red);
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    if (w == 0) {
        v = red[lane];
        for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
        if (lane == 0) red[0] = v;
    }
    __syncthreads();
    return red[0];
}

struct AddF64 {
    __device__ double operator()(double a, double b) const { return a + b; }
};

// Among usable entries with key >= lo, in descending key order, the key of the entry at which the
// inclusive running weight (mass, or 1 each when `count`) first reaches `target` (>= 1); the last
// weighted entry when the set weighs less; 0 when it weighs nothing.
__device__ uint64_t find_desc(const float* l, const uint64_t* mass, uint32_t vocab, uint64_t lo, uint64_t target,
                              bool count, Shared& sh) {
    uint64_t prefix = 0, rem = target;
    for (int level = 0; level < 8; ++level) {
        const int shift = 56 - 8 * level;
        for (int i = threadIdx.x; i < PARTS * 256; i += T) sh.hist[i / 256][i % 256] = 0;
        if (threadIdx.x < 256) sh.cnt[threadIdx.x] = 0;
        __syncthreads();
        // FD_UNROLL entries a thread per step, every load issued before any is used: one entry at
        // a time waited on its two L2 loads each (latency-bound, 32 warps an SM).
        for (uint32_t i0 = threadIdx.x; i0 < vocab; i0 += FD_UNROLL * T) {
            float fs[FD_UNROLL];
            uint64_t ws[FD_UNROLL];
#pragma unroll
            for (int u = 0; u < FD_UNROLL; ++u) {
                const uint32_t i = i0 + u * T;
                fs[u] = i < vocab ? l[i] : -INFINITY;
                ws[u] = !count && i < vocab ? mass[i] : 0;
            }
#pragma unroll
            for (int u = 0; u < FD_UNROLL; ++u) {
                const uint32_t i = i0 + u * T;
                const float f = fs[u];
                if (!usable(f)) continue;
                const uint64_t k = cand_key(f, i);
                if (k < lo) continue;
                if (level > 0 && (k >> (shift + 8)) != (prefix >> (shift + 8))) continue;
                const uint32_t d = static_cast<uint32_t>(k >> shift) & 255u;
                if (count) {
                    atomicAdd(&sh.hist[0][d], 1u);
                } else {
                    if (level > 0) atomicAdd(&sh.cnt[d], 1u);
                    const uint64_t w = ws[u];
#pragma unroll
                    for (int q = 0; q < PARTS; ++q) {
                        const uint32_t part =
                            static_cast<uint32_t>(w >> (10 * q)) & (q == PARTS - 1 ? 0x7FFu : 0x3FFu);
                        if (part) atomicAdd(&sh.hist[q][d], part);
                    }
                }
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int chosen = -1, last = -1;
            uint64_t r = rem;
            auto bucket = [&](int d) {
                uint64_t h = 0;
#pragma unroll
                for (int q = 0; q < PARTS; ++q) h += static_cast<uint64_t>(sh.hist[q][d]) << (10 * q);
                return h;
            };
            for (int d = 255; d >= 0; --d) {
                const uint64_t h = bucket(d);
                if (!h) continue;
                last = d;
                if (r <= h) {
                    chosen = d;
                    break;
                }
                r -= h;
            }
            if (chosen < 0 && last >= 0) {  // asked past the end: the last entry of the set
                chosen = last;
                r = bucket(last);
            }
            sh.found = chosen >= 0;
            sh.prefix = prefix | (static_cast<uint64_t>(chosen < 0 ? 0 : chosen) << shift);
            sh.rem = r;
            // One entry under the chosen digit: the remaining levels could only spell out its key.
            sh.single = chosen >= 0 && level < 7 && (count ? bucket(chosen) == 1 : level > 0 && sh.cnt[chosen] == 1);
        }
        __syncthreads();
        if (!sh.found) return 0;
        prefix = sh.prefix;
        rem = sh.rem;
        if (sh.single) {
            // Its key, from the one pass that meets it (usable, >= lo, under the prefix so far).
            for (uint32_t i0 = threadIdx.x; i0 < vocab; i0 += FD_UNROLL * T) {
                float fs[FD_UNROLL];
#pragma unroll
                for (int u = 0; u < FD_UNROLL; ++u) fs[u] = i0 + u * T < vocab ? l[i0 + u * T] : -INFINITY;
#pragma unroll
                for (int u = 0; u < FD_UNROLL; ++u) {
                    if (!usable(fs[u])) continue;
                    const uint64_t k = cand_key(fs[u], i0 + u * T);
                    if (k >= lo && (k >> shift) == (prefix >> shift)) sh.key = k;
                }
            }
            __syncthreads();
            return sh.key;
        }
    }
    return prefix;
}

}  // namespace

// logits [B, vocab] f32 (-inf: masked); fparams [B, 4]: temperature, top_p, min_p, unused;
// iparams [B, 6]: top_k, top_logprobs, seed (low, high 32 bits), position (low, high); mass
// [B, vocab] scratch; token [B]; logprob [B]; top_ids / top_lp [B, top_stride] (-1 / NaN past a
// row's top_logprobs). A row without a usable logit gets token -1 and sets *status to 1.
extern "C" __global__ void __launch_bounds__(T) di_sample(const float* __restrict__ logits, uint32_t vocab,
                                                          const float* __restrict__ fparams,
                                                          const int32_t* __restrict__ iparams,
                                                          uint64_t* __restrict__ mass_all, int32_t* __restrict__ token,
                                                          float* __restrict__ logprob, int32_t* __restrict__ top_ids,
                                                          float* __restrict__ top_lp, uint32_t top_stride,
                                                          int32_t* __restrict__ status) {
    __shared__ Shared sh;
    const uint32_t b = blockIdx.x;
    const float* l = logits + static_cast<size_t>(b) * vocab;
    uint64_t* mass = mass_all + static_cast<size_t>(b) * vocab;
    const float temperature = fparams[b * 4], top_p = fparams[b * 4 + 1], min_p = fparams[b * 4 + 2];
    const int32_t* ip = iparams + b * 6;
    const uint32_t top_k = static_cast<uint32_t>(ip[0]);
    const uint32_t ntop = min(static_cast<uint32_t>(ip[1]), min(top_stride, 20u));
    const uint64_t seed = static_cast<uint32_t>(ip[2]) | (static_cast<uint64_t>(static_cast<uint32_t>(ip[3])) << 32);
    const uint64_t position = static_cast<uint32_t>(ip[4]) | (static_cast<uint64_t>(static_cast<uint32_t>(ip[5])) << 32);
    const bool greedy = temperature < 1e-5f;
    const double t = greedy ? 1.0 : static_cast<double>(temperature);
    if (threadIdx.x == 0) sh.pick = 0;

    // The best entry (ties to the lower id).
    uint64_t best = 0;
    for (uint32_t i = threadIdx.x; i < vocab; i += T) {
        const float f = l[i];
        if (usable(f)) best = max(best, cand_key(f, i));
    }
    best = block_reduce(best, Max{}, sh);
    if (best == 0) {
        if (threadIdx.x == 0) {
            token[b] = -1;
            logprob[b] = NAN;
            *status = 1;
        }
        for (uint32_t j = threadIdx.x; j < top_stride; j += T) {
            top_ids[b * top_stride + j] = -1;
            top_lp[b * top_stride + j] = NAN;
        }
        return;
    }
    const double mx = static_cast<double>(l[key_id(best)]);

    // Log-normaliser and masses.
    double s = 0.0;
    for (uint32_t i = threadIdx.x; i < vocab; i += T) {
        const float f = l[i];
        double p = 0.0;
        if (usable(f)) {
            p = exp((static_cast<double>(f) - mx) / t);
            s += p;
        }
        if (!greedy) mass[i] = static_cast<uint64_t>(__double2ull_rn(p * MASS_ONE));
    }
    s = block_reduce(s, AddF64{}, sh);
    const double lse = mx + log(s) * t;

    // The top_logprobs most likely entries, in order.
    if (ntop > 0) {
        const uint64_t kth = find_desc(l, mass, vocab, 0, ntop, true, sh);
        if (threadIdx.x == 0) sh.ntop_found = 0;
        __syncthreads();
        for (uint32_t i = threadIdx.x; i < vocab; i += T) {
            const float f = l[i];
            if (usable(f) && cand_key(f, i) >= kth) {
                const int slot = atomicAdd(&sh.ntop_found, 1);
                if (slot < 20) sh.top[slot] = cand_key(f, i);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            const int n = min(sh.ntop_found, 20);
            for (int a = 1; a < n; ++a) {  // insertion sort, descending
                const uint64_t k = sh.top[a];
                int c = a - 1;
                while (c >= 0 && sh.top[c] < k) {
                    sh.top[c + 1] = sh.top[c];
                    --c;
                }
                sh.top[c + 1] = k;
            }
            for (uint32_t j = 0; j < top_stride; ++j) {
                const bool have = j < ntop && static_cast<int>(j) < n;
                const uint32_t id = have ? key_id(sh.top[j]) : 0;
                top_ids[b * top_stride + j] = have ? static_cast<int32_t>(id) : -1;
                top_lp[b * top_stride + j] = have ? static_cast<float>((static_cast<double>(l[id]) - lse) / t) : NAN;
            }
        }
        __syncthreads();
    } else {
        for (uint32_t j = threadIdx.x; j < top_stride; j += T) {
            top_ids[b * top_stride + j] = -1;
            top_lp[b * top_stride + j] = NAN;
        }
    }

    uint32_t pick = key_id(best);
    if (!greedy) {
        const double u = uniform(seed, position);
        const bool truncate = top_k > 0 || top_p < 1.0f || min_p > 0.0f;
        if (!truncate) {
            // Plain sampling walks the vocabulary in id order: contiguous chunks a thread, an
            // exclusive scan of their masses, then the owning thread walks its chunk.
            const uint32_t chunk = (vocab + T - 1) / T;
            const uint32_t begin = min(threadIdx.x * chunk, vocab), end = min(begin + chunk, vocab);
            uint64_t mine = 0;
            for (uint32_t i = begin; i < end; ++i) mine += mass[i];
            const uint64_t total = block_reduce(mine, Add{}, sh);
            uint64_t target = static_cast<uint64_t>(u * static_cast<double>(total));
            if (target >= total) target = total - 1;
            // Inclusive scan over threads (warp shuffles, then warp totals).
            uint64_t inc = mine;
            const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
            for (int o = 1; o < 32; o <<= 1) {
                const uint64_t v = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= o) inc += v;
            }
            __syncthreads();
            if (lane == 31) sh.red[w] = inc;
            __syncthreads();
            uint64_t before = 0;
            for (int j = 0; j < w; ++j) before += sh.red[j];
            const uint64_t excl = before + inc - mine;
            if (mine > 0 && excl <= target && target < excl + mine) {
                uint64_t acc = excl;
                for (uint32_t i = begin; i < end; ++i) {
                    acc += mass[i];
                    if (acc > target) {
                        sh.pick = i;
                        break;
                    }
                }
            }
            __syncthreads();
            pick = sh.pick;
        } else {
            // Candidates: the top_k best, or everything within e^-40 of the best.
            uint64_t lo;
            if (top_k > 0) {
                lo = find_desc(l, mass, vocab, 0, top_k, true, sh);
            } else {
                const double floor_l = mx - 40.0 * t;
                uint64_t m = ~0ull;
                for (uint32_t i = threadIdx.x; i < vocab; i += T) {
                    const float f = l[i];
                    if (usable(f) && static_cast<double>(f) >= floor_l) m = min(m, static_cast<uint64_t>(order_key(f)));
                }
                lo = block_reduce(m, Min{}, sh) << 32;
            }
            uint64_t keep = lo;
            if (top_p < 1.0f) {
                uint64_t part = 0;
                for (uint32_t i = threadIdx.x; i < vocab; i += T) {
                    const float f = l[i];
                    if (usable(f) && cand_key(f, i) >= lo) part += mass[i];
                }
                const uint64_t total = block_reduce(part, Add{}, sh);
                double want = ceil(static_cast<double>(top_p) * static_cast<double>(total));
                uint64_t target = want < 1.0 ? 1ull : static_cast<uint64_t>(want);
                if (target > total) target = total;
                keep = max(keep, find_desc(l, mass, vocab, lo, target, false, sh));
            }
            if (min_p > 0.0f) {
                uint64_t m = ~0ull;
                for (uint32_t i = threadIdx.x; i < vocab; i += T) {
                    const float f = l[i];
                    if (usable(f) && cand_key(f, i) >= lo &&
                        exp((static_cast<double>(f) - mx) / t) >= static_cast<double>(min_p))
                        m = min(m, static_cast<uint64_t>(order_key(f)));
                }
                m = block_reduce(m, Min{}, sh);
                if (m != ~0ull) keep = max(keep, m << 32);
            }
            uint64_t part = 0;
            for (uint32_t i = threadIdx.x; i < vocab; i += T) {
                const float f = l[i];
                if (usable(f) && cand_key(f, i) >= keep) part += mass[i];
            }
            const uint64_t kept = block_reduce(part, Add{}, sh);
            uint64_t target = static_cast<uint64_t>(u * static_cast<double>(kept));
            if (kept > 0 && target >= kept) target = kept - 1;
            const uint64_t k = find_desc(l, mass, vocab, keep, target + 1, false, sh);
            if (k != 0) pick = key_id(k);
        }
    }
    if (threadIdx.x == 0) {
        token[b] = static_cast<int32_t>(pick);
        logprob[b] = static_cast<float>((static_cast<double>(l[pick]) - lse) / t);
    }
}
