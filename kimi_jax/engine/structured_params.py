"""Structured outputs' constraint type: `StructuredOutputsParams` (vLLM's names), its checks and
limits, its llguidance grammar (`to_grammar`), and JSON schemas as compiled (`prepare_schema`:
objects closed, numbers bounded to +-NUMBER_BOUND / INTEGER_BOUNDS)."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional, Sequence, Union

__all__ = ["StructuredOutputsParams", "StructuredOutputError", "prepare_schema", "json_layout",
           "check_repeats", "one_line"]

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
NUMBER_BOUND = 1e18                             # llguidance's float-range regexes stop near 1e19
INTEGER_BOUNDS = (-9 * 10 ** 18, 9 * 10 ** 18)
# llguidance crashes (SIGSEGV) near 1,000 chained $refs or 3,000 chained rules; x{100000}: seconds
MAX_SCHEMA_DEPTH = 128        # nested objects and lists of a schema's JSON, $refs followed
MAX_GRAMMAR_RULES = 500       # rule definitions of a Lark grammar
MAX_REPEAT = 10_000           # a regex's counted repetition {n} / {n,m}
MAX_CONSTRAINT_BYTES = 65_536  # a regex, a grammar, a JSON schema, a choice list (UTF-8, in total)


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled or a request field that does not describe one."""


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One of json (schema), regex, choice, grammar (Lark or GBNF), json_object, structural_tag.
    JSON is laid out as ``json.dumps`` writes it (compact with disable_any_whitespace), no other
    whitespace; disable_additional_properties: `prepare_schema`'s closing (default True, unlike
    vLLM)."""
    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Union[str, dict]] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = True

    def kind(self) -> str:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise StructuredOutputError(
                f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got {set_ or 'none'}"
            )
        return set_[0]

    def validate(self) -> None:
        k = self.kind()
        v = getattr(self, k)
        if k == "json" and not isinstance(v, (str, dict)):
            raise StructuredOutputError(
                "structured_outputs.json must be a JSON schema (object or string), got "
                f"{type(v).__name__}"
            )
        if k in ("regex", "grammar") and (not isinstance(v, str) or not v):
            raise StructuredOutputError(f"structured_outputs.{k} must be a non-empty string")
        if k == "choice" and (
            isinstance(v, str) or not v or any(not isinstance(c, str) for c in v)
        ):
            raise StructuredOutputError(
                "structured_outputs.choice must be a non-empty list of strings"
            )
        if k == "structural_tag" and not isinstance(v, (str, dict)):
            raise StructuredOutputError(
                "structured_outputs.structural_tag must be an object or a JSON string"
            )
        for flag in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, flag), bool):
                raise StructuredOutputError(f"structured_outputs.{flag} must be a boolean")

    def check_limits(self) -> None:
        k = self.kind()
        v = getattr(self, k)
        # schemas: prepare_schema
        text = v if isinstance(v, str) else "".join(v) if k == "choice" else ""
        if len(text.encode("utf-8", "surrogatepass")) > MAX_CONSTRAINT_BYTES:
            raise StructuredOutputError(
                f"structured_outputs.{k} is longer than {MAX_CONSTRAINT_BYTES} bytes"
            )
        if k in ("regex", "grammar"):
            check_repeats(v, f"structured_outputs.{k}")
        if k == "grammar":
            rules = len(re.findall(r"(?m)^\s*[?!]?[A-Za-z_][A-Za-z_0-9]*(\.-?\d+)?\s*:", v))
            if rules > MAX_GRAMMAR_RULES:
                raise StructuredOutputError(
                    f"structured_outputs.grammar has {rules} rules, more than {MAX_GRAMMAR_RULES}"
                )

    def to_grammar(self) -> str:
        """The llguidance grammar (a JSON string) of this constraint."""
        import llguidance as llg
        self.validate()
        k = self.kind()
        self.check_limits()
        try:
            if k in ("json", "json_object"):
                schema = {"type": "object"} if k == "json_object" else self.json
                if isinstance(schema, str):
                    schema = json.loads(schema)
                schema = prepare_schema(
                    schema, "structured_outputs.json", self.disable_additional_properties
                )
                return llg.LLMatcher.grammar_from_json_schema(
                    schema, defaults=json_layout(self.disable_any_whitespace)
                )
            if k == "structural_tag":
                return self._structural_tag_grammar()
            if k == "regex":
                return llg.LLMatcher.grammar_from_regex(self.regex)
            if k == "choice":
                return llg.LLMatcher.grammar_from_lark(
                    "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in self.choice))
            return llg.grammar_from("grammar", self.grammar)  # Lark, else GBNF (`root ::= ...`)
        except StructuredOutputError:
            raise
        except (ValueError, TypeError, AssertionError) as e:
            raise StructuredOutputError(f"structured_outputs.{k}: {one_line(e)}") from None

    def _structural_tag_grammar(self) -> str:
        """vLLM's structural tag as llguidance's: free text, each begin opens its schema's JSON."""
        from llguidance import StructTag

        spec = (
            json.loads(self.structural_tag)
            if isinstance(self.structural_tag, str)
            else self.structural_tag
        )
        where = "structured_outputs.structural_tag"
        if (
            not isinstance(spec, dict)
            or not isinstance(spec.get("structures"), list)
            or not spec["structures"]
        ):
            raise StructuredOutputError(f"{where} needs a non-empty 'structures' list")
        triggers = spec.get("triggers") or []
        tags = []
        for i, st in enumerate(spec["structures"]):
            if (
                not isinstance(st, dict)
                or not isinstance(st.get("begin"), str)
                or not isinstance(st.get("end"), str)
            ):
                raise StructuredOutputError(
                    f"{where}.structures[{i}] needs string 'begin' and 'end'"
                )
            trig = next(
                (t for t in triggers if isinstance(t, str) and t and st["begin"].startswith(t)),
                None,
            )
            if trig is None:
                raise StructuredOutputError(
                    f"{where}.structures[{i}].begin starts with none of the triggers"
                )
            schema = prepare_schema(
                st.get("schema", {"type": "object"}),
                f"{where}.structures[{i}].schema",
                self.disable_additional_properties,
            )
            tags.append(StructTag(trigger=trig, begin=st["begin"], grammar=schema, end=st["end"]))
        return StructTag.to_grammar(tags)


_NOT_SCHEMAS = ("enum", "const", "default", "examples", "required", "x-guidance")


def check_repeats(regex: str, where: str) -> None:
    for m in re.finditer(r"\{(\d+)(?:,(\d*))?\}", regex):
        if max(int(m.group(1)), int(m.group(2) or 0)) > MAX_REPEAT:
            raise StructuredOutputError(
                f"{where}: the repetition {m.group(0)} is over {MAX_REPEAT}"
            )


def _schema_depth(root: dict, where: str) -> None:
    """Refuses nesting past MAX_SCHEMA_DEPTH ($refs followed) and $ref cycles without a schema."""
    memo: dict[str, int] = {}

    def target(ref: str) -> Any:
        node: Any = root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        return node

    def depth(s: Any, level: int, refs: tuple) -> int:
        if level > MAX_SCHEMA_DEPTH:
            raise StructuredOutputError(f"{where} nests schemas more than {MAX_SCHEMA_DEPTH} deep "
                                        "($refs followed)")
        if isinstance(s, list):
            return max((depth(v, level, refs) for v in s), default=0)
        if not isinstance(s, dict):
            return 0
        d = 0
        ref = s.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            if ref in refs:
                if all(
                    isinstance(t := target(r), dict)
                    and set(t) <= {"$ref", "$defs", "definitions", "$schema", "$id", "title"}
                    for r in refs[refs.index(ref) :]
                ):
                    raise StructuredOutputError(
                        f"{where}: $ref {ref!r} refers to itself through no "
                        "schema of its own, so no value matches"
                    )
            elif ref in memo:
                if level + memo[ref] > MAX_SCHEMA_DEPTH:
                    depth({}, MAX_SCHEMA_DEPTH + 1, refs)
                d = memo[ref]
            else:
                memo[ref] = d = depth(target(ref), level, refs + (ref,))
        for k, v in s.items():
            if k not in _NOT_SCHEMAS and k != "$ref":
                d = max(d, 1 + depth(v, level + 1, refs))
        return d
    depth(root, 0, ())


def prepare_schema(schema: Any, where: str, close: bool = True) -> dict:
    """A copy of a JSON schema as compiled (`close`: objects closed, not ``allOf`` branches)."""
    if not isinstance(schema, dict):
        raise StructuredOutputError(
            f"{where} must be a JSON schema object, got {type(schema).__name__}"
        )

    def walk(s: Any, path: str, in_all_of: bool = False, level: int = 0) -> Any:
        if level > 2 * MAX_SCHEMA_DEPTH:
            raise StructuredOutputError(f"{where} nests schemas more than {MAX_SCHEMA_DEPTH} deep")
        if isinstance(s, list):
            return [walk(v, f"{path}[{i}]", in_all_of, level + 1) for i, v in enumerate(s)]
        if not isinstance(s, dict):
            return s
        out = {}
        for k, v in s.items():
            out[k] = v if k in _NOT_SCHEMAS else walk(v, f"{path}.{k}", k == "allOf", level + 1)
        if isinstance(out.get("pattern"), str):
            check_repeats(out["pattern"], f"{path}.pattern")
        if "x-guidance" in out and not isinstance(out["x-guidance"], dict):
            raise StructuredOutputError(
                f"{path}.x-guidance must be an object, got {_typename(out['x-guidance'])}"
            )
        if (close and not in_all_of and "properties" in out and "additionalProperties" not in out
                and "unevaluatedProperties" not in out and "patternProperties" not in out):
            out["additionalProperties"] = False
        types = out.get("type")
        types = types if isinstance(types, list) else [types]
        if "number" in types or "integer" in types:
            lo, hi = (-NUMBER_BOUND, NUMBER_BOUND) if "number" in types else INTEGER_BOUNDS
            if "minimum" not in out and "exclusiveMinimum" not in out:
                out["minimum"] = lo
            if "maximum" not in out and "exclusiveMaximum" not in out:
                out["maximum"] = hi
        return out
    out = walk(schema, where)
    if len(json.dumps(out)) > MAX_CONSTRAINT_BYTES:
        raise StructuredOutputError(f"{where} is longer than {MAX_CONSTRAINT_BYTES} bytes")
    _schema_depth(out, where)
    return out


def _typename(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def json_layout(compact: bool) -> dict:
    """llguidance JSON options: no free whitespace; compact json.dumps separators (``,`` ``:``)."""
    return {"whitespace_flexible": False, "item_separator": "," if compact else ", ",
            "key_separator": ":" if compact else ": "}


def one_line(e: Any, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
