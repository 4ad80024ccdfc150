//! The loader on real files (sharded checkpoints, corrupt and mismatched files) and the forward's
//! invariants on random configurations: incremental decoding equals the full-sequence forward,
//! and a mixed varlen batch equals its sequences run alone.

mod support;

use std::path::Path;

use deepinfer_engine::{Model, Numerics};
use proptest::prelude::*;
use support::{random_config, random_model_dir, temp_dir, Rng};

fn logits(model: &Model, ids: &[u32]) -> Vec<f32> {
    let mut st = model.new_state();
    model.forward(&mut [(ids, &mut st)], Numerics::Reference, false).unwrap().0.remove(0).logits
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn ids(rng: &mut Rng, n: usize, vocab: u64) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab) as u32).collect()
}

#[test]
fn sharded_checkpoint_loads_like_a_single_file() {
    let mut rng = Rng(11);
    let c = random_config(&mut rng);
    let single = random_model_dir("single", &c, 5, 1);
    let sharded = random_model_dir("sharded", &c, 5, 3);
    assert!(sharded.join("model.safetensors.index.json").is_file());
    assert!(!sharded.join("model.safetensors").exists());
    let (a, b) = (Model::load(&single).unwrap(), Model::load(&sharded).unwrap());
    let t = ids(&mut rng, 17, c["vocab_size"].as_u64().unwrap());
    assert_eq!(logits(&a, &t), logits(&b, &t));

    // The same file gzipped (as the repository ships its models) loads to the same model.
    let gz = random_model_dir("gz", &c, 5, 1);
    let f = gz.join("model.safetensors");
    let raw = std::fs::read(&f).unwrap();
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut enc, &raw).unwrap();
    let packed = enc.finish().unwrap();
    std::fs::remove_file(&f).unwrap();
    std::fs::write(gz.join("model.safetensors.gz"), &packed).unwrap();
    assert_eq!(logits(&Model::load(&gz).unwrap(), &t), logits(&a, &t));
    // A truncated gzip is an error naming the file.
    std::fs::write(gz.join("model.safetensors.gz"), &packed[..packed.len() / 2]).unwrap();
    let e = load_err(&gz);
    assert!(e.contains("model.safetensors.gz") && e.contains("does not inflate"), "{e}");
}

fn load_err(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn corrupt_and_mismatched_checkpoints_are_named_errors() {
    let c = random_config(&mut Rng(3));
    // Truncated file.
    let d = random_model_dir("trunc", &c, 1, 1);
    let f = d.join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len - 100).unwrap();
    let e = load_err(&d);
    assert!(e.contains("model.safetensors") && e.contains("truncated or corrupt"), "{e}");

    // Garbage header.
    let d = random_model_dir("garbage", &c, 1, 1);
    std::fs::write(d.join("model.safetensors"), b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!").unwrap();
    assert!(load_err(&d).contains("model.safetensors"));

    // A shard listed in the index is missing.
    let d = random_model_dir("missing-shard", &c, 1, 2);
    std::fs::remove_file(d.join("model-00002-of-00002.safetensors")).unwrap();
    assert!(load_err(&d).contains("model-00002-of-00002.safetensors"));

    // Wrong shape and wrong dtype name the tensor.
    let mut bad = c.clone();
    bad["hidden_size"] = serde_json::json!(c["hidden_size"].as_u64().unwrap() * 2);
    let d = random_model_dir("shape", &c, 1, 1);
    std::fs::write(d.join("config.json"), bad.to_string()).unwrap();
    let e = load_err(&d);
    assert!(e.contains("embed.weight") && e.contains("shape"), "{e}");

    let d = temp_dir("dtype");
    std::fs::write(d.join("config.json"), c.to_string()).unwrap();
    let mut tensors = support::random_tensors(&c, &mut Rng(1));
    let i = tensors.iter().position(|t| t.0 == "norm.weight").unwrap();
    let n = tensors[i].2[0];
    tensors[i].1 = safetensors::tensor::Dtype::I32;
    tensors[i].3 = vec![0u8; n * 4];
    support::write_checkpoint(&d, &tensors, 1).unwrap();
    let e = load_err(&d);
    assert!(e.contains("norm.weight") && e.contains("I32"), "{e}");

    // A missing tensor.
    let d = temp_dir("absent");
    std::fs::write(d.join("config.json"), c.to_string()).unwrap();
    let tensors: Vec<_> =
        support::random_tensors(&c, &mut Rng(1)).into_iter().filter(|t| t.0 != "layers.0.attn.wkv.weight").collect();
    support::write_checkpoint(&d, &tensors, 1).unwrap();
    assert!(load_err(&d).contains("layers.0.attn.wkv.weight"));

    // No checkpoint at all, and a config that is not V4.
    let d = temp_dir("empty");
    std::fs::write(d.join("config.json"), c.to_string()).unwrap();
    assert!(load_err(&d).contains("model.safetensors"));
    let mut llama = c.clone();
    llama["model_type"] = serde_json::json!("llama");
    std::fs::write(d.join("config.json"), llama.to_string()).unwrap();
    assert!(load_err(&d).contains("model_type"));
}

#[test]
fn a_restore_from_blocks_of_the_wrong_size_is_a_named_error() {
    let c = random_config(&mut Rng(11));
    let m = Model::load(&random_model_dir("restore-bad", &c, 3, 1)).unwrap();
    let bt = m.block_tokens_at_least(1);
    let e = m.restore_state(&[&[0u8; 7][..]], bt, 0).unwrap_err().to_string();
    assert!(e.contains("cached blocks") && e.contains("7 bytes"), "{e}");
}

#[test]
fn out_of_vocabulary_token_is_rejected() {
    let c = random_config(&mut Rng(9));
    let m = Model::load(&random_model_dir("oov", &c, 2, 1)).unwrap();
    let mut st = m.new_state();
    let v = c["vocab_size"].as_u64().unwrap() as u32;
    let e = m.forward(&mut [(&[1, v][..], &mut st)], Numerics::Reference, false).unwrap_err().to_string();
    assert!(e.contains("tokens") && e.contains(&v.to_string()), "{e}");
    assert_eq!(st.len, 0, "a rejected batch leaves the state untouched");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Random configurations, weights and tokens: feeding the sequence in random chunks (prefill
    /// chunks and single decode steps, with a cache) gives the full forward's logits.
    #[test]
    fn incremental_decoding_equals_full_forward(seed in 0u64..10_000, chunk_seed in 0u64..1000) {
        let mut rng = Rng(seed);
        let c = random_config(&mut rng);
        let model = Model::load(&random_model_dir("incr", &c, seed, 1 + (seed % 2) as usize)).unwrap();
        let n = 12 + rng.below(30) as usize;
        let t = ids(&mut rng, n, c["vocab_size"].as_u64().unwrap());
        let full = logits(&model, &t);
        let mut st = model.new_state();
        let mut got = Vec::new();
        let mut cr = Rng(chunk_seed);
        let mut i = 0;
        while i < n {
            let len = if cr.below(3) == 0 { 1 } else { 1 + cr.below(9) as usize }.min(n - i);
            let (o, _) = model.forward(&mut [(&t[i..i + len], &mut st)], Numerics::Reference, false).unwrap();
            got.extend_from_slice(&o[0].logits);
            i += len;
        }
        prop_assert_eq!(st.len, n);
        // Same per-token arithmetic either way (row-wise dot products, the same keys in the same
        // order), so only the compressor's chunk boundaries could differ: they must not.
        let d = max_diff(&full, &got);
        prop_assert!(d <= 1e-5, "max |full - incremental| = {} for {}", d, c);
    }

    /// A state restored from published blocks plus the exact replay continues exactly like the
    /// sequence computed cold: the tokens after the hit get the full forward's logits. (With the
    /// default window-only replay the same check fails by up to 0.09: the replay must cover the
    /// receptive field of the window state.)
    #[test]
    fn restored_blocks_plus_exact_replay_equal_the_full_forward(seed in 0u64..10_000, extra in 1usize..4) {
        let mut rng = Rng(seed);
        let c = random_config(&mut rng);
        let model = Model::load(&random_model_dir("restore", &c, seed, 1)).unwrap();
        let bt = model.block_tokens_at_least(1);
        let exact = model.exact_replay_tokens();
        let blocks = exact / bt + extra;
        let n = blocks * bt + 3 + rng.below(8) as usize;
        let t = ids(&mut rng, n, c["vocab_size"].as_u64().unwrap());
        let full = logits(&model, &t);
        let mut cold = model.new_state();
        model.forward(&mut [(&t[..blocks * bt], &mut cold)], Numerics::Reference, false).unwrap();
        let payloads: Vec<Vec<u8>> = (0..blocks).map(|b| model.block_payload(&cold, b, bt)).collect();
        let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
        let plan = deepinfer_kv::replay::plan(&model.kv_layout(bt).unwrap(), blocks * bt, n, Some(exact));
        prop_assert_eq!(plan.reused_tokens, blocks * bt);
        prop_assert!(plan.replay_tokens() >= exact);
        let mut st = model.restore_state(&refs, bt, plan.replay_from).unwrap();
        prop_assert_eq!(st.compressed_rows(), cold.compressed_rows());
        let (o, _) = model.forward(&mut [(&t[plan.replay_from..], &mut st)], Numerics::Reference, false).unwrap();
        let v = model.config().vocab_size;
        let skip = (plan.reused_tokens - plan.replay_from) * v;
        let d = max_diff(&o[0].logits[skip..], &full[plan.reused_tokens * v..]);
        prop_assert!(d <= 1e-5, "max |cold - restored| = {} for {}", d, c);
    }

    /// A varlen batch (sequences of different lengths and cache states) gives each sequence the
    /// logits it gets alone.
    #[test]
    fn mixed_batch_equals_separate_runs(seed in 0u64..10_000) {
        let mut rng = Rng(seed);
        let c = random_config(&mut rng);
        let v = c["vocab_size"].as_u64().unwrap();
        let model = Model::load(&random_model_dir("batch", &c, seed, 1)).unwrap();
        let seqs: Vec<Vec<u32>> = (0..3).map(|_| { let n = 3 + rng.below(20) as usize; ids(&mut rng, n, v) }).collect();
        let alone: Vec<Vec<f32>> = seqs.iter().map(|s| logits(&model, s)).collect();
        // Sequence 0 arrives with a cached prefix: prefill its first part alone, then batch the rest.
        let split = seqs[0].len() / 2;
        let mut s0 = model.new_state();
        let (first, _) = model.forward(&mut [(&seqs[0][..split], &mut s0)], Numerics::Reference, false).unwrap();
        let (mut s1, mut s2) = (model.new_state(), model.new_state());
        let (outs, _) = model.forward(
            &mut [(&seqs[0][split..], &mut s0), (&seqs[1][..], &mut s1), (&seqs[2][..], &mut s2)],
            Numerics::Reference, false).unwrap();
        let mut l0 = first[0].logits.clone();
        l0.extend_from_slice(&outs[0].logits);
        prop_assert!(max_diff(&l0, &alone[0]) <= 1e-5);
        prop_assert!(max_diff(&outs[1].logits, &alone[1]) <= 1e-5);
        prop_assert!(max_diff(&outs[2].logits, &alone[2]) <= 1e-5);
    }
}
