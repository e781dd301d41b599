"""The user-facing API (vLLM's names): LLM, SamplingParams, RequestOutput, CompletionOutput."""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import threading
import time
from typing import Callable, Optional, Sequence, Union

import jax.numpy as jnp
import numpy as np

import jax

from kimi_jax import ops
from kimi_jax.config import ModelConfig, preset
from kimi_jax.engine.steps import Engine
from kimi_jax.engine.sampling import Logprob, SamplingParams
from kimi_jax.engine.scheduler import BatchEngine, Request, RequestError, validate_prompt
from kimi_jax.parallel.sharding import Layout
from kimi_jax.entrypoints.weights import load_model, random_model  # noqa: F401  (LLM's weights)
from kimi_jax.engine import compiles
from kimi_jax.engine.args import EngineConfig
from kimi_jax.entrypoints import compilation_cache, progress

log = logging.getLogger(__name__)
Prompt = Union[str, Sequence[int], dict]
_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: Optional[str]
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, Logprob]]]
    finish_reason: Optional[str]            # "stop" | "length" | "tool_calls" (LLM.chat with tools)
    stop_reason: Union[int, str, None] = None
    # LLM.chat with tools: the parsed answer (text before Kimi's tool-call section) and OpenAI tool_calls
    content: Optional[str] = None
    tool_calls: Optional[list] = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict = dataclasses.field(default_factory=dict)
    num_cached_tokens: int = 0              # prompt tokens read from the prefix cache
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None


def _prompt_list(prompts) -> list:
    """generate()'s prompts as a list of prompts (TypeError naming the argument otherwise)."""
    if isinstance(prompts, np.ndarray):
        if not np.issubdtype(prompts.dtype, np.integer) or prompts.ndim not in (1, 2):
            raise TypeError(f"prompts: a numpy array of token ids must be 1-D or 2-D of integers, got "
                            f"{prompts.dtype}{list(prompts.shape)}")
        return [prompts.tolist()] if prompts.ndim == 1 else prompts.tolist()
    if isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        raise TypeError(f"prompts must be a string, a list of token ids, a prompt dict or a list of those, "
                        f"got {type(prompts).__name__}")
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                            and isinstance(prompts[0], (int, np.integer))):
        return [prompts]
    return [p.tolist() if isinstance(p, np.ndarray) and np.issubdtype(p.dtype, np.integer) and p.ndim == 1
            else p for p in prompts]
def _progress_bar(use_tqdm, total: int):
    """generate()'s bar over `total` requests: None (off), tqdm, or the class use_tqdm names."""
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="requests", unit="req")
    from tqdm import tqdm
    return tqdm(total=total, desc="requests", unit="req")


def demo_model_path() -> Optional[str]:
    """The shipped demo checkpoint (package data), if installed."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "demo")
    try:
        import checkpoints
        here = os.path.join(os.path.dirname(checkpoints.__file__), "demo")
    except ImportError:
        pass
    return here if os.path.isfile(os.path.join(here, "config.json")) else None


def latency_metrics(r: Request) -> dict:
    """A finished request's timing as the host saw it: arrival_time, first_token_time and finished_time
    (time.time()), time_to_first_token (seconds from arrival, queueing included) and
    time_per_output_token (mean seconds between its later tokens; None with fewer than two)."""
    n = len(r.output_ids)
    ttft = (r.first_token_time - r.arrival_time
            if r.first_token_time is not None and r.arrival_time is not None else None)
    tpot = ((r.finished_time - r.first_token_time) / (n - 1)
            if n > 1 and r.finished_time is not None and r.first_token_time is not None else None)
    return {"arrival_time": r.arrival_time, "first_token_time": r.first_token_time,
            "finished_time": r.finished_time, "time_to_first_token": ttft, "time_per_output_token": tpot}


def default_prefill_chunk(cfg: ModelConfig, dtype, plan: Optional[ops.ExecPlan] = None) -> int:
    """prefill_chunk's default: 2048 where a chunk after cached tokens takes the split path (no [B, N, T, S]
    scores; BENCHMARKS.md "Prefill chunk size"), else 256 (the einsum path's f32 scores)."""
    path = ops.prefill_attention_path(cfg.qk_head_dim, cfg.v_head_dim, dtype, causal=False, plan=plan)
    return 2048 if path.endswith("_split") else 256


class LLM:
    """An engine for one model, built from an EngineConfig: `LLM(model, **EngineConfig fields)` or
    `LLM.from_config(engine_config)` (kimi_jax.engine.args)."""

    def __init__(self, model: Union[str, ModelConfig, None] = None, *,
                 engine_config: Optional[EngineConfig] = None, **kwargs):
        if engine_config is None:
            engine_config = EngineConfig(model, **kwargs)
        elif model is not None or kwargs:
            raise TypeError("give LLM either engine_config or model and keyword arguments, not both")
        if engine_config.model is None:
            demo = demo_model_path()
            if demo is None:
                log.warning("no demo model installed; using the random 'tiny' preset")
            engine_config = engine_config.replace(model=demo or "tiny")
        self.engine_config = ec = engine_config
        if ec.trust_remote_code:
            log.warning("trust_remote_code: no code from the checkpoint is ever run here; "
                        "the model is kimi_jax's own")
        self.dtype = _DTYPES[ec.resolve_dtype(jax.devices()[0].platform)]
        self.model_path = ec.model_path
        self.layout = Layout(ec.tensor_parallel_size, ec.data_parallel_size, ec.enable_expert_parallel)
        if isinstance(ec.model, ModelConfig):
            self.config = ec.model
        elif self.model_path is not None:
            self.config = ModelConfig.from_pretrained(self.model_path)
        else:
            self.config = preset(ec.model)
        self.layout.check_divisible(self.config)
        limit = self.config.max_position_embeddings
        if ec.max_model_len is not None and ec.max_model_len > limit:
            raise ValueError(f"max_model_len={ec.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({limit})")
        compilation_cache.enable(ec.compilation_cache_dir)
        compiles.install()                # /metrics counts the start-up's programs too
        self.check_finite_weights = ec.check_finite_weights
        self.tokenizer = self._load_tokenizer(ec.tokenizer, self.model_path)    # before the weights
        with progress.phase("loading weights" if self.model_path else "making random weights"):
            net = self._build(ec.seed)
        if self.tokenizer is not None and self.model_path is not None:
            self.tokenizer.template_dir = self.model_path
        self.max_model_len = ec.max_model_len or limit
        self.max_num_seqs = ec.max_num_seqs
        self.engine = Engine(net, self.config, self.layout, plan=ops.default_plan(ec.exec_plan))
        self.page_size = ec.page_size
        self.num_pages = ec.num_pages or self._default_num_pages(ec.gpu_memory_utilization)
        self.prefill_chunk = ec.prefill_chunk or default_prefill_chunk(self.config, self.dtype, self.exec_plan)
        self.max_prefill_tokens = ec.max_prefill_tokens
        self.speculative = ec.speculative_config
        self.overlap_scheduling = ec.overlap_scheduling
        # generate() keeps one batch engine with prefix caching, so its cache outlives a call
        self.enable_prefix_caching = ec.enable_prefix_caching
        self.max_logprobs = ec.max_logprobs
        self._generate_engine: Optional[BatchEngine] = None
        self._rng = random.Random(ec.seed)
        self._structured = None
        self._next_id = 0
        if ec.precompile:
            self.precompile()

    @classmethod
    def from_config(cls, engine_config: EngineConfig) -> "LLM":
        return cls(engine_config=engine_config)

    def precompile(self) -> int:
        """Compile every program the batch engine's limits can reach (`Runner.programs`), reporting
        each on the progress log; returns how many."""
        def report(i, n, key):
            progress.log.info("precompiled %d / %d programs (%s)", i, n, key, extra={"kimi_done": i == n})
        with progress.phase("precompiling the serving programs"):
            return self.batch_engine().precompile(report)

    @property
    def exec_plan(self) -> ops.ExecPlan:
        """The ExecPlan the engine's steps run (`self.engine.plan`)."""
        return self.engine.plan

    def _default_num_pages(self, utilization: float) -> int:
        """Pages from the device memory left after the weights (GPU; under data parallelism each device
        holds 1/dp of the pool, so the pool is dp times what one device has room for); on CPU, enough for
        every sequence slot to reach max_model_len, capped at 2048 pages (XLA:CPU's cache update costs
        time in proportion to the pool; a fuller pool preempts and recomputes instead)."""
        cfg = self.config
        page_bytes = (cfg.num_hidden_layers * self.page_size * cfg.latent_dim * jnp.dtype(self.dtype).itemsize)
        full = self.max_num_seqs * -(-self.max_model_len // self.page_size)
        from kimi_jax.parallel.sharding import device_memory_bytes
        limit = device_memory_bytes()
        if limit is None:
            return max(2, min(full, 2048))
        stats = jax.devices()[0].memory_stats() or {}
        free = limit * utilization - stats.get("bytes_in_use", 0)
        pages = int(free // page_bytes) * self.layout.data_parallel_size
        if pages < 2:
            raise ValueError(f"no memory left for the cache: {free / 2**30:.2f} GiB free after the weights "
                             f"at gpu_memory_utilization={utilization}")
        return min(pages, full)

    def _build(self, seed: int):
        """Create or load the model with every parameter placed on its devices under the layout,
        after checking that the per-device bytes fit."""
        cfg, layout, dtype = self.config, self.layout, self.dtype
        if self.model_path is None:
            return random_model(cfg, layout, dtype, seed)
        return load_model(self.model_path, cfg, layout, dtype, check_finite=self.check_finite_weights)

    @staticmethod
    def _load_tokenizer(tokenizer: Optional[str], model_path: Optional[str]):
        """The tokenizer named by `tokenizer`, else the checkpoint's; None (a warning: token-id prompts
        only) for a checkpoint with neither tokenizer file; a missing or corrupt file raises."""
        from checkpoints.tokenizer_format import TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE
        from kimi_jax.text.tokenizer import Tokenizer, TokenizerNotFound
        path = tokenizer or model_path
        if path is None:
            return None
        if tokenizer is None and not any(os.path.isfile(os.path.join(path, f))
                                         for f in (TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE)):
            log.warning("%s has no %s: prompts must be token ids", path, TIKTOKEN_FILE)
            return None
        try:
            return Tokenizer.from_pretrained(path)
        except TokenizerNotFound as e:
            raise ValueError(str(e)) from None

    # ---- inputs -------------------------------------------------------------------------------
    def token_ids(self, prompt: Prompt, i: int) -> list[int]:
        """Token ids of a prompt: text (tokenized), token ids, or vLLM's {"prompt": text} /
        {"prompt_token_ids": ids}; the ids' validity is checked by the batch engine."""
        if isinstance(prompt, dict):
            for key in ("multi_modal_data", "mm_processor_kwargs"):
                if prompt.get(key) not in (None, {}):
                    raise ValueError(f"request {i}: the prompt's {key!r} is not supported (a text-only "
                                     "model)")
            keys = set(prompt) - {"multi_modal_data", "mm_processor_kwargs"}
            if keys == {"prompt_token_ids"}:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                    raise ValueError(f"request {i}: prompt_token_ids must be a list of token ids")
                return list(ids)
            if keys == {"prompt"}:
                if not isinstance(prompt["prompt"], str):
                    raise ValueError(f"request {i}: 'prompt' must be a string, got {type(prompt['prompt']).__name__}")
                return self.token_ids(prompt["prompt"], i)
            raise ValueError(f"request {i}: a prompt dict needs exactly one of 'prompt' (text) or "
                             f"'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {i}: a text prompt needs a tokenizer, and the checkpoint "
                                 f"{self.model_path or '(preset)'} has no tiktoken.model; pass token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (Sequence, np.ndarray)) or isinstance(prompt, bytes):
            raise ValueError(f"request {i}: a prompt is a string, a list of token ids or a dict with "
                             f"'prompt' / 'prompt_token_ids', got {type(prompt).__name__}")
        return list(prompt)

    @staticmethod
    def _prompt_text(prompt) -> Optional[str]:
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt")
        return prompt if isinstance(prompt, str) else None

    # ---- API ----------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [len(token_ids), vocab]: next-token logits at every position (prefill path)."""
        ids = self.token_ids(token_ids, 0)
        try:
            validate_prompt(ids, self.config.vocab_size, self.max_model_len + 1)
        except RequestError as e:
            raise ValueError(str(e)) from None
        return self.engine.logits([int(t) for t in ids])

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: Union[bool, Callable] = True, *, _prompt_texts: Optional[list[str]] = None
                 ) -> list[RequestOutput]:
        """Generate for one prompt or a list (text, token ids, or vLLM's prompt dicts; numpy integer
        arrays of ids too). use_tqdm: a progress bar over the requests (or a tqdm-like class to make it).
        _prompt_texts: the RequestOutput.prompt of each (chat: the rendered conversation). Calls from
        several threads run one at a time."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sps = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            sps = list(sampling_params)
        else:
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}" + (" (build one: SamplingParams(**d))"
                                                                   if isinstance(sampling_params, dict) else ""))
        if len(sps) != len(prompts):
            raise ValueError(f"got {len(sps)} SamplingParams for {len(prompts)} prompts")
        ids = [self.token_ids(p, i) for i, p in enumerate(prompts)]
        texts = _prompt_texts or [self._prompt_text(p) for p in prompts]
        with self._generate_lock():          # one batch engine, its pages donated step to step: one caller
            return self._generate(texts, ids, sps, use_tqdm)

    _lock_guard = threading.Lock()

    def _generate_lock(self) -> threading.RLock:
        lock = self.__dict__.get("_generate_mutex")
        if lock is None:
            with LLM._lock_guard:
                lock = self.__dict__.setdefault("_generate_mutex", threading.RLock())
        return lock

    def _generate(self, texts, ids, sps, use_tqdm) -> list[RequestOutput]:
        be = self._engine_for_generate()
        groups = []
        # every request is checked before any runs (kimi_jax.engine.validation): one bad value fails the
        # call up front, naming the request and the field
        for i, (text, t, sp) in enumerate(zip(texts, ids, sps)):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"request {i}: sampling_params must be SamplingParams, got {type(sp).__name__}")
            try:
                sp.validate(vocab_size=self.config.vocab_size, max_logprobs=self.max_logprobs)
                seed = sp.seed if sp.seed is not None else self._rng.getrandbits(31)
                groups.append(be.make_samples(str(self._next_id + i), t, sp, seed, prompt=text))
            except (RequestError, ValueError, TypeError) as e:
                raise ValueError(f"request {i}: {e}") from None
        self._next_id += len(groups)
        for g in groups:
            be.add_samples(g)
        bar = _progress_bar(use_tqdm, sum(len(g) for g in groups))
        t0 = time.perf_counter()

        def finished(_r):
            bar.update(1)
            bar.set_postfix(tok_s=f"{be.stats['generated_tokens'] / max(time.perf_counter() - t0, 1e-9):.1f}",
                            refresh=False)
        try:
            be.run(on_finish=finished if bar is not None else None)
        except BaseException:
            self._generate_engine = None       # its pages and queues are in an unknown state
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self.to_group_output(g) for g in groups]

    def get_tokenizer(self):
        """The tokenizer (vLLM's name; None for a model without one)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (vLLM's name)."""
        from kimi_jax.sampling_params import generation_defaults
        return SamplingParams(**generation_defaults(self.model_path))

    def _engine_for_generate(self) -> BatchEngine:
        """generate()'s batch engine: with prefix caching one kept for the LLM's life (its cached pages
        serve later calls), else a fresh one per call."""
        if not self.enable_prefix_caching:
            return self.batch_engine()
        if self._generate_engine is None:
            self._generate_engine = self.batch_engine()
        return self._generate_engine

    def batch_engine(self) -> BatchEngine:
        """A continuous-batching engine over this model (a fresh page pool)."""
        eos = set(self.config.eos_token_id)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.stop_token_ids)
        return BatchEngine(self.engine, num_pages=self.num_pages, page_size=self.page_size,
                           max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                           cache_dtype=self.dtype, prefill_chunk=self.prefill_chunk,
                           max_prefill_tokens=self.max_prefill_tokens, tokenizer=self.tokenizer, eos_ids=eos,
                           speculative=self.speculative, overlap=self.overlap_scheduling,
                           enable_prefix_caching=self.enable_prefix_caching, structured=self.structured_backend(),
                           max_logprobs=self.max_logprobs)

    def structured_backend(self):
        """The structured-outputs backend over this model's tokenizer (None without one), shared by
        every batch engine: compiled grammars are cached across calls."""
        if self._structured is None and self.tokenizer is not None:
            from kimi_jax.engine.structured import StructuredBackend
            self._structured = StructuredBackend(self.tokenizer, self.config.vocab_size)
        return self._structured

    def to_output(self, r: Request) -> RequestOutput:
        return self.to_group_output([r])

    def to_group_output(self, reqs: list[Request]) -> RequestOutput:
        """One prompt's RequestOutput from its samples (`BatchEngine.make_samples`): with best_of, the n
        of highest cumulative logprob (best first), else all n in sample order; indices 0 .. n-1."""
        r0, p = reqs[0], reqs[0].params
        chosen = list(reqs)
        if p.num_samples > p.n:
            chosen = sorted(reqs, key=lambda r: -r.cumulative_logprob)[:p.n]
        outputs = [self._completion(i, r) for i, r in enumerate(chosen)]
        prompt_lp = None
        if r0.prompt_logprobs is not None:
            prompt_lp = [None] + [self._decoded(d) for d in r0.prompt_logprobs[1:]]
        return RequestOutput(
            request_id=r0.group_id or r0.request_id, prompt=r0.prompt, prompt_token_ids=r0.prompt_ids,
            outputs=outputs, prompt_logprobs=prompt_lp,
            metrics={"num_preemptions": sum(r.num_preemptions for r in reqs),
                     "spec_drafted": sum(r.spec.drafted for r in reqs),
                     "spec_accepted": sum(r.spec.accepted for r in reqs),
                     "spec_verify_steps": sum(r.spec.verify_steps for r in reqs), **latency_metrics(r0)},
            num_cached_tokens=max(r.num_cached_tokens for r in reqs))

    def _completion(self, index: int, r: Request) -> CompletionOutput:
        text = None
        if self.tokenizer is not None:
            text = r.text if r.text is not None else self.tokenizer.decode(
                r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
        wants = r.params.logprobs is not None
        return CompletionOutput(index=index, text=text, token_ids=list(r.output_ids),
                                cumulative_logprob=r.cumulative_logprob if wants else None,
                                logprobs=[self._decoded(d) for d in r.logprobs] if wants else None,
                                finish_reason=r.finish_reason, stop_reason=r.stop_reason)

    def _decoded(self, lp: dict) -> dict:
        """Logprob entries with decoded_token set (each token's own text, special tokens included)."""
        if self.tokenizer is None:
            return lp
        return {t: dataclasses.replace(v, decoded_token=self.tokenizer.decode([t])) for t, v in lp.items()}

    def render_chat(self, messages, *, add_generation_prompt: bool = True, tools=None,
                    chat_template: Optional[str] = None) -> str:
        """One conversation rendered with the checkpoint's own chat template (sandboxed Jinja)."""
        if self.tokenizer is None:
            raise ValueError(f"chat needs a tokenizer; {self.model_path or 'this preset'} has none")
        tmpl = self.tokenizer.load_chat_template(chat_template)
        return tmpl.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    def encode_chat(self, messages, *, add_generation_prompt: bool = True, tools=None,
                    chat_template: Optional[str] = None) -> list[int]:
        """Prompt token ids of one conversation: the checkpoint's chat template (sandboxed, bounded)
        with only its own markup as special tokens; text from the messages and tools always encodes as
        plain text (kimi_jax.text.conversation)."""
        from kimi_jax.text.conversation import encode_conversation
        if self.tokenizer is None:
            raise ValueError(f"chat needs a tokenizer; {self.model_path or 'this preset'} has none")
        tmpl = self.tokenizer.load_chat_template(chat_template)
        return encode_conversation(tmpl, self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                   tools=tools)

    def chat(self, messages, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
             add_generation_prompt: bool = True, tools=None, chat_template: Optional[str] = None,
             use_tqdm: Union[bool, Callable] = True, tool_choice=None, response_format=None):
        """Generate from one conversation or a list of them, rendered with the checkpoint's chat template
        (`chat_prompt_ids`). tools / tool_choice / response_format constrain the output (OpenAI's fields)
        unless sampling_params has structured_outputs; with tools each output's calls are parsed into
        `content`, `tool_calls` and finish_reason "tool_calls"."""
        from kimi_jax.engine.structured_openai import from_openai
        from kimi_jax.engine.structured_params import StructuredOutputError
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kw = dict(add_generation_prompt=add_generation_prompt, tools=tools, chat_template=chat_template)
        prompts = [self.chat_prompt_ids(c, **kw) for c in convs]
        texts = [self.render_chat(c, **kw) for c in convs]
        try:
            constraint = from_openai(response_format, tools, tool_choice)
        except StructuredOutputError as e:
            raise ValueError(str(e)) from None
        sps = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
               else [sampling_params or SamplingParams()] * len(prompts))
        if constraint is not None:
            sps = [sp if not isinstance(sp, SamplingParams) or sp.structured_outputs is not None
                   else dataclasses.replace(sp, structured_outputs=constraint) for sp in sps]
        outs = self.generate(prompts, sps, use_tqdm=use_tqdm, _prompt_texts=texts)
        if tools:
            from kimi_jax.entrypoints.openai.protocol import calls_complete
            from kimi_jax.text.tool_parser import parse_output, tool_finish_reason
            for ro in outs:
                for c in ro.outputs:
                    parsed = parse_output(c.token_ids, self.tokenizer)
                    c.content, c.tool_calls = parsed.content, parsed.tool_calls
                    c.finish_reason = tool_finish_reason(c.finish_reason, calls_complete(parsed.tool_calls))
        return outs

    def chat_prompt_ids(self, messages, *, add_generation_prompt: bool = True, tools=None,
                        chat_template: Optional[str] = None) -> list[int]:
        """The prompt token ids of one conversation, as `chat` feeds them (the server uses this too):
        `encode_chat` (message text never becomes special tokens)."""
        return self.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                chat_template=chat_template)
