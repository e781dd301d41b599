"""Tool-call and structured-output accuracy over a JSONL of OpenAI chat requests (K2-Vendor-Verifier
style), against a server or the in-process LLM API.

  python -m launch.tool_eval --make_sample=/tmp/req.jsonl --n=50          # the built-in request set
  python -m launch.tool_eval --requests=/tmp/req.jsonl                     # LLM API, demo model
  python -m launch.tool_eval --requests=/tmp/req.jsonl --base_url=http://127.0.0.1:8000/v1 --model=kimi

Each line is a chat request body (``messages``, and ``tools`` / ``tool_choice`` /
``response_format`` / ``temperature`` / ``max_tokens`` / ``seed``). Counted per request with tools:
finish_reason == "tool_calls"; calls whose arguments parse as JSON; calls whose function is one of the
request's tools and whose arguments validate against its ``parameters`` (jsonschema):
schema_accuracy = valid calls / calls. Per request with a ``json_schema`` response_format: content that
parses and validates. tool_choice "required" / named: the share of responses that carry a call.
"""
from __future__ import annotations

import json
import sys
from typing import Iterable

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("requests", None, "JSONL of chat request bodies")
flags.DEFINE_string("make_sample", None, "write the built-in request set here and exit")
flags.DEFINE_integer("n", 50, "requests of each kind in the built-in set")
flags.DEFINE_string("base_url", None, "an OpenAI-compatible server (loopback); else the LLM API")
flags.DEFINE_string("model", None, "model name for the server, or checkpoint for the LLM API (default: demo)")
flags.DEFINE_integer("max_tokens", 256, "max_tokens for requests that set none")
flags.DEFINE_string("out", None, "write the summary (and per-request results) as JSON here")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
         "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "create_event", "description": "Put an event in a calendar",
     "parameters": {"type": "object", "properties": {
         "title": {"type": "string", "maxLength": 60},
         "when": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                                   "month": {"enum": ["jan", "feb", "mar", "apr", "may", "jun", "jul",
                                                                      "aug", "sep", "oct", "nov", "dec"]}},
                  "required": ["day", "month"], "additionalProperties": False},
         "attendees": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4}},
         "required": ["title", "when"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search_flights", "parameters": {"type": "object", "properties": {
        "from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9}, "nonstop": {"type": "boolean"}},
        "required": ["from", "to", "passengers"], "additionalProperties": False}}},
]

SCHEMAS = [
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "neutral", "negative"]},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["sentiment", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "emails": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3}},
        "required": ["name", "age", "emails"], "additionalProperties": False}},
     "required": ["person"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}},
        "priority": {"enum": ["low", "high"]}}, "required": ["items", "priority"], "additionalProperties": False},
]

PROMPTS = ["What's the weather like in Paris?", "Book a meeting with Ana on the 3rd of May.",
           "Find me a flight from SFO to JFK for two.", "Summarise this review: great phone, poor battery.",
           "Extract the order: two of AB-1234 and one of CD-0001, urgent."]


def sample_requests(n: int) -> list[dict]:
    """n json_schema requests, n tool_choice "required" ones and n "auto" ones (seeded, varied)."""
    out = []
    for i in range(n):
        s = SCHEMAS[i % len(SCHEMAS)]
        out.append({"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "seed": i,
                    "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i % len(SCHEMAS)}", "schema": s}}})
    for choice in ("required", "auto"):
        for i in range(n):
            out.append({"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "seed": 1000 + i,
                        "tools": TOOLS[: 1 + i % len(TOOLS)], "tool_choice": choice})
    return out


def score(request: dict, message: dict, finish_reason: str) -> dict:
    """Counts for one response (`message`: an OpenAI assistant message)."""
    import jsonschema
    r = {"finish_reason": finish_reason}
    tools = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
             for t in request.get("tools") or []}
    if tools:
        calls = message.get("tool_calls") or []
        r.update(tool_calls=len(calls), parsed=0, valid=0, finish_tool_calls=finish_reason == "tool_calls")
        for c in calls:
            try:
                args = json.loads(c["function"]["arguments"])
            except (ValueError, KeyError, TypeError):
                continue
            r["parsed"] += 1
            schema = tools.get(c["function"].get("name"))
            if schema is not None and _valid(args, schema, jsonschema):
                r["valid"] += 1
    rf = request.get("response_format") or {}
    if rf.get("type") == "json_schema":
        try:
            doc = json.loads(message.get("content") or "")
            r["json_parsed"] = True
            r["json_valid"] = _valid(doc, rf["json_schema"].get("schema", {}), jsonschema)
        except ValueError:
            r["json_parsed"] = r["json_valid"] = False
    return r


def _valid(doc, schema, jsonschema) -> bool:
    try:
        jsonschema.validate(doc, schema)
        return True
    except jsonschema.ValidationError:
        return False


def summarize(requests: list[dict], results: list[dict]) -> dict:
    s = {"requests": len(results)}
    tool_rs = [(q, r) for q, r in zip(requests, results) if "tool_calls" in r]
    if tool_rs:
        calls = sum(r["tool_calls"] for _, r in tool_rs)
        s["tool_requests"] = len(tool_rs)
        s["finish_reason_tool_calls"] = sum(r["finish_tool_calls"] for _, r in tool_rs)
        s["tool_calls"] = calls
        s["calls_parsed"] = sum(r["parsed"] for _, r in tool_rs)
        s["calls_valid"] = sum(r["valid"] for _, r in tool_rs)
        s["schema_accuracy"] = round(s["calls_valid"] / calls, 4) if calls else None
        forced = [r for q, r in tool_rs if q.get("tool_choice") not in (None, "auto", "none")]
        if forced:
            s["forced_requests"] = len(forced)
            s["forced_with_valid_calls"] = sum(r["tool_calls"] > 0 and r["valid"] == r["tool_calls"] for r in forced)
    js = [r for r in results if "json_valid" in r]
    if js:
        s["json_schema_requests"] = len(js)
        s["json_parsed"] = sum(r["json_parsed"] for r in js)
        s["json_valid"] = sum(r["json_valid"] for r in js)
    return s


def run_llm(requests: list[dict], model, default_max_tokens: int) -> list[tuple[dict, str]]:
    """(message, finish_reason) per request through LLM.chat, requests with the same tools /
    tool_choice / response_format / sampling batched together."""
    from kimi_jax import LLM, SamplingParams
    llm = LLM(model, dtype="float32", max_model_len=2048, max_num_seqs=64)
    groups: dict[str, list[int]] = {}
    for i, q in enumerate(requests):
        key = json.dumps([q.get("tools"), q.get("tool_choice"), q.get("response_format"), q.get("temperature", 1.0),
                          q.get("max_tokens", default_max_tokens)], sort_keys=True)
        groups.setdefault(key, []).append(i)
    out: list = [None] * len(requests)
    for idx in groups.values():
        q0 = requests[idx[0]]
        sps = SamplingParams(temperature=q0.get("temperature", 1.0), max_tokens=q0.get("max_tokens", default_max_tokens))
        # one call per group; each conversation its own seed (generate takes one SamplingParams per prompt)
        outs = _chat(llm, [requests[i] for i in idx], sps)
        for i, o in zip(idx, outs):
            c = o.outputs[0]
            if q0.get("tools"):
                msg = {"role": "assistant", "content": c.content or None, "tool_calls": c.tool_calls or None}
            else:
                msg = {"role": "assistant", "content": c.text}
            out[i] = (msg, c.finish_reason)
    return out


def _chat(llm, reqs: list[dict], sp):
    import dataclasses
    q0 = reqs[0]
    return llm.chat([q["messages"] for q in reqs], [dataclasses.replace(sp, seed=q.get("seed")) for q in reqs],
                    tools=q0.get("tools"), tool_choice=q0.get("tool_choice"), response_format=q0.get("response_format"))


def run_server(requests: list[dict], base_url: str, model: str, default_max_tokens: int):
    from openai import OpenAI
    client = OpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    out = []
    for q in requests:
        body = {"max_tokens": default_max_tokens, **q}
        resp = client.chat.completions.create(model=model, **body)
        ch = resp.choices[0]
        out.append((ch.message.model_dump(exclude_none=True), ch.finish_reason))
    return out


def read_requests(path: str) -> list[dict]:
    reqs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
            except ValueError as e:
                raise SystemExit(f"{path}:{n}: not JSON ({e})")
            if not isinstance(q, dict) or not isinstance(q.get("messages"), list):
                raise SystemExit(f"{path}:{n}: a request needs a 'messages' list")
            reqs.append(q)
    return reqs


def write_jsonl(path: str, rows: Iterable[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main(argv):
    del argv
    if FLAGS.make_sample:
        write_jsonl(FLAGS.make_sample, sample_requests(FLAGS.n))
        return
    if not FLAGS.requests:
        raise SystemExit("--requests (a JSONL of chat requests) or --make_sample is required")
    reqs = read_requests(FLAGS.requests)
    if FLAGS.base_url:
        responses = run_server(reqs, FLAGS.base_url, FLAGS.model or "kimi", FLAGS.max_tokens)
    else:
        responses = run_llm(reqs, FLAGS.model, FLAGS.max_tokens)
    results = [score(q, m, f) for q, (m, f) in zip(reqs, responses)]
    summary = summarize(reqs, results)
    print(json.dumps(summary, indent=1))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"summary": summary, "results": results,
                       "responses": [m for m, _ in responses]}, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    sys.exit(app.run(main))
