"""kimi-batch's output lines against the OpenAI Batch format, field by field (the `openai` client's own
response types check the bodies): chat and completions with logprobs, n, a forced tool call in
message.tool_calls, url routing, method errors, duplicate custom_ids, refused requests (400 / 404 with
OpenAI's error body), the model name, the progress total and the prefix cache summary. One in-process run over the demo model (it has a tokenizer
and a chat template) and a rerun that must add nothing."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

openai = pytest.importorskip("openai")

NAME = "batch-model"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"], "additionalProperties": False}}}]
CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0,
        "logprobs": True, "top_logprobs": 2}
COMPLETION = {"prompt": "The with statement", "max_tokens": 3, "temperature": 0, "logprobs": 2, "n": 2,
              "model": NAME}
LINES = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
    {"custom_id": "text", "method": "POST", "url": "/v1/completions", "body": COMPLETION},
    {"custom_id": "text", "method": "POST", "url": "/v1/completions", "body": {"prompt": "again"}},
    {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}},
    {"custom_id": "get", "method": "DELETE", "url": "/v1/completions", "body": {}},     # broken and repeated
    {"custom_id": "wrong-route", "method": "POST", "url": "/v1/completions", "body": CHAT},
    {"custom_id": "other-model", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "model": "gpt-4o"}},
    {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
    {"custom_id": "penalty", "method": "POST", "url": "/v1/chat/completions",
     "body": {**CHAT, "logprobs": False, "top_logprobs": None, "presence_penalty": 0.5}},
    {"custom_id": "tool", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "Add"}], "tools": TOOLS, "max_tokens": 48, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "add"}}}},
]


def _run(cli, inp, out, *extra):
    return cli("launch.batch", f"--input={inp}", f"--output={out}", "--max-num-seqs=4",
               f"--served-model-name={NAME}", *extra)


def test_batch_output_is_openai_batch_format(cli, tmp_path, monkeypatch):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(json.dumps(l) for l in LINES) + "\n{not json\n\n")
    t0 = int(time.time())
    res = _run(cli, inp, out)
    assert res.returncode == 0, res
    got = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(got) == len(LINES) + 1                          # one output line per non-blank input line
    by_id: dict = {}
    for r in got:
        assert set(r) == {"id", "custom_id", "response", "error"} and r["id"].startswith("batch_req_")
        by_id.setdefault(r["custom_id"], []).append(r)
    assert len({r["id"] for r in got}) == len(got)

    def ok(cid):
        (r,) = [r for r in by_id[cid] if r["error"] is None]
        res = r["response"]
        assert set(res) == {"status_code", "request_id", "body"} and res["status_code"] == 200
        assert isinstance(res["request_id"], str) and res["request_id"]
        body = res["body"]
        assert t0 - 1 <= body["created"] <= time.time() + 1 and body["model"] == NAME
        assert {"id", "object", "created", "model", "choices", "usage"} <= set(body)
        u = body["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        return body

    chat = ok("chat")
    openai.types.chat.ChatCompletion.model_validate(chat)
    assert chat["id"].startswith("chatcmpl-") and chat["object"] == "chat.completion"
    (c,) = chat["choices"]
    assert {"index", "message", "logprobs", "finish_reason"} <= set(c) and c["index"] == 0
    assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
    content = c["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] and c["finish_reason"] in ("stop", "length")
    assert "".join(t["token"] for t in content) == c["message"]["content"]
    for t in content:                       # greedy: the chosen token is the most likely one
        assert len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["token"] == t["token"]
        assert t["top_logprobs"][0]["logprob"] == t["logprob"] >= t["top_logprobs"][1]["logprob"]
        assert bytes(t["bytes"]).decode("utf-8", "replace") == t["token"]

    text = ok("text")
    openai.types.Completion.model_validate(text)
    assert text["id"].startswith("cmpl-") and text["object"] == "text_completion"
    assert [c["index"] for c in text["choices"]] == [0, 1]     # n = 2
    assert text["choices"][0]["text"] == text["choices"][1]["text"]   # greedy: both the same
    assert text["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in text["choices"])
    for c in text["choices"]:
        lp = c["logprobs"]
        assert "".join(lp["tokens"]) == c["text"] and len(lp["token_logprobs"]) == len(lp["tokens"])
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
        for tok, p, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert len(top) == 2 and top[tok] == p == max(top.values())
    assert ok("penalty")["choices"][0]["logprobs"] is None
    tool = ok("tool")           # a named tool: the call is forced and parsed into message.tool_calls
    openai.types.chat.ChatCompletion.model_validate(tool)
    (c,) = tool["choices"]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
    (call,) = c["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "add"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOLS[0]["function"]["parameters"])

    def top_error(cid, code, *words):
        (r,) = by_id[cid]
        assert r["response"] is None and r["error"]["code"] == code, r
        assert all(w in r["error"]["message"] for w in words), r

    dup = [r for r in by_id["text"] if r["error"] is not None]
    assert len(dup) == 1 and dup[0]["error"]["code"] == "duplicate_custom_id" and "line 3" in dup[0]["error"]["message"]
    top_error("embed", "invalid_url", "/v1/embeddings")
    first, again = by_id["get"]
    assert first["error"]["code"] == "invalid_method" and "GET" in first["error"]["message"]
    assert again["error"]["code"] == "duplicate_custom_id" and "line 6" in again["error"]["message"]
    top_error("line-9", "invalid_request", "custom_id")
    top_error(f"line-{len(LINES) + 1}", "invalid_request", "malformed JSON")

    def refused(cid, status, param):
        (r,) = by_id[cid]
        assert r["error"] is None and r["response"]["status_code"] == status, r
        err = r["response"]["body"]["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
        return err

    assert "messages" in refused("wrong-route", 400, "messages")["message"]    # a chat body sent to completions
    assert refused("other-model", 404, "model")["code"] == "model_not_found"

    # the progress bar counts every non-blank line, with its total; the summary gives the cache hit rate
    n = len(LINES) + 1
    assert f"{n}/{n}" in res.stderr, res.stderr[-2000:]
    summary = res.stderr.strip().splitlines()[-1]
    assert re.search(r"4 results, 2 refused, 6 errors, 0 already done, of 12 lines", summary), summary
    m = re.search(r"prefix cache hit rate (\S+) \((\d+) of (\d+) prompt tokens\)", summary)
    assert m and int(m.group(3)) > 0 and int(m.group(2)) <= int(m.group(3)), summary

    # a rerun finds every line done (the repeated custom_id's error included): nothing is added
    from kimi_jax.entrypoints.frontend import Frontend
    load, seen = Frontend.from_config.__func__, []

    def spy(cls, engine_config):
        seen.append(engine_config.enable_prefix_caching)
        return load(cls, engine_config)
    monkeypatch.setattr(Frontend, "from_config", classmethod(spy))
    before = out.read_text()
    again = _run(cli, inp, out, "--no-enable-prefix-caching")
    assert again.returncode == 0, again
    assert seen == [False]
    assert out.read_text() == before
    assert "0 results, 0 refused, 0 errors, 12 already done" in again.stderr, again.stderr[-1000:]
