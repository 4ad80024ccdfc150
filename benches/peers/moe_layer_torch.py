#!/usr/bin/env python3
"""PyTorch peer of `crates/moe/benches/gpu_moe.rs`: transformers' DeepseekV4SparseMoeBlock (score
routing, 256 experts, top-6, shared expert, hidden 4096, intermediate 2048) in bf16 on the GPU,
for 1, 64 and 4096 tokens, timed the same way (rotating inputs, CUDA events around batches,
median). transformers' experts_implementation backends are timed where they run: "eager" (its
per-expert loop, the module's default) and "grouped_mm" (torch._grouped_mm).

usage: moe_layer_torch.py OUT.json [--small]   (--small: tiny shapes on the CPU, a smoke test)
"""
import json
import sys

import torch
import transformers
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

from timing import median_ms


def build(small, impl, device):
    dims = dict(hidden_size=256, moe_intermediate_size=128, n_routed_experts=16) if small else {}
    cfg = DeepseekV4Config(num_hidden_layers=4, mlp_layer_types=["moe"] * 4, **dims)
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    with torch.device(device):
        block = DeepseekV4SparseMoeBlock(cfg, layer_idx=3).to(torch.bfloat16)
    for name, p in block.named_parameters():
        fan_in = p.shape[-1]
        torch.nn.init.normal_(p, std=fan_in ** -0.5)
    block.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    return cfg, block.eval()


def time_block(block, cfg, tokens, device):
    d = cfg.hidden_size
    inputs = max(2, min(32, 64 // min(tokens, 64)))
    xs = [torch.randn(1, tokens, d, device=device, dtype=torch.bfloat16) * 2 for _ in range(inputs)]
    batch = 3 if tokens >= 1024 else 20
    with torch.no_grad():
        for x in xs:
            block(x)
    at = [0]

    def step():
        at[0] = (at[0] + 1) % inputs
        block(xs[at[0]])

    return median_ms(step, device, batch, reps=12)


def main():
    out = sys.argv[1]
    small = "--small" in sys.argv
    device = "cpu" if small else "cuda"
    results = []
    for impl in ["eager", "grouped_mm"]:
        try:
            cfg, block = build(small, impl, device)
        except Exception as e:  # an implementation this torch/transformers cannot build
            results.append({"experts_implementation": impl, "error": repr(e)})
            print(f"torch moe {impl}: not available ({e!r})")
            continue
        for tokens in ([1, 8] if small else [1, 64, 4096]):
            try:
                ms = time_block(block, cfg, tokens, device)
            except Exception as e:
                results.append({"experts_implementation": impl, "tokens": tokens, "error": repr(e)})
                print(f"torch moe {impl} tokens={tokens}: failed ({e!r})")
                continue
            print(f"torch moe {impl:<10} tokens={tokens:<5} median {ms:.4f} ms")
            results.append({"experts_implementation": impl, "tokens": tokens, "median_ms": ms})
        del block
        if device == "cuda":
            torch.cuda.empty_cache()
    doc = {
        "bench": "PyTorch peer: transformers DeepseekV4SparseMoeBlock (bf16)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "method": "random bf16 weights (std fan_in^-0.5), score routing with bias; inputs rotate; CUDA events around batches of forwards (20, or 3 at 4096 tokens), 2 warm-up batches, median of 10",
        "results": results,
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
