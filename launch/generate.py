r"""kimi-generate: continue a prompt, or answer a chat, with a kimi_jax model.

With no flags it loads the shipped demo model (checkpoints/demo, a small Kimi-K2-architecture model
trained by launch/train_demo.py) and prints a continuation of a default prompt, on whatever JAX
backend is present (the CPU is enough).

  kimi-generate                                        # the demo model, default prompt
  kimi-generate --prompt "The with statement" --max-tokens 64 --temperature 0
  kimi-generate --messages '[{"role": "user", "content": "What does json.dumps do?"}]'
  kimi-generate --model /path/to/Kimi-K2.5 --tensor-parallel-size 8 --stream

Plain prompts print the prompt followed by its continuation; chat prints the assistant's reply.
Sampling flags follow vLLM's SamplingParams (flag names in either spelling: --max-tokens or
--max_tokens). A bad flag or value prints one line (`kimi-generate: error: ...`) to stderr and exits
with status 2. Compiled programs are kept in a persistent cache (--compilation-cache-dir), so the
second run starts faster; loading and compiling are reported on stderr (--no-progress: quiet).
"""
from __future__ import annotations

import json
import sys
import time

from absl import flags, logging

from launch import common

PROG = "kimi-generate"
DEFAULT_PROMPT = "The with statement"

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Define the CLI's own flags (the layout, XLA and multi-host flags come from launch.common)."""
    if "max_tokens" in FLAGS:
        return
    flags.DEFINE_string("model", None, "Checkpoint directory or preset name; default: the shipped demo model.")
    flags.DEFINE_string("prompt", None, f"Text to continue (default {DEFAULT_PROMPT!r}).")
    flags.DEFINE_string("messages", None, "Chat messages as a JSON list of {role, content} objects (or "
                        "@FILE holding one); the reply is generated with the checkpoint's chat template.")
    flags.DEFINE_integer("max_tokens", 64, "Maximum number of tokens to generate.")
    flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 is greedy.")
    flags.DEFINE_float("top_p", 0.95, "Nucleus sampling: smallest set of tokens with this probability mass.")
    flags.DEFINE_integer("top_k", -1, "Sample among the k most likely tokens (-1: off).")
    flags.DEFINE_float("min_p", 0.0, "Drop tokens less likely than min_p times the most likely one.")
    flags.DEFINE_integer("seed", 0, "Sampling seed (the same seed gives the same text).")
    flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"], common.DTYPE_HELP)
    flags.DEFINE_integer("max_model_len", None, "Longest prompt + output (default: the model's maximum).")
    flags.DEFINE_bool("stream", False, "Print the text piece by piece as tokens are decoded.")
    flags.DEFINE_bool("ignore_eos", False, "Keep generating past the end-of-text / end-of-turn tokens.")


class CliError(Exception):
    """A user error: reported as one line, exit status 2."""


def _fail(message: str) -> None:
    common.fail(PROG, message)



def _messages(value: str):
    if value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as f:
                value = f.read()
        except OSError as e:
            raise CliError(f"--messages: cannot read {value[1:]}: {e.strerror}") from None
    try:
        msgs = json.loads(value)
    except json.JSONDecodeError as e:
        raise CliError(f"--messages is not valid JSON: {e}") from None
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise CliError("--messages must be a non-empty JSON list of {\"role\": ..., \"content\": ...} objects")
    return msgs


def _sampling_params():
    from kimi_jax.engine.sampling import SamplingParams
    try:
        return SamplingParams(temperature=FLAGS.temperature, top_p=FLAGS.top_p, top_k=FLAGS.top_k,
                              min_p=FLAGS.min_p, max_tokens=FLAGS.max_tokens, seed=FLAGS.seed,
                              ignore_eos=FLAGS.ignore_eos)
    except ValueError as e:
        raise CliError(f"--{e}") from None


def _load():
    from kimi_jax.entrypoints.llm import LLM
    try:
        # one request: on CPU this also sizes the page pool for one sequence
        return LLM.from_config(common.engine_config(max_num_seqs=1))
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        # ValueError covers ConfigError, CheckpointError and TokenizerError: a bad --model or layout
        raise CliError(str(e)) from None


def _emit(text: str, end: str = "") -> None:
    sys.stdout.write(text + end)
    sys.stdout.flush()


def generate() -> None:
    if FLAGS.prompt is not None and FLAGS.messages is not None:
        raise CliError("give --prompt or --messages, not both")
    if FLAGS.prompt is not None and not FLAGS.prompt:
        raise CliError("--prompt is empty")
    messages = _messages(FLAGS.messages) if FLAGS.messages is not None else None
    sp = _sampling_params()
    t0 = time.time()
    llm = _load()
    if llm.tokenizer is None:
        raise CliError(f"model {FLAGS.model!r} has no tokenizer (tiktoken.model); kimi-generate needs text")
    logging.info("loaded %s (%s) in %.1fs", llm.model_path or FLAGS.model, llm.dtype.__name__, time.time() - t0)
    prompt = DEFAULT_PROMPT if FLAGS.prompt is None and messages is None else FLAGS.prompt
    try:
        if FLAGS.stream:
            completion = _stream(llm, prompt, messages, sp)
        elif messages is not None:
            completion = llm.chat(messages, sp, use_tqdm=False)[0].outputs[0]
            _emit(completion.text or "", "\n")
        else:
            completion = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
            _emit(prompt + (completion.text or ""), "\n")
    except ValueError as e:          # prompt too long for max_model_len, a bad chat message, ...
        raise CliError(str(e)) from None
    logging.info("%d tokens, finish_reason=%s, %.1fs total", len(completion.token_ids),
                 completion.finish_reason, time.time() - t0)


def _stream(llm, prompt, messages, sp):
    """Generate one request step by step on LLM's engine core, printing text as tokens arrive
    (through the streaming detokenizer, which never splits a UTF-8 character)."""
    if messages is not None:
        ids = llm.encode_chat(messages)
    else:
        ids = llm.tokenizer.encode(prompt)
    engine = llm.engine_core()
    [req] = engine.add_request("0", ids, sp, prompt=prompt)    # raises on a bad request
    from kimi_jax.entrypoints import progress
    progress.pause()                 # the text goes to the same terminal from here on
    if messages is None:
        _emit(prompt)
    dec = llm.tokenizer.incremental_decoder(skip_special_tokens=True)
    seen = 0
    while engine.has_unfinished():
        engine.step()
        _emit(dec.feed_many(req.output_ids[seen:]))
        seen = len(req.output_ids)
    _emit(dec.flush(), "\n")
    return llm.outputs.completion(0, req)


def main(argv):
    del argv
    common.setup()
    try:
        generate()
    except CliError as e:
        _fail(str(e))


def run(argv=None):
    """Console-script entry point (`kimi-generate`)."""
    define_flags()
    common.run(main, PROG, __name__, __doc__, argv=argv, positional_hint=" (use --prompt)")


if __name__ == "__main__":
    run()
