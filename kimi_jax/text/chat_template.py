"""A checkpoint's chat template (``chat_template.jinja``, else tokenizer_config.json's) rendered as
transformers' ``apply_chat_template`` does, in ``jinja2.sandbox.ImmutableSandboxedEnvironment``.
Templates are untrusted: reading an unsafe attribute raises :class:`ChatTemplateError`, and the
template sees only plain JSON types."""
# Over 600 lines: the Kimi chat format: message checks, rendering, loading.
from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import math
import os
import re
import threading
from datetime import datetime
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "RenderLimits",
    "ChatTemplateNotFound",
    "validate_messages",
    "VALID_ROLES",
]

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
VALID_ROLES = ("system", "user", "assistant", "tool")
MAX_TEMPLATE_BYTES = 256 * 2**10          # a chat template's source (real ones are a few KB)
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """An unusable chat template (syntax, sandbox refusal, raise_exception), or bad messages."""


class ChatTemplateNotFound(ChatTemplateError, FileNotFoundError):
    """No chat template in the checkpoint directory."""


def _one_line(text: Any, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass(frozen=True)
class RenderLimits:
    """Bounds on one render of an (untrusted) template: wall-clock seconds, characters of output and
    of any one value the template builds (a string or list made by ``*`` / ``+`` / ``%``, a value
    stored in a namespace, an argument of a call or filter), items of one ``range``, and bits of a
    power."""
    timeout_s: float = 10.0
    max_output_chars: int = 32 * 2 ** 20
    max_value_len: int = 32 * 2 ** 20
    max_range: int = 100_000
    max_pow_bits: int = 4096


class _TemplateTimeout(BaseException):
    """Raised inside the rendering thread when the render's deadline passes."""


class _LimitError(SecurityError):
    """A render that exceeds one of its RenderLimits."""


def _size(v: Any) -> int:
    return len(v) if isinstance(v, (str, bytes, list, tuple, dict)) else 0


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, but an unsafe attribute access fails at once instead of yielding
    Undefined, and every render is bounded (RenderLimits): ``*``, ``+``, ``%`` and ``**`` are
    checked before they compute, calls and filters refuse oversized arguments, ``range`` is
    capped."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, limits: "RenderLimits", **kw):
        super().__init__(**kw)
        self.limits = limits

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def _check_len(self, n: int, what: str) -> None:
        if n > self.limits.max_value_len:
            raise _LimitError(
                f"{what} would hold {n} items, over the limit of {self.limits.max_value_len}"
            )

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        lim = self.limits
        if operator == "*":
            for seq, k in ((left, right), (right, left)):
                if _size(seq) and isinstance(k, int):
                    self._check_len(_size(seq) * max(k, 0), "a repeated string or list")
        elif operator == "+" and _size(left) and _size(right):
            self._check_len(_size(left) + _size(right), "a concatenation")
        elif operator == "%" and isinstance(left, str):
            self._check_format(left, right)
        elif (
            operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float))
        ):
            if abs(left) > 1 and right > 0 and right * math.log2(abs(left)) > lim.max_pow_bits:
                raise _LimitError(f"power {left!r} ** {right!r} is over {lim.max_pow_bits} bits")
        return super().call_binop(context, operator, left, right)

    def _check_format(self, fmt: str, args: Any) -> None:
        """printf / str.format widths: literal ones and numbers passed for them are capped."""
        if re.search(r"\d{7,}", fmt):
            raise _LimitError("a format width of more than 6 digits")
        for a in args if isinstance(args, (tuple, list)) else (args,):
            if (
                isinstance(a, int)
                and not isinstance(a, bool)
                and abs(a) > self.limits.max_value_len
            ):
                if "*" in fmt or "{" in fmt:
                    raise _LimitError(f"a format width of {a}")

    def _check_args(self, name: str, args, kwargs) -> None:
        for a in (*args, *kwargs.values()):
            self._check_len(_size(a), f"an argument of {name}")
            if (
                isinstance(a, int)
                and not isinstance(a, bool)
                and abs(a) > self.limits.max_value_len
            ):
                raise _LimitError(
                    f"{name} called with {a}, over the limit of {self.limits.max_value_len}"
                )

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        name = getattr(__obj, "__name__", type(__obj).__name__)
        if name in _AMPLIFYING_METHODS or name in ("format", "format_map"):
            __self._check_args(name, args, kwargs)
        else:
            for a in (*args, *kwargs.values()):
                __self._check_len(_size(a), f"an argument of {name}")
        return super().call(__context, __obj, *args, **kwargs)


# str methods whose integer argument sets the size of the result
_AMPLIFYING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
# filters whose arguments set the size of the result
_AMPLIFYING_FILTERS = (
    "center",
    "indent",
    "format",
    "wordwrap",
    "truncate",
    "batch",
    "slice",
    "join",
    "replace",
)


def _bounded_filter(env: "_StrictSandbox", name: str, fn):
    @functools.wraps(fn)
    def bounded(*args, **kwargs):
        # pass-context / pass-environment filters take that first: check the rest
        env._check_args(
            f"filter {name!r}",
            [
                a
                for a in args
                if not isinstance(
                    a, (jinja2.Environment, jinja2.runtime.Context, jinja2.nodes.EvalContext)
                )
            ][1:],
            kwargs,
        )
        out = fn(*args, **kwargs)
        env._check_len(_size(out), f"the result of filter {name!r}")
        return out
    return bounded


class _BoundedRange:
    """``range`` for templates: at most RenderLimits.max_range items."""

    def __init__(self, limit: int):
        self.limit = limit

    def __call__(self, *args):
        rng = range(*args)
        if len(rng) > self.limit:
            raise _LimitError(f"range of {len(rng)} items, over the limit of {self.limit}")
        return rng


class _Deadline:
    """Raises _TemplateTimeout in the calling thread once `seconds` have passed (an asynchronous
    exception: it interrupts a template loop that calls nothing); cancelled on exit, a pending one
    cleared."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.lock = threading.Lock()
        self.state = "running"

    def _fire(self) -> None:
        with self.lock:
            if self.state == "running":
                self.state = "fired"
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self.tid), ctypes.py_object(_TemplateTimeout)
                )

    def __enter__(self) -> "_Deadline":
        self.tid = threading.get_ident()
        self.timer = threading.Timer(self.seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.lock:
            if self.state == "fired":         # raised, or still pending: clear it
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.tid), None)
            self.state = "done"
        self.timer.cancel()


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HF assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore-prefixed names (no reaching internals through it) and
    values over the render's max_value_len (`_make_env` makes the subclass that sets it)."""

    max_value_len = RenderLimits().max_value_len

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        if _size(value) > type(self).max_value_len:
            raise _LimitError(f"namespace attribute {name!r} would hold {_size(value)} items")
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
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _make_env(limits: RenderLimits) -> jinja2.Environment:
    env = _StrictSandbox(limits, trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    for name in _AMPLIFYING_FILTERS:
        if name in env.filters:
            env.filters[name] = _bounded_filter(env, name, env.filters[name])
    env.globals["range"] = _BoundedRange(limits.max_range)
    env.globals.pop("lipsum", None)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = type(
        "namespace", (_TemplateNamespace,), {"max_value_len": limits.max_value_len}
    )
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
    """Check a conversation and return a plain copy (keys whose value is ``None`` dropped, as
    transformers does).

    Each message is a dict with ``role`` in system/user/assistant/tool and ``content`` a string or a
    list of text parts (``{"type": "text", "text": str}``); an assistant message may omit content
    when it has ``tool_calls`` (a list of ``{"id"?, "type"?, "function": {"name": str, "arguments":
    str | dict}}``). Errors name the message index.
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
            raise ChatTemplateError(
                f"{at}: role must be one of {', '.join(VALID_ROLES)}, got {role!r}"
            )
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise ChatTemplateError(
                    f"{at}: only assistant messages may have tool_calls (role is {role!r})"
                )
            if not isinstance(tool_calls, (list, tuple)):
                raise ChatTemplateError(f"{at}: tool_calls must be a list")
            for j, call in enumerate(tool_calls):
                fn = call.get("function") if isinstance(call, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise ChatTemplateError(
                        f"{at}.tool_calls[{j}]: needs a 'function' dict with a string 'name'"
                    )
                args = fn.get("arguments", {})
                if not isinstance(args, (str, Mapping)):
                    raise ChatTemplateError(
                        f"{at}.tool_calls[{j}]: function arguments must be a str or dict"
                    )
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
                            f"{at}.content[{j}]: content parts must be {{'type': 'text', 'text': "
                            f"str}}, got {_one_line(repr(part), 80)}"
                        )
            else:
                raise ChatTemplateError(
                    f"{at}: content must be a string or a list of text parts, got "
                    f"{type(content).__name__}"
                )
        for key in ("name", "tool_call_id"):
            if key in msg and not isinstance(msg[key], str):
                raise ChatTemplateError(
                    f"{at}: {key} must be a string, got {type(msg[key]).__name__}"
                )
        out.append(_plain(msg, at))
    return out


class ChatTemplate:
    """A compiled chat template plus the special-token strings it is rendered with.

    ``ChatTemplate(source, special_tokens={"bos_token": "[BOS]", ...}, path=...)``;
    ``ChatTemplate.from_pretrained(dir)``; ``render(messages, add_generation_prompt=True,
    tools=None, **kw)``.
    """

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Optional[Mapping[str, str]] = None,
        path: Optional[str] = None,
        limits: RenderLimits = RenderLimits(),
    ):
        if not isinstance(source, str):
            raise ChatTemplateError(
                f"{path or 'chat template'}: template must be a string, got {type(source).__name__}"
            )
        if (
            len(source) > MAX_TEMPLATE_BYTES
            or len(source.encode("utf-8", "replace")) > MAX_TEMPLATE_BYTES
        ):
            raise ChatTemplateError(f"{path or 'chat template'}: the chat template is larger than "
                                    f"MAX_TEMPLATE_BYTES={MAX_TEMPLATE_BYTES}")
        self.source = source
        self.path = path
        self.special_tokens = dict(special_tokens or {})
        self.limits = limits
        where = path or "chat template"
        try:
            self._template = _make_env(limits).from_string(source)
        except TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"{where}:{e.lineno}: chat template syntax error: {_one_line(e.message)}"
            ) from None
        except TemplateError as e:
            raise ChatTemplateError(f"{where}: chat template error: {_one_line(e)}") from None

    @classmethod
    def from_pretrained(cls, path: Union[str, os.PathLike]) -> "ChatTemplate":
        """Read ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``, from
        ``path``."""
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
                raise ChatTemplateError(
                    f"{config_file}: corrupt tokenizer_config.json: {_one_line(e)}"
                ) from None
            if not isinstance(cfg, dict):
                raise ChatTemplateError(
                    f"{config_file}: corrupt tokenizer_config.json: top level is not an object"
                )
        specials = {}
        for key in _SPECIAL_TOKEN_KEYS:
            v = cfg.get(key)
            if isinstance(v, Mapping):
                v = v.get("content")
            if isinstance(v, str):
                specials[key] = v
        if os.path.isfile(jinja_file):
            if (size := os.path.getsize(jinja_file)) > MAX_TEMPLATE_BYTES:
                raise ChatTemplateError(
                    f"{jinja_file}: the chat template has {size} bytes, more than "
                    f"MAX_TEMPLATE_BYTES={MAX_TEMPLATE_BYTES}"
                )
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
                f"{path}: no chat template (neither {CHAT_TEMPLATE_FILE} nor a 'chat_template' in "
                f"{TOKENIZER_CONFIG_FILE})"
            )
        return cls(template, special_tokens=specials, path=config_file)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        escape: Optional[Callable[[Any], Any]] = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt string (what transformers' ``apply_chat_template(...,
        tokenize=False)`` returns for the same template, messages and special tokens).

        escape: applied to the messages, tools, documents and kwargs (plain JSON values) before the
        template sees them (kimi_jax.text.conversation marks message text with it). The render is
        bounded by the template's RenderLimits; going over one is a ChatTemplateError naming the
        template."""
        chat = validate_messages(messages)
        # transformers aliases reasoning fields: templates reading any of the names see it.
        for i, m in enumerate(chat):
            reasoning = next(
                (
                    m[k]
                    for k in ("reasoning_content", "thinking", "reasoning")
                    if m.get(k) is not None
                ),
                None,
            )
            if reasoning is not None:
                chat[i] = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        if tools is not None:
            if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
                raise ChatTemplateError(
                    f"tools must be a list of JSON-schema dicts, got {type(tools).__name__}"
                )
            for j, t in enumerate(tools):
                if not isinstance(t, Mapping):
                    raise ChatTemplateError(
                        f"tools[{j}]: must be a JSON-schema dict, got {type(t).__name__}"
                    )
            tools = _plain(tools, "tools")
        documents = _plain(kwargs.pop("documents", None), "documents")
        extra = _plain(kwargs, "template kwargs")
        if escape is not None:
            chat, tools, documents, extra = (
                escape(chat),
                escape(tools),
                escape(documents),
                escape(extra),
            )
        variables = {**self.special_tokens, **extra}
        where = self.path or "chat template"
        lim = self.limits
        out: list[str] = []
        n = 0
        try:
            with _Deadline(lim.timeout_s):
                for piece in self._template.generate(
                    messages=chat,
                    tools=tools,
                    documents=documents,
                    add_generation_prompt=bool(add_generation_prompt),
                    **variables,
                ):
                    n += len(piece)
                    if n > lim.max_output_chars:
                        raise _LimitError(
                            f"output over the limit of {lim.max_output_chars} characters"
                        )
                    out.append(piece)
            return "".join(out)
        except _TemplateTimeout:
            raise ChatTemplateError(
                f"{where}: chat template took longer than {lim.timeout_s:g} s " "to render; refused"
            ) from None
        except _LimitError as e:
            raise ChatTemplateError(f"{where}: chat template refused: {_one_line(e)}") from None
        except MemoryError:
            raise ChatTemplateError(f"{where}: chat template ran out of memory") from None
        except SecurityError as e:
            raise ChatTemplateError(f"{where}: refused by the sandbox: {_one_line(e)}") from None
        except TemplateError as e:
            raise ChatTemplateError(f"{where}: chat template error: {_one_line(e)}") from None
        except RecursionError:
            raise ChatTemplateError(f"{where}: chat template error: recursion too deep") from None
        except (
            TypeError,
            ValueError,
            KeyError,
            IndexError,
            AttributeError,
            OverflowError,
            ZeroDivisionError,
        ) as e:
            raise ChatTemplateError(
                f"{where}: chat template failed: {type(e).__name__}: {_one_line(e)}"
            ) from None

    def __repr__(self) -> str:
        return f"ChatTemplate(path={self.path!r}, {len(self.source)} chars)"
