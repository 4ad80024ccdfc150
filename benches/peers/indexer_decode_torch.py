#!/usr/bin/env python3
"""PyTorch peer of the indexer section of `crates/kernels-ffi/benches/gpu_attention.rs`:
transformers' DeepseekV4 lightning-indexer scoring (`DeepseekV4IndexerScorer`, the module
`DeepseekV4Indexer` calls: q·K in fp32, ReLU, the head weights from `weights_proj`, the sum over
heads) followed by the same `topk(512)` the indexer takes, for one decode step of 64 sequences with
64 index heads of 128 over 2048 and 32768 compressed rows (8k and 128k contexts at ratio 4). The
compressed keys are handed over gathered and contiguous (as its cache holds them). Random bf16
weights; timed with CUDA events around batches of 5 calls, median of 10 after 2 warm-up batches.

usage: indexer_decode_torch.py OUT.json [--small]   (--small: tiny shapes on the CPU)
"""
import json
import sys

import torch
import transformers
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

try:
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer
except ImportError:  # releases before the scorer was split out of DeepseekV4Indexer
    DeepseekV4IndexerScorer = None

from timing import median_ms


def main():
    out = sys.argv[1]
    small = "--small" in sys.argv
    device = "cpu" if small else "cuda"
    batch, heads, d, hidden, k = (2, 4, 16, 64, 8) if small else (64, 64, 128, 4096, 512)
    cases = [("indexer 8k (2048 rows)", 64 if small else 2048), ("indexer 128k (32768 rows)", 256 if small else 32768)]
    config = DeepseekV4Config(hidden_size=hidden, index_n_heads=heads, index_head_dim=d, index_topk=k)
    if DeepseekV4IndexerScorer is not None:
        scorer = DeepseekV4IndexerScorer(config).to(device=device, dtype=torch.bfloat16).eval()
        source = "DeepseekV4IndexerScorer"
    else:
        # The same lines as that module's forward (transformers 5.24), for older releases.
        proj = torch.nn.Linear(hidden, heads, bias=False).to(device=device, dtype=torch.bfloat16)

        def scorer(q, kv, hs):
            s = torch.matmul(q.float(), kv.transpose(-1, -2).float().unsqueeze(1))
            s = torch.relu(s) * d**-0.5
            w = proj(hs).float() * heads**-0.5
            return (s * w.unsqueeze(-1)).sum(dim=2)

        source = "DeepseekV4IndexerScorer's forward, inlined"

    results = []
    for what, rows in cases:
        q = torch.randn(batch, 1, heads, d, device=device, dtype=torch.bfloat16)
        h = torch.randn(batch, 1, hidden, device=device, dtype=torch.bfloat16)
        # Key copies rotate (more than the L2 between them on the GPU).
        keys = [torch.randn(batch, rows, d, device=device, dtype=torch.bfloat16) for _ in range(2 if small else 3)]
        at = [0]

        def step():
            at[0] = (at[0] + 1) % len(keys)
            scores = scorer(q, keys[at[0]], h)  # [B, 1, rows]
            scores.topk(min(k, rows), dim=-1)

        ms = median_ms(step, device, batch=5, reps=12)
        print(f"torch indexer_decode {what:<26} batch={batch} heads={heads} dim={d} rows={rows} k={k} median {ms:.4f} ms")
        results.append({"case": what, "batch": batch, "heads": heads, "dim": d, "rows": rows, "k": k, "median_ms": ms})
    doc = {
        "bench": "PyTorch peer: transformers DeepseekV4IndexerScorer + topk (bf16 weights, fp32 scores)",
        "scorer": source,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "results": results,
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
