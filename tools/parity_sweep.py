#!/usr/bin/env python3
"""Make tiny DeepSeek-V4 checkpoints with configurations and seeds other than the committed
fixtures', using make_tiny_v4.py's generator (transformers' DeepseekV4ForCausalLM as reference),
so `deepinfer check-parity` can be run on them: parity must come from the math, not the fixtures.

    python tools/parity_sweep.py --out target/parity_sweep
    for d in target/parity_sweep/*/; do deepinfer check-parity --model "$d"; done

Needs torch 2.15.0, transformers 5.24.0, safetensors, accelerate (docs/MODEL_V4.md §14.1).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_v4 as gen  # noqa: E402

EXTRA = {
    # Wider heads, 2 residual streams, 16 experts top-4, a 16-token window, HCA ratio 32,
    # an SWA layer in the middle and one hash layer; Pro-like routed scaling. 16 indexer heads:
    # with 4, exact zero-score (all-ReLU-negative) ties made every input fail the tie guard.
    "wide": dict(cfg=gen.base_config(384, 128, 5, [4, 128, 0, 4, 4], 1, compress_rate_hca=32,
                                     head_dim=32, num_attention_heads=8, qk_rope_head_dim=8,
                                     q_lora_rank=48, o_groups=4, o_lora_rank=24,
                                     n_routed_experts=16, num_experts_per_tok=4,
                                     moe_intermediate_size=48, hc_mult=2, hc_sinkhorn_iters=10,
                                     sliding_window=16, index_topk=6, index_n_heads=16,
                                     swiglu_limit=3.0, routed_scaling_factor=2.5),
                 seq=128, prefill=80, quant=False),
    # FP8/FP4 storage with a different layout: HCA first, three hash layers, top-1 indexer.
    "quant_alt": dict(cfg=gen.base_config(384, 256, 4, [128, 4, 0, 4], 3, compress_rate_hca=8,
                                          head_dim=128, num_attention_heads=2, q_lora_rank=128,
                                          o_groups=1, o_lora_rank=128, moe_intermediate_size=128,
                                          index_head_dim=64, qk_rope_head_dim=16, index_topk=1,
                                          sliding_window=6, expert_dtype="fp4",
                                          quantization_config={"activation_scheme": "dynamic",
                                                               "fmt": "e4m3", "quant_method": "fp8",
                                                               "scale_fmt": "ue8m0",
                                                               "weight_block_size": [128, 128]}),
                      seq=72, prefill=41, quant=True),
}

# (variant, seed). Some seeds find no input free of near-ties in the router/indexer top-k within
# the generator's 50 attempts (wide, seed 2 did not): those are skipped with a message.
RUNS = [("small", 7), ("small_q", 3), ("real", 5), ("wide", 1), ("wide", 2), ("wide", 6), ("quant_alt", 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="target/parity_sweep")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(2)
    variants = dict(gen.VARIANTS, **EXTRA)
    for name, seed in RUNS:
        tag = f"{name}_seed{seed}"
        if os.path.isfile(os.path.join(args.out, tag, "meta.json")):
            continue
        try:
            gen.run_variant(tag, dict(variants[name]), args.out, seed)
        except RuntimeError as e:
            print(f"[{tag}] skipped: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
