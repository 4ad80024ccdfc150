#!/usr/bin/env python3
"""Train the tiny model's byte-level BPE tokenizer on the corpus and encode the corpus with it.

    python3 tools/tiny-model/tokenizer.py [--dir target/tiny-model] [--vocab 4096]

Reads corpus/{train,valid,chat}.jsonl (corpus.py); writes into --dir:
  tokenizer/tokenizer.json, tokenizer/tokenizer_config.json
      DeepSeek's pre-tokenizer (digit groups, CJK runs, its word/punctuation regex, then byte-level)
      and byte-level decoder; DeepSeek-V4's control tokens as added special tokens with their exact
      spellings (BOS id 0, EOS id 1, pad id 2, then <｜User｜>, <｜Assistant｜>, <think>, </think>,
      ｜DSML｜, ...), so the official prompt encodings apply unchanged.
  data/train.u16.xz, data/valid.u16.xz   <BOS> document <EOS> streams, uint16 little endian
  data/chat.u16.xz, data/chat_mask.u8.xz chat turns rendered as DeepSeek-V4 prompts (thinking off):
      <BOS><｜User｜>question<｜Assistant｜></think>answer<EOS>; mask 1 on answer and EOS
  data/stats.json                        token counts, bytes/token, unigram entropy of valid
Needs: tokenizers, numpy.
"""
import argparse, json, lzma, math, os
from collections import Counter

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers, Regex

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT, THINK_END = "<｜User｜>", "<｜Assistant｜>", "</think>"
# DeepSeek-V4's control tokens (the vendored V4 tokenizer's added tokens, without its reserved
# "place▁holder▁no▁N" tokens, which no prompt format uses).
CONTROL = [BOS, EOS, PAD, "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>", USER, ASSISTANT, "<|EOT|>",
           "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
           "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
           "<｜tool▁sep｜>", "<think>", THINK_END, "｜DSML｜", "<｜System｜>", "<｜begin▁sys｜>", "<｜end▁sys｜>",
           "<｜latest_reminder｜>", "<｜action｜>", "<｜query｜>", "<｜answer｜>", "<｜search｜>",
           "<｜image｜>", "<｜ref｜>", "<｜/ref｜>", "<｜box｜>", "<｜/box｜>", "<｜point｜>", "<｜/point｜>",
           "<｜polygon｜>", "<｜/polygon｜>"]


def rows(path):
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def chat_text(r):
    return f"{BOS}{USER}{r['user']}{ASSISTANT}{THINK_END}{r['assistant']}{EOS}"


def save_xz(path, arr):
    with lzma.open(path, "wb", preset=6) as f:
        f.write(arr.tobytes())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="target/tiny-model")
    ap.add_argument("--vocab", type=int, default=4096)
    a = ap.parse_args()
    corpus, tdir, ddir = f"{a.dir}/corpus", f"{a.dir}/tokenizer", f"{a.dir}/data"
    os.makedirs(tdir, exist_ok=True)
    os.makedirs(ddir, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), "isolated"),
        pre_tokenizers.Split(Regex("[一-龥\u3040-ゟ゠-ヿ]+"), "isolated"),
        pre_tokenizers.Split(Regex(r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=CONTROL, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def texts():
        for r in rows(f"{corpus}/train.jsonl"):
            yield r["text"]
        for r in rows(f"{corpus}/chat.jsonl"):
            yield r["user"] + "\n" + r["assistant"]

    tok.train_from_iterator(texts(), trainer)
    assert tok.get_vocab_size() == a.vocab, tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in (BOS, EOS, PAD)] == [0, 1, 2]
    tok.save(f"{tdir}/tokenizer.json")
    with open(f"{tdir}/tokenizer_config.json", "w") as f:
        json.dump({"add_bos_token": False, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS,
                   "pad_token": EOS, "clean_up_tokenization_spaces": False, "model_max_length": 1048576,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2, ensure_ascii=False)

    bos, eos = 0, 1
    stats = {"vocab": a.vocab}
    for split in ("train", "valid"):
        docs = [r["text"] for r in rows(f"{corpus}/{split}.jsonl")]
        ids = []
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            ids += [bos] + enc.ids + [eos]
        arr = np.array(ids, dtype=np.uint16)
        save_xz(f"{ddir}/{split}.u16.xz", arr)
        nbytes = sum(len(d.encode()) for d in docs)
        stats[split] = {"tokens": len(ids), "bytes": nbytes, "bytes_per_token": nbytes / len(ids)}
        if split == "valid":
            # Unigram baseline: entropy of the valid tokens under train-free unigram counts of valid
            c = Counter(ids)
            h = -sum(n / len(ids) * math.log(n / len(ids)) for n in c.values())
            stats["valid"]["unigram_perplexity"] = math.exp(h)
    chat = [chat_text(r) for r in rows(f"{corpus}/chat.jsonl")]
    ids, mask = [], []
    for r, enc in zip(rows(f"{corpus}/chat.jsonl"), tok.encode_batch(chat, add_special_tokens=False)):
        a_start = enc.ids.index(tok.token_to_id(THINK_END)) + 1
        ids += enc.ids
        mask += [0] * a_start + [1] * (len(enc.ids) - a_start)
    save_xz(f"{ddir}/chat.u16.xz", np.array(ids, dtype=np.uint16))
    save_xz(f"{ddir}/chat_mask.u8.xz", np.array(mask, dtype=np.uint8))
    stats["chat"] = {"tokens": len(ids), "answer_tokens": int(sum(mask))}
    stats["files_bytes"] = {f: os.path.getsize(f"{ddir}/{f}") for f in os.listdir(ddir) if f.endswith(".xz")}
    with open(f"{ddir}/stats.json", "w") as f:
        json.dump(stats, f, indent=1)
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
