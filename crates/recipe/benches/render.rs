//! Render + tokenize a 32k-token multi-turn conversation (Chat Completions, V4 encoding, the
//! vendored tokenizer): requests per second the protocol layer sustains on one core's share.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use deepinfer_recipe::{convert, render, DeepseekTokenizer, Encoding, Protocol};
use serde_json::json;

fn conversation(target_tokens: usize) -> serde_json::Value {
    // ~45 tokens per user/assistant pair of this text: enough pairs for the target.
    let text = "The scheduler plans each step under a token budget; chunked prefill keeps decode latency low. ";
    let mut messages = vec![json!({"role": "system", "content": "You are a careful assistant."})];
    for i in 0..target_tokens / 45 {
        messages.push(json!({"role": "user", "content": format!("Question {i}: {text}")}));
        messages.push(json!({"role": "assistant", "content": format!("Answer {i}: {text}")}));
    }
    messages.push(json!({"role": "user", "content": "Summarise."}));
    json!({"model": "DeepSeek-V4-Pro", "messages": messages, "thinking": {"type": "disabled"}})
}

fn bench(c: &mut Criterion) {
    let tok = DeepseekTokenizer::builtin().unwrap();
    let body = conversation(32_000);
    let conv = convert(Protocol::Chat, &body).unwrap();
    let n = render(&conv.request, Encoding::V4, Some(&tok)).token_ids.unwrap().len();
    let mut g = c.benchmark_group("recipe");
    g.throughput(Throughput::Elements(1));
    g.sample_size(20);
    g.bench_function(format!("convert_render_tokenize_{n}_tokens"), |b| {
        b.iter(|| {
            let conv = convert(Protocol::Chat, &body).unwrap();
            render(&conv.request, Encoding::V4, Some(&tok)).token_ids.unwrap().len()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
