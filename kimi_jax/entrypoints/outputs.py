"""The output processor every front end shares: finished samples -> RequestOutput (vLLM's types)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

from kimi_jax.engine.requests import Request
from kimi_jax.engine.sampling import Logprob


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: Optional[str]
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, Logprob]]]
    finish_reason: Optional[str]            # "stop" | "length" | "tool_calls" (LLM.chat with tools)
    stop_reason: Union[int, str, None] = None
    # LLM.chat with tools: the parsed answer (text before Kimi's tool-call section), tool_calls
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


def latency_metrics(r: Request) -> dict:
    """A finished request's timing as the host saw it: arrival_time, first_token_time and
    finished_time (time.time()), time_to_first_token (seconds from arrival, queueing included) and
    time_per_output_token (mean seconds between its later tokens; None with fewer than two)."""
    n = len(r.output_ids)
    ttft = (r.first_token_time - r.arrival_time
            if r.first_token_time is not None and r.arrival_time is not None else None)
    tpot = ((r.finished_time - r.first_token_time) / (n - 1)
            if n > 1 and r.finished_time is not None and r.first_token_time is not None else None)
    return {"arrival_time": r.arrival_time, "first_token_time": r.first_token_time,
            "finished_time": r.finished_time, "time_to_first_token": ttft,
            "time_per_output_token": tpot}


class OutputProcessor:
    """RequestOutputs over a tokenizer (None: token ids only, no text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def request_output(self, samples: list[Request]) -> RequestOutput:
        """One prompt's RequestOutput from its finished samples: with best_of the n of highest
        cumulative logprob (best first), else all n in sample order."""
        r0, p = samples[0], samples[0].params
        chosen = list(samples)
        if p.num_samples > p.n:
            chosen = sorted(samples, key=lambda r: -r.cumulative_logprob)[:p.n]
        outputs = [self.completion(i, r) for i, r in enumerate(chosen)]
        prompt_lp = None
        if r0.prompt_logprobs is not None:
            prompt_lp = [None] + [self.decoded(d) for d in r0.prompt_logprobs[1:]]
        return RequestOutput(
            request_id=r0.group_id or r0.request_id,
            prompt=r0.prompt,
            prompt_token_ids=r0.prompt_ids,
            outputs=outputs,
            prompt_logprobs=prompt_lp,
            metrics={
                "num_preemptions": sum(r.num_preemptions for r in samples),
                "spec_drafted": sum(r.spec.drafted for r in samples),
                "spec_accepted": sum(r.spec.accepted for r in samples),
                "spec_verify_steps": sum(r.spec.verify_steps for r in samples),
                **latency_metrics(r0),
            },
            num_cached_tokens=max(r.num_cached_tokens for r in samples),
        )

    def completion(self, index: int, r: Request) -> CompletionOutput:
        """One finished sample as choice `index`."""
        text = None
        if self.tokenizer is not None:
            text = r.text if r.text is not None else self.tokenizer.decode(
                r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
        wants = r.params.logprobs is not None
        return CompletionOutput(index=index, text=text, token_ids=list(r.output_ids),
                                cumulative_logprob=r.cumulative_logprob if wants else None,
                                logprobs=[self.decoded(d) for d in r.logprobs] if wants else None,
                                finish_reason=r.finish_reason, stop_reason=r.stop_reason)

    def decoded(self, lp: dict) -> dict:
        """Logprob entries with decoded_token set (each token's text, special tokens included)."""
        if self.tokenizer is None:
            return lp
        return {
            t: dataclasses.replace(v, decoded_token=self.tokenizer.decode([t]))
            for t, v in lp.items()
        }
