//! The engine loop's serving features on tiny models: prefix reuse with exact and bounded replay
//! (device pool and durable directory), the streaming API with cancellation, stop strings and
//! streamed text, and the deterministic mode.

mod support;

use std::path::PathBuf;
use std::sync::Arc;

use deepinfer_engine::engine::{Event, KvDirConfig, ReplayMode};
use deepinfer_engine::sampler::SamplingParams;
use deepinfer_engine::{Engine, EngineConfig, FinishReason, GenerateRequest, Model};
use deepinfer_recipe::DeepseekTokenizer;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_v4").join(name)
}

fn greedy() -> SamplingParams {
    SamplingParams { temperature: 0.0, top_logprobs: 0, ..Default::default() }
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|j| (j * 37 + salt * 11 + j * j % 7) % 250 + 3).collect()
}

fn engine(cfg: EngineConfig) -> Engine {
    Engine::new(Model::load(&fixture("small")).unwrap(), cfg).unwrap()
}

/// Turn 1: a 200-token prompt. Turn 2: turn 1's prompt and answer plus 40 new tokens.
fn turns(e: &Engine) -> (Vec<u32>, deepinfer_engine::GenerateOutput, deepinfer_engine::EngineStats) {
    let first = tokens(200, 1);
    let (o1, _) = e.generate(vec![GenerateRequest::new(1, first.clone(), 10, greedy())]);
    let mut second = first;
    second.extend_from_slice(&o1[0].tokens);
    second.extend(tokens(40, 2));
    let (o2, s2) = e.generate(vec![GenerateRequest::new(2, second.clone(), 10, greedy())]);
    (second, o2.into_iter().next().unwrap(), s2)
}

#[test]
fn a_second_turn_computes_only_its_new_tokens_plus_the_replay_and_equals_a_cold_run() {
    let warm = engine(EngineConfig::default());
    let (prompt, hot, stats) = turns(&warm);
    let cold = engine(EngineConfig { prefix_cache_blocks: 0, ..Default::default() });
    let (c, cstats) = cold.generate(vec![GenerateRequest::new(2, prompt.clone(), 10, greedy())]);
    assert_eq!(hot.tokens, c[0].tokens, "cached and cold greedy outputs");
    assert_eq!(hot.logprobs, c[0].logprobs, "exact replay rebuilds the state bit for bit");
    // Block 64 (a multiple of the ratios 4 and 16): 210 cached tokens give 3 blocks (192).
    assert_eq!(hot.cached_tokens, 192);
    let model = Model::load(&fixture("small")).unwrap();
    let exact = model.exact_replay_tokens();
    assert_eq!(exact, 5 * 7 + 16, "5 layers x (window 8 - 1) + the HCA window");
    assert_eq!(hot.replayed_tokens, exact.div_ceil(16) * 16, "aligned to the compressor windows");
    let new_tokens = prompt.len() - hot.cached_tokens;
    assert_eq!(stats.computed_tokens, new_tokens + hot.replayed_tokens + 9, "prompt work + 9 decodes");
    assert_eq!(cstats.computed_tokens, prompt.len() + 9);
    assert_eq!(stats.prefix_hits, 1);
}

#[test]
fn bounded_replay_recomputes_only_keep_tokens() {
    let e = engine(EngineConfig { replay: ReplayMode::Bounded { keep: 16 }, ..Default::default() });
    let (prompt, hot, stats) = turns(&e);
    assert_eq!(hot.replayed_tokens, 16);
    assert_eq!(stats.computed_tokens, prompt.len() - 192 + 16 + 9);
    assert_eq!(hot.tokens.len(), 10);
}

#[test]
fn blocks_written_to_a_directory_serve_a_new_engine() {
    let dir = support::temp_dir("kvdir");
    let kv_dir = KvDirConfig { dir: dir.clone(), capacity_bytes: 1 << 30, host_bytes: 1 << 26 };
    let a = engine(EngineConfig { kv_dir: Some(kv_dir.clone()), ..Default::default() });
    let first = tokens(200, 1);
    let (o1, _) = a.generate(vec![GenerateRequest::new(1, first.clone(), 10, greedy())]);
    a.flush().unwrap();
    drop(a);
    let mut second = first;
    second.extend_from_slice(&o1[0].tokens);
    second.extend(tokens(40, 2));
    // A fresh engine (empty device pool) on the same directory: the hit comes from disk.
    let b = engine(EngineConfig { kv_dir: Some(kv_dir), ..Default::default() });
    let (hot, stats) = b.generate(vec![GenerateRequest::new(2, second.clone(), 10, greedy())]);
    assert_eq!(stats.kv.store_hit_blocks, 3);
    assert_eq!(hot[0].cached_tokens, 192);
    let cold = engine(EngineConfig { prefix_cache_blocks: 0, ..Default::default() });
    let (c, _) = cold.generate(vec![GenerateRequest::new(2, second, 10, greedy())]);
    assert_eq!(hot[0].tokens, c[0].tokens);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn another_salt_or_model_never_hits() {
    let e = engine(EngineConfig::default());
    let p = tokens(300, 3);
    let mut r = GenerateRequest::new(1, p.clone(), 2, greedy());
    r.cache_salt = Some("tenant-a".into());
    e.generate(vec![r]);
    let mut r = GenerateRequest::new(2, p.clone(), 2, greedy());
    r.cache_salt = Some("tenant-b".into());
    let (o, _) = e.generate(vec![r]);
    assert_eq!(o[0].cached_tokens, 0, "another tenant");
    let (o, _) = e.generate(vec![GenerateRequest::new(3, p, 2, greedy())]);
    assert_eq!(o[0].cached_tokens, 0, "no salt is its own namespace");
    let other = Model::load(&fixture("real")).unwrap();
    assert_ne!(other.fingerprint(), e.model().fingerprint());
}

#[test]
fn the_stream_carries_every_token_and_cancel_stops_one_request() {
    let e = Arc::new(engine(EngineConfig::default()));
    let h = e.clone().start();
    let sampling = SamplingParams { temperature: 0.8, seed: Some(5), ..Default::default() };
    let short: Vec<_> =
        (0..3).map(|i| h.submit(GenerateRequest::new(i, tokens(20 + i as usize, 4), 6, sampling.clone()))).collect();
    let long = h.submit(GenerateRequest::new(9, tokens(300, 5), 5000, sampling.clone()));
    // Cancel the long one after its first token.
    match long.recv().unwrap() {
        Event::Admitted { id, prompt_tokens, cached_tokens } => {
            assert_eq!((id, prompt_tokens, cached_tokens), (9, 300, 0))
        }
        e => panic!("the stream starts with Admitted: {e:?}"),
    }
    match long.recv().unwrap() {
        Event::Token { id, .. } => assert_eq!(id, 9),
        e => panic!("finished early: {e:?}"),
    }
    h.cancel(9);
    let rest: Vec<Event> = long.iter().collect();
    match rest.last().unwrap() {
        Event::Done(o) => {
            assert_eq!(o.finish, FinishReason::Cancelled);
            assert!(o.tokens.len() < 5000);
        }
        e => panic!("{e:?}"),
    }
    for rx in short {
        let events: Vec<Event> = rx.iter().collect();
        let streamed: Vec<u32> = events
            .iter()
            .filter_map(|e| match e {
                Event::Token { token, .. } => Some(*token),
                _ => None,
            })
            .collect();
        let Event::Done(o) = events.last().unwrap() else { panic!("no Done") };
        assert_eq!(o.finish, FinishReason::Length);
        assert_eq!(streamed, o.tokens);
    }
    let stats = h.shutdown();
    assert!(stats.overlapped_steps > 0, "steps were planned while the previous one ran");
    // Nothing runs: every block still in use is one the prefix cache keeps, the cancelled
    // request's included (its published prompt blocks), and no running state leaked.
    let u = e.kv_usage();
    assert!(u.cached > 0, "{u:?}");
    assert_eq!(u.used, u.cached, "blocks held by no request and no cache entry: {u:?}");
}

#[test]
fn batch_invariant_mode_makes_unseeded_requests_reproducible() {
    let reqs = |n: u64| -> Vec<GenerateRequest> {
        (0..n)
            .map(|i| {
                GenerateRequest::new(
                    i,
                    tokens(8 + i as usize, 6),
                    6,
                    SamplingParams { temperature: 1.0, ..Default::default() },
                )
            })
            .collect()
    };
    let det = |max_running| {
        let e = engine(EngineConfig { batch_invariant: true, max_running, ..Default::default() });
        e.generate(reqs(7)).0.into_iter().map(|o| o.tokens).collect::<Vec<_>>()
    };
    assert_eq!(det(1), det(7));
    let e = engine(EngineConfig::default());
    let (a, _) = e.generate(reqs(7));
    let (b, _) = e.generate(reqs(7));
    assert!(a.iter().zip(&b).any(|(x, y)| x.seed != y.seed), "outside deterministic mode seeds are random");
}

/// The built-in tiny model (V4 vocabulary) with the vendored tokenizer.
fn text_engine() -> Engine {
    let dir = support::random_model_dir("text", &support::builtin_config(), 77, 1);
    let e = Engine::new(Model::load(&dir).unwrap(), EngineConfig::default())
        .unwrap()
        .with_tokenizer(DeepseekTokenizer::builtin().unwrap())
        .unwrap();
    let _ = std::fs::remove_dir_all(dir);
    e
}

#[test]
fn stop_strings_cut_the_text_and_the_stream_matches_it() {
    let e = Arc::new(text_engine());
    let tok = DeepseekTokenizer::builtin().unwrap();
    let prompt = tok.encode_batch(&["Once upon a time".to_string()]).unwrap().remove(0);
    let (free, _) = e.generate(vec![GenerateRequest::new(0, prompt.clone(), 40, greedy())]);
    let text = free[0].text.clone().unwrap();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 12, "{text:?}");
    let stop: String = chars[8..11].iter().collect();
    let expect = &text[..text.find(&stop).unwrap()];
    let h = e.clone().start();
    let mut r = GenerateRequest::new(1, prompt, 40, greedy());
    r.stop_strings = vec![stop.clone(), "never-appears-xyz".into()];
    let events: Vec<Event> = h.submit(r).iter().collect();
    let streamed: String = events
        .iter()
        .filter_map(|e| match e {
            Event::Token { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    let Event::Done(o) = events.last().unwrap() else { panic!() };
    assert_eq!(o.finish, FinishReason::Stop, "stop {stop:?} in {text:?}");
    assert_eq!(o.text.as_deref(), Some(expect));
    assert_eq!(streamed, expect);
}

#[test]
fn stop_strings_without_a_tokenizer_are_a_named_error() {
    let e = engine(EngineConfig::default());
    let mut r = GenerateRequest::new(0, tokens(5, 0), 4, greedy());
    r.stop_strings = vec!["x".into()];
    let (o, _) = e.generate(vec![r]);
    assert_eq!(o[0].finish, FinishReason::Error);
    assert!(o[0].error.as_deref().unwrap().contains("`stop`"));
}
