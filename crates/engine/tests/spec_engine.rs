//! Speculative decoding in the engine loop (MTP drafts, issue #39) is lossless: with drafts the
//! engine emits exactly the tokens it emits without them, greedy and seeded sampling alike, at
//! batch 1, 8 and 64 over 200 prompts, on prefix-cache hits with bounded replay, with stop
//! tokens and max_tokens cutting accepted runs; and the drafts are really used (accepted drafts
//! counted), so the comparison cannot pass by never speculating.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use deepinfer_engine::sampler::SamplingParams;
use deepinfer_engine::{Engine, EngineConfig, GenerateRequest, Model, ReplayMode};
use deepinfer_recipe::{Constraint, DeepseekTokenizer};

/// The trained built-in model (its MTP head agrees with the main head often enough to accept drafts).
fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/deepinfer-tiny-v4")
}

fn model() -> &'static Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| {
        Arc::new(
            Model::load(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/deepinfer-tiny-v4")).unwrap(),
        )
    })
}

fn engine(speculative_tokens: usize, max_running: usize, replay: ReplayMode) -> Engine {
    let cfg = EngineConfig { speculative_tokens, max_running, token_budget: 1024, replay, ..Default::default() };
    Engine::with_model(model().clone(), cfg).unwrap()
}

/// `n` prompts in groups of 4 sharing a prefix of `prefix_blocks` cache blocks (prefix-cache hits when
/// that is more than the replay a hit needs), each with
/// its own tail; a few stop tokens so accepted runs get cut.
fn requests(sampling: &SamplingParams, n: usize, prefix_blocks: usize) -> Vec<GenerateRequest> {
    let v = model().config().vocab_size as u64;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % (v - 8) + 4) as u32
    };
    let mut out = Vec::new();
    let block = model().block_tokens_at_least(64);
    for g in 0..n.div_ceil(4) {
        let prefix: Vec<u32> = (0..block * prefix_blocks).map(|_| next()).collect();
        for j in 0..4 {
            let mut prompt = prefix.clone();
            prompt.extend((0..2 + j * 3).map(|_| next()));
            let id = (g * 4 + j) as u64;
            let mut r = GenerateRequest::new(id, prompt, 12 + (id as usize % 9), sampling.clone());
            r.stop_token_ids = vec![next(), next()];
            out.push(r);
        }
    }
    out.truncate(n);
    out
}

fn tokens(e: &Engine, reqs: Vec<GenerateRequest>) -> (Vec<Vec<u32>>, deepinfer_engine::EngineStats) {
    let (outs, stats) = e.generate(reqs);
    for o in &outs {
        assert!(o.error.is_none(), "request {}: {:?}", o.id, o.error);
    }
    (outs.into_iter().map(|o| o.tokens).collect(), stats)
}

fn greedy() -> SamplingParams {
    SamplingParams { temperature: 0.0, ..Default::default() }
}

#[test]
fn greedy_output_with_drafts_equals_output_without_at_batch_1_8_and_64() {
    let (want, plain) = tokens(&engine(0, 64, ReplayMode::Exact), requests(&greedy(), 200, 1));
    assert_eq!(plain.accepted_drafts, 0);
    for max_running in [1, 8, 64] {
        let (got, st) = tokens(&engine(3, max_running, ReplayMode::Exact), requests(&greedy(), 200, 1));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "batch {max_running}, request {i}");
        }
        assert!(st.accepted_drafts * 5 > st.drafted_tokens, "batch {max_running}: {st:?}");
        assert!(st.accepted_drafts < st.drafted_tokens, "some drafts rejected, so rollback ran: {st:?}");
        // One request at a time: fewer target steps than tokens, the drafts saved forwards.
        if max_running == 1 {
            assert!(st.steps < st.generated_tokens as u64, "{} steps for {} tokens", st.steps, st.generated_tokens);
        }
    }
}

#[test]
fn seeded_sampling_with_drafts_equals_sampling_without() {
    let s = SamplingParams { temperature: 0.7, top_p: 0.9, seed: Some(11), ..Default::default() };
    let (want, _) = tokens(&engine(0, 16, ReplayMode::Exact), requests(&s, 64, 1));
    let (got, st) = tokens(&engine(4, 16, ReplayMode::Exact), requests(&s, 64, 1));
    assert_eq!(got, want);
    assert!(st.accepted_drafts > 0, "{st:?}");
}

#[test]
fn prefix_hits_bounded_replay_and_penalties_keep_speculation_lossless() {
    let s = SamplingParams { temperature: 0.0, repetition_penalty: 1.3, presence_penalty: 0.4, ..Default::default() };
    let keep = model().config().sliding_window;
    // Each group's first member runs first and publishes the prefix; the rest hit it.
    let waves = || {
        let (first, rest): (Vec<_>, Vec<_>) = requests(&s, 24, 5).into_iter().partition(|r| r.id % 4 == 0);
        [first, rest]
    };
    let run = |k: usize| {
        let e = engine(k, 8, ReplayMode::Bounded { keep });
        let [a, b] = waves();
        let (mut out, _) = tokens(&e, a);
        let (more, st) = tokens(&e, b);
        out.extend(more);
        (out, st)
    };
    let (want, _) = run(0);
    let (got, st) = run(2);
    assert_eq!(got, want);
    assert!(st.accepted_drafts > 0 && st.prefix_hits > 0, "{st:?}");
}

#[test]
fn structured_output_through_speculation_equals_without() {
    // Grammar masks apply to every verified row (the matcher advanced over the drafts before it).
    let tok = DeepseekTokenizer::from_file(&model_dir().join("tokenizer.json")).unwrap();
    let prompt = tok.encode_batch(&["The answer, as JSON:".to_string()]).unwrap().remove(0);
    let schema = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":24},
        "count":{"type":"integer","minimum":0,"maximum":999},"ok":{"type":"boolean"}},
        "required":["name","count","ok"],"additionalProperties":false}"#;
    let reqs = || -> Vec<GenerateRequest> {
        (0..12u64)
            .map(|i| {
                let (temperature, seed) = if i % 2 == 0 { (0.0, None) } else { (0.8, Some(i)) };
                let sampling = SamplingParams { temperature, seed, ..Default::default() };
                let mut r = GenerateRequest::new(i, prompt.clone(), 80, sampling);
                r.constraint = Some(Constraint {
                    kind: if i % 3 == 0 { "regex".into() } else { "json_schema".into() },
                    schema: if i % 3 == 0 {
                        "(the|a) [a-z]{2,12} (is|was) [0-9]{1,3}\\.".into()
                    } else {
                        schema.into()
                    },
                });
                r
            })
            .collect()
    };
    let run = |k: usize| {
        let e = engine(k, 8, ReplayMode::Exact).with_tokenizer(tok.clone()).unwrap();
        let (outs, st) = e.generate(reqs());
        for o in &outs {
            assert!(o.error.is_none(), "request {}: {:?}", o.id, o.error);
        }
        (outs.into_iter().map(|o| (o.tokens, o.text)).collect::<Vec<_>>(), st)
    };
    let (want, _) = run(0);
    let (got, st) = run(3);
    assert_eq!(got, want);
    assert!(st.accepted_drafts > 0, "{st:?}");
}
