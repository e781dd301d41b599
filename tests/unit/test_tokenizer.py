"""Tokenizer: a tiny BPE trained by checkpoints/bpe.py, written in Kimi's format, loaded through tiktoken."""
from __future__ import annotations

import json
import os

import pytest

from checkpoints.bpe import (
    KIMI_SPECIAL_TOKEN_OFFSETS,
    kimi_chat_template,
    train_bpe,
    write_tokenizer_files,
)
from kimi_jax.text import tokenizer as tokmod
from kimi_jax.text.tokenizer import KIMI_PAT_STR, Tokenizer, TokenizerError, TokenizerNotFound

_CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "In the beginning the model reads text, and then it writes the next words of the text.",
    "def tokenize(text):\n    return [token for token in text.split()]\n",
    "Numbers like 12345 and 2024-06-01 appear, as do symbols: (a + b) * c != d.",
    "日本語のテキストと中文文本也在这里。你好世界，你好朋友。",
    "Emoji streams: 😀😀😀 🎉🎉 👍🏽 and accents: café, naïve, ÉCOLE, Straße.",
    "    indented    lines\twith\ttabs\n\n\nand blank lines.",
]
CORPUS = "\n".join(_CORPUS_LINES * 40)
VOCAB = 450  # small enough that emoji stay split across tokens (some tokens end mid-character)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    ranks = train_bpe([CORPUS], VOCAB, KIMI_PAT_STR)
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d, ranks, model_max_length=512, chat_template=kimi_chat_template())
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_pretrained(tok_dir)


def test_train_bpe_deterministic_and_well_formed():
    a = train_bpe([CORPUS], VOCAB)
    b = train_bpe(iter([CORPUS]), VOCAB)
    assert a == b
    assert len(a) == VOCAB
    assert sorted(a.values()) == list(range(VOCAB))
    assert all(a[bytes([i])] == i for i in range(256))
    # merges are learned: common words become single tokens
    assert b" the" in a and b" fox" in a
    # merging stops when no pair occurs twice: a huge budget yields fewer ranks, still contiguous
    c = train_bpe([CORPUS], 5000)
    assert VOCAB < len(c) < 5000 and sorted(c.values()) == list(range(len(c)))
    with pytest.raises(ValueError):
        train_bpe([CORPUS], 100)


def test_files_and_special_layout(tok_dir, tok):
    assert {"tiktoken.model", "tokenizer_config.json", "chat_template.jinja"} <= set(os.listdir(tok_dir))
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "[BOS]" and cfg["eos_token"] == "[EOS]" and cfg["pad_token"] == "[PAD]"
    assert cfg["num_reserved_special_tokens"] == 256 and cfg["model_max_length"] == 512
    assert cfg["chat_template"] == (tok_dir / "chat_template.jinja").read_text()

    n = tok.num_base_tokens
    assert n == VOCAB
    assert tok.vocab_size == n + 258
    for name, off in KIMI_SPECIAL_TOKEN_OFFSETS.items():
        assert tok.special_tokens[name] == n + off
        assert tok.token_to_id(name) == n + off
    assert tok.bos_id == n and tok.eos_id == n + 1 and tok.pad_id == n + 255
    assert tok.special_tokens[f"<|reserved_token_{n + 5}|>"] == n + 5  # unnamed slots are filled
    assert len(tok.special_tokens) == 258
    assert tok.stop_token_ids == [n + 1, n + 2]  # [EOS], <|im_end|>
    assert tok.token_to_id("a") == ord("a")
    assert tok.token_to_id("not-a-token-xyz") is None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Hello, world! The fox jumps.",
        "def f(x):\n    return x ** 2\n",
        "日本語と中文：你好世界",
        "emoji 😀🎉👍🏽 mixed café ÉCOLE Straße",
        "   \t\t  \n\n\n   \r\n  trailing   ",
        "never seen: ζβγ ∑∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \x00\x7f",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.num_base_tokens for i in ids)
    assert tok.decode(ids) == text


def test_compresses_training_text(tok):
    text = _CORPUS_LINES[0]
    assert len(tok.encode(text)) < len(text.encode()) / 2


def test_specials_not_from_plain_text(tok):
    im_end = tok.special_tokens["<|im_end|>"]
    bos = tok.bos_id
    text = "hi<|im_end|>[BOS] there"
    plain = tok.encode(text)  # must not raise
    assert im_end not in plain and bos not in plain
    assert all(i < tok.num_base_tokens for i in plain)
    assert tok.decode(plain) == text

    allowed = tok.encode(text, allow_special=True)
    assert allowed.count(im_end) == 1 and allowed.count(bos) == 1
    assert tok.decode(allowed) == text

    only = tok.encode(text, allow_special={"<|im_end|>"})
    assert im_end in only and bos not in only
    with pytest.raises(ValueError):
        tok.encode(text, allow_special={"<|nope|>"})


def test_special_decode_and_skip(tok):
    sp = tok.special_tokens
    ids = [tok.bos_id, *tok.encode("hello"), sp["<|tool_call_begin|>"], sp["<|im_end|>"]]
    assert tok.decode(ids) == "[BOS]hello<|tool_call_begin|><|im_end|>"
    # tool-call tokens are 'special: false' in Kimi's config, so skip_special_tokens keeps them
    assert tok.decode(ids, skip_special_tokens=True) == "hello<|tool_call_begin|>"
    assert tok.id_to_token(sp["<|im_middle|>"]) == "<|im_middle|>"
    with pytest.raises(TokenizerError):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerError):
        tok.decode([-1])


def _emoji_split_ids(tok):
    text = "ok 😀😀😀 🎉 👍🏽 日本語 café"
    ids = tok.encode(text)
    # at least one token must be an incomplete UTF-8 sequence for the test to mean anything
    partial = [i for i in ids if "\ufffd" in tok.token_bytes(i).decode("utf-8", "replace")]
    assert partial, "fixture vocab should split emoji bytes across tokens"
    return text, ids


def test_incremental_decoder_never_emits_partial_chars(tok):
    text, ids = _emoji_split_ids(tok)
    dec = tok.incremental_decoder()
    out = ""
    for i in ids:
        delta = dec.feed(i)
        assert "\ufffd" not in delta
        out += delta
        assert text.startswith(out)
    out += dec.flush()
    assert out == text == tok.decode(ids)


def test_incremental_decoder_single_bytes_and_flush(tok):
    # feed an emoji one byte-token at a time: nothing until the 4th byte
    dec = tok.incremental_decoder()
    deltas = [dec.feed(b) for b in "😀".encode()]
    assert deltas == ["", "", "", "😀"]
    # a truncated character is flushed as U+FFFD, as decode() does
    dec = tok.incremental_decoder()
    assert dec.feed(0xF0) == "" and dec.pending_bytes == 1
    assert dec.flush() == "\ufffd" == tok.decode([0xF0])


def test_incremental_decoder_specials(tok):
    ids = [tok.bos_id, *tok.encode("a 😀"), tok.special_tokens["<|im_end|>"]]
    for skip in (False, True):
        dec = tok.incremental_decoder(skip_special_tokens=skip)
        streamed = "".join(dec.feed(i) for i in ids) + dec.flush()
        assert streamed == tok.decode(ids, skip_special_tokens=skip)


def _kimi_reference_split(s, limit):
    """Kimi's run splitter written out character by character (independent of the regex version)."""
    pieces, start, run, is_space = [], 0, 0, (s[0].isspace() if s else False)
    for i, ch in enumerate(s):
        now = ch.isspace()
        if now != is_space:
            run, is_space = 1, now
        else:
            run += 1
            if run > limit:
                pieces.append(s[start:i])
                start, run = i, 1
    pieces.append(s[start:])
    return pieces


def test_long_input_splitting(tok):
    lim = tokmod.MAX_NO_WHITESPACES_CHARS
    s = "ab" * (lim + 7) + " " * (2 * lim + 3) + "x y " * 10 + "z" * (lim + 1) + "\u3000" * 5
    assert list(tokmod._split_long_runs(s)) == _kimi_reference_split(s, lim)
    chunks = list(tokmod._chunks(s))
    assert "".join(chunks) == s
    ids = tok.encode(s)
    assert tok.decode(ids) == s
    big = ("word " * 90_000) + "😀" * 10  # > 400k chars: several tiktoken calls
    assert tok.decode(tok.encode(big)) == big


def test_missing_and_corrupt_files(tmp_path, tok_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerNotFound, match="empty") as ei:
        Tokenizer.from_pretrained(empty)
    assert isinstance(ei.value, FileNotFoundError) and "\n" not in str(ei.value)
    with pytest.raises(TokenizerNotFound):
        Tokenizer.from_pretrained(tmp_path / "does-not-exist")

    only_cfg = tmp_path / "only_cfg"
    only_cfg.mkdir()
    (only_cfg / "tokenizer_config.json").write_text((tok_dir / "tokenizer_config.json").read_text())
    with pytest.raises(TokenizerNotFound, match="tiktoken.model"):
        Tokenizer.from_pretrained(only_cfg)

    only_model = tmp_path / "only_model"
    only_model.mkdir()
    (only_model / "tiktoken.model").write_bytes((tok_dir / "tiktoken.model").read_bytes())
    with pytest.raises(TokenizerNotFound, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(only_model)

    bad_model = tmp_path / "bad_model"
    bad_model.mkdir()
    (bad_model / "tokenizer_config.json").write_text((tok_dir / "tokenizer_config.json").read_text())
    (bad_model / "tiktoken.model").write_text("IQ== 0\nnot base64!! x\n")
    with pytest.raises(TokenizerError, match="tiktoken.model") as ei:
        Tokenizer.from_pretrained(bad_model)
    assert "\n" not in str(ei.value)
    lines = (tok_dir / "tiktoken.model").read_text().splitlines()
    (bad_model / "tiktoken.model").write_text("\n".join(lines[1:]) + "\n")  # byte 0x00 missing, ranks shifted
    with pytest.raises(TokenizerError, match="tiktoken.model"):
        Tokenizer.from_pretrained(bad_model)

    bad_cfg = tmp_path / "bad_cfg"
    bad_cfg.mkdir()
    (bad_cfg / "tiktoken.model").write_bytes((tok_dir / "tiktoken.model").read_bytes())
    (bad_cfg / "tokenizer_config.json").write_text('{"added_tokens_decoder": {')
    with pytest.raises(TokenizerError, match="tokenizer_config.json") as ei:
        Tokenizer.from_pretrained(bad_cfg)
    assert "\n" not in str(ei.value)


def test_load_from_model_file_path(tok_dir, tok):
    t2 = Tokenizer.from_pretrained(tok_dir / "tiktoken.model")
    assert t2.encode("The fox") == tok.encode("The fox")
