"""Kimi's tokenizer (``tiktoken.model`` + ``tokenizer_config.json``) through tiktoken, as Kimi's
``tokenization_kimi.py`` builds it: the base ranks, then num_reserved_special_tokens + 2 special ids
(unnamed ones ``<|reserved_token_{id}|>``), Kimi's pre-split pattern, long inputs cut before
tiktoken. Plain text never encodes to a special token unless ``encode(..., allow_special=True)``."""
from __future__ import annotations

import base64
import binascii
import codecs
import json
import operator
import os
import re
from typing import AbstractSet, Iterable, Iterator, Mapping, Optional, Sequence, Union

import tiktoken

from checkpoints.tokenizer_format import (
    KIMI_PAT_STR,
    NUM_RESERVED_SPECIAL_TOKENS,
    TIKTOKEN_FILE,
    TOKENIZER_CONFIG_FILE,
)

__all__ = [
    "KIMI_PAT_STR",
    "NUM_RESERVED_SPECIAL_TOKENS",
    "TIKTOKEN_FILE",
    "TOKENIZER_CONFIG_FILE",
    "IncrementalDecoder",
    "Tokenizer",
    "TokenizerError",
    "TokenizerNotFound",
    "load_tiktoken_ranks",
]

# tiktoken handles up to ~400k chars per call without a Rust panic, and runs of (non-)whitespace
# over ~25k make its regex / BPE quadratic (openai/tiktoken#195). Kimi's tokenizer cuts there.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000

# A maximal run (preceded by a different class or the start) longer than the limit. Python's `\s`
# matches exactly the characters for which str.isspace() is true, as Kimi's splitter uses. The
# look-behinds make the scan linear: a run is only tried from its first character.
_LONG_RUN = re.compile(
    r"(?<!\s)\s{%d,}|(?<!\S)\S{%d,}" % (MAX_NO_WHITESPACES_CHARS + 1, MAX_NO_WHITESPACES_CHARS + 1)
)


class TokenizerError(ValueError):
    """A tokenizer file that exists but is unusable (corrupt, inconsistent), or a bad token id."""


class TokenizerNotFound(FileNotFoundError):
    """The directory (or one of the files it needs) does not hold a Kimi tokenizer."""


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_tiktoken_ranks(path: Union[str, os.PathLike]) -> dict[bytes, int]:
    """Read a ``tiktoken.model`` file (``<base64> <rank>`` per line) into ``{token_bytes: rank}``,
    refusing malformed lines, duplicates, ranks other than ``0 .. n-1`` and missing single bytes
    (TokenizerError)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise TokenizerNotFound(f"{path}: tokenizer file not found") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read tokenizer file ({e.strerror or e})") from None
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerError(
                f"{path}:{lineno}: corrupt tiktoken.model: expected '<base64 token> <rank>', got "
                f"{_one_line(line[:80])!s}"
            )
        try:
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (binascii.Error, ValueError):
            raise TokenizerError(
                f"{path}:{lineno}: corrupt tiktoken.model: bad base64 token or rank in line "
                f"{_one_line(line[:80])!s}"
            ) from None
        if not token or rank < 0:
            raise TokenizerError(
                f"{path}:{lineno}: corrupt tiktoken.model: empty token or negative rank"
            )
        if token in ranks:
            raise TokenizerError(
                f"{path}:{lineno}: corrupt tiktoken.model: token {token!r} appears twice"
            )
        if rank in seen_ranks:
            raise TokenizerError(
                f"{path}:{lineno}: corrupt tiktoken.model: rank {rank} appears twice"
            )
        ranks[token] = rank
        seen_ranks.add(rank)
    if not ranks:
        raise TokenizerError(f"{path}: corrupt tiktoken.model: no tokens")
    if max(seen_ranks) != len(ranks) - 1:
        raise TokenizerError(
            f"{path}: corrupt tiktoken.model: ranks are not contiguous 0..{len(ranks) - 1} (max "
            f"rank {max(seen_ranks)})"
        )
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(
            f"{path}: corrupt tiktoken.model: {len(missing)} single-byte tokens missing (first: "
            f"{missing[0]:#04x}); a byte-level BPE needs all 256"
        )
    return ranks


def _token_content(value) -> Optional[str]:
    """tokenizer_config stores a token either as a string or as a serialized AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_config(path: str) -> dict:
    try:
        with open(path, "r", encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise TokenizerNotFound(f"{path}: tokenizer config not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: corrupt tokenizer_config.json: {_one_line(e)}") from None
    except OSError as e:
        raise TokenizerError(
            f"{path}: cannot read tokenizer_config.json ({e.strerror or e})"
        ) from None
    if not isinstance(cfg, dict):
        raise TokenizerError(
            f"{path}: corrupt tokenizer_config.json: top level is {type(cfg).__name__}, not an "
            "object"
        )
    return cfg


def _split_long_runs(text: str) -> Iterator[str]:
    """Kimi's ``_split_whitespaces_or_nonwhitespaces``: runs past the limit cut every 25k chars."""
    start = 0
    for m in _LONG_RUN.finditer(text):
        for cut in range(m.start() + MAX_NO_WHITESPACES_CHARS, m.end(), MAX_NO_WHITESPACES_CHARS):
            yield text[start:cut]
            start = cut
    yield text[start:]


def _chunks(text: str) -> Iterator[str]:
    """Pieces of at most 400k chars, cut further so no (non-)whitespace run exceeds 25k chars."""
    if len(text) <= MAX_NO_WHITESPACES_CHARS:
        yield text
        return
    for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        yield from _split_long_runs(text[i : i + TIKTOKEN_MAX_ENCODE_CHARS])


class Tokenizer:
    """A Kimi tokenizer: byte-level BPE ranks + special tokens (`special_tokens`: ``{string: id}``,
    named and reserved; `num_base_tokens`: the first special id), encoded through tiktoken."""

    def __init__(
        self,
        mergeable_ranks: Mapping[bytes, int],
        special_tokens: Mapping[str, int],
        *,
        pat_str: str = KIMI_PAT_STR,
        bos_token: Optional[str] = "[BOS]",
        eos_token: Optional[str] = "[EOS]",
        pad_token: Optional[str] = None,
        unk_token: Optional[str] = None,
        non_special: AbstractSet[str] = frozenset(),
        name: str = "kimi",
        config: Optional[dict] = None,
    ):
        self.mergeable_ranks = dict(mergeable_ranks)
        self.special_tokens: dict[str, int] = dict(special_tokens)
        self.num_base_tokens = len(self.mergeable_ranks)
        for tok, i in self.special_tokens.items():
            if i < self.num_base_tokens:
                raise TokenizerError(
                    f"special token {tok!r} has id {i}, inside the {self.num_base_tokens} BPE ranks"
                )
        if len(set(self.special_tokens.values())) != len(self.special_tokens):
            raise TokenizerError("two special tokens share an id")
        self.pat_str = pat_str
        self._enc = tiktoken.Encoding(
            name,
            pat_str=pat_str,
            mergeable_ranks=self.mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        self._id_to_special: dict[int, str] = {i: t for t, i in self.special_tokens.items()}
        self._special_bytes: dict[int, bytes] = {
            i: t.encode("utf-8") for t, i in self.special_tokens.items()
        }
        # Added tokens marked "special": false in tokenizer_config (Kimi's tool-call tokens) are
        # kept by decode(skip_special_tokens=True); everything else in the special range is skipped.
        self._skippable_ids = frozenset(
            i for t, i in self.special_tokens.items() if t not in non_special
        )
        self.config = dict(config or {})
        self.chat_template = self.config.get("chat_template")

        def _id(tok: Optional[str], what: str) -> Optional[int]:
            if tok is None:
                return None
            if tok not in self.special_tokens:
                raise TokenizerError(f"{what} {tok!r} is not one of the special tokens")
            return self.special_tokens[tok]

        self.bos_token, self.eos_token, self.pad_token, self.unk_token = (
            bos_token,
            eos_token,
            pad_token,
            unk_token,
        )
        self.bos_id = _id(bos_token, "bos_token")
        self.eos_id = _id(eos_token, "eos_token")
        self.pad_id = _id(pad_token, "pad_token")
        self.unk_id = _id(unk_token, "unk_token")
        self._special_re_all: Optional[re.Pattern] = None
        self.template_dir: Optional[str] = None
        self._template = None

    @classmethod
    def from_pretrained(cls, path: Union[str, os.PathLike]) -> "Tokenizer":
        """Load ``tiktoken.model`` + ``tokenizer_config.json`` from a checkpoint directory (or the
        model file); TokenizerNotFound when a file is missing, TokenizerError naming a corrupt
        one."""
        path = os.fspath(path)
        if os.path.isfile(path) and os.path.basename(path) == TIKTOKEN_FILE:
            path = os.path.dirname(path) or "."
        if not os.path.isdir(path):
            raise TokenizerNotFound(f"{path}: no such tokenizer directory")
        model_file = os.path.join(path, TIKTOKEN_FILE)
        config_file = os.path.join(path, TOKENIZER_CONFIG_FILE)
        has_model, has_config = os.path.isfile(model_file), os.path.isfile(config_file)
        if not has_model and not has_config:
            raise TokenizerNotFound(
                f"{path}: no tokenizer in this directory (expected {TIKTOKEN_FILE} and "
                f"{TOKENIZER_CONFIG_FILE})"
            )
        if not has_model:
            raise TokenizerNotFound(
                f"{model_file}: tokenizer file not found (next to {TOKENIZER_CONFIG_FILE})"
            )
        if not has_config:
            raise TokenizerNotFound(
                f"{config_file}: tokenizer config not found (next to {TIKTOKEN_FILE})"
            )

        ranks = load_tiktoken_ranks(model_file)
        cfg = _read_config(config_file)
        num_base = len(ranks)

        decoder = cfg.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise TokenizerError(
                f"{config_file}: corrupt tokenizer_config.json: added_tokens_decoder is not an "
                "object"
            )
        named: dict[int, str] = {}
        non_special: set[str] = set()
        for key, entry in decoder.items():
            try:
                idx = int(key)
            except ValueError:
                raise TokenizerError(
                    f"{config_file}: corrupt tokenizer_config.json: added_tokens_decoder key "
                    f"{key!r} is not an id"
                ) from None
            content = _token_content(entry)
            if content is None:
                raise TokenizerError(
                    f"{config_file}: corrupt tokenizer_config.json: added token {key} has no "
                    "string 'content'"
                )
            if idx < num_base:
                raise TokenizerError(
                    f"{config_file}: added token {content!r} has id {idx}, inside the {num_base} "
                    f"ranks of {TIKTOKEN_FILE}"
                )
            named[idx] = content
            if isinstance(entry, Mapping) and entry.get("special") is False:
                non_special.add(content)
        n_reserved = cfg.get("num_reserved_special_tokens", NUM_RESERVED_SPECIAL_TOKENS)
        if not isinstance(n_reserved, int) or n_reserved < 0:
            raise TokenizerError(
                f"{config_file}: num_reserved_special_tokens must be a non-negative integer"
            )
        ids = set(range(num_base, num_base + n_reserved + 2)) | set(named)
        special_tokens: dict[str, int] = {}
        for i in sorted(ids):
            tok = named.get(i, f"<|reserved_token_{i}|>")
            if tok in special_tokens:
                raise TokenizerError(
                    f"{config_file}: special token {tok!r} has two ids ({special_tokens[tok]} and "
                    f"{i})"
                )
            special_tokens[tok] = i

        def tok_field(key: str, default: Optional[str]) -> Optional[str]:
            if key not in cfg:
                return default if default in special_tokens else None
            value = cfg[key]
            content = _token_content(value)
            if value is not None and content is None:
                raise TokenizerError(
                    f"{config_file}: corrupt tokenizer_config.json: {key} is not a token string"
                )
            if content is not None and content not in special_tokens:
                raise TokenizerError(
                    f"{config_file}: {key} {content!r} is not among the added tokens"
                )
            return content

        tok = cls(
            ranks,
            special_tokens,
            bos_token=tok_field("bos_token", "[BOS]"),
            eos_token=tok_field("eos_token", "[EOS]"),
            pad_token=tok_field("pad_token", None),
            unk_token=tok_field("unk_token", None),
            non_special=frozenset(non_special),
            name=os.path.basename(os.path.abspath(path)) or "kimi",
            config=cfg,
        )
        tok.template_dir = path
        return tok


    @property
    def vocab_size(self) -> int:
        """Number of token ids (largest id + 1); the model's embedding may have fewer rows."""
        return self._enc.n_vocab

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end a generation: the eos token and ``<|im_end|>`` (when present)."""
        out: list[int] = []
        for i in (self.eos_id, self.special_tokens.get("<|im_end|>")):
            if i is not None and i not in out:
                out.append(i)
        return out

    def token_to_id(self, token: str) -> Optional[int]:
        """Id of a special token, or of a base token given as UTF-8 text; ``None`` if neither."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self.mergeable_ranks.get(token.encode("utf-8"))

    def id_to_token(self, token_id: int) -> str:
        """Text of one token (special tokens by name; a partial UTF-8 sequence gives U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (a special token's bytes are its name in UTF-8)."""
        token_id = operator.index(token_id)
        self._check_ids([token_id])
        b = self._special_bytes.get(token_id)
        return b if b is not None else self._enc.decode_single_token_bytes(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._id_to_special


    def _special_regex(self, allowed: AbstractSet[str]) -> re.Pattern:
        return re.compile("|".join(re.escape(t) for t in sorted(allowed, key=len, reverse=True)))

    def encode(self, text: str, add_special_tokens: bool = True, *,
               allow_special: Union[bool, AbstractSet[str]] = False) -> list[int]:
        """Token ids for ``text``; allow_special: False (special-token strings are plain text), True
        (all map to their ids) or a set of the special tokens recognised (add_special_tokens: adds
        nothing)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        if not allow_special:
            return self._encode_ordinary(text)
        if allow_special is True:
            if self._special_re_all is None:
                self._special_re_all = self._special_regex(self.special_tokens.keys())
            pattern = self._special_re_all
        else:
            unknown = set(allow_special) - self.special_tokens.keys()
            if unknown:
                raise ValueError(
                    f"allow_special names tokens that are not special tokens: {sorted(unknown)[:5]}"
                )
            pattern = self._special_regex(allow_special)
        out: list[int] = []
        pos = 0
        # split at special tokens first, so the long-input chunking never cuts one in two
        for m in pattern.finditer(text):
            if m.start() > pos:
                out.extend(self._encode_ordinary(text[pos : m.start()]))
            out.append(self.special_tokens[m.group()])
            pos = m.end()
        if pos < len(text):
            out.extend(self._encode_ordinary(text[pos:]))
        return out

    def _encode_ordinary(self, text: str) -> list[int]:
        if len(text) <= MAX_NO_WHITESPACES_CHARS:
            return self._enc.encode_ordinary(text)
        out: list[int] = []
        for piece in _chunks(text):
            if piece:
                out.extend(self._enc.encode_ordinary(piece))
        return out

    def encode_batch(
        self, texts: Sequence[str], *, allow_special: Union[bool, AbstractSet[str]] = False
    ) -> list[list[int]]:
        return [self.encode(t, allow_special=allow_special) for t in texts]

    def _check_ids(self, ids: Iterable[int]) -> None:
        n = self.num_base_tokens
        for i in ids:
            if i < 0 or (i >= n and i not in self._id_to_special):
                raise TokenizerError(f"token id {i} is out of range (vocab_size {self.vocab_size})")

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        ids = [operator.index(i) for i in ids]
        self._check_ids(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._skippable_ids]
        return self._enc.decode_bytes(ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text for ``ids``. Special tokens decode to their names unless ``skip_special_tokens``,
        which drops every special id except added tokens marked ``"special": false`` (Kimi's
        tool-call tokens). Invalid UTF-8 (e.g. a truncated multi-byte character) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.eos_id

    @property
    def bos_token_id(self) -> Optional[int]:
        return self.bos_id

    @property
    def pad_token_id(self) -> Optional[int]:
        return self.pad_id

    def convert_ids_to_tokens(self, ids: Union[int, Iterable[int]]) -> Union[str, list[str]]:
        """Each id's token text (`id_to_token`); one id gives one string."""
        if not hasattr(ids, "__iter__"):
            return self.id_to_token(ids)
        return [self.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(
        self, tokens: Union[str, Iterable[str]]
    ) -> Union[Optional[int], list]:
        """Each token's id (`token_to_id`; None for an unknown token); one string gives one id."""
        if isinstance(tokens, str):
            return self.token_to_id(tokens)
        return [self.token_to_id(t) for t in tokens]

    def __call__(self, text: Union[str, Sequence[str]], add_special_tokens: bool = True,
                 **_ignored) -> "Encoding":
        """``tokenizer(text)``: input_ids and attention_mask (other keyword arguments ignored)."""
        if isinstance(text, str):
            ids = self.encode(text)
            return Encoding(input_ids=ids, attention_mask=[1] * len(ids))
        batch = [self.encode(t) for t in text]
        return Encoding(input_ids=batch, attention_mask=[[1] * len(b) for b in batch])

    def load_chat_template(self, chat_template: Optional[str] = None):
        """`chat_template` as a ChatTemplate, else the checkpoint's (read once)."""
        from kimi_jax.text.chat_template import ChatTemplate, ChatTemplateNotFound
        if chat_template is not None:
            return ChatTemplate(chat_template)
        if self._template is None:
            if self.template_dir is None:
                raise ChatTemplateNotFound(
                    "this tokenizer was not read from a checkpoint directory; " "pass chat_template"
                )
            self._template = ChatTemplate.from_pretrained(self.template_dir)
        return self._template

    def apply_chat_template(
        self,
        conversation,
        tools=None,
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        chat_template: Optional[str] = None,
        **kwargs,
    ) -> Union[str, list[int]]:
        """The checkpoint's template as LLM.chat renders it: prompt ids or text (tokenize=False)"""
        from kimi_jax.text.conversation import encode_conversation, render_conversation
        tmpl = self.load_chat_template(chat_template)
        kw = dict(add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        if tokenize:
            return encode_conversation(tmpl, self, conversation, **kw)
        return render_conversation(tmpl, self, conversation, **kw)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(num_base_tokens={self.num_base_tokens}, "
            f"special_tokens={len(self.special_tokens)}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id})"
        )


class Encoding(dict):
    """``tokenizer(text)``'s result: a dict whose keys read as attributes (``enc.input_ids``)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class IncrementalDecoder:
    """Streaming detokenizer: ids in, newly completed text out (never part of a UTF-8 character);
    all deltas plus ``flush()`` equal ``tokenizer.decode(all_ids)``."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.ids: list[int] = []

    def feed(self, token_id: int) -> str:
        """Add one id; return the text it completes (possibly ``""``)."""
        token_id = operator.index(token_id)
        tok = self.tokenizer
        self.ids.append(token_id)
        if self.skip_special_tokens and token_id in tok._skippable_ids:
            return ""
        return self._utf8.decode(tok.token_bytes(token_id))

    def feed_many(self, ids: Iterable[int]) -> str:
        return "".join(self.feed(i) for i in ids)

    def flush(self) -> str:
        """End of stream: return any held bytes (invalid leftovers as U+FFFD) and reset."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out

    @property
    def pending_bytes(self) -> int:
        """Bytes held back because they do not yet form a complete character."""
        return len(self._utf8.getstate()[0])
