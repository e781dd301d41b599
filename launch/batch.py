"""kimi-batch: offline inference over a JSONL file in the OpenAI Batch format.

  kimi-batch --input requests.jsonl --output results.jsonl [--model DIR] [layout flags]

Each line's body is parsed and answered as kimi-serve answers it (/v1/chat/completions or
/v1/completions, by the line's url): one output line per input line, OpenAI's batch output
({"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}), written as it
finishes. A request the server would refuse gets its status code and OpenAI error body; a line that is
not a request (malformed JSON, no custom_id, a bad url or method, a repeated custom_id) the top-level
error. Every failure of a line becomes that line's output, whether found when the line is read or
while it runs (a step that raises is rerun request by request on a fresh page pool: the request that
fails alone gets a 500, the others their results), so the job always completes and a rerun never
meets the same failure again. Rerunning the same command after an interruption skips finished lines
and does the rest. The summary gives the prefix cache hit rate (prompt tokens found cached / looked up).
"""
from __future__ import annotations

import os
import sys

from absl import flags

from launch import common

flags.DEFINE_string("input", None, "input JSONL file (-i, as vLLM's run-batch)", required=True,
                    short_name="i")
flags.DEFINE_string("output", None, "output JSONL file (appended; existing ids are skipped; -o)",
                    required=True, short_name="o")
flags.DEFINE_string("model", None, "checkpoint directory or preset (default: the demo model)")
flags.DEFINE_string("served_model_name", None, "the model name of the responses and the one a body's 'model' "
                    "must match (default: --model, else 'kimi-jax-demo')")
flags.DEFINE_enum("dtype", "auto", ["auto", "bfloat16", "float32"], common.DTYPE_HELP)
flags.DEFINE_integer("max_num_seqs", 64, "requests decoded together")
flags.DEFINE_integer("max_model_len", None, "longest prompt + output")
flags.DEFINE_integer("default_max_tokens", 256, "max_tokens for lines that give none")
flags.DEFINE_bool("precompile", False, "compile every program the limits can reach before the first line "
                  "runs (README 'Start-up')")
FLAGS = flags.FLAGS


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def main(argv):
    del argv
    common.setup()
    from kimi_jax.entrypoints import batch as B
    from kimi_jax.entrypoints.frontend import Frontend

    if _same_file(FLAGS.input, FLAGS.output):
        common.fail("kimi-batch", f"--output {FLAGS.output} is the input file; give another path")
    try:
        infile = open(FLAGS.input, "rb")      # each line decoded on its own: one bad byte, one error line
        total = B.count_lines(FLAGS.input) if os.path.isfile(FLAGS.input) else None   # a pipe is read once
    except OSError as e:
        common.fail("kimi-batch", f"--input {FLAGS.input}: {e.strerror}")
    try:
        writer = B.ResultWriter(FLAGS.output)
    except B.OutputFileError as e:
        common.fail("kimi-batch", f"--output {e}")
    try:
        frontend = Frontend.from_config(common.engine_config())
    except (*common.user_errors(), ValueError) as e:
        writer.close()                         # its lock goes with it
        common.fail("kimi-batch", e)
    model_name = FLAGS.served_model_name or FLAGS.model or "kimi-jax-demo"
    try:
        with infile:
            summary = B.run_job(frontend, infile, writer, model_name=model_name,
                                default_max_tokens=FLAGS.default_max_tokens, total=total,
                                progress=FLAGS.progress is not False)
    except B.OutputWriteError as e:
        resume = f"; {writer.written} lines written, rerun to finish" if writer.regular else ""
        common.fail("kimi-batch", f"--output {e.strerror}{resume}")
    except OSError as e:
        common.fail("kimi-batch", f"--output {FLAGS.output}: cannot write ({e.strerror or e})")
    print(f"kimi-batch: {summary.line(FLAGS.output)}", file=sys.stderr)


def run(argv=None):
    """Console-script entry point (`kimi-batch`)."""
    common.run(main, "kimi-batch", __name__, __doc__, argv=argv)


if __name__ == "__main__":
    run()
