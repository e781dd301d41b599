"""JSONL batch jobs in the OpenAI Batch format: input lines -> requests, results -> output lines, resuming.

Input lines are the OpenAI Batch format
  {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...], ...}}
(`url` /v1/chat/completions or /v1/completions; without `url` the body's `messages` / `prompt` picks
it; `method` must be POST) or a plain {"custom_id"?: ..., "prompt": ..., ...} completions body. The
bodies are parsed by the server's request model (kimi_jax.entrypoints.openai.protocol), so a body is
accepted or refused exactly as the server would.

Every input line gets exactly one output line, OpenAI's batch output:
  {"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"}, "error"}
with the completion / chat-completion body (status 200), or the API's error body for a request the
server refuses (status 400 / 404) or one that fails while it runs (500); `error` is null then. A line
that cannot be read as a request at all (malformed JSON, no custom_id, a bad url or method, a repeated
custom_id) gets `response` null and the top-level `error` object. Output is appended line by line
(flushed and fsynced), so a rerun after Ctrl-C or kill -9 skips the lines already written and a torn
last line is cut off.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import uuid

from kimi_jax.entrypoints.openai import protocol as P

ROUTES = {"/v1/chat/completions": P.parse_chat, "/v1/completions": P.parse_completion}
ENVELOPE_KEYS = {"custom_id", "method", "url", "body"}
DUPLICATE = "duplicate_custom_id"


class LineError(ValueError):
    """An input line that is not a request at all (the top-level error of its output line)."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Line:
    """One input line read as a request: its custom_id, route and body (not yet checked)."""
    custom_id: str
    lineno: int
    url: str
    body: dict


def read_line(line: str, lineno: int) -> Line:
    """The envelope of one input line; LineError when it is not a request at all."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise LineError(f"line {lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise LineError(f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
    envelope = bool({"body", "url", "method"} & set(obj))
    cid = obj.get("custom_id", None if envelope else f"line-{lineno}")
    if cid is None:
        raise LineError(f"line {lineno}: 'custom_id' is required")
    if not isinstance(cid, str) or not cid:
        raise LineError(f"line {lineno}: custom_id must be a non-empty string")
    if not envelope:
        body = {k: v for k, v in obj.items() if k != "custom_id"}
        return Line(cid, lineno, "/v1/chat/completions" if "messages" in body else "/v1/completions", body)
    unknown = sorted(set(obj) - ENVELOPE_KEYS)
    if unknown:
        raise LineError(f"line {lineno}: unknown field(s) {unknown} (a line has {sorted(ENVELOPE_KEYS)})")
    method = obj.get("method", "POST")
    if method != "POST":
        raise LineError(f"line {lineno}: method {_one_line(json.dumps(method), 40)} is not supported "
                        "(only POST)", "invalid_method")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(f"line {lineno}: 'body' must be a JSON object")
    url = obj.get("url", "/v1/chat/completions" if "messages" in body else "/v1/completions")
    if url not in ROUTES:
        raise LineError(f"line {lineno}: url {_one_line(json.dumps(url), 60)} is not served "
                        f"(one of {sorted(ROUTES)})", "invalid_url")
    return Line(cid, lineno, url, body)


def parse_body(ln: Line, default_max_tokens: int) -> tuple[P.GenerationRequest, bool]:
    """The line's GenerationRequest (ProtocolError as the server raises it) and whether max_tokens is
    the job's default (the body gives none)."""
    body = ln.body
    defaulted = isinstance(body, dict) and body.get("max_tokens") is None \
        and body.get("max_completion_tokens") is None
    if defaulted:
        body = {**body, "max_tokens": default_max_tokens}
    return ROUTES[ln.url](body), defaulted


def fit_default_max_tokens(g: P.GenerationRequest, n_prompt: int, limit: int) -> P.GenerationRequest:
    """A defaulted max_tokens cut to what the context leaves after the prompt (as the server does when
    a request gives none)."""
    room = limit - n_prompt
    if 1 <= room < g.params.max_tokens:
        g = dataclasses.replace(g, params=dataclasses.replace(g.params, max_tokens=room))
    return g


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


def _ids() -> tuple[str, str]:
    return "batch_req_" + uuid.uuid4().hex, "req_" + uuid.uuid4().hex


def response_line(custom_id: str, status_code: int, body: dict) -> dict:
    """An output line carrying an HTTP response: a completion body, or the API's error body."""
    line_id, request_id = _ids()
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": None}


def refused_line(custom_id: str, e: P.ProtocolError) -> dict:
    return response_line(custom_id, e.status, e.body())


def failed_line(custom_id: str, message: str) -> dict:
    return response_line(custom_id, 500, P.error_body(message, "server_error"))


def error_line(custom_id: str, message: str, code: str = "invalid_request") -> dict:
    line_id, _ = _ids()
    return {"id": line_id, "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}


def result_body(g: P.GenerationRequest, model: str, choices: list, n_prompt: int, tokenizer) -> dict:
    """The completion / chat-completion body, built as the server builds it."""
    use = P.usage(n_prompt, sum(len(c.token_ids) for c in choices))
    build = P.chat_response if g.kind == "chat" else P.completion_response
    return build(P.new_id(g.kind), P.now(), model, choices, use, tokenizer, g.logprobs)


class OutputFileError(ValueError):
    """An output file kimi-batch cannot append to (not its own results, or not writable)."""


class ResultWriter:
    """Appends output lines durably and knows which input lines are already done: `done` holds the
    custom_ids answered (a line's own result or error), `duplicates[cid]` how many repeats of cid were
    reported."""

    def __init__(self, path: str):
        self.path = path
        self.done: set[str] = set()
        self.duplicates: collections.Counter = collections.Counter()
        self.written = 0
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
            if isinstance(obj.get("error"), dict) and obj["error"].get("code") == DUPLICATE:
                self.duplicates[obj["custom_id"]] += 1
            else:
                self.done.add(obj["custom_id"])
        if keep < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(keep)

    def write(self, record: dict, duplicate: bool = False) -> None:
        cid = record["custom_id"]
        if not duplicate and cid in self.done:
            return
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.written += 1
        if duplicate:
            self.duplicates[cid] += 1
        else:
            self.done.add(cid)

    def close(self) -> None:
        self._f.close()
