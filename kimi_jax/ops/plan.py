"""ExecPlan: every execution choice of the model's ops in one frozen, hashable value, a static argument
of each jitted step (a different plan is a different compiled step). Force a path in tests with
`dataclasses.replace(plan, impl="xla")`."""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax

IMPLS = ("xla", "pallas")
MLA_DECODE_KERNELS = ("auto", "triton", "mgpu")
MLA_SCHEDULES = ("rows", "balanced")
LAYER_LOOPS = ("scan", "unroll")
# fresh causal prefill: XLA einsums, or one jax.nn.dot_product_attention call by that implementation
PREFILL_ATTENTION_CHOICES = ("einsum", "cudnn", "xla")
# chunks after cached tokens also: two unmasked calls merged by log-sum-exp (ops.prefill_attention)
CHUNK_ATTENTION_CHOICES = PREFILL_ATTENTION_CHOICES + ("cudnn_split", "xla_split")


@dataclasses.dataclass(frozen=True)
class ExecPlan:
    """How the ops run; the defaults are the portable plan, `for_backend()` this machine's.

    impl: 'xla' or 'pallas' (the GPU kernels; on CPU their interpreters). mla_decode_kernel: 'triton',
    'mgpu' or 'auto' (`ops.mla_decode_kernel`, which reads `hopper`). mla_schedule: 'rows', 'balanced' or
    None (the engine picks per step, `mla_schedule_for`). prefill_attention / chunk_attention: the
    CHOICES above or 'auto'. layer_loop: 'scan' or 'unroll' (static slices; BENCHMARKS.md "Engine decode
    step"). combine_xla_max_macs: the balanced merge's XLA / Pallas threshold.
    one_new_token_elementwise: merge a decode step's one new token elementwise (off only to time both).
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
        """The plan for `backend` (default jax.default_backend()); `options` are fields, impl and
        layer_loop also None / 'auto' ('pallas' and 'unroll' on GPU, else 'xla' and 'scan')."""
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
