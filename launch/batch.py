"""kimi-batch: offline inference over a JSONL file (OpenAI Batch API format or {"prompt": ...}).

  kimi-batch --input requests.jsonl --output results.jsonl [--model DIR] [layout flags]

Results are written as they finish, one line per input line (a result or an error object, with its
custom_id). Every failure of a line becomes that line's error object, whether found when the line is
read or while it runs (a step that raises is rerun request by request on a fresh page pool: the
request that fails alone gets the error, the others their results), so the job always completes and
a rerun never meets the same failure again. Rerunning the same command after an interruption skips
finished ids and does the rest.
"""
from __future__ import annotations

import os
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


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def _failure(lineno: int, e: BaseException) -> str:
    return f"line {lineno}: request failed while running: {type(e).__name__}: {' '.join(str(e).split())[:300]}"


def main(argv):
    del argv
    common.setup()
    from kimi_jax import LLM
    from kimi_jax.entrypoints.batch import (Job, OutputFileError, ResultWriter, custom_id_of, error_line,
                                            parse_line, result_line)

    if _same_file(FLAGS.input, FLAGS.output):
        common.fail("kimi-batch", f"--output {FLAGS.output} is the input file; give another path")
    try:
        infile = open(FLAGS.input, encoding="utf-8")
    except OSError as e:
        common.fail("kimi-batch", f"--input {FLAGS.input}: {e.strerror}")
    try:
        writer = ResultWriter(FLAGS.output)
    except OutputFileError as e:
        common.fail("kimi-batch", f"--output {e}")
    try:
        llm = LLM(FLAGS.model, dtype=FLAGS.dtype, max_num_seqs=FLAGS.max_num_seqs,
                  max_model_len=FLAGS.max_model_len, **common.engine_kwargs())
    except (*common.user_errors(), ValueError) as e:
        common.fail("kimi-batch", e)
    model_name = FLAGS.model or "kimi-jax-demo"
    engine = [llm.batch_engine()]
    jobs: dict[str, Job] = {}
    made: dict[str, tuple] = {}          # custom_id -> (line number, token ids, seed): to rerun it alone
    seen: set[str] = set()
    lines = enumerate(infile, start=1)
    generated = [0]

    def request(cid: str, be):
        lineno, ids, seed = made[cid]
        job = jobs[cid]
        return be.make_request(cid, ids, job.params, seed, prompt=job.prompt if isinstance(job.prompt, str) else None)

    def feed() -> bool:
        """Add input lines until a batch's worth is waiting; False when the input is exhausted."""
        be = engine[0]
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
                ids = llm.encode_chat(job.messages) if job.kind == "chat" else llm.token_ids(job.prompt, lineno)
                seed = job.params.seed if job.params.seed is not None else lineno
                jobs[cid], made[cid] = job, (lineno, ids, seed)
                req = request(cid, be)
            except Exception as e:  # noqa: BLE001 - any failure of one line is that line's error
                jobs.pop(cid, None), made.pop(cid, None)
                msg = " ".join(str(e).split()) or type(e).__name__
                writer.write(error_line(cid, msg if msg.startswith("line ") else f"line {lineno}: {msg}"))
                continue
            be.add(req)
        return True

    def on_finish(r) -> None:
        out = llm.to_output(r).outputs[0]
        writer.write(result_line(jobs.pop(r.request_id), out.text, len(r.prompt_ids), out.token_ids,
                                 out.finish_reason, model_name))
        made.pop(r.request_id, None)

    def rerun_alone(cids) -> None:
        """Each request of a failed step on its own fresh pool; one that fails alone gets its error."""
        for cid in cids:
            solo = llm.batch_engine()
            try:
                solo.add(request(cid, solo))
                solo.run(on_finish=on_finish)
            except Exception as e:  # noqa: BLE001
                writer.write(error_line(cid, _failure(made[cid][0], e)))
                jobs.pop(cid, None), made.pop(cid, None)
            generated[0] += solo.stats["generated_tokens"]

    try:
        while True:
            be = engine[0]
            try:
                be.run(on_finish=on_finish, progress=FLAGS.progress is not False, feed=feed)
                generated[0] += be.stats["generated_tokens"]
                break
            except Exception:  # noqa: BLE001 - some request broke a step: find it, keep the others
                generated[0] += be.stats["generated_tokens"]
                engine[0] = llm.batch_engine()
                rerun_alone(list(jobs))
        for cid in list(jobs):           # none expected: every request reached on_finish
            writer.write(error_line(cid, f"line {made[cid][0]}: the request did not finish"))
    except OSError as e:
        common.fail("kimi-batch", f"--output {FLAGS.output}: cannot write ({e.strerror or e})")
    finally:
        writer.close()
    print(f"kimi-batch: {len(writer.done)} results in {FLAGS.output}; "
          f"{generated[0]} tokens generated", file=sys.stderr)


def run(argv=None):
    """Console-script entry point (`kimi-batch`)."""
    common.run(main, "kimi-batch", __name__, __doc__, argv=argv)


if __name__ == "__main__":
    run()
