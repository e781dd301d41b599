"""ExecPlan: every execution choice of the model's ops in one frozen, hashable (static) value."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

IMPLS = ("xla", "pallas")
MLA_DECODE_KERNELS = ("auto", "triton", "mgpu")
MLA_SCHEDULES = ("rows", "balanced")
LAYER_LOOPS = ("scan", "unroll")
LAYER_WEIGHTS = ("stacked", "per_layer")
PREFILL_ATTENTION_CHOICES = ("einsum", "cudnn", "xla")
CHUNK_ATTENTION_CHOICES = PREFILL_ATTENTION_CHOICES + ("cudnn_split", "xla_split")
ROUTER_KERNELS = ("auto", "xla", "pallas", "pallas_gemv")
# router 'auto': where it won on the H200 (pallas_kernels/NOTES.md "Small ops")
ROUTER_AUTO_MAX_TOKEN_EXPERTS = 512
NORM_KERNELS = ("xla", "pallas")
ROUTINGS = ("model", "uniform")


@dataclasses.dataclass(frozen=True)
class ExecPlan:
    """How the ops run; the defaults are the portable plan, `for_backend()` this machine's.
    mla_schedule None: the engine picks per step; layer_weights 'per_layer' (under 'unroll'): each
    layer's non-expert weights as arrays of their own (BENCHMARKS.md "Compile time and per-layer
    weights"). router_kernel 'pallas': XLA's gemv, then one launch for the top-k; 'pallas_gemv': all
    in one launch (pallas_kernels/router); 'auto': 'pallas' for small steps
    (ROUTER_AUTO_MAX_TOKEN_EXPERTS) under impl 'pallas', else 'xla'. absorbed_chunk_tokens: chunk
    prefills of at most this many tokens a row run absorbed (Pallas; 0: never). routing 'uniform'
    (benchmarks of random weights, whose routing concentrates): experts by `fused.comb_ids`.
    mla_fuse_new: the Triton MLA kernel takes the new tokens in ('rows' schedule;
    `MlaDecodeConfig.fuse_new`). pack_vectors (with 'per_layer'): each layer's norm scales and
    router bias as one array (`layer_weights.pack_vectors`: fewer arguments for the host).
    batch_invariant: a row's result does not depend on the other rows of its step (no dot of one
    row, 2-d projections, sums as dot rows: docs/ARCHITECTURE.md "Batch invariance");
    invariant_rows: under it, the rows of a product with a weight run this many at a time (a tile
    reads the weight once; XLA:CPU's dots sum a row by the row count past 32-64 rows, so 16 there,
    64 on a GPU, where a product of one shape is one kernel)."""
    impl: str = "xla"
    mla_decode_kernel: str = "auto"
    hopper: bool = False
    mla_schedule: Optional[str] = None
    prefill_attention: str = "auto"
    chunk_attention: str = "auto"
    layer_loop: str = "scan"
    layer_weights: str = "stacked"
    combine_xla_max_macs: int = 1 << 27
    one_new_token_elementwise: bool = True
    router_kernel: str = "auto"
    norm_kernel: str = "xla"
    absorbed_chunk_tokens: int = 0
    routing: str = "model"
    mla_fuse_new: bool = False
    pack_vectors: bool = False
    batch_invariant: bool = False
    invariant_rows: int = 16

    def __post_init__(self):
        for name, choices in (("impl", IMPLS), ("mla_decode_kernel", MLA_DECODE_KERNELS),
                              ("mla_schedule", (None,) + MLA_SCHEDULES),
                              ("prefill_attention", ("auto",) + PREFILL_ATTENTION_CHOICES),
                              ("chunk_attention", ("auto",) + CHUNK_ATTENTION_CHOICES),
                              ("layer_loop", LAYER_LOOPS), ("layer_weights", LAYER_WEIGHTS),
                              ("router_kernel", ROUTER_KERNELS), ("norm_kernel", NORM_KERNELS),
                              ("routing", ROUTINGS)):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"ExecPlan.{name}={value!r}; expected one of {choices}")
        if self.layer_weights == "per_layer" and self.layer_loop != "unroll":
            raise ValueError("ExecPlan.layer_weights='per_layer' needs layer_loop='unroll'")
        if self.pack_vectors and self.layer_weights != "per_layer":
            raise ValueError("ExecPlan.pack_vectors needs layer_weights='per_layer'")
        for name in ("hopper", "one_new_token_elementwise", "mla_fuse_new", "pack_vectors",
                     "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ExecPlan.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("combine_xla_max_macs", "absorbed_chunk_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"ExecPlan.{name}={getattr(self, name)!r} must be an int >= 0")
        if (not isinstance(self.invariant_rows, int) or isinstance(self.invariant_rows, bool)
                or self.invariant_rows < 1):
            raise ValueError(f"ExecPlan.invariant_rows={self.invariant_rows!r} must be an int >= 1")

    @property
    def pallas(self) -> bool:
        return self.impl == "pallas"

    @property
    def row_tile(self) -> int:
        """Rows a product with a weight runs at a time (0: as one product, not batch_invariant)."""
        return self.invariant_rows if self.batch_invariant else 0

    def router_kernel_for(self, tokens: int, experts: int) -> str:
        """The router path of a step of `tokens` tokens over `experts` experts ('auto' resolved)."""
        if self.router_kernel != "auto":
            return self.router_kernel
        return (
            "pallas" if self.pallas and tokens * experts <= ROUTER_AUTO_MAX_TOKEN_EXPERTS else "xla"
        )

    def absorbs_chunk(self, tokens: int) -> bool:
        return self.pallas and tokens <= self.absorbed_chunk_tokens

    @classmethod
    def for_backend(cls, backend: Optional[str] = None, *, hopper: Optional[bool] = None,
                    **options) -> "ExecPlan":
        """The plan for `backend` (default jax.default_backend()); `options` are fields, where None
        / 'auto' means 'pallas', 'unroll', 'per_layer' on GPU and 'xla', 'scan', 'stacked'
        elsewhere."""
        unknown = set(options) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"ExecPlan.for_backend: unknown option(s) {sorted(unknown)}")
        backend = backend or jax.default_backend()
        gpu = backend == "gpu"
        if hopper is None:
            hopper = gpu and _device_is_hopper()
        impl = options.pop("impl", None)
        loop = options.pop("layer_loop", None)
        loop = ("unroll" if gpu else "scan") if loop in (None, "auto") else loop
        weights = options.pop("layer_weights", None)
        if weights in (None, "auto"):
            weights = "per_layer" if gpu and loop == "unroll" else "stacked"
        # BENCHMARKS.md "Program set"
        options.setdefault("absorbed_chunk_tokens", 64 if gpu else 0)
        # BENCHMARKS.md "The host's enqueue"
        options.setdefault("pack_vectors", weights == "per_layer")
        options.setdefault("invariant_rows", 64 if gpu else 16)
        return cls(impl=("pallas" if gpu else "xla") if impl in (None, "auto") else impl,
                   layer_loop=loop, layer_weights=weights, hopper=bool(hopper), **options)


def _device_is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def default_plan(plan: Optional[ExecPlan] = None) -> ExecPlan:
    """`plan`, or this machine's plan for an op called without one (tests, benchmarks)."""
    return ExecPlan.for_backend() if plan is None else plan
