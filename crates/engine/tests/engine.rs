//! The engine loop end to end on the tiny fixtures: greedy output equals the reference model's
//! argmax (mixed batches, chunked prefill), seeded sampling is deterministic at any batch size,
//! preemption changes nothing in the output, and a bad request fails alone.

use std::path::PathBuf;

use deepinfer_engine::checkpoint::Checkpoint;
use deepinfer_engine::sampler::SamplingParams;
use deepinfer_engine::{Engine, EngineConfig, FinishReason, GenerateRequest, Model, Numerics};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_v4").join(name)
}

fn greedy() -> SamplingParams {
    SamplingParams { temperature: 0.0, ..Default::default() }
}

fn req(id: u64, prompt: &[u32], max_tokens: usize, sampling: SamplingParams) -> GenerateRequest {
    GenerateRequest::new(id, prompt.to_vec(), max_tokens, sampling)
}

fn reference(name: &str) -> (Vec<u32>, Vec<f32>, usize) {
    let dir = fixture(name);
    let refs = Checkpoint::open_files(&dir, &[deepinfer_engine::checkpoint::file_or_gz(&dir, "reference.safetensors")])
        .unwrap();
    let s = refs.shape("input_ids").unwrap()[1];
    let ids: Vec<u32> = refs.i64("input_ids", &[1, s]).unwrap().into_iter().map(|v| v as u32).collect();
    let v = refs.shape("logits").unwrap()[1];
    (ids, refs.f32("logits", &[s, v], [128, 128]).unwrap(), v)
}

fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |(bi, bv), (i, v)| if *v > bv { (i, *v) } else { (bi, bv) }).0
        as u32
}

#[test]
fn greedy_first_tokens_equal_the_reference_argmax_in_a_mixed_chunked_batch() {
    for name in ["small", "real"] {
        let (ids, logits, v) = reference(name);
        let engine =
            Engine::new(Model::load(&fixture(name)).unwrap(), EngineConfig { token_budget: 24, ..Default::default() })
                .unwrap();
        let lens: Vec<usize> =
            [5, 17, 31, 37, ids.len() / 2, ids.len()].into_iter().filter(|k| *k <= ids.len()).collect();
        let reqs: Vec<GenerateRequest> =
            lens.iter().enumerate().map(|(i, k)| req(i as u64, &ids[..*k], 1, greedy())).collect();
        let (outs, stats) = engine.generate(reqs);
        assert!(stats.steps > 3, "a 24-token budget splits the prompts into chunks");
        for (o, k) in outs.iter().zip(&lens) {
            assert_eq!(o.tokens, vec![argmax(&logits[(k - 1) * v..k * v])], "{name}: prompt of {k} tokens");
        }
    }
}

#[test]
fn greedy_continuation_matches_teacher_forcing() {
    let (ids, _, _) = reference("small");
    let model = Model::load(&fixture("small")).unwrap();
    let engine = Engine::new(Model::load(&fixture("small")).unwrap(), EngineConfig::default()).unwrap();
    let (outs, _) = engine.generate(vec![req(0, &ids[..20], 12, greedy())]);
    let gen = &outs[0].tokens;
    assert_eq!(gen.len(), 12);
    let mut all = ids[..20].to_vec();
    all.extend_from_slice(gen);
    let mut st = model.new_state();
    let (o, _) = model.forward(&mut [(&all[..], &mut st)], Numerics::Reference, false).unwrap();
    let v = model.config().vocab_size;
    for (i, t) in gen.iter().enumerate() {
        let row = 19 + i;
        assert_eq!(argmax(&o[0].logits[row * v..(row + 1) * v]), *t, "token {i}");
    }
}

fn seeded(n: u64) -> Vec<GenerateRequest> {
    (0..n)
        .map(|i| {
            let prompt: Vec<u32> = (0..(5 + i * 3) as u32).map(|j| (j * 31 + i as u32 * 7) % 250 + 2).collect();
            req(
                i,
                &prompt,
                8,
                SamplingParams { temperature: 0.9, top_p: 0.95, top_k: 50, seed: Some(1000 + i), ..Default::default() },
            )
        })
        .collect()
}

#[test]
fn seeded_outputs_do_not_depend_on_batch_size_or_run() {
    let run = |max_running: usize| {
        let engine = Engine::new(
            Model::load(&fixture("small")).unwrap(),
            EngineConfig { max_running, token_budget: 64, ..Default::default() },
        )
        .unwrap();
        engine.generate(seeded(20)).0.into_iter().map(|o| o.tokens).collect::<Vec<_>>()
    };
    let one = run(1);
    assert_eq!(run(7), one);
    assert_eq!(run(20), one);
    assert_eq!(run(20), one, "and across runs");
    assert!(one.iter().all(|t| t.len() == 8));
}

#[test]
fn preemption_under_memory_pressure_changes_no_output() {
    let roomy = Engine::new(Model::load(&fixture("small")).unwrap(), EngineConfig::default()).unwrap();
    let tight = Engine::new(
        Model::load(&fixture("small")).unwrap(),
        EngineConfig { kv_blocks: 2, block_tokens: 16, ..Default::default() },
    )
    .unwrap();
    let (a, _) = roomy.generate(seeded(6));
    let (b, stats) = tight.generate(seeded(6));
    assert!(stats.preemptions > 0, "2 blocks of 16 tokens cannot hold 6 sequences");
    assert_eq!(a.iter().map(|o| &o.tokens).collect::<Vec<_>>(), b.iter().map(|o| &o.tokens).collect::<Vec<_>>());
}

#[test]
fn a_bad_request_fails_alone() {
    let engine =
        Engine::new(Model::load(&fixture("small")).unwrap(), EngineConfig { max_context: 100, ..Default::default() })
            .unwrap();
    let reqs = vec![
        req(0, &[5, 6, 7], 4, greedy()),
        req(1, &[5, 6, 7], 4, SamplingParams { top_p: 0.0, ..Default::default() }),
        req(2, &[5, 999], 4, greedy()),
        req(3, &[1; 90], 20, greedy()),
        req(4, &[], 4, greedy()),
        req(5, &[8, 9], 3, greedy()),
    ];
    let (outs, _) = engine.generate(reqs);
    let fin: Vec<FinishReason> = outs.iter().map(|o| o.finish).collect();
    assert_eq!(
        fin,
        [
            FinishReason::Length,
            FinishReason::Error,
            FinishReason::Error,
            FinishReason::Error,
            FinishReason::Error,
            FinishReason::Length
        ]
    );
    assert!(outs[1].error.as_deref().unwrap().contains("top_p"));
    assert!(outs[2].error.as_deref().unwrap().contains("999"));
    assert!(outs[3].error.as_deref().unwrap().contains("context"));
    assert_eq!(outs[5].tokens.len(), 3);
}
