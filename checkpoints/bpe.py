"""Train a small byte-level BPE vocabulary and write it in Kimi's tokenizer format.

* :func:`train_bpe` learns merges on a text corpus in pure Python (word counts + incremental pair-count
  updates with a lazy max-heap), deterministically, and returns tiktoken ranks: the 256 single bytes
  first (rank = byte value), then one rank per merge in merge order.
* :func:`write_tokenizer_files` writes ``tiktoken.model``, ``tokenizer_config.json`` (Kimi's special
  tokens at ``num_base +`` the same offsets Kimi-K2 uses, see :data:`KIMI_SPECIAL_TOKEN_OFFSETS`) and
  ``chat_template.jinja``; :class:`kimi_jax.text.tokenizer.Tokenizer` loads the result.
* :func:`kimi_chat_template` is a Kimi-K2-style Jinja chat template.

Pre-tokenization for training uses Kimi's pattern through the ``regex`` module (installed with
tiktoken; its ``V1`` mode understands the ``&&`` class intersections and splits like tiktoken). If
``regex`` is missing, a simplified pattern for Python's ``re`` is used for training only; encoding always
uses Kimi's pattern through tiktoken.
"""
from __future__ import annotations

import base64
import heapq
import json
import os
import re
from collections import Counter
from typing import Iterable, Mapping, Optional, Union

from checkpoints.tokenizer_format import KIMI_PAT_STR, NUM_RESERVED_SPECIAL_TOKENS, TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE

__all__ = [
    "CHAT_TEMPLATE_FILE",
    "DEFAULT_SYSTEM_PROMPT",
    "KIMI_SPECIAL_TOKEN_OFFSETS",
    "NON_SPECIAL_TOKENS",
    "kimi_chat_template",
    "train_bpe",
    "write_tokenizer_files",
]

CHAT_TEMPLATE_FILE = "chat_template.jinja"

#: Special tokens at ``num_base + offset``, as in Kimi-K2's tokenizer_config (num_base 163584: the base BPE
#: has 163,584 ranks; 256 reserved special tokens, embedding rows up to 163839).
#: Offsets 5, 8, 16 and 22..253 are reserved (unnamed) slots. ``<|media_content|>`` (+19) and ``[UNK]``
#: (+254) are inferred from the surrounding ids, not confirmed from a published config.
KIMI_SPECIAL_TOKEN_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "[UNK]": 254,
    "[PAD]": 255,
}

#: Added tokens Kimi marks ``"special": false`` (kept by ``decode(skip_special_tokens=True)``).
NON_SPECIAL_TOKENS = frozenset(
    {
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    }
)

#: Inserted by the chat template when the conversation has no system message (Kimi-K2.5's wording).
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# Used only for training when the `regex` module is unavailable: GPT-2/cl100k-like classes expressible in
# Python `re` (letters = [^\W\d_], digits = \d). It splits CJK less finely than Kimi's pattern, which only
# costs some vocabulary quality; encoding always uses KIMI_PAT_STR through tiktoken.
_RE_FALLBACK_PAT = (
    r"""[^\r\n\w]?[^\W\d_]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|\d{1,3}"""
    r"""| ?[^\s\w]+[\r\n]*|_+"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _compile_training_pattern(pat_str: str):
    try:
        import regex  # a dependency of tiktoken
    except ImportError:  # pragma: no cover - depends on the environment
        if pat_str == KIMI_PAT_STR:
            return re.compile(_RE_FALLBACK_PAT)
        return re.compile(pat_str)
    return regex.compile(pat_str, regex.V1)


def _count_words(text_iter: Iterable[str], pat_str: str) -> Counter:
    pattern = _compile_training_pattern(pat_str)
    counts: Counter = Counter()
    if isinstance(text_iter, str):
        text_iter = [text_iter]
    for text in text_iter:
        if not isinstance(text, str):
            raise TypeError(f"train_bpe expects an iterable of str, got an item of type {type(text).__name__}")
        counts.update(pattern.findall(text))
    return counts


def train_bpe(
    text_iter: Union[str, Iterable[str]],
    vocab_size: int,
    pat_str: str = KIMI_PAT_STR,
    *,
    min_frequency: int = 2,
) -> dict[bytes, int]:
    """Learn a byte-level BPE vocabulary of at most ``vocab_size`` ranks (256 single bytes + merges).

    The text is split into words with ``pat_str`` (merges never cross word boundaries, as at encode time),
    then the most frequent adjacent pair is merged until ``vocab_size`` ranks exist or no pair occurs
    ``min_frequency`` times. Ties break on the pair's bytes, so the result is deterministic for a given
    corpus. Returns ``{token_bytes: rank}`` with ranks ``0 .. n-1`` (single bytes: rank = byte value).
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be at least 256 (the single bytes), got {vocab_size}")
    word_counts = _count_words(text_iter, pat_str)

    token_bytes: list[bytes] = [bytes([i]) for i in range(256)]
    ranks: dict[bytes, int] = {b: i for i, b in enumerate(token_bytes)}
    # Token ids inside words are ranks; a merge whose bytes already exist reuses that rank.
    words: list[list[int]] = []
    freqs: list[int] = []
    for w, c in word_counts.items():
        b = w.encode("utf-8")
        if len(b) > 1:
            words.append(list(b))
            freqs.append(c)

    pair_counts: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}
    for wi, (word, f) in enumerate(zip(words, freqs)):
        for p in zip(word, word[1:]):
            pair_counts[p] = pair_counts.get(p, 0) + f
            s = where.get(p)
            if s is None:
                where[p] = {wi}
            else:
                s.add(wi)

    def entry(p: tuple[int, int], c: int):
        return (-c, token_bytes[p[0]], token_bytes[p[1]], p)

    heap = [entry(p, c) for p, c in pair_counts.items()]
    heapq.heapify(heap)

    while len(ranks) < vocab_size and heap:
        neg, _, _, pair = heapq.heappop(heap)
        count = pair_counts.get(pair, 0)
        if count != -neg:  # stale entry; the current count was pushed again when it changed
            continue
        if count < min_frequency:
            break
        a, b = pair
        merged = token_bytes[a] + token_bytes[b]
        new_id = ranks.get(merged)
        if new_id is None:
            new_id = len(token_bytes)
            token_bytes.append(merged)
            ranks[merged] = new_id
        changed: set[tuple[int, int]] = set()
        for wi in where.pop(pair, ()):
            word = words[wi]
            n = len(word)
            # Merge left to right; skip words where the pair no longer occurs (stale index).
            out: list[int] = []
            i = 0
            hit = False
            while i < n:
                if i + 1 < n and word[i] == a and word[i + 1] == b:
                    out.append(new_id)
                    i += 2
                    hit = True
                else:
                    out.append(word[i])
                    i += 1
            if not hit:
                continue
            f = freqs[wi]
            for p in zip(word, word[1:]):
                pair_counts[p] -= f
                changed.add(p)
            for p in zip(out, out[1:]):
                pair_counts[p] = pair_counts.get(p, 0) + f
                changed.add(p)
                s = where.get(p)
                if s is None:
                    where[p] = {wi}
                else:
                    s.add(wi)
            words[wi] = out
        for p in changed:
            c = pair_counts.get(p, 0)
            if c > 0:
                heapq.heappush(heap, entry(p, c))
            else:
                pair_counts.pop(p, None)
                where.pop(p, None)
        pair_counts.pop(pair, None)
    return ranks


def _check_ranks(ranks: Mapping[bytes, int]) -> list[bytes]:
    by_rank: list[Optional[bytes]] = [None] * len(ranks)
    for tok, r in ranks.items():
        if not isinstance(tok, bytes) or not tok:
            raise ValueError(f"ranks keys must be non-empty bytes, got {tok!r}")
        if not isinstance(r, int) or not 0 <= r < len(ranks) or by_rank[r] is not None:
            raise ValueError(f"ranks must be exactly 0..{len(ranks) - 1}, each once (bad rank {r!r})")
        by_rank[r] = tok
    missing = [i for i in range(256) if bytes([i]) not in ranks]
    if missing:
        raise ValueError(f"ranks miss {len(missing)} single bytes (first {missing[0]:#04x}); all 256 are needed")
    return by_rank  # type: ignore[return-value]


def write_tokenizer_files(
    directory: Union[str, os.PathLike],
    ranks: Mapping[bytes, int],
    *,
    model_max_length: int,
    chat_template: Optional[str] = None,
    special_token_offsets: Optional[Mapping[str, int]] = None,
    num_reserved_special_tokens: int = NUM_RESERVED_SPECIAL_TOKENS,
) -> dict:
    """Write ``tiktoken.model``, ``tokenizer_config.json`` and ``chat_template.jinja`` into ``directory``.

    Special tokens go at ``len(ranks) + offset`` (default: :data:`KIMI_SPECIAL_TOKEN_OFFSETS`), inside the
    ``num_reserved_special_tokens + 2`` special slots. ``chat_template`` defaults to
    :func:`kimi_chat_template`. Returns the tokenizer_config dict written.
    """
    directory = os.fspath(directory)
    by_rank = _check_ranks(ranks)
    num_base = len(by_rank)
    offsets = dict(KIMI_SPECIAL_TOKEN_OFFSETS if special_token_offsets is None else special_token_offsets)
    n_slots = num_reserved_special_tokens + 2
    for tok, off in offsets.items():
        if not 0 <= off < n_slots:
            raise ValueError(f"special token {tok!r}: offset {off} outside the {n_slots} special slots")
    if len(set(offsets.values())) != len(offsets):
        raise ValueError("two special tokens share an offset")
    if chat_template is None:
        chat_template = kimi_chat_template()

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, TIKTOKEN_FILE), "w", encoding="ascii", newline="\n") as f:
        for r, tok in enumerate(by_rank):
            f.write(f"{base64.b64encode(tok).decode('ascii')} {r}\n")

    added = {}
    for tok, off in sorted(offsets.items(), key=lambda kv: kv[1]):
        added[str(num_base + off)] = {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": tok not in NON_SPECIAL_TOKENS,
        }
    named = set(offsets)

    def pick(tok: str) -> Optional[str]:
        return tok if tok in named else None

    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": [
            t for t in ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                        "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>") if t in named
        ],
        "bos_token": pick("[BOS]"),
        "eos_token": pick("[EOS]"),
        "pad_token": pick("[PAD]"),
        "unk_token": pick("[UNK]"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
        "num_reserved_special_tokens": num_reserved_special_tokens,
        "chat_template": chat_template,
    }
    with open(os.path.join(directory, TOKENIZER_CONFIG_FILE), "w", encoding="utf-8", newline="\n") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(directory, CHAT_TEMPLATE_FILE), "w", encoding="utf-8", newline="\n") as f:
        f.write(chat_template)
    return config


# The template's structure follows the published Kimi-K2 chat format (each turn
# `<|im_{role}|>{name or role}<|im_middle|>{content}<|im_end|>`, tools in a first `tool_declare` system
# turn, generation prompt `<|im_assistant|>assistant<|im_middle|>`). Everything is
# emitted through expressions with whitespace control, so the output is the same with or without
# trim_blocks / lstrip_blocks.
_KIMI_CHAT_TEMPLATE = r"""{#- Kimi-K2-style chat template (kimi_jax). -#}
{%- macro render_content(msg) -%}
  {%- set content = msg.get('content') -%}
  {%- if content is string -%}
    {{- content -}}
  {%- elif content is not none -%}
    {%- for part in content -%}
      {%- if part is string -%}
        {{- part -}}
      {%- elif part.get('type') == 'image' or 'image' in part or 'image_url' in part -%}
        {{- '<|media_begin|>image<|media_content|><|media_pad|><|media_end|>' -}}
      {%- else -%}
        {{- part.get('text', '') -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set state = namespace(call_index=0) -%}
{%- if tools -%}
  {{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' -}}
{%- endif -%}
{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}
  {{- '<|im_system|>system<|im_middle|>__DEFAULT_SYSTEM__<|im_end|>' -}}
{%- endif -%}
{%- for message in messages -%}
  {%- set role = message['role'] -%}
  {%- set speaker = message.get('name') or role -%}
  {%- if role == 'user' -%}
    {{- '<|im_user|>' + speaker + '<|im_middle|>' -}}
  {%- elif role == 'assistant' -%}
    {{- '<|im_assistant|>' + speaker + '<|im_middle|>' -}}
  {%- else -%}
    {{- '<|im_system|>' + speaker + '<|im_middle|>' -}}
  {%- endif -%}
  {%- if role == 'tool' -%}
    {{- '## Return of ' + (message.get('tool_call_id') or '') + '\n' -}}
  {%- endif -%}
  {{- render_content(message) -}}
  {%- if role == 'assistant' and message.get('tool_calls') -%}
    {{- '<|tool_calls_section_begin|>' -}}
    {%- for call in message['tool_calls'] -%}
      {%- set fn = call.get('function') or call -%}
      {%- if call.get('id') -%}
        {%- set call_id = call['id'] -%}
      {%- else -%}
        {%- set call_id = 'functions.' + fn['name'] + ':' + (state.call_index | string) -%}
      {%- endif -%}
      {%- set state.call_index = state.call_index + 1 -%}
      {%- set args = fn.get('arguments', {}) -%}
      {{- '<|tool_call_begin|>' + call_id + '<|tool_call_argument_begin|>' -}}
      {{- args if args is string else (args | tojson) -}}
      {{- '<|tool_call_end|>' -}}
    {%- endfor -%}
    {{- '<|tool_calls_section_end|>' -}}
  {%- endif -%}
  {{- '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_assistant|>assistant<|im_middle|>' -}}
{%- endif -%}
"""


def kimi_chat_template(default_system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> str:
    """A Kimi-K2-style chat template (Jinja) for ``tokenizer_config.json`` / ``chat_template.jinja``.

    Each turn renders as ``<|im_{system,user,assistant}|>{name or role}<|im_middle|>{content}<|im_end|>``;
    the tool role renders as system with ``## Return of {tool_call_id}`` before the result; ``tools`` go
    first as a ``tool_declare`` system turn; when the first message is not a system message,
    ``default_system_prompt`` is inserted; assistant ``tool_calls`` render as
    ``<|tool_calls_section_begin|><|tool_call_begin|>{id or functions.NAME:IDX}<|tool_call_argument_begin|>
    {json}<|tool_call_end|>...<|tool_calls_section_end|>``; ``add_generation_prompt`` appends
    ``<|im_assistant|>assistant<|im_middle|>``.
    """
    if not isinstance(default_system_prompt, str):
        raise TypeError("default_system_prompt must be a str")
    # Escape for a single-quoted Jinja string literal.
    escaped = default_system_prompt.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return _KIMI_CHAT_TEMPLATE.replace("__DEFAULT_SYSTEM__", escaped)
