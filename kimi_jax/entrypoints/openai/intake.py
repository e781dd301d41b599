"""Bounds on what a request may ask before any work is done: JSON depth, body size, choices."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Union

MAX_DEPTH = 128                   # JSON nesting of a body (a request needs far fewer)


class TooDeep(ValueError):
    """A JSON text nested deeper than the limit (or than the parser can go)."""


class NumberTooLong(ValueError):
    """A JSON integer with more digits than Python converts (sys.get_int_max_str_digits)."""


def depth(value) -> int:
    """The nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d + 1)
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def loads(text: Union[str, bytes], max_depth: int = MAX_DEPTH):
    """json.loads, refusing nesting beyond max_depth (TooDeep) and integers beyond the interpreter's
    digit limit (NumberTooLong); its other errors as json.loads raises them."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(f"JSON nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError:
        raise
    except ValueError:                  # int(): more digits than the interpreter's limit
        raise NumberTooLong(f"JSON has an integer of more than {sys.get_int_max_str_digits()} "
                            "digits") from None
    if depth(value) > max_depth:
        raise TooDeep(f"JSON nested deeper than {max_depth} levels")
    return value


def json_text(v: str) -> str:
    """A JSON string (a schema), held to the body's limits; not JSON, refused where it is read."""
    try:
        loads(v)
    except TooDeep as e:
        raise ValueError(f"the JSON string is {e}") from None
    except NumberTooLong:
        raise
    except ValueError:
        pass
    return v


def bad_key(value) -> str:
    """The path of the first object key that is not valid Unicode (a lone surrogate), escaped."""
    stack = [("", value)]
    while stack:
        where, v = stack.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, x in items:
            name = f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}" if where else k
            if isinstance(k, str):
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return name.encode("utf-8", "backslashreplace").decode("utf-8")
            stack.append((name, x))
    return ""


def first_line(text, limit: int) -> str:
    line = " ".join(next((ln for ln in str(text).splitlines() if ln.strip()), "").split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def text_chars(value) -> int:
    """Characters in every string of a parsed JSON value (keys included), without recursion."""
    n, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            n += len(v)
        elif isinstance(v, dict):
            n += sum(len(k) for k in v if isinstance(k, str))
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return n


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one HTTP request may ask: body bytes (413 beyond), choices = prompts x n and prompt
    characters (400)."""

    max_body_bytes: int = 64 * 2**20
    max_choices: int = 256
    max_prompt_chars: int = 8 * 2**20
    max_depth: int = MAX_DEPTH

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f.name} must be an integer >= 1, got {v!r}")
