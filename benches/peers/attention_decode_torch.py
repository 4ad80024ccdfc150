#!/usr/bin/env python3
"""PyTorch peer of `crates/kernels-ffi/benches/gpu_attention.rs`: transformers' DeepseekV4
attention function (`eager_attention_forward` of modeling_deepseek_v4, the one
DeepseekV4Attention calls by default: Q K^T, the sink column, softmax, P V, with the single K=V
head repeated for 64 heads) on the same shapes in bf16: batch 64, 64 heads of 512, 640 / 192 /
1152 / 128 keys. The keys are handed over already gathered and contiguous (the module reads them
from its cache that way), so the peer does not pay for the gather our kernel does. Timed with CUDA
events around batches of 20 calls, median of 20 batches after 2 warm-up batches.

Prefill (gpu_attention's 32k-token chunk, CSA 128 + 512 keys a query and sliding-only 128): the
eager function over the whole chunk would hold [64 heads, 32k, 32k] scores, so the peer runs it in
the decode form our kernel uses too, each query its own row of already gathered keys, 256 queries
a call, 128 calls a chunk (the keys of one call reused by all: not timed as a gather). Median of
5 chunks after 1 warm-up chunk.

usage: attention_decode_torch.py OUT.json [--small]   (--small: tiny shapes on the CPU)
"""
import json
import sys
import types

import torch
import transformers
from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

from timing import median_ms


def main():
    out = sys.argv[1]
    small = "--small" in sys.argv
    device = "cpu" if small else "cuda"
    batch, heads, d = (2, 4, 64) if small else (64, 64, 512)
    cases = [("CSA (128 window + 512 top-k)", 640), ("HCA 8k (128 + 64)", 192), ("HCA 128k (128 + 1024)", 1152), ("sliding only (128)", 128)]
    module = types.SimpleNamespace(sinks=torch.randn(heads, device=device, dtype=torch.bfloat16), num_key_value_groups=heads, training=False)
    results = []
    for what, keys in cases:
        q = torch.randn(batch, heads, 1, d, device=device, dtype=torch.bfloat16) * 8
        kvs = [torch.randn(batch, 1, keys, d, device=device, dtype=torch.bfloat16) for _ in range(4)]
        at = [0]

        def step():
            at[0] = (at[0] + 1) % len(kvs)
            eager_attention_forward(module, q, kvs[at[0]], kvs[at[0]], None, d ** -0.5)

        ms = median_ms(step, device, batch=20, reps=22)
        print(f"torch attention_decode {what:<30} batch={batch} heads={heads} keys={keys:<5} median {ms:.4f} ms")
        results.append({"case": what, "batch": batch, "heads": heads, "head_dim": d, "keys": keys, "median_ms": ms})
    doc = {
        "bench": "PyTorch peer: transformers DeepseekV4 eager_attention_forward (bf16)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "results": results,
    }
    if not small:
        tokens, per = 32768, 256  # repeat_kv copies the keys 64 times: 10.7 GB a call at 640 keys
        for what, keys in [("CSA prefill 32k (128 + 512)", 640), ("sliding prefill 32k (128)", 128)]:
            q = torch.randn(per, heads, 1, d, device=device, dtype=torch.bfloat16) * 8
            kv = torch.randn(per, 1, keys, d, device=device, dtype=torch.bfloat16)

            def chunk():
                for _ in range(tokens // per):
                    eager_attention_forward(module, q, kv, kv, None, d ** -0.5)

            ms = median_ms(chunk, device, batch=1, reps=6, warmup=1)
            flops = 4.0 * tokens * heads * keys * d
            print(f"torch attention_prefill {what:<28} tokens={tokens} heads={heads} keys={keys:<4} median {ms:.3f} ms  {flops / ms / 1e9:.2f} TFLOP/s")
            results.append({"case": what, "op": "attention_prefill", "tokens": tokens, "heads": heads, "head_dim": d,
                             "keys_per_query": keys, "median_ms": ms, "tflop_per_s": flops / ms / 1e9})
    with open(out, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
