"""Repository hygiene, without importing jax: every relative link in the tracked Markdown files resolves
to a tracked file or folder; no tracked code, doc or test file narrates history (sittings, numbered
rounds or issues, dated deadlines: git holds the history); no file cites the design documents that are
not in the repository."""
from __future__ import annotations

import bisect
import functools
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
THIS = pathlib.Path(__file__).resolve().relative_to(ROOT).as_posix()

# text files of the project: code, docs, tests, build and CI files (not checkpoint data: the demo model's
# training log quotes Python's documentation, whose words are not ours)
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".cfg", ".ini", ".txt", ".yml", ".yaml", ".jinja"}
DATA_DIRS = ("checkpoints/demo/",)

ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
            "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
            r"last|previous|next|this|that|same|earlier|later|\d+(?:st|nd|rd|th)")
HISTORY = [
    ("a numbered or relative sitting", re.compile(rf"\b(?:{ORDINALS})(?:\s+(?:device|GPU|CPU))?\s+sessions?\b", re.I)),
    ("a sitting", re.compile(r"\bsittings?\b", re.I)),
    ("a numbered round", re.compile(r"(?<![-_])\brounds?\s+\d+", re.I)),
    ("a numbered issue", re.compile(r"\bissues?\s+\d+", re.I)),
    ("a dated deadline", re.compile(r"\buntil\s+20\d\d-", re.I)),
    ("'previously'", re.compile(r"\bpreviously\b", re.I)),
    ("'new in'", re.compile(r"\bnew in\b", re.I)),
    ("a past version's value", re.compile(r"\bversion\s+\d+'s\s+(?:was|were)\b", re.I)),
]
# 'session' alone is history unless it is a library's session object or pytest's test session
SESSION = re.compile(r"\bsessions?\b", re.I)
SESSION_OK = re.compile(
    r"ClientSession|aiohttp|requests\.Session|\bHTTP\s+session|\bhttp\s+session|scope\s*=\s*[\"']session[\"']"
    r"|\btest\s+session\b|\bpytest\b.*\bsession\b"
    r"|\bsession(?:\.\w|\s*=|\s*[,)\]])|\(\s*session\b|\bas\s+session\b", re.I)
# what `joined` strips from the start of a line: indentation and a comment marker (#, //, /*, *, >)
LEAD = re.compile(r"^\s*(?:#+|//+|/\*+|\*+(?!/)|>+)?\s*")
ABSENT_DOCS = re.compile(r"\b(?:DESIGN|KIMI_FORMAT)\.md\b")

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


@functools.lru_cache(maxsize=None)
def tracked() -> tuple[str, ...]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:      # not a git checkout: nothing to check here
        pytest.skip(f"git ls-files failed: {e}")
    return tuple(p for p in out.decode().split("\0") if p)


def text_files() -> list[str]:
    return [p for p in tracked()
            if (pathlib.PurePosixPath(p).suffix in TEXT_SUFFIXES or p.startswith(".ci/"))
            and not p.startswith(DATA_DIRS) and (ROOT / p).is_file()]


def read(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8", errors="replace")


def markdown_links(text: str):
    """(line number, target) of every inline link or image outside fenced code blocks and code spans."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        for m in LINK.finditer(line):
            yield n, m.group(1) or m.group(2)


def test_relative_links_resolve():
    files = set(tracked())
    dirs = {str(pathlib.PurePosixPath(p).parent) for p in files}
    bad = []
    for md in [p for p in tracked() if p.endswith(".md")]:
        base = pathlib.PurePosixPath(md).parent
        for n, target in markdown_links(read(md)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue                                   # a URL, mailto: or an anchor in the same file
            path = target.split("#", 1)[0].split("?", 1)[0]
            resolved = (ROOT / base / path).resolve()
            try:
                rel = resolved.relative_to(ROOT).as_posix()
            except ValueError:
                bad.append(f"{md}:{n}: {target} leaves the repository")
                continue
            if rel not in files and rel.rstrip("/") not in dirs:
                bad.append(f"{md}:{n}: {target} -> {rel} is not a tracked file")
    assert not bad, "broken relative links:\n" + "\n".join(bad)


def joined(text: str) -> tuple[str, list[int]]:
    """The text's lines without their indentation and leading comment markers, joined by single spaces
    (a phrase split across a line break, in a comment or a docstring, reads as one), and the offset
    where each line starts in it."""
    parts, starts, pos = [], [], 0
    for line in text.splitlines():
        part = LEAD.sub("", line, count=1).rstrip()
        parts.append(part)
        starts.append(pos)
        pos += len(part) + 1
    return " ".join(parts), starts


def text_hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the words) of every history phrase in `text`, matched over the joined lines
    (`joined`); a phrase is reported at the line where it starts. 'session' alone counts where its line
    holds no library or pytest session."""
    flat, starts = joined(text)
    lines = text.splitlines()
    line_of = lambda offset: bisect.bisect_right(starts, offset)   # noqa: E731  (1-based)
    found: dict[int, list[tuple[str, str]]] = {}
    for what, rx in HISTORY:
        for m in rx.finditer(flat):
            found.setdefault(line_of(m.start()), []).append((what, m.group(0)))
    for m in SESSION.finditer(flat):
        n = line_of(m.start())
        around = flat[starts[max(n - 2, 0)]:starts[n] if n < len(starts) else len(flat)]   # lines n - 1, n
        if n not in found and not SESSION_OK.search(around):
            found[n] = [("'session' as a sitting", lines[n - 1].strip()[:100])]
    return [(n, what, words) for n in sorted(found) for what, words in found[n]]


def history_hits(path: str) -> list[str]:
    return [f"{path}:{n}: {what}: {words!r}" for n, what, words in text_hits(read(path))]


def test_no_history_words():
    hits = [h for p in text_files() if p != THIS for h in history_hits(p)]
    by_file: dict[str, int] = {}
    for h in hits:
        by_file[h.split(":", 1)[0]] = by_file.get(h.split(":", 1)[0], 0) + 1
    summary = ", ".join(f"{f} ({k})" for f, k in sorted(by_file.items()))
    assert not hits, f"history words in {len(by_file)} files: {summary}\n" + "\n".join(hits[:200])


def test_no_citations_of_absent_design_docs():
    hits = [f"{p}:{n}: {line.strip()[:100]}" for p in text_files() if p != THIS
            for n, line in enumerate(read(p).splitlines(), 1) if ABSENT_DOCS.search(line)
            and not (ROOT / ABSENT_DOCS.search(line).group(0)).exists()]
    assert not hits, "cites a document that is not in the repository:\n" + "\n".join(hits)


@pytest.mark.parametrize("line,bad", [
    ("measured in the sixteenth session", True), ("this session's run", True), ("the 17th session", True),
    ("BENCHMARKS round 21", True), ("issue 3's table", True), ("until 2026-12-01", True),
    ("async with aiohttp.ClientSession() as session:", False), ("@pytest.fixture(scope=\"session\")", False),
    ("an HTTP session per client", False), ("the kernel's rounding", False), ("round(x, 3)", False),
    ("the next device session", True), ("one more session", True), ("as measured that session.", True),
    ("return await one(session, url, body)", False), ("session.post(url)", False),
    ("load_bench --rounds 4", False),
    # split across a line break: in a comment, a docstring, a Markdown quote
    ("measured in the\n# sixteenth session", True), ("the copy read 15% below, fifth\n    session).", True),
    ("# as measured the\n# previous\n# session", True), ("> see issue\n> 12", True),
    ("# the first\n\n# session object", True), ("async with aiohttp.ClientSession() as\n    session:", False),
    ("@pytest.fixture(scope=\n    \"session\")", False), ("the rounding\n# 3 ways", False),
])
def test_history_patterns(line, bad):
    """The patterns catch the phrasings they are for, over line breaks too, and leave a library's
    session objects alone."""
    assert bool(text_hits(line)) == bad, line


# ---- the share of docstring and comment lines (a report: other parts of the library are trimmed apart) ----
def doc_comment_lines(source: str) -> tuple[int, int]:
    """(docstring + comment lines, non-blank lines) of one Python source: a line counts once if it holds
    a COMMENT token or belongs to the docstring of a module, class or function."""
    import ast
    import io
    import tokenize
    lines = source.splitlines()
    marked = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            marked.add(tok.start[0])
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                marked.update(range(body[0].lineno, body[0].end_lineno + 1))
    nonblank = {i for i, line in enumerate(lines, 1) if line.strip()}
    return len(marked & nonblank), len(nonblank)


def test_doc_comment_counter_counts_docstrings_and_comments_once():
    src = ('"""Module.\n\nMore."""\nimport os  # why\n\n\ndef f():\n    """One line."""\n'
           '    # a comment\n    return "not a docstring"\n\n\nclass C:\n    x = 1\n')
    assert doc_comment_lines(src) == (5, 9)


def test_library_doc_comment_share_at_most_15_percent():
    """Docstrings and comments stay at most 15% of the library's non-blank lines (the anchors: 12-16%);
    the message lists the five files with the most."""
    rows, total = [], [0, 0]
    for path in sorted(p for p in tracked() if p.startswith("kimi_jax/") and p.endswith(".py")):
        doc, nonblank = doc_comment_lines(read(path))
        total[0], total[1] = total[0] + doc, total[1] + nonblank
        rows.append((doc - 0.15 * nonblank, f"{path} {doc}/{nonblank}"))
    assert total[1] > 0
    worst = [r for _, r in sorted(rows, reverse=True)[:5]]
    assert total[0] <= 0.15 * total[1], f"{total[0]}/{total[1]} = {total[0] / total[1]:.1%}; most: {worst}"


def test_library_lines_at_most_100_characters():
    """Every line of the library's Python files (kimi_jax/) is at most 100 characters; the message
    lists the first few offenders as path:line."""
    long = [f"{path}:{n}" for path in sorted(p for p in tracked() if p.startswith("kimi_jax/")
                                              and p.endswith(".py"))
            for n, line in enumerate(read(path).splitlines(), 1) if len(line) > 100]
    assert not long, f"{len(long)} lines over 100 characters, first: {long[:10]}"


def test_product_files_over_600_lines_say_why():
    """A product file longer than 600 lines carries a one-line reason ("# Over 600 lines: ..." or the
    same words in its docstring)."""
    long = [p for p in tracked() if p.endswith(".py") and not p.startswith("tests/")
            and len(read(p).splitlines()) > 600]
    assert [p for p in long if "Over 600 lines:" not in read(p)] == []
