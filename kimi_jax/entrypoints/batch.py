"""JSONL batch jobs: OpenAI Batch API input lines -> requests, results -> output lines, and resuming.

Input lines are either the OpenAI Batch format
  {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...], ...}}
or a plain {"custom_id"?: ..., "prompt": "..." | [token ids], "max_tokens": ..., ...}.
Every input line gets exactly one output line, with its custom_id ("line-N" when it has none): a result
or an error object. Output is appended line by line (flushed and fsynced), so a rerun after Ctrl-C or
kill -9 skips the custom_ids already written and a torn last line is cut off.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

from kimi_jax.engine.sampling import SamplingParams

ENVELOPE_KEYS = {"custom_id", "method", "url", "body"}
BODY_KEYS = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
             "top_k", "min_p", "stop", "seed", "logprobs", "top_logprobs", "n", "stream", "stop_token_ids",
             "ignore_eos", "user", "metadata"}


class LineError(ValueError):
    """An input line that cannot become a request (reported in the output; the job goes on)."""


@dataclasses.dataclass
class Job:
    custom_id: str
    kind: str                       # "chat" | "completion"
    messages: Optional[list] = None
    prompt: Any = None              # str or list of token ids
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)


def parse_line(line: str, lineno: int, default_max_tokens: int) -> Job:
    """One input line -> Job; LineError (with the custom_id known so far) on anything wrong."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise LineError(f"line {lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise LineError(f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
    cid = obj.get("custom_id", f"line-{lineno}")
    if not isinstance(cid, str) or not cid:
        raise LineError(f"line {lineno}: custom_id must be a non-empty string")
    if "body" in obj:
        unknown = set(obj) - ENVELOPE_KEYS
        body = obj["body"]
        if not isinstance(body, dict):
            raise LineError(f"line {lineno}: body must be an object")
    else:
        body = {k: v for k, v in obj.items() if k != "custom_id"}
        unknown = set()
    unknown |= set(body) - BODY_KEYS
    if unknown:
        raise LineError(f"line {lineno}: unknown field(s) {sorted(unknown)}")
    if ("messages" in body) == ("prompt" in body):
        raise LineError(f"line {lineno}: body needs exactly one of 'messages' or 'prompt'")
    if body.get("n", 1) != 1:
        raise LineError(f"line {lineno}: n={body['n']!r} is not supported (n must be 1)")
    if body.get("stream", False):
        raise LineError(f"line {lineno}: stream=true is not supported in batch jobs")
    logprobs = body.get("logprobs")
    if isinstance(logprobs, bool):
        logprobs = body.get("top_logprobs", 0) if logprobs else None
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    try:
        # values go in as given: SamplingParams.validate checks their types (no silent int()/float())
        params = SamplingParams(
            temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
            top_k=body.get("top_k", -1), min_p=body.get("min_p", 0.0), max_tokens=max_tokens,
            stop=body.get("stop"), stop_token_ids=body.get("stop_token_ids"),
            ignore_eos=body.get("ignore_eos", False), seed=body.get("seed"), logprobs=logprobs)
        params.validate()
    except (TypeError, ValueError) as e:
        raise LineError(f"line {lineno}: {e}") from None
    if "messages" in body:
        if not isinstance(body["messages"], list) or not body["messages"]:
            raise LineError(f"line {lineno}: messages must be a non-empty list")
        return Job(cid, "chat", messages=body["messages"], params=params)
    prompt = body["prompt"]
    if not isinstance(prompt, (str, list)) or (isinstance(prompt, str) and not prompt):
        raise LineError(f"line {lineno}: prompt must be a non-empty string or a list of token ids, "
                        f"got {_one_line(json.dumps(prompt), 60)}")
    return Job(cid, "completion", prompt=prompt, params=params)


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def custom_id_of(line: str, lineno: int) -> str:
    """The custom_id a line reports under, even when the line is broken."""
    try:
        obj = json.loads(line)
        cid = obj.get("custom_id") if isinstance(obj, dict) else None
        return cid if isinstance(cid, str) and cid else f"line-{lineno}"
    except json.JSONDecodeError:
        return f"line-{lineno}"


def result_line(job: Job, text: Optional[str], prompt_tokens: int, token_ids: list[int],
                finish_reason: str, model: str) -> dict:
    if job.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "token_ids": token_ids, "finish_reason": finish_reason}
        obj = "text_completion"
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(token_ids),
             "total_tokens": prompt_tokens + len(token_ids)}
    return {"id": f"batch_req_{job.custom_id}", "custom_id": job.custom_id,
            "response": {"status_code": 200, "body": {"object": obj, "model": model, "choices": [choice],
                                                      "usage": usage}},
            "error": None}


def error_line(custom_id: str, message: str) -> dict:
    return {"id": f"batch_req_{custom_id}", "custom_id": custom_id, "response": None,
            "error": {"code": "invalid_request", "message": message}}


class OutputFileError(ValueError):
    """An output file kimi-batch cannot append to (not its own results, or not writable)."""


class ResultWriter:
    """Appends output lines durably and knows which custom_ids are already done."""

    def __init__(self, path: str):
        self.path = path
        self.done: set[str] = set()
        try:
            if os.path.exists(path):
                self._recover()
            self._f = open(path, "a", encoding="utf-8")
        except OSError as e:
            raise OutputFileError(f"{path}: cannot write the output file ({e.strerror or e})") from None

    def _recover(self) -> None:
        with open(self.path, "rb") as f:
            data = f.read()
        keep = data.rfind(b"\n") + 1          # a torn last line (kill -9 mid-write) is dropped
        for lineno, raw in enumerate(data[:keep].splitlines(), start=1):
            try:
                obj = json.loads(raw)
                ok = (isinstance(obj, dict) and isinstance(obj.get("custom_id"), str)
                      and {"response", "error"} <= obj.keys())
            except (json.JSONDecodeError, UnicodeDecodeError):
                ok = False
            if not ok:
                raise OutputFileError(f"{self.path}:{lineno}: the output file holds a line that is not a "
                                      f"kimi-batch result ({_one_line(raw[:80].decode('utf-8', 'replace'), 60)}); "
                                      "give another --output")
            self.done.add(obj["custom_id"])
        if keep < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(keep)

    def write(self, record: dict) -> None:
        cid = record["custom_id"]
        if cid in self.done:
            return
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done.add(cid)

    def close(self) -> None:
        self._f.close()
