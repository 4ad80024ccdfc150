"""DeepInfer-rs for Python: the Rust DeepSeek-V4 engine behind a vLLM-shaped offline API.

    from deepinfer import LLM, SamplingParams
    llm = LLM()  # the built-in tiny model on the CPU
    print(llm.generate("The sea", SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text)

`LLM.generate` takes text or token ids, `LLM.chat` takes OpenAI-style messages (with tools and
response_format, rendered by the official DeepSeek recipe), `LLM.stream` yields outputs as tokens
arrive, and `generate_async` / `chat_async` / `stream_async` are their asyncio forms. The engine
runs on its own threads with the GIL released; Ctrl-C cancels what a call waits for.
"""

from __future__ import annotations

import asyncio
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from ._deepinfer import Engine as _Engine
from ._deepinfer import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "__version__"]

PromptType = Union[str, Sequence[int]]

# The model name chat bodies carry: it selects the DeepSeek-V4 prompt encoding.
_CHAT_MODEL = "DeepSeek-V4-Pro"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (isinstance(x, (int, float))) and not isinstance(x, bool)


def _check(cond: bool, exc: type, param: str, problem: str) -> None:
    if not cond:
        raise exc(f"{param}: {problem}")


@dataclass
class SamplingParams:
    """How to sample, with vLLM's names and defaults.

    n: outputs per prompt (output i uses seed + i when a seed is given).
    max_tokens: most output tokens (16, as vLLM).
    temperature: 0 is greedy. top_p, top_k (0 or -1: off), min_p: the usual filters.
    presence_penalty, frequency_penalty (in [-2, 2]), repetition_penalty (1: off).
    seed: sampling is a function of (seed, position): the same seed gives the same output.
    stop: strings that end the output (not included); stop_token_ids: tokens that end it.
    ignore_eos: keep going past end-of-sentence (exactly max_tokens tokens).
    logprobs: alternatives reported per token (None: only the sampled token's logprob).
    json_schema (dict or JSON text) / regex: constrain the output (token masks).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: Union[None, str, List[str]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    json_schema: Union[None, str, Dict[str, Any]] = None
    regex: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("n", "max_tokens", "top_k"):
            _check(_is_int(getattr(self, name)), TypeError, name, f"must be an int, got {type(getattr(self, name)).__name__}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            _check(_is_number(v), TypeError, name, f"must be a number, got {type(v).__name__}")
        _check(self.top_k >= -1, ValueError, "top_k", f"{self.top_k} is not -1 (off) or a non-negative int")
        _check(self.n >= 1, ValueError, "n", f"{self.n} is not at least 1")
        _check(self.max_tokens >= 1, ValueError, "max_tokens", f"{self.max_tokens} is not at least 1")
        if self.seed is not None:
            _check(_is_int(self.seed), TypeError, "seed", f"must be an int or None, got {type(self.seed).__name__}")
            _check(0 <= self.seed < 2**64, ValueError, "seed", f"{self.seed} is not in [0, 2**64)")
        if self.stop is not None:
            ok = isinstance(self.stop, str) or (isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop))
            _check(ok, TypeError, "stop", "must be a str or a list of str")
        if self.stop_token_ids is not None:
            ok = isinstance(self.stop_token_ids, list) and all(_is_int(t) and 0 <= t < 2**32 for t in self.stop_token_ids)
            _check(ok, TypeError, "stop_token_ids", "must be a list of token ids (ints in [0, 2**32))")
        _check(isinstance(self.ignore_eos, bool), TypeError, "ignore_eos", "must be a bool")
        if self.logprobs is not None:
            _check(_is_int(self.logprobs), TypeError, "logprobs", "must be an int or None")
            _check(self.logprobs >= 0, ValueError, "logprobs", f"{self.logprobs} is negative")
        if self.json_schema is not None:
            _check(isinstance(self.json_schema, (str, dict)), TypeError, "json_schema", "must be a dict or JSON text")
        if self.regex is not None:
            _check(isinstance(self.regex, str), TypeError, "regex", "must be a str")

    def _fields(self) -> Dict[str, Any]:
        """Every field in the engine's types (range checks happen in the engine, naming the field)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        schema = self.json_schema if self.json_schema is None or isinstance(self.json_schema, str) else json.dumps(self.json_schema)
        return {
            "n": self.n,
            "max_tokens": self.max_tokens,
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": max(self.top_k, 0),
            "min_p": float(self.min_p),
            "presence_penalty": float(self.presence_penalty),
            "frequency_penalty": float(self.frequency_penalty),
            "repetition_penalty": float(self.repetition_penalty),
            "seed": self.seed,
            "stop": stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs or 0,
            "json_schema": schema,
            "regex": self.regex,
        }


@dataclass
class CompletionOutput:
    """One output of a request. For `chat`, `text` is the answer's content and the reasoning and
    tool calls are parsed out (OpenAI's shapes); `raw_text` is the output as generated."""

    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, float]]]
    finish_reason: Optional[str]
    raw_text: str = ""
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    seed: Optional[int] = None
    error: Optional[str] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Seconds from submission to the first token and to the end."""

    ttft_s: Optional[float]
    e2e_s: Optional[float]


@dataclass
class RequestOutput:
    """A prompt's outputs, as vLLM's RequestOutput."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None


def _completion(index: int, o: Dict[str, Any], want_logprobs: bool) -> CompletionOutput:
    logprobs = None
    if want_logprobs:
        logprobs = []
        for tok, lp, top in zip(o["token_ids"], o["logprobs"], o["top_logprobs"] or [[]] * len(o["token_ids"])):
            d = {int(t): float(p) for t, p in top}
            d[int(tok)] = float(lp)
            logprobs.append(d)
    chat = o.get("chat")
    text = o["text"]
    reasoning = tools = None
    finish = o["finish_reason"]
    if chat is not None:
        msg = chat["message"] or {}
        text = msg.get("content") or ""
        reasoning = msg.get("reasoning_content")
        tools = msg.get("tool_calls")
        if finish == "stop" and chat.get("finish_reason") == "tool_calls":
            finish = "tool_calls"
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=list(o["token_ids"]),
        cumulative_logprob=float(sum(o["logprobs"])) if o["logprobs"] else None,
        logprobs=logprobs,
        finish_reason=finish,
        raw_text=o["text"],
        reasoning_content=reasoning,
        tool_calls=tools,
        seed=o.get("seed"),
        error=o.get("error"),
    )


def _request_output(prompt: Optional[str], outs: List[Dict[str, Any]], want_logprobs: bool) -> RequestOutput:
    first = outs[0]
    return RequestOutput(
        request_id=first["request_id"],
        prompt=prompt,
        prompt_token_ids=list(first["prompt_token_ids"]),
        outputs=[_completion(i, o, want_logprobs) for i, o in enumerate(outs)],
        finished=True,
        num_cached_tokens=int(first["num_cached_tokens"]),
        metrics=RequestMetrics(ttft_s=first["ttft_s"], e2e_s=first["e2e_s"]),
    )


class LLM:
    """A model loaded into the engine.

    model: a Hugging Face-style checkpoint directory (config.json, safetensors, tokenizer.json);
        None: the built-in tiny DeepSeek-V4 model (trained, from the checkout the wheel was built in;
        random weights when that checkout is gone).
    device: "cpu" (the reference model), "cuda" or "cuda:N" (a wheel built with the cuda feature).
    max_running, max_context, token_budget: the engine's limits (requests at once, prompt + output
        tokens, tokens a step computes). kv_dir: keep KV blocks there too (prefix reuse across runs).
    speculative_tokens: MTP drafts per decode step (lossless; None: DEEPINFER_USE_NEXTN_DECODE).
    gpu_memory_utilization: fraction of the GPU the weights and cache may take.
    """

    def __init__(
        self,
        model: Optional[Union[str, os.PathLike]] = None,
        device: str = "cpu",
        *,
        max_running: int = 64,
        max_context: int = 65536,
        token_budget: int = 512,
        kv_dir: Optional[Union[str, os.PathLike]] = None,
        speculative_tokens: Optional[int] = None,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        if model is not None:
            _check(isinstance(model, (str, os.PathLike)), TypeError, "model", "must be a path or None")
            _check(os.path.isdir(model), ValueError, "model", f"{os.fspath(model)!r} is not a directory")
        _check(isinstance(device, str), TypeError, "device", "must be a str")
        for name, v in (("max_running", max_running), ("max_context", max_context), ("token_budget", token_budget)):
            _check(_is_int(v), TypeError, name, f"must be an int, got {type(v).__name__}")
            _check(v >= 1, ValueError, name, f"{v} is not at least 1")
        if speculative_tokens is not None:
            _check(_is_int(speculative_tokens), TypeError, "speculative_tokens", "must be an int or None")
            _check(speculative_tokens >= 0, ValueError, "speculative_tokens", f"{speculative_tokens} is negative")
        _check(_is_number(gpu_memory_utilization), TypeError, "gpu_memory_utilization", "must be a number")
        if kv_dir is not None:
            _check(isinstance(kv_dir, (str, os.PathLike)), TypeError, "kv_dir", "must be a path or None")
        self._engine = _Engine(
            None if model is None else os.fspath(model),
            device,
            token_budget,
            max_running,
            max_context,
            None if kv_dir is None else os.fspath(kv_dir),
            speculative_tokens,
            float(gpu_memory_utilization),
        )
        self.info: Dict[str, Any] = json.loads(self._engine.info())

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _params(sampling_params: Optional[SamplingParams]) -> SamplingParams:
        if sampling_params is None:
            return SamplingParams()
        _check(isinstance(sampling_params, SamplingParams), TypeError, "sampling_params", "must be a SamplingParams")
        return sampling_params

    @staticmethod
    def _prompts(prompts: Any) -> Tuple[List[PromptType], bool]:
        """The prompt list, and whether one prompt was given alone."""
        if isinstance(prompts, str):
            return [prompts], True
        if isinstance(prompts, dict):
            _check("prompt_token_ids" in prompts, TypeError, "prompts", "a dict prompt needs prompt_token_ids")
            return [list(prompts["prompt_token_ids"])], True
        _check(isinstance(prompts, (list, tuple)), TypeError, "prompts", "must be a str, a list of str or token-id lists")
        _check(len(prompts) > 0, ValueError, "prompts", "is empty")
        if all(_is_int(t) for t in prompts):
            return [list(prompts)], True
        out: List[PromptType] = []
        for p in prompts:
            if isinstance(p, dict) and "prompt_token_ids" in p:
                p = list(p["prompt_token_ids"])
            ok = isinstance(p, str) or (isinstance(p, (list, tuple)) and all(_is_int(t) for t in p))
            _check(ok, TypeError, "prompts", "each prompt must be a str or a list of token ids")
            out.append(p if isinstance(p, str) else list(p))
        return out, False

    def _per_prompt(self, sampling_params: Any, n: int) -> List[SamplingParams]:
        if isinstance(sampling_params, (list, tuple)):
            _check(len(sampling_params) == n, ValueError, "sampling_params", f"has {len(sampling_params)} entries for {n} prompts")
            return [self._params(s) for s in sampling_params]
        return [self._params(sampling_params)] * n

    def _collect(self, ids: List[int]) -> List[Dict[str, Any]]:
        return [json.loads(o) for o in self._engine.wait(ids)]

    def _submit(self, prompts: Any, sampling_params: Any) -> Tuple[List[Tuple[Optional[str], List[int], SamplingParams]], bool]:
        plist, single = self._prompts(prompts)
        params = self._per_prompt(sampling_params, len(plist))
        jobs = []
        try:
            for p, sp in zip(plist, params):
                jobs.append((p if isinstance(p, str) else None, self._engine.submit(p, sp._fields()), sp))
        except BaseException:
            self._engine.cancel([i for _, ids, _ in jobs for i in ids])
            raise
        return jobs, single

    # -- raw prompts -----------------------------------------------------------------------

    def generate(self, prompts: Any, sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None) -> List[RequestOutput]:
        """Generate for each prompt (a str, token ids, or a list of either); one RequestOutput per
        prompt, in order. All prompts run together in the engine's batches."""
        jobs, _ = self._submit(prompts, sampling_params)
        try:
            return [_request_output(p, self._collect(ids), sp.logprobs is not None) for p, ids, sp in jobs]
        except BaseException:
            self._engine.cancel([i for _, ids, _ in jobs for i in ids])
            raise

    def stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """Yield the output of one prompt as it grows (cumulative text and tokens, as vLLM's
        streaming outputs); the last has finished=True and the finish reason. Closing the
        iterator early cancels the request."""
        state = self._open_stream(prompt, sampling_params)
        try:
            while not state.done:
                out = state.event(self._engine.next_event(state.rid, 0.1))
                if out is not None:
                    yield out
        finally:
            if not state.done:
                self._engine.cancel([state.rid])

    def _open_stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams]) -> "_StreamState":
        sp = self._params(sampling_params)
        _check(sp.n == 1, ValueError, "n", "stream generates one output (n=1)")
        plist, single = self._prompts(prompt)
        _check(single, TypeError, "prompt", "stream takes one prompt")
        [rid] = self._engine.submit(plist[0], sp._fields())
        return _StreamState(plist[0] if isinstance(plist[0], str) else None, sp.logprobs is not None, rid)

    # -- chat ------------------------------------------------------------------------------

    def _chat_body(
        self,
        messages: List[Dict[str, Any]],
        sp: SamplingParams,
        tools: Optional[List[Dict[str, Any]]],
        tool_choice: Any,
        response_format: Optional[Dict[str, Any]],
        thinking: Optional[bool],
    ) -> Dict[str, Any]:
        _check(isinstance(messages, list) and all(isinstance(m, dict) for m in messages), TypeError, "messages", "must be a list of message dicts")
        _check(tools is None or isinstance(tools, list), TypeError, "tools", "must be a list of tool dicts or None")
        _check(response_format is None or isinstance(response_format, dict), TypeError, "response_format", "must be a dict or None")
        _check(thinking is None or isinstance(thinking, bool), TypeError, "thinking", "must be a bool or None")
        _check(sp.regex is None, ValueError, "regex", "chat takes response_format (or json_schema), not regex")
        _check(not sp.ignore_eos, ValueError, "ignore_eos", "is for raw prompts (generate), not chat")
        _check(not sp.stop_token_ids, ValueError, "stop_token_ids", "is for raw prompts (generate), not chat")
        body: Dict[str, Any] = {
            "model": _CHAT_MODEL,
            "messages": messages,
            "max_tokens": sp.max_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "min_p": sp.min_p,
            "presence_penalty": sp.presence_penalty,
            "frequency_penalty": sp.frequency_penalty,
            "repetition_penalty": sp.repetition_penalty,
        }
        if sp.seed is not None:
            body["seed"] = sp.seed
        if sp.stop:
            body["stop"] = sp.stop
        if sp.logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = sp.logprobs
        if tools is not None:
            body["tools"] = tools
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
        if response_format is None and sp.json_schema is not None:
            schema = json.loads(sp.json_schema) if isinstance(sp.json_schema, str) else sp.json_schema
            response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        if response_format is not None:
            body["response_format"] = response_format
        if thinking is not None:
            body["thinking"] = {"type": "enabled" if thinking else "disabled"}
        return body

    def _submit_chat(self, messages: Any, sampling_params: Any, tools: Any, tool_choice: Any, response_format: Any, thinking: Any):
        batch = isinstance(messages, list) and len(messages) > 0 and all(isinstance(m, list) for m in messages)
        convs = messages if batch else [messages]
        params = self._per_prompt(sampling_params, len(convs))
        jobs = []
        try:
            for conv, sp in zip(convs, params):
                body = self._chat_body(conv, sp, tools, tool_choice, response_format, thinking)
                ids, overridden = self._engine.submit_chat(json.dumps(body), sp.n)
                for fld, asked, used in overridden:
                    warnings.warn(
                        f"{fld} {asked} overridden to {used} by the model's thinking mode (pass thinking=False to keep it)",
                        stacklevel=3,
                    )
                jobs.append((ids, sp))
        except BaseException:
            self._engine.cancel([i for ids, _ in jobs for i in ids])
            raise
        return jobs

    def chat(
        self,
        messages: Union[List[Dict[str, Any]], List[List[Dict[str, Any]]]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        *,
        tools: Optional[List[Dict[str, Any]]] = None,
        tool_choice: Any = None,
        response_format: Optional[Dict[str, Any]] = None,
        thinking: Optional[bool] = None,
    ) -> List[RequestOutput]:
        """Answer a conversation (OpenAI-style messages), or a list of conversations. Rendered in
        the DeepSeek-V4 format by the official recipe; `tools` (OpenAI function tools) come back as
        `tool_calls`, `response_format` (json_object / json_schema) constrains the answer. thinking:
        None for the model's default (on: temperature and top_p follow its policy), False or True."""
        jobs = self._submit_chat(messages, sampling_params, tools, tool_choice, response_format, thinking)
        try:
            return [_request_output(None, self._collect(ids), sp.logprobs is not None) for ids, sp in jobs]
        except BaseException:
            self._engine.cancel([i for ids, _ in jobs for i in ids])
            raise

    # -- asyncio ---------------------------------------------------------------------------

    async def _gather(self, jobs: List[Tuple[Optional[str], List[int], SamplingParams]]) -> List[RequestOutput]:
        ids = [i for _, rids, _ in jobs for i in rids]
        try:
            outs = await asyncio.to_thread(self._engine.wait, ids)
        except BaseException:
            self._engine.cancel(ids)
            raise
        parsed = [json.loads(o) for o in outs]
        results, at = [], 0
        for p, rids, sp in jobs:
            results.append(_request_output(p, parsed[at : at + len(rids)], sp.logprobs is not None))
            at += len(rids)
        return results

    async def generate_async(self, prompts: Any, sampling_params: Any = None) -> List[RequestOutput]:
        """`generate` for asyncio: the wait runs in a worker thread; cancelling the task cancels
        the requests."""
        jobs, _ = self._submit(prompts, sampling_params)
        return await self._gather(jobs)

    async def chat_async(self, messages: Any, sampling_params: Any = None, **kwargs: Any) -> List[RequestOutput]:
        """`chat` for asyncio (same arguments)."""
        jobs = self._submit_chat(
            messages, sampling_params, kwargs.pop("tools", None), kwargs.pop("tool_choice", None),
            kwargs.pop("response_format", None), kwargs.pop("thinking", None),
        )
        _check(not kwargs, TypeError, next(iter(kwargs), ""), "is not a chat argument")
        return await self._gather([(None, ids, sp) for ids, sp in jobs])

    async def stream_async(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None) -> AsyncIterator[RequestOutput]:
        """`stream` for asyncio."""
        state = self._open_stream(prompt, sampling_params)
        try:
            while not state.done:
                out = state.event(await asyncio.to_thread(self._engine.next_event, state.rid, 0.1))
                if out is not None:
                    yield out
        finally:
            if not state.done:
                self._engine.cancel([state.rid])

    # -- the rest --------------------------------------------------------------------------

    def encode(self, text: str) -> List[int]:
        """Token ids of `text` as plain text."""
        _check(isinstance(text, str), TypeError, "text", "must be a str")
        return self._engine.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids."""
        return self._engine.decode(list(token_ids))

    def close(self) -> Optional[Dict[str, Any]]:
        """Finish what was submitted and stop the engine; its counters (None if already closed)."""
        s = self._engine.close()
        return None if s is None else json.loads(s)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class _StreamState:
    prompt: Optional[str]
    want_logprobs: bool
    rid: int
    text: str = ""
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[Dict[int, float]] = field(default_factory=list)
    prompt_token_ids: List[int] = field(default_factory=list)
    cached: int = 0
    done: bool = False

    def event(self, raw: Optional[str]) -> Optional[RequestOutput]:
        """The output after one event (JSON text from next_event; None: nothing came), if any."""
        if raw is None:
            return None
        ev = json.loads(raw)
        kind = ev["kind"]
        if kind == "admitted":
            self.cached = ev["cached_tokens"]
            self.prompt_token_ids = list(ev["prompt_token_ids"])
            return None
        if kind == "token":
            self.text += ev["text"]
            self.token_ids.append(ev["token_id"])
            if self.want_logprobs:
                d = {int(t): float(p) for t, p in ev["top_logprobs"]}
                d[int(ev["token_id"])] = float(ev["logprob"])
                self.logprobs.append(d)
            out = CompletionOutput(0, self.text, list(self.token_ids), None,
                                   list(self.logprobs) if self.want_logprobs else None, None, raw_text=self.text)
            return RequestOutput(str(self.rid), self.prompt, self.prompt_token_ids, [out], False, self.cached)
        self.done = True
        return _request_output(self.prompt, [ev["output"]], self.want_logprobs)
