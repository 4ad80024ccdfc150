#!/usr/bin/env python3
"""Whole-model peer of `deepinfer bench --device cuda` (issue #37): transformers'
`DeepseekV4ForCausalLM`, bf16 eager (it has no FP8/FP4 path, so its weights are 2x the FP8 and 4x
the FP4 bytes ours read), random weights, the config `deepinfer random-model` writes
(`config.json` of that directory: V4-Flash layer shapes, L layers). Measures, with the engine's
arithmetic (greedy, no sampling cost):
- prefill: one forward over a P-token prompt (tok/s, i.e. TTFT = P / tok/s), median of 3 after 1;
- decode at batch B with a C-token context: `model.generate` of N new tokens, tok/s = B·N over
  the time after the prefill (the prefill's time, measured alone, subtracted), one run after a
  warm-up.

usage: model_torch.py MODEL_DIR OUT.json [--prefill 512,2048] [--decode 1,8] [--context 512] [--new 32]
"""
import argparse
import json
import time

import torch
import transformers
from transformers import AutoConfig, DeepseekV4ForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--decode", default="1,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    a = ap.parse_args()
    cfg = AutoConfig.from_pretrained(a.model_dir)
    for k in ("quantization_config",):
        if hasattr(cfg, k):
            delattr(cfg, k)
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device("cuda"):
        model = DeepseekV4ForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    out = {"peer": "transformers DeepseekV4ForCausalLM, bf16 eager, random weights",
           "transformers": transformers.__version__, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0), "layers": cfg.num_hidden_layers, "params": params,
           "build_s": time.time() - t0, "prefill": [], "decode": []}
    print(json.dumps({k: out[k] for k in ("gpu", "layers", "params", "build_s")}), flush=True)
    v = cfg.vocab_size
    g = torch.Generator(device="cuda").manual_seed(1)

    def prefill_s(b, n):
        ids = torch.randint(2, v, (b, n), device="cuda", generator=g)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for n in [int(x) for x in a.prefill.split(",") if x]:
        try:
            prefill_s(1, n)
            ts = sorted(prefill_s(1, n) for _ in range(3))
            out["prefill"].append({"tokens": n, "seconds": ts[1], "tokens_per_s": n / ts[1]})
        except torch.OutOfMemoryError as e:
            out["prefill"].append({"tokens": n, "error": "out of memory"})
            torch.cuda.empty_cache()
        print(json.dumps(out["prefill"][-1]), flush=True)
    for b in [int(x) for x in a.decode.split(",") if x]:
        try:
            ids = torch.randint(2, v, (b, a.context), device="cuda", generator=g)
            kw = dict(max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, pad_token_id=0)
            with torch.no_grad():
                model.generate(ids, **dict(kw, max_new_tokens=4, min_new_tokens=4))
                pre = prefill_s(b, a.context)
                torch.cuda.synchronize()
                t = time.perf_counter()
                model.generate(ids, **kw)
                torch.cuda.synchronize()
                total = time.perf_counter() - t
            dec = max(total - pre, 1e-9)
            out["decode"].append({"batch": b, "context": a.context, "new_tokens": a.new, "seconds": total,
                                  "prefill_seconds": pre, "tokens_per_s": b * a.new / dec,
                                  "ms_per_step": dec / a.new * 1e3})
        except torch.OutOfMemoryError:
            out["decode"].append({"batch": b, "error": "out of memory"})
            torch.cuda.empty_cache()
        print(json.dumps(out["decode"][-1]), flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
