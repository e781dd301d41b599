"""An OpenAI chat request's fields (response_format, tools, tool_choice, parallel_tool_calls) as one
structured-outputs constraint (`from_openai`); tool calls follow Kimi's section as a Lark grammar
over its special tokens (`tool_call_grammar`)."""
from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from kimi_jax.engine.structured_params import (StructuredOutputError, StructuredOutputsParams,
                                               json_layout, prepare_schema)

__all__ = ["from_openai", "tool_call_grammar"]

_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
_CALL = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")


def _tool_function(tool: Any, where: str) -> tuple[str, dict]:
    if (
        not isinstance(tool, dict)
        or tool.get("type", "function") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise StructuredOutputError(
            f"{where}: a tool must be {{'type': 'function', 'function': {{...}}}}"
        )
    fn = tool["function"]
    name = fn.get("name")
    if (
        not isinstance(name, str)
        or not name
        or not all(c.isalnum() or c in "_-." for c in name)
        or not name.isascii()
    ):
        raise StructuredOutputError(
            f"{where}.function.name must be letters, digits, '_', '-' or '.', got {name!r}"
        )
    params = fn.get("parameters", {"type": "object"})
    if params is None:
        params = {"type": "object"}
    return name, prepare_schema(params, f"{where}.function.parameters")


def tool_call_grammar(
    tools: Sequence[dict],
    *,
    names: Optional[Sequence[str]] = None,
    single: bool = False,
    allow_text: bool = False,
    disable_any_whitespace: bool = False,
) -> str:
    """A Lark grammar for Kimi's tool-call section: calls to `names` (all when None) whose arguments
    match each ``parameters`` schema; `single`: one call; `allow_text`: free text first, the section
    optional."""
    fns = {}
    for i, t in enumerate(tools):
        name, params = _tool_function(t, f"tools[{i}]")
        if name in fns:
            raise StructuredOutputError(
                f"tools[{i}].function.name {name!r} repeats an earlier tool's name"
            )
        fns[name] = params
    chosen = list(fns) if names is None else list(names)
    for n in chosen:
        if n not in fns:
            raise StructuredOutputError(
                f"tool_choice names function {n!r}, which is not among the tools"
            )
    lines = []
    if allow_text:
        lines += ["start: TEXT? section?", "TEXT: /(?s:.+)/"]
    else:
        lines += ["start: section"]
    lines += [f"section: {_SECTION[0]} {'call' if single else 'call+'} {_SECTION[1]}",
              "call: " + " | ".join(f"call_{i}" for i in range(len(chosen))),
              "IDX: /[0-9]{1,3}/"]
    for i, n in enumerate(chosen):
        schema = dict(fns[n])
        schema["x-guidance"] = {
            **json_layout(disable_any_whitespace),
            **schema.get("x-guidance", {}),
        }
        lines.append(
            f'call_{i}: {_CALL[0]} {json.dumps("functions." + n + ":")} IDX {_CALL[1]} args_{i} '
            f'{_CALL[2]}'
        )
        lines.append(f"args_{i}: %json {json.dumps(schema)}")
    return "\n".join(lines)


def from_openai(response_format: Any = None, tools: Any = None, tool_choice: Any = None,
                parallel_tool_calls: Optional[bool] = None) -> Optional[StructuredOutputsParams]:
    """The constraint of an OpenAI chat request, or None (free text). tool_choice "required" / a
    named function: a tool-call section; "auto": free text (or response_format's JSON) or valid
    calls; "none": no special token. parallel_tool_calls=False: at most one call."""
    rf = None
    if response_format is not None:
        kinds = ("text", "json_object", "json_schema", "structural_tag")
        if not isinstance(response_format, dict) or response_format.get("type") not in kinds:
            raise StructuredOutputError("response_format.type must be 'text', 'json_object', "
                                        "'json_schema' or 'structural_tag'")
        if response_format["type"] == "structural_tag":  # vLLM's: structures [{begin, schema, end}]
            rf = StructuredOutputsParams(structural_tag={k: v for k, v in response_format.items()
                                                         if k != "type"})
        elif response_format["type"] == "json_object":
            rf = StructuredOutputsParams(json_object=True)
        elif response_format["type"] == "json_schema":
            js = response_format.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise StructuredOutputError(
                    "response_format.json_schema must be an object with a 'schema' object"
                )
            rf = StructuredOutputsParams(json=js.get("schema", {"type": "object"}))
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise StructuredOutputError("tool_choice is given but the request has no tools")
        return rf
    if not isinstance(tools, (list, tuple)):
        raise StructuredOutputError("tools must be a list of tool objects")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return rf or StructuredOutputsParams(grammar="start: TEXT?\nTEXT: /(?s:.+)/")
    single = parallel_tool_calls is False
    if choice == "required":
        return StructuredOutputsParams(grammar=tool_call_grammar(tools, single=single))
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise StructuredOutputError("tool_choice must be 'none', 'auto', 'required' or "
                                        "{'type': 'function', 'function': {'name': ...}}")
        return StructuredOutputsParams(grammar=tool_call_grammar(tools, names=[name], single=True))
    if choice != "auto":
        raise StructuredOutputError(
            f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}"
        )
    if rf is not None and rf.structural_tag is not None:
        raise StructuredOutputError("response_format of type 'structural_tag' cannot be combined "
                                    "with tools under tool_choice 'auto'")
    grammar = tool_call_grammar(tools, allow_text=rf is None, single=single)
    if rf is not None:
        body = grammar.replace("start: section", "start: answer | section", 1)
        schema = {"type": "object"} if rf.json_object else rf.json
        schema = prepare_schema(
            json.loads(schema) if isinstance(schema, str) else schema, "response_format"
        )
        schema["x-guidance"] = {**json_layout(False), **schema.get("x-guidance", {})}
        grammar = body + "\nanswer: %json " + json.dumps(schema)
    return StructuredOutputsParams(grammar=grammar)
