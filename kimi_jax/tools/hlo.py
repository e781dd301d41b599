"""A compiled program's HLO text: its computations, how often each runs, its collectives, op
categories.

Collectives count once per execution: a collective in a while-loop body runs once per trip (the
loop's `known_trip_count`, else its condition's constant bound; nested loops multiply); an async
pair counts once. Categories of an executed op (`categorize`): its collective kind; attention when
its Python stack is inside MLA.__call__ / _softmax / the paged attention ops but not a projection;
matmul for dots, gemm custom calls, fusions holding one, and INT4 dequantization; rest for
everything else.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from typing import Optional

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
CATEGORIES = COLLECTIVE_KINDS + ("matmul", "attention", "rest")

# ---- HLO text parsing ----------------------------------------------------------------------------

_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_SHAPE_RE = re.compile(
    r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2|"
    r"f8e4m3|f8e3m4|f8e4m3fnuz|f8e5m2fnuz|c64|c128|token)\[([0-9,]*)\]"
)
_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
    "f16": 2,
    "bf16": 2,
    "f32": 4,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "token": 0,
}
_CALL_ATTRS = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_STACK_ID = re.compile(r"stack_frame_id=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class HloInstr:
    name: str
    opcode: str
    type_str: str
    rest: str                         # operands and attributes (the remainder of the line)
    computation: str

    @property
    def result_bytes(self) -> int:
        return int(sum(_DTYPE_BYTES.get(dt, 0) * math.prod(int(d) for d in dims.split(",") if d)
                       for dt, dims in _SHAPE_RE.findall(self.type_str)))

    @property
    def kind(self) -> Optional[str]:
        """The collective kind ('all-reduce', ...) of this instruction, or None."""
        op = self.opcode
        for k in COLLECTIVE_KINDS:
            if op == k or op == k + "-start":
                return k
        return None

    @property
    def group_size(self) -> Optional[int]:
        """Devices per replica group (None if not stated)."""
        m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", self.rest)
        if m:
            sizes = dict((k.strip("' "), int(v)) for k, v in
                         (kv.split("=") for kv in m.group(1).split(",") if "=" in kv))
            axes = [a.strip("' ") for a in m.group(2).split(",") if a.strip("' ")]
            return math.prod(sizes[a] for a in axes) if axes else 1
        m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", self.rest)
        if m:
            return int(m.group(2))
        m = re.search(r"replica_groups=\{\{([^}]*)\}", self.rest)
        if m:
            return len([x for x in m.group(1).split(",") if x.strip()])
        m = re.search(r"source_target_pairs=\{(.*?)\}\}", self.rest)   # collective-permute
        if m:
            pairs = re.findall(r"\{(\d+),(\d+)", m.group(0))
            return 1 if all(a == b for a, b in pairs) else 2
        return None

    @property
    def stack_frame_id(self) -> Optional[int]:
        m = _STACK_ID.search(self.rest)
        return int(m.group(1)) if m else None

    @property
    def op_name(self) -> str:
        m = _OP_NAME.search(self.rest)
        return m.group(1) if m else ""


@dataclasses.dataclass
class HloModule:
    computations: dict[str, list[HloInstr]]
    entry: str
    functions: dict[int, str]                       # stack frame id -> function name
    parents: dict[int, int]                         # stack frame id -> parent frame id

    @property
    def instructions(self) -> dict[str, HloInstr]:
        return {i.name: i for instrs in self.computations.values() for i in instrs}

    def stack(self, frame_id: Optional[int]) -> list[str]:
        """Python function names of a stack frame, innermost first."""
        out, seen = [], set()
        while frame_id and frame_id in self.functions and frame_id not in seen:
            seen.add(frame_id)
            out.append(self.functions[frame_id])
            frame_id = self.parents.get(frame_id)
        return out


def parse_hlo(text: str) -> HloModule:
    """Computations and instructions of an HLO module's text (`compiled.as_text()`)."""
    comps: dict[str, list[HloInstr]] = {}
    entry, cur = None, None
    names: dict[int, str] = {}
    fn_of_loc: dict[int, int] = {}
    frames: dict[int, tuple[int, int]] = {}
    section = None
    for line in text.splitlines():
        s = line.strip()
        if s in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = s
            continue
        if section and cur is None:
            if not s:
                continue
            m = re.match(r"^(\d+)\s+(.*)$", s)
            if m and not s.startswith(("%", "ENTRY")):
                k, v = int(m.group(1)), m.group(2)
                if section == "FunctionNames":
                    names[k] = v.strip('"')
                elif section == "FileLocations":
                    f = re.search(r"function_name_id=(\d+)", v)
                    fn_of_loc[k] = int(f.group(1)) if f else 0
                elif section == "StackFrames":
                    loc = re.search(r"file_location_id=(\d+)", v)
                    par = re.search(r"parent_frame_id=(\d+)", v)
                    frames[k] = (int(loc.group(1)) if loc else 0, int(par.group(1)) if par else 0)
                continue
            section = None
        if cur is None:
            m = _COMP_RE.match(line)
            if m and not line.startswith("HloModule"):
                cur = m.group(2)
                comps[cur] = []
                if m.group(1):
                    entry = cur
            continue
        if s == "}":
            cur = None
            continue
        m = _INSTR_RE.match(line)
        if m:
            comps[cur].append(HloInstr(m.group(1), m.group(3), m.group(2), m.group(4), cur))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    functions = {fid: names.get(fn_of_loc.get(loc, 0), "?") for fid, (loc, _) in frames.items()}
    parents = {fid: par for fid, (_, par) in frames.items()}
    return HloModule(comps, entry, functions, parents)


def _callees(instr: HloInstr, module: HloModule) -> list[tuple[str, int]]:
    """(computation, executions per execution of `instr`) for the computations `instr` runs."""
    if instr.opcode in ("async-done", "async-update") or instr.opcode.endswith("-done"):
        return []
    out = []
    trips = None
    if instr.opcode == "while":
        m = _TRIP.search(instr.rest)
        trips = int(m.group(1)) if m else _trip_from_condition(instr, module)
    for attr, comp in _CALL_ATTRS.findall(instr.rest):
        if attr == "to_apply" or comp not in module.computations:   # reducers hold no collectives
            continue
        if attr == "body":
            out.append((comp, trips))
        elif attr == "condition":
            out.append((comp, trips + 1))
        else:
            out.append((comp, 1))
    m = _BRANCHES.search(instr.rest)
    if m:   # a conditional runs one branch; count each (an upper bound, flagged by the caller)
        out += [(c.strip().lstrip("%"), 1) for c in m.group(1).split(",") if c.strip()]
    return out


def _trip_from_condition(instr: HloInstr, module: HloModule) -> int:
    m = re.search(r"condition=%?([\w.\-]+)", instr.rest)
    body = module.computations.get(m.group(1), []) if m else []
    consts = [int(c) for i in body if i.opcode == "constant"
              for c in re.findall(r"^(\d+)\)", i.rest)]
    cmp_lt = any(i.opcode == "compare" and "direction=LT" in i.rest for i in body)
    if consts and cmp_lt:
        return max(consts)
    raise ValueError(f"while loop {instr.name}: no known_trip_count and no constant bound in its "
                     "condition; cannot count the collectives in its body")


def execution_counts(module: HloModule) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation."""
    counts: dict[str, int] = defaultdict(int)

    def visit(comp: str, mult: int, depth: int = 0):
        if depth > 64:
            raise ValueError("HLO call graph too deep (cycle?)")
        counts[comp] += mult
        for instr in module.computations.get(comp, []):
            for callee, n in _callees(instr, module):
                visit(callee, mult * n, depth + 1)

    visit(module.entry, 1)
    return dict(counts)


@dataclasses.dataclass
class CollectiveOp:
    kind: str
    name: str
    executions: int             # per step (trip counts applied)
    bytes: int                  # result bytes of one execution (gathered size for all-gather)
    group_size: Optional[int]
    in_loop: bool
    source: str                 # the JAX op that produced it (HLO op_name metadata)

    @property
    def trivial(self) -> bool:
        """Groups of one device: no data moves (XLA still emits the op)."""
        return self.group_size == 1


@dataclasses.dataclass
class CollectiveCounts:
    ops: list[CollectiveOp]
    hlo_text: str = dataclasses.field(default="", repr=False)   # the program they were counted in

    def count(self, kind: Optional[str] = None, *, trivial: bool = False) -> int:
        """Executions per step of `kind` (all kinds if None). Ops whose groups hold one device
        (e.g. a psum over a mesh axis of size 1: no communication) count only with trivial=True."""
        return sum(o.executions for o in self.ops
                   if (kind is None or o.kind == kind) and (trivial or not o.trivial))

    def by_kind(self, *, trivial: bool = False) -> dict[str, int]:
        return {k: self.count(k, trivial=trivial) for k in COLLECTIVE_KINDS}

    def static_by_kind(self) -> dict[str, int]:
        return {
            k: sum(1 for o in self.ops if o.kind == k and not o.trivial) for k in COLLECTIVE_KINDS
        }

    def to_json(self) -> dict:
        return {
            "per_step": self.by_kind(),
            "total_per_step": self.count(),
            "trivial_per_step": {
                k: self.count(k, trivial=True) - self.count(k) for k in COLLECTIVE_KINDS
            },
            "static_ops": self.static_by_kind(),
            "ops": [dataclasses.asdict(o) for o in self.ops],
        }


def collectives_of_hlo(text_or_module) -> CollectiveCounts:
    """Every collective of a compiled program, with how many times it runs per execution."""
    module = text_or_module if isinstance(text_or_module, HloModule) else parse_hlo(text_or_module)
    runs = execution_counts(module)
    ops = []
    for comp, instrs in module.computations.items():
        n = runs.get(comp, 0)
        if not n:
            continue
        for i in instrs:
            if i.kind is None:
                continue
            ops.append(CollectiveOp(kind=i.kind, name=i.name, executions=n, bytes=i.result_bytes,
                                    group_size=i.group_size, in_loop=n > 1 or comp != module.entry,
                                    source=i.op_name))
    return CollectiveCounts(ops)


# ---- op categories -------------------------------------------------------------------------------

_MATMUL_OPS = ("dot", "convolution", "ragged-dot")
_GEMM_TARGET = re.compile(
    r'custom_call_target="[^"]*(gemm|cublas|matmul|triton|mosaic|pallas)[^"]*"', re.I
)
_ATTN_FUNCS = ("MLA.__call__", "_softmax", "softmax",  # ops.softmax: attention's only
               # the paged step's attention ops (kimi_jax.ops and the kernel wrapper's XLA parts)
               "mla_paged_attention", "_mla_paged_attention_xla", "paged_keys", "gather_pages",
               "_new_token_part", "combine", "mla_decode_partials")
_ATTN_EINSUM = re.compile(r"bnts|bsa->|bsr->")      # MLA's score / value einsums (mla.py)
_PROJ_FUNCS = (
    "Linear.__call__",
    "linear",
    "MLA._queries",
    "MLA.latents",
    "MLA._kv_b",
    "RMSNorm.__call__",
    "apply_rope",
    "rope_cos_sin",
)


def _contains_matmul(comp: str, module: HloModule, depth=0) -> bool:
    for i in module.computations.get(comp, []):
        if i.opcode in _MATMUL_OPS or (i.opcode == "custom-call" and _GEMM_TARGET.search(i.rest)):
            return True
        if depth < 4:
            for c in re.findall(r"\bcalls=%?([\w.\-]+)", i.rest):
                if _contains_matmul(c, module, depth + 1):
                    return True
    return False


def categorize(instr: Optional[HloInstr], module: Optional[HloModule], event_name: str = "") -> str:
    """The category of one executed instruction (see the module docstring for the rules)."""
    if instr is None:  # not in the compiled text: fall back on the kernel's name
        n = event_name.lower()
        for k, keys in (("all-reduce", ("all-reduce", "allreduce", "psum")),
                        ("all-gather", ("all-gather", "allgather")),
                        ("reduce-scatter", ("reduce-scatter", "reducescatter", "psum_scatter")),
                        ("all-to-all", ("all-to-all", "alltoall")),
                        ("collective-permute", ("collective-permute", "sendrecv", "ppermute"))):
            if any(x in n for x in keys):
                return k
        # Pallas kernels run under their own names: the INT4 expert matmuls, the MLA decode kernel
        if any(
            x in n
            for x in ("gemm", "dot", "cublas", "matmul", "ragged", "cutlass", "nvjet", "int4")
        ):
            return "matmul"
        if any(x in n for x in ("softmax", "attention", "mla")):
            return "attention"
        return "rest"
    if instr.kind is not None:
        return instr.kind
    for k in COLLECTIVE_KINDS:  # the -done half of an async pair, or a wrapped async collective
        if instr.opcode == k + "-done" or (
            instr.opcode.startswith("async") and k in instr.rest[:400]
        ):
            return k
    stack = module.stack(instr.stack_frame_id) if module is not None else []
    is_mm = instr.opcode in _MATMUL_OPS or (
        instr.opcode == "custom-call" and _GEMM_TARGET.search(instr.rest)
    )
    if not is_mm and instr.opcode == "fusion" and module is not None:
        is_mm = any(
            _contains_matmul(c, module) for c in re.findall(r"\bcalls=%?([\w.\-]+)", instr.rest)
        )
    if stack and any(f in _ATTN_FUNCS for f in stack):
        inner = stack[: next(i for i, f in enumerate(stack) if f in _ATTN_FUNCS)]
        if not any(f in _PROJ_FUNCS for f in inner):
            return "attention"
    elif not stack and _ATTN_EINSUM.search(instr.op_name):   # no stack frames: the einsum specs
        return "attention"
    if is_mm or any(f in ("dequantize_jnp", "dequantize") for f in stack):
        return "matmul"
    return "rest"


def summarize_counts(counts: CollectiveCounts) -> str:
    parts = [f"{k} {v}" for k, v in counts.by_kind().items() if v]
    return ", ".join(parts) if parts else "none"
