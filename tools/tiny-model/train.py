#!/usr/bin/env python3
"""Train the tiny DeepSeek-V4 model (every V4 feature: mHC, sliding window, CSA with the lightning
indexer, HCA, hash- and score-routed MoE with a shared expert, one MTP layer) on the corpus that
corpus.py and tokenizer.py built. Runs on one GPU (or, slowly, a CPU for a smoke test).

    python3 tools/tiny-model/train.py --data target/tiny-model/data --out OUT [--minutes 7.5]
        [--resume DIR] [--device cuda]

The schedule is by wall-clock time: warm-up, cosine decay to 10%, and in the last `--chat-share` of
the time half of every batch is chat turns (loss on the answers only). Loss = LM + 0.3 x MTP (the
MTP layer predicts token t+2 from the main model's final streams at t and the embedding of t+1,
sharing the embedding and the head, as DeepSeek-V3/V4 do). The lightning indexer is not trained
(transformers' V4 has no indexer loss): it keeps a wide random initialisation, a fixed selection the
rest of the model learns with. Score-routed MoE layers are balanced
without an auxiliary loss: after each step every router's selection bias moves by 1e-3 towards
equal load (DeepSeek-V3's rule).

Writes into OUT (every 2 minutes and at the end, so a run cut short leaves weights):
  weights-N.safetensors  bf16 weights in transformers' names plus mtp.* (each file < 16 MiB)
  config.json            the official V4 config of the model
  log.json               loss curve, validation perplexity, MTP agreement, timings
  samples.json           greedy continuations of a few prompts (plain and chat)
Needs: torch, transformers with deepseek_v4, safetensors, numpy, tokenizers (for samples).
"""
import argparse, copy, json, lzma, math, os, time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 5,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16,
    "q_lora_rank": 96, "o_groups": 2, "o_lora_rank": 64,
    "sliding_window": 64,
    # per layer, then the MTP layer: 0 sliding only, 4 CSA (+indexer), 128 HCA (ratio compress_rate_hca)
    "compress_ratios": [0, 4, 128, 4, 128, 0], "compress_rate_hca": 32,
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 96,
    "num_hash_layers": 1, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1,
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "initializer_range": 0.02,
    "attention_bias": False, "attention_dropout": 0.0, "torch_dtype": "bfloat16", "use_cache": True,
}


def hf_config(c):
    from transformers import DeepseekV4Config
    kw = copy.deepcopy({k: v for k, v in c.items() if k not in ("architectures", "torch_dtype")})
    cfg = DeepseekV4Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def rms(x, w, eps):
    x32 = x.float()
    return (w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


class Mtp(nn.Module):
    """MTP layer 0: combines the main model's final streams at t with the embedding of token t+1,
    runs one sliding-window V4 block, and predicts token t+2 through the shared head."""

    def __init__(self, cfg, c):
        super().__init__()
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as MD
        mcfg = copy.deepcopy(cfg)
        mcfg.layer_types = ["sliding_attention"]
        mcfg.mlp_layer_types = ["moe"]
        mcfg.num_hidden_layers = 1
        d = c["hidden_size"]
        self.block = MD.DeepseekV4DecoderLayer(mcfg, 0)
        self.head = MD.DeepseekV4HyperHead(mcfg)
        self.rot = MD.DeepseekV4RotaryEmbedding(mcfg)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = nn.Parameter(torch.ones(d))
        self.hnorm = nn.Parameter(torch.ones(d))
        self.norm = nn.Parameter(torch.ones(d))
        self.window, self.eps = c["sliding_window"], c["rms_norm_eps"]

    def forward(self, embed_w, head_w, streams, ids):
        s1 = ids.shape[1] - 1
        e = rms(F.embedding(ids[:, 1:], embed_w), self.enorm, self.eps)
        h = rms(streams[:, :s1], self.hnorm, self.eps)
        x = self.e_proj(e).unsqueeze(2) + self.h_proj(h)
        pos = torch.arange(s1, device=ids.device)[None]
        pe = {"main": self.rot(x, pos, layer_type="main"), "compress": self.rot(x, pos, layer_type="compress")}
        i = torch.arange(s1, device=ids.device)
        ok = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        mask = torch.zeros(s1, s1, device=ids.device).masked_fill(~ok, float("-inf"))[None, None]
        x = self.block(x, position_embeddings=pe, position_ids=pos, attention_mask=mask, input_ids=ids[:, 1:], cache=None)
        return rms(self.head(x), self.norm, self.eps) @ head_w.T


def load_u(path, dtype):
    with lzma.open(path) as f:
        return np.frombuffer(f.read(), dtype=dtype)


class Trainer:
    def __init__(self, a):
        from transformers import DeepseekV4ForCausalLM
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as MD
        self.a, self.dev = a, torch.device(a.device)
        torch.manual_seed(a.seed)
        self.cfg = hf_config(CONFIG)
        self.model = DeepseekV4ForCausalLM(self.cfg).to(self.dev)
        self.mtp = Mtp(self.cfg, CONFIG).to(self.dev)
        for m in self.mtp.modules():
            self.model._init_weights(m)
        # Hash layers: each token id goes to top_k distinct experts, spread evenly.
        g = torch.Generator().manual_seed(a.seed)
        e, k, v = CONFIG["n_routed_experts"], CONFIG["num_experts_per_tok"], CONFIG["vocab_size"]
        for mod in self.model.modules():
            if isinstance(mod, MD.DeepseekV4HashRouter):
                mod.tid2eid.copy_(torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(v)]).to(self.dev))
        # transformers' V4 has no indexer loss (DeepSeek distils the indexer from the attention
        # distribution), so the indexer gets no gradient: give it weights large enough that its
        # scores are not all ReLU zeros, i.e. a fixed, tie-free selection the model trains with.
        for mod in self.model.modules():
            if isinstance(mod, MD.DeepseekV4Indexer):
                for w in (mod.q_b_proj.weight, mod.scorer.weights_proj.weight, mod.kv_proj.weight, mod.gate_proj.weight):
                    with torch.no_grad():
                        w.copy_(torch.randn(w.shape, generator=g) * 0.2)
        if a.resume:
            self.load(a.resume)
        self.routers = [m for m in list(self.model.modules()) + list(self.mtp.modules()) if isinstance(m, MD.DeepseekV4TopKRouter)]
        self.counts = {}
        for r in self.routers:
            r.register_forward_hook(self._count)
        self.streams = None
        self.model.model.hc_head.register_forward_pre_hook(self._grab)
        params = list(self.model.parameters()) + list(self.mtp.parameters())
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                     lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=self.dev.type == "cuda")
        self.train = torch.from_numpy(load_u(f"{a.data}/train.u16.xz", np.uint16).astype(np.int32)).to(self.dev)
        self.valid = torch.from_numpy(load_u(f"{a.data}/valid.u16.xz", np.uint16).astype(np.int32)).to(self.dev)
        self.chat = torch.from_numpy(load_u(f"{a.data}/chat.u16.xz", np.uint16).astype(np.int32)).to(self.dev)
        self.chat_mask = torch.from_numpy(load_u(f"{a.data}/chat_mask.u8.xz", np.uint8).astype(np.int32)).to(self.dev)
        self.params = sum(p.numel() for p in params)

    def _count(self, mod, inp, out):
        idx = out[2].detach().reshape(-1)
        c = torch.bincount(idx, minlength=mod.num_experts)
        self.counts[id(mod)] = self.counts.get(id(mod), 0) + c

    def _grab(self, mod, args):
        self.streams = args[0]

    def windows(self, data, n, s, mask=None):
        off = torch.randint(0, data.numel() - s, (n,), device=self.dev)
        idx = off[:, None] + torch.arange(s, device=self.dev)[None]
        return data[idx].long(), (mask[idx] if mask is not None else None)

    def losses(self, ids, mask=None):
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.dev.type == "cuda"):
            logits = self.model(input_ids=ids, use_cache=False).logits
            mtp = self.mtp(self.model.model.embed_tokens.weight, self.model.lm_head.weight, self.streams, ids)
        v = logits.shape[-1]
        lm = F.cross_entropy(logits[:, :-1].float().reshape(-1, v), ids[:, 1:].reshape(-1), reduction="none")
        mt = F.cross_entropy(mtp[:, :-1].float().reshape(-1, v), ids[:, 2:].reshape(-1), reduction="none")
        if mask is None:
            return lm.mean(), mt.mean(), logits, mtp
        m1, m2 = mask[:, 1:].reshape(-1).float(), mask[:, 2:].reshape(-1).float()
        return (lm * m1).sum() / m1.sum().clamp(min=1), (mt * m2).sum() / m2.sum().clamp(min=1), logits, mtp

    def lr_at(self, frac):
        warm = 0.03
        if frac < warm:
            return self.a.lr * frac / warm
        return self.a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (frac - warm) / (1 - warm)))))

    @torch.no_grad()
    def evaluate(self, max_windows=512):
        self.model.eval()
        self.mtp.eval()
        s, b = self.a.seq, self.a.batch
        n = min(max_windows, self.valid.numel() // s)
        tot = {"lm": 0.0, "mtp": 0.0, "agree": 0.0, "mtp_acc": 0.0, "lm_acc": 0.0, "rows": 0}
        for i in range(0, n, b):
            k = min(b, n - i)
            ids = self.valid[i * s:(i + k) * s].view(k, s).long()
            lm, mt, logits, mtp = self.losses(ids)
            rows = k * (s - 2)
            main_next = logits[:, 1:-1].argmax(-1)        # main head at t+1 predicts token t+2
            mtp_pred = mtp[:, :-1].argmax(-1)              # MTP at t predicts token t+2
            tot["lm"] += lm.item() * k
            tot["mtp"] += mt.item() * k
            tot["agree"] += (main_next == mtp_pred).float().sum().item()
            tot["mtp_acc"] += (mtp_pred == ids[:, 2:]).float().sum().item()
            tot["lm_acc"] += (logits[:, :-1].argmax(-1) == ids[:, 1:]).float().mean().item() * rows
            tot["rows"] += rows
        self.model.train()
        self.mtp.train()
        nw = n
        return {"valid_windows": nw, "valid_loss": tot["lm"] / nw, "valid_perplexity": math.exp(tot["lm"] / nw),
                "mtp_loss": tot["mtp"] / nw, "mtp_top1_agreement_with_main": tot["agree"] / tot["rows"],
                "mtp_top1_accuracy": tot["mtp_acc"] / tot["rows"], "lm_top1_accuracy": tot["lm_acc"] / tot["rows"]}

    def state(self):
        sd = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).cpu().contiguous()
              for k, v in self.model.state_dict().items() if "inv_freq" not in k}
        sd.update({f"mtp.{k}": v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).cpu().contiguous()
                   for k, v in self.mtp.state_dict().items() if "inv_freq" not in k})
        return sd

    def save(self, out, log):
        from safetensors.torch import save_file
        os.makedirs(out, exist_ok=True)
        sd = self.state()
        shards, cur, size = [], {}, 0
        for k in sorted(sd):
            n = sd[k].numel() * sd[k].element_size()
            if cur and size + n > 15 * 2**20:
                shards.append(cur)
                cur, size = {}, 0
            cur[k] = sd[k]
            size += n
        shards.append(cur)
        for f in os.listdir(out):
            if f.startswith("weights-"):
                os.remove(os.path.join(out, f))
        for i, s in enumerate(shards):
            save_file(s, os.path.join(out, f"weights-{i}.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(CONFIG, f, indent=1)
        with open(os.path.join(out, "log.json"), "w") as f:
            json.dump(log, f, indent=1)

    def load(self, d):
        from safetensors.torch import load_file
        sd = {}
        for f in sorted(os.listdir(d)):
            if f.startswith("weights-"):
                sd.update(load_file(os.path.join(d, f)))
        main = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
        mtp = {k[4:]: v for k, v in sd.items() if k.startswith("mtp.")}
        missing, unexpected = self.model.load_state_dict(main, strict=False)
        assert not unexpected and all("inv_freq" in m for m in missing), (missing, unexpected)
        missing, unexpected = self.mtp.load_state_dict(mtp, strict=False)
        assert not unexpected and all("inv_freq" in m for m in missing), (missing, unexpected)

    @torch.no_grad()
    def samples(self, tok_path):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(tok_path)
        self.model.eval()
        prompts = ["The history of the United States", "def parse_args(", "SELECT name FROM",
                   "It was a dark and stormy night,",
                   "<｜begin▁of▁sentence｜><｜User｜>What is a database index?<｜Assistant｜></think>",
                   "<｜begin▁of▁sentence｜><｜User｜>Hello, how are you?<｜Assistant｜></think>"]
        out = []
        for p in prompts:
            ids = tok.encode(p if p.startswith("<｜") else "<｜begin▁of▁sentence｜>" + p, add_special_tokens=False).ids
            x = torch.tensor([ids], device=self.dev)
            for _ in range(48):
                with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.dev.type == "cuda"):
                    nxt = self.model(input_ids=x, use_cache=False).logits[0, -1].float()
                # a mild repetition penalty on the last 32 tokens keeps greedy samples readable
                for t in set(x[0, -32:].tolist()):
                    nxt[t] = nxt[t] / 1.3 if nxt[t] > 0 else nxt[t] * 1.3
                t = int(nxt.argmax())
                x = torch.cat([x, torch.tensor([[t]], device=self.dev)], 1)
                if t == 1:
                    break
            out.append({"prompt": p, "completion": tok.decode(x[0, len(ids):].tolist(), skip_special_tokens=False)})
        self.model.train()
        return out

    def run(self):
        a = self.a
        t0 = time.time()
        budget = a.minutes * 60
        log = {"config": CONFIG, "params": self.params, "args": vars(a), "curve": []}
        print(f"params {self.params / 1e6:.2f}M, train tokens {self.train.numel() / 1e6:.1f}M", flush=True)
        step, tokens, last_save = 0, 0, time.time()
        self.model.train()
        self.mtp.train()
        while True:
            frac = (time.time() - t0) / budget
            if frac >= 1.0 or (a.max_steps and step >= a.max_steps):
                break
            for gr in self.opt.param_groups:
                gr["lr"] = self.lr_at(frac)
            chat = frac > 1 - a.chat_share
            if chat:
                ids1, _ = self.windows(self.train, a.batch // 2, a.seq)
                ids2, m2 = self.windows(self.chat, a.batch - a.batch // 2, a.seq, self.chat_mask)
                lm1, mt1, _, _ = self.losses(ids1)
                lm2, mt2, _, _ = self.losses(ids2, m2)
                lm, mt = (lm1 + lm2) / 2, (mt1 + mt2) / 2
            else:
                ids, _ = self.windows(self.train, a.batch, a.seq)
                lm, mt, _, _ = self.losses(ids)
            loss = lm + 0.3 * mt
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(list(self.model.parameters()) + list(self.mtp.parameters()), 1.0)
            self.opt.step()
            with torch.no_grad():
                for r in self.routers:
                    c = self.counts.pop(id(r), None)
                    if c is not None:
                        c = c.float()
                        r.e_score_correction_bias += 1e-3 * torch.sign(c.mean() - c)
            step += 1
            tokens += a.batch * a.seq
            if step % 25 == 0 or step == 1:
                rec = {"step": step, "s": round(time.time() - t0, 1), "lm": round(lm.item(), 4),
                       "mtp": round(mt.item(), 4), "lr": self.opt.param_groups[0]["lr"], "grad_norm": round(gn.item(), 3),
                       "tokens": tokens, "chat": chat}
                log["curve"].append(rec)
                print(json.dumps(rec), flush=True)
            if time.time() - last_save > 120:
                self.save(a.out, log)
                last_save = time.time()
        log["train_s"] = time.time() - t0
        log["steps"] = step
        log["tokens"] = tokens
        log["tokens_per_s"] = tokens / log["train_s"]
        log["eval"] = self.evaluate(self.a.eval_windows)
        print(json.dumps(log["eval"]), flush=True)
        self.save(a.out, log)
        if a.tokenizer and os.path.exists(a.tokenizer):
            with open(os.path.join(a.out, "samples.json"), "w") as f:
                json.dump(self.samples(a.tokenizer), f, indent=1, ensure_ascii=False)
        print(f"done in {time.time() - t0:.0f}s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="target/tiny-model/data")
    ap.add_argument("--tokenizer", default="target/tiny-model/tokenizer/tokenizer.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=7.5)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--eval-windows", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--chat-share", type=float, default=0.12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", default="")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    if a.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    Trainer(a).run()


if __name__ == "__main__":
    main()
