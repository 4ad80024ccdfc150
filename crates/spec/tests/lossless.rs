//! Sampled speculation is lossless: the tokens it emits have the target's distribution, whatever
//! the drafter proposes.
//!
//! The target and the drafter are two different Markov chains over a 6-token vocabulary (each
//! token's distribution depends on the token before it, so a rejected draft changes what the
//! target sees next). Each of 120,000 seeded runs starts after token 0, speculates with k = 0..3
//! drafts a step (k = seed mod 4) until it has emitted two tokens, and records the pair. Under the
//! target, pair (a, b) has probability P(a | 0)·P(b | a). Pearson's chi-square over the 36 cells
//! has 35 degrees of freedom; the test fails above 80, which a correct sampler exceeds with
//! probability about 2e-5 (and, the runs being seeded, never flakes: the figure is the same on
//! every run). The same statistic on the drafts alone (what a verifier that accepted everything
//! would emit) is in the thousands, so the test would see a wrong rule.

use deepinfer_spec::rng::{draw, uniform};
use deepinfer_spec::verify::verify_sampled;

const V: usize = 6;
const RUNS: u64 = 120_000;

/// A fixed random row-stochastic matrix (with some zeros: the chains disagree on support too).
fn chain(salt: u64) -> Vec<Vec<f32>> {
    (0..V as u64)
        .map(|r| {
            let row: Vec<f32> = (0..V as u64)
                .map(|c| {
                    let u = uniform(salt, r * 97 + c, 11);
                    if u < 0.15 {
                        0.0
                    } else {
                        u as f32
                    }
                })
                .collect();
            let s: f32 = row.iter().sum();
            row.iter().map(|x| x / s).collect()
        })
        .collect()
}

/// The first two tokens after token 0 of one seeded run; `rule` = false emits the drafts as if
/// every one were accepted (the wrong rule the test must detect).
fn first_pair(p: &[Vec<f32>], q: &[Vec<f32>], seed: u64, rule: bool) -> (usize, usize) {
    let k = (seed % 4) as usize;
    let mut out: Vec<u32> = Vec::new();
    let mut prev = 0u32;
    let mut pos = 0u64;
    while out.len() < 2 {
        let mut drafts = Vec::new();
        let mut ctx = prev;
        for i in 0..k {
            let w: Vec<f64> = q[ctx as usize].iter().map(|&x| x as f64).collect();
            ctx = draw(&w, uniform(seed ^ 0xD8AF, pos + i as u64, 9)).unwrap() as u32;
            drafts.push(ctx);
        }
        let mut prevs = vec![prev];
        prevs.extend(&drafts);
        let prow: Vec<&[f32]> = prevs.iter().map(|&t| p[t as usize].as_slice()).collect();
        let qrow: Vec<&[f32]> = prevs[..k].iter().map(|&t| q[t as usize].as_slice()).collect();
        let emitted = if rule || k == 0 {
            verify_sampled(&drafts, &qrow, &prow, seed, pos).unwrap().tokens(&drafts)
        } else {
            drafts.clone()
        };
        pos += emitted.len() as u64;
        prev = *emitted.last().unwrap();
        out.extend(emitted);
    }
    (out[0] as usize, out[1] as usize)
}

/// Pearson's chi-square over the possible pairs, the total variation distance, and how many runs
/// emitted a pair the target cannot produce.
fn chi_square(p: &[Vec<f32>], q: &[Vec<f32>], rule: bool) -> (f64, f64, u64) {
    let mut counts = vec![0u64; V * V];
    for seed in 0..RUNS {
        let (a, b) = first_pair(p, q, seed, rule);
        counts[a * V + b] += 1;
    }
    let (mut chi, mut tv, mut impossible) = (0.0, 0.0, 0);
    for a in 0..V {
        for b in 0..V {
            let pr = p[0][a] as f64 * p[a][b] as f64;
            let seen = counts[a * V + b] as f64;
            let want = pr * RUNS as f64;
            tv += (seen / RUNS as f64 - pr).abs() / 2.0;
            if want > 0.0 {
                chi += (seen - want).powi(2) / want;
            } else {
                impossible += counts[a * V + b];
            }
        }
    }
    (chi, tv, impossible)
}

#[test]
fn speculation_emits_the_targets_distribution() {
    let (p, q) = (chain(1), chain(2));
    // Every cell of 36 has either probability 0 or an expected count well above 5.
    let (chi, tv, impossible) = chi_square(&p, &q, true);
    println!("lossless: chi-square {chi:.1} (35 df), total variation {tv:.4}, {RUNS} runs");
    assert_eq!(impossible, 0, "pairs the target cannot produce were emitted");
    assert!(chi < 80.0, "chi-square {chi} over 35 degrees of freedom: not the target's distribution");
    let (chi_wrong, tv_wrong, impossible_wrong) = chi_square(&p, &q, false);
    println!("accepting every draft: chi-square {chi_wrong:.1}, total variation {tv_wrong:.4}, {impossible_wrong} impossible");
    assert!(chi_wrong > 1000.0 && impossible_wrong > 0, "the test cannot tell accepting every draft apart");
}
