"""ExecPlan: every execution choice of the model's ops in one frozen, hashable value.

A plan is built once from the hardware and the user's options (`ExecPlan.for_backend`), handed to the
engine (`Engine(..., plan=...)`), which passes it to the model's call and the model to every op, and is a
static argument of each jitted step: a different plan is a different compiled step, never a silently
reused one. Tests and benchmarks force a path with `dataclasses.replace(plan, impl="xla")` (or
`ExecPlan(...)` directly); nothing reads a module-level switch while tracing.

Per-step choices that depend on the step's data stay static arguments of that step: the MLA decode
schedule of a skewed batch (`kimi_jax.engine.steps.mla_schedule_for`) is set on the step's copy of the
plan (`mla_schedule`) when the plan leaves it open.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax

IMPLS = ("xla", "pallas")
MLA_DECODE_KERNELS = ("auto", "triton", "mgpu")
MLA_SCHEDULES = ("rows", "balanced")
LAYER_LOOPS = ("scan", "unroll")
# How a fresh causal prefill attends: "einsum" (XLA einsums and a masked softmax); "cudnn" / "xla": one
# jax.nn.dot_product_attention call with that implementation (V zero-padded to the qk head dim). "xla" is
# the cuDNN formulation anywhere: the CPU stand-in the tests use.
PREFILL_ATTENTION_CHOICES = ("einsum", "cudnn", "xla")
# Prefill chunks after cached tokens: those, or "cudnn_split" / "xla_split": two unmasked calls merged
# by their log-sum-exps (kimi_jax.ops.prefill_attention).
CHUNK_ATTENTION_CHOICES = PREFILL_ATTENTION_CHOICES + ("cudnn_split", "xla_split")


@dataclasses.dataclass(frozen=True)
class ExecPlan:
    """How the ops run. The defaults are the portable plan (plain XLA everywhere, the layers under
    lax.scan); `ExecPlan.for_backend()` is the plan for this machine.

    impl: 'xla' (plain jnp/lax, runs everywhere) or 'pallas' (the GPU kernels: Pallas, and cuDNN for
      prefill attention). On CPU 'pallas' runs the kernels in their interpreters (tests).
    mla_decode_kernel: the paged MLA decode kernel under impl='pallas': 'triton'
      (pallas_kernels/mla/decode.py, any head count), 'mgpu' (pallas_kernels/mla/decode_mgpu.py: Mosaic
      GPU, 64-row tiles) or 'auto' (`kimi_jax.ops.mla_decode_kernel`'s rule, which also needs `hopper`).
    hopper: the GPU is a Hopper (compute capability 9.x): an input of the 'auto' kernel rule.
    mla_schedule: the decode kernels' work schedule for every decode step: 'rows' (each row split into
      the same number of parts of its own length) or 'balanced' (pallas_kernels.mla.decode.balanced_items:
      parts of one size across the batch), or None: the engine picks per decode step (`mla_schedule_for`:
      'balanced' for a large skewed batch, else each kernel's default); an op called directly with None
      runs each kernel's default. Measured on the H200 (BENCHMARKS.md, 'MLA decode with rows of mixed
      lengths'; equal rows by `kimi-bench mla --balanced`): 'balanced' is 1.4-7.3x faster on batches of one long row among short ones; on equal rows within 4% from 32K up,
      slower at 4K (its item table and combine: 4-7% at batch 64, up to 37% at batch 8-16).
    prefill_attention: how a fresh causal prefill attends (PREFILL_ATTENTION_CHOICES) or 'auto' (cuDNN
      under impl='pallas' where the shapes fit, else einsum).
    chunk_attention: how a prefill chunk after cached tokens attends (CHUNK_ATTENTION_CHOICES) or 'auto'
      ('cudnn_split' under impl='pallas' where cuDNN fits, else einsum).
    layer_loop: how a layer stack runs: 'scan' (lax.scan: one compiled body) or 'unroll' (a Python loop
      with static layer indices). Measured on an H200 (BENCHMARKS.md "Engine decode step", layer loop; JAX 0.11.2): inside
      lax.scan / fori_loop XLA copies each layer's slice of the stacked weights before its matmuls read it
      (950 GB/s effective), while static slices are read in place (2,060 GB/s); `for_backend` unrolls on GPU.
    combine_xla_max_macs: the balanced schedule's merge takes the XLA contraction up to this many
      B x I x M x A multiply-adds, the Pallas kernel above (pallas_kernels.mla.combine.combine).
    one_new_token_elementwise: a decode step's single new token is merged elementwise instead of by the
      general einsum form (pallas_kernels.mla.decode._new_token_part); off only to time both.
    """
    impl: str = "xla"
    mla_decode_kernel: str = "auto"
    hopper: bool = False
    mla_schedule: Optional[str] = None
    prefill_attention: str = "auto"
    chunk_attention: str = "auto"
    layer_loop: str = "scan"
    combine_xla_max_macs: int = 1 << 27
    one_new_token_elementwise: bool = True

    def __post_init__(self):
        for name, choices in (("impl", IMPLS), ("mla_decode_kernel", MLA_DECODE_KERNELS),
                              ("mla_schedule", (None,) + MLA_SCHEDULES),
                              ("prefill_attention", ("auto",) + PREFILL_ATTENTION_CHOICES),
                              ("chunk_attention", ("auto",) + CHUNK_ATTENTION_CHOICES),
                              ("layer_loop", LAYER_LOOPS)):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"ExecPlan.{name}={value!r}; expected one of {choices}")
        if not isinstance(self.hopper, bool) or not isinstance(self.one_new_token_elementwise, bool):
            raise ValueError(f"ExecPlan.hopper and .one_new_token_elementwise must be bools, got "
                             f"{self.hopper!r} and {self.one_new_token_elementwise!r}")
        if not isinstance(self.combine_xla_max_macs, int) or self.combine_xla_max_macs < 0:
            raise ValueError(f"ExecPlan.combine_xla_max_macs={self.combine_xla_max_macs!r} must be an int >= 0")

    @property
    def pallas(self) -> bool:
        return self.impl == "pallas"

    @classmethod
    def for_backend(cls, backend: Optional[str] = None, *, hopper: Optional[bool] = None,
                    **options) -> "ExecPlan":
        """The plan for `backend` ('gpu', 'cpu', ...; default jax.default_backend()) and, on a GPU,
        its kind (`hopper`; default: read from jax.devices()[0]). `options` are ExecPlan fields; impl
        and layer_loop may also be None or 'auto' (the backend's choice: 'pallas' and 'unroll' on GPU,
        'xla' and 'scan' elsewhere)."""
        unknown = set(options) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"ExecPlan.for_backend: unknown option(s) {sorted(unknown)}")
        backend = backend or jax.default_backend()
        gpu = backend == "gpu"
        if hopper is None:
            hopper = gpu and _device_is_hopper()
        impl = options.pop("impl", None)
        loop = options.pop("layer_loop", None)
        return cls(impl=("pallas" if gpu else "xla") if impl in (None, "auto") else impl,
                   layer_loop=("unroll" if gpu else "scan") if loop in (None, "auto") else loop,
                   hopper=bool(hopper), **options)


def _device_is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def default_plan(plan: Optional[ExecPlan] = None) -> ExecPlan:
    """`plan`, or this machine's plan for an op called without one (tests, benchmarks)."""
    return ExecPlan.for_backend() if plan is None else plan
