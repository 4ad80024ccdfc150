//! The device sampler against the CPU definition (`cpu::sampling::choose`) on fresh random logits
//! every run (the seed is printed; `DEEPINFER_TEST_SEED` reproduces a run). Skipped, with a
//! message, where there is no GPU; run on the H200 from the GPU bundle.
//!
//! What must agree, and why:
//! - the `top_logprobs` alternatives: the same ids in the same order (both order by logit, ties
//!   to the lower id); their log-probabilities within 2e-5 (the CPU sums the normaliser in id
//!   order, the device in a fixed tree, both in f64; the result is rounded to f32);
//! - the chosen token, exactly, unless the CPU's draw or one of its top-p / min-p boundaries lies
//!   within vocab x 2^-40 (in units of the best token's probability) of a candidate boundary: the
//!   device holds probabilities as integers in units of 2^-40, so sums can differ by that much.
//!   Such rows are counted and printed, and must stay rare;
//! - the device's own results, bit for bit, across reruns and when a row moves to another place in
//!   another batch (a row depends on itself alone).

use deepinfer_kernels_ffi::cpu::sampling::{choose, uniform, Choice, Truncation};
use deepinfer_kernels_ffi::sampling::{sample, SampleRow, SamplerWorkspace};
use deepinfer_kernels_ffi::testing::{cuda_device_or_skip, fresh_seed, SplitMix};
use deepinfer_kernels_ffi::Stream;

const LOGPROB_TOL: f32 = 2e-5;

/// The smallest distance, in units of the best token's probability, between a quantity the CPU
/// compares (the draw, the top-p running sum, the min-p floor) and the boundary it is compared with.
fn margin(l: &[f64], t: &Truncation, position: u64) -> f64 {
    if t.temperature < 1e-5 {
        return f64::INFINITY;
    }
    let temp = t.temperature as f64;
    let mx = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut cand: Vec<usize> = (0..l.len()).filter(|i| l[*i] > f64::NEG_INFINITY).collect();
    let desc = |a: &usize, b: &usize| l[*b].total_cmp(&l[*a]).then(a.cmp(b));
    if t.top_k > 0 {
        cand.sort_by(desc);
        cand.truncate(t.top_k);
    } else if t.top_p < 1.0 || t.min_p > 0.0 {
        cand.retain(|i| l[*i] >= mx - 40.0 * temp);
        cand.sort_by(desc);
    }
    let probs: Vec<f64> = cand.iter().map(|i| ((l[*i] - mx) / temp).exp()).collect();
    let total: f64 = probs.iter().sum();
    let mut m = f64::INFINITY;
    let mut keep = probs.len();
    if t.top_p < 1.0 {
        let mut acc = 0.0;
        for (k, p) in probs.iter().enumerate() {
            acc += p / total;
            m = m.min((acc - t.top_p as f64).abs() * total);
            if acc >= t.top_p as f64 {
                keep = k + 1;
                break;
            }
        }
    }
    if t.min_p > 0.0 {
        let floor = t.min_p as f64;
        probs.iter().for_each(|p| m = m.min((p - floor).abs()));
        keep = keep.min(probs.iter().take_while(|p| **p >= floor).count().max(1));
    }
    let kept: f64 = probs[..keep].iter().sum();
    let u = uniform(t.seed, position) * kept;
    let mut cum = 0.0;
    for p in &probs[..keep] {
        cum += p;
        m = m.min((cum - u).abs());
    }
    m
}

struct Batch {
    vocab: usize,
    logits: Vec<f32>,
    rows: Vec<SampleRow>,
}

fn random_batch(rng: &mut SplitMix, vocab: usize, n: usize) -> Batch {
    let mut logits = Vec::with_capacity(n * vocab);
    let mut rows = Vec::with_capacity(n);
    for r in 0..n {
        // Peaked, flat, tied (few distinct values) and partly masked rows.
        let kind = r % 4;
        let scale = [8.0f32, 0.5, 3.0, 4.0][kind];
        for _ in 0..vocab {
            let mut v = rng.uniform() * scale + rng.uniform() * rng.uniform() * scale;
            if kind == 2 {
                v = (v * 2.0).round() / 2.0;
            }
            if kind == 3 && rng.next_u64() % 10 < 3 {
                v = f32::NEG_INFINITY;
            }
            logits.push(v);
        }
        let pick = |rng: &mut SplitMix, opts: &[f32]| opts[(rng.next_u64() % opts.len() as u64) as usize];
        let temperature = pick(rng, &[0.0, 0.3, 0.7, 1.0, 1.0, 1.5]);
        let top_k = pick(rng, &[0.0, 0.0, 1.0, 5.0, 50.0, 1e9]) as usize;
        let top_p = pick(rng, &[1.0, 1.0, 0.5, 0.9, 0.99]);
        let min_p = pick(rng, &[0.0, 0.0, 0.05, 0.3]);
        let top_logprobs = (rng.next_u64() % 6) as usize;
        let truncation = Truncation { temperature, top_k, top_p, min_p, seed: rng.next_u64(), top_logprobs };
        rows.push(SampleRow { truncation, position: rng.next_u64() % 100_000 });
    }
    Batch { vocab, logits, rows }
}

fn run(s: &Stream, b: &Batch) -> Vec<Choice> {
    let logits = s.upload(&b.logits).unwrap();
    let mut ws = SamplerWorkspace::new(s, b.rows.len(), b.vocab, 5).unwrap();
    sample(s, &logits, &b.rows, &mut ws).unwrap();
    ws.choices(s, b.rows.len()).unwrap()
}

#[test]
fn gpu_sampling_matches_cpu() {
    let Some(dev) = cuda_device_or_skip("gpu_sampling_matches_cpu") else { return };
    let s = dev.default_stream();
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = SplitMix(seed);
    let (mut rows_checked, mut near) = (0, 0);
    for vocab in [7usize, 1000, 32_000, 129_280] {
        let n = if vocab > 100_000 { 24 } else { 48 };
        let b = random_batch(&mut rng, vocab, n);
        let got = run(&s, &b);
        for (r, (g, row)) in got.iter().zip(&b.rows).enumerate() {
            let l: Vec<f64> = b.logits[r * vocab..(r + 1) * vocab].iter().map(|v| *v as f64).collect();
            let want = choose(&l, &row.truncation, row.position);
            let what = format!("vocab {vocab} row {r} {:?}", row.truncation);
            assert_eq!(
                g.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                want.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                "{what}: alternatives"
            );
            for ((_, a), (_, w)) in g.top.iter().zip(&want.top) {
                assert!((a - w).abs() <= LOGPROB_TOL, "{what}: alternative logprob {a} vs {w}");
            }
            rows_checked += 1;
            if g.token != want.token {
                let m = margin(&l, &row.truncation, row.position);
                let allowed = vocab as f64 * 2f64.powi(-40) + 1e-12;
                assert!(
                    m <= allowed,
                    "{what}: token {} vs CPU {} with margin {m:e} (allowed {allowed:e})",
                    g.token,
                    want.token
                );
                near += 1;
                continue;
            }
            assert!(
                (g.logprob - want.logprob).abs() <= LOGPROB_TOL,
                "{what}: logprob {} vs {}",
                g.logprob,
                want.logprob
            );
        }
        // Reruns and a reshuffled batch give the same bits.
        assert_eq!(run(&s, &b), got, "vocab {vocab}: rerun");
        let order: Vec<usize> = (0..n).rev().collect();
        let shuffled = Batch {
            vocab,
            logits: order.iter().flat_map(|r| b.logits[r * vocab..(r + 1) * vocab].to_vec()).collect(),
            rows: order.iter().map(|r| b.rows[*r]).collect(),
        };
        let again = run(&s, &shuffled);
        for (i, r) in order.iter().enumerate() {
            assert_eq!(again[i], got[*r], "vocab {vocab}: row {r} moved to {i}");
        }
    }
    println!("{rows_checked} rows checked, {near} within the quantisation margin of a boundary");
    assert!(near * 20 <= rows_checked, "{near} of {rows_checked} rows near a boundary is not rare");
}

#[test]
fn gpu_sampling_flags_fully_masked_rows() {
    let Some(dev) = cuda_device_or_skip("gpu_sampling_flags_fully_masked_rows") else { return };
    let s = dev.default_stream();
    let logits = s.upload(&[0.5f32, 1.0, 2.0, f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY]).unwrap();
    let mut ws = SamplerWorkspace::new(&s, 2, 3, 2).unwrap();
    let t = Truncation { temperature: 1.0, top_k: 0, top_p: 0.9, min_p: 0.0, seed: 1, top_logprobs: 2 };
    sample(&s, &logits, &[SampleRow { truncation: t, position: 0 }; 2], &mut ws).unwrap();
    let e = ws.choices(&s, 2).unwrap_err();
    assert!(e.to_string().contains("row 1 has no usable logit"), "{e}");
    let first = &ws.choices(&s, 1).unwrap()[0];
    assert_eq!(first.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
}
