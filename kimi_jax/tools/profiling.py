"""Where a decode step's time goes: collectives counted in the compiled program
(`count_decode_collectives`), device op time by category from a profiler trace (`profile_decode`).
On CPU a collective's time includes the wait for the slowest simulated device: CPU shares show the
program's structure, not GPU timings."""
from __future__ import annotations

import bisect
import dataclasses
import glob
import gzip
import itertools
import json
import os
import re
import time
from collections import defaultdict
from typing import Optional

from kimi_jax.tools.hlo import (
    CATEGORIES,
    COLLECTIVE_KINDS,
    CollectiveCounts,
    HloModule,  # noqa: F401
    categorize,
    collectives_of_hlo,
    parse_hlo,
    summarize_counts,
)
from kimi_jax.tools.png_chart import (  # noqa: F401
    COLORS,
    read_png_size,
    stacked_bar_png,
    write_png_chart,
)


def cache_sharding(layout):
    from jax.sharding import PartitionSpec as P
    if layout is None or layout.world == 1:
        return None
    return layout.sharding(P(None, layout.axis_rule("batch"), None, None))


def abstract_engine(cfg, layout, dtype=None):
    """An ModelSteps over shapes only (sharded ShapeDtypeStructs): compiles any model without its
    weights."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from kimi_jax.engine.steps import ModelSteps
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
    return ModelSteps(nnx.merge(graphdef, state), cfg, layout)


def decode_args(
    engine, layout, batch: int, cache_len: int, *, abstract: bool, temperature: float = 0.0
):
    """(cache, tokens, positions, sampling arrays, steps) for one decode step of `batch` rows."""
    import jax
    import jax.numpy as jnp
    from kimi_jax.model.transformer import init_cache
    from kimi_jax.engine.sampling import SamplingArrays, SamplingParams
    cfg = engine.cfg
    sh = cache_sharding(layout)
    sp = SamplingArrays.build([SamplingParams(temperature=temperature)] * batch, list(range(batch)))
    if abstract:
        cache = {
            k: jax.ShapeDtypeStruct(
                (n, batch, cache_len, cfg.latent_dim), engine.cache_dtype, sharding=sh
            )
            for k, n in (("dense", cfg.num_dense_layers), ("moe", cfg.num_moe_layers))
            if n
        }
        vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
        return cache, vec, vec, sp, vec
    cache = init_cache(cfg, batch, cache_len, engine.cache_dtype)
    if sh is not None:
        cache = {k: jax.device_put(v, sh) for k, v in cache.items()}
    z = jnp.zeros((batch,), jnp.int32)
    # distinct tokens per row: identical rows route to the same 8 experts, understating MoE reads
    tokens = (jnp.arange(batch, dtype=jnp.int32) * 7919 + 11) % cfg.vocab_size
    return cache, tokens, z, sp, jnp.ones((batch,), jnp.int32)


PAGE_SIZE = 16      # as kimi_jax.entrypoints.llm.LLM's default


def paged_args(engine, layout, batch: int, cache_len: int, page_size: int = PAGE_SIZE):
    """(pages, tokens [B, 1], block table [B, P], sampling arrays) for a decode step (T = 1), with
    `cache_len` tokens per row and page ids local to each dp rank, as the scheduler emits them."""
    import numpy as np
    from kimi_jax.engine.sampling import SamplingArrays, SamplingParams
    cfg = engine.cfg
    P = -(-cache_len // page_size)
    dp = engine.dp
    pages = engine.init_pages(batch * P, page_size)
    sp = SamplingArrays.build([SamplingParams(temperature=0.0)] * batch, list(range(batch)))
    tokens = ((np.arange(batch, dtype=np.int32) * 7919 + 11) % cfg.vocab_size)[:, None]
    # local ids per rank
    table = np.arange(batch * P, dtype=np.int32).reshape(batch, P) % (batch * P // dp)
    return pages, tokens, table, sp


def compile_decode_step(
    engine, layout, batch: int, cache_len: int, *, abstract: Optional[bool] = None
):
    """Lower and compile the contiguous-cache reference step (`step_adapters.decode_jit`) for this
    batch and cache length; returns the Compiled."""
    import jax
    from kimi_jax.tools.step_adapters import decode_jit
    if abstract is None:
        leaves = jax.tree.leaves(engine.state)
        abstract = bool(leaves) and isinstance(leaves[0], jax.ShapeDtypeStruct)
    cache, tok, pos, sp, steps = decode_args(engine, layout, batch, cache_len, abstract=abstract)
    return decode_jit(engine).lower(engine.state, cache, tok, pos, sp, steps, n_logprobs=None,
                                    plan=engine.exec_plan).compile()


def count_decode_collectives(
    cfg, layout, batch: int = 8, cache_len: int = 64, dtype=None
) -> CollectiveCounts:
    """Collectives per decode step of `cfg` under `layout`, from its compiled program (shapes)"""
    engine = abstract_engine(cfg, layout, dtype)
    text = compile_decode_step(engine, layout, batch, cache_len, abstract=True).as_text()
    counts = collectives_of_hlo(text)
    counts.hlo_text = text
    return counts


def random_engine(cfg, layout, dtype=None, seed: int = 0, plan=None):
    """An ModelSteps with the random weights `LLM(ModelConfig)` makes
    (kimi_jax.entrypoints.weights.random_model); plan: its ExecPlan (default the backend's)."""
    import jax.numpy as jnp
    from kimi_jax.entrypoints.weights import random_model
    from kimi_jax.engine.steps import ModelSteps
    layout.check_divisible(cfg)
    return ModelSteps(
        random_model(cfg, layout, dtype or jnp.bfloat16, seed), cfg, layout, plan=plan
    )


def find_trace_file(trace_dir: str) -> str:
    files = sorted(
        glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
        + glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
        key=os.path.getmtime,
    )
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
            inner = any(
                p.start_us + p.dur_us <= end
                for p in itertools.takewhile(lambda p: p.start_us < end, thread_ops[i + 1 :])
            )
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
    evs = [
        o for o in drop_containers(device_op_events(find_trace_file(tdir)), module) if o.dur_us > 0
    ]
    per_op = defaultdict(float)
    for o in evs:
        per_op[o.kernel or o.name] += o.dur_us / calls
    span = (
        (max(o.start_us + o.dur_us for o in evs) - min(o.start_us for o in evs)) / calls
        if evs
        else 0.0
    )
    return dict(sorted(per_op.items(), key=lambda kv: -kv[1])), span, tdir



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
    # per step, from the compiled program (groups > 1 device)
    collectives_program: dict[str, int]
    # per step, program ops over groups of one device (no data moves)
    collectives_trivial: dict[str, int]
    # per step per device, every collective op event in the trace
    collectives_trace: dict[str, float]
    per_step_ms: list[dict[str, float]]      # each traced step's categories (mean over devices)
    trace_dir: str
    trace_file: str
    top_ops: list[dict] = dataclasses.field(default_factory=list)   # the costliest ops, ms per step
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> str:
        rows = [
            f"kimi-profile: {self.model}  layout {self.layout}  batch {self.batch}  context "
            f"{self.context}  {self.steps} steps on {self.n_devices} x {self.backend}",
            f"step: {self.step_ms:.3f} ms wall (host), {self.device_step_ms:.3f} ms of device ops "
            f"(mean over devices)",
            f"{'category':<20}{'ms/step':>10}{'share':>9}{'count/step':>12}{'in trace':>10}",
        ]
        for c in CATEGORIES:
            cnt = self.collectives_program.get(c)
            tr = self.collectives_trace.get(c)
            rows.append(
                f"{c:<20}{self.ms_per_step.get(c, 0.0):>10.3f}{100 * self.share.get(c, 0.0):>8.1f}%"
                f"{'' if cnt is None else cnt:>12}{'' if tr is None else format(tr, '.0f'):>10}"
            )
        triv = {k: v for k, v in self.collectives_trivial.items() if v}
        if triv:
            rows.append(
                "count/step: the compiled program's collectives over groups of more than one "
                "device; also executed over groups of one device (no data moves): "
                + ", ".join(f"{k} {v}" for k, v in triv.items())
            )
        if self.top_ops:
            rows.append("costliest ops (ms/step): " + "; ".join(
                f"{t['op']} [{t['category']}] {t['ms_per_step']:.3f}" for t in self.top_ops[:6]))
        rows.append(
            f"raw trace: {self.trace_dir}  (open {os.path.basename(self.trace_file)} in Perfetto)"
        )
        rows += [f"note: {n}" for n in self.notes]
        return "\n".join(rows)


_SANITIZE = re.compile(r"[.\-]")
_OP_PREFIX = re.compile(r"^([a-z][a-z\-]*\.\d+)")


class _Resolver:
    """Trace event -> (HLO instruction or None, category), cached. In a CUDA-graph command buffer
    `hlo_op` names the buffer; the kernel name is then the instruction's with '.' and '-' as '_'
    (gemm_fusion_dot_79), or has it as a prefix (all-reduce.5.0-fusion.1)."""

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


def analyze_trace(
    trace_file: str, module: HloModule, steps: int, *, module_name: Optional[str] = None
):
    """(category ms per step, per-step categories, collective executions per step per device,
    n_devices, top ops) from a trace of `steps` executions of the program compiled as `module`."""
    resolve = _Resolver(module)
    ops = [
        o for o in device_op_events(trace_file) if module_name is None or o.module == module_name
    ]
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
    breakdown.png and out_dir/trace; return the report. paged: the serving step
    (`ModelSteps.step_jit`, kind 'decode'), else the contiguous-cache reference step
    (`step_adapters.decode_jit`)."""
    import jax
    import numpy as np
    from kimi_jax.engine.steps import StepBatch, bucket
    from kimi_jax.tools.step_adapters import _i32 as i32     # numpy step inputs: jit's fast path
    from kimi_jax.tools.step_adapters import decode_jit
    cache_len = bucket(context + warmup + steps + 1)
    ones, zeros = np.ones((batch,), np.int32), np.zeros((batch,), np.int32)
    if paged:
        cache, tok, table, sp = paged_args(engine, layout, batch, cache_len)
        rows = lambda tok, pos, step: StepBatch(tok, pos, i32(table), zeros, step, sp)  # noqa: E731
        lowered = engine.step_jit.lower(engine.state, cache, rows(i32(tok), i32(tok), i32(ones)),
                                        kind="decode", n_logprobs=None, sample_mode="greedy",
                                        plan=engine.exec_plan)
    else:
        cache, tok, _, sp, _ = decode_args(engine, layout, batch, cache_len, abstract=False)
        lowered = decode_jit(engine).lower(
            engine.state,
            cache,
            tok,
            tok,
            sp,
            i32(ones),
            n_logprobs=None,
            sample_mode="greedy",
            plan=engine.exec_plan,
        )
    # the executable that runs is the one whose HLO is parsed (compiled once, called directly)
    compiled = lowered.compile()
    compiled_text = compiled.as_text()
    module = parse_hlo(compiled_text)
    program = collectives_of_hlo(module)
    m = re.match(r"HloModule\s+([\w.\-]+)", compiled_text)
    module_name = m.group(1) if m else None
    # distinct tokens per row (as `decode_args`)
    tokens = np.asarray(tok)

    def step(i, cache):
        pos = np.full(tokens.shape, context + i, np.int32)
        if paged:
            inputs = rows(i32(tokens), i32(pos), i32(ones * (i + 1)))
            cache, out = compiled(engine.state, cache, inputs)
        else:
            cache, out = compiled(
                engine.state, cache, i32(tokens), i32(pos), sp, i32(ones * (i + 1))
            )
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
        # CPU needs level 2: its per-device op events are host events
        opts.host_tracer_level = 1
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=opts):
        for i in range(steps):
            t0 = time.perf_counter()
            cache = step(warmup + i, cache)
            walls.append(time.perf_counter() - t0)
    trace_file = find_trace_file(trace_dir)
    ms, per_step, coll_trace, nd, top = analyze_trace(
        trace_file, module, steps, module_name=module_name
    )
    busy = sum(ms.values())
    notes = ["paged-cache decode step (ModelSteps.step_jit)" if paged
             else "contiguous-cache reference step (step_adapters.decode_jit)",
             "attention vs matmul split is a heuristic on the HLO instructions' Python stacks "
             "(MLA score/value einsums + softmax = attention)"]
    if jax.default_backend() == "cpu":
        notes.append(
            "CPU simulated devices: collective time includes waiting for the slowest device (all "
            "devices share the host cores); use the counts, not the CPU shares, for GPU planning"
        )
    report = ProfileReport(
        model=model_name,
        layout=layout.name,
        batch=batch,
        context=context,
        steps=steps,
        backend=jax.default_backend(),
        n_devices=nd,
        step_ms=1000 * float(np.median(walls)),
        device_step_ms=busy,
        ms_per_step=ms,
        share={c: (ms[c] / busy if busy else 0.0) for c in CATEGORIES},
        collectives_program=program.by_kind(),
        collectives_trivial={
            k: v - program.count(k) for k, v in program.by_kind(trivial=True).items()
        },
        collectives_trace=coll_trace,
        per_step_ms=per_step,
        trace_dir=trace_dir,
        trace_file=trace_file,
        top_ops=top,
        notes=notes,
    )
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "decode_step.hlo.txt"), "w") as f:
        f.write(compiled_text)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump({**report.to_json(), "collective_ops": program.to_json()["ops"]}, f, indent=1)
    write_png_chart(report, os.path.join(out_dir, "breakdown.png"))
    return report


__all__ = [
    "COLLECTIVE_KINDS",
    "CATEGORIES",
    "parse_hlo",
    "collectives_of_hlo",
    "CollectiveCounts",
    "abstract_engine",
    "random_engine",
    "compile_decode_step",
    "paged_args",
    "count_decode_collectives",
    "profile_decode",
    "analyze_trace",
    "ProfileReport",
    "write_png_chart",
    "stacked_bar_png",
    "categorize",
]
