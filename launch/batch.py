"""kimi-batch: offline inference over a JSONL file (OpenAI Batch API format or {"prompt": ...}).

  kimi-batch --input requests.jsonl --output results.jsonl [--model DIR] [layout flags]

Results are written as they finish, one line per input line (a result or an error object, with its
custom_id). Rerunning the same command after an interruption skips finished ids and does the rest.
"""
from __future__ import annotations

import sys

from absl import flags

from launch import common

flags.DEFINE_string("input", None, "input JSONL file", required=True)
flags.DEFINE_string("output", None, "output JSONL file (appended; existing ids are skipped)", required=True)
flags.DEFINE_string("model", None, "checkpoint directory or preset (default: the demo model)")
flags.DEFINE_enum("dtype", "float32", ["bfloat16", "float32"], "compute dtype")
flags.DEFINE_integer("max_num_seqs", 64, "requests decoded together")
flags.DEFINE_integer("max_model_len", None, "longest prompt + output")
flags.DEFINE_integer("default_max_tokens", 256, "max_tokens for lines that give none")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    common.setup()
    from kimi_jax import LLM
    from kimi_jax.entrypoints.batch import Job, LineError, ResultWriter, custom_id_of, error_line, parse_line, result_line
    from kimi_jax.engine.scheduler import RequestError

    try:
        infile = open(FLAGS.input, encoding="utf-8")
    except OSError as e:
        common.fail("kimi-batch", f"--input {FLAGS.input}: {e.strerror}")
    writer = ResultWriter(FLAGS.output)
    try:
        llm = LLM(FLAGS.model, dtype=FLAGS.dtype, max_num_seqs=FLAGS.max_num_seqs,
                  max_model_len=FLAGS.max_model_len, **common.engine_kwargs())
    except (*common.user_errors(), ValueError) as e:
        common.fail("kimi-batch", e)
    model_name = FLAGS.model or "kimi-jax-demo"
    be = llm.batch_engine()
    jobs: dict[str, Job] = {}
    seen: set[str] = set()
    lines = enumerate(infile, start=1)

    def feed() -> bool:
        """Add input lines until a batch's worth is waiting; False when the input is exhausted."""
        while len(be.waiting) < be.max_num_seqs:
            try:
                lineno, line = next(lines)
            except StopIteration:
                return False
            if not line.strip():
                continue
            cid = custom_id_of(line, lineno)
            if cid in seen:
                cid = f"line-{lineno}"
                if cid not in writer.done:
                    writer.write(error_line(cid, f"line {lineno}: duplicate custom_id {custom_id_of(line, lineno)!r}"))
                continue
            seen.add(cid)
            if cid in writer.done:
                continue
            try:
                job = parse_line(line, lineno, FLAGS.default_max_tokens)
                ids = (llm.tokenizer.encode(llm.render_chat(job.messages), allow_special=True)
                       if job.kind == "chat" else llm.token_ids(job.prompt, lineno))
                seed = job.params.seed if job.params.seed is not None else lineno
                req = be.make_request(cid, ids, job.params, seed,
                                      prompt=job.prompt if isinstance(job.prompt, str) else None)
            except (LineError, RequestError, ValueError) as e:
                msg = str(e) if str(e).startswith("line ") else f"line {lineno}: {e}"
                writer.write(error_line(cid, msg))
                continue
            jobs[cid] = job
            be.add(req)
        return True

    def on_finish(r) -> None:
        out = llm.to_output(r).outputs[0]
        writer.write(result_line(jobs.pop(r.request_id), out.text, len(r.prompt_ids), out.token_ids,
                                 out.finish_reason, model_name))

    try:
        be.run(on_finish=on_finish, progress=FLAGS.progress is not False, feed=feed)
    finally:
        writer.close()
    print(f"kimi-batch: {len(writer.done)} results in {FLAGS.output}; "
          f"{be.stats['generated_tokens']} tokens generated", file=sys.stderr)


def run(argv=None):
    """Console-script entry point (`kimi-batch`)."""
    common.run(main, "kimi-batch", __name__, __doc__, argv=argv)


if __name__ == "__main__":
    run()
