"""An OpenAI-compatible HTTP server over AsyncLLM (aiohttp).

aiohttp rather than FastAPI / uvicorn: the GPU machines have aiohttp and not those; the request
models are kimi_jax.entrypoints.openai.protocol's (pydantic).

  GET  /v1/models, /v1/models/ID  the served model
  POST /v1/completions            prompt(s) -> text, streamed as SSE with "stream": true
  POST /v1/chat/completions       messages -> reply (the checkpoint's chat template, as LLM.chat)
  POST /tokenize, /detokenize     {"prompt" | "messages" (+ "tools")} -> token ids; {"tokens"} ->
                                  text
  GET  /health                    200 once the model is loaded, its program set compiled (with
                                  EngineConfig.precompile) and a warm-up request has run
  GET  /metrics                   Prometheus text (kimi_jax.entrypoints.openai.metrics)
  GET  /version                   {"version": kimi_jax's version}

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}: bad input (a field, a
prompt longer than the context, beyond the RequestLimits) 400, a body beyond them 413, unknown model
404, a missing or wrong API key 401 (with a key set, on every route but OPEN_ROUTES; /metrics too
when metrics_need_key), more than max_queue waiting 429 with Retry-After, shutting down 503. Intake
(parsing, tokenizing, request building) runs on a thread pool, off the event loop. A client that
disconnects has its requests aborted. Each request is logged at INFO (`access_log`): id, route,
status, prompt / output tokens, time to first token and total. `serve` stops admitting on SIGTERM /
SIGINT, gives in-flight requests a grace period, aborts the rest, closes every connection and
returns.
"""
# Over 600 lines: the OpenAI server's routes, their checks and streaming.
from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import os
import signal
import time
import uuid
from typing import Optional

from aiohttp import web, web_protocol, web_server

from kimi_jax.engine.async_engine import AsyncLLM, EngineDead, QueueFull
from kimi_jax.engine.sampling import SamplingParams
from kimi_jax.engine.validation import RequestError
from kimi_jax.entrypoints.openai import intake, protocol as P
from kimi_jax.entrypoints.openai.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from kimi_jax.text.tool_parser import ChatOutputParser, calls_complete, tool_finish_reason

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1
CLOSE_S = 2.0                         # after the grace period: handlers unwind, connections close
KEEPALIVE_S = 15.0                    # an idle connection, or one slow with its headers, is closed
MAX_ECHO = 200


class ListenError(OSError):
    """The server could not bind its address."""

OPEN_ROUTES = ("/health", "/metrics", "/version")       # answered without the API key
# the access log's fields of a request (its id, tokens, time to first token)
INFO = web.RequestKey("kimi_access", dict) if hasattr(web, "RequestKey") else "kimi_access"


class _Aborted(Exception):
    """An engine request of a response was aborted; the message is what the client is told."""


def _error(status: int, message: str, type: str = "invalid_request_error", param=None, code=None,
           headers=None) -> web.Response:
    return web.json_response(
        P.error_body(message, type, param, code), status=status, headers=headers
    )


class _JSONErrorHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler, answering what its HTTP parser refuses (a header or URL beyond
    its size, an unknown Content-Encoding, ...) with OpenAI's JSON error body, not plain text."""
    __slots__ = ()

    def handle_error(self, request, status=500, exc=None, message=None):
        plain = super().handle_error(request, status, exc, message)     # logs; raises if sent
        text = message or (plain.text if status != 500 else None) or "internal error"
        text = " ".join(str(text).split())[:MAX_ECHO]
        resp = _error(status, text, "server_error" if status >= 500 else "invalid_request_error")
        resp.force_close()
        return resp


class _JSONErrorServer(web_server.Server):
    __slots__ = ()

    def __call__(self) -> web_protocol.RequestHandler:
        return _JSONErrorHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> web_server.Server:
        server = await super()._make_server()
        server.__class__ = _JSONErrorServer
        return server


class OpenAIServer:
    """The app's state: the model's Frontend (kimi_jax.entrypoints.frontend: its input and output
    processors), the AsyncLLM over an engine core of its own, names, key and metrics."""

    def __init__(
        self,
        frontend,
        *,
        served_model_name: Optional[str] = None,
        api_key: Optional[str] = None,
        max_queue: Optional[int] = None,
        limits: Optional[intake.RequestLimits] = None,
        metrics_need_key: bool = False,
        access_log: bool = True,
    ):
        self.frontend = fe = frontend
        self.access_log = access_log
        self.tokenizer = fe.tokenizer
        self.model_name = served_model_name or fe.model_path or "kimi-jax"
        self.api_key = api_key or None
        self.metrics_need_key = metrics_need_key
        self.limits = limits or intake.RequestLimits()
        self.async_llm = AsyncLLM(fe.make_core(), max_queue=max_queue)
        max_num_seqs = fe.scheduler_config.max_num_seqs
        queued = max_num_seqs + max_queue if max_queue is not None else self.limits.max_choices
        self.max_choices = min(self.limits.max_choices, queued)
        # a longer text prompt cannot fit max_model_len tokens (a char is >= 1 byte, a token <= L)
        longest = _longest_token(fe.tokenizer)
        self.max_prompt_chars = min(
            self.limits.max_prompt_chars, fe.max_model_len * (longest or 2**62)
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kimi-jax-intake")
        import kimi_jax
        install = os.path.dirname(os.path.dirname(os.path.abspath(kimi_jax.__file__)))
        model = (
            [(os.path.abspath(fe.model_path), self.model_name), (fe.model_path, self.model_name)]
            if fe.model_path
            else []
        )
        self._paths = [(p, n) for p, n in model + [(install, "<install>")] if p not in ("", "/")]
        self.metrics = ServerMetrics(self.async_llm, self.model_name)
        self.ready = False
        self.draining = False
        self.active = 0                        # generation requests being served
        self._idle: Optional[asyncio.Event] = None

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """With EngineConfig.precompile, compile the core's program set (on a thread: /health
        answers 503 meanwhile) before the engine thread starts stepping it; then the warm-up."""
        self._idle = asyncio.Event()
        self._idle.set()
        if self.frontend.engine_config.precompile:
            await self._off_loop(self.frontend.precompile, self.async_llm.core)
        self.async_llm.start()
        await self._warmup()
        self.ready = True

    async def _warmup(self) -> None:
        """One short greedy request, so the first shapes are compiled before /health says ready."""
        ids = [self.frontend.config.bos_token_id or 1] * 4
        samples = self.async_llm.make_request(
            "warmup-" + uuid.uuid4().hex,
            ids,
            SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
            seed=0,
        )
        async for d in self.async_llm.generate(samples):
            if d.error:
                raise RuntimeError(f"warm-up request failed: {d.error}")

    async def drain(self, grace_s: float) -> None:
        """Stop admitting, wait up to grace_s for in-flight requests, then abort what is left."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except asyncio.TimeoutError:
            log.warning(
                "%d requests still in flight after %.1fs; aborting them", self.active, grace_s
            )
            self.async_llm.shutdown()
            # handlers see their aborts; one blocked on a client that never reads is closed
            try:
                await asyncio.wait_for(self._idle.wait(), CLOSE_S)
            except asyncio.TimeoutError:
                log.warning(
                    "%d requests still writing to clients; closing their connections", self.active
                )
        self.async_llm.shutdown()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._access, self._errors, self._auth],
                              client_max_size=self.limits.max_body_bytes)
        app.add_routes(
            [
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model:.+}", self.model),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics_endpoint),
                web.get("/version", self.version),
            ]
        )
        return app

    # ---- middlewares ----------------------------------------------------------------------------
    @web.middleware
    async def _access(self, request, handler):
        """One INFO line per request: id, route, status, tokens, time to first token, total."""
        t0 = time.perf_counter()
        request[INFO] = info = {}
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        finally:
            if self.access_log:
                ttft = info.get("ttft")
                log.info(
                    "%s %s %s %d prompt_tokens=%s output_tokens=%s ttft=%s total=%.3fs",
                    info.get("id", "-"),
                    request.method,
                    request.path,
                    status,
                    info.get("prompt_tokens", "-"),
                    info.get("output_tokens", "-"),
                    "-" if ttft is None else f"{ttft:.3f}s",
                    time.perf_counter() - t0,
                )

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except P.ProtocolError as e:
            body = e.body()
            body["error"]["message"] = self._scrub(body["error"]["message"])
            return web.json_response(body, status=e.status)
        # a body its Content-Encoding cannot decode
        except web_protocol.RequestPayloadError as e:
            why = getattr(e.__cause__, "message", None) or str(e)
            return _error(
                400,
                "the request body cannot be read: " + " ".join(str(why).split())[:MAX_ECHO],
                code="bad_body",
            )
        except web.HTTPRequestEntityTooLarge:
            return _error(
                413,
                f"the request body is larger than max_body_bytes={self.limits.max_body_bytes}",
                code="body_too_large",
            )
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _error(
                e.status,
                f"{e.reason}: {request.method} {request.path}",
                "not_found_error" if e.status == 404 else "invalid_request_error",
            )
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:  # a bug, not bad input: logged, the server goes on
            log.exception("error serving %s", request.path)
            return _error(
                500,
                f"internal error ({type(e).__name__}); the server log has the details",
                "server_error",
            )

    def _scrub(self, message: str) -> str:
        """An error text without the server's file paths (the checkpoint's, the package's)."""
        for path, name in self._paths:
            message = message.replace(path, name)
        return message

    @web.middleware
    async def _auth(self, request, handler):
        open_routes = tuple(
            r for r in OPEN_ROUTES if not (r == "/metrics" and self.metrics_need_key)
        )
        if self.api_key and request.path not in open_routes:
            got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(got, f"Bearer {self.api_key}".encode()):
                return _error(
                    401,
                    "missing or invalid API key (send 'Authorization: Bearer <key>')",
                    param=None,
                    code="invalid_api_key",
                )
        return await handler(request)

    # ---- simple endpoints -----------------------------------------------------------------------
    async def health(self, request):
        if self.ready and self.async_llm.alive and not self.draining:
            return web.Response(status=200)
        return _error(503, "not ready" if not self.ready else "shutting down", "server_error")

    async def metrics_endpoint(self, request):
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    def _model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "kimi_jax",
            "root": self.frontend.model_path or self.model_name,
            "max_model_len": self.frontend.max_model_len,
        }

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        P.check_model(request.match_info["model"], [self.model_name])
        return web.json_response(self._model_card())

    async def version(self, request):
        from kimi_jax import __version__
        return web.json_response({"version": __version__})

    async def _json(self, request):
        return self._loads(await request.read())

    def _loads(self, raw: bytes):
        try:
            return intake.loads(raw, self.limits.max_depth)
        except intake.TooDeep as e:
            raise P.ProtocolError(f"the request body is {e}", code="too_deep") from None
        except intake.NumberTooLong as e:
            raise P.ProtocolError(f"the request body is not accepted: {e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise P.ProtocolError(f"the request body is not valid JSON: {e}") from None

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise P.ProtocolError(
                f"{what} needs a tokenizer and this model has none; send token ids", "prompt"
            )

    def _chat_ids(self, messages, add_generation_prompt=True, tools=None) -> list[int]:
        self._need_tokenizer("chat")
        try:
            return self.frontend.inputs.encode_chat(
                messages, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except ValueError as e:                 # ChatTemplateError: a bad message, names its index
            raise P.ProtocolError(str(e), "messages") from None

    async def tokenize(self, request):
        return web.json_response(await self._off_loop(self._tokenize, await request.read()))

    def _tokenize(self, raw: bytes) -> dict:
        body = self._loads(raw)
        if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
            raise P.ProtocolError("the body needs exactly one of 'prompt' or 'messages'")
        if "messages" in body:
            agp = body.get("add_generation_prompt", True)
            if not isinstance(agp, bool):
                raise P.ProtocolError(
                    f"'add_generation_prompt' must be a boolean, got {agp!r}",
                    "add_generation_prompt",
                )
            tools = body.get("tools")
            if tools is not None and not isinstance(tools, list):
                raise P.ProtocolError("'tools' must be a list", "tools")
            ids = self._chat_ids(body["messages"], agp, tools or None)
        else:
            if not isinstance(body["prompt"], str):
                raise P.ProtocolError("'prompt' must be a string", "prompt")
            self._need_tokenizer("tokenize")
            self._check_chars(len(body["prompt"]), "prompt")
            ids = self.tokenizer.encode(body["prompt"])
        return {"count": len(ids), "max_model_len": self.frontend.max_model_len, "tokens": ids}

    async def detokenize(self, request):
        return web.json_response(await self._off_loop(self._detokenize, await request.read()))

    def _detokenize(self, raw: bytes) -> dict:
        body = self._loads(raw)
        toks = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(toks, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in toks
        ):
            raise P.ProtocolError("'tokens' must be a list of token ids", "tokens")
        self._need_tokenizer("detokenize")
        vocab = self.frontend.config.vocab_size
        bad = [t for t in toks if not 0 <= t < min(vocab, self.tokenizer.vocab_size)]
        if bad:
            raise P.ProtocolError(f"token id {bad[0]} is outside the vocabulary", "tokens")
        return {"prompt": self.tokenizer.decode(toks)}

    # ---- generation -----------------------------------------------------------------------------
    async def completions(self, request):
        return await self._generate(request, P.parse_completion)

    async def chat(self, request):
        return await self._generate(request, P.parse_chat)

    def _check_chars(self, n: int, field: str) -> None:
        if n > self.max_prompt_chars:
            raise P.ProtocolError(
                f"the {field} has {n} characters, more than max_prompt_chars="
                f"{self.max_prompt_chars} (it cannot fit "
                f"max_model_len={self.frontend.max_model_len} "
                "tokens, or is beyond the server's limit)",
                field,
                code="prompt_too_large",
            )

    def _intake(self, raw: bytes, parse):
        """A body -> (GenerationRequest, its id, [(choice index, engine request)]); ProtocolError on
        bad input."""
        g = parse(self._loads(raw))
        P.check_model(g.model, [self.model_name])
        choices = (1 if g.kind == "chat" else len(g.prompts)) * g.n
        if choices > self.max_choices:
            raise P.ProtocolError(
                f"the request asks for {choices} choices (prompts x n), more than the "
                f"{self.max_choices} one request may have (max_choices, or max_num_seqs + "
                "max_queue)",
                "n",
                code="too_many_choices",
            )
        if g.kind == "chat":
            self._check_chars(intake.text_chars([g.messages, g.tools]), "messages")
        else:
            self._check_chars(sum(len(p) for p in g.prompts if isinstance(p, str)), "prompt")
        rid = P.new_id(g.kind)
        return g, rid, self._engine_requests(g, rid)

    def _engine_requests(self, g: P.GenerationRequest, rid: str) -> list:
        """(choice index, sample) for every prompt and each of its n samples (one prompt's samples
        share its prefill); ProtocolError on bad input."""
        if g.kind == "chat":
            prompts = [(None, self._chat_ids(g.messages, g.add_generation_prompt, g.tools))]
            field = "messages"
        else:
            prompts, field = [], "prompt"
            for p in g.prompts:
                if isinstance(p, str):
                    self._need_tokenizer("a text prompt")
                    prompts.append((p, self.tokenizer.encode(p)))
                else:
                    prompts.append((None, list(p)))
        out = []
        limit = self.frontend.max_model_len
        for i, (text, ids) in enumerate(prompts):
            P.check_context(len(ids), g.params.max_tokens, limit, g.kind)
            try:
                samples = self.async_llm.make_request(f"{rid}-{i}", ids, g.params, prompt=text)
            except RequestError as e:
                raise P.request_error(g, e, field) from None
            out += [(i * g.n + j, r) for j, r in enumerate(samples)]
        return out

    async def _generate(self, request, parse):
        raw = await request.read()
        if self.draining or not self.ready:
            return _error(
                503,
                "the server is shutting down" if self.draining else "the server is starting",
                "server_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        g, rid, reqs = await self._off_loop(self._intake, raw, parse)
        request[INFO]["id"] = rid
        if self.draining:
            return _error(
                503,
                "the server is shutting down",
                "server_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        queue: asyncio.Queue = asyncio.Queue()
        submitted = []
        try:
            for i in range(0, len(reqs), g.n):           # one prompt's samples at a time
                samples = [r for _, r in reqs[i:i + g.n]]
                self.async_llm.submit(samples, queue)
                submitted += samples
        except QueueFull as e:
            for r in submitted:
                self.async_llm.abort(r.request_id)
            return _error(
                429,
                f"the server is busy: {e}",
                "rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        except EngineDead as e:
            return _error(503, str(e), "server_error")
        self.active += 1
        self._idle.clear()
        try:
            if g.stream:
                return await self._stream(request, g, rid, reqs, queue)
            return await self._collect(g, rid, reqs, queue, request[INFO])
        finally:
            request[INFO].update(
                prompt_tokens=sum(len(r.prompt_ids) for k, r in reqs if k % g.n == 0),
                output_tokens=sum(len(r.output_ids) for _, r in reqs),
            )
            for _, r in reqs:
                if r.finish_reason is None:
                    self.async_llm.abort(r.request_id)
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    def _count(self, d, prompt_len: int, first: bool) -> None:
        if first and d.token_ids:
            self.metrics.prompt_tokens.inc(prompt_len)
        self.metrics.generation_tokens.inc(len(d.token_ids))
        if d.finished and d.request is not None and d.request.finish_reason != "abort":
            self.metrics.finished(d.request)

    async def _deltas(self, reqs, queue, info: Optional[dict] = None):
        """The engine's deltas for `reqs` ((choice index, engine request) pairs) as they arrive on
        `queue`, as (choice index, engine request, delta), until every request has finished. Each
        delta is counted in the metrics (a request's prompt tokens with its first tokens); an
        aborted request (an engine error, or the server shutting down) raises _Aborted with the
        message to send. info: gets "ttft", seconds to the first token."""
        index = {r.request_id: (k, r) for k, r in reqs}
        t0 = time.perf_counter()
        started, left = set(), len(reqs)
        while left:
            d = await queue.get()
            k, r = index[d.request_id]
            self._count(d, len(r.prompt_ids), d.request_id not in started)
            if d.token_ids:
                started.add(d.request_id)
                if info is not None and "ttft" not in info:
                    info["ttft"] = time.perf_counter() - t0
            if d.error is not None or (d.finished and r.finish_reason == "abort"):
                raise _Aborted(f"request aborted: {d.error or 'the server is shutting down'}")
            left -= bool(d.finished)
            yield k, r, d

    async def _collect(self, g, rid, reqs, queue, info=None):
        done = {}
        try:
            async for k, r, d in self._deltas(reqs, queue, info):
                if d.finished:
                    out = self.frontend.outputs.completion(k, r)
                    done[k] = P.Choice(
                        k,
                        out.text or "",
                        out.token_ids,
                        out.finish_reason,
                        out.stop_reason,
                        out.logprobs,
                    )
                    if g.kind == "chat" and g.tools and self.tokenizer is not None:
                        P.with_tool_calls(done[k], self.tokenizer)      # Kimi's tool-call section
        except _Aborted as e:
            return _error(503, str(e), "server_error")
        choices = [done[k] for k in sorted(done)]
        n_prompt = sum(len(r.prompt_ids) for k, r in reqs if k % g.n == 0)
        use = P.usage(n_prompt, sum(len(c.token_ids) for c in choices))
        build = P.chat_response if g.kind == "chat" else P.completion_response
        return web.json_response(
            build(rid, P.now(), self.model_name, choices, use, self.tokenizer, g.logprobs)
        )

    async def _stream(self, request, g, rid, reqs, queue):
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        created, chat = P.now(), g.kind == "chat"
        streams = {
            r.request_id: P.TextStream(self.tokenizer, r.params.stop_strings)
            if self.tokenizer
            else None
            for _, r in reqs
        }
        # chat with tools: content and tool-call deltas from the parser (kimi_jax.text.tool_parser)
        calls = ({r.request_id: ChatOutputParser(self.tokenizer) for _, r in reqs}
                 if chat and g.tools and self.tokenizer is not None else None)
        offsets = {r.request_id: 0 for _, r in reqs}

        async def send(obj):
            await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

        if chat:
            for k, _ in reqs:
                await send(
                    P.chat_chunk(
                        rid,
                        created,
                        self.model_name,
                        P.Choice(k, "", []),
                        first=True,
                        with_usage=g.include_usage,
                    )
                )
        try:
            async for k, r, d in self._deltas(reqs, queue, request[INFO]):
                ts = streams[d.request_id]
                c = P.Choice(
                    k, "", d.token_ids, logprobs=d.logprobs if g.logprobs is not None else None
                )
                if calls is not None:
                    parser = calls[d.request_id]
                    delta = parser.feed_ids(d.token_ids)
                    if d.finished:
                        tail = parser.finish()
                        delta.content += tail.content
                        delta.tool_calls += tail.tool_calls
                        out = self.frontend.outputs.completion(k, r)
                        complete = calls_complete(parser.result().tool_calls)
                        c.finish_reason = tool_finish_reason(out.finish_reason, complete)
                        c.stop_reason = out.stop_reason
                    c.text, c.tool_calls = delta.content, delta.tool_calls or None
                    if not d.finished and not delta and c.logprobs is None:
                        continue
                # the engine's final text (a stop string cut off) completes what was sent
                elif d.finished:
                    out = self.frontend.outputs.completion(k, r)
                    c.text = ts.finish(out.text or "") if ts is not None else ""
                    c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
                else:
                    c.text = ts.feed(d.token_ids) if ts is not None else ""
                    # as vLLM: a chunk for every step with tokens, empty text too (tool calls:
                    # parsed deltas)
                    if not c.text and c.logprobs is None and not d.token_ids:
                        continue
                if chat:
                    await send(
                        P.chat_chunk(
                            rid,
                            created,
                            self.model_name,
                            c,
                            self.tokenizer,
                            g.logprobs,
                            with_usage=g.include_usage,
                        )
                    )
                else:
                    await send(
                        P.completion_chunk(
                            rid,
                            created,
                            self.model_name,
                            c,
                            self.tokenizer,
                            g.logprobs,
                            offsets[d.request_id],
                            with_usage=g.include_usage,
                        )
                    )
                    offsets[d.request_id] += len(c.text)
        except _Aborted as e:
            await send(P.error_body(str(e), "server_error"))
        else:
            if g.include_usage:
                n_prompt = sum(len(r.prompt_ids) for k, r in reqs if k % g.n == 0)
                await send(
                    P.usage_chunk(
                        rid,
                        created,
                        self.model_name,
                        g.kind,
                        P.usage(n_prompt, sum(len(r.output_ids) for _, r in reqs)),
                    )
                )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def serve(server: OpenAIServer, *, host: str = "127.0.0.1", port: int = 8000, sock=None,
                stop: Optional[asyncio.Event] = None, grace_s: float = 30.0, on_ready=None,
                keepalive_s: float = KEEPALIVE_S) -> None:
    """Run until `stop` is set (or SIGTERM / SIGINT when stop is None): load check, warm-up, listen;
    then drain (`OpenAIServer.drain`) and close. A connection that completes no request's headers
    within keepalive_s of opening or of its last response is closed."""
    if not keepalive_s > 0:
        raise ValueError(f"keepalive_s must be > 0, got {keepalive_s!r}")
    loop = asyncio.get_running_loop()
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    runner = _Runner(
        server.app(),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=CLOSE_S,
        keepalive_timeout=keepalive_s,
    )
    await runner.setup()
    site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ListenError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        await server.start()
        log.info("serving %s on %s", server.model_name, site.name)
        if on_ready is not None:
            on_ready()
        await stop.wait()
        log.info("stopping: no new requests; %d in flight get %.0fs", server.active, grace_s)
        await server.drain(grace_s)
    finally:
        server.async_llm.shutdown()
        await runner.cleanup()


def _longest_token(tokenizer) -> Optional[int]:
    """Bytes one token may stand for at most (1 without a tokenizer: ids only; None: unknown)."""
    if tokenizer is None:
        return 1
    ranks = getattr(tokenizer, "mergeable_ranks", None)
    if not ranks:
        return None
    special = getattr(tokenizer, "special_tokens", None) or {}
    return max([len(b) for b in ranks] + [len(t.encode()) for t in special])
