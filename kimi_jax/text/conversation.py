"""A conversation -> prompt token ids where only the chat template's own markup becomes special
tokens (request strings escaped with U+FDD0: doubled where it occurs, inside special-token strings,
at edges that could join one)."""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Protocol, Sequence

from kimi_jax.text.chat_template import ChatTemplate


class Tokenizer(Protocol):
    """What a conversation is encoded with (kimi_jax.text.tokenizer.Tokenizer)."""
    special_tokens: Mapping[str, int]

    def encode(self, text: str) -> list[int]: ...


__all__ = ["encode_conversation", "TextEscaper", "MARK"]

MARK = "\ufdd0"
_UNESCAPE = re.compile(MARK + "(.?)", re.S)


class TextEscaper:
    """Escapes request strings against one tokenizer's special tokens (see the module docstring)."""

    def __init__(self, special_tokens: Sequence[str]):
        toks = sorted((t for t in special_tokens if t and MARK not in t), key=len, reverse=True)
        self.tokens = toks
        self._re = re.compile("|".join(re.escape(t) for t in toks)) if toks else None
        self._prefixes = {t[:k] for t in toks for k in range(1, len(t))}
        self._suffixes = {t[-k:] for t in toks for k in range(1, len(t))}
        self._longest = max((len(t) for t in toks), default=0)

    def escape(self, s: str) -> str:
        if self._re is None:
            return s
        s = s.replace(MARK, MARK + MARK)
        for _ in range(len(s) + 1):           # a mark can uncover an overlapping token: repeat
            s, n = self._re.subn(lambda m: m.group()[0] + MARK + m.group()[1:], s)
            if not n:
                break
        for k in range(min(self._longest - 1, len(s)), 0, -1):
            if s[-k:] in self._prefixes:      # the text ends with the start of a special token
                s = s[: len(s) - k + 1] + MARK + s[len(s) - k + 1:]
                break
        for k in range(min(self._longest - 1, len(s)), 0, -1):
            if s[:k] in self._suffixes:       # the text starts with the end of a special token
                s = s[: k - 1] + MARK + s[k - 1:]
                break
        return s

    def tree(self, value: Any) -> Any:
        """Every string of a JSON-like value escaped (dict keys included)."""
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, Mapping):
            return {self.tree(k): self.tree(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.tree(v) for v in value]
        return value

    def split(self, rendered: str):
        """(piece, is_special) over the rendered prompt; ordinary pieces unescaped."""
        pos = 0
        for m in (self._re.finditer(rendered) if self._re is not None else ()):
            if m.start() > pos:
                yield _UNESCAPE.sub(r"\1", rendered[pos:m.start()]), False
            yield m.group(), True
            pos = m.end()
        if pos < len(rendered):
            yield _UNESCAPE.sub(r"\1", rendered[pos:]), False


def _escaper(tokenizer: Tokenizer) -> TextEscaper:
    esc = getattr(tokenizer, "_text_escaper", None)
    if esc is None:
        esc = tokenizer._text_escaper = TextEscaper(list(tokenizer.special_tokens))
    return esc


def encode_conversation(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    tools: Optional[Sequence[Mapping]] = None,
    **kwargs: Any,
) -> list[int]:
    """Prompt token ids: the template's markup as special tokens, every request string as plain text
    (ChatTemplateError for a bad conversation or template)."""
    esc = _escaper(tokenizer)
    rendered = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                               escape=esc.tree, **kwargs)
    ids: list[int] = []
    for piece, special in esc.split(rendered):
        if special:
            ids.append(tokenizer.special_tokens[piece])
        else:
            ids.extend(tokenizer.encode(piece))
    return ids


def render_conversation(template: ChatTemplate, tokenizer: Tokenizer, messages: Any, **kw) -> str:
    """The prompt text `encode_conversation` encodes (message text as written, marks removed)."""
    esc = _escaper(tokenizer)
    return "".join(p for p, _ in esc.split(template.render(messages, escape=esc.tree, **kw)))
