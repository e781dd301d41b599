"""JSONL batch jobs in the OpenAI Batch format: input lines -> requests, results -> output lines,
resuming.

Input lines are the OpenAI Batch format
  {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...],
  ...}}
(without `url` the body's `messages` / `prompt` picks it) or a plain completions body; bodies are
parsed by the server's request model, so each is accepted or refused exactly as the server would.

Every input line gets exactly one output line, OpenAI's batch output:
  {"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"},
  "error"}
with the body (200) or the API's error body (400 / 404 refused, 500 failed while running). A line
that is not a request at all (malformed JSON, a bad url, a repeated custom_id, ...) gets `response`
null and the top-level `error`; a line without a custom_id answers as `line-<number>`. Output is
appended and fsynced line by line, so a rerun after Ctrl-C or kill -9 skips the lines already
written.

`run_job` feeds lines to one continuous-batching engine; a step that raises is rerun request by
request, so the request that fails alone gets a 500 and the others their results.
"""
# Over 600 lines: kimi-batch whole: its input reader, request checks, resume, summary.
from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import json
import os
import re
import stat
import sys
import uuid
from typing import Iterable, Optional, Union

from kimi_jax.entrypoints.openai import intake, protocol as P

ROUTES = {"/v1/chat/completions": P.parse_chat, "/v1/completions": P.parse_completion}
ENVELOPE_KEYS = {"custom_id", "method", "url", "body"}
DUPLICATE = "duplicate_custom_id"
MAX_DEPTH = intake.MAX_DEPTH + 1          # the envelope adds one level to the body's
MAX_LINE_BYTES = intake.RequestLimits().max_body_bytes + 4096  # the server's body limit + envelope
MAX_RUN_ON = 2**30
_AUTO_ID = re.compile(r"line-[0-9]+")


class LineError(ValueError):
    """An input line that is not a request at all (the top-level error of its output line)."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Line:
    """One input line read as a request: its custom_id, route and body (not yet checked)."""
    custom_id: str
    lineno: int
    url: str
    body: dict


def load_json(line: Union[str, bytes], lineno: int):
    """One line's JSON value; LineError for invalid UTF-8, bad JSON or nesting beyond MAX_DEPTH."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LineError(
                f"line {lineno}: not valid UTF-8 (byte 0x{line[e.start]:02x} at offset {e.start})"
            ) from None
    if lineno == 1:
        line = line.removeprefix("\ufeff")        # a byte order mark some editors write
    try:
        return intake.loads(line, MAX_DEPTH)
    except json.JSONDecodeError as e:
        raise LineError(f"line {lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    except (intake.TooDeep, intake.NumberTooLong) as e:
        raise LineError(f"line {lineno}: {e}") from None


def read_line(line: Union[str, bytes], lineno: int) -> Line:
    """The envelope of one input line; LineError when it is not a request at all."""
    obj = load_json(line, lineno)
    if not isinstance(obj, dict):
        raise LineError(f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
    envelope = bool({"body", "url", "method"} & set(obj))
    cid = obj.get("custom_id", None if envelope else f"line-{lineno}")
    if cid is None:
        raise LineError(f"line {lineno}: 'custom_id' is required")
    if not isinstance(cid, str) or not cid:
        raise LineError(f"line {lineno}: custom_id must be a non-empty string")
    if _AUTO_ID.fullmatch(cid) and cid != f"line-{lineno}":
        raise LineError(
            f"line {lineno}: custom_id {cid!r} is the automatic id of another line "
            "(line-<number> is reserved for lines without a custom_id)",
            "reserved_custom_id",
        )
    if not envelope:
        body = {k: v for k, v in obj.items() if k != "custom_id"}
        return Line(
            cid, lineno, "/v1/chat/completions" if "messages" in body else "/v1/completions", body
        )
    unknown = sorted(set(obj) - ENVELOPE_KEYS)
    if unknown:
        raise LineError(
            f"line {lineno}: unknown field(s) {unknown} (a line has {sorted(ENVELOPE_KEYS)})"
        )
    method = obj.get("method", "POST")
    if method != "POST":
        raise LineError(
            f"line {lineno}: method {_one_line(json.dumps(method), 40)} is not supported "
            "(only POST)",
            "invalid_method",
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(f"line {lineno}: 'body' must be a JSON object")
    url = obj.get("url", "/v1/chat/completions" if "messages" in body else "/v1/completions")
    if url not in ROUTES:
        raise LineError(f"line {lineno}: url {_one_line(json.dumps(url), 60)} is not served "
                        f"(one of {sorted(ROUTES)})", "invalid_url")
    return Line(cid, lineno, url, body)


def parse_body(ln: Line, default_max_tokens: int) -> tuple[P.GenerationRequest, bool]:
    """(the line's GenerationRequest (ProtocolError as the server raises it), max_tokens is the
    default)."""
    body = ln.body
    defaulted = isinstance(body, dict) and body.get("max_tokens") is None \
        and body.get("max_completion_tokens") is None
    if defaulted:
        body = {**body, "max_tokens": default_max_tokens}
    return ROUTES[ln.url](body), defaulted


def fit_default_max_tokens(
    g: P.GenerationRequest, n_prompt: int, limit: int
) -> P.GenerationRequest:
    """A defaulted max_tokens cut to what the context leaves after the prompt, as the server's."""
    room = limit - n_prompt
    if 1 <= room < g.params.max_tokens:
        g = dataclasses.replace(g, params=dataclasses.replace(g.params, max_tokens=room))
    return g


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def custom_id_of(line: Union[str, bytes], lineno: int) -> str:
    """The custom_id a line reports under, even when the line is broken."""
    own, replaced = f"line-{lineno}", False
    if isinstance(line, bytes):               # a bad byte elsewhere on the line keeps its custom_id
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError:
            line, replaced = line.decode("utf-8", "replace"), True
    try:
        obj = load_json(line, lineno)
    except LineError:
        return own
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    ok = (
        isinstance(cid, str)
        and cid
        and not _AUTO_ID.fullmatch(cid)
        and not (replaced and "\ufffd" in cid)
    )
    return cid if ok else own


def _ids() -> tuple[str, str]:
    return "batch_req_" + uuid.uuid4().hex, "req_" + uuid.uuid4().hex


def response_line(custom_id: str, status_code: int, body: dict) -> dict:
    """An output line carrying an HTTP response: a completion body, or the API's error body."""
    line_id, request_id = _ids()
    return {
        "id": line_id,
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def refused_line(custom_id: str, e: P.ProtocolError) -> dict:
    return response_line(custom_id, e.status, e.body())


def failed_line(custom_id: str, message: str) -> dict:
    return response_line(custom_id, 500, P.error_body(message, "server_error"))


def error_line(custom_id: str, message: str, code: str = "invalid_request") -> dict:
    line_id, _ = _ids()
    return {
        "id": line_id,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def result_body(
    g: P.GenerationRequest, model: str, choices: list, n_prompt: int, tokenizer
) -> dict:
    """The completion / chat-completion body, built as the server builds it."""
    use = P.usage(n_prompt, sum(len(c.token_ids) for c in choices))
    build = P.chat_response if g.kind == "chat" else P.completion_response
    return build(P.new_id(g.kind), P.now(), model, choices, use, tokenizer, g.logprobs)


class OutputFileError(ValueError):
    """An output file kimi-batch cannot append to (not its own results, or not writable)."""


class OutputWriteError(OSError):
    """Writing an output line failed (disk full, a closed pipe): the job stops, nothing is lost."""


class ResultWriter:
    """Appends output lines durably and knows which input lines are already done: `done` holds the
    custom_ids answered (a line's own result or error), `duplicates[cid]` how many repeats of cid
    were reported. A regular file is locked (one job at a time), recovered and fsynced; a pipe or
    device (/dev/stdout, /dev/full) is written as is, unbuffered."""

    def __init__(self, path: str):
        self.path = path
        self.done: set[str] = set()
        self.duplicates: collections.Counter = collections.Counter()
        self.written = 0
        self._fd = -1
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self.regular = stat.S_ISREG(os.fstat(self._fd).st_mode)
            if self.regular:
                self._lock()
                self._recover()
        except OSError as e:
            self._close_fd()
            raise OutputFileError(
                f"{path}: cannot write the output file ({e.strerror or e})"
            ) from None
        except OutputFileError:
            self._close_fd()
            raise

    def _lock(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise OutputFileError(
                    f"{self.path}: another kimi-batch job is writing this output file"
                ) from None
            # a file system without locks (some network mounts): written unlocked

    def _recover(self) -> None:
        keep = 0
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(iter(f.readline, b""), start=1):
                if not raw.endswith(b"\n"):
                    break                       # a torn last line (kill -9 mid-write) is dropped
                self._recover_line(raw, lineno)
                keep += len(raw)
        if keep < os.path.getsize(self.path):
            os.truncate(self.path, keep)

    def _recover_line(self, raw: bytes, lineno: int) -> None:
        try:
            obj = json.loads(raw)
            ok = (isinstance(obj, dict) and isinstance(obj.get("custom_id"), str)
                  and {"response", "error"} <= obj.keys())
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            raise OutputFileError(
                f"{self.path}:{lineno}: the output file holds a line that is not a "
                f"kimi-batch result ({_one_line(raw[:80].decode('utf-8', 'replace'), 60)}); "
                "give another --output"
            )
        if isinstance(obj.get("error"), dict) and obj["error"].get("code") == DUPLICATE:
            self.duplicates[obj["custom_id"]] += 1
        else:
            self.done.add(obj["custom_id"])

    def write(self, record: dict, duplicate: bool = False) -> None:
        cid = record["custom_id"]
        if not duplicate and cid in self.done:
            return
        try:
            text = json.dumps(record, ensure_ascii=False).encode("utf-8")
        # a lone surrogate (from a \ud800 escape) stays escaped
        except UnicodeEncodeError:
            text = json.dumps(record).encode("ascii")
        data = memoryview(text + b"\n")
        try:
            while data:
                data = data[os.write(self._fd, data):]
            if self.regular:
                os.fsync(self._fd)
        except OSError as e:
            raise OutputWriteError(
                e.errno, f"{self.path}: cannot write ({e.strerror or e})"
            ) from None
        self.written += 1
        if duplicate:
            self.duplicates[cid] += 1
        else:
            self.done.add(cid)

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        self._close_fd()


def count_lines(path: str) -> int:
    """Non-blank lines of an input file (the job's total), read in blocks (lines of any size)."""
    n, content = 0, False
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            *ended, last = block.split(b"\n")
            for piece in ended:
                n += content or bool(piece.strip())
                content = False
            content = content or bool(last.strip())
    return n + content


class TooLong:
    """An input line of more than MAX_LINE_BYTES (its bytes were read in pieces and dropped);
    `endless` when it ran on past MAX_RUN_ON bytes, where reading stops (a device: /dev/zero)."""

    def __init__(self, size: int, endless: bool = False):
        self.size, self.endless = size, endless

    def strip(self) -> bool:
        return True


def input_lines(infile, max_bytes: Optional[int] = None):
    """(line number, line) of an open input file; a line longer than max_bytes as TooLong."""
    max_bytes, lineno = max_bytes or MAX_LINE_BYTES, 0
    while line := infile.readline(max_bytes + 1):
        lineno += 1
        if len(line) > max_bytes and not line.endswith(b"\n" if isinstance(line, bytes) else "\n"):
            size = len(line)
            while (rest := infile.readline(1 << 20)) and size <= MAX_RUN_ON:
                size += len(rest)
                if rest.endswith(b"\n" if isinstance(rest, bytes) else "\n"):
                    break
            line = TooLong(size, size > MAX_RUN_ON)
        yield lineno, line
        if isinstance(line, TooLong) and line.endless:
            return


def _failure(lineno: int, e: BaseException, when: str = "while running") -> str:
    return (
        f"line {lineno}: request failed {when}: {type(e).__name__}: "
        f"{' '.join(str(e).split())[:300]}"
    )


@dataclasses.dataclass
class _Job:
    line: Line
    g: P.GenerationRequest
    prompts: list                    # (prompt text or None, token ids) per prompt
    seed: int
    choices: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class JobSummary:
    """What a job did: output lines by kind (ok / refused / errors / skipped) and the engines' stats
    summed (generated_tokens, prefix_cache_queries, prefix_cache_hits, ...)."""
    total: int
    counts: collections.Counter
    stats: collections.Counter

    def line(self, output: str) -> str:
        c, t = self.counts, self.stats
        q, h = t["prefix_cache_queries"], t["prefix_cache_hits"]
        rate = f"{h / q:.1%}" if q else "n/a"
        return (
            f"{c['ok']} results, {c['refused']} refused, {c['errors']} errors, {c['skipped']} "
            f"already done, of {self.total} lines, in {output}; {t['generated_tokens']} tokens "
            f"generated; prefix cache hit rate {rate} ({h} of {q} prompt tokens)"
        )


def run_job(
    frontend,
    infile: Iterable[Union[str, bytes]],
    writer: ResultWriter,
    *,
    model_name: str,
    default_max_tokens: int,
    total: Optional[int] = None,
    progress: bool = True,
    desc: str = "kimi-batch",
) -> JobSummary:
    """Answer every line of `infile` (an open input file, binary or text) into `writer` with engine
    cores over `frontend` (kimi_jax.entrypoints.frontend.Frontend),
    skipping the custom_ids the writer already holds; closes the writer. With
    EngineConfig.precompile the first core's program set is compiled before any line runs.
    OutputWriteError (an OSError) stops the job at the first line that cannot be written."""
    from tqdm import tqdm

    from kimi_jax.engine.validation import RequestError

    inputs = frontend.inputs
    engine = [frontend.make_core()]
    if frontend.engine_config.precompile:              # the program set before the first line
        try:
            frontend.precompile(engine[0])
        except BaseException:
            writer.close()
            raise
    jobs: dict[str, _Job] = {}            # custom_id -> its job, until its output line is written
    by_rid: dict[str, tuple] = {}         # sample id -> (custom_id, choice index)
    seen: collections.Counter = collections.Counter()
    lines = input_lines(infile)
    totals: collections.Counter = collections.Counter()     # the stats of every engine the job used
    bar = tqdm(total=total, desc=desc, unit="line", disable=not progress, file=sys.stderr)
    counts: collections.Counter = collections.Counter()     # ok / refused / errors / skipped

    def write(record: dict, kind: str, duplicate: bool = False) -> None:
        writer.write(record, duplicate=duplicate)
        counts[kind] += 1
        bar.update(1)
        bar.set_postfix(errors=counts["refused"] + counts["errors"], refresh=False)

    def requests(cid: str, core) -> list:
        """Each prompt's samples (one prompt's n share its prefill)."""
        job = jobs[cid]
        out = []
        for i, (text, ids) in enumerate(job.prompts):
            samples = core.make_request(f"{job.line.lineno}-{i}", ids, job.g.params, seed=job.seed,
                                        prompt=text)
            for j, r in enumerate(samples):
                by_rid[r.request_id] = (cid, i * job.g.n + j)
            out.append(samples)
        return out

    def prepare(ln: Line) -> _Job:
        g, defaulted = parse_body(ln, default_max_tokens)
        P.check_model(g.model, [model_name])
        field = "messages" if g.kind == "chat" else "prompt"
        try:
            if g.kind == "chat":
                prompts = [
                    (
                        None,
                        inputs.encode_chat(
                            g.messages, add_generation_prompt=g.add_generation_prompt, tools=g.tools
                        ),
                    )
                ]
            else:
                prompts = [(p if isinstance(p, str) else None,
                            inputs.token_ids(list(p) if isinstance(p, tuple) else p, ln.lineno))
                           for p in g.prompts]
        except ValueError as e:
            raise P.ProtocolError(" ".join(str(e).split()), field) from None
        if defaulted:
            g = fit_default_max_tokens(
                g, max(len(ids) for _, ids in prompts), frontend.max_model_len
            )
        for _, ids in prompts:
            P.check_context(len(ids), g.params.max_tokens, frontend.max_model_len, g.kind)
        seed = g.params.seed if g.params.seed is not None else ln.lineno
        return _Job(ln, g, prompts, seed)

    def feed() -> bool:
        """Add input lines until a batch's worth is waiting; False when the input is exhausted."""
        be = engine[0]
        while len(be.scheduler.waiting) < be.scheduler.max_num_seqs:
            try:
                lineno, line = next(lines)
            except StopIteration:
                return False
            if not line.strip():
                continue
            try:
                if isinstance(line, TooLong) and line.endless:
                    raise LineError(
                        f"line {lineno}: more than {MAX_RUN_ON} bytes without a newline; the "
                        "input is not read further",
                        "input_not_lines",
                    )
                if isinstance(line, TooLong):
                    raise LineError(f"line {lineno}: {line.size} bytes, more than {MAX_LINE_BYTES}")
                ln, err = read_line(line, lineno), None
                cid = ln.custom_id
            except LineError as e:
                ln, err = None, e
                cid = f"line-{lineno}" if isinstance(line, TooLong) else custom_id_of(line, lineno)
            seen[cid] += 1
            # a repeat: an error under its own custom_id, the first one runs
            if seen[cid] > 1:
                if writer.duplicates[cid] < seen[cid] - 1:
                    write(
                        error_line(
                            cid,
                            f"line {lineno}: duplicate custom_id {cid!r} (an earlier line has it)",
                            DUPLICATE,
                        ),
                        "errors",
                        duplicate=True,
                    )
                else:
                    counts["skipped"] += 1
                    bar.update(1)
                continue
            if cid in writer.done:
                counts["skipped"] += 1
                bar.update(1)
                continue
            if err is not None:
                write(error_line(cid, str(err), err.code), "errors")
                continue
            try:
                jobs[cid] = prepare(ln)
                reqs = requests(cid, be)
            except (P.ProtocolError, RequestError) as e:
                job = jobs.pop(cid, None)
                # the engine refused it: a grammar, a value
                if not isinstance(e, P.ProtocolError):
                    e = P.request_error(
                        job.g if job else None,
                        e,
                        "messages" if ln.url.endswith("chat/completions") else "prompt",
                    )
                write(refused_line(cid, e), "refused")
                continue
            except OutputWriteError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure of one line is that line's error
                jobs.pop(cid, None)
                write(failed_line(cid, _failure(lineno, e, "while being read")), "errors")
                continue
            for samples in reqs:
                be.add(samples)
        return True

    def on_finish(r) -> None:
        cid, k = by_rid.pop(r.request_id)
        job = jobs.get(cid)
        if job is None:
            return
        out = frontend.outputs.completion(k, r)
        job.choices[k] = P.Choice(
            k, out.text or "", out.token_ids, out.finish_reason, out.stop_reason, out.logprobs
        )
        if job.g.kind == "chat" and job.g.tools and frontend.tokenizer is not None:
            P.with_tool_calls(job.choices[k], frontend.tokenizer)      # message.tool_calls
        if len(job.choices) == len(job.prompts) * job.g.n:
            choices = [job.choices[i] for i in sorted(job.choices)]
            n_prompt = sum(len(ids) for _, ids in job.prompts)
            body = result_body(job.g, model_name, choices, n_prompt, frontend.tokenizer)
            write(response_line(cid, 200, body), "ok")
            del jobs[cid]

    def used(be) -> None:
        totals.update({k: v for k, v in be.stats.items() if isinstance(v, (int, float))})

    def rerun_alone(cids) -> None:
        """Each request of a failed step on a fresh pool; one that fails alone gets its error."""
        for cid in cids:
            solo = frontend.make_core()
            jobs[cid].choices.clear()
            try:
                for samples in requests(cid, solo):
                    solo.add(samples)
                solo.run(on_finish=on_finish)
            except OutputWriteError:
                raise
            except Exception as e:  # noqa: BLE001
                write(failed_line(cid, _failure(jobs[cid].line.lineno, e)), "errors")
                jobs.pop(cid, None)
            used(solo)

    try:
        while True:
            be = engine[0]
            try:
                be.run(on_finish=on_finish, feed=feed)
                used(be)
                break
            except OutputWriteError:
                raise
            except Exception:  # noqa: BLE001 - some request broke a step: find it, keep the others
                used(be)
                engine[0] = frontend.make_core()
                rerun_alone(list(jobs))
        for cid in list(jobs):  # none expected: every request reached on_finish
            write(
                failed_line(cid, f"line {jobs[cid].line.lineno}: the request did not finish"),
                "errors",
            )
    finally:
        writer.close()
        bar.close()
    return JobSummary(total if total is not None else sum(counts.values()), counts, totals)
