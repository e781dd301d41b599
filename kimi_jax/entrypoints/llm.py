"""The user-facing API (vLLM's names): LLM, SamplingParams, RequestOutput, CompletionOutput. LLM is
a thin client of one engine core (kimi_jax.engine.core) over a Frontend
(kimi_jax.entrypoints.frontend): the same input processor, request API and output processor as the
OpenAI server and kimi-batch."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Optional, Sequence, Union

import numpy as np

from kimi_jax import ops
from kimi_jax.config import ModelConfig
from kimi_jax.engine.args import EngineConfig
from kimi_jax.engine.core import EngineCore
from kimi_jax.engine.sampling import SamplingParams
from kimi_jax.engine.requests import validate_prompt
from kimi_jax.engine.validation import RequestError
from kimi_jax.entrypoints.frontend import (  # noqa: F401
    Frontend,
    default_prefill_chunk,
    demo_model_path,
)
from kimi_jax.entrypoints.inputs import Prompt
from kimi_jax.entrypoints.outputs import (  # noqa: F401
    CompletionOutput,
    RequestOutput,
    latency_metrics,
)

log = logging.getLogger(__name__)


def _prompt_list(prompts) -> list:
    """generate()'s prompts as a list of prompts (TypeError naming the argument otherwise)."""
    if isinstance(prompts, np.ndarray):
        if not np.issubdtype(prompts.dtype, np.integer) or prompts.ndim not in (1, 2):
            raise TypeError(
                f"prompts: a numpy array of token ids must be 1-D or 2-D of integers, got "
                f"{prompts.dtype}{list(prompts.shape)}"
            )
        return [prompts.tolist()] if prompts.ndim == 1 else prompts.tolist()
    if isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        raise TypeError(
            f"prompts must be a string, a list of token ids, a prompt dict or a list of "
            f"those, got {type(prompts).__name__}"
        )
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                            and isinstance(prompts[0], (int, np.integer))):
        return [prompts]
    return [p.tolist() if isinstance(p, np.ndarray) and np.issubdtype(p.dtype, np.integer)
            and p.ndim == 1 else p for p in prompts]


def _progress_bar(use_tqdm, total: int):
    """generate()'s bar over `total` requests: None (off), tqdm, or the class use_tqdm names."""
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="requests", unit="req")
    from tqdm import tqdm
    return tqdm(total=total, desc="requests", unit="req")


class LLM:
    """An engine for one model, built from an EngineConfig: `LLM(model, **EngineConfig fields)` or
    `LLM.from_config(engine_config)` (kimi_jax.engine.args)."""

    def __init__(self, model: Union[str, ModelConfig, None] = None, *,
                 engine_config: Optional[EngineConfig] = None, **kwargs):
        if engine_config is None:
            engine_config = EngineConfig(model, **kwargs)
        elif model is not None or kwargs:
            raise TypeError(
                "give LLM either engine_config or model and keyword arguments, not both"
            )
        self.frontend = fe = Frontend.from_config(engine_config)
        self.engine_config = fe.engine_config
        self.config, self.tokenizer, self.layout, self.dtype = (
            fe.config,
            fe.tokenizer,
            fe.layout,
            fe.dtype,
        )
        self.inputs, self.outputs = fe.inputs, fe.outputs
        self._core: Optional[EngineCore] = None
        self._next_id = 0
        if self.engine_config.precompile:
            self.precompile()

    @classmethod
    def from_config(cls, engine_config: EngineConfig) -> "LLM":
        return cls(engine_config=engine_config)

    # the resolved settings, as the engine runs them
    model_path = property(lambda self: self.frontend.model_path)
    max_model_len = property(lambda self: self.frontend.scheduler_config.max_model_len)
    max_num_seqs = property(lambda self: self.frontend.scheduler_config.max_num_seqs)
    prefill_chunk = property(lambda self: self.frontend.scheduler_config.prefill_chunk)
    max_logprobs = property(lambda self: self.frontend.scheduler_config.max_logprobs)
    block_size = property(lambda self: self.frontend.cache_config.page_size)
    num_gpu_blocks = property(lambda self: self.frontend.cache_config.num_pages)

    @property
    def exec_plan(self) -> ops.ExecPlan:
        """The ExecPlan the model's steps run."""
        return self.frontend.steps.exec_plan

    def precompile(self) -> int:
        """Compile every program this LLM's engine core can reach (`Runner.programs`), reporting
        each on the progress log (`Frontend.precompile`); returns how many."""
        return self.frontend.precompile(self.engine_core())

    def engine_core(self) -> EngineCore:
        """generate()'s engine core: with prefix caching one kept (its cached pages serve later
        calls), else a fresh one per call."""
        if self._core is None or not self.engine_config.enable_prefix_caching:
            self._core = self.frontend.make_core()
        return self._core

    # ---- API ----------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [len(token_ids), vocab]: next-token logits at every position (prefill path)."""
        ids = self.inputs.token_ids(token_ids, 0)
        try:
            validate_prompt(ids, self.config.vocab_size, self.max_model_len + 1)
        except RequestError as e:
            raise ValueError(str(e)) from None
        return self.frontend.steps.logits([int(t) for t in ids])

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: Union[bool, Callable] = True,
        *,
        _prompt_texts: Optional[list[str]] = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list (text, token ids, or vLLM's prompt dicts; numpy integer
        arrays of ids too). use_tqdm: a progress bar over the requests (or a tqdm-like class to make
        it). _prompt_texts: the RequestOutput.prompt of each (chat: the rendered conversation).
        Calls from several threads run one at a time."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sps = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            sps = list(sampling_params)
        else:
            raise TypeError(
                f"sampling_params must be a SamplingParams or a list of them, got "
                f"{type(sampling_params).__name__}"
                + (" (build one: SamplingParams(**d))" if isinstance(sampling_params, dict) else "")
            )
        if len(sps) != len(prompts):
            raise ValueError(f"got {len(sps)} SamplingParams for {len(prompts)} prompts")
        ids = [self.inputs.token_ids(p, i) for i, p in enumerate(prompts)]
        texts = _prompt_texts or [self.inputs.prompt_text(p) for p in prompts]
        with self._generate_lock():          # one core, its pages donated step to step: one caller
            return self._generate(texts, ids, sps, use_tqdm)

    _lock_guard = threading.Lock()

    def _generate_lock(self) -> threading.RLock:
        lock = self.__dict__.get("_generate_mutex")
        if lock is None:
            with LLM._lock_guard:
                lock = self.__dict__.setdefault("_generate_mutex", threading.RLock())
        return lock

    def _generate(self, texts, ids, sps, use_tqdm) -> list[RequestOutput]:
        core = self.engine_core()
        groups = []
        # every request is checked before any runs (kimi_jax.engine.validation): one bad value fails
        # the call up front, naming the request and the field
        for i, (text, t, sp) in enumerate(zip(texts, ids, sps)):
            try:
                groups.append(core.make_request(str(self._next_id + i), t, sp, prompt=text))
            except (RequestError, ValueError, TypeError) as e:
                raise ValueError(f"request {i}: {e}") from None
        self._next_id += len(groups)
        for g in groups:
            core.add(g)
        bar = _progress_bar(use_tqdm, sum(len(g) for g in groups))
        t0 = time.perf_counter()

        def finished(_r):
            rate = core.stats["generated_tokens"] / max(time.perf_counter() - t0, 1e-9)
            bar.update(1)
            bar.set_postfix(tok_s=f"{rate:.1f}", refresh=False)
        try:
            core.run(on_finish=finished if bar is not None else None)
        except BaseException:
            self._core = None       # its pages and queues are in an unknown state
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self.outputs.request_output(g) for g in groups]

    def get_tokenizer(self):
        """The tokenizer (vLLM's name; None for a model without one)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (vLLM's name)."""
        from kimi_jax.sampling_params import generation_defaults
        return SamplingParams(**generation_defaults(self.model_path))

    def render_chat(self, messages, *, add_generation_prompt: bool = True, tools=None,
                    chat_template: Optional[str] = None) -> str:
        """One conversation rendered with the checkpoint's own chat template (sandboxed Jinja)."""
        return self.inputs.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template=chat_template,
        )

    def encode_chat(self, messages, *, add_generation_prompt: bool = True, tools=None,
                    chat_template: Optional[str] = None) -> list[int]:
        """Prompt token ids of one conversation, as `chat` feeds them (`InputProcessor.encode_chat`:
        message text never becomes special tokens)."""
        return self.inputs.encode_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template=chat_template,
        )

    def chat(
        self,
        messages,
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        add_generation_prompt: bool = True,
        tools=None,
        chat_template: Optional[str] = None,
        use_tqdm: Union[bool, Callable] = True,
        tool_choice=None,
        response_format=None,
    ):
        """Generate from one conversation or a list (`encode_chat`); tools / tool_choice /
        response_format constrain the output unless sampling_params has structured_outputs, and
        with tools each output's calls are parsed into `content`, `tool_calls`, finish_reason."""
        from kimi_jax.engine.structured_openai import from_openai
        from kimi_jax.engine.structured_params import StructuredOutputError
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kw = dict(
            add_generation_prompt=add_generation_prompt, tools=tools, chat_template=chat_template
        )
        prompts = [self.encode_chat(c, **kw) for c in convs]
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
            from kimi_jax.text.tool_parser import calls_complete, parse_output, tool_finish_reason
            for ro in outs:
                for c in ro.outputs:
                    parsed = parse_output(c.token_ids, self.tokenizer)
                    c.content, c.tool_calls = parsed.content, parsed.tool_calls
                    c.finish_reason = tool_finish_reason(
                        c.finish_reason, calls_complete(parsed.tool_calls)
                    )
        return outs
