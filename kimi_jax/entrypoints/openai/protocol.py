"""OpenAI completions / chat-completions bodies: parsing into engine requests and building responses.

Independent of HTTP (the server, kimi-batch and tool calling use it). `parse_completion` and
`parse_chat` turn a request body (a dict from JSON) into a `GenerationRequest`: the prompt(s) or the
messages, the engine's SamplingParams (OpenAI names mapped onto vLLM's) and the response options.
Anything wrong raises ProtocolError naming the field (`param`), which the server returns as a 400 with
OpenAI's error body (`error_body`). Unknown fields are rejected, as OpenAI does.

Sampling fields: temperature, top_p, max_tokens (chat: max_completion_tokens too), stop, seed, n,
logprobs / top_logprobs, and vLLM's top_k, min_p, stop_token_ids, ignore_eos,
include_stop_str_in_output. presence_penalty, frequency_penalty, repetition_penalty, logit_bias
and min_tokens are passed on under vLLM's names when SamplingParams has those fields; otherwise a
value other than the no-op default is rejected. n is served as n independent requests (`Choice`
index i * n + j for prompt i).

Responses: `completion_response` / `chat_response` and the streaming chunks take `Choice`s; a Choice
carries `tool_calls` and `reasoning_content` for a chat message (set by a tool-call / reasoning parser;
None leaves them out).
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Callable, Optional, Sequence, Union

from kimi_jax.engine.sampling import SamplingParams

MAX_LOGPROBS = 20
MAX_N = 64

# OpenAI / vLLM field -> SamplingParams field, with the value that changes nothing
OPTIONAL_SAMPLING = {"presence_penalty": ("presence_penalty", 0.0),
                     "frequency_penalty": ("frequency_penalty", 0.0),
                     "repetition_penalty": ("repetition_penalty", 1.0),
                     "logit_bias": ("logit_bias", None),
                     "min_tokens": ("min_tokens", 0)}
_COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "max_tokens", "stop", "seed", "n",
           "user", "top_k", "min_p", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
           "skip_special_tokens", *OPTIONAL_SAMPLING}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                         "parallel_tool_calls", "response_format", "metadata", "store", "service_tier",
                         "add_generation_prompt", "modalities"}


class ProtocolError(ValueError):
    """A request the server refuses: HTTP status, OpenAI error type, the field at fault and a code."""

    def __init__(self, message: str, param: Optional[str] = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    kind: str                                  # "completion" | "chat"
    model: Optional[str]
    params: SamplingParams
    prompts: tuple = ()                        # completion: each a str or a tuple of token ids
    messages: Optional[list] = None            # chat: the conversation as given
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None             # top logprobs per token (0: only the chosen token's)
    add_generation_prompt: bool = True
    tools: Optional[list] = None               # chat: passed to the chat template; calls parsed from the reply


# ---- field checks ---------------------------------------------------------------------------------
def _typename(v) -> str:
    return "null" if v is None else type(v).__name__


def _number(body: dict, name: str, default, *, integer: bool = False, lo=None, hi=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
        raise ProtocolError(f"'{name}' must be {'an integer' if integer else 'a number'}, got {v!r}", name)
    v = int(v) if integer else float(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ProtocolError(f"'{name}' must be in [{lo}, {hi}], got {v}" if hi is not None
                            else f"'{name}' must be >= {lo}, got {v}", name)
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ProtocolError(f"'{name}' must be a boolean, got {v!r}", name)
    return v


def _token_ids(v, name: str) -> tuple:
    if not v or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise ProtocolError(f"'{name}' must be a non-empty list of token ids (integers)", name)
    return tuple(v)


def _stop(body: dict):
    v = body.get("stop")
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ProtocolError(f"'stop' must be a non-empty string or a list of them, got {v!r}", "stop")
    return list(stops) or None


def _check_fields(body: Any, allowed: set) -> None:
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {_typename(body)}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ProtocolError(f"unrecognized request argument: '{unknown[0]}'", unknown[0])


def _unsupported(body: dict, name: str, ok: Callable[[Any], bool], what: str) -> None:
    if name in body and body[name] is not None and not ok(body[name]):
        raise ProtocolError(f"'{name}'={body[name]!r} is not supported ({what})", name)


def _sampling(body: dict, *, max_tokens, logprobs: Optional[int]) -> SamplingParams:
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        stop_ids = list(_token_ids(stop_ids, "stop_token_ids"))
    seed = _number(body, "seed", None, integer=True, lo=-2**63, hi=2**63 - 1)
    kw = dict(temperature=_number(body, "temperature", 1.0, lo=0.0),
              top_p=_number(body, "top_p", 1.0), top_k=_number(body, "top_k", -1, integer=True),
              min_p=_number(body, "min_p", 0.0), max_tokens=max_tokens, stop=_stop(body),
              stop_token_ids=stop_ids, ignore_eos=_bool(body, "ignore_eos", False), seed=seed,
              logprobs=logprobs,
              include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False))
    if body.get("top_k") is not None and kw["top_k"] == 0:    # vLLM: 0 also means off
        kw["top_k"] = -1
    for name, (field, noop) in OPTIONAL_SAMPLING.items():
        if body.get(name) is None:
            continue
        value = body[name]
        if name == "logit_bias":
            value = _logit_bias(value)
        else:
            value = _number(body, name, noop, integer=name == "min_tokens")
        if field in fields:
            kw[field] = value
        elif value != noop and value:
            raise ProtocolError(f"'{name}' is not supported by this engine", name)
    params = SamplingParams(**kw)
    try:
        params.validate()
    except ValueError as e:                  # SamplingParams names the field first
        msg = str(e)
        field = msg.split()[0] if msg else None
        raise ProtocolError(msg, field if field in body or field in fields else None) from None
    return params


def _logit_bias(v) -> Optional[dict]:
    if not isinstance(v, dict):
        raise ProtocolError("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    out = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise ProtocolError(f"'logit_bias' key {k!r} is not a token id", "logit_bias") from None
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise ProtocolError(f"'logit_bias' value for {k!r} must be a number in [-100, 100]", "logit_bias")
        out[tid] = float(b)
    return out or None


def _common(body: dict) -> dict:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError(f"'model' must be a string, got {model!r}", "model")
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise ProtocolError("'stream_options' is only allowed with stream=true", "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise ProtocolError(f"'stream_options' must be an object with 'include_usage', got {opts!r}",
                                "stream_options")
        include_usage = _bool(opts, "include_usage", False)
    _unsupported(body, "skip_special_tokens", lambda v: v is True, "special tokens are always skipped")
    n = _number(body, "n", 1, integer=True, lo=1, hi=MAX_N)
    return dict(model=model, stream=stream, include_usage=include_usage, n=n)


# ---- requests -------------------------------------------------------------------------------------
def parse_completion(body: Any) -> GenerationRequest:
    """A /v1/completions body -> GenerationRequest (ProtocolError naming the field)."""
    _check_fields(body, COMPLETION_FIELDS)
    common = _common(body)
    if "prompt" not in body:
        raise ProtocolError("'prompt' is required", "prompt")
    p = body["prompt"]
    if isinstance(p, str):
        prompts = (p,)
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        prompts = (tuple(p),)
    elif isinstance(p, list) and p and all(isinstance(s, str) for s in p):
        prompts = tuple(p)
    elif isinstance(p, list) and p and all(isinstance(s, list) for s in p):
        prompts = tuple(_token_ids(s, "prompt") for s in p)
    else:
        raise ProtocolError("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                            "such lists (non-empty)", "prompt")
    if any(isinstance(s, str) and not s for s in prompts):
        raise ProtocolError("'prompt' is empty", "prompt")
    _unsupported(body, "echo", lambda v: v is False, "prompts are not echoed")
    _unsupported(body, "suffix", lambda v: False, "no insertion")
    _unsupported(body, "best_of", lambda v: v == common["n"], "best_of must equal n")
    logprobs = _number(body, "logprobs", None, integer=True, lo=0, hi=MAX_LOGPROBS)
    max_tokens = _number(body, "max_tokens", 16, integer=True, lo=1)
    params = _sampling(body, max_tokens=max_tokens, logprobs=logprobs)
    return GenerationRequest("completion", params=params, prompts=prompts, logprobs=logprobs, **common)


def parse_chat(body: Any) -> GenerationRequest:
    """A /v1/chat/completions body -> GenerationRequest (ProtocolError naming the field). The messages
    are checked by the chat template when rendered."""
    _check_fields(body, CHAT_FIELDS)
    common = _common(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ProtocolError("'messages' must be a non-empty list", "messages")
    want = _bool(body, "logprobs", False)
    top = _number(body, "top_logprobs", None, integer=True, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want:
        raise ProtocolError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (top or 0) if want else None
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, None, integer=True, lo=1)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ProtocolError("'tools' must be a list", "tools")
    _unsupported(body, "modalities", lambda v: v == ["text"], "text only")
    params = _sampling(body, max_tokens=max_tokens, logprobs=logprobs)
    # tools / tool_choice / response_format constrain the output (kimi_jax.engine.structured)
    from kimi_jax.engine.structured import StructuredOutputError, from_openai
    try:
        constraint = from_openai(body.get("response_format"), tools, body.get("tool_choice"))
    except StructuredOutputError as e:
        msg = str(e)
        field = next((f for f in ("response_format", "tool_choice", "tools") if msg.startswith(f)), "tools")
        raise ProtocolError(msg, field) from None
    if constraint is not None:
        params = dataclasses.replace(params, structured_outputs=constraint)
    return GenerationRequest("chat", params=params, messages=msgs, logprobs=logprobs,
                             add_generation_prompt=_bool(body, "add_generation_prompt", True),
                             tools=tools or None, **common)


def check_context(n_prompt: int, max_tokens: Optional[int], limit: int, kind: str) -> None:
    """A prompt of n_prompt tokens and max_tokens within the model's context (ProtocolError, 400)."""
    field = "messages" if kind == "chat" else "prompt"
    if n_prompt >= limit:
        raise ProtocolError(f"this model's maximum context length is {limit} tokens; the prompt has "
                            f"{n_prompt} tokens", field, code="context_length_exceeded")
    if max_tokens is not None and n_prompt + max_tokens > limit:
        raise ProtocolError(f"this model's maximum context length is {limit} tokens; the prompt "
                            f"({n_prompt} tokens) plus max_tokens ({max_tokens}) exceeds it",
                            "max_completion_tokens" if kind == "chat" else "max_tokens",
                            code="context_length_exceeded")


def choice_seed(seed: Optional[int], j: int) -> Optional[int]:
    """The seed of choice j of n (j = 0: the request's own seed)."""
    return (seed * 1_000_003 + j) % 2**63 if seed is not None and j else seed


def check_model(req_model: Optional[str], served: Sequence[str]) -> None:
    if req_model is not None and req_model not in served:
        raise ProtocolError(f"The model '{req_model}' does not exist (served: {', '.join(served)})", "model",
                            status=404, code="model_not_found")


# ---- responses ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Choice:
    """One generated sequence (or, streaming, one piece of it)."""
    index: int
    text: str
    token_ids: list
    finish_reason: Optional[str] = None        # "stop" | "length" | "tool_calls" | None (more to come)
    stop_reason: Union[int, str, None] = None
    logprobs: Optional[list] = None            # per token: {token id: logprob (float or .logprob)}
    tool_calls: Optional[list] = None          # chat: [{"id", "type": "function", "function": {...}}]
    reasoning_content: Optional[str] = None    # chat: the reasoning part of the reply


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _lp(v) -> float:
    return float(getattr(v, "logprob", v))


def _top(entry: dict, k: int) -> list:
    return sorted(((int(t), _lp(v)) for t, v in entry.items()), key=lambda x: -x[1])[:k]


def _token(tokenizer, t: int) -> str:
    """A token's text; without a tokenizer vLLM's "token_id:N" spelling."""
    return tokenizer.decode([t]) if tokenizer is not None else f"token_id:{t}"


def completion_logprobs(c: Choice, tokenizer, k: int, offset: int = 0) -> dict:
    """OpenAI's completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(c.token_ids, c.logprobs or []):
        s = _token(tokenizer, tid)
        offsets.append(offset)
        offset += len(s)
        tokens.append(s)
        lps.append(_lp(entry[tid]) if tid in entry else None)
        tops.append({_token(tokenizer, t): v for t, v in _top(entry, k)} if k else None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(c: Choice, tokenizer, k: int) -> dict:
    """OpenAI's chat logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def item(t, v):
        return {"token": _token(tokenizer, t), "logprob": v,
                "bytes": list(tokenizer.token_bytes(t)) if tokenizer is not None else None}
    content = []
    for tid, entry in zip(c.token_ids, c.logprobs or []):
        d = item(tid, _lp(entry[tid]) if tid in entry else None)
        d["top_logprobs"] = [item(t, v) for t, v in _top(entry, k)]
        content.append(d)
    return {"content": content}


def _completion_choice(c: Choice, tokenizer, k, offset=0) -> dict:
    return {"index": c.index, "text": c.text,
            "logprobs": completion_logprobs(c, tokenizer, k, offset) if c.logprobs is not None else None,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def _message(c: Choice, delta: bool, first: bool = False) -> dict:
    m = {"role": "assistant"} if (first or not delta) else {}
    if c.text or not delta or first:
        m["content"] = c.text if (c.text or not c.tool_calls) else None
    if c.tool_calls is not None:
        m["tool_calls"] = c.tool_calls
    if c.reasoning_content is not None:
        m["reasoning_content"] = c.reasoning_content
    return m


def completion_response(rid: str, created: int, model: str, choices: list, usage_: dict, tokenizer=None,
                        k: Optional[int] = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [_completion_choice(c, tokenizer, k) for c in choices], "usage": usage_}


def with_tool_calls(c: Choice, tokenizer) -> Choice:
    """A finished chat choice of a request with tools: Kimi's tool-call section of its tokens parsed into
    `tool_calls`, the text before it as the content, finish_reason "tool_calls" when it made calls."""
    from kimi_jax.text.tool_parser import parse_output, tool_finish_reason
    parsed = parse_output(c.token_ids, tokenizer)
    c.text, c.tool_calls = parsed.content, parsed.tool_calls or None
    c.finish_reason = tool_finish_reason(c.finish_reason, bool(parsed.tool_calls))
    return c


def chat_response(rid: str, created: int, model: str, choices: list, usage_: dict, tokenizer=None,
                  k: Optional[int] = None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c.index, "message": _message(c, delta=False),
                         "logprobs": chat_logprobs(c, tokenizer, k) if c.logprobs is not None else None,
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in choices],
            "usage": usage_}


def completion_chunk(rid: str, created: int, model: str, c: Choice, tokenizer=None, k=None, offset: int = 0,
                     with_usage: bool = False) -> dict:
    d = {"id": rid, "object": "text_completion", "created": created, "model": model,
         "choices": [_completion_choice(c, tokenizer, k, offset)]}
    if with_usage:
        d["usage"] = None
    return d


def chat_chunk(rid: str, created: int, model: str, c: Choice, tokenizer=None, k=None, first: bool = False,
               with_usage: bool = False) -> dict:
    d = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
         "choices": [{"index": c.index, "delta": _message(c, delta=True, first=first),
                      "logprobs": chat_logprobs(c, tokenizer, k) if c.logprobs is not None else None,
                      "finish_reason": c.finish_reason}]}
    if c.finish_reason is not None:
        d["choices"][0]["stop_reason"] = c.stop_reason
    if with_usage:
        d["usage"] = None
    return d


def usage_chunk(rid: str, created: int, model: str, kind: str, usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage_}


def now() -> int:
    return int(time.time())


# ---- streaming text -------------------------------------------------------------------------------
class TextStream:
    """A choice's text as its tokens arrive: the streaming detokenizer's output, minus a tail that could
    still begin a stop string (held until it cannot). `finish(final)` returns what completes the final
    text (the engine's, stop string cut off), so the deltas always add up to the non-streamed text."""

    def __init__(self, tokenizer, stop_strings: Sequence[str]):
        self._dec = tokenizer.incremental_decoder(skip_special_tokens=True)
        self._hold = max((len(s) for s in stop_strings), default=1) - 1
        self.text, self.sent = "", 0

    def feed(self, token_ids) -> str:
        self.text += self._dec.feed_many(token_ids)
        upto = max(self.sent, len(self.text) - self._hold)
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def finish(self, final: str) -> str:
        out = final[self.sent:]
        self.sent = len(final)
        return out
