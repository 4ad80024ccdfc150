#!/usr/bin/env python3
"""Export a train.py run as an official DeepSeek-V4 checkpoint directory with reference outputs.

    python3 tools/tiny-model/export.py --run RUN_DIR [--dir target/tiny-model] [--out models]

RUN_DIR holds train.py's weights-*.safetensors (transformers' names plus mtp.*), config.json,
log.json and samples.json. Writes OUT/deepinfer-tiny-v4/:
  config.json, model.safetensors   official V4 names and dtypes (MODEL_V4.md §10), weights in bf16
                                   (hyper-connection parameters, sinks, ape and gate biases in f32)
  reference.safetensors, meta.json  transformers' outputs on validation text, in the layout of
                                   tools/make_tiny_v4.py (input_ids, logits, final_hidden,
                                   router_topk.L, indexer_topk.L, mtp_logits, ...);
                                   make_tiny_v4 also reloads the directory through
                                   DeepseekV4ForCausalLM.from_pretrained and compares
  tokenizer.json, tokenizer_config.json
  training.json                    the run's log (loss curve, evaluation) and greedy samples
Needs: torch, transformers (>= 5.20) with deepseek_v4, safetensors, accelerate, numpy.
"""
import argparse, json, lzma, os, shutil, sys

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import make_tiny_v4 as M  # noqa: E402

NAME = "deepinfer-tiny-v4"


def official(sd, c):
    """transformers' names (+ mtp.*) -> official names."""
    inv = {hf: off for off, hf in M.REN.items()}
    out = {"embed.weight": sd["model.embed_tokens.weight"], "head.weight": sd["lm_head.weight"],
           "norm.weight": sd["model.norm.weight"], "hc_head_fn": sd["model.hc_head.hc_fn"],
           "hc_head_base": sd["model.hc_head.hc_base"], "hc_head_scale": sd["model.hc_head.hc_scale"]}

    def block(src, dst):
        for k, v in sd.items():
            if not k.startswith(src):
                continue
            rest = k[len(src):]
            if rest == "mlp.experts.gate_up_proj":
                i = v.shape[1] // 2
                for e in range(v.shape[0]):
                    out[f"{dst}ffn.experts.{e}.w1.weight"] = v[e, :i]
                    out[f"{dst}ffn.experts.{e}.w3.weight"] = v[e, i:]
            elif rest == "mlp.experts.down_proj":
                for e in range(v.shape[0]):
                    out[f"{dst}ffn.experts.{e}.w2.weight"] = v[e]
            elif rest in inv:
                out[dst + inv[rest]] = v
            else:
                raise KeyError(f"no official name for {k}")

    for i in range(c["num_hidden_layers"]):
        block(f"model.layers.{i}.", f"layers.{i}.")
    block("mtp.block.", "mtp.0.")
    for a, b in (("mtp.e_proj.weight", "e_proj.weight"), ("mtp.h_proj.weight", "h_proj.weight"),
                 ("mtp.enorm", "enorm.weight"), ("mtp.hnorm", "hnorm.weight"), ("mtp.norm", "norm.weight"),
                 ("mtp.head.hc_fn", "hc_head_fn"), ("mtp.head.hc_base", "hc_head_base"),
                 ("mtp.head.hc_scale", "hc_head_scale")):
        out["mtp.0." + b] = sd[a]
    return out


def card(c, training, manifest, stats, meta):
    log, ev = training["log"], training["log"]["eval"]
    src = "\n".join(f"| {s['name']} | {s['registry']} `{s['package']}` {s['version']} | {s['licence']} | "
                    f"{s['content']} | {s['text_bytes'] / 1e6:.1f} MB |" for s in manifest["sources"])
    samples = "\n\n".join(f"**{x['prompt']}**\n\n```\n{x['completion']}\n```" for x in training.get("samples", []))
    layers = ", ".join(meta["layer_types"])
    return f"""# deepinfer-tiny-v4

A {log['params'] / 1e6:.1f}M-parameter model of the exact DeepSeek-V4 architecture, trained from scratch for
DeepInfer-rs's demos, speculative-decoding tests and quality checks. It is DeepInfer-rs's built-in default
model. Made by `tools/tiny-model/pipeline.sh` (see tools/tiny-model/README.md); everything below is read
from the files beside this card.

## Architecture
{c['num_hidden_layers']} layers ({layers}) with mHC (hc_mult {c['hc_mult']}, Sinkhorn {c['hc_sinkhorn_iters']}
iterations), a {c['sliding_window']}-token sliding window on every layer, CSA (ratio 4, lightning indexer
{c['index_n_heads']} heads x {c['index_head_dim']}, top-{c['index_topk']}) and HCA (ratio {c['compress_rate_hca']});
MoE with {c['n_routed_experts']} routed experts (top-{c['num_experts_per_tok']}) and a shared expert, the first
{c['num_hash_layers']} layer hash-routed; one MTP layer. Hidden {c['hidden_size']}, {c['num_attention_heads']}
query heads of {c['head_dim']} over one KV head, vocabulary {c['vocab_size']}. Weights in BF16 under the
official names (hyper-connection parameters, sinks, ape and gate biases in F32), {meta['files_bytes']['model.safetensors'] / 2**20:.1f} MiB.

## Data (permissively licensed only)
{manifest['train_documents']} training and {manifest['valid_documents']} validation documents
({manifest['train_bytes'] / 1e6:.1f} MB / {manifest['valid_bytes'] / 1e6:.2f} MB of text, {manifest['duplicates_dropped']} duplicates
dropped, validation = 1.2% of documents chosen by hash), plus {manifest['chat_pairs']} chat pairs. Checksums of
every package and of the extracted splits: `corpus_manifest.json`.

| source | package | licence | content | text |
|---|---|---|---|---|
{src}

Tokenizer: byte-level BPE with DeepSeek's pre-tokenizer, {stats['vocab']} tokens including DeepSeek-V4's control
tokens (`<｜begin▁of▁sentence｜>` 0, `<｜end▁of▁sentence｜>` 1, `<｜User｜>`, `<｜Assistant｜>`, `<think>`, `</think>`,
`｜DSML｜`, ...) as special tokens, so the official V4 prompt encodings apply unchanged;
{stats['train']['bytes_per_token']:.2f} bytes per token. Training tokens: {stats['train']['tokens'] / 1e6:.1f}M.

## Training
One NVIDIA H200, {log['train_s'] / 60:.1f} minutes, {log['steps']} steps of {log['args']['batch']} x {log['args']['seq']} tokens
({log['tokens'] / 1e6:.1f}M tokens, {log['tokens_per_s'] / 1e3:.0f}k tokens/s), AdamW (lr {log['args']['lr']}, cosine to 10%),
loss = LM + 0.3 x MTP, transformers' DeepseekV4ForCausalLM (bf16 autocast) plus our MTP layer; the last
{log['args']['chat_share'] * 100:.0f}% of the time half of each batch is chat turns rendered with the V4 template (loss on the
answers). Score-routed experts are balanced by DeepSeek-V3's bias update. The lightning indexer is not
trained: transformers' implementation has no indexer loss (DeepSeek distils it from the attention
distribution), so it keeps a wide random initialisation, a fixed selection the model trained with.

## Evaluation (validation text, {ev['valid_windows']} windows of {log['args']['seq']} tokens)
| metric | value |
|---|---|
| perplexity | {ev['valid_perplexity']:.2f} |
| unigram perplexity of the same tokens (their own frequencies, a lower bound for any unigram model) | {stats['valid']['unigram_perplexity']:.0f} |
| next-token top-1 accuracy | {ev['lm_top1_accuracy']:.3f} |
| MTP (token t+2) top-1 agreement with the main head's prediction at t+1 | {ev['mtp_top1_agreement_with_main']:.3f} |
| MTP top-1 accuracy | {ev['mtp_top1_accuracy']:.3f} |

## Reference outputs
`reference.safetensors` holds transformers {meta['transformers']}'s float32 outputs on {meta['seq_len']} validation
tokens (logits, cached decode from token {meta['prefill_len']}, per-layer streams, router and indexer top-k, MTP
logits), in the layout of the engine's fixtures. transformers reloads this directory through its own
official-name loader and reproduces them with a max difference of {meta['reload_vs_inmemory_max_abs_diff']};
`deepinfer check-parity --model models/deepinfer-tiny-v4` checks the CPU engine against them.

## Greedy samples (transformers, with a 1.3 repetition penalty over the last 32 tokens)
{samples}

## Limits
A tiny model: answers are short and often wrong; it knows the register of documentation, code and old
prose, not facts. Context beyond the {log['args']['seq']}-token training length is untested.
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--dir", default="target/tiny-model")
    ap.add_argument("--out", default="models")
    ap.add_argument("--seq", type=int, default=96)
    ap.add_argument("--prefill", type=int, default=72)
    a = ap.parse_args()
    torch.set_num_threads(2)
    c = json.load(open(os.path.join(a.run, "config.json")))
    sd = {}
    for f in sorted(os.listdir(a.run)):
        if f.startswith("weights-"):
            sd.update(load_file(os.path.join(a.run, f)))
    off = official(sd, c)
    specs = {n: (shape, kind) for n, shape, kind, _ in M.official_param_specs(c, c["num_hidden_layers"] + 1)}
    assert set(specs) == set(off), (sorted(set(specs) - set(off))[:5], sorted(set(off) - set(specs))[:5])
    save, master = {}, {}
    for n, (shape, kind) in specs.items():
        v = off[n]
        assert tuple(v.shape) == tuple(shape), (n, v.shape, shape)
        if kind == "i64":
            save[n] = v.to(torch.int64)
            master[n] = save[n]
        else:
            save[n] = v.to(torch.float32 if kind == "f32" else torch.bfloat16)
            master[n] = save[n].float()
    # Candidate inputs: validation windows starting at a document's BOS (make_tiny_v4 takes the
    # first whose router / indexer top-k choices have a safe margin).
    valid = np.frombuffer(lzma.open(os.path.join(a.dir, "data", "valid.u16.xz")).read(), dtype=np.uint16)
    starts = [int(i) for i in np.nonzero(valid == 0)[0] if i + a.seq <= len(valid)]
    inputs = [torch.from_numpy(valid[s:s + a.seq].astype(np.int64)) for s in starts[:50]]
    spec = {"cfg": c, "weights": (save, master), "inputs": inputs, "seq": a.seq, "prefill": a.prefill, "quant": False}
    meta = M.run_variant(NAME, spec, a.out, 0)
    d = os.path.join(a.out, NAME)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(a.dir, "tokenizer", f), os.path.join(d, f))
    training = {"log": json.load(open(os.path.join(a.run, "log.json")))}
    sp = os.path.join(a.run, "samples.json")
    if os.path.exists(sp):
        training["samples"] = json.load(open(sp))
    with open(os.path.join(d, "training.json"), "w") as f:
        json.dump(training, f, indent=1, ensure_ascii=False)
    manifest = json.load(open(os.path.join(a.dir, "corpus", "manifest.json")))
    stats = json.load(open(os.path.join(a.dir, "data", "stats.json")))
    shutil.copy(os.path.join(a.dir, "corpus", "manifest.json"), os.path.join(d, "corpus_manifest.json"))
    shutil.copy(os.path.join(a.dir, "data", "stats.json"), os.path.join(d, "data_stats.json"))
    with open(os.path.join(d, "README.md"), "w") as f:
        f.write(card(c, training, manifest, stats, meta))
    print(f"wrote {d}: reload diff {meta['reload_vs_inmemory_max_abs_diff']}, decode diff {meta['decode_vs_full_max_abs_diff']}")


if __name__ == "__main__":
    main()
