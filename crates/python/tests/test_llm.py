"""The Python package against the built-in model (CPU), run by `cargo xtask ci` in a fresh venv
with the freshly built wheel installed. DEEPINFER_BIN names the CLI binary of the same checkout
(greedy outputs must equal the CLI's)."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import deepinfer
from deepinfer import LLM, CompletionOutput, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)
PROMPTS = ["The sea is", "Once upon a time", "def add(a, b):", "The capital of France"]


@pytest.fixture(scope="module")
def llm():
    m = LLM()
    yield m
    m.close()


def test_generate_returns_vllm_shaped_outputs(llm):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outs] == PROMPTS
    for o in outs:
        assert isinstance(o, RequestOutput) and o.finished
        c = o.outputs[0]
        assert isinstance(c, CompletionOutput)
        assert 1 <= len(c.token_ids) <= 24
        assert c.finish_reason in ("stop", "length")
        assert c.text == llm.decode([t for t in c.token_ids if t != 1]) or c.finish_reason == "stop"
        assert o.prompt_token_ids[0] == 0, "text prompts start with begin-of-sentence"
        assert o.metrics.ttft_s > 0 and o.metrics.e2e_s >= o.metrics.ttft_s
    assert llm.info["builtin"] == "trained"


def test_text_and_token_prompts_agree(llm):
    ids = [0] + llm.encode("The sea is")
    by_text = llm.generate("The sea is", GREEDY)[0]
    by_ids = llm.generate(ids, GREEDY)[0]
    assert by_text.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_length_and_ignore_eos(llm):
    o = llm.generate("The", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    assert len(o.token_ids) == 40 and o.finish_reason == "length"


def test_stop_strings_end_the_text(llm):
    full = llm.generate("The sea is", GREEDY)[0].outputs[0].text
    word = full.split()[1]
    cut = llm.generate("The sea is", SamplingParams(temperature=0, max_tokens=24, stop=[word]))[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert word not in cut.text and full.startswith(cut.text)


def test_logprobs(llm):
    o = llm.generate("The sea is", SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0].outputs[0]
    assert len(o.logprobs) == len(o.token_ids)
    for tok, d in zip(o.token_ids, o.logprobs):
        assert tok in d and len(d) >= 3
        assert d[tok] == max(d.values()), "greedy picks the most likely token"
    assert o.cumulative_logprob == pytest.approx(sum(d[t] for t, d in zip(o.token_ids, o.logprobs)), rel=1e-5)


def test_seeded_sampling_is_reproducible_and_n_outputs_differ(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=24, seed=7, n=3, ignore_eos=True)
    a = llm.generate("Once upon a time", sp)[0]
    b = llm.generate("Once upon a time", sp)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3, "output i samples with seed + i"
    single = llm.generate("Once upon a time", SamplingParams(temperature=1.0, max_tokens=24, seed=8, ignore_eos=True))[0]
    assert single.outputs[0].token_ids == a.outputs[1].token_ids


def test_json_schema_and_regex_constrain_the_output(llm):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    o = llm.generate("A person:", SamplingParams(temperature=0, max_tokens=64, json_schema=schema))[0].outputs[0]
    v = json.loads(o.text)
    assert set(v) == {"name", "age"} and isinstance(v["age"], int)
    r = llm.generate("Count:", SamplingParams(temperature=0, max_tokens=12, regex="[0-9]+( [0-9]+)*"))[0].outputs[0]
    import re
    assert re.fullmatch("[0-9]+( [0-9]+)*", r.text), r.text


def cli(*args):
    exe = os.environ.get("DEEPINFER_BIN")
    if not exe:
        pytest.skip("DEEPINFER_BIN not set (cargo xtask ci sets it)")
    p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return [json.loads(l) for l in p.stdout.splitlines() if l.strip()]


def test_greedy_chat_equals_the_cli(llm):
    for prompt in ["Hello!", "Write a haiku about the sea."]:
        [want] = cli("generate", "--prompt", prompt, "--max-tokens", "24", "--output", "json")
        got = llm.chat([{"role": "user", "content": prompt}], GREEDY, thinking=False)[0]
        assert got.outputs[0].token_ids == want["tokens"], prompt
        assert got.outputs[0].raw_text == want["text"]


def test_chat_parses_tool_calls_and_answers_json_schema(llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    o = llm.chat([{"role": "user", "content": "What is the weather in Paris?"}],
                 SamplingParams(temperature=0, max_tokens=96), tools=tools, tool_choice="required", thinking=False)[0]
    c = o.outputs[0]
    assert c.finish_reason == "tool_calls", c
    [call] = c.tool_calls
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    a = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(temperature=0, max_tokens=48),
                 response_format=rf, thinking=False)[0].outputs[0]
    assert list(json.loads(a.text)) == ["answer"]


def test_thinking_overrides_warn(llm):
    with pytest.warns(UserWarning, match="temperature"):
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=4))


def test_stream_grows_to_the_generated_output(llm):
    want = llm.generate("Once upon a time", GREEDY)[0].outputs[0]
    seen = list(llm.stream("Once upon a time", GREEDY))
    assert seen[-1].finished and not any(s.finished for s in seen[:-1])
    assert seen[-1].outputs[0].token_ids == want.token_ids and seen[-1].outputs[0].text == want.text
    for a, b in zip(seen, seen[1:]):
        assert b.outputs[0].text.startswith(a.outputs[0].text)
    assert len(seen) >= len(want.token_ids)


def test_closing_a_stream_early_cancels_it(llm):
    it = llm.stream("The", SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    next(it)
    it.close()
    o = llm.generate("The sea is", GREEDY)[0]
    assert o.outputs[0].token_ids, "the engine still serves"


def test_asyncio_variants(llm):
    async def main():
        outs = await asyncio.gather(*(llm.generate_async(p, GREEDY) for p in PROMPTS))
        chat = await llm.chat_async([{"role": "user", "content": "Hello!"}], GREEDY, thinking=False)
        streamed = [o async for o in llm.stream_async("The sea is", GREEDY)]
        return outs, chat, streamed

    outs, chat, streamed = asyncio.run(main())
    serial = llm.generate(PROMPTS, GREEDY)
    assert [o[0].outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in serial]
    assert chat[0].outputs[0].token_ids == llm.chat([{"role": "user", "content": "Hello!"}], GREEDY, thinking=False)[0].outputs[0].token_ids
    assert streamed[-1].outputs[0].token_ids == serial[0].outputs[0].token_ids


def test_concurrent_threads_get_the_serial_outputs_and_the_gil_is_released(llm):
    serial = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    results = [None] * len(PROMPTS)
    ticks = [0]
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    def worker(i):
        results[i] = llm.generate(PROMPTS[i], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].token_ids

    t = threading.Thread(target=ticker)
    t.start()
    ws = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    t0 = time.time()
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    elapsed = time.time() - t0
    stop.set()
    t.join()
    assert results == serial
    # A thread holding the GIL for the whole generate would leave the ticker ~0 ticks.
    assert ticks[0] >= elapsed * 1000 / 20, (ticks[0], elapsed)


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        ({"temperature": "hot"}, TypeError, "temperature"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_k": -5}, ValueError, "top_k"),
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"max_tokens": 1.5}, TypeError, "max_tokens"),
        ({"n": 0}, ValueError, "n"),
        ({"seed": -1}, ValueError, "seed"),
        ({"stop": 3}, TypeError, "stop"),
        ({"logprobs": 100}, ValueError, "logprobs"),
        ({"presence_penalty": 9.0}, ValueError, "presence_penalty"),
        ({"json_schema": "not json"}, ValueError, "json_schema"),
        ({"json_schema": {}, "regex": "a"}, ValueError, "regex"),
    ],
)
def test_bad_sampling_arguments_name_the_parameter(llm, kwargs, exc, name):
    with pytest.raises(exc, match=rf"^{name}:"):
        llm.generate("Hi", SamplingParams(**kwargs))


def test_bad_call_arguments_name_the_parameter(llm, tmp_path):
    with pytest.raises(TypeError, match="^prompts:"):
        llm.generate(3.5)
    with pytest.raises(ValueError, match="^prompts:"):
        llm.generate([])
    with pytest.raises(ValueError, match="^prompts:"):
        llm.generate([5000, 1])  # past the vocabulary
    with pytest.raises(ValueError, match="^max_tokens:"):
        llm.generate("Hi", SamplingParams(max_tokens=70000))
    with pytest.raises(TypeError, match="^sampling_params:"):
        llm.generate("Hi", {"temperature": 0})
    with pytest.raises(ValueError, match="^sampling_params:"):
        llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValueError, match="^messages:"):
        llm.chat([{"role": "wizard", "content": "Hi"}], GREEDY)
    with pytest.raises(TypeError, match="^messages:"):
        llm.chat("Hi")
    with pytest.raises(ValueError, match="^regex:"):
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(regex="a"))
    with pytest.raises(ValueError, match="^model:"):
        LLM(model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="^model:"):
        LLM(model=str(tmp_path))  # a directory without config.json
    with pytest.raises(ValueError, match="^device:"):
        LLM(device="tpu")
    with pytest.raises(TypeError, match="^max_running:"):
        LLM(max_running="8")
    with pytest.raises(ValueError, match="^n:"):
        list(llm.stream("Hi", SamplingParams(n=2)))


def test_ctrl_c_cancels_and_the_engine_keeps_serving():
    script = textwrap.dedent(
        """
        import faulthandler, os, signal, threading, time
        from deepinfer import LLM, SamplingParams
        # Ctrl-C as in an interactive Python: a process started with SIGINT ignored (some CI
        # launchers) would otherwise never see it. A hang dumps every thread's stack.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        faulthandler.dump_traceback_later(60, exit=True)
        llm = LLM()
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        t0 = time.time()
        try:
            llm.generate("The", SamplingParams(temperature=0, max_tokens=60000, ignore_eos=True))
            print("not interrupted")
        except KeyboardInterrupt:
            print(f"interrupted after {time.time() - t0:.2f}s")
        o = llm.generate("The sea is", SamplingParams(temperature=0, max_tokens=8))[0]
        print("after", len(o.outputs[0].token_ids))
        """
    )
    p = subprocess.run([sys.executable, "-u", "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (p.stdout, p.stderr)
    lines = p.stdout.split("\n")
    assert lines[0].startswith("interrupted after"), p.stdout
    assert float(lines[0].split()[2][:-1]) < 5.0
    assert lines[1].startswith("after ") and int(lines[1].split()[1]) >= 1


def test_closed_engine_fails_requests_clearly():
    m = LLM()
    stats = m.close()
    assert stats is not None and m.close() is None
    o = m.generate("Hi", GREEDY)[0].outputs[0]
    assert o.finish_reason == "error" and "closed" in o.error


def test_version_and_stubs_ship():
    assert deepinfer.__version__
    here = os.path.dirname(deepinfer.__file__)
    assert os.path.isfile(os.path.join(here, "_deepinfer.pyi")) and os.path.isfile(os.path.join(here, "py.typed"))
