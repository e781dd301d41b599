r"""kimi-bench full_depth: the whole depth of Kimi-K2.5 in one decode step on one device: compile time,
host dispatch time, device time, and the planner's prediction beside each row.

  kimi-bench full_depth --batches 1,16,64 --context 4096 --cache_dir /tmp/jaxcache
  kimi-bench full_depth --compile_only --cache_dir /tmp/jaxcache   # the same compiles, warm cache
  kimi-bench full_depth --tiny --layers 2 --batches 1 --context 64 --steps 2 --hardware cpu --out /tmp/x   # CPU

The model is the `kimi-k2.5-61x16` preset (Kimi-K2.5's shapes and 61 layers, 16 INT4 routed experts
per layer, top-8: at batch 1 a token reads the bytes a real layer reads), random weights made on the
device parameter by parameter (`kimi_jax.entrypoints.weights.random_model`). The step is the serving decode step
(`ModelSteps.step_jit`, kind 'decode': paged latent cache, absorbed MLA, greedy sampling on the device)
over a page pool holding `--context` tokens per row, random cache contents; every row attends over
all of them (position context - 1, rewritten each step).

`--preset kimi-k2.5-tp8-shard` / `kimi-k2.5-tp8-ep8-shard` run one GPU's share of Kimi-K2.5 under TP8 /
TP8 attention + EP8 experts (kimi_jax.config.shard_of) at full depth, no collectives. Every step row
states the bytes the step reads (`bytes_gb`: planner.step_bytes, expected experts touched; `bytes_max_gb`:
min(E, B x K) of them) and their floors at the hardware preset's copy bandwidth (`floor_ms`,
`floor_max_ms`); a shard preset's rows add `pred_8dev_ms`, the planner's 8-device plan of the whole model
on that layout without its collectives.

Per batch the step is lowered once and compiled once per command-buffer variant (XLA compile options,
no new process: `default` = XLA's own command-buffer (CUDA graph) settings, `off` =
xla_gpu_enable_command_buffer empty); the compiled program's HLO is asked how many of its kernels
sit in command-buffer calls (jax 0.11.2's XLA forms its command buffers after the HLO passes, so there
the census finds none, and the variants differ in their enqueue time only). Each variant is timed four ways (ms per step, medians):

  sync      numpy inputs, the sampled tokens fetched to the host before the next dispatch (the order
            of the synchronous scheduler)
  chain     --steps steps dispatched back to back, each fed the previous step's tokens on the device,
            one wait at the end: the device-bound rate while the host keeps ahead (= overlap scheduling)
  enqueue   the host time of one dispatch in that chain (the loop before the wait, / steps)
  device    the kernels' time per step from a profiler trace (`--profile_batches`; the profiler runs
            kernels one by one, outside command buffers): busy = sum of kernel durations, span = first
            start to last end per step

The serving call itself (`step_adapters.decode_step_async`: its host work included) is timed the
same ways (`variant` = serve: its host work, dispatching the first variant's executable), and with
`--scheduler_batches` the continuous-batching engine core (`EngineCore.run`) decodes --steps tokens for
every row with overlap scheduling on and off, its runner's fixed buffers on and off (requests enter with
their prompt already in the cache; the runner compiles its own step programs).
Compile times: `lower_s` (trace + lowering, once per batch), `compile_s` per variant; with
--cache_dir the persistent compilation cache is on, and `cache_hit` says whether the compile was served
from it (run the same command again with --compile_only for the warm numbers).

Timed rows carry the chain's last tokens (equal between processes making the same calls, e.g. under two
XLA_FLAGS; XLA's command-buffer update mode is one: a process setting). `--dispatch`: a row timing a no-op over
the weight arrays (host cost per argument); `--fixed_buffers`: the step with no moved buffer (`variant` fixed,
`time_fixed_buffers`); `--variant_options`: more compile-option variants.

Rows are appended to OUT/full_depth_rows.jsonl as they are measured (they survive a timeout), then a
table is printed.

Over 600 lines: every way of timing the step shares one model, one lowering and one row format.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import statistics
import time
from typing import Optional

from absl import flags

from kimi_jax.config import PRESETS
from launch import common
from launch.bench import harness
from launch.bench.harness import random_pages

flags.DEFINE_enum("preset", "kimi-k2.5-61x16", PRESETS, "model preset (kimi_jax.config.preset)")
flags.DEFINE_integer("layers", 0, "num_hidden_layers (0: the preset's)")
flags.DEFINE_list("batches", ["1", "16", "64"], "decode batches")
flags.DEFINE_integer("context", 4096, "cached tokens per row (a multiple of the page size)")
flags.DEFINE_integer("steps", 20, "timed steps per measurement")
flags.DEFINE_list("variants", ["default", "off"], "command-buffer variants to compile and time (default, off, all)")
flags.DEFINE_list("variant_batches", ["1"], "batches that time every variant (the others: the first only)")
flags.DEFINE_list("profile_batches", ["1"], "batches that also take a profiler trace")
flags.DEFINE_list("scheduler_batches", ["1"], "batches that also run the scheduler, overlap on and off")
flags.DEFINE_bool("compile_only", False, "build, lower and compile the steps, time nothing (e.g. a second "
                  "process that finds them in --cache_dir)")
flags.DEFINE_string("cache_dir", None, "persistent compilation cache directory")
flags.DEFINE_string("hardware", "h200", "planner hardware preset for the predictions")
flags.DEFINE_string("tag", "", "label written into every row")
flags.DEFINE_string("out", os.environ.get("OUT", "out/bench_full_depth"), "results directory")
flags.DEFINE_string("router_kernel", None, "ExecPlan.router_kernel of the step (default: the plan's)")
flags.DEFINE_string("norm_kernel", None, "ExecPlan.norm_kernel of the step (default: the plan's)")
flags.DEFINE_string("routing", None, "ExecPlan.routing of the step: 'uniform' spreads each token's experts evenly "
                    "(random weights route to fewer experts than uniform at batch > 1: BENCHMARKS.md, 'The decode "
                    "step with one q_a / kv_a product'); default: the model's router")
flags.DEFINE_string("variant_options", None, "more command-buffer / XLA variants as JSON {name: {xla option: "
                    "value}} (e.g. '{\"cb_while\": {\"xla_gpu_enable_command_buffer\": \"FUSION,WHILE\"}}'); "
                    "name them in --variants")
flags.DEFINE_bool("dispatch", True, "time the host's dispatch of an executable that takes the model's weights "
                  "and does nothing (the per-argument share of enqueue)")
flags.DEFINE_bool("fixed_buffers", False, "also time the step with every buffer at a fixed address from call to "
                  "call (variant 'fixed': no CUDA-graph update)")
flags.DEFINE_bool("mla_fuse_new", None, "ExecPlan.mla_fuse_new of the step (default: the plan's)")
flags.DEFINE_bool("pack_vectors", None, "ExecPlan.pack_vectors of the step (default: the plan's)")
flags.DEFINE_bool("tiny", False, "CPU dry run: the tiny preset in float32")
FLAGS = flags.FLAGS

PAGE_SIZE = 16
# XLA compile options per variant ("default": XLA's own settings)
VARIANTS = {
    "default": None,
    "off": {"xla_gpu_enable_command_buffer": ""},
    "all": {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
            "xla_gpu_graph_min_graph_size": 1},
}


def step_inputs(cfg, batch: int, context: int):
    """(tokens [B], positions [B], block table [B, P], sampling arrays, steps [B]) for a decode step of
    `batch` rows, each owning P = context / page pages of its own (pages b*P .. b*P + P - 1), at
    position context - 1: every row attends over `context` tokens."""
    import numpy as np
    from kimi_jax.engine.sampling import SamplingArrays, SamplingParams
    P = context // PAGE_SIZE
    tokens = ((np.arange(batch, dtype=np.int32) * 7919 + 11) % cfg.vocab_size).astype(np.int32)  # distinct rows
    positions = np.full((batch,), context - 1, np.int32)
    table = np.arange(batch * P, dtype=np.int32).reshape(batch, P)
    sp = SamplingArrays.build([SamplingParams(temperature=0.0)] * batch, list(range(batch)))
    return tokens, positions, table, sp, np.ones((batch,), np.int32)


def command_buffer_census(hlo_text: str) -> dict:
    """Kernels of a compiled GPU program inside and outside command buffers: fusions and custom calls
    of the entry computation and of the computations its command-buffer calls run (on CPU: no command
    buffers, every op counts as outside)."""
    from kimi_jax.tools.profiling import parse_hlo
    module = parse_hlo(hlo_text)
    comps = module.computations
    entry = module.entry
    kernel = lambda i: i.opcode in ("fusion", "custom-call")          # noqa: E731
    inside = outside = buffers = 0
    custom_in = custom_out = 0
    for instr in comps.get(entry, []):
        called = [c for c in _called(instr)]
        if instr.opcode in ("call", "command-buffer") and any("command_buffer" in c for c in called):
            buffers += 1
            for c in called:
                for j in comps.get(c, []):
                    inside += kernel(j)
                    custom_in += j.opcode == "custom-call"
        else:
            outside += kernel(instr)
            custom_out += instr.opcode == "custom-call"
    return dict(command_buffers=buffers, kernels_in_buffers=inside, kernels_outside=outside,
                custom_calls_in_buffers=custom_in, custom_calls_outside=custom_out)


def _called(instr) -> list[str]:
    import re
    return re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", instr.rest)


def time_exe(call, pages, inputs, steps: int) -> tuple[dict, object]:
    """Time one executable (`call(pages, tokens, positions, table, sp, steps) -> (pages, out)`) the
    sync / chain / enqueue ways (module docstring); returns (ms per step by mode, pages)."""
    import numpy as np
    tokens, positions, table, sp, step_B = inputs
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        pages, out = call(pages, tokens, positions, table, sp, step_B)
        np.asarray(out["tokens"])
        ts.append(time.perf_counter() - t0)
    res = {"sync_ms": 1e3 * statistics.median(ts)}

    def advance(carry):
        pages, out = call(carry[0], carry[1], positions, table, sp, step_B)
        return pages, out["tokens"]
    (pages, tok), times = time_chain(advance, (pages, out["tokens"]), steps)
    # the chain's last tokens: equal between processes that run the same calls on the same weights, so
    # two XLA settings (e.g. command-buffer update modes) can be checked against each other
    return dict(res, **times, last_tokens=[int(t) for t in np.asarray(tok).reshape(-1)]), pages


def time_chain(advance, carry, steps: int, repeats: int = 3) -> tuple[object, dict]:
    """`steps` calls `carry = advance(carry)` back to back, one wait at the end, `repeats` times: (the last
    carry, {chain_ms: wall per step, enqueue_ms: the host's loop per step}), medians."""
    import jax
    chains, enq = [], []
    for _ in range(repeats):
        jax.block_until_ready(carry)
        t0 = time.perf_counter()
        for _ in range(steps):
            carry = advance(carry)
        t1 = time.perf_counter()
        jax.block_until_ready(carry)
        t2 = time.perf_counter()
        enq.append((t1 - t0) / steps)
        chains.append((t2 - t0) / steps)
    return carry, dict(chain_ms=1e3 * statistics.median(chains), enqueue_ms=1e3 * statistics.median(enq))


def time_fixed_buffers(engine, pages, inputs, steps: int, schedule, call=None) -> tuple[dict, object]:
    """The step with every buffer at a fixed address from call to call: block table, sampling arrays and
    per-row steps placed on the device once, and tokens in / out and positions in one int32 [2, B] array
    that is donated with the pool and returned in place (the sampled tokens become the next step's
    input), so XLA's CUDA graph of the step sees no moved buffer and needs no update. The chain / enqueue
    ways of `time_exe` (ms per step) and the last tokens; with `call` (the ordinary step, as time_exe's)
    `tokens_match`: whether 3 chained steps of both from one copy of the pool sample the same tokens."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from kimi_jax.tools.step_adapters import decode_batch, scheduled_plan
    tokens, positions, table, sp, step_B = inputs
    plan = scheduled_plan(engine.exec_plan, schedule)

    def step(state, pages, io_2B, table, sp, step_B):
        batch = decode_batch(io_2B[0], io_2B[1], table, sp, step_B)
        pages, out = engine.step_jit(state, pages, batch, kind="decode", n_logprobs=None,
                                     sample_mode="greedy", plan=plan)
        return pages, io_2B.at[0].set(out["tokens"].astype(jnp.int32))

    fixed = jax.jit(step, donate_argnums=(1, 2))
    first_io = lambda: jnp.asarray(np.stack([np.asarray(tokens, np.int32), np.asarray(positions, np.int32)]))  # noqa: E731
    table, sp, step_B = jax.device_put((np.asarray(table, np.int32), sp, np.asarray(step_B, np.int32)))
    advance = lambda carry: fixed(engine.weights, *carry, table, sp, step_B)   # noqa: E731  (pages, io)
    res = {}
    if call is not None:
        ours, theirs, tok = [], [], tokens
        p = engine.snapshot(pages)
        for _ in range(3):
            p, o = call(p, tok, positions, table, sp, step_B)
            tok = o["tokens"]
            theirs.append(np.asarray(tok).tolist())
        carry = (engine.snapshot(pages), first_io())
        for _ in range(3):
            carry = advance(carry)
            ours.append(np.asarray(carry[1][0]).tolist())
        del p, carry
        res["tokens_match"] = ours == theirs
    carry = (pages, first_io())
    for _ in range(4):          # compile, then the runs after which XLA keeps the graph
        carry = advance(carry)
    (pages, io), times = time_chain(advance, carry, steps)
    return dict(res, **times, last_tokens=[int(t) for t in np.asarray(io[0])]), pages


def profile_exe(call, pages, inputs, steps: int, hlo_text: str, top_kernels: int = 30) -> tuple[dict, object]:
    """Kernel time per step of `steps` chained steps under the profiler: busy (sum of kernel
    durations, container ops dropped), span (first start to last end), kernels per step, and the
    costliest kernel names (us per step, launches per step)."""
    import tempfile
    import jax
    from kimi_jax.tools.profiling import drop_containers, find_trace_file, device_op_events, parse_hlo
    tokens, positions, table, sp, step_B = inputs
    tok = tokens
    tdir = tempfile.mkdtemp(prefix="kimi_full_depth_")
    jax.block_until_ready(pages)
    with jax.profiler.trace(tdir):
        for _ in range(steps):
            pages, out = call(pages, tok, positions, table, sp, step_B)
            tok = out["tokens"]
        jax.block_until_ready((pages, tok))
    evs = [o for o in drop_containers(device_op_events(find_trace_file(tdir)), parse_hlo(hlo_text))
           if o.dur_us > 0]
    if not evs:
        return {}, pages
    span = max(o.start_us + o.dur_us for o in evs) - min(o.start_us for o in evs)
    by_kernel: dict = {}
    for o in evs:
        us, n = by_kernel.get(o.kernel or o.name, (0.0, 0))
        by_kernel[o.kernel or o.name] = (us + o.dur_us, n + 1)
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top_kernels]
    evs.sort(key=lambda o: o.start_us)
    last = evs[len(evs) - len(evs) // steps:]        # the last step's kernels, in launch order
    return dict(step_kernels=[(o.name, o.kernel, o.dur_us) for o in last],
                device_busy_ms=sum(o.dur_us for o in evs) / 1e3 / steps, device_span_ms=span / 1e3 / steps,
                kernels_per_step=len(evs) / steps,
                top_kernels=[(k, us / steps, n / steps) for k, (us, n) in top]), pages


@contextlib.contextmanager
def _serving(engine, step):
    """Inside the block the engine's step is `step` (an executable compiled already)."""
    jitted, engine.step_jit = engine.step_jit, step
    try:
        yield
    finally:
        engine.step_jit = jitted


def _against_chain(times: dict, plan: dict) -> dict:
    """A timed row's host share of its chain and its chain against the planner's prediction."""
    return dict(host_share_of_chain=times["enqueue_ms"] / times["chain_ms"],
                pred_error=times["chain_ms"] / plan["pred_ms"] - 1.0)


def _call_compiled(compiled, state, pages, tokens, positions, table, sp, steps):
    from kimi_jax.tools.step_adapters import decode_batch
    return compiled(state, pages, decode_batch(tokens, positions, table, sp, steps))


def _call_as_jit(compiled, schedule, state, pages, batch, occ=None, prev=None, *, kind, n_logprobs,
                 sample_mode, plan, n_prompt_logprobs=None, fresh=False):
    """`ModelSteps.step_jit`'s signature over one compiled decode step (static arguments as compiled)."""
    got = (kind, n_logprobs, n_prompt_logprobs, sample_mode, plan.mla_schedule, occ, prev)
    if got != ("decode", None, None, "greedy", schedule, None, None):
        raise ValueError(f"the benchmark's step was compiled for a greedy decode step without "
                         f"logprobs on the MLA schedule {schedule}, got (kind, n_logprobs, "
                         f"n_prompt_logprobs, sample_mode, mla_schedule, occ, prev) = {got}")
    return compiled(state, pages, batch)


# shard presets -> (the whole model's preset, the layout on 8 devices whose one-device share they are)
SHARDS = {"kimi-k2.5-tp8-shard": ("kimi-k2.5", dict(tensor_parallel_size=8)),
          "kimi-k2.5-tp8-ep8-shard": ("kimi-k2.5", dict(tensor_parallel_size=8, enable_expert_parallel=True))}


def plan_row(cfg, hw, batch: int, context: int, whole=None) -> dict:
    """The planner's one-device prediction, the bytes the step reads (planner.step_bytes: expected and
    most experts touched) with their floors at hw's copy bandwidth, and with `whole` = (cfg, Layout) of
    a shard preset the whole model's plan on that layout without its collectives (pred_8dev_ms)."""
    from kimi_jax.parallel.sharding import Layout
    from kimi_jax.tools import planner
    p = planner.plan(cfg, hw, Layout(1), batch, context)
    read = sum(planner.step_bytes(cfg, batch, context).values())
    most = sum(planner.step_bytes(cfg, batch, context, experts="max").values())
    row = dict(pred_ms=1e3 * p.step_s, pred_weights_gb=p.weight_bytes / 1e9, pred_cache_gb=p.cache_bytes / 1e9,
               bytes_gb=read / 1e9, bytes_max_gb=most / 1e9, floor_ms=1e3 * read / hw.hbm_bw,
               floor_max_ms=1e3 * most / hw.hbm_bw)
    if whole is not None:
        w = planner.plan(whole[0], hw, whole[1], batch, context)
        row.update(pred_8dev_ms=1e3 * (w.compute_memory_s + w.overhead_s), pred_8dev_layout=w.layout)
    return row


class _CacheHits:
    """Counts the persistent compilation cache's hits and misses (jax.monitoring events)."""

    def __init__(self):
        import jax
        self.hits = self.misses = 0

        def listen(name, **kw):
            if name == "/jax/compilation_cache/cache_hits":
                self.hits += 1
            elif name == "/jax/compilation_cache/cache_misses":
                self.misses += 1
        jax.monitoring.register_event_listener(listen)


def bench(cfg, batches, *, context: int, steps: int, variants, variant_batches=(), profile_batches=(),
          scheduler_batches=(), compile_only: bool = False, hw_name: str = "h200", dtype=None, emit=print,
          tag: str = "", plan_options: Optional[dict] = None, whole=None,
          kernel_dir: Optional[str] = None, variant_options: Optional[dict] = None,
          dispatch: bool = False, fixed_buffers: bool = False) -> list[dict]:
    """Every measurement of the module docstring for `cfg` on one device; `emit(row)` is called as
    each row is done; `whole`: as plan_row's; `kernel_dir`: where each profiled step's kernels are
    written in launch order (kernels_B<batch>.tsv: HLO op, kernel, us) beside its compiled HLO
    (step_B<batch>.hlo.txt); `variant_options`: more variants {name: XLA compile options}; `dispatch`: a
    row timing the host's dispatch of an executable that takes the weights and does nothing
    (`harness.dispatch_cost`); `fixed_buffers`: a row of the step with every buffer at a fixed address
    (`time_fixed_buffers`). Returns the rows."""
    import jax
    import jax.numpy as jnp
    from kimi_jax import ops
    from kimi_jax.engine.mla_schedule import mla_schedule_for
    from kimi_jax.parallel.sharding import Layout
    from kimi_jax.tools.step_adapters import decode_batch, decode_step_async, scheduled_plan
    from kimi_jax.tools import hardware
    from kimi_jax.ops import ExecPlan
    from kimi_jax.tools.profiling import random_engine
    from kimi_jax.engine.shapes import MIN_TABLE_TOKENS, table_bucket
    P = context // PAGE_SIZE
    if context % PAGE_SIZE or table_bucket(P, PAGE_SIZE) != P:
        # the step is compiled for the block-table width the scheduler uses (engine.shapes.table_bucket)
        raise ValueError(f"context={context}: need a power-of-two number of {PAGE_SIZE}-token pages covering "
                         f"at least {MIN_TABLE_TOKENS} tokens")
    known = {**VARIANTS, **(variant_options or {})}
    for v in variants:
        if v not in known:
            raise ValueError(f"unknown command-buffer variant {v!r} (known: {', '.join(known)})")
    dtype = dtype or jnp.bfloat16
    hw = hardware.get(hw_name)
    hits = _CacheHits()
    base = dict(tag=tag, **(plan_options or {}), layers=cfg.num_hidden_layers, experts=cfg.n_routed_experts,
                context=context, device=jax.devices()[0].device_kind, jax=jax.__version__,
                xla_flags=os.environ.get("XLA_FLAGS", ""))
    rows = []

    def out(row):
        row = {**base, **row}
        rows.append(row)
        emit(row)

    layout = Layout(1)
    t0 = time.perf_counter()
    # compile_only builds the weights too: a step lowered over shapes only is another program (another
    # persistent cache key) than the one over the placed arrays
    engine = random_engine(cfg, layout, dtype, plan=ExecPlan.for_backend(**(plan_options or {})))
    jax.block_until_ready(jax.tree.leaves(engine.state))
    out(dict(kind="build", seconds=time.perf_counter() - t0))
    if dispatch and not compile_only:
        cost = harness.dispatch_cost(engine.weights)      # what the steps take; then the nnx.State of it
        out(dict(kind="dispatch", **cost, as_nnx_state_us=harness.dispatch_cost(engine.state)["with_weights_us"]))
    pallas = engine.exec_plan.impl == "pallas"
    scheduled = {}        # batch -> its plan row, for the scheduler
    for b in batches:
        inputs = step_inputs(cfg, b, context)
        tokens, positions, table, sp, step_B = inputs
        P = table.shape[1]
        schedule = mla_schedule_for(positions, pallas)
        pages = random_pages(engine, b * P)
        t0 = time.perf_counter()
        batch = decode_batch(tokens, positions, table, sp, step_B)
        lowered = engine.step_jit.lower(engine.weights, pages, batch, kind="decode",
                                        n_logprobs=None, sample_mode="greedy",
                                        plan=scheduled_plan(engine.exec_plan, schedule))
        lower_s = time.perf_counter() - t0
        plan = plan_row(cfg, hw, b, context, whole)
        first = None
        for v in (variants if b in variant_batches else variants[:1]):
            h0, m0 = hits.hits, hits.misses
            t0 = time.perf_counter()
            try:
                compiled = lowered.compile(compiler_options=known[v])
            except Exception as e:       # an option this XLA does not know: the row says so, the run goes on
                if v == variants[0]:
                    raise
                out(dict(kind="step", batch=b, variant=v, error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            compile_s = time.perf_counter() - t0
            first = first or compiled
            text = compiled.as_text()
            row = dict(kind="step", batch=b, variant=v, lower_s=lower_s, compile_s=compile_s,
                       cache_hit=hits.hits > h0, cache_miss=hits.misses > m0, hlo_chars=len(text),
                       **command_buffer_census(text), **plan)
            if not compile_only:
                call = functools.partial(_call_compiled, compiled, engine.weights)
                pages, o = call(pages, tokens, positions, table, sp, step_B)   # a first run (allocations)
                jax.block_until_ready(o)
                times, pages = time_exe(call, pages, inputs, steps)
                row.update(times)
                if b in profile_batches and v == variants[0]:
                    prof, pages = profile_exe(call, pages, inputs, min(steps, 3), text)
                    listed = prof.pop("step_kernels", [])
                    if kernel_dir:
                        with open(os.path.join(kernel_dir, f"kernels_B{b}.tsv"), "w") as f:
                            f.writelines(f"{op}\t{kernel}\t{us:.2f}\n" for op, kernel, us in listed)
                        with open(os.path.join(kernel_dir, f"step_B{b}.hlo.txt"), "w") as f:
                            f.write(text)
                    row.update(prof)
                row.update(_against_chain(row, plan))
            out(row)
            del compiled
        del lowered
        if compile_only:
            del pages
            continue
        # the serving call: step_adapters.decode_step_async's host work, dispatching the first
        # variant's executable (the jitted step is served by it: no second compile)
        serve = functools.partial(_call_as_jit, first, schedule)
        with _serving(engine, serve):
            call = functools.partial(decode_step_async, engine, n_logprobs=None,
                                     sample_mode="greedy")
            times, pages = time_exe(call, pages, inputs, steps)
        out(dict(kind="step", batch=b, variant="serve", **times, **plan, **_against_chain(times, plan)))
        if fixed_buffers:
            times, pages = time_fixed_buffers(engine, pages, inputs, steps, schedule,
                                              call=functools.partial(_call_compiled, first, engine.weights))
            out(dict(kind="step", batch=b, variant="fixed", **times, **plan, **_against_chain(times, plan)))
        del pages, first
        if b in scheduler_batches:
            scheduled[b] = plan
    # last: the scheduler's runner compiles step programs of its own
    for b, plan in scheduled.items():
        for overlap, fixed in ((True, True), (True, False), (False, True), (False, False)):
            out(dict(kind="scheduler", batch=b, overlap=overlap, fixed_buffers=fixed, **plan,
                     **scheduler_run(engine, b, context, steps, overlap, fixed)))
    out(dict(kind="cache", hits=hits.hits, misses=hits.misses))
    return rows


def scheduler_run(engine, batch: int, context: int, steps: int, overlap: bool, fixed_buffers: bool = True) -> dict:
    """`EngineCore.run` decoding `steps` tokens (after a 3-token warm-up run) for `batch` requests
    whose prompts of context - max(steps, page) - 1 tokens are already cached, over a pool of the
    benchmark's shape (context / page pages per row, so the decode step is the one compiled already):
    ms per step (wall / engine steps), the engine's steps and its overlapped steps."""
    import numpy as np
    from kimi_jax.engine.sampling import SamplingParams
    from kimi_jax.engine.args import CacheConfig, SchedulerConfig
    from kimi_jax.engine.core import EngineCore
    cfg = engine.cfg
    # each row leaves at least one of its pages free before it decodes (admission needs one)
    prompt_len = context - max(steps, PAGE_SIZE) - 1
    cache = CacheConfig(PAGE_SIZE, batch * (context // PAGE_SIZE), engine.cache_dtype)
    sc = SchedulerConfig(batch, context, 256, 2048, overlap_scheduling=overlap)
    be = EngineCore(engine, sc, cache, fixed_buffers=fixed_buffers)
    pool = be.scheduler.pool
    be.runner.pages = random_pages(engine, pool.num_pages)
    rng = np.random.default_rng(0)

    def one_run(n_tokens, tag):
        for i in range(batch):
            ids = [int(t) for t in rng.integers(0, cfg.vocab_size, prompt_len)]
            [r] = be.make_request(f"{tag}{i}", ids, SamplingParams(temperature=0.0, max_tokens=n_tokens,
                                                                   ignore_eos=True), seed=i)
            r.num_computed = prompt_len - 1     # prompt cached but its last token: decode only
            r.pages = pool.take(-(-r.num_computed // PAGE_SIZE))
            be.add([r])
        s0, o0 = be.stats["steps"], be.stats["overlapped_steps"]
        t0 = time.perf_counter()
        be.run()
        return time.perf_counter() - t0, be.stats["steps"] - s0, be.stats["overlapped_steps"] - o0

    one_run(3, "w")
    wall, n, overlapped = one_run(steps, "t")
    del be
    return dict(ms_per_step=1e3 * wall / n, engine_steps=n, overlapped_steps=overlapped)


def table(rows) -> str:
    lines = [f"{'B':>3} {'variant':8} {'lower s':>7} {'compile s':>9} {'hit':>3} {'cb':>3} {'in/out':>9} "
             f"{'sync':>7} {'chain':>7} {'enq':>6} {'busy':>7} {'pred':>7} {'err':>6} {'host%':>6} {'GB':>6} "
             f"{'floor':>6} {'pred8':>7}"]
    f = lambda r, k, w, p=2: (format(r[k], f"{w}.{p}f") if isinstance(r.get(k), (int, float)) else " " * (w - 1) + "-")  # noqa: E731
    for r in rows:
        if r["kind"] == "step" and "error" in r:
            lines.append(f"{r['batch']:3d} {r['variant']:8} failed: {r['error'][:120]}")
        elif r["kind"] == "step":
            cb = f"{r.get('kernels_in_buffers', '-')}/{r.get('kernels_outside', '-')}"
            lines.append(f"{r['batch']:3d} {r['variant']:8} {f(r, 'lower_s', 7, 1)} {f(r, 'compile_s', 9, 1)} "
                         f"{'y' if r.get('cache_hit') else 'n':>3} {r.get('command_buffers', '-'):>3} {cb:>9} "
                         f"{f(r, 'sync_ms', 7)} {f(r, 'chain_ms', 7)} {f(r, 'enqueue_ms', 6)} "
                         f"{f(r, 'device_busy_ms', 7)} {f(r, 'pred_ms', 7)} "
                         f"{100 * r['pred_error'] if 'pred_error' in r else float('nan'):5.1f}% "
                         f"{100 * r['host_share_of_chain'] if 'host_share_of_chain' in r else float('nan'):5.1f}% "
                         f"{f(r, 'bytes_gb', 6)} {f(r, 'floor_ms', 6)} {f(r, 'pred_8dev_ms', 7)}")
        elif r["kind"] == "scheduler":
            lines.append(f"{r['batch']:3d} sched overlap={r['overlap']} fixed={r.get('fixed_buffers')}: "
                         f"{r['ms_per_step']:.2f} ms/step "
                         f"({r['engine_steps']} steps, {r['overlapped_steps']} overlapped), pred {r['pred_ms']:.2f}")
        elif r["kind"] == "build":
            lines.append(f"model built in {r['seconds']:.1f} s (random weights, on the device)")
        elif r["kind"] == "dispatch":
            lines.append(f"dispatch of a no-op over the {r['arguments']} weight arrays: {r['with_weights_us']:.0f} us "
                         f"({r['alone_us']:.1f} without them, {r['per_argument_us']:.2f} us an argument; as an "
                         f"nnx.State {r.get('as_nnx_state_us', float('nan')):.0f} us)")
    return "\n".join(lines)


def main(argv):
    del argv
    common.setup()
    import jax
    import jax.numpy as jnp
    from kimi_jax.config import preset
    if FLAGS.cache_dir:
        jax.config.update("jax_compilation_cache_dir", FLAGS.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cfg = preset("tiny" if FLAGS.tiny else FLAGS.preset)
    whole = None
    if not FLAGS.tiny and FLAGS.preset in SHARDS:
        from kimi_jax.parallel.sharding import Layout
        name, layout = SHARDS[FLAGS.preset]
        whole = (preset(name).replace(num_hidden_layers=cfg.num_hidden_layers), Layout(**layout))
    if FLAGS.layers:
        cfg = cfg.replace(num_hidden_layers=FLAGS.layers)
        whole = whole and (whole[0].replace(num_hidden_layers=FLAGS.layers), whole[1])
    os.makedirs(FLAGS.out, exist_ok=True)
    path = os.path.join(FLAGS.out, "full_depth_rows.jsonl")

    def emit(row):
        print(json.dumps(row, default=float), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(row, default=float) + "\n")

    ints = lambda xs: [int(x) for x in xs]   # noqa: E731
    rows = bench(cfg, ints(FLAGS.batches), context=FLAGS.context, steps=FLAGS.steps, variants=FLAGS.variants,
                 variant_batches=ints(FLAGS.variant_batches), profile_batches=ints(FLAGS.profile_batches),
                 scheduler_batches=ints(FLAGS.scheduler_batches), compile_only=FLAGS.compile_only,
                 hw_name=FLAGS.hardware, dtype=jnp.float32 if FLAGS.tiny else None, emit=emit, tag=FLAGS.tag,
                 plan_options={k: getattr(FLAGS, k) for k in ("router_kernel", "norm_kernel", "routing", "mla_fuse_new",
                                                                  "pack_vectors")
                               if getattr(FLAGS, k) is not None},
                 whole=whole, kernel_dir=FLAGS.out, dispatch=FLAGS.dispatch, fixed_buffers=FLAGS.fixed_buffers,
                 variant_options=json.loads(FLAGS.variant_options) if FLAGS.variant_options else None)
    print(table(rows), flush=True)


def run(argv=None) -> None:
    common.run(main, "kimi-bench full_depth", __name__, __doc__, argv=argv)


if __name__ == "__main__":
    run()
