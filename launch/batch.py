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

import collections
import dataclasses
import os
import sys
from typing import Any

from absl import flags

from launch import common

flags.DEFINE_string("input", None, "input JSONL file", required=True)
flags.DEFINE_string("output", None, "output JSONL file (appended; existing ids are skipped)", required=True)
flags.DEFINE_string("model", None, "checkpoint directory or preset (default: the demo model)")
flags.DEFINE_string("served_model_name", None, "the model name of the responses and the one a body's 'model' "
                    "must match (default: --model, else 'kimi-jax-demo')")
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


def _failure(lineno: int, e: BaseException, when: str = "while running") -> str:
    return f"line {lineno}: request failed {when}: {type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


@dataclasses.dataclass
class _Job:
    line: Any                        # kimi_jax.entrypoints.batch.Line
    g: Any                           # protocol.GenerationRequest
    prompts: list                    # (prompt text or None, token ids) per prompt
    seed: int
    choices: dict = dataclasses.field(default_factory=dict)


def main(argv):
    del argv
    common.setup()
    from tqdm import tqdm

    from kimi_jax import LLM
    from kimi_jax.engine.validation import RequestError
    from kimi_jax.entrypoints import batch as B
    from kimi_jax.entrypoints.openai import protocol as P

    if _same_file(FLAGS.input, FLAGS.output):
        common.fail("kimi-batch", f"--output {FLAGS.output} is the input file; give another path")
    try:
        infile = open(FLAGS.input, encoding="utf-8")
        total = _count_lines(FLAGS.input)
    except OSError as e:
        common.fail("kimi-batch", f"--input {FLAGS.input}: {e.strerror}")
    try:
        writer = B.ResultWriter(FLAGS.output)
    except B.OutputFileError as e:
        common.fail("kimi-batch", f"--output {e}")
    try:
        llm = LLM(FLAGS.model, dtype=FLAGS.dtype, max_num_seqs=FLAGS.max_num_seqs,
                  max_model_len=FLAGS.max_model_len, **common.engine_kwargs())
    except (*common.user_errors(), ValueError) as e:
        common.fail("kimi-batch", e)
    model_name = FLAGS.served_model_name or FLAGS.model or "kimi-jax-demo"
    engine = [llm.batch_engine()]
    jobs: dict[str, _Job] = {}            # custom_id -> its job, until its output line is written
    by_rid: dict[str, tuple] = {}         # engine request id -> (custom_id, choice index)
    seen: collections.Counter = collections.Counter()
    lines = enumerate(infile, start=1)
    totals = collections.Counter()        # the stats of every engine the job used
    bar = tqdm(total=total, desc="kimi-batch", unit="line", disable=FLAGS.progress is False, file=sys.stderr)
    counts = collections.Counter()        # ok / refused / errors / skipped

    def write(record: dict, kind: str, duplicate: bool = False) -> None:
        writer.write(record, duplicate=duplicate)
        counts[kind] += 1
        bar.update(1)
        bar.set_postfix(errors=counts["refused"] + counts["errors"], refresh=False)

    def requests(cid: str, be) -> list:
        job = jobs[cid]
        out = []
        for i, (text, ids) in enumerate(job.prompts):
            for j in range(job.g.n):
                k = i * job.g.n + j
                rid = f"{job.line.lineno}-{k}"
                by_rid[rid] = (cid, k)
                out.append(be.make_request(rid, ids, job.g.params, P.choice_seed(job.seed, j), prompt=text))
        return out

    def prepare(ln) -> _Job:
        g, defaulted = B.parse_body(ln, FLAGS.default_max_tokens)
        P.check_model(g.model, [model_name])
        field = "messages" if g.kind == "chat" else "prompt"
        try:
            if g.kind == "chat":
                prompts = [(None, llm.encode_chat(g.messages, add_generation_prompt=g.add_generation_prompt,
                                                  tools=g.tools))]
            else:
                prompts = [(p if isinstance(p, str) else None, llm.token_ids(list(p) if isinstance(p, tuple) else p,
                                                                            ln.lineno)) for p in g.prompts]
        except ValueError as e:
            raise P.ProtocolError(" ".join(str(e).split()), field) from None
        if defaulted:
            g = B.fit_default_max_tokens(g, max(len(ids) for _, ids in prompts), llm.max_model_len)
        for _, ids in prompts:
            P.check_context(len(ids), g.params.max_tokens, llm.max_model_len, g.kind)
        seed = g.params.seed if g.params.seed is not None else ln.lineno
        return _Job(ln, g, prompts, seed)

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
            try:
                ln, err = B.read_line(line, lineno), None
                cid = ln.custom_id
            except B.LineError as e:
                ln, err, cid = None, e, B.custom_id_of(line, lineno)
            seen[cid] += 1
            if seen[cid] > 1:            # a repeat: an error under its own custom_id, the first one runs
                if writer.duplicates[cid] < seen[cid] - 1:
                    write(B.error_line(cid, f"line {lineno}: duplicate custom_id {cid!r} (an earlier line has it)",
                                       B.DUPLICATE), "errors", duplicate=True)
                else:
                    counts["skipped"] += 1
                    bar.update(1)
                continue
            if cid in writer.done:
                counts["skipped"] += 1
                bar.update(1)
                continue
            if err is not None:
                write(B.error_line(cid, str(err), err.code), "errors")
                continue
            try:
                jobs[cid] = prepare(ln)
                reqs = requests(cid, be)
            except (P.ProtocolError, RequestError) as e:
                jobs.pop(cid, None)
                if not isinstance(e, P.ProtocolError):
                    e = P.ProtocolError(" ".join(str(e).split()), "messages" if ln.url.endswith("chat/completions")
                                        else "prompt")
                write(B.refused_line(cid, e), "refused")
                continue
            except Exception as e:  # noqa: BLE001 - any failure of one line is that line's error
                jobs.pop(cid, None)
                write(B.failed_line(cid, _failure(lineno, e, "while being read")), "errors")
                continue
            for r in reqs:
                be.add(r)
        return True

    def on_finish(r) -> None:
        cid, k = by_rid.pop(r.request_id)
        job = jobs.get(cid)
        if job is None:
            return
        out = llm.to_output(r).outputs[0]
        job.choices[k] = P.Choice(k, out.text or "", out.token_ids, out.finish_reason, out.stop_reason,
                                  out.logprobs)
        if job.g.kind == "chat" and job.g.tools and llm.tokenizer is not None:
            P.with_tool_calls(job.choices[k], llm.tokenizer)      # message.tool_calls
        if len(job.choices) == len(job.prompts) * job.g.n:
            choices = [job.choices[i] for i in sorted(job.choices)]
            n_prompt = sum(len(ids) for _, ids in job.prompts)
            body = B.result_body(job.g, model_name, choices, n_prompt, llm.tokenizer)
            write(B.response_line(cid, 200, body), "ok")
            del jobs[cid]

    def used(be) -> None:
        totals.update({k: v for k, v in be.stats.items() if isinstance(v, (int, float))})

    def rerun_alone(cids) -> None:
        """Each request of a failed step on its own fresh pool; one that fails alone gets its error."""
        for cid in cids:
            solo = llm.batch_engine()
            jobs[cid].choices.clear()
            try:
                for r in requests(cid, solo):
                    solo.add(r)
                solo.run(on_finish=on_finish)
            except Exception as e:  # noqa: BLE001
                write(B.failed_line(cid, _failure(jobs[cid].line.lineno, e)), "errors")
                jobs.pop(cid, None)
            used(solo)

    try:
        while True:
            be = engine[0]
            try:
                be.run(on_finish=on_finish, feed=feed)
                used(be)
                break
            except Exception:  # noqa: BLE001 - some request broke a step: find it, keep the others
                used(be)
                engine[0] = llm.batch_engine()
                rerun_alone(list(jobs))
        for cid in list(jobs):           # none expected: every request reached on_finish
            write(B.failed_line(cid, f"line {jobs[cid].line.lineno}: the request did not finish"), "errors")
    except OSError as e:
        common.fail("kimi-batch", f"--output {FLAGS.output}: cannot write ({e.strerror or e})")
    finally:
        writer.close()
        bar.close()
    q, h = totals["prefix_cache_queries"], totals["prefix_cache_hits"]
    rate = f"{h / q:.1%}" if q else "n/a"
    print(f"kimi-batch: {counts['ok']} results, {counts['refused']} refused, {counts['errors']} errors, "
          f"{counts['skipped']} already done, of {total} lines, in {FLAGS.output}; "
          f"{totals['generated_tokens']} tokens generated; prefix cache hit rate {rate} "
          f"({h} of {q} prompt tokens)", file=sys.stderr)


def run(argv=None):
    """Console-script entry point (`kimi-batch`)."""
    common.run(main, "kimi-batch", __name__, __doc__, argv=argv)


if __name__ == "__main__":
    run()
