"""Where a decode step's time goes: collectives counted from the compiled program, op time from a trace.

(One file over 600 lines: the two views share the step's construction and the trace parser; split,
each half would import the other.)

Two independent views of one jitted decode step (`Engine.decode_jit`):

1. **The compiled program** (`collectives_of_hlo`). The step is lowered and compiled for the layout
   and its optimized HLO text is parsed into computations. Every all-reduce, all-gather,
   reduce-scatter, all-to-all and collective-permute is counted once per *execution*: the layers run
   in `lax.scan`, so a collective inside a while-loop body runs once per trip; the trip count is read
   from the loop's `known_trip_count` backend config (or, failing that, from its condition's
   compare-against-constant), and nested loops multiply. Async pairs count once (the `-start` op).
   This count needs no device time and no trace: `compile_decode_step` also works on an *abstract*
   engine (shapes only, `abstract_engine`), so the full Kimi-K2.5 step can be counted on a laptop.

2. **A trace** (`profile_decode`). N decode steps run under `jax.profiler.trace(...,
   create_perfetto_trace=True)`; the Perfetto JSON is parsed and every device op event of the decode
   module is put in one category by its HLO instruction (looked up in the compiled text):

   | category        | rule                                                                    |
   | all-reduce etc. | the instruction's opcode (async -start/-done and wrapped forms included)|
   | attention       | HEURISTIC: the instruction's Python stack (HLO stack frames) is inside  |
   |                 | MLA.__call__ or _softmax but not inside a Linear / q / latent projection |
   |                 | (score and value einsums, softmax, cache update)                         |
   | matmul          | dot / convolution / ragged-dot / gemm custom-calls (cuBLAS, Triton,      |
   |                 | Pallas) or a fusion that contains one, and INT4 dequantization feeding  |
   |                 | the expert matmuls                                                       |
   | rest            | everything else (norms, rope, router top-k, sampling, copies, ...)       |

   On GPU the events are the device kernels (process `/device:GPU:N`); on CPU (simulated devices)
   they are the host thunk executor's per-device op events (args `hlo_op`, `device_ordinal`), and a
   collective's time includes waiting at the rendezvous for the slowest simulated device (all 8
   share the host's cores), so CPU shares show the program's structure, not GPU timings.
   Container ops (while/conditional/call) that enclose other events are skipped, so no time is
   counted twice.

Outputs: a `ProfileReport` (per-step totals and shares, per-kind collective counts from the program
and from the trace), written as JSON plus a stacked-bar PNG (`write_png_chart`, dependency-free),
the compiled step's HLO text (decode_step.hlo.txt), and the raw trace directory's path, kept for
Perfetto / XProf.
"""
from __future__ import annotations

import bisect
import dataclasses
import glob
import gzip
import itertools
import json
import math
import os
import re
import struct
import time
import zlib
from collections import defaultdict
from typing import Optional

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
CATEGORIES = COLLECTIVE_KINDS + ("matmul", "attention", "rest")

# ---- HLO text parsing ------------------------------------------------------------------------------

_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_SHAPE_RE = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2|"
                       r"f8e4m3|f8e3m4|f8e4m3fnuz|f8e5m2fnuz|c64|c128|token)\[([0-9,]*)\]")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
                "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0}
_CALL_ATTRS = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
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
        return {k: sum(1 for o in self.ops if o.kind == k and not o.trivial) for k in COLLECTIVE_KINDS}

    def to_json(self) -> dict:
        return {"per_step": self.by_kind(), "total_per_step": self.count(),
                "trivial_per_step": {k: self.count(k, trivial=True) - self.count(k) for k in COLLECTIVE_KINDS},
                "static_ops": self.static_by_kind(), "ops": [dataclasses.asdict(o) for o in self.ops]}


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


# ---- op categories -----------------------------------------------------------------------------------

_MATMUL_OPS = ("dot", "convolution", "ragged-dot")
_GEMM_TARGET = re.compile(r'custom_call_target="[^"]*(gemm|cublas|matmul|triton|mosaic|pallas)[^"]*"', re.I)
_ATTN_FUNCS = ("MLA.__call__", "_softmax",
               # the paged step's attention ops (kimi_jax.ops and the kernel wrapper's XLA parts)
               "mla_paged_attention", "_mla_paged_attention_xla", "paged_keys", "gather_pages",
               "_new_token_part", "combine", "mla_decode_partials")
_ATTN_EINSUM = re.compile(r"bnts|bsa->|bsr->")      # MLA's score / value einsums (mla.py)
_PROJ_FUNCS = ("Linear.__call__", "linear", "MLA._queries", "MLA.latents", "MLA._kv_b", "RMSNorm.__call__",
               "apply_rope", "rope_cos_sin")


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
        # Pallas kernels run under their own names: the INT4 expert matmuls and the MLA decode kernel
        if any(x in n for x in ("gemm", "dot", "cublas", "matmul", "ragged", "cutlass", "nvjet", "int4")):
            return "matmul"
        if any(x in n for x in ("softmax", "attention", "mla")):
            return "attention"
        return "rest"
    if instr.kind is not None:
        return instr.kind
    for k in COLLECTIVE_KINDS:   # the -done half of an async pair, or a wrapped async collective
        if instr.opcode == k + "-done" or (instr.opcode.startswith("async") and k in instr.rest[:400]):
            return k
    stack = module.stack(instr.stack_frame_id) if module is not None else []
    is_mm = instr.opcode in _MATMUL_OPS or (instr.opcode == "custom-call" and _GEMM_TARGET.search(instr.rest))
    if not is_mm and instr.opcode == "fusion" and module is not None:
        is_mm = any(_contains_matmul(c, module) for c in re.findall(r"\bcalls=%?([\w.\-]+)", instr.rest))
    if stack and any(f in _ATTN_FUNCS for f in stack):
        inner = stack[: next(i for i, f in enumerate(stack) if f in _ATTN_FUNCS)]
        if not any(f in _PROJ_FUNCS for f in inner):
            return "attention"
    elif not stack and _ATTN_EINSUM.search(instr.op_name):   # no stack frames: the einsum specs
        return "attention"
    if is_mm or any(f in ("dequantize_jnp", "dequantize") for f in stack):
        return "matmul"
    return "rest"


# ---- compiling the decode step -------------------------------------------------------------------------

def cache_sharding(layout):
    from jax.sharding import PartitionSpec as P
    if layout is None or layout.world == 1:
        return None
    return layout.sharding(P(None, layout.axis_rule("batch"), None, None))


def abstract_engine(cfg, layout, dtype=None):
    """An Engine over shapes only (every parameter a sharded ShapeDtypeStruct): compiles any model
    for any layout without allocating its weights."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from kimi_jax.engine.steps import Engine
    from kimi_jax.model.transformer import abstract_model
    from kimi_jax.parallel.sharding import param_shardings
    dtype = dtype or jnp.bfloat16
    layout.check_divisible(cfg)
    model = abstract_model(cfg, dtype, layout.moe_parallel())
    shardings = param_shardings(layout, nnx.split(model)[1]) if layout.world > 1 else None
    graphdef, state = nnx.split(model)
    for path, var in nnx.to_flat_state(state):
        v = var.get_value()
        sh = shardings[tuple(str(k) for k in path)] if shardings else None
        var.set_value(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh))   # shapes only
    return Engine(nnx.merge(graphdef, state), cfg, layout)


def decode_args(engine, layout, batch: int, cache_len: int, *, abstract: bool, temperature: float = 0.0):
    """(cache, tokens, positions, sampling arrays, steps) for one decode step of `batch` rows."""
    import jax
    import jax.numpy as jnp
    from kimi_jax.model.transformer import init_cache
    from kimi_jax.engine.sampling import SamplingArrays, SamplingParams
    cfg = engine.cfg
    sh = cache_sharding(layout)
    sp = SamplingArrays.build([SamplingParams(temperature=temperature)] * batch, list(range(batch)))
    if abstract:
        cache = {k: jax.ShapeDtypeStruct((n, batch, cache_len, cfg.latent_dim), engine.cache_dtype, sharding=sh)
                 for k, n in (("dense", cfg.num_dense_layers), ("moe", cfg.num_moe_layers)) if n}
        vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
        return cache, vec, vec, sp, vec
    cache = init_cache(cfg, batch, cache_len, engine.cache_dtype)
    if sh is not None:
        cache = {k: jax.device_put(v, sh) for k, v in cache.items()}
    z = jnp.zeros((batch,), jnp.int32)
    # distinct tokens per row: identical rows would all route to the same 8 experts and understate the
    # MoE read at batch > 1 (the first H200 engine rows had this bug)
    tokens = (jnp.arange(batch, dtype=jnp.int32) * 7919 + 11) % cfg.vocab_size
    return cache, tokens, z, sp, jnp.ones((batch,), jnp.int32)


PAGE_SIZE = 16      # as kimi_jax.entrypoints.llm.LLM's default


def paged_args(engine, layout, batch: int, cache_len: int, page_size: int = PAGE_SIZE):
    """(pages, tokens [B, 1], block table [B, P], sampling arrays) for the serving decode step
    (`Engine.paged_step_jit`, absorbed, T = 1): a pool sized for `cache_len` tokens per row, placed as the engine
    keeps it (`Engine.init_pages`: split over the dp ranks); row b owns P pages of its rank's partition,
    with ids local to that partition, as the scheduler emits them. `layout`: unused (the engine's own)."""
    import numpy as np
    from kimi_jax.engine.sampling import SamplingArrays, SamplingParams
    cfg = engine.cfg
    P = -(-cache_len // page_size)
    dp = engine.dp
    pages = engine.init_pages(batch * P, page_size)
    sp = SamplingArrays.build([SamplingParams(temperature=0.0)] * batch, list(range(batch)))
    tokens = ((np.arange(batch, dtype=np.int32) * 7919 + 11) % cfg.vocab_size)[:, None]   # distinct rows
    table = np.arange(batch * P, dtype=np.int32).reshape(batch, P) % (batch * P // dp)   # local ids per rank
    return pages, tokens, table, sp


def compile_decode_step(engine, layout, batch: int, cache_len: int, *, abstract: Optional[bool] = None):
    """Lower and compile `engine.decode_jit` for this batch and cache length; returns the Compiled."""
    import jax
    if abstract is None:
        leaves = jax.tree.leaves(engine.state)
        abstract = bool(leaves) and isinstance(leaves[0], jax.ShapeDtypeStruct)
    cache, tok, pos, sp, steps = decode_args(engine, layout, batch, cache_len, abstract=abstract)
    return engine.decode_jit.lower(engine.state, cache, tok, pos, sp, steps, n_logprobs=None,
                                plan=engine.plan).compile()


def count_decode_collectives(cfg, layout, batch: int = 8, cache_len: int = 64, dtype=None) -> CollectiveCounts:
    """Collectives per decode step of `cfg` under `layout`, from the compiled program (shapes only)."""
    engine = abstract_engine(cfg, layout, dtype)
    text = compile_decode_step(engine, layout, batch, cache_len, abstract=True).as_text()
    counts = collectives_of_hlo(text)
    counts.hlo_text = text
    return counts


def random_engine(cfg, layout, dtype=None, seed: int = 0):
    """An Engine with the random weights `LLM(ModelConfig)` makes (kimi_jax.entrypoints.weights.random_model),
    for timing and collective counts."""
    import jax.numpy as jnp
    from kimi_jax.entrypoints.weights import random_model
    from kimi_jax.engine.steps import Engine
    layout.check_divisible(cfg)
    return Engine(random_model(cfg, layout, dtype or jnp.bfloat16, seed), cfg, layout)


# ---- trace parsing -----------------------------------------------------------------------------------

def find_trace_file(trace_dir: str) -> str:
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
                   + glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz / perfetto_trace.json.gz under {trace_dir}")
    return files[-1]


@dataclasses.dataclass
class TraceOp:
    device: str
    name: str
    start_us: float
    dur_us: float
    run_id: Optional[str]
    module: Optional[str]
    thread: object = None
    kernel: str = ""            # the GPU kernel's name (CPU: empty)


def device_op_events(trace_file: str) -> list[TraceOp]:
    """Device op events of a Chrome/Perfetto trace: GPU kernels (process '/device:...') or, on CPU,
    the per-device thunk events that carry an `hlo_op`."""
    with gzip.open(trace_file, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    out = []
    for e in events:
        if e.get("ph") != "X":
            continue
        args = e.get("args", {}) or {}
        pname = procs.get(e.get("pid"), "")
        if "hlo_op" in args and "device_ordinal" in args:           # CPU thunk executor
            dev = "cpu:" + str(args["device_ordinal"])
        elif pname.startswith("/device:") and "host" not in pname.lower():   # accelerator kernels
            dev = pname
        else:
            continue
        name = args.get("hlo_op") or e.get("name", "")
        kernel = "" if "device_ordinal" in args else e.get("name", "")
        out.append(TraceOp(dev, name, float(e["ts"]), float(e.get("dur", 0.0)),
                           args.get("run_id"), args.get("hlo_module"), e.get("tid"), kernel))
    return out


_CONTAINERS = ("while", "conditional", "call", "async-start")


def drop_containers(ops: list[TraceOp], module: Optional[HloModule] = None) -> list[TraceOp]:
    """Remove the events of container instructions (while / conditional / call) that enclose another
    event on the same device thread, so no time is counted twice."""
    instrs = module.instructions if module is not None else {}
    by_thread = defaultdict(list)
    for o in ops:
        by_thread[(o.device, o.thread)].append(o)
    keep = []
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda o: (o.start_us, -o.dur_us))
        for i, o in enumerate(thread_ops):
            instr = instrs.get(o.name)
            if instr is None or instr.opcode not in _CONTAINERS:
                keep.append(o)
                continue
            end = o.start_us + o.dur_us
            inner = any(p.start_us + p.dur_us <= end
                        for p in itertools.takewhile(lambda p: p.start_us < end, thread_ops[i + 1:]))
            if not inner:
                keep.append(o)
    return keep


def device_ops_per_call(compiled, args, calls: int) -> tuple[dict, float, str]:
    """Run a compiled executable of `calls` repeated calls once under jax.profiler (after one warm
    run): (device us per call of each op, by kernel name on GPU, most expensive first; the span of
    its device ops per call, first start to last end; the trace's directory)."""
    import tempfile
    import jax
    module = parse_hlo(compiled.as_text())         # names the trace's container ops
    jax.block_until_ready(compiled(*args))
    tdir = tempfile.mkdtemp(prefix="kimi_ops_")      # the caller's output stays free of deep trees
    with jax.profiler.trace(tdir):
        jax.block_until_ready(compiled(*args))
    evs = [o for o in drop_containers(device_op_events(find_trace_file(tdir)), module) if o.dur_us > 0]
    per_op = defaultdict(float)
    for o in evs:
        per_op[o.kernel or o.name] += o.dur_us / calls
    span = (max(o.start_us + o.dur_us for o in evs) - min(o.start_us for o in evs)) / calls if evs else 0.0
    return dict(sorted(per_op.items(), key=lambda kv: -kv[1])), span, tdir


# ---- the report --------------------------------------------------------------------------------------

@dataclasses.dataclass
class ProfileReport:
    model: str
    layout: str
    batch: int
    context: int
    steps: int
    backend: str
    n_devices: int
    step_ms: float                           # host wall time per step (median)
    device_step_ms: float                    # device op time per step (mean over devices)
    ms_per_step: dict[str, float]            # category -> device ms per step (mean over devices)
    share: dict[str, float]                  # category -> fraction of device op time
    collectives_program: dict[str, int]      # per step, from the compiled program (groups > 1 device)
    collectives_trivial: dict[str, int]      # per step, program ops over groups of one device (no data moves)
    collectives_trace: dict[str, float]      # per step per device, every collective op event in the trace
    per_step_ms: list[dict[str, float]]      # each traced step's categories (mean over devices)
    trace_dir: str
    trace_file: str
    top_ops: list[dict] = dataclasses.field(default_factory=list)   # the costliest ops, ms per step
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> str:
        rows = [f"kimi-profile: {self.model}  layout {self.layout}  batch {self.batch}  context {self.context}  "
                f"{self.steps} steps on {self.n_devices} x {self.backend}",
                f"step: {self.step_ms:.3f} ms wall (host), {self.device_step_ms:.3f} ms of device ops "
                f"(mean over devices)",
                f"{'category':<20}{'ms/step':>10}{'share':>9}{'count/step':>12}{'in trace':>10}"]
        for c in CATEGORIES:
            cnt = self.collectives_program.get(c)
            tr = self.collectives_trace.get(c)
            rows.append(f"{c:<20}{self.ms_per_step.get(c, 0.0):>10.3f}{100 * self.share.get(c, 0.0):>8.1f}%"
                        f"{'' if cnt is None else cnt:>12}{'' if tr is None else format(tr, '.0f'):>10}")
        triv = {k: v for k, v in self.collectives_trivial.items() if v}
        if triv:
            rows.append("count/step: the compiled program's collectives over groups of more than one device; "
                        "also executed over groups of one device (no data moves): "
                        + ", ".join(f"{k} {v}" for k, v in triv.items()))
        if self.top_ops:
            rows.append("costliest ops (ms/step): " + "; ".join(
                f"{t['op']} [{t['category']}] {t['ms_per_step']:.3f}" for t in self.top_ops[:6]))
        rows.append(f"raw trace: {self.trace_dir}  (open {os.path.basename(self.trace_file)} in Perfetto)")
        rows += [f"note: {n}" for n in self.notes]
        return "\n".join(rows)


_SANITIZE = re.compile(r"[.\-]")
_OP_PREFIX = re.compile(r"^([a-z][a-z\-]*\.\d+)")


class _Resolver:
    """Trace event -> (HLO instruction or None, category), cached per (hlo_op, kernel name).

    CPU events carry the instruction's name (`hlo_op`). GPU kernels carry `hlo_op` too, but inside a
    CUDA-graph command buffer it names the buffer (command_buffer_N) and the kernel's own name is the
    fused instruction's with '.' and '-' written '_' (gemm_fusion_dot_79 <- gemm_fusion_dot.79);
    thunk-level kernels such as all-reduce.5.0-fusion.1 name the instruction as a prefix."""

    def __init__(self, module: HloModule):
        self.module = module
        self.instrs = module.instructions
        self.sanitized = {_SANITIZE.sub("_", n): i for n, i in self.instrs.items()}
        self.cache: dict = {}

    def __call__(self, hlo_op: str, kernel: str):
        key = (hlo_op, kernel)
        if key not in self.cache:
            instr = (self.instrs.get(hlo_op) if hlo_op else None)
            if instr is not None and instr.opcode in ("call", "command-buffer"):
                instr = None
            if instr is None:
                instr = self.instrs.get(kernel) or self.sanitized.get(_SANITIZE.sub("_", kernel))
            if instr is None and hlo_op:
                m = _OP_PREFIX.match(hlo_op)
                instr = self.instrs.get(m.group(1)) if m else None
            name = " ".join(x for x in (hlo_op, kernel) if x)
            self.cache[key] = (instr, categorize(instr, self.module, name))
        return self.cache[key]


def _split_steps(ops: list[TraceOp], steps: int) -> list[list[TraceOp]]:
    """Group events into steps: by run_id where the trace has one (CPU), else at the steps-1 widest
    idle gaps of the busiest device (each step ends with the host waiting for its outputs)."""
    if steps <= 1 or not ops:
        return [ops]
    if all(o.run_id is not None for o in ops):
        by_run = defaultdict(list)
        for o in ops:
            by_run[o.run_id].append(o)
        groups = sorted(by_run.values(), key=lambda g: min(o.start_us for o in g))
        return sorted(groups, key=lambda g: -len(g))[:steps] if len(groups) > steps else groups
    per_dev = defaultdict(list)
    for o in ops:
        per_dev[o.device].append(o)
    dev_ops = sorted(max(per_dev.values(), key=len), key=lambda o: o.start_us)
    gaps, end = [], dev_ops[0].start_us + dev_ops[0].dur_us
    for o in dev_ops[1:]:
        if o.start_us > end:
            gaps.append((o.start_us - end, (end + o.start_us) / 2))
        end = max(end, o.start_us + o.dur_us)
    cuts = sorted(t for _, t in sorted(gaps, reverse=True)[: steps - 1])
    groups: list[list[TraceOp]] = [[] for _ in range(len(cuts) + 1)]
    for o in ops:
        groups[bisect.bisect_right(cuts, o.start_us)].append(o)
    return groups


def analyze_trace(trace_file: str, module: HloModule, steps: int, *, module_name: Optional[str] = None):
    """(category ms per step, per-step categories, collective executions per step per device,
    n_devices, top ops) from a trace of `steps` executions of the program compiled as `module`."""
    resolve = _Resolver(module)
    ops = [o for o in device_op_events(trace_file) if module_name is None or o.module == module_name]
    ops = drop_containers(ops, module)
    devices = sorted({o.device for o in ops})
    if not ops:
        raise ValueError(f"{trace_file}: no device op events of the decode program {module_name}")
    nd = max(len(devices), 1)
    totals = defaultdict(float)
    counts = defaultdict(int)
    by_op = defaultdict(float)
    cat_of = {}
    for o in ops:
        instr, cat = resolve(o.name, o.kernel)
        cat_of[id(o)] = cat
        totals[cat] += o.dur_us
        label = instr.name if instr is not None else (o.kernel or o.name)
        by_op[(cat, label)] += o.dur_us
        if cat in COLLECTIVE_KINDS and not o.name.endswith("-done") and "done" not in o.kernel:
            counts[cat] += 1
    ms = {c: totals.get(c, 0.0) / 1000.0 / nd / steps for c in CATEGORIES}
    per_step = []
    for group in _split_steps(ops, steps):
        acc = defaultdict(float)
        for o in group:
            acc[cat_of[id(o)]] += o.dur_us
        per_step.append({c: acc.get(c, 0.0) / 1000.0 / nd for c in CATEGORIES})
    coll = {k: counts.get(k, 0) / nd / steps for k in COLLECTIVE_KINDS}
    top = [{"category": c, "op": label, "ms_per_step": t / 1000.0 / nd / steps}
           for (c, label), t in sorted(by_op.items(), key=lambda kv: -kv[1])[:12]]
    return ms, per_step, coll, nd, top


def profile_decode(engine, layout, *, batch: int, context: int, steps: int, out_dir: str,
                   model_name: str = "?", warmup: int = 2, paged: bool = True) -> ProfileReport:
    """Run `steps` decode steps (after `warmup`) under the JAX profiler; write report.json,
    breakdown.png and the raw trace (out_dir/trace) and return the report.

    paged (default): the step generation runs (`Engine.paged_step_jit`: paged latent cache, absorbed MLA, on a
    GPU the Pallas decode kernel, one page write after all layers); otherwise the contiguous-cache
    reference step (`Engine.decode_jit`), which on a GPU uses the XLA attention path and rewrites the cache."""
    import jax
    import numpy as np
    from kimi_jax.engine.steps import _i32 as i32       # numpy step inputs: jit's fast path, as the engine's
    from kimi_jax.engine.steps import bucket
    cache_len = bucket(context + warmup + steps + 1)
    ones, zeros = np.ones((batch,), np.int32), np.zeros((batch,), np.int32)
    if paged:
        cache, tok, table, sp = paged_args(engine, layout, batch, cache_len)
        lowered = engine.paged_step_jit.lower(engine.state, cache, i32(tok), i32(tok), i32(table), zeros, sp,
                                     i32(ones), n_logprobs=None, absorbed=True, fresh=False,
                                     sample_mode="greedy", plan=engine.plan)
    else:
        cache, tok, _, sp, _ = decode_args(engine, layout, batch, cache_len, abstract=False)
        lowered = engine.decode_jit.lower(engine.state, cache, tok, tok, sp, i32(ones), n_logprobs=None,
                                       sample_mode="greedy", plan=engine.plan)
    # the executable that runs is the one whose HLO is parsed (compiled once, called directly)
    compiled = lowered.compile()
    compiled_text = compiled.as_text()
    module = parse_hlo(compiled_text)
    program = collectives_of_hlo(module)
    m = re.match(r"HloModule\s+([\w.\-]+)", compiled_text)
    module_name = m.group(1) if m else None
    # distinct tokens per row: identical rows route to the same 8 experts, so batch > 1 would time a
    # best case (the H200 engine rows of 2026-11-29 fed token 0 to every row)
    tokens = np.asarray(tok)

    def step(i, cache):
        pos = np.full(tokens.shape, context + i, np.int32)
        if paged:
            cache, out = compiled(engine.state, cache, i32(tokens), i32(pos), i32(table), zeros, sp,
                                  i32(ones * (i + 1)))
        else:
            cache, out = compiled(engine.state, cache, i32(tokens), i32(pos), sp, i32(ones * (i + 1)))
        jax.block_until_ready(out)
        return cache

    for i in range(warmup):
        cache = step(i, cache)
    trace_dir = os.path.abspath(os.path.join(out_dir, "trace"))
    os.makedirs(trace_dir, exist_ok=True)
    walls = []
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0          # Python function events would dwarf the device ops
    if jax.default_backend() != "cpu":
        opts.host_tracer_level = 1        # CPU needs level 2: its per-device op events are host events
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=opts):
        for i in range(steps):
            t0 = time.perf_counter()
            cache = step(warmup + i, cache)
            walls.append(time.perf_counter() - t0)
    trace_file = find_trace_file(trace_dir)
    ms, per_step, coll_trace, nd, top = analyze_trace(trace_file, module, steps, module_name=module_name)
    busy = sum(ms.values())
    notes = ["paged-cache decode step (Engine.paged_step_jit)" if paged
             else "contiguous-cache reference step (Engine.decode_jit)",
             "attention vs matmul split is a heuristic on the HLO instructions' Python stacks "
             "(MLA score/value einsums + softmax = attention)"]
    if jax.default_backend() == "cpu":
        notes.append("CPU simulated devices: collective time includes waiting for the slowest device "
                     "(all devices share the host cores); use the counts, not the CPU shares, for GPU planning")
    report = ProfileReport(
        model=model_name, layout=layout.name, batch=batch, context=context, steps=steps,
        backend=jax.default_backend(), n_devices=nd, step_ms=1000 * float(np.median(walls)),
        device_step_ms=busy, ms_per_step=ms, share={c: (ms[c] / busy if busy else 0.0) for c in CATEGORIES},
        collectives_program=program.by_kind(),
        collectives_trivial={k: v - program.count(k) for k, v in program.by_kind(trivial=True).items()},
        collectives_trace=coll_trace, per_step_ms=per_step,
        trace_dir=trace_dir, trace_file=trace_file, top_ops=top, notes=notes)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "decode_step.hlo.txt"), "w") as f:
        f.write(compiled_text)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump({**report.to_json(), "collective_ops": program.to_json()["ops"]}, f, indent=1)
    write_png_chart(report, os.path.join(out_dir, "breakdown.png"))
    return report


# ---- a dependency-free PNG stacked-bar chart ---------------------------------------------------------

COLORS = {"all-reduce": (214, 39, 40), "all-gather": (255, 127, 14), "reduce-scatter": (188, 189, 34),
          "all-to-all": (148, 103, 189), "collective-permute": (140, 86, 75), "matmul": (31, 119, 180),
          "attention": (44, 160, 44), "rest": (127, 127, 127)}

# 5x7 bitmap glyphs, one string of 7 rows of 5 bits each
_FONT = {
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11110 00001 00001 01110 00001 00001 11110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    "A": "01110 10001 10001 11111 10001 10001 10001", "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110", "D": "11110 10001 10001 10001 10001 10001 11110",
    "E": "11111 10000 10000 11110 10000 10000 11111", "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111", "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110", "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001", "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001", "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110", "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101", "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110", "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110", "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010", "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 01010 00100 00100 00100 00100", "Z": "11111 00001 00010 00100 01000 10000 11111",
    " ": "00000 00000 00000 00000 00000 00000 00000", ".": "00000 00000 00000 00000 00000 01100 01100",
    "-": "00000 00000 00000 11111 00000 00000 00000", "%": "11000 11001 00010 00100 01000 10011 00011",
    ":": "00000 01100 01100 00000 01100 01100 00000", "/": "00001 00001 00010 00100 01000 10000 10000",
    "(": "00010 00100 01000 01000 01000 00100 00010", ")": "01000 00100 00010 00010 00010 00100 01000",
    "+": "00000 00100 00100 11111 00100 00100 00000", "=": "00000 00000 11111 00000 11111 00000 00000",
    ",": "00000 00000 00000 00000 01100 00100 01000",
    "_": "00000 00000 00000 00000 00000 00000 11111",
}


class _Canvas:
    def __init__(self, w, h, bg=(255, 255, 255)):
        self.w, self.h = w, h
        self.px = bytearray(bytes(bg) * (w * h))

    def rect(self, x0, y0, x1, y1, color):
        x0, x1 = max(0, int(x0)), min(self.w, int(x1))
        y0, y1 = max(0, int(y0)), min(self.h, int(y1))
        row = bytes(color) * max(0, x1 - x0)
        for y in range(y0, y1):
            i = (y * self.w + x0) * 3
            self.px[i:i + len(row)] = row

    def text(self, x, y, s, color=(0, 0, 0), scale=2):
        for ch in s.upper():
            g = _FONT.get(ch, _FONT[" "])
            for r, bits in enumerate(g.split()):
                for c, b in enumerate(bits):
                    if b == "1":
                        self.rect(x + c * scale, y + r * scale, x + (c + 1) * scale, y + (r + 1) * scale, color)
            x += 6 * scale
        return x

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3]) for y in range(self.h))

        def chunk(tag, data):
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def stacked_bar_png(bars: list[tuple[str, dict[str, float]]], title: str, unit: str = "MS") -> bytes:
    """A stacked-bar chart: one bar per (label, {category: value}), categories in CATEGORIES order."""
    W, H, left, top, bottom = 960, 520, 80, 56, 60
    legend_w = 250
    plot_w = W - left - legend_w - 20
    plot_h = H - top - bottom
    cv = _Canvas(W, H)
    cv.text(left, 6, title[:60], scale=2)
    vmax = max([sum(v.values()) for _, v in bars] + [1e-9])
    mag = 10 ** math.floor(math.log10(vmax))
    ymax = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= vmax)
    cv.rect(left - 2, top, left, top + plot_h, (0, 0, 0))
    cv.rect(left - 2, top + plot_h, left + plot_w, top + plot_h + 2, (0, 0, 0))
    for k in range(5):
        v = ymax * k / 4
        y = top + plot_h - plot_h * k / 4
        cv.rect(left - 6, y, left - 2, y + 1, (0, 0, 0))
        cv.text(4, y - 7, f"{v:.3g}", scale=2)
    cv.text(4, top - 30, unit, scale=2)
    n = max(len(bars), 1)
    slot = plot_w / n
    bw = max(4, min(80, slot * 0.7))
    for i, (label, vals) in enumerate(bars):
        x0 = left + slot * i + (slot - bw) / 2
        y = top + plot_h
        for c in CATEGORIES:
            h = plot_h * vals.get(c, 0.0) / ymax
            if h > 0:
                cv.rect(x0, y - h, x0 + bw, y, COLORS[c])
                y -= h
        cv.text(x0, top + plot_h + 8, label[:6], scale=2 if n <= 12 else 1)
    lx = W - legend_w
    for j, c in enumerate(reversed(CATEGORIES)):
        yy = top + 24 * j
        cv.rect(lx, yy, lx + 16, yy + 16, COLORS[c])
        cv.text(lx + 24, yy + 1, c, scale=2)
    return cv.png()


def write_png_chart(report: ProfileReport, path: str) -> str:
    bars = [(f"S{i}", s) for i, s in enumerate(report.per_step_ms)] + [("MEAN", report.ms_per_step)]
    title = f"{report.layout} B{report.batch} CTX{report.context} {report.backend}"
    with open(path, "wb") as f:
        f.write(stacked_bar_png(bars, title, unit="MS/STEP"))
    return path


def read_png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    return struct.unpack(">II", head[16:24])


def summarize_counts(counts: CollectiveCounts) -> str:
    parts = [f"{k} {v}" for k, v in counts.by_kind().items() if v]
    return ", ".join(parts) if parts else "none"


__all__ = ["COLLECTIVE_KINDS", "CATEGORIES", "parse_hlo", "collectives_of_hlo", "CollectiveCounts",
           "abstract_engine", "random_engine", "compile_decode_step", "paged_args", "count_decode_collectives",
           "profile_decode", "analyze_trace", "ProfileReport", "write_png_chart", "stacked_bar_png",
           "categorize"]
