"""The user-facing API (vLLM's names): LLM, SamplingParams, RequestOutput, CompletionOutput."""
from __future__ import annotations

import dataclasses
import logging
import os
import random
from typing import Optional, Sequence, Union

import jax.numpy as jnp
import numpy as np

import jax

from kimi_jax.config import PRESETS, ModelConfig, preset
from kimi_jax.engine import Engine, bucket
from kimi_jax.sampling import SamplingArrays, SamplingParams
from kimi_jax.sharding import Layout, check_fits, param_shardings

log = logging.getLogger(__name__)
Prompt = Union[str, Sequence[int]]
_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: Optional[str]
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str]            # "stop" | "length"
    stop_reason: Union[int, str, None] = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


def demo_model_path() -> Optional[str]:
    """The shipped demo checkpoint (package data), if installed."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "demo")
    try:
        import checkpoints
        here = os.path.join(os.path.dirname(checkpoints.__file__), "demo")
    except ImportError:
        pass
    return here if os.path.isfile(os.path.join(here, "config.json")) else None


class LLM:
    """An engine for one model. `model`: a checkpoint directory, a preset name (random weights), or
    None for the shipped demo model."""

    def __init__(self, model: Optional[str] = None, *, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, enable_expert_parallel: bool = False,
                 dtype: str = "bfloat16", max_model_len: Optional[int] = None, max_num_seqs: int = 256,
                 seed: int = 0, tokenizer: Optional[str] = None):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported (choose one of {sorted(_DTYPES)})")
        if tensor_parallel_size < 1 or data_parallel_size < 1:
            raise ValueError("tensor_parallel_size and data_parallel_size must be >= 1")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.dtype = _DTYPES[dtype]
        model = model if model is not None else demo_model_path()
        self.model_path = None
        if model is None:
            log.warning("no demo model installed; using the random 'tiny' preset")
            model = "tiny"
        self.layout = Layout(tensor_parallel_size, data_parallel_size, enable_expert_parallel)
        if os.path.isdir(model):
            self.model_path = model
            self.config = ModelConfig.from_pretrained(model)
        elif model in PRESETS:
            self.config = preset(model)
        else:
            raise ValueError(f"model={model!r} is neither a checkpoint directory nor a preset {PRESETS}")
        self.layout.check_divisible(self.config)
        net = self._build(seed)
        self.tokenizer = self._load_tokenizer(tokenizer or self.model_path)
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.max_num_seqs = max_num_seqs
        self.engine = Engine(net, self.config, self.layout)
        self._rng = random.Random(seed)
        self._next_id = 0

    def _build(self, seed: int):
        """Create or load the model with every parameter placed on its devices under the layout,
        after checking that the per-device bytes fit."""
        from flax import nnx
        from kimi_jax.model.transformer import Transformer
        cfg, layout, dtype = self.config, self.layout, self.dtype
        parallel = layout.moe_parallel()
        make = lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed), parallel=parallel)
        abstract = nnx.split(nnx.eval_shape(make))[1]
        check_fits(layout, abstract)
        shardings = param_shardings(layout, abstract)
        place = lambda path, a: jax.device_put(a, shardings[path])
        if self.model_path is not None:
            from checkpoints.loader import load_model
            return load_model(self.model_path, dtype=dtype, cfg=cfg, place=place, parallel=parallel)[1]
        net = make()
        graphdef, state = nnx.split(net)
        flat = {tuple(str(k) for k in p): v for p, v in nnx.to_flat_state(state)}
        for path, var in flat.items():
            var[...] = place(path, var[...])
        return nnx.merge(graphdef, state)

    @staticmethod
    def _load_tokenizer(path):
        if path is None:
            return None
        from kimi_jax.tokenizer import Tokenizer, TokenizerNotFound
        try:
            return Tokenizer.from_pretrained(path)
        except TokenizerNotFound:
            return None

    # ---- inputs -------------------------------------------------------------------------------
    def _token_ids(self, prompt: Prompt, i: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {i}: a text prompt needs a tokenizer, and the checkpoint "
                                 f"{self.model_path or '(preset)'} has no tiktoken.model; pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError(f"request {i}: empty prompt")
        V = self.config.vocab_size
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < V]
        if bad:
            raise ValueError(f"request {i}: token id {bad[0]!r} is outside the vocabulary [0, {V})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {i}: prompt of {len(ids)} tokens leaves no room under "
                             f"max_model_len={self.max_model_len}")
        return [int(t) for t in ids]

    def _stop_ids(self, sp: SamplingParams) -> set[int]:
        ids = set(sp.stop_token_ids or ())
        if not sp.ignore_eos:
            ids |= set(self.config.eos_token_id)
            if self.tokenizer is not None:
                ids |= set(self.tokenizer.stop_token_ids)
        return ids

    # ---- API ----------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [len(token_ids), vocab]: next-token logits at every position (prefill path)."""
        ids = self._token_ids(token_ids, 0)
        return self.engine.logits(ids)

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        sps = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
               else list(sampling_params))
        if len(sps) != len(prompts):
            raise ValueError(f"got {len(sps)} SamplingParams for {len(prompts)} prompts")
        for i, sp in enumerate(sps):
            try:
                sp.validate()
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        ids = [self._token_ids(p, i) for i, p in enumerate(prompts)]
        outs: list[RequestOutput] = []
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(prompts), desc="requests", unit="req")
        for s in range(0, len(prompts), self.max_num_seqs):
            sl = slice(s, s + self.max_num_seqs)
            outs += self._run_batch(prompts[sl], ids[sl], sps[sl])
            if bar is not None:
                bar.update(len(ids[sl]))
        if bar is not None:
            bar.close()
        return outs

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None, *,
             add_generation_prompt: bool = True, tools=None, chat_template: Optional[str] = None):
        """Render the checkpoint's own chat template (sandboxed) and generate; messages may be one
        conversation (a list of dicts) or a list of conversations."""
        from kimi_jax.chat_template import ChatTemplate
        if self.tokenizer is None:
            raise ValueError(f"chat needs a tokenizer; {self.model_path or 'this preset'} has none")
        tmpl = (ChatTemplate(chat_template) if chat_template is not None
                else ChatTemplate.from_pretrained(self.model_path))
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            text = tmpl.render(conv, add_generation_prompt=add_generation_prompt, tools=tools)
            prompts.append(self.tokenizer.encode(text, allow_special=True))
        return self.generate(prompts, sampling_params)

    # ---- the generation loop ------------------------------------------------------------------
    def _run_batch(self, prompts, ids, sps) -> list[RequestOutput]:
        B = len(ids)
        B_pad = self.engine.batch_size(B)
        lens = np.array([len(p) for p in ids] + [1] * (B_pad - B), np.int64)
        max_new = np.array([min(sp.max_tokens or self.max_model_len, self.max_model_len - len(p))
                            for sp, p in zip(sps, ids)] + [1] * (B_pad - B), np.int64)
        cache_len = bucket(int((lens + max_new).max()))
        seeds = [sp.seed if sp.seed is not None else self._rng.getrandbits(31) for sp in sps]
        rows_sp = list(sps) + [SamplingParams(temperature=0.0)] * (B_pad - B)
        arrays = SamplingArrays.build(rows_sp, seeds + [0] * (B_pad - B))
        n_lp = max((sp.logprobs for sp in sps if sp.logprobs is not None), default=None)
        stop_ids = [self._stop_ids(sp) for sp in sps]
        gen: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[dict]] = [[] for _ in range(B)]
        cum = [0.0] * B
        finish: list[Optional[str]] = [None] * B + ["pad"] * (B_pad - B)
        stop_reason: list = [None] * B
        texts: list[Optional[str]] = [None] * B
        cache, out = self.engine.prefill([*ids, *[[0]] * (B_pad - B)], arrays, cache_len, n_lp)
        step = 0
        while True:
            for b in range(B):
                if finish[b] is not None:
                    continue
                t = int(out.tokens[b])
                gen[b].append(t)
                if n_lp is not None:
                    lp = {int(i): float(v) for i, v in
                          zip(out.top_ids[b][:sps[b].logprobs or 0], out.top_vals[b][:sps[b].logprobs or 0])}
                    lp[t] = float(out.logprob[b])
                    cum[b] += float(out.logprob[b])
                    if sps[b].logprobs is not None:
                        lps[b].append(lp)
                if t in stop_ids[b]:
                    finish[b], stop_reason[b] = "stop", t
                elif sps[b].stop_strings and self.tokenizer is not None and self._hit_stop(b, gen, sps, texts):
                    finish[b], stop_reason[b] = "stop", texts[b][1]
                elif len(gen[b]) >= max_new[b]:
                    finish[b] = "length"
            if all(f is not None for f in finish):
                break
            step += 1
            last = np.array([g[-1] if g else 0 for g in gen] + [0] * (B_pad - B), np.int32)
            n_gen = np.array([len(g) for g in gen] + [1] * (B_pad - B), np.int64)
            cache, out = self.engine.decode(cache, last, lens + n_gen - 1, arrays, n_gen, n_lp)
        results = []
        for b in range(B):
            sp = sps[b]
            text = None
            if self.tokenizer is not None:
                text = texts[b][0] if texts[b] is not None else self.tokenizer.decode(gen[b], skip_special_tokens=True)
            self._next_id += 1
            results.append(RequestOutput(
                request_id=str(self._next_id - 1), prompt=prompts[b] if isinstance(prompts[b], str) else None,
                prompt_token_ids=ids[b],
                outputs=[CompletionOutput(index=0, text=text, token_ids=gen[b],
                                          cumulative_logprob=cum[b] if n_lp is not None else None,
                                          logprobs=lps[b] if sp.logprobs is not None else None,
                                          finish_reason=finish[b], stop_reason=stop_reason[b])]))
        return results

    def _hit_stop(self, b, gen, sps, texts) -> bool:
        """Check the decoded text for a stop string; on a hit, store (truncated text, stop string)."""
        text = self.tokenizer.decode(gen[b], skip_special_tokens=True)
        best = None
        for s in sps[b].stop_strings:
            k = text.find(s)
            if k >= 0 and (best is None or k < best[0]):
                best = (k, s)
        if best is None:
            return False
        k, s = best
        texts[b] = (text[: k + len(s)] if sps[b].include_stop_str_in_output else text[:k], s)
        return True
