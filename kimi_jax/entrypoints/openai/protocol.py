"""OpenAI completions / chat-completions bodies: parsing into engine requests and building
responses.

Independent of HTTP (the server, kimi-batch and tool calling use it). Bodies are pydantic models
with strict types (`CompletionRequest`, `ChatCompletionRequest`); `parse_completion` / `parse_chat`
make a `GenerationRequest` whose SamplingParams apply their own ranges. A bad field raises
ProtocolError naming its path (`param`), answered as a 400 with OpenAI's error body. Unused fields
are accepted and listed in one warning per request, as vLLM does, except `REFUSED` ones (ignoring
them would change the answer). vLLM's extensions (top_k, min_p, ..., ``structured_outputs`` and the
older guided_*) work on both endpoints; n is served as n requests (`Choice` index i * n + j for
prompt i). Over 600 lines: the request models, their checks and the response bodies are one API's
two directions.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
import uuid
from typing import Annotated, Any, Optional, Sequence, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from kimi_jax.engine.sampling import SamplingParams
from kimi_jax.engine.structured_openai import from_openai
from kimi_jax.engine.structured_params import StructuredOutputError, StructuredOutputsParams
from kimi_jax.entrypoints.openai import intake

log = logging.getLogger(__name__)
MAX_LOGPROBS = 20
MAX_N = 64
MAX_MESSAGE = 1000
MAX_STOP, MAX_STOP_CHARS = 64, 1024       # stop strings of a request, characters of each
_TOKEN_ID = re.compile(r"0|[1-9][0-9]*")

OPTIONAL_SAMPLING = {"presence_penalty": ("presence_penalty", 0.0),
                     "frequency_penalty": ("frequency_penalty", 0.0),
                     "repetition_penalty": ("repetition_penalty", 1.0),
                     "logit_bias": ("logit_bias", None),
                     "min_tokens": ("min_tokens", 0)}
_REFUSED_VLLM = {
    "use_beam_search",
    "length_penalty",
    "truncate_prompt_tokens",
    "allowed_token_ids",
    "prompt_logprobs",
    "logits_processors",
    "return_tokens_as_token_ids",
    "echo",
    "suffix",
}
REFUSED = {
    "completion": _REFUSED_VLLM | {"messages", "top_logprobs"},
    "chat": _REFUSED_VLLM
    | {
        "prompt",
        "functions",
        "function_call",
        "audio",
        "web_search_options",
        "chat_template",
        "chat_template_kwargs",
        "continue_final_message",
        "documents",
    },
}


class ProtocolError(ValueError):
    """A request the server refuses: HTTP status, OpenAI error type, field at fault and a code."""

    def __init__(self, message: str, param: Optional[str] = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None):
        message = intake.first_line(message, MAX_MESSAGE)
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message,
            param,
            status,
            type,
            code,
        )

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
    # chat: passed to the chat template; calls parsed from the reply
    tools: Optional[list] = None
    constraint_field: Optional[str] = None     # the field that set params.structured_outputs
    ignored: tuple = ()                        # fields accepted and not used (logged)

    def constraint_error(self, message: str) -> ProtocolError:
        """A grammar the engine refused, as a 400 naming the field that gave it."""
        field = self.constraint_field or "structured_outputs"
        kind = (
            self.params.structured_outputs.kind()
            if self.params.structured_outputs is not None
            else ""
        )
        if field != "structured_outputs" and message.startswith(f"structured_outputs.{kind}"):
            message = field + message[len(f"structured_outputs.{kind}"):]
        return ProtocolError(message, field)


# ---- the request models --------------------------------------------------------------------------
def _integral(v):
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_integral)]
Schema = Union[Annotated[str, AfterValidator(intake.json_text)], dict[str, Any]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None


class StructuredOutputsBody(_Strict):
    """vLLM's ``structured_outputs`` (kimi_jax.engine.structured_params.StructuredOutputsParams)."""

    json_: Optional[Schema] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Schema] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = True
    disable_fallback: Optional[bool] = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=self.json_object,
            structural_tag=self.structural_tag,
            disable_any_whitespace=self.disable_any_whitespace,
            disable_additional_properties=self.disable_additional_properties,
        )


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: Optional[str] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[Annotated[Int, Field(ge=1, le=MAX_N)]] = None
    max_tokens: Optional[Int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[Int] = None
    user: Optional[str] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[Union[Int, str], float]] = None
    response_format: Optional[dict[str, Any]] = None
    top_k: Optional[Int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[Int] = None
    stop_token_ids: Optional[list[Int]] = None
    ignore_eos: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    bad_words: Optional[list[str]] = None
    best_of: Optional[Int] = None
    structured_outputs: Optional[StructuredOutputsBody] = None
    guided_json: Optional[Schema] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None


class CompletionRequest(_Request):
    prompt: Any = None
    logprobs: Optional[Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)]] = None
    echo: Optional[bool] = None
    suffix: Optional[str] = None


class ChatCompletionRequest(_Request):
    messages: Any = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)]] = None
    max_completion_tokens: Optional[Int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    add_generation_prompt: Optional[bool] = None
    modalities: Optional[list[str]] = None


# ---- field checks --------------------------------------------------------------------------------
def _typename(v) -> str:
    return "null" if v is None else type(v).__name__


def _short(v, limit: int = 80) -> str:
    text = " ".join(repr(v).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _path(loc: Sequence, body: Any) -> str:
    """The longest prefix of a pydantic error location that names a place in the body (union member
    tags dropped), as ``a.b[0]``; a missing field's own name."""
    out, here = "", body
    for i, part in enumerate(loc):
        if isinstance(part, int) and isinstance(here, list) and 0 <= part < len(here):
            out, here = f"{out}[{part}]", here[part]
        elif isinstance(part, str) and (isinstance(here, dict) and part in here or i == 0):
            out, here = (
                f"{out}.{part}" if out else part,
                here.get(part) if isinstance(here, dict) else None,
            )
        else:
            break
    return out


def _validate(model: type, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        path = _path(err["loc"], body)
        if err["type"] == "string_unicode" and (key := intake.bad_key(body)):
            raise ProtocolError(
                f"'{key}': a field name that is not valid Unicode (a lone surrogate)", key
            ) from None
        msg = err["msg"][0].lower() + err["msg"][1:]
        got = "" if err["type"] == "missing" else f", got {_short(err['input'])}"
        if err["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            raise ProtocolError(f"'{path}' must be in range ({msg}){got}", path) from None
        raise ProtocolError(f"'{path}': {msg}{got}", path) from None


def _extras(model: type, body: Any, kind: str) -> tuple:
    """The unused fields: REFUSED ones a 400, the rest logged in one line."""
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {_typename(body)}")
    extra = {k: v for k, v in body.items() if k not in model.model_fields}
    harmful = sorted(
        k for k, v in extra.items() if k in REFUSED[kind] and v not in (None, False, "", [], {})
    )
    if harmful:
        raise ProtocolError(
            f"'{harmful[0]}' is not supported by this server ({kind} requests)", harmful[0]
        )
    ignored = tuple(sorted(k for k in extra if k not in REFUSED[kind]))
    if ignored:
        names = ", ".join(ignored).encode("utf-8", "backslashreplace").decode("utf-8")
        log.warning(
            "%s request: fields present in the request and ignored: %s", kind, names[:MAX_MESSAGE]
        )
    return ignored


def _refuse_unless(req: _Request, name: str, ok, what: str) -> None:
    v = getattr(req, name)
    if v is not None and not ok(v):
        raise ProtocolError(f"'{name}'={_short(v)} is not supported ({what})", name)


def _param_name(field: Optional[str], req: _Request, kind: str) -> Optional[str]:
    """The request field of a SamplingParams field."""
    if field == "max_tokens" and kind == "chat" and req.max_completion_tokens is not None:
        return "max_completion_tokens"
    if field == "logprobs" and kind == "chat":
        return "top_logprobs" if req.top_logprobs is not None else "logprobs"
    return field


def _sampling(
    req: _Request, kind: str, *, max_tokens, logprobs: Optional[int], structured
) -> SamplingParams:
    top_k = req.top_k if req.top_k != 0 else -1
    kw = dict(
        n=req.n,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=top_k,
        min_p=req.min_p,
        seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else (req.stop or None),
        max_tokens=max_tokens,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        bad_words=req.bad_words or None,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        min_tokens=req.min_tokens,
        structured_outputs=structured,
    )
    if req.logit_bias:
        kw["logit_bias"] = _logit_bias(req.logit_bias)
    kw = {k: v for k, v in kw.items() if v is not None or k == "max_tokens"}
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        field = getattr(e, "field", None) or str(e).split()[0]
        raise ProtocolError(str(e), _param_name(field, req, kind)) from None


def _logit_bias(v: dict) -> dict:
    out = {}
    for k, b in v.items():
        if isinstance(k, str) and not (_TOKEN_ID.fullmatch(k) and k.isascii()):
            raise ProtocolError(
                f"'logit_bias' key {_short(k)} is not a token id (a decimal integer "
                "without sign, spaces or leading zeros)",
                "logit_bias",
            )
        if int(k) in out:
            raise ProtocolError(f"'logit_bias' has token id {int(k)} twice", "logit_bias")
        out[int(k)] = b
    return out


def _structured(req: _Request) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """The constraint of vLLM's fields (structured_outputs or one guided_*) and the field that gave
    it."""
    given = [
        f
        for f in (
            "structured_outputs",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        )
        if getattr(req, f) is not None
    ]
    if len(given) > 1:
        raise ProtocolError(
            f"'{given[1]}' cannot be combined with '{given[0]}': give one constraint", given[1]
        )
    _refuse_unless(
        req, "guided_whitespace_pattern", lambda v: False, "JSON is written without free whitespace"
    )
    if not given:
        return None, None
    f = given[0]
    if f == "structured_outputs":
        so = req.structured_outputs.params()
    else:
        so = StructuredOutputsParams(**{f.removeprefix("guided_"): getattr(req, f)})
    try:
        so.validate()
    except StructuredOutputError as e:
        msg = str(e)
        raise ProtocolError(
            msg
            if f == "structured_outputs"
            else msg.replace("structured_outputs.", f + ": ", 1).replace(
                "structured_outputs", f, 1
            ),
            f,
        ) from None
    return so, f


def _constraint(req: _Request, tools=None, tool_choice=None, parallel=None):
    """(constraint or None, its field): vLLM's fields, else response_format and the tools."""
    so, field = _structured(req)
    if so is not None:
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise ProtocolError(f"'{field}' cannot be combined with 'response_format'", field)
        if tools and tool_choice not in (None, "none", "auto"):
            raise ProtocolError(
                f"'{field}' cannot be combined with tool_choice={_short(tool_choice)}", field
            )
        return so, field
    js = (req.response_format or {}).get("json_schema")
    if isinstance(js, dict) and isinstance(js.get("schema"), str):
        try:
            intake.json_text(js["schema"])
        except ValueError as e:
            raise ProtocolError(
                f"response_format.json_schema.schema: {e}", "response_format"
            ) from None
    try:
        c = from_openai(req.response_format, tools, tool_choice, parallel)
    except StructuredOutputError as e:
        msg = str(e)
        field = next(
            (f for f in ("response_format", "tool_choice", "tools") if msg.startswith(f)), "tools"
        )
        raise ProtocolError(msg, field) from None
    if c is None:
        return None, None
    return c, ("response_format" if tools is None or tool_choice == "none" else "tools")


def _common(req: _Request) -> dict:
    if req.stream_options is not None and not req.stream:
        raise ProtocolError("'stream_options' is only allowed with stream=true", "stream_options")
    _refuse_unless(
        req, "skip_special_tokens", lambda v: v is True, "special tokens are always skipped"
    )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    _refuse_unless(req, "best_of", lambda v: v == (req.n or 1), "best_of must equal n")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ProtocolError(
            f"'stop' takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} "
            f"characters each, got {len(stops)} of up to {max(map(len, stops))}",
            "stop",
        )
    return dict(model=req.model, stream=bool(req.stream), include_usage=include_usage, n=req.n or 1)


def _token_ids(v, name: str) -> tuple:
    if not v or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise ProtocolError(f"'{name}' must be a non-empty list of token ids (integers)", name)
    return tuple(v)


def _prompts(p: Any) -> tuple:
    if isinstance(p, str):
        prompts = (p,)
    elif (
        isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
    ):
        prompts = (tuple(p),)
    elif isinstance(p, list) and p and all(isinstance(s, str) for s in p):
        prompts = tuple(p)
    elif isinstance(p, list) and p and all(isinstance(s, list) for s in p):
        prompts = tuple(_token_ids(s, "prompt") for s in p)
    else:
        raise ProtocolError(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of "
            "such lists (non-empty)",
            "prompt",
        )
    if any(isinstance(s, str) and not s for s in prompts):
        raise ProtocolError("'prompt' is empty", "prompt")
    return prompts


# ---- requests ------------------------------------------------------------------------------------
def parse_completion(body: Any) -> GenerationRequest:
    """A /v1/completions body -> GenerationRequest (ProtocolError naming the field)."""
    ignored = _extras(CompletionRequest, body, "completion")
    req = _validate(CompletionRequest, body)
    common = _common(req)
    if "prompt" not in body:
        raise ProtocolError("'prompt' is required", "prompt")
    prompts = _prompts(req.prompt)
    _refuse_unless(req, "echo", lambda v: v is False, "prompts are not echoed")
    _refuse_unless(req, "suffix", lambda v: v == "", "no insertion")
    max_tokens = req.max_tokens if req.max_tokens is not None else 16
    so, field = _constraint(req)
    params = _sampling(
        req, "completion", max_tokens=max_tokens, logprobs=req.logprobs, structured=so
    )
    return GenerationRequest("completion", params=params, prompts=prompts, logprobs=req.logprobs,
                             constraint_field=field, ignored=ignored, **common)


def _check_messages_and_tools(msgs: Any, tools: Optional[list]) -> None:
    if not isinstance(msgs, list) or not msgs:
        raise ProtocolError("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        if (
            isinstance(m, dict)
            and m.get("role") == "tool"
            and not isinstance(m.get("tool_call_id"), str)
        ):
            raise ProtocolError(
                f"messages[{i}]: a tool message needs its 'tool_call_id' (a string)", "messages"
            )
    names = [t["function"].get("name") for t in tools or ()
             if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise ProtocolError(f"tools: two tools are named {n!r}", "tools")


def parse_chat(body: Any) -> GenerationRequest:
    """A /v1/chat/completions body -> GenerationRequest (ProtocolError naming the field). The
    messages are checked by the chat template when rendered."""
    ignored = _extras(ChatCompletionRequest, body, "chat")
    req = _validate(ChatCompletionRequest, body)
    common = _common(req)
    _check_messages_and_tools(req.messages, req.tools)
    if req.top_logprobs is not None and not req.logprobs:
        raise ProtocolError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    _refuse_unless(req, "modalities", lambda v: v == ["text"], "text only")
    so, field = _constraint(req, req.tools, req.tool_choice, req.parallel_tool_calls)
    params = _sampling(req, "chat", max_tokens=max_tokens, logprobs=logprobs, structured=so)
    add_gp = req.add_generation_prompt if req.add_generation_prompt is not None else True
    return GenerationRequest(
        "chat",
        params=params,
        messages=req.messages,
        logprobs=logprobs,
        add_generation_prompt=add_gp,
        tools=req.tools or None,
        constraint_field=field,
        ignored=ignored,
        **common,
    )


_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def request_error(g: Optional[GenerationRequest], e: Exception, default: str) -> ProtocolError:
    """An engine's RequestError as a 400 naming its grammar's field, parameter, else `default`."""
    msg = intake.first_line(e, 10 * MAX_MESSAGE)
    if g is not None and msg.startswith("structured_outputs"):
        return g.constraint_error(msg)
    field = getattr(e, "field", None) or next(
        (f for f in _SAMPLING_FIELDS if msg.startswith(f + " ")), None
    )
    return ProtocolError(msg, field or default)


def check_context(n_prompt: int, max_tokens: Optional[int], limit: int, kind: str) -> None:
    """A prompt of n_prompt tokens and max_tokens within the model's context (ProtocolError 400)."""
    field = "messages" if kind == "chat" else "prompt"
    if n_prompt >= limit:
        raise ProtocolError(
            f"this model's maximum context length is {limit} tokens; the prompt has "
            f"{n_prompt} tokens",
            field,
            code="context_length_exceeded",
        )
    if max_tokens is not None and n_prompt + max_tokens > limit:
        raise ProtocolError(f"this model's maximum context length is {limit} tokens; the prompt "
                            f"({n_prompt} tokens) plus max_tokens ({max_tokens}) exceeds it",
                            "max_completion_tokens" if kind == "chat" else "max_tokens",
                            code="context_length_exceeded")


def check_model(req_model: Optional[str], served: Sequence[str]) -> None:
    if req_model is not None and req_model not in served:
        raise ProtocolError(
            f"The model '{req_model}' does not exist (served: {', '.join(served)})",
            "model",
            status=404,
            code="model_not_found",
        )


# ---- responses -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Choice:
    """One generated sequence (or, streaming, one piece of it)."""
    index: int
    text: str
    token_ids: list
    # "stop" | "length" | "tool_calls" | None (more to come)
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    logprobs: Optional[list] = None            # per token: {token id: logprob (float or .logprob)}
    # chat: [{"id", "type": "function", "function": {...}}]
    tool_calls: Optional[list] = None
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
        # k + 1: sampled too
        top = dict(_top(entry, k)) | ({tid: _lp(entry[tid])} if tid in entry else {})
        tops.append({_token(tokenizer, t): v for t, v in top.items()} if k else None)
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
    return {
        "index": c.index,
        "text": c.text,
        "logprobs": completion_logprobs(c, tokenizer, k, offset)
        if c.logprobs is not None
        else None,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


def _message(c: Choice, delta: bool, first: bool = False) -> dict:
    m = {"role": "assistant"} if (first or not delta) else {}
    if c.text or not delta or first:
        m["content"] = c.text if (c.text or not c.tool_calls) else None
    if c.tool_calls is not None:
        m["tool_calls"] = c.tool_calls
    if c.reasoning_content is not None:
        m["reasoning_content"] = c.reasoning_content
    return m


def completion_response(
    rid: str,
    created: int,
    model: str,
    choices: list,
    usage_: dict,
    tokenizer=None,
    k: Optional[int] = None,
) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [_completion_choice(c, tokenizer, k) for c in choices], "usage": usage_}


def with_tool_calls(c: Choice, tokenizer) -> Choice:
    """A finished chat choice of a request with tools: Kimi's tool-call section of its tokens parsed
    into `tool_calls`, the text before it as the content, finish_reason "tool_calls" when it made
    calls."""
    from kimi_jax.text.tool_parser import calls_complete, parse_output, tool_finish_reason
    parsed = parse_output(c.token_ids, tokenizer)
    c.text, c.tool_calls = parsed.content, parsed.tool_calls or None
    c.finish_reason = tool_finish_reason(c.finish_reason, calls_complete(parsed.tool_calls))
    return c


def chat_response(rid: str, created: int, model: str, choices: list, usage_: dict, tokenizer=None,
                  k: Optional[int] = None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": _message(c, delta=False),
                "logprobs": chat_logprobs(c, tokenizer, k) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in choices
        ],
        "usage": usage_,
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    c: Choice,
    tokenizer=None,
    k=None,
    offset: int = 0,
    with_usage: bool = False,
) -> dict:
    d = {"id": rid, "object": "text_completion", "created": created, "model": model,
         "choices": [_completion_choice(c, tokenizer, k, offset)]}
    if with_usage:
        d["usage"] = None
    return d


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    c: Choice,
    tokenizer=None,
    k=None,
    first: bool = False,
    with_usage: bool = False,
) -> dict:
    d = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "delta": _message(c, delta=True, first=first),
                "logprobs": chat_logprobs(c, tokenizer, k) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
        ],
    }
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


# ---- streaming text ------------------------------------------------------------------------------
class TextStream:
    """A choice's text as its tokens arrive: the streaming detokenizer's output, minus a tail that
    could still begin a stop string (held until it cannot). `finish(final)` returns what completes
    the final text (the engine's, stop string cut off), so the deltas always add up to the
    non-streamed text."""

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
