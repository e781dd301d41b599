"""A checkpoint's own chat template, rendered in a sandboxed Jinja environment.

:class:`ChatTemplate` reads the template from ``chat_template.jinja`` (preferred, as transformers 5 does)
or from the ``chat_template`` entry of ``tokenizer_config.json``, and renders it the way transformers'
``apply_chat_template`` does: ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` tag, a ``tojson`` filter that does
not HTML-escape, and the ``raise_exception`` / ``strftime_now`` / ``dict`` / ``namespace`` globals; the
tokenizer's special-token strings (``bos_token``, ``eos_token``, ...) are passed as variables.

Templates are untrusted. Unlike plain Jinja (which renders an unsafe attribute as an empty string), any
attempt to read an unsafe attribute (``__class__``, ``__globals__``, ``mro``, mutating methods, ...) raises
:class:`ChatTemplateError` at once. Everything a template sees is rebuilt from plain JSON types first.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Mapping, Optional, Sequence, Union

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "ChatTemplateNotFound", "validate_messages", "VALID_ROLES"]

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
VALID_ROLES = ("system", "user", "assistant", "tool")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A chat template that cannot be used (syntax, refused by the sandbox, raise_exception), or bad messages."""


class ChatTemplateNotFound(ChatTemplateError, FileNotFoundError):
    """No chat template in the checkpoint directory."""


def _one_line(text: Any, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, but an unsafe attribute access fails at once instead of yielding Undefined."""

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask marker in HF templates): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore-prefixed names (no reaching internals through it)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} is not allowed (underscore prefix)")


class _TemplateDict:
    """``dict(...)`` for templates, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _make_env() -> jinja2.Environment:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any, where: str = "value") -> Any:
    """A copy of ``value`` made only of JSON types (str/int/float/bool/None, dict, list)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / jax scalars
        try:
            return _plain(value.item(), where)
        except Exception:  # noqa: BLE001
            pass
    raise ChatTemplateError(f"{where}: {type(value).__name__} is not a JSON value")


def validate_messages(messages: Any) -> list[dict]:
    """Check a conversation and return a plain copy (keys whose value is ``None`` dropped, as transformers does).

    Each message is a dict with ``role`` in system/user/assistant/tool and ``content`` a string or a list of
    text parts (``{"type": "text", "text": str}``); an assistant message may omit content when it has
    ``tool_calls`` (a list of ``{"id"?, "type"?, "function": {"name": str, "arguments": str | dict}}``).
    Errors name the message index.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out: list[dict] = []
    for i, msg in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"{at}: a message must be a dict, got {type(msg).__name__}")
        msg = {k: v for k, v in msg.items() if v is not None}
        for k in msg:
            if not isinstance(k, str):
                raise ChatTemplateError(f"{at}: keys must be strings, got {k!r}")
        role = msg.get("role")
        if role not in VALID_ROLES:
            raise ChatTemplateError(f"{at}: role must be one of {', '.join(VALID_ROLES)}, got {role!r}")
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise ChatTemplateError(f"{at}: only assistant messages may have tool_calls (role is {role!r})")
            if not isinstance(tool_calls, (list, tuple)):
                raise ChatTemplateError(f"{at}: tool_calls must be a list")
            for j, call in enumerate(tool_calls):
                fn = call.get("function") if isinstance(call, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise ChatTemplateError(f"{at}.tool_calls[{j}]: needs a 'function' dict with a string 'name'")
                args = fn.get("arguments", {})
                if not isinstance(args, (str, Mapping)):
                    raise ChatTemplateError(f"{at}.tool_calls[{j}]: function arguments must be a str or dict")
                if "id" in call and not isinstance(call["id"], str):
                    raise ChatTemplateError(f"{at}.tool_calls[{j}]: id must be a string")
        if "content" not in msg:
            if not (role == "assistant" and tool_calls):
                raise ChatTemplateError(f"{at}: missing 'content' (role {role!r})")
        else:
            content = msg["content"]
            if isinstance(content, str):
                pass
            elif isinstance(content, (list, tuple)):
                for j, part in enumerate(content):
                    if not (
                        isinstance(part, Mapping)
                        and part.get("type", "text") == "text"
                        and isinstance(part.get("text"), str)
                    ):
                        raise ChatTemplateError(
                            f"{at}.content[{j}]: content parts must be {{'type': 'text', 'text': str}}, got {_one_line(repr(part), 80)}"
                        )
            else:
                raise ChatTemplateError(
                    f"{at}: content must be a string or a list of text parts, got {type(content).__name__}"
                )
        for key in ("name", "tool_call_id"):
            if key in msg and not isinstance(msg[key], str):
                raise ChatTemplateError(f"{at}: {key} must be a string, got {type(msg[key]).__name__}")
        out.append(_plain(msg, at))
    return out


class ChatTemplate:
    """A compiled chat template plus the special-token strings it is rendered with.

    ``ChatTemplate(source, special_tokens={"bos_token": "[BOS]", ...}, path=...)``;
    ``ChatTemplate.from_pretrained(dir)``; ``render(messages, add_generation_prompt=True, tools=None, **kw)``.
    """

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Optional[Mapping[str, str]] = None,
        path: Optional[str] = None,
    ):
        if not isinstance(source, str):
            raise ChatTemplateError(f"{path or 'chat template'}: template must be a string, got {type(source).__name__}")
        self.source = source
        self.path = path
        self.special_tokens = dict(special_tokens or {})
        where = path or "chat template"
        try:
            self._template = _make_env().from_string(source)
        except TemplateSyntaxError as e:
            raise ChatTemplateError(f"{where}:{e.lineno}: chat template syntax error: {_one_line(e.message)}") from None
        except TemplateError as e:
            raise ChatTemplateError(f"{where}: chat template error: {_one_line(e)}") from None

    @classmethod
    def from_pretrained(cls, path: Union[str, os.PathLike]) -> "ChatTemplate":
        """Read ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``, from ``path``."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ChatTemplateNotFound(f"{path}: no such checkpoint directory")
        config_file = os.path.join(path, TOKENIZER_CONFIG_FILE)
        jinja_file = os.path.join(path, CHAT_TEMPLATE_FILE)
        cfg: dict = {}
        if os.path.isfile(config_file):
            try:
                with open(config_file, "r", encoding="utf-8") as f:
                    cfg = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ChatTemplateError(f"{config_file}: corrupt tokenizer_config.json: {_one_line(e)}") from None
            if not isinstance(cfg, dict):
                raise ChatTemplateError(f"{config_file}: corrupt tokenizer_config.json: top level is not an object")
        specials = {}
        for key in _SPECIAL_TOKEN_KEYS:
            v = cfg.get(key)
            if isinstance(v, Mapping):
                v = v.get("content")
            if isinstance(v, str):
                specials[key] = v
        if os.path.isfile(jinja_file):
            try:
                with open(jinja_file, "r", encoding="utf-8") as f:
                    source = f.read()
            except UnicodeDecodeError as e:
                raise ChatTemplateError(f"{jinja_file}: not UTF-8 text: {_one_line(e)}") from None
            return cls(source, special_tokens=specials, path=jinja_file)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if template is None:
            raise ChatTemplateNotFound(
                f"{path}: no chat template (neither {CHAT_TEMPLATE_FILE} nor a 'chat_template' in {TOKENIZER_CONFIG_FILE})"
            )
        return cls(template, special_tokens=specials, path=config_file)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt string (what transformers' ``apply_chat_template(...,
        tokenize=False)`` returns for the same template, messages and special tokens)."""
        chat = validate_messages(messages)
        # transformers aliases reasoning fields so templates reading any of the names see the reasoning.
        for i, m in enumerate(chat):
            reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k) is not None), None)
            if reasoning is not None:
                chat[i] = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        if tools is not None:
            if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
                raise ChatTemplateError(f"tools must be a list of JSON-schema dicts, got {type(tools).__name__}")
            for j, t in enumerate(tools):
                if not isinstance(t, Mapping):
                    raise ChatTemplateError(f"tools[{j}]: must be a JSON-schema dict, got {type(t).__name__}")
            tools = _plain(tools, "tools")
        documents = _plain(kwargs.pop("documents", None), "documents")
        variables = {**self.special_tokens, **_plain(kwargs, "template kwargs")}
        where = self.path or "chat template"
        try:
            return self._template.render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=bool(add_generation_prompt),
                **variables,
            )
        except SecurityError as e:
            raise ChatTemplateError(f"{where}: refused by the sandbox: {_one_line(e)}") from None
        except TemplateError as e:
            raise ChatTemplateError(f"{where}: chat template error: {_one_line(e)}") from None
        except RecursionError:
            raise ChatTemplateError(f"{where}: chat template error: recursion too deep") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, ZeroDivisionError) as e:
            raise ChatTemplateError(f"{where}: chat template failed: {type(e).__name__}: {_one_line(e)}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate(path={self.path!r}, {len(self.source)} chars)"
