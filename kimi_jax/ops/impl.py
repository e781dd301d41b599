"""Which implementation an op runs, and the helpers the op modules share (`kimi_jax.ops`,
`kimi_jax.ops.prefill_attention`).

Each op has an 'xla' implementation (plain jnp/lax, runs everywhere) and, where one exists, a GPU one
('pallas': Pallas kernels, or cuDNN for prefill attention). `impl=None` picks 'pallas' on GPU and 'xla'
elsewhere; tests force each with `impl=` or with `use_impl(...)`. Switches are read at trace time: set
them before an engine first compiles a step.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import jax
import jax.numpy as jnp

_FORCED_IMPL: Optional[str] = None
IMPLS = ("xla", "pallas")


@contextlib.contextmanager
def forced(namespace: dict, name: str, value: Optional[str], choices: tuple, what: str):
    """Set the module-level switch `name` of `namespace` (a module's globals()) to `value` inside the
    block (None: automatic)."""
    if value is not None and value not in choices:
        raise ValueError(f"unknown {what} {value!r}; expected one of {choices}")
    old = namespace[name]
    namespace[name] = value
    try:
        yield
    finally:
        namespace[name] = old


def use_impl(impl: Optional[str]):
    """Force every op to one implementation inside the block (for tests and benchmarks)."""
    return forced(globals(), "_FORCED_IMPL", impl, IMPLS, "ops implementation")


def resolve_impl(impl: Optional[str] = None) -> str:
    impl = impl or _FORCED_IMPL
    if impl is None:
        impl = "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl not in IMPLS:
        raise ValueError(f"unknown ops implementation {impl!r}; expected one of {IMPLS}")
    return impl


def einsum_f32(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum accumulating and returning float32. XLA:CPU cannot run some bf16 x bf16 -> f32 dots
    (batch dimensions that are not leading: "UNIMPLEMENTED ... DotThunk"), so on CPU the operands are
    widened to f32 first (exact; the products and sums are f32 either way)."""
    if jax.default_backend() == "cpu":
        a, b = a.astype(jnp.promote_types(a.dtype, jnp.float32)), b.astype(jnp.promote_types(b.dtype, jnp.float32))
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)


def shard_map(f, mesh, in_specs, out_specs):
    """jax.shard_map without its replication checks (the ops' bodies use collectives and custom calls);
    jax.experimental's on older jax."""
    try:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    except (AttributeError, TypeError):  # older jax
        from jax.experimental.shard_map import shard_map
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
