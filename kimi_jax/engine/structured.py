"""Constrained decoding through llguidance: a `StructuredOutputsParams` (vLLM's names, or `from_openai`)
compiles to a grammar; JSON schemas go through `prepare_schema` (objects closed, numbers bounded to
+-NUMBER_BOUND / INTEGER_BOUNDS); tool calls follow Kimi's section as a Lark grammar over its special
tokens. Each step the host fills a packed int32 bitmask [B, ceil(V/32)] that `apply_token_bitmask`
applies on the device. llguidance over xgrammar: BENCHMARKS.md "Structured outputs"."""
from __future__ import annotations

import collections
import dataclasses
import json
import re
import threading
from typing import Any, Optional, Sequence, Union

import jax.numpy as jnp
import numpy as np

__all__ = [
    "StructuredOutputsParams", "StructuredOutputError", "StructuredBackend", "RowMatcher",
    "apply_token_bitmask", "apply_token_bitmask_reference", "from_openai", "tool_call_grammar",
    "mask_words", "prepare_schema",
]

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
    JSON is laid out as ``json.dumps`` writes it (compact with disable_any_whitespace), no other whitespace;
    disable_additional_properties: `prepare_schema`'s closing (default True, unlike vLLM)."""
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
                f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got {set_ or 'none'}")
        return set_[0]

    def validate(self) -> None:
        k = self.kind()
        v = getattr(self, k)
        if k == "json" and not isinstance(v, (str, dict)):
            raise StructuredOutputError(f"structured_outputs.json must be a JSON schema (object or string), got {type(v).__name__}")
        if k in ("regex", "grammar") and (not isinstance(v, str) or not v):
            raise StructuredOutputError(f"structured_outputs.{k} must be a non-empty string")
        if k == "choice" and (isinstance(v, str) or not v or any(not isinstance(c, str) for c in v)):
            raise StructuredOutputError("structured_outputs.choice must be a non-empty list of strings")
        if k == "structural_tag" and not isinstance(v, (str, dict)):
            raise StructuredOutputError("structured_outputs.structural_tag must be an object or a JSON string")
        for flag in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, flag), bool):
                raise StructuredOutputError(f"structured_outputs.{flag} must be a boolean")

    def check_limits(self) -> None:
        k = self.kind()
        v = getattr(self, k)
        text = v if isinstance(v, str) else "".join(v) if k == "choice" else ""   # schemas: prepare_schema
        if len(text.encode("utf-8", "surrogatepass")) > MAX_CONSTRAINT_BYTES:
            raise StructuredOutputError(f"structured_outputs.{k} is longer than {MAX_CONSTRAINT_BYTES} bytes")
        if k in ("regex", "grammar"):
            check_repeats(v, f"structured_outputs.{k}")
        if k == "grammar":
            rules = len(re.findall(r"(?m)^\s*[?!]?[A-Za-z_][A-Za-z_0-9]*(\.-?\d+)?\s*:", v))
            if rules > MAX_GRAMMAR_RULES:
                raise StructuredOutputError(f"structured_outputs.grammar has {rules} rules, more than "
                                            f"{MAX_GRAMMAR_RULES}")

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
                schema = prepare_schema(schema, "structured_outputs.json", self.disable_additional_properties)
                return llg.LLMatcher.grammar_from_json_schema(schema, defaults=json_layout(self.disable_any_whitespace))
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
            raise StructuredOutputError(f"structured_outputs.{k}: {_one_line(e)}") from None

    def _structural_tag_grammar(self) -> str:
        """vLLM's structural tag as llguidance's: free text, each begin opening its schema's JSON."""
        from llguidance import StructTag
        spec = json.loads(self.structural_tag) if isinstance(self.structural_tag, str) else self.structural_tag
        where = "structured_outputs.structural_tag"
        if not isinstance(spec, dict) or not isinstance(spec.get("structures"), list) or not spec["structures"]:
            raise StructuredOutputError(f"{where} needs a non-empty 'structures' list")
        triggers = spec.get("triggers") or []
        tags = []
        for i, st in enumerate(spec["structures"]):
            if not isinstance(st, dict) or not isinstance(st.get("begin"), str) or not isinstance(st.get("end"), str):
                raise StructuredOutputError(f"{where}.structures[{i}] needs string 'begin' and 'end'")
            trig = next((t for t in triggers if isinstance(t, str) and t and st["begin"].startswith(t)), None)
            if trig is None:
                raise StructuredOutputError(f"{where}.structures[{i}].begin starts with none of the triggers")
            schema = prepare_schema(st.get("schema", {"type": "object"}), f"{where}.structures[{i}].schema",
                                    self.disable_additional_properties)
            tags.append(StructTag(trigger=trig, begin=st["begin"], grammar=schema, end=st["end"]))
        return StructTag.to_grammar(tags)


_NOT_SCHEMAS = ("enum", "const", "default", "examples", "required", "x-guidance")


def check_repeats(regex: str, where: str) -> None:
    for m in re.finditer(r"\{(\d+)(?:,(\d*))?\}", regex):
        if max(int(m.group(1)), int(m.group(2) or 0)) > MAX_REPEAT:
            raise StructuredOutputError(f"{where}: the repetition {m.group(0)} is over {MAX_REPEAT}")


def _schema_depth(root: dict, where: str) -> None:
    """Refuses nesting past MAX_SCHEMA_DEPTH ($refs followed) and $ref cycles with no schema between."""
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
                if all(isinstance(t := target(r), dict) and set(t) <= {"$ref", "$defs", "definitions",
                                                                       "$schema", "$id", "title"}
                       for r in refs[refs.index(ref):]):
                    raise StructuredOutputError(f"{where}: $ref {ref!r} refers to itself through no "
                                                "schema of its own, so no value matches")
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
        raise StructuredOutputError(f"{where} must be a JSON schema object, got {type(schema).__name__}")

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
            raise StructuredOutputError(f"{path}.x-guidance must be an object, got {_typename(out['x-guidance'])}")
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
    """llguidance JSON options: no free whitespace; separators as json.dumps (compact: ``,`` ``:``)."""
    return {"whitespace_flexible": False, "item_separator": "," if compact else ", ",
            "key_separator": ":" if compact else ": "}


def _one_line(e: Any, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- OpenAI fields -> constraint

_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
_CALL = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")


def _tool_function(tool: Any, where: str) -> tuple[str, dict]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
        raise StructuredOutputError(f"{where}: a tool must be {{'type': 'function', 'function': {{...}}}}")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-." for c in name) or not name.isascii():
        raise StructuredOutputError(f"{where}.function.name must be letters, digits, '_', '-' or '.', got {name!r}")
    params = fn.get("parameters", {"type": "object"})
    if params is None:
        params = {"type": "object"}
    return name, prepare_schema(params, f"{where}.function.parameters")


def tool_call_grammar(tools: Sequence[dict], *, names: Optional[Sequence[str]] = None, single: bool = False,
                      allow_text: bool = False, disable_any_whitespace: bool = False) -> str:
    """A Lark grammar for Kimi's tool-call section: calls to `names` (all when None) whose arguments match
    each ``parameters`` schema; `single`: one call; `allow_text`: free text first, the section optional."""
    fns = {}
    for i, t in enumerate(tools):
        name, params = _tool_function(t, f"tools[{i}]")
        if name in fns:
            raise StructuredOutputError(f"tools[{i}].function.name {name!r} repeats an earlier tool's name")
        fns[name] = params
    chosen = list(fns) if names is None else list(names)
    for n in chosen:
        if n not in fns:
            raise StructuredOutputError(f"tool_choice names function {n!r}, which is not among the tools")
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
        schema["x-guidance"] = {**json_layout(disable_any_whitespace), **schema.get("x-guidance", {})}
        lines.append(f'call_{i}: {_CALL[0]} {json.dumps("functions." + n + ":")} IDX {_CALL[1]} args_{i} {_CALL[2]}')
        lines.append(f"args_{i}: %json {json.dumps(schema)}")
    return "\n".join(lines)


def from_openai(response_format: Any = None, tools: Any = None, tool_choice: Any = None,
                parallel_tool_calls: Optional[bool] = None) -> Optional[StructuredOutputsParams]:
    """The constraint of an OpenAI chat request, or None (free text). tool_choice "required" / a named
    function: a tool-call section; "auto": free text (or response_format's JSON) or valid calls; "none":
    no special token. parallel_tool_calls=False: at most one call."""
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
                raise StructuredOutputError("response_format.json_schema must be an object with a 'schema' object")
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
        raise StructuredOutputError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}")
    if rf is not None and rf.structural_tag is not None:
        raise StructuredOutputError("response_format of type 'structural_tag' cannot be combined "
                                    "with tools under tool_choice 'auto'")
    grammar = tool_call_grammar(tools, allow_text=rf is None, single=single)
    if rf is not None:
        body = grammar.replace("start: section", "start: answer | section", 1)
        schema = {"type": "object"} if rf.json_object else rf.json
        schema = prepare_schema(json.loads(schema) if isinstance(schema, str) else schema, "response_format")
        schema["x-guidance"] = {**json_layout(False), **schema.get("x-guidance", {})}
        grammar = body + "\nanswer: %json " + json.dumps(schema)
    return StructuredOutputsParams(grammar=grammar)


# ---------------------------------------------------------------- matchers and masks

def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class RowMatcher:
    """One request's grammar state: `accept` (False: the token broke the grammar), `is_finished`."""

    def __init__(self, matcher, grammar: str):
        self._m = matcher
        self.grammar = grammar

    def accept(self, token: int) -> bool:
        return bool(self._m.consume_token(int(token)))

    def is_finished(self) -> bool:
        return bool(self._m.is_stopped())

    def is_error(self) -> bool:
        return bool(self._m.is_error())

    def error(self) -> str:
        return self._m.get_error()

    def closing_path(self, priority: Sequence[int], stop_ids, limit: int, first: Optional[int] = None
                     ) -> Optional[list[int]]:
        """Tokens a greedy closer writes to a complete output (forced text, else `priority`'s first allowed,
        else the lowest id), None past `limit`; on a copy; `first`: taken before, not counted."""
        m = self._m.deep_copy()
        if first is not None and not m.consume_token(int(first)):
            return None
        path: list[int] = []
        while len(path) < limit:
            if m.is_stopped():
                return path
            forced = m.compute_ff_tokens()
            if forced:
                if not m.consume_tokens(forced):
                    return None
                path += forced
                continue
            bits = np.frombuffer(m.compute_bitmask(), np.uint8)
            allowed = lambda t: t < bits.size * 8 and (bits[t >> 3] >> (t & 7)) & 1
            pick = next((t for t in priority if allowed(t)), None)
            if pick is None:
                nz = np.flatnonzero(np.unpackbits(bits, bitorder="little"))
                if nz.size == 0:
                    return None
                pick = int(nz[0])
            path.append(pick)
            if pick in stop_ids:
                return path
            if not m.consume_token(pick):
                return None
        return None


class StructuredBackend:
    """llguidance over one tokenizer and `vocab_size` logits, with the `cache_size` most recent compiled
    grammars; llguidance's tokenizer is built on first use."""

    def __init__(self, tokenizer, vocab_size: int, *, cache_size: int = 128, num_threads: Optional[int] = None):
        import llguidance as llg
        if tokenizer is None:
            raise StructuredOutputError("structured outputs need the model's tokenizer; this model has none")
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self._llg = llg
        self._lltok_built = None
        self.words = mask_words(self.vocab_size)
        self._num_threads = num_threads
        self._executor_built = None
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def _tok_words(self) -> int:
        """Mask words of the tokenizer's ids (its vocabulary may be larger than the model's logits)."""
        return mask_words(self.tokenizer.vocab_size)

    @property
    def _lltok(self):
        """The tokenizer as llguidance sees it, built on first use."""
        with self._lock:
            if self._lltok_built is None:
                from llguidance.tiktoken import lltokenizer_from_encoding
                self._lltok_built = lltokenizer_from_encoding(
                    self.tokenizer._enc, n_vocab=self.tokenizer.vocab_size,
                    eos_token=list(self.tokenizer.stop_token_ids))
            return self._lltok_built

    @property
    def _executor(self):
        if self._executor_built is None:
            self._executor_built = self._llg.LLExecutor(num_threads=self._num_threads)
        return self._executor_built

    @property
    def closing_priority(self) -> list[int]:
        """Token preference of `RowMatcher.closing_path`: stops, closing markers, then JSON-closing bytes."""
        if getattr(self, "_priority", None) is None:
            tok = self.tokenizer
            ids = list(tok.stop_token_ids)
            ids += [tok.special_tokens[m] for m in ("<|tool_calls_section_end|>", "<|tool_call_end|>")
                    if m in tok.special_tokens]
            ids += [tok.mergeable_ranks[bytes([c])] for c in b'"}],:0[{tfn' if bytes([c]) in tok.mergeable_ranks]
            self._priority = ids
        return self._priority

    #: slack a close keeps: one sampled token (an opening brace) can lengthen it
    close_margin: int = 16

    def bitmask_closing(self, mask_row: np.ndarray, row: RowMatcher, tokens_left: int) -> bool:
        """Narrow the row's mask to the greedy close's next token once the close needs all but `close_margin`
        of `tokens_left` (before that, forbid special tokens); True if it narrowed."""
        stops = set(self.tokenizer.stop_token_ids)
        limit = 2 * tokens_left + 16
        path = row.closing_path(self.closing_priority, stops, limit)
        if path is None or not path:
            return False
        if len(path) + self.close_margin >= tokens_left:
            t = path[0]
            if t >= self.words * 32:
                return False
            mask_row[:] = 0
            mask_row[t >> 5] = np.int32(np.uint32(1 << (t & 31)).view(np.int32))
            return True
        narrowed = False
        base = self.tokenizer.num_base_tokens
        bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")
        # each special token's close may search only as far as still fits, all of them together at
        # most `limit` tokens (the engine thread's work a step stays bounded; past it, forbid the rest)
        fits, budget = tokens_left - self.close_margin - 1, limit
        for t in np.flatnonzero(bits[base:]) + base:
            t = int(t)
            if t in stops or t >= self.vocab_size:
                continue
            reach = min(fits, budget)
            after = row.closing_path(self.closing_priority, stops, reach, first=t) if reach > 0 else None
            budget -= reach if after is None else len(after)
            if after is None or 1 + len(after) + self.close_margin >= tokens_left:
                mask_row[t >> 5] &= np.int32(~np.uint32(1 << (t & 31)).view(np.int32))
                narrowed = True
        return narrowed

    def compile(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar of params, checked against this tokenizer (StructuredOutputError)."""
        grammar = params.to_grammar()
        self._start(grammar, params.kind())
        return grammar

    def _start(self, grammar: str, kind: str) -> Any:
        """The compiled start state (its first mask computed: some errors show only then), cached."""
        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
                return hit
        m = _on_big_stack(lambda: self._first_state(grammar))
        if m.is_error():
            raise StructuredOutputError(f"structured_outputs.{kind}: {_one_line(m.get_error())}")
        hit = m
        with self._lock:
            self._cache[grammar] = hit
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return hit

    def _first_state(self, grammar: str) -> Any:
        m = self._llg.LLMatcher(self._lltok, grammar, log_level=0)
        if not m.is_error():
            m.compute_bitmask()
        return m

    def matcher(self, params: StructuredOutputsParams, budget: Optional[int] = None) -> RowMatcher:
        """A fresh grammar state; an output that `budget` cuts off ends with "length"."""
        grammar = params.to_grammar()
        return RowMatcher(self._start(grammar, params.kind()).deep_copy(), grammar)

    def fill_bitmask(self, rows: Sequence[Optional[RowMatcher]], batch: Optional[int] = None) -> np.ndarray:
        """[batch, ceil(vocab_size / 32)] int32 for a step's rows (None or past len(rows): all ones)."""
        B = len(rows) if batch is None else batch
        mask = np.full((B, self._tok_words), -1, np.int32)
        pairs = [(r._m, b) for b, r in enumerate(rows) if r is not None]
        if pairs:
            self._executor.unsafe_compute_mask_ptr(pairs, mask.ctypes.data, self._tok_words * 4, B)
        if self._tok_words >= self.words:
            return np.ascontiguousarray(mask[:, :self.words])
        extra = np.full((B, self.words - self._tok_words), -1, np.int32)
        extra[[b for _, b in pairs]] = 0
        return np.concatenate([mask, extra], axis=1)


COMPILE_STACK = 256 << 20     # llguidance builds 20,000 chained rules on it (8 MiB: SIGSEGV near 3,000)
_STACK_LOCK = threading.Lock()


def _on_big_stack(fn):
    """fn() on a thread of its own with a COMPILE_STACK stack (reserved, used as it grows)."""
    box: dict = {}

    def run():
        try:
            box["v"] = fn()
        except BaseException as e:      # re-raised on the caller's thread
            box["e"] = e
    with _STACK_LOCK:
        old = threading.stack_size(COMPILE_STACK)
        try:
            t = threading.Thread(target=run, name="kimi-jax-grammar", daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]


def apply_token_bitmask(logits_BV: jnp.ndarray, mask_Bw: jnp.ndarray) -> jnp.ndarray:
    """Logits with every token whose bit (t % 32 of word t // 32) is clear set to -inf (jit-friendly)."""
    B, V = logits_BV.shape
    bits_Bw32 = (mask_Bw[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed_BV = bits_Bw32.reshape(B, -1)[:, :V].astype(bool)
    return jnp.where(allowed_BV, logits_BV, jnp.asarray(-jnp.inf, logits_BV.dtype))


def apply_token_bitmask_reference(logits_BV: np.ndarray, mask_Bw: np.ndarray) -> np.ndarray:
    """Plain-loop numpy reference of `apply_token_bitmask`."""
    out = np.array(logits_BV, copy=True)
    B, V = out.shape
    for b in range(B):
        for t in range(V):
            if not (int(mask_Bw[b, t // 32]) >> (t % 32)) & 1:
                out[b, t] = -np.inf
    return out
