"""The jitted model steps the runner drives: pure functions of the model's state with the cache
donated (`_step` over one StepBatch, `_all_logits`); the ExecPlan is a static argument of each.
Their loose-argument forms for the profiler and benchmarks are in kimi_jax.tools.step_adapters."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax import ops
from kimi_jax.config import ModelConfig
from kimi_jax.model import layer_weights
from kimi_jax.model.transformer import Transformer
from kimi_jax.engine import penalties
from kimi_jax.engine.shapes import bucket  # noqa: F401 (the steps' callers take it from here)
from kimi_jax.engine.sampling import SamplingArrays, sample, top_logprobs, verify_drafts
from kimi_jax.engine.token_mask import apply_token_bitmask


# Pages one call of the pool's page copy (`ModelSteps.copy_pages`, n > 1 forks) moves.
COPY_PAGES = 64


@dataclasses.dataclass
class StepOutput:
    tokens: np.ndarray                      # [B] int32
    logprob: Optional[np.ndarray] = None    # [B] chosen-token logprob
    top_ids: Optional[np.ndarray] = None    # [B, n]
    top_vals: Optional[np.ndarray] = None   # [B, n]
    rank: Optional[np.ndarray] = None       # [B] chosen token's rank (1: the most likely)
    # prompt logprobs: each position's next prompt token's logprob and rank, and its top-n
    prompt_logprob: Optional[np.ndarray] = None    # [B, T]
    prompt_rank: Optional[np.ndarray] = None       # [B, T]
    prompt_top_ids: Optional[np.ndarray] = None    # [B, T, n]
    prompt_top_vals: Optional[np.ndarray] = None   # [B, T, n]
    # a ragged step with speculation: each row's drafts accepted (its token follows them)
    accepted: Optional[np.ndarray] = None   # [B]


class Occurrences:
    """An occurrence pool (kimi_jax.engine.penalties) that steps replace with their updated copy;
    pad_row: the row padding rows use."""

    def __init__(self, pool, pad_row: int):
        self.pool, self.pad_row = pool, pad_row


# the updated pool's key among a step's outputs (taken off by the ModelSteps)
_OCC = "occurrences"


class _Structure:
    """A state's tree structure, compared by identity (a jit cache key checks it at every call)."""

    def __init__(self, treedef):
        self.treedef = treedef


@jax.tree_util.register_pytree_node_class
class FlatWeights:
    """The model's state as one flat tuple of arrays, the steps' argument: flattening an nnx.State
    costs the host about 0.4 us a Variable at each call (BENCHMARKS.md, "The host's enqueue"), a
    tuple next to nothing."""

    def __init__(self, leaves, structure: _Structure):
        self.leaves, self.structure = tuple(leaves), structure

    @classmethod
    def of(cls, state) -> "FlatWeights":
        leaves, treedef = jax.tree.flatten(state)
        return cls(leaves, _Structure(treedef))

    def tree_flatten(self):
        return self.leaves, self.structure

    @classmethod
    def tree_unflatten(cls, structure, leaves):
        return cls(leaves, structure)


def _merge(graphdef, state):
    if isinstance(state, FlatWeights):
        state = jax.tree.unflatten(state.structure.treedef, state.leaves)
    return nnx.merge(graphdef, state)


def _decodable(logits, vocab_limit: Optional[int]):
    """logits with the ids the tokenizer cannot decode (>= vocab_limit: the model's padded
    vocabulary rows) at -inf: no sampler picks one, and logprobs are over the ids that can be
    returned (None: every id)."""
    if vocab_limit is None:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)


def _sample_out(logits_BV, sp, step_B, n_logprobs, shard, mode=None, occ=None, mask_Bw=None,
                invariant=False, vocab_limit=None):
    # pinned vocab-split first, so each device multiplies its own lm_head rows (BENCHMARKS.md,
    # 'ModelSteps decode step': otherwise the partitioner all-gathers the whole lm_head weight)
    logits_BV = _constrain(logits_BV, shard.get("logits2"))
    # one all-gather of the (vocab-split) logits; sorting / cumsum over a sharded vocab would
    # compile to sequential loops and many small collectives
    logits_BV = _decodable(_constrain(logits_BV, shard.get("replicated")), vocab_limit)
    adjusted = logits_BV
    # logit_bias, bans, min_tokens, penalties (static: the pytree's shape)
    if sp.adjust is not None:
        occ_BV = None if occ is None else occ[sp.adjust.occ_row]
        adjusted = penalties.adjust_logits(logits_BV, sp.adjust, step_B, occ_BV)
    # structured outputs: tokens whose bit is clear in the row's packed mask [B, ceil(V / 32)]
    # cannot be sampled (applied after the adjustments, so no bias can lift a masked token)
    if mask_Bw is not None:
        adjusted = apply_token_bitmask(adjusted, mask_Bw)
    tok = sample(adjusted, sp, step_B, mode)
    out = {"tokens": tok}
    if n_logprobs is not None:  # of the raw logits (vLLM's default raw logprobs)
        out.update(zip(("logprob", "rank", "top_ids", "top_vals"),
                       top_logprobs(logits_BV, tok, n_logprobs, invariant=invariant)))
    # replicated, so every process (multi-host) can read the tokens
    out = {k: _constrain(o, shard.get("replicated")) for k, o in out.items()}
    if occ is not None:
        out[_OCC] = _constrain(
            penalties.count_sampled(occ, sp.adjust, tok), shard.get("replicated")
        )
    return out


def _constrain(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step's inputs (host numpy or device arrays; engine.runner lays them out from a StepPlan).
    tokens: [B, T], or [B] for a decode step (the previous step's device tokens may be fed as they
    are). The optional fields are None when no row needs them (the pytree's structure: its own
    program)."""
    tokens: jax.Array
    positions_BT: jax.Array               # -1: padding
    block_table_BP: jax.Array             # page ids local to the row's data-parallel rank
    last_B: jax.Array                     # the column each row samples from
    step_B: jax.Array                     # tokens each row has sampled so far
    sp: SamplingArrays
    # prompt logprobs: each position's next prompt token (< 0: none)
    targets_BT: Optional[jax.Array] = None
    # structured outputs' packed token bitmask [B, ceil(V / 32)]
    mask_Bw: Optional[jax.Array] = None
    n_draft_B: Optional[jax.Array] = None     # verification: drafts per row (tokens[:, 1:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleInputs:
    """A split decode step's sampling inputs, laid out once the step before is booked; a ragged
    step's with drafts to verify: drafts_BY [B, Y] (Y = spec_width - 1), n_draft_B [B] valid."""
    sp: SamplingArrays
    step_B: jax.Array
    mask_Bw: Optional[jax.Array] = None
    drafts_BY: Optional[jax.Array] = None
    n_draft_B: Optional[jax.Array] = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    """A ragged step's forward inputs: T tokens of any mix of rows on one flat axis and their B
    rows (kimi_jax.ops.ragged: the data-parallel ranks' blocks in turn, indices local to each
    rank). Its rows are sampled by the sampling half (`SampleInputs` over the B rows).
    slots_T: the pool slot each token's latents are written to, page * p + offset with the page
    local to the rank (padding: X / ranks * p or more, dropped). sample_B: the token whose logits
    row b samples (an index into its rank's block; with speculation S of them a row, [B * S] row
    after row, `_sample_half`'s spec_width). targets_T (prompt logprobs): each token's next
    prompt token (< 0: none); None when no row asks. from_prev_T (overlap scheduling): the row of
    the step in flight whose sampled token token t is, an index into its rank's block of
    prev_tokens_B (< 0: tokens_T's); prev_tokens_B: that step's sampled tokens as the sampling
    half returns them to a chain (`_sample_half`'s rows: each rank's block of the widest step's
    B / ranks rows), zeros when no token is fed from it."""
    tokens_T: jax.Array
    positions_T: jax.Array                # -1: padding
    slots_T: jax.Array
    rows: ops.RaggedRows
    sample_B: jax.Array
    targets_T: Optional[jax.Array] = None
    from_prev_T: Optional[jax.Array] = None
    prev_tokens_B: Optional[jax.Array] = None


STEP_KINDS = ("prefill", "decode", "verify")


def _step(
    graphdef,
    shard,
    state,
    pages,
    batch: StepBatch,
    occ=None,
    prev=None,
    *,
    kind: str,
    n_logprobs=None,
    n_prompt_logprobs=None,
    fresh: bool = False,
    sample_mode=None,
    plan: ops.ExecPlan,
    vocab_limit: Optional[int] = None,
):
    """One continuous-batching step over the paged cache (kind static): 'decode' (T = 1) and
    'verify' (row b feeds [last token, drafts...]) run absorbed MLA, 'prefill' expanded MLA
    (`fresh`: no row has cached tokens, attention reads only the new tokens). Samples from each
    row's token at last_B (verify: returns (accepted [B], next [B])). occ: the occurrence pool when
    some row uses penalties. With n_prompt_logprobs the logits of every position score targets_BT
    and give their top-n. prev: unread, donated: the outputs (but the pool) take its buffers (the
    runner's fixed buffers)."""
    model = _merge(graphdef, state)
    tokens_BT = batch.tokens[:, None] if batch.tokens.ndim == 1 else batch.tokens
    tokens_BT = _constrain(tokens_BT, shard.get("batch2"))
    h_BTD, pages = model.hidden_states(
        tokens_BT,
        batch.positions_BT,
        pages,
        absorbed=kind != "prefill",
        block_table_BP=batch.block_table_BP,
        fresh=fresh,
        plan=plan,
    )
    pages = {k: _constrain(v, shard.get("pages")) for k, v in pages.items()}
    B = tokens_BT.shape[0]
    if kind == "verify":
        logits_BTV = _constrain(
            _constrain(model.logits(h_BTD, plan), shard.get("logits3")), shard.get("replicated")
        )
        n_acc, nxt = verify_drafts(
            _decodable(logits_BTV, vocab_limit), tokens_BT[:, 1:], batch.n_draft_B, batch.sp,
            batch.step_B
        )
        return pages, tuple(_constrain(o, shard.get("replicated")) for o in (n_acc, nxt))
    sample_args = (batch.sp, batch.step_B, n_logprobs, shard, sample_mode, occ, batch.mask_Bw,
                   plan.batch_invariant, vocab_limit)
    if n_prompt_logprobs is None:
        logits_BV = model.logits(h_BTD[jnp.arange(B), batch.last_B][:, None], plan)[:, 0]
        return pages, _sample_out(logits_BV, *sample_args)
    logits_BTV = _constrain(
        _constrain(model.logits(h_BTD, plan), shard.get("logits3")), shard.get("replicated")
    )
    out = _sample_out(logits_BTV[jnp.arange(B), batch.last_B], *sample_args)
    prompt = top_logprobs(_decodable(logits_BTV, vocab_limit), jnp.maximum(batch.targets_BT, 0),
                          n_prompt_logprobs, invariant=plan.batch_invariant)
    out.update(zip(("prompt_logprob", "prompt_rank", "prompt_top_ids", "prompt_top_vals"), prompt))
    return pages, out


def _forward(graphdef, shard, state, pages, batch: StepBatch, prev=None, *, plan: ops.ExecPlan):
    """A decode step's forward half (absorbed MLA, T = 1): the pool updated and each row's
    next-token logits [B, V], vocab-split; `_sample_half` samples them once the host has filled the
    masks."""
    model = _merge(graphdef, state)
    tokens_BT = _constrain(batch.tokens[:, None], shard.get("batch2"))
    h_BTD, pages = model.hidden_states(tokens_BT, batch.positions_BT, pages, absorbed=True,
                                       block_table_BP=batch.block_table_BP, plan=plan)
    pages = {k: _constrain(v, shard.get("pages")) for k, v in pages.items()}
    return pages, _constrain(model.logits(h_BTD, plan)[:, 0], shard.get("logits2"))


def _ragged_forward(graphdef, shard, state, pages, batch: RaggedBatch, prev=None, *,
                    plan: ops.ExecPlan, max_pages: int, n_prompt_logprobs=None, ranks: int = 1,
                    vocab_limit=None):
    """A ragged step's forward half: the T tokens of any mix of rows (RaggedBatch) in one pass of
    absorbed MLA (`Transformer.ragged_hidden_states`, the token axis as [Z, T / Z], Z = ranks) ->
    (the pool with their latents written, each row's logits [B, V] at its sample_B token ([B * S, V]
    with speculation's S a row),
    vocab-split as `_forward`'s); `_sample_half` samples them. With n_prompt_logprobs the second
    output is (those logits, {prompt_logprob, prompt_rank [T], prompt_top_ids, prompt_top_vals
    [T, n]} of every token's logits against targets_T, replicated). max_pages (static): the most
    pages a row holds. ranks: the data-parallel size (T, B and X' of pages_X multiples of it).
    prev: unread, donated (the runner's fixed buffers). With from_prev_T a token marked so is the
    step in flight's sampled token (prev_tokens_B, each rank's block read by that rank)."""
    T, B, X = (batch.tokens_T.shape[0], batch.sample_B.shape[0], batch.rows.pages_X.shape[0])
    for name, n in (("tokens_T", T), ("sample_B", B), ("rows.pages_X", X)):
        if n % ranks:
            raise ValueError(f"RaggedBatch.{name}: {n} entries, not a multiple of the "
                             f"data-parallel size {ranks}")
    model = _merge(graphdef, state)
    flat = lambda a: _constrain(a, shard.get("batch1"))                        # noqa: E731
    blocks = lambda a: _constrain(flat(a).reshape(ranks, -1), shard.get("batch2"))  # noqa: E731
    tokens_ZT, positions_ZT, slots_ZT, sample_ZB = (
        blocks(a) for a in (batch.tokens_T, batch.positions_T, batch.slots_T, batch.sample_B))
    if batch.from_prev_T is not None:
        # tokens sampled by the step in flight, each rank's from its own block (no collective)
        from_ZT, prev_ZB = blocks(batch.from_prev_T), blocks(batch.prev_tokens_B)
        fed_ZT = jnp.take_along_axis(prev_ZB, jnp.maximum(from_ZT, 0), axis=1, mode="clip")
        tokens_ZT = jnp.where(from_ZT >= 0, fed_ZT, tokens_ZT)
    h_ZTD, pages = model.ragged_hidden_states(
        tokens_ZT, positions_ZT, pages, jax.tree.map(flat, batch.rows), slots_ZT,
        max_pages=max_pages, plan=plan)
    pages = {k: _constrain(v, shard.get("pages")) for k, v in pages.items()}
    # each rank's block of Z (ranks) x B / Z rows: the hidden states of the tokens they sample
    if n_prompt_logprobs is None:
        h_ZBD = jnp.take_along_axis(h_ZTD, sample_ZB[..., None], axis=1, mode="clip")
        logits_BV = model.logits(h_ZBD, plan).reshape(B, -1)
        return pages, _constrain(logits_BV, shard.get("logits2"))
    logits_ZTV = _constrain(model.logits(h_ZTD, plan), shard.get("logits3"))
    logits_BV = jnp.take_along_axis(logits_ZTV, sample_ZB[..., None], axis=1, mode="clip")
    logits_BV = _constrain(logits_BV.reshape(B, -1), shard.get("logits2"))
    logits_TV = _constrain(logits_ZTV, shard.get("replicated")).reshape(T, -1)
    prompt = top_logprobs(_decodable(logits_TV, vocab_limit), jnp.maximum(batch.targets_T, 0),
                          n_prompt_logprobs, invariant=plan.batch_invariant)
    names = ("prompt_logprob", "prompt_rank", "prompt_top_ids", "prompt_top_vals")
    return pages, (logits_BV, {k: _constrain(v, shard.get("replicated"))
                               for k, v in zip(names, prompt)})


def _sample_half(shard, logits_BV, inputs: SampleInputs, occ=None, prev=None, *, n_logprobs=None,
                 sample_mode=None, rows=None, ranks: int = 1, invariant: bool = False,
                 vocab_limit=None, spec_width: int = 1):
    """A split decode step's sampling half: `_step`'s sampler over the forward half's logits. rows
    (a ragged step's, static): the tokens [rows] with each of the ranks' blocks of B / ranks
    padded to rows / ranks (zeros after), the one shape a chained ragged forward takes.
    spec_width S (static, a ragged step of an engine with speculation): the logits [B * S, V],
    S a row (its last token, then each draft); with inputs.drafts_BY the row's drafts are verified
    (`verify_drafts`: 'accepted' [B] beside its next token), else its first is sampled."""
    if spec_width > 1:
        logits_BSV = logits_BV.reshape(-1, spec_width, logits_BV.shape[-1])
        if inputs.drafts_BY is not None:
            n_acc, nxt = verify_drafts(_decodable(logits_BSV, vocab_limit), inputs.drafts_BY,
                                       inputs.n_draft_B, inputs.sp, inputs.step_B,
                                       greedy=sample_mode == "greedy")
            out = {"tokens": _constrain(nxt, shard.get("replicated")),
                   "accepted": _constrain(n_acc, shard.get("replicated"))}
            return _pad_rows(shard, out, rows, ranks)
        logits_BV = logits_BSV[:, 0]
    out = _sample_out(logits_BV, inputs.sp, inputs.step_B, n_logprobs, shard, sample_mode, occ,
                      inputs.mask_Bw, invariant, vocab_limit)
    return _pad_rows(shard, out, rows, ranks)


def _pad_rows(shard, out: dict, rows, ranks: int) -> dict:
    """`_sample_half`'s tokens [B] padded to [rows] (each rank's block to rows / ranks)."""
    B = out["tokens"].shape[0]
    if rows is not None and rows != B:
        tok_ZB = out["tokens"].reshape(ranks, B // ranks)
        tok_ZB = jnp.pad(tok_ZB, ((0, 0), (0, (rows - B) // ranks)))
        out["tokens"] = _constrain(tok_ZB.reshape(rows), shard.get("replicated"))
    return out


def _all_logits(graphdef, shard, state, tokens_BT, *, plan: ops.ExecPlan):
    model = _merge(graphdef, state)
    tokens_BT = _constrain(tokens_BT, shard.get("batch2"))
    B, T = tokens_BT.shape
    logits, _ = model(
        tokens_BT,
        jnp.broadcast_to(jnp.arange(T), (B, T)),
        None,
        absorbed=False,
        fresh=True,
        plan=plan,
    )
    return _constrain(_constrain(logits, shard.get("logits3")), shard.get("replicated"))


class ModelSteps:
    """layout: a kimi_jax.parallel.sharding.Layout; the batch is split over its data-parallel axis.
    plan: the kimi_jax.ops.ExecPlan every step runs (default `ExecPlan.for_backend()`); a static
    argument of each jitted step, so assigning another plan to `engine.exec_plan` compiles steps for
    it. vocab_limit: the ids a tokenizer decodes (< vocab_limit) where the model's vocabulary is
    padded past them: the samplers never pick the others (None: every id)."""

    def __init__(self, model: Transformer, cfg: ModelConfig, layout=None,
                 plan: Optional[ops.ExecPlan] = None, vocab_limit: Optional[int] = None):
        if plan is not None and not isinstance(plan, ops.ExecPlan):
            raise TypeError(
                f"ModelSteps: plan must be a kimi_jax.ops.ExecPlan, got {type(plan).__name__}"
            )
        self.exec_plan = ops.default_plan(plan)
        self.cfg = cfg
        self.vocab_limit = (None if vocab_limit is None or vocab_limit >= cfg.vocab_size
                            else int(vocab_limit))
        self.graphdef, self.state = nnx.split(model)
        if self.exec_plan.layer_weights == "per_layer":
            layer_weights.split_layers(self.state, cfg, pack=self.exec_plan.pack_vectors)
        self.weights = FlatWeights.of(self.state)     # what the steps take (the same arrays)
        self.cache_dtype = model.dtype
        self.dp = 1 if layout is None else layout.data_parallel_size
        # (batch, page-table bucket) -> (decode, verification pass s), measured once (speculation)
        self.pass_costs: dict[tuple[int, int], tuple[float, float]] = {}
        shard = {}
        if layout is not None and layout.world > 1:
            from jax.sharding import PartitionSpec as P
            b = layout.axis_rule("batch")
            v = layout.axis_rule("vocab")
            shard = {
                "batch1": layout.sharding(P(b)),
                "batch2": layout.sharding(P(b, None)),
                "cache": layout.sharding(P(None, b, None, None)),
                "replicated": layout.sharding(P()),
                # the paged pool [L, num_pages, page, C]: pages split like the rows (each dp rank
                # holds its own rows' pages; the scheduler gives rows page ids local to their rank)
                "pages": layout.sharding(P(None, b if self.dp > 1 else None, None, None)),
                "logits2": layout.sharding(P(b, v)),
                "logits3": layout.sharding(P(b, None, v)),
            }
        self._shard = shard
        self._logits = jax.jit(
            functools.partial(_all_logits, self.graphdef, shard), static_argnames=("plan",)
        )
        # the sharding of a decode step's output tokens (replicated), which host-fed tokens take:
        # one compiled decode program serves both feeds from the first step on (jit keys its cache
        # on the inputs' shardings, and host arrays are uncommitted)
        self.token_sharding = (layout.sharding(jax.sharding.PartitionSpec()) if layout is not None
                                else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        self.logits_sharding = shard.get("logits2", self.token_sharding)   # a split step's logits
        # the one step the runner (kimi_jax.engine.runner) drives: a StepBatch in, program by kind
        self.step_jit = jax.jit(
            functools.partial(_step, self.graphdef, shard, vocab_limit=self.vocab_limit),
            static_argnames=(
                "kind",
                "n_logprobs",
                "n_prompt_logprobs",
                "fresh",
                "sample_mode",
                "plan",
            ),
            donate_argnames=("pages", "occ", "prev"),
            keep_unused=True,
        )
        # a decode step split in two (constrained rows under overlap scheduling): the forward half
        # is dispatched before the host has read the previous token, the sampling half after
        self.forward_jit = jax.jit(
            functools.partial(_forward, self.graphdef, shard),
            static_argnames=("plan",),
            donate_argnames=("pages", "prev"),
            keep_unused=True,
        )
        # the pool's placement: `init_pages`'s (on one device, where that pool is uncommitted, the
        # inputs' one: the runner commits the pool so before a ragged forward first takes it)
        self.pool_sharding = shard.get("pages", self.token_sharding)
        # one pass over a flat token axis of any mix of rows (RaggedBatch); sample_jit samples it;
        # the pool comes back placed as it went in (one program from the first call on)
        self.ragged_jit = jax.jit(
            functools.partial(_ragged_forward, self.graphdef, shard, ranks=self.dp,
                              vocab_limit=self.vocab_limit),
            static_argnames=("plan", "max_pages", "n_prompt_logprobs"),
            donate_argnames=("pages", "prev"),
            out_shardings=(self.pool_sharding, None),
            keep_unused=True,
        )
        self.sample_jit = jax.jit(
            functools.partial(_sample_half, shard, ranks=self.dp,
                              invariant=self.exec_plan.batch_invariant,
                              vocab_limit=self.vocab_limit),
            static_argnames=("n_logprobs", "sample_mode", "rows", "spec_width"),
            donate_argnames=("occ", "prev"),
            keep_unused=True,
        )
        self.put_batch = jax.jit(lambda io, new: jax.tree.map(jnp.copy, new), donate_argnums=0,
                                 out_shardings=self.token_sharding, keep_unused=True)
        self.snapshot = jax.jit(lambda out: jax.tree.map(jnp.copy, out))
        self._set_occ_row = jax.jit(lambda pool, i, row: pool.at[i].set(row), donate_argnums=0,
                                    out_shardings=self.token_sharding)
        self._copy_pages = jax.jit(
            lambda pages, src, dst: {k: v.at[:, dst].set(v[:, src]) for k, v in pages.items()},
            donate_argnums=0,
        )

    def init_pages(self, num_pages: int, page_size: int, dtype=None) -> dict:
        """A zeroed paged pool {kind: [L, X, p, C]} placed as the steps keep it:
        under data parallelism its pages are split over the dp ranks in `dp` equal contiguous
        partitions (num_pages a multiple of dp), rank k holding pages [k * num_pages / dp, ...) and
        the rows of its batch block; block tables hold ids local to the row's rank. Created on its
        devices (never whole on one)."""
        from kimi_jax.model.transformer import init_pages
        if num_pages % self.dp:
            raise ValueError(
                f"num_pages={num_pages} is not a multiple of the data-parallel size {self.dp}"
            )
        make = functools.partial(
            init_pages, self.cfg, num_pages, page_size, dtype or self.cache_dtype
        )
        sharding = self._shard.get("pages")
        if sharding is None:
            return make()
        return jax.jit(make, out_shardings=sharding)()

    def batch_size(self, n: int) -> int:
        """Padded batch: a power of two, and a multiple of the data-parallel size."""
        b = bucket(n, 1)
        return -(-b // self.dp) * self.dp

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        T = len(token_ids)
        padded = np.zeros((self.batch_size(1), bucket(T)), np.int32)
        padded[0, :T] = token_ids
        return np.asarray(
            self._logits(self.weights, jnp.asarray(padded), plan=self.exec_plan)[0, :T], np.float32
        )

    def new_occurrences(self, num_rows: int) -> Occurrences:
        """A zeroed occurrence pool for num_rows penalised requests (plus the padding row)."""
        make = lambda: jnp.zeros((num_rows + 1, self.cfg.vocab_size), jnp.int32)  # noqa: E731
        # committed as the steps return it (replicated): its first step runs the program of the rest
        return Occurrences(jax.jit(make, out_shardings=self.token_sharding)(), num_rows)

    def set_occurrences(self, occ: Occurrences, row: int, row_V: np.ndarray) -> None:
        """Write one pool row (penalties.occurrence_row), after every step dispatched before."""
        occ.pool = self._set_occ_row(occ.pool, np.int32(row), np.asarray(row_V, np.int32))

    def copy_pages(self, pages, src: Sequence[int], dst: Sequence[int], rank: int = 0):
        """The pool with pages dst holding copies of pages src (ids local to DP rank `rank`),
        COPY_PAGES at a time: one program for any number of pages (precompiled with the set)."""
        per = next(iter(pages.values())).shape[1] // self.dp
        for i in range(0, len(src), COPY_PAGES):
            s, d = list(src[i:i + COPY_PAGES]), list(dst[i:i + COPY_PAGES])
            s += [s[-1]] * (COPY_PAGES - len(s))            # padding repeats the last copy
            d += [d[-1]] * (COPY_PAGES - len(d))
            pages = self._copy_pages(pages, _i32(s) + rank * per, _i32(d) + rank * per)
        return pages

def is_fresh(positions_BT) -> bool:
    """Host check (static for the step): every row's real tokens sit at positions 0, 1, ... from its
    first column, padding (< 0) only after them; no row has cached tokens before them."""
    pos = np.asarray(positions_BT)
    valid = pos >= 0
    return bool(np.all(np.where(valid, pos == np.arange(pos.shape[1]), True))
                and np.all(valid[:, 1:] <= valid[:, :-1]))


def _i32(a) -> np.ndarray:
    """Step inputs stay numpy: jit takes them through its C++ fast path."""
    return np.asarray(a, np.int32)
