r"""kimi-serve: an OpenAI-compatible HTTP server (kimi_jax.entrypoints.openai.server).

  kimi-serve                                            # the demo model on 127.0.0.1:8000
  kimi-serve /path/to/Kimi-K2.5 --tensor_parallel_size 8 --max_num_seqs 64 --api_key KEY
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
       -d '{"model": "kimi-jax-demo", "prompt": "The with statement", "max_tokens": 32}'

Flags follow vLLM's names (block_size: tokens per cache page, num_gpu_blocks_override: cache pages,
async_scheduling: dispatch decode step N+1 before reading step N). It binds to 127.0.0.1 unless --host
says otherwise. SIGTERM / SIGINT stop admitting, give in-flight requests --shutdown_grace_s to finish,
abort the rest and exit 0. The model may be given positionally (`kimi-serve MODEL`, as vLLM's `vllm
serve MODEL`) or as --model. Each request is logged at INFO (--noaccess_log turns it off). A bad
flag or model prints one line (`kimi-serve: error: ...`), exit status 2. Unlike `LLM`, it runs the
ragged step layout by default (drafts of --speculative_config verified inside it) and compiles its
whole program set before /health answers 200 (--enforce_eager: programs compile on first use).
"""
from __future__ import annotations

import asyncio
import logging as pylogging
import os
import socket
import sys

from absl import flags, logging

from launch import common

PROG = "kimi-serve"
FLAGS = flags.FLAGS

flags.DEFINE_string("model", None, "checkpoint directory or preset name; default: the shipped demo model")
flags.DEFINE_string("served_model_name", None, "the model name clients send (default: 'kimi-jax-demo' for the "
                    "demo model, else --model)")
flags.DEFINE_string("host", "127.0.0.1", "address to bind (loopback unless told otherwise)")
flags.DEFINE_integer("port", 8000, "port to listen on")
flags.DEFINE_string("api_key", None, "require 'Authorization: Bearer KEY' on every route but /health, /metrics "
                    "and /version (default: env KIMI_JAX_API_KEY)")
flags.DEFINE_bool("access_log", True, "log one line per request (id, route, status, tokens, TTFT, total)")
flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"], common.DTYPE_HELP)
flags.DEFINE_integer("max_num_seqs", 64, "requests decoded together")
flags.DEFINE_integer("max_model_len", None, "longest prompt + output (default: the model's maximum)")
flags.DEFINE_integer("max_queue", 1024, "requests waiting for a slot before new ones get 429")
flags.DEFINE_float("gpu_memory_utilization", 0.9, "fraction of device memory for weights + cache")
flags.DEFINE_integer("block_size", 16, "tokens per cache page")
flags.DEFINE_integer("num_gpu_blocks_override", None, "cache pages (default: from free memory)")
flags.DEFINE_integer("seed", 0, "seed of the random weights (presets) and of requests that give none")
flags.DEFINE_string("tokenizer", None, "tokenizer directory (default: the model's)")
flags.DEFINE_string("speculative_config", None, "speculative decoding as JSON, e.g. "
                    "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'")
flags.DEFINE_bool("async_scheduling", True, "overlap scheduling (off with speculation)")
flags.DEFINE_bool("precompile", None, "compile every serving program the limits can reach before reporting "
                  "ready (Runner.programs; README 'Start-up'); default: on with the ragged step layout "
                  "unless --enforce_eager")
flags.DEFINE_float("shutdown_grace_s", 30.0, "seconds in-flight requests get to finish after SIGTERM")
flags.DEFINE_bool("metrics_need_key", False, "require the API key on /metrics too (it names the served model)")
flags.DEFINE_integer("max_body_bytes", 64 * 2**20, "largest request body (413 beyond)")
flags.DEFINE_integer("max_choices", 256, "most choices (prompts x n) one request may ask (400 beyond)")
# vLLM's launch flags, accepted with their meaning here: Kimi's tool calls and reasoning are parsed
flags.DEFINE_bool("trust_remote_code", False,
                  "accepted: no code from the checkpoint is ever run (LLM logs one warning)")
flags.DEFINE_bool("enable_auto_tool_choice", True,
                  "accepted: tool calls are always parsed (tool_choice auto)")
flags.DEFINE_string("tool_call_parser", "kimi_k2",
                    "accepted: kimi_k2 only (Kimi's tool-call section)")
flags.DEFINE_string("reasoning_parser", "kimi_k2",
                    "accepted: kimi_k2 only (the reply's reasoning_content)")
flags.DEFINE_bool("enforce_eager", False,
                  "programs compile on first use (no precompile before ready)")
flags.DEFINE_float("keepalive_s", 15.0, "close a connection that completes no request's headers this long "
                   "after opening or after its last response")
flags.DEFINE_integer("max_prompt_chars", 8 * 2**20, "longest text prompt / conversation in characters (400 beyond)")


def main(argv):
    if len(argv) > 1 and FLAGS.model is not None:
        common.fail(PROG, f"the model is given twice: positionally ({argv[1]!r}) and as --model={FLAGS.model!r}")
    model = argv[1] if len(argv) > 1 else FLAGS.model
    common.setup()
    from kimi_jax.entrypoints.frontend import Frontend
    from kimi_jax.entrypoints.openai.intake import RequestLimits
    from kimi_jax.entrypoints.openai.server import ListenError, OpenAIServer, serve
    if not 0 < FLAGS.port < 65536:
        common.fail(PROG, f"--port={FLAGS.port} is not a port number")
    if FLAGS.max_queue < 0:
        common.fail(PROG, f"--max_queue must be >= 0, got {FLAGS.max_queue}")
    if not FLAGS.shutdown_grace_s >= 0:
        common.fail(PROG, f"--shutdown_grace_s must be >= 0, got {FLAGS.shutdown_grace_s}")
    for name in ("tool_call_parser", "reasoning_parser"):
        if FLAGS[name].value != "kimi_k2":
            common.fail(PROG, f"--{name.replace('_', '-')}={FLAGS[name].value!r} is not supported: "
                        "only kimi_k2 (Kimi's format, always parsed)")
    if not FLAGS.enable_auto_tool_choice:
        common.fail(PROG, "--no-enable-auto-tool-choice is not supported: tool calls are always "
                    "parsed")
    if not FLAGS.keepalive_s > 0:
        common.fail(PROG, f"--keepalive_s must be > 0, got {FLAGS.keepalive_s}")
    try:
        limits = RequestLimits(max_body_bytes=FLAGS.max_body_bytes, max_choices=FLAGS.max_choices,
                               max_prompt_chars=FLAGS.max_prompt_chars)
    except ValueError as e:
        common.fail(PROG, f"--{e}")
    try:
        ec = common.engine_config(model=model, **serving_defaults())
    except (*common.user_errors(), ValueError, NotImplementedError, FileNotFoundError) as e:
        common.fail(PROG, e)
    sock = _bind(FLAGS.host, FLAGS.port)          # before the weights load: a taken port fails now
    try:
        frontend = Frontend.from_config(ec)
    except (*common.user_errors(), ValueError, NotImplementedError, FileNotFoundError) as e:
        common.fail(PROG, e)
    name = FLAGS.served_model_name or (model if model else "kimi-jax-demo")
    api_key = FLAGS.api_key or os.environ.get("KIMI_JAX_API_KEY") or None
    if FLAGS.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        logging.warning("listening on %s without --api_key: anyone who can reach it can use it", FLAGS.host)
    if FLAGS.access_log:    # absl puts the root logger at WARNING unless --verbosity is given
        pylogging.getLogger("kimi_jax.entrypoints.openai.server").setLevel(pylogging.INFO)
    server = OpenAIServer(frontend, served_model_name=name, api_key=api_key, max_queue=FLAGS.max_queue, limits=limits,
                          metrics_need_key=FLAGS.metrics_need_key, access_log=FLAGS.access_log)
    print(f"{PROG}: loading {name}; listening on http://{FLAGS.host}:{FLAGS.port}", file=sys.stderr, flush=True)
    try:
        asyncio.run(serve(server, sock=sock, grace_s=FLAGS.shutdown_grace_s, keepalive_s=FLAGS.keepalive_s,
                          on_ready=lambda: print(f"{PROG}: ready", file=sys.stderr, flush=True)))
    except ListenError as e:                # the port is taken, the address is not ours
        common.fail(PROG, e.strerror)
    print(f"{PROG}: stopped", file=sys.stderr, flush=True)


def serving_defaults() -> dict:
    """What kimi-serve sets where its flags are not given: the ragged step layout (its program set
    does not grow with the limits) and, with the ragged layout and unless --enforce_eager, its
    whole set compiled before ready (the padded set at serving limits is hundreds of programs:
    compiled on first use unless --precompile)."""
    out = {}
    if FLAGS.step_layout is None:
        out["step_layout"] = "ragged"
    if FLAGS.precompile is None:
        ragged = out.get("step_layout", FLAGS.step_layout) == "ragged"
        out["precompile"] = ragged and not FLAGS.enforce_eager
    return out


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (listening starts once the model is ready); one line naming --port
    when the address is taken or not this machine's."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        common.fail(PROG, f"--port={port}: cannot listen on {host}:{port}: {e.strerror or e}")
    return sock


def run(argv=None):
    """Console-script entry point (`kimi-serve`)."""
    pylogging.basicConfig(level=pylogging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    common.run(main, PROG, __name__, __doc__, argv=argv, positionals=1)


if __name__ == "__main__":
    run()
