"""What every front end (LLM, the OpenAI server, kimi-batch) is built on: one model loaded once from
an EngineConfig, its jitted steps, the input and output processors, and engine cores over them."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Optional

import jax
import jax.numpy as jnp

from kimi_jax import ops
from kimi_jax.config import ModelConfig, preset
from kimi_jax.engine import compiles
from kimi_jax.engine.args import CacheConfig, EngineConfig, SchedulerConfig
from kimi_jax.engine.core import EngineCore
from kimi_jax.engine.steps import ModelSteps
from kimi_jax.entrypoints import compilation_cache, progress
from kimi_jax.entrypoints.inputs import InputProcessor, load_tokenizer
from kimi_jax.entrypoints.outputs import OutputProcessor
from kimi_jax.entrypoints.weights import load_model, random_model, read_checkpoint
from kimi_jax.parallel.sharding import Layout, device_memory_bytes

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def demo_model_path() -> Optional[str]:
    """The shipped demo checkpoint (package data), if installed."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints",
                        "demo")
    try:
        import checkpoints
        here = os.path.join(os.path.dirname(checkpoints.__file__), "demo")
    except ImportError:
        pass
    return here if os.path.isfile(os.path.join(here, "config.json")) else None


def default_prefill_chunk(cfg: ModelConfig, dtype, plan: Optional[ops.ExecPlan] = None) -> int:
    """prefill_chunk's default: 2048 where a chunk after cached tokens takes the split path (no
    [B, N, T, S] scores; BENCHMARKS.md "Prefill chunk size"), else 256 (einsum path: f32 scores)."""
    path = ops.prefill_attention_path(
        cfg.qk_head_dim, cfg.v_head_dim, dtype, causal=False, plan=plan
    )
    return 2048 if path.endswith("_split") else 256


@dataclasses.dataclass
class Frontend:
    """One loaded model: its jitted `steps`, `inputs`, `outputs`, the resolved configs, and
    `make_core()` (each core its own page pool; grammars and pass costs shared)."""
    engine_config: EngineConfig
    config: ModelConfig
    layout: Layout
    dtype: object
    tokenizer: object
    steps: ModelSteps
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    inputs: InputProcessor
    outputs: OutputProcessor
    _structured: object = None
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def model_path(self) -> Optional[str]:
        return self.engine_config.model_path

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    @property
    def eos_ids(self) -> set:
        eos = set(self.config.eos_token_id)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.stop_token_ids)
        return eos

    def structured_backend(self):
        """The structured-outputs backend (None without a tokenizer), shared by every core."""
        with self._lock:
            if self._structured is None and self.tokenizer is not None:
                from kimi_jax.engine.structured import StructuredBackend
                self._structured = StructuredBackend(self.tokenizer, self.config.vocab_size)
            return self._structured

    def make_core(self, **changes) -> EngineCore:
        """A new engine core (a fresh page pool); changes: SchedulerConfig / CacheConfig fields."""
        sc, cc = self.scheduler_config, self.cache_config
        own = {f.name for f in dataclasses.fields(SchedulerConfig)}
        cache = {f.name for f in dataclasses.fields(CacheConfig)}
        unknown = set(changes) - own - cache
        if unknown:
            raise TypeError(f"make_core: no setting {sorted(unknown)[0]!r}")
        sc = dataclasses.replace(sc, **{k: v for k, v in changes.items() if k in own})
        cc = dataclasses.replace(cc, **{k: v for k, v in changes.items() if k in cache})
        return EngineCore(self.steps, sc, cc, tokenizer=self.tokenizer,
                          eos_ids=self.eos_ids, structured=self.structured_backend(),
                          seed=self.engine_config.seed)

    def precompile(self, core: EngineCore) -> int:
        """Compile `core`'s program set (`EngineCore.precompile`: LLM, the OpenAI server and
        kimi-batch with `EngineConfig.precompile`), each program on the progress log; returns how
        many."""
        def report(i, n, key):
            progress.log.info("precompiled %d / %d programs (%s)", i, n, key,
                              extra={"kimi_done": i == n})
        with progress.phase("precompiling the serving programs"):
            return core.precompile(report)

    @classmethod
    def from_config(cls, ec: EngineConfig) -> "Frontend":
        """Load what `ec` names (the demo model when it names none): its config, tokenizer (before
        the weights, so a missing file fails at once) and weights, checked and placed under its
        layout."""
        if ec.model is None:
            demo = demo_model_path()
            if demo is None:
                log.warning("no demo model installed; using the random 'tiny' preset")
            ec = ec.replace(model=demo or "tiny")
        if ec.trust_remote_code:
            log.warning("trust_remote_code: no code from the checkpoint is ever run here; "
                        "the model is kimi_jax's own")
        path = ec.model_path
        layout = Layout(ec.tensor_parallel_size, ec.data_parallel_size, ec.enable_expert_parallel)
        checkpoint = None
        if isinstance(ec.model, ModelConfig):
            cfg = ec.model
        elif path is not None:
            checkpoint = read_checkpoint(path)     # config.json and the weights' index read once
            cfg = checkpoint.config
        else:
            cfg = preset(ec.model)
        dtype = DTYPES[ec.resolve_dtype(jax.devices()[0].platform,
                                        checkpoint.config_dict if checkpoint else None)]
        layout.check_divisible(cfg)
        limit = cfg.max_position_embeddings
        if ec.max_model_len is not None and ec.max_model_len > limit:
            raise ValueError(f"max_model_len={ec.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({limit})")
        compilation_cache.enable(ec.compilation_cache_dir)
        compiles.install()                # /metrics counts the start-up's programs too
        tokenizer = load_tokenizer(ec.tokenizer, path)    # before the weights
        with progress.phase("loading weights" if path else "making random weights"):
            net = (
                random_model(cfg, layout, dtype, ec.seed)
                if checkpoint is None
                else load_model(
                    checkpoint, cfg, layout, dtype, check_finite=ec.check_finite_weights
                )
            )
        if tokenizer is not None and path is not None:
            tokenizer.template_dir = path
        plan = ops.default_plan(ec.exec_plan)
        if ec.batch_invariant:
            plan = dataclasses.replace(plan, batch_invariant=True)
        # a vocabulary padded past the tokenizer's ids: those rows are never sampled
        steps = ModelSteps(net, cfg, layout, plan=plan,
                           vocab_limit=None if tokenizer is None else tokenizer.vocab_size)
        max_model_len = ec.max_model_len or limit
        num_pages = ec.num_gpu_blocks_override or _default_num_pages(
            cfg, layout, dtype, ec, max_model_len
        )
        sc = SchedulerConfig(
            max_num_seqs=ec.max_num_seqs, max_model_len=max_model_len,
            prefill_chunk=ec.prefill_chunk or default_prefill_chunk(cfg, dtype, steps.exec_plan),
            max_prefill_tokens=ec.max_prefill_tokens, max_logprobs=ec.max_logprobs,
            speculative_config=ec.speculative_config, overlap_scheduling=ec.overlap_scheduling,
            step_layout=ec.step_layout, max_num_batched_tokens=ec.batched_tokens(),
            long_prefill_token_threshold=ec.long_prefill_token_threshold)
        cc = CacheConfig(ec.block_size, num_pages, dtype, ec.enable_prefix_caching)
        return cls(
            ec,
            cfg,
            layout,
            dtype,
            tokenizer,
            steps,
            sc,
            cc,
            InputProcessor(tokenizer, path),
            OutputProcessor(tokenizer),
        )


def _default_num_pages(cfg: ModelConfig, layout: Layout, dtype, ec: EngineConfig,
                       max_model_len: int) -> int:
    """Pages from the device memory left after the weights (GPU; under data parallelism each device
    holds 1/dp of the pool, so the pool is dp times what one device has room for); on CPU, enough
    for every sequence slot to reach max_model_len, capped at 2048 pages (XLA:CPU's cache update
    costs time in proportion to the pool; a fuller pool preempts and recomputes instead)."""
    page_bytes = cfg.num_hidden_layers * ec.block_size * cfg.latent_dim * jnp.dtype(dtype).itemsize
    full = ec.max_num_seqs * -(-max_model_len // ec.block_size)
    limit = device_memory_bytes()
    if limit is None:
        return max(2, min(full, 2048))
    stats = jax.devices()[0].memory_stats() or {}
    free = limit * ec.gpu_memory_utilization - stats.get("bytes_in_use", 0)
    pages = int(free // page_bytes) * layout.data_parallel_size
    if pages < 2:
        raise ValueError(
            f"no memory left for the cache: {free / 2**30:.2f} GiB free after the weights "
            f"at gpu_memory_utilization={ec.gpu_memory_utilization}"
        )
    return min(pages, full)
