r"""Tool-call and structured-output accuracy (K2-Vendor-Verifier style) of one JSONL of OpenAI chat
requests, through any of the three ways in: LLM.chat, a running kimi-serve (the official `openai`
client) or kimi-batch. One report for all three.

  python -m launch.tool_eval --make_sample=/tmp/req.jsonl --n=50 --kinds=json_schema,required
  python -m launch.tool_eval --requests=/tmp/req.jsonl                        # LLM.chat, demo model
  kimi-serve --dtype float32 --port 8011 &
  python -m launch.tool_eval --requests=/tmp/req.jsonl --path=server --base_url=http://127.0.0.1:8011/v1
  python -m launch.tool_eval --requests=/tmp/req.jsonl --path=batch [--batch_cli]

Each line is a chat request body (`messages`, and `tools` / `tool_choice` / `response_format` /
`temperature` / `max_tokens` / `seed` ...); a body without max_tokens gets --max_tokens on every path.
--path=llm parses each body as the server does (kimi_jax.entrypoints.openai.protocol) and calls
LLM.chat; --path=server sends them to --base_url (loopback only) at most --concurrency at a time, each
with a --timeout_s limit; --path=batch writes them as an OpenAI Batch input (custom_id req-N), runs
kimi-batch's job over it in this process (--batch_cli: the kimi-batch command as a subprocess) and
reads its output lines. A request that gets no completion (an HTTP error, a refused or failed batch
line) counts as an error and as invalid.

Counted per request with tools: finish_reason "tool_calls"; calls whose arguments parse as JSON; calls
whose function is one of the request's tools and whose arguments validate against its `parameters`
(jsonschema): schema_accuracy = valid calls / calls. tool_choice "required" / named: the requests
answered with at least one call, every call valid. Per request with a `json_schema` response_format:
content that parses and validates.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Optional

from absl import flags

from launch import common

PROG = "tool_eval"


class EvalError(Exception):
    """A bad flag value, request file or server: reported as one line, exit status 2."""

KINDS = ("json_schema", "required", "auto")
FLAGS = flags.FLAGS
flags.DEFINE_string("requests", None, "JSONL of chat request bodies")
flags.DEFINE_string("make_sample", None, "write the built-in request set here and exit")
flags.DEFINE_integer("n", 50, "requests of each kind in the built-in set")
flags.DEFINE_list("kinds", list(KINDS), f"kinds of the built-in set, in this order (of {', '.join(KINDS)})")
flags.DEFINE_enum("path", None, ["llm", "server", "batch"], "the way in: LLM.chat, the server at --base_url, "
                  "or kimi-batch (default: server when --base_url is given, else llm)")
flags.DEFINE_string("base_url", None, "the OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 (loopback)")
flags.DEFINE_string("api_key", None, "sent to the server (default: env KIMI_JAX_API_KEY, else a placeholder)")
flags.DEFINE_integer("concurrency", 16, "server requests in flight at most")
flags.DEFINE_float("timeout_s", 600.0, "server: seconds one request may take")
flags.DEFINE_integer("max_requests", 1000, "evaluate the first this many requests of the file")
flags.DEFINE_string("model", None, "llm / batch: checkpoint directory or preset (default: the demo model); "
                    "server: the model name sent (default: the server's first model)")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "llm / batch: compute dtype")
flags.DEFINE_integer("max_num_seqs", 64, "llm / batch: requests decoded together")
flags.DEFINE_integer("max_model_len", None, "llm / batch: longest prompt + output (default: the model's)")
flags.DEFINE_integer("max_tokens", 256, "max_tokens for requests that give none")
flags.DEFINE_string("batch_dir", None, "batch: keep the Batch input / output JSONL here (default: a temporary "
                    "directory, removed)")
flags.DEFINE_bool("batch_cli", False, "batch: run the kimi-batch command (python -m launch.batch) as a "
                  "subprocess instead of its job in this process")
flags.DEFINE_string("out", None, "write the summary, per-request results and responses as JSON here")

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


def sample_requests(n: int, kinds: Iterable[str] = KINDS, temperature: float = 1.0) -> list[dict]:
    """n requests of each kind: "json_schema" (response_format over SCHEMAS in turn), "required" and
    "auto" (tool_choice over the first 1-3 of TOOLS); sampled at `temperature`, each with its own seed."""
    out = []
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown request kind {kind!r} (one of {', '.join(KINDS)})")
        base = {"json_schema": 0, "required": 1000, "auto": 2000}[kind]
        for i in range(n):
            q = {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "temperature": temperature,
                 "seed": base + i}
            if kind == "json_schema":
                q["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": f"s{i % len(SCHEMAS)}", "schema": SCHEMAS[i % len(SCHEMAS)]}}
            else:
                q.update(tools=TOOLS[: 1 + i % len(TOOLS)], tool_choice=kind)
            out.append(q)
    return out


# ---- scoring: one chat-completion body per request, whatever the path ---------------------------------
def score(request: dict, body: Optional[dict]) -> dict:
    """Counts for one response: `body` is an OpenAI chat-completion body, or an error ({"error": message}
    or the API's error body)."""
    import jsonschema
    if not body or not body.get("choices"):
        err = (body or {}).get("error") or "no response"
        r = {"error": str(err.get("message") if isinstance(err, dict) else err), "finish_reason": None}
        message = {}
    else:
        choice = body["choices"][0]
        r = {"finish_reason": choice.get("finish_reason")}
        message = choice.get("message") or {}
    tools = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
             for t in request.get("tools") or []}
    if tools:
        calls = message.get("tool_calls") or []
        r.update(tool_calls=len(calls), parsed=0, valid=0, finish_tool_calls=r["finish_reason"] == "tool_calls")
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
    s = {"requests": len(results), "errors": sum("error" in r for r in results)}
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
    s["all_valid"] = all_valid(s)
    return s


def all_valid(summary: dict) -> bool:
    """Every request answered, every call parsed and valid, every forced request with calls, every
    json_schema output valid."""
    return (summary["errors"] == 0 and summary.get("calls_valid", 0) == summary.get("tool_calls", 0)
            and summary.get("forced_with_valid_calls", 0) == summary.get("forced_requests", 0)
            and summary.get("json_valid", 0) == summary.get("json_schema_requests", 0))


# ---- the three paths: each returns one chat-completion body (or {"error": ...}) per request ------------
def with_max_tokens(requests: list[dict], max_tokens: int) -> list[dict]:
    """The bodies as sent on every path: max_tokens filled in where a body gives none."""
    return [q if q.get("max_tokens") is not None or q.get("max_completion_tokens") is not None
            else {**q, "max_tokens": max_tokens} for q in requests]


def make_llm(model: Optional[str], dtype: str, max_num_seqs: int, max_model_len: Optional[int], **engine_kw):
    from kimi_jax import LLM
    try:
        return LLM(model, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len, **engine_kw)
    except ValueError as e:
        raise EvalError(e) from None


def run_llm(bodies: list[dict], llm, model_name: str = "llm") -> list[dict]:
    """Through LLM.chat: each body parsed by the server's parser (protocol.parse_chat: its sampling
    parameters and constraint), bodies with the same tools chatted together."""
    from kimi_jax.entrypoints.openai import protocol as P
    out: list = [None] * len(bodies)
    groups: dict[str, list] = {}
    for i, q in enumerate(bodies):
        try:
            g = P.parse_chat(q)
        except P.ProtocolError as e:
            out[i] = e.body()
            continue
        groups.setdefault(json.dumps([g.tools, g.add_generation_prompt], sort_keys=True), []).append((i, g))
    for members in groups.values():
        g0 = members[0][1]
        try:
            outs = llm.chat([g.messages for _, g in members], [g.params for _, g in members], tools=g0.tools,
                            add_generation_prompt=g0.add_generation_prompt, use_tqdm=False)
        except ValueError as e:
            for i, _ in members:
                out[i] = P.error_body(" ".join(str(e).split()))
            continue
        for (i, g), o in zip(members, outs):
            c = o.outputs[0]
            ch = P.Choice(0, (c.content if g.tools else c.text) or "", c.token_ids, c.finish_reason,
                          getattr(c, "stop_reason", None), tool_calls=(c.tool_calls or None) if g.tools else None)
            out[i] = P.chat_response(P.new_id("chat"), P.now(), model_name, [ch],
                                     P.usage(len(o.prompt_token_ids), len(c.token_ids)))
    return out


def run_server(bodies: list[dict], base_url: str, model: Optional[str] = None, *, api_key: Optional[str] = None,
               concurrency: int = 8, timeout_s: float = 600.0) -> list[dict]:
    """Through a running server with the official `openai` client: at most `concurrency` requests in
    flight, each limited to timeout_s, no retries. Fields the client has no argument for go in
    extra_body."""
    import openai
    client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", timeout=timeout_s, max_retries=0)
    if model is None:
        try:
            model = client.models.list().data[0].id
        except openai.APIError as e:
            raise EvalError(f"cannot list the models of {base_url}: {e}") from None
    known = set(inspect.signature(client.chat.completions.create).parameters) - {"extra_body", "extra_headers",
                                                                                 "extra_query", "timeout", "stream"}

    def one(q: dict) -> dict:
        kw = {k: v for k, v in q.items() if k in known}
        extra = {k: v for k, v in q.items() if k not in known and k != "stream"}
        kw["model"] = q.get("model") or model
        try:
            resp = client.chat.completions.create(**kw, extra_body=extra or None)
        except openai.APIStatusError as e:
            return {"error": f"HTTP {e.status_code}: {e.message}"}
        except openai.APIError as e:        # timeouts, refused connections
            return {"error": f"{type(e).__name__}: {e}"}
        return resp.model_dump(exclude_none=True)

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(one, bodies))


def write_batch_input(path: str, bodies: list[dict]) -> list[str]:
    """The bodies as OpenAI Batch input lines (custom_id req-N, POST /v1/chat/completions); their ids."""
    ids = [f"req-{i}" for i in range(len(bodies))]
    write_jsonl(path, ({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": q}
                       for cid, q in zip(ids, bodies)))
    return ids


def read_batch_output(path: str, ids: list[str]) -> list[dict]:
    """Per custom_id the completion body of its output line, or {"error": ...} (a refused or failed
    line, a line-level error, no line)."""
    got: dict[str, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            res = r.get("response")
            if r.get("error") is not None:
                got[r["custom_id"]] = {"error": f"{r['error'].get('code')}: {r['error'].get('message')}"}
            elif res["status_code"] != 200:
                msg = (res.get("body") or {}).get("error", {}).get("message")
                got[r["custom_id"]] = {"error": f"HTTP {res['status_code']}: {msg}"}
            else:
                got[r["custom_id"]] = res["body"]
    return [got.get(cid, {"error": "kimi-batch wrote no line for it"}) for cid in ids]


def batch_command(inp: str, out: str, *, model: Optional[str], dtype: str, max_num_seqs: int,
                  max_model_len: Optional[int], max_tokens: int, extra: Iterable[str] = ()) -> list[str]:
    """The kimi-batch command line (this interpreter, `-m launch.batch`) for one job."""
    cmd = [sys.executable, "-m", "launch.batch", f"--input={inp}", f"--output={out}", f"--dtype={dtype}",
           f"--max_num_seqs={max_num_seqs}", f"--default_max_tokens={max_tokens}"]
    if model:
        cmd.append(f"--model={model}")
    if max_model_len:
        cmd.append(f"--max_model_len={max_model_len}")
    return cmd + list(extra)


def run_batch(bodies: list[dict], workdir: str, *, llm=None, command: Optional[Callable[[str, str], list]] = None,
              max_tokens: int = 256, progress: bool = False) -> list[dict]:
    """Through kimi-batch: the bodies written as Batch input in `workdir`, answered by kimi-batch's job
    (kimi_jax.entrypoints.batch.run_job) over `llm` in this process, or by the command line
    `command(input, output)` (see batch_command) as a subprocess; its output lines read back."""
    inp, out = os.path.join(workdir, "batch_input.jsonl"), os.path.join(workdir, "batch_output.jsonl")
    if os.path.exists(out):
        raise EvalError(f"{out} exists (kimi-batch would skip the ids it holds); remove it or give another "
                        "--batch_dir")
    ids = write_batch_input(inp, bodies)
    if command is not None:
        argv = command(inp, out)
        print(f"{PROG}: running {' '.join(argv)}", file=sys.stderr, flush=True)
        p = subprocess.run(argv)
        if p.returncode != 0:
            raise EvalError(f"kimi-batch exited with status {p.returncode}")
    else:
        from kimi_jax.entrypoints import batch as B
        with open(inp, encoding="utf-8") as f:
            B.run_job(llm.frontend, f, B.ResultWriter(out), model_name="kimi-batch", default_max_tokens=max_tokens,
                      total=len(bodies), progress=progress)
    return read_batch_output(out, ids)


# ---- files and the command line ------------------------------------------------------------------
def read_requests(path: str, limit: Optional[int] = None) -> list[dict]:
    """The file's requests, the first `limit` of them (lines after those are not read)."""
    reqs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(reqs) >= limit:
                break
            if not line.strip():
                continue
            try:
                q = json.loads(line)
            except ValueError as e:
                raise EvalError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(q, dict) or not isinstance(q.get("messages"), list):
                raise EvalError(f"{path}:{n}: a request needs a 'messages' list")
            reqs.append(q)
    return reqs


def write_jsonl(path: str, rows: Iterable[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def evaluate(path: str, bodies: list[dict]) -> list[dict]:
    """The responses of one path, as the flags configure it."""
    if path == "server":
        if not FLAGS.base_url:
            raise EvalError("--path=server needs --base_url (e.g. http://127.0.0.1:8000/v1)")
        try:
            common.check_loopback(FLAGS.base_url)
        except (ValueError, OSError) as e:
            raise EvalError(e) from None
        return run_server(bodies, FLAGS.base_url, FLAGS.model, concurrency=FLAGS.concurrency,
                          api_key=FLAGS.api_key or os.environ.get("KIMI_JAX_API_KEY"), timeout_s=FLAGS.timeout_s)
    common.setup()
    engine = dict(model=FLAGS.model, dtype=FLAGS.dtype, max_num_seqs=FLAGS.max_num_seqs,
                  max_model_len=FLAGS.max_model_len)
    if path == "llm":
        return run_llm(bodies, make_llm(**engine, **common.engine_kwargs()), FLAGS.model or "kimi-jax-demo")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = FLAGS.batch_dir or tmp
        os.makedirs(workdir, exist_ok=True)
        if FLAGS.batch_cli:
            names = ("tensor_parallel_size", "data_parallel_size", "compilation_cache_dir",
                     *common.SCHEDULING_FLAGS)
            extra = [f"--{k}={getattr(FLAGS, k)}" for k in names if getattr(FLAGS, k) is not None]
            extra += [f"--{'' if getattr(FLAGS, k) else 'no'}{k}" for k in ("enable_expert_parallel",
                                                                             "enable_prefix_caching")]
            extra += ["--noprogress"] if FLAGS.progress is False else []
            return run_batch(bodies, workdir, max_tokens=FLAGS.max_tokens, command=lambda i, o: batch_command(
                i, o, max_tokens=FLAGS.max_tokens, extra=extra, **engine))
        return run_batch(bodies, workdir, llm=make_llm(**engine, **common.engine_kwargs()),
                         max_tokens=FLAGS.max_tokens, progress=FLAGS.progress is not False)


def main(argv):
    del argv
    if FLAGS.make_sample:
        try:
            write_jsonl(FLAGS.make_sample, sample_requests(FLAGS.n, FLAGS.kinds))
        except ValueError as e:
            common.fail(PROG, f"--kinds: {e}")
        return
    if not FLAGS.requests:
        common.fail(PROG, "--requests (a JSONL of chat requests) or --make_sample is required")
    try:
        import jsonschema  # noqa: F401  (a dependency; checked before any request is sent)
    except ImportError:
        common.fail(PROG, "the scoring needs the jsonschema package (pip install jsonschema)")
    path = FLAGS.path or ("server" if FLAGS.base_url else "llm")
    if FLAGS.base_url and path != "server":
        common.fail(PROG, f"--base_url is for --path=server, not --path={path}")
    if FLAGS.max_requests < 1:
        common.fail(PROG, f"--max_requests must be >= 1, got {FLAGS.max_requests}")
    try:
        reqs = read_requests(FLAGS.requests, FLAGS.max_requests)
    except OSError as e:
        common.fail(PROG, f"--requests {FLAGS.requests}: {e.strerror or e}")
    bodies = with_max_tokens(reqs, FLAGS.max_tokens)
    t0 = time.perf_counter()
    responses = evaluate(path, bodies)
    results = [score(q, b) for q, b in zip(reqs, responses)]
    summary = {"path": path, **summarize(reqs, results), "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(summary, indent=1))
    if FLAGS.out:
        with open(FLAGS.out, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "results": results, "responses": responses}, f, indent=1,
                      ensure_ascii=False)


def run(argv=None):
    common.run(main, PROG, __name__, __doc__, argv=argv, errors=(EvalError,))


if __name__ == "__main__":
    run()
