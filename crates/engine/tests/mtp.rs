//! The MTP drafter on the reference model: its first draft is the MTP head's prediction over the
//! whole sequence at once (the cache it keeps equals a full run), autoregressive drafts leave the
//! cache untouched, and greedy speculation's step count is consistent.

use std::path::PathBuf;

use deepinfer_engine::model::{Model, Numerics};
use deepinfer_engine::mtp::{greedy_acceptance, greedy_with_streams, MtpDrafter};
use deepinfer_spec::Drafter;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_v4").join(name)
}

fn argmax(row: &[f32]) -> u32 {
    deepinfer_engine::sampler::argmax(row) as u32
}

#[test]
fn first_drafts_equal_the_mtp_head_over_the_whole_sequence() {
    let m = Model::load(&fixture("real")).unwrap();
    let n = Numerics::Reference;
    let prompt: Vec<u32> = (0..20u32).map(|i| (i * 37 + 5) % 200 + 3).collect();
    let (tokens, streams) = greedy_with_streams(&m, &prompt, 12, n).unwrap();
    assert_eq!(tokens.len(), 32);
    let w = m.config().hc_mult * m.config().hidden_size;
    assert_eq!(streams.len(), 31 * w);
    // The MTP head over every row at once: row t predicts token t + 2.
    let mut st = m.new_mtp_state();
    let all = m.mtp_forward(&streams, &tokens[1..], &mut st, n).unwrap();
    let v = m.config().vocab_size;
    let mut d = MtpDrafter::new(&m, n).unwrap();
    d.observe(7, &streams).unwrap();
    for len in 21..32 {
        let draft = d.draft(7, &tokens[..len], 3).unwrap();
        assert_eq!(draft.tokens.len(), 3);
        let row = len - 2;
        assert_eq!(draft.tokens[0], argmax(&all[row * v..(row + 1) * v]), "len {len}");
        let c = draft.confidence();
        assert!(c.iter().all(|p| (0.0..=1.0).contains(p) && *p > 0.0), "{c:?}");
    }
    // A sequence it never observed, or cut back before what it took, drafts nothing.
    assert!(d.draft(8, &tokens[..25], 2).unwrap().tokens.is_empty());
    d.rollback(7, 10);
    assert!(d.draft(7, &tokens[..11], 2).unwrap().tokens.is_empty());
}

#[test]
fn greedy_speculation_counts_steps_and_drafts_consistently() {
    let m = Model::load(&fixture("real")).unwrap();
    let n = Numerics::Reference;
    let prompt: Vec<u32> = (0..16u32).map(|i| (i * 11 + 2) % 200 + 3).collect();
    let (tokens, streams) = greedy_with_streams(&m, &prompt, 24, n).unwrap();
    let plain = greedy_acceptance(&m, &tokens, &streams, prompt.len(), 0, n).unwrap();
    assert_eq!((plain.steps, plain.tokens, plain.drafted), (24, 24, 0));
    for k in 1..=4 {
        let a = greedy_acceptance(&m, &tokens, &streams, prompt.len(), k, n).unwrap();
        assert_eq!(a.tokens, 24, "k {k}: every continuation token emitted once");
        assert!(a.accepted <= a.drafted && a.drafted <= k * a.steps, "{a:?}");
        assert_eq!(a.steps + a.accepted, a.tokens, "each step emits its accepted drafts plus one: {a:?}");
    }
}

#[test]
fn sampled_drafts_come_from_their_distributions_and_reproduce() {
    let m = Model::load(&fixture("real")).unwrap();
    let n = Numerics::Reference;
    let prompt: Vec<u32> = (0..18u32).map(|i| (i * 23 + 9) % 200 + 3).collect();
    let (tokens, streams) = greedy_with_streams(&m, &prompt, 6, n).unwrap();
    let run = |temp: f32, seed: u64| {
        let mut d = MtpDrafter::new(&m, n).unwrap().sampling(temp, seed).unwrap();
        d.observe(1, &streams).unwrap();
        d.draft(1, &tokens[..20], 4).unwrap()
    };
    let a = run(1.0, 5);
    assert_eq!(a, run(1.0, 5), "a seed drafts the same tokens");
    assert_eq!(a.tokens.len(), 4);
    for (t, dist) in a.tokens.iter().zip(&a.dists) {
        assert!(dist[*t as usize] > 0.0);
        assert!((dist.iter().map(|&x| x as f64).sum::<f64>() - 1.0).abs() < 1e-4);
    }
    // Usable for sampled verification as they are.
    let q: Vec<&[f32]> = a.dists.iter().map(|d| d.as_slice()).collect();
    let p: Vec<&[f32]> = a.dists.iter().chain(std::iter::once(&a.dists[0])).map(|d| d.as_slice()).collect();
    let v = deepinfer_spec::verify_sampled(&a.tokens, &q, &p, 5, 20).unwrap();
    assert_eq!(v.accepted, 4, "drafts judged against their own distributions all stand");
    // Seeds differ somewhere over a few tries; a near-zero temperature is the greedy draft.
    assert!((0..8).any(|s| run(1.0, s).tokens != a.tokens));
    let mut greedy = MtpDrafter::new(&m, n).unwrap();
    greedy.observe(1, &streams).unwrap();
    assert_eq!(run(1e-4, 3).tokens, greedy.draft(1, &tokens[..20], 4).unwrap().tokens);
    assert!(MtpDrafter::new(&m, n).unwrap().sampling(0.0, 1).is_err());
}
