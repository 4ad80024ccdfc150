"""The official `openai` and `anthropic` Python clients against a running `deepinfer serve`.

Run by crates/server/tests/serve_clients.rs, which starts the server (built-in model, CPU) with
`--api-key test-key --max-queued 2 --max-running 2 --max-body-bytes 1000000 --default-thinking off`
and passes its URL in DEEPINFER_URL. Clients never retry (max_retries=0), so each status reaches
the test as the client's typed exception.
"""

import json
import os
import threading

import anthropic
import openai
import pytest

URL = os.environ["DEEPINFER_URL"]
MODEL = os.environ.get("DEEPINFER_MODEL", "deepinfer-tiny-v4")
KEY = "test-key"


@pytest.fixture(scope="module")
def oa():
    return openai.OpenAI(base_url=URL + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def an():
    return anthropic.Anthropic(base_url=URL, api_key=KEY, max_retries=0, timeout=120)


def user(text):
    return [{"role": "user", "content": text}]


# ---- Chat Completions


def test_chat_non_streaming(oa):
    r = oa.chat.completions.create(model=MODEL, messages=user("What is SQLite?"), max_tokens=12)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 12
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streaming_with_usage(oa):
    chunks = list(oa.chat.completions.create(model=MODEL, messages=user("Tell me about Python."), max_tokens=10,
                                             temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    full = oa.chat.completions.create(model=MODEL, messages=user("Tell me about Python."), max_tokens=10,
                                      temperature=0)
    assert full.choices[0].message.content == text, "streamed and whole greedy answers agree"


def test_chat_system_and_developer_roles(oa):
    for role in ("system", "developer"):
        r = oa.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                       messages=[{"role": role, "content": "Be brief."}] + user("Hi"))
        assert r.choices[0].message.content is not None


def test_chat_logprobs(oa):
    r = oa.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=5, temperature=0, logprobs=True,
                                   top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert lp and all(t.logprob <= 0 for t in lp)
    assert all(len(t.top_logprobs) == 3 for t in lp)
    # Greedy: the chosen token is the most likely one.
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-4 for t in lp)


def test_chat_n_choices(oa):
    r = oa.chat.completions.create(model=MODEL, messages=user("Write a word."), max_tokens=6, temperature=1.0,
                                   n=3, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(1 for _ in r.choices) * 6 or r.usage.completion_tokens > 0
    s = list(oa.chat.completions.create(model=MODEL, messages=user("Write a word."), max_tokens=6,
                                        temperature=1.0, n=2, seed=7, stream=True))
    assert {c.choices[0].index for c in s if c.choices} == {0, 1}


def test_seeded_requests_reproduce(oa):
    kw = dict(model=MODEL, messages=user("Once upon a time"), max_tokens=16, temperature=1.0, seed=1234)
    a = oa.chat.completions.create(**kw).choices[0].message.content
    b = oa.chat.completions.create(**kw).choices[0].message.content
    c = oa.chat.completions.create(**{**kw, "seed": 99}).choices[0].message.content
    assert a == b
    assert a != c or len(a) < 4


def test_json_schema_output_validates(oa):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = oa.chat.completions.create(model=MODEL, messages=user("Give a person as JSON."), max_tokens=60,
                                   temperature=0,
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"name": "person", "schema": schema}})
    v = json.loads(r.choices[0].message.content)
    assert set(v) == {"name", "age"} and isinstance(v["name"], str) and isinstance(v["age"], int)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"]}}}]


def test_tool_call_and_result_round_trip(oa):
    r = oa.chat.completions.create(model=MODEL, messages=user("Weather in Paris?"), max_tokens=80, temperature=0,
                                   tools=TOOLS, tool_choice={"type": "function",
                                                             "function": {"name": "get_weather"}})
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather", r
    args = json.loads(calls[0].function.arguments)
    assert isinstance(args.get("city"), str)
    assert r.choices[0].finish_reason == "tool_calls"
    follow = [*user("Weather in Paris?"),
              {"role": "assistant", "content": None,
               "tool_calls": [{"id": calls[0].id, "type": "function",
                               "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
              {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 C"}]
    r2 = oa.chat.completions.create(model=MODEL, messages=follow, max_tokens=8, temperature=0, tools=TOOLS)
    assert r2.choices[0].message is not None


def test_tool_choice_none_and_required(oa):
    r = oa.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=6, temperature=0, tools=TOOLS,
                                   tool_choice="none")
    assert not r.choices[0].message.tool_calls
    r = oa.chat.completions.create(model=MODEL, messages=user("Weather?"), max_tokens=80, temperature=0,
                                   tools=TOOLS, tool_choice="required")
    assert r.choices[0].message.tool_calls


# ---- Completions and Responses


def test_completions(oa):
    r = oa.completions.create(model=MODEL, prompt="The history of", max_tokens=8, temperature=0)
    assert r.choices[0].text and r.choices[0].finish_reason == "length"
    s = list(oa.completions.create(model=MODEL, prompt="The history of", max_tokens=8, temperature=0,
                                   stream=True))
    assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text


def test_responses(oa):
    r = oa.responses.create(model=MODEL, input="What is Go?", max_output_tokens=10, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text
    events = list(oa.responses.create(model=MODEL, input="What is Go?", max_output_tokens=10, temperature=0,
                                      stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed",
                                                                         "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text


# ---- Anthropic Messages


def test_messages(an):
    m = an.messages.create(model=MODEL, max_tokens=10, messages=user("Hi"), system="Be brief.")
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens > 0 and m.usage.cache_read_input_tokens == 0


def test_messages_streaming(an):
    kinds = []
    text = ""
    # Greedy on both sides (`temperature` as a raw field: anthropic 2.x no longer sends the kwarg).
    greedy = {"temperature": 0}
    with an.messages.stream(model=MODEL, max_tokens=10, messages=user("Hi"), extra_body=greedy) as s:
        for e in s:
            kinds.append(e.type)
            if e.type == "content_block_delta" and e.delta.type == "text_delta":
                text += e.delta.text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    whole = an.messages.create(model=MODEL, max_tokens=10, messages=user("Hi"), extra_body=greedy)
    assert whole.content[0].text == text


def test_messages_tool_use_and_result(an):
    tools = [{"name": "get_weather", "description": "Weather in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                               "required": ["city"]}}]
    m = an.messages.create(model=MODEL, max_tokens=80, messages=user("Weather in Oslo?"), tools=tools,
                           tool_choice={"type": "tool", "name": "get_weather"})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input.get("city"), str)
    assert m.stop_reason == "tool_use"
    m2 = an.messages.create(model=MODEL, max_tokens=8, tools=tools, extra_body={"temperature": 0}, messages=[
        *user("Weather in Oslo?"),
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather",
                                           "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "snow"}]}])
    assert m2.type == "message"


def test_count_tokens(an):
    short = an.messages.count_tokens(model=MODEL, messages=user("Hi"))
    long = an.messages.count_tokens(model=MODEL, messages=user("Hi " * 50))
    assert 0 < short.input_tokens < long.input_tokens


def test_thinking_blocks(an):
    m = an.messages.create(model=MODEL, max_tokens=30, messages=user("Hi"),
                           thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.content and m.content[0].type in ("thinking", "text")


# ---- Errors as typed exceptions


def test_wrong_key_is_401():
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=URL + "/v1", api_key="nope", max_retries=0).chat.completions.create(
            model=MODEL, messages=user("Hi"), max_tokens=2)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=URL, api_key="nope", max_retries=0).messages.create(
            model=MODEL, messages=user("Hi"), max_tokens=2)


def test_unknown_model_is_404(oa, an):
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-9", messages=user("Hi"), max_tokens=2)
    with pytest.raises(anthropic.NotFoundError):
        an.messages.create(model="claude-9", messages=user("Hi"), max_tokens=2)


def test_bad_request_is_400_naming_the_field(oa, an):
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=2, n=99)
    assert "n" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=2, extra_body={"top_k": "many"})
    assert "top_k" in str(e.value)
    with pytest.raises(anthropic.BadRequestError):
        an.messages.create(model=MODEL, messages=[], max_tokens=2)


def test_big_body_is_413(oa):
    with pytest.raises(openai.APIStatusError) as e:
        oa.chat.completions.create(model=MODEL, messages=user("x" * 2_000_000), max_tokens=2)
    assert e.value.status_code == 413


def test_past_max_queued_is_429(oa):
    errors, done = [], []

    def one():
        try:
            oa.chat.completions.create(model=MODEL, messages=user("Tell me a long story."), max_tokens=120,
                                       temperature=0)
            done.append(1)
        except openai.RateLimitError as e:
            errors.append(e)

    ts = [threading.Thread(target=one) for _ in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert errors, "8 concurrent requests against --max-running 2 --max-queued 2"
    assert done, "some were served"
    assert errors[0].response.headers.get("retry-after") == "1"
    # And the server keeps serving.
    assert oa.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=2).choices


def test_models_and_health(oa):
    assert [m.id for m in oa.models.list().data] == [MODEL]
    import urllib.request
    assert urllib.request.urlopen(URL + "/health").status == 200
    text = urllib.request.urlopen(URL + "/metrics").read().decode()
    assert "vllm:time_to_first_token_seconds_count" in text and "vllm:generation_tokens_total" in text
