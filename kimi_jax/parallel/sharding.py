"""Parallel layouts: the ("dp", "tp") mesh of a `Layout` and RULES, the one table from logical axis
names to mesh axes (model code never names a mesh axis). TP splits heads and FFN widths over tp; EP
holds whole experts, E / (dp * tp) each; DP+EP replicates attention over a batch split. Routed
experts run in shard_map (ops.routed_experts)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("dp", "tp")

# logical axis -> (mesh axes without expert parallelism, mesh axes with it). None: replicated.
RULES: dict[str, tuple] = {
    "batch":      ("dp", "dp"),
    "layers":     (None, None),
    "vocab":      ("tp", "tp"),
    "embed":      (None, None),
    "norm":       (None, None),
    "q_lora":     (None, None),
    "kv_lora":    (None, None),
    "kv_latent":  (None, None),
    "q_heads":    ("tp", "tp"),
    "kv_heads":   ("tp", "tp"),
    "o_heads":    ("tp", "tp"),
    "mlp":        ("tp", "tp"),
    "shared_mlp": ("tp", "tp"),
    "experts":    (None, ("dp", "tp")),
    "router_experts": (None, None),   # the router scores every expert for every token: replicated
    "expert_mlp": ("tp", None),
}


class LayoutError(ValueError):
    """A layout that cannot run this model on these devices."""


@dataclasses.dataclass(frozen=True)
class Layout:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False

    @property
    def world(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def name(self) -> str:
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        parts = ([f"DP{dp}"] if dp > 1 else []) + ([f"TP{tp}"] if tp > 1 or dp == 1 else [])
        return "x".join(parts) + ("+EP" if self.enable_expert_parallel else "")

    def axis_rule(self, logical: Optional[str]):
        if logical is None:
            return None
        if logical not in RULES:
            raise KeyError(
                f"logical axis {logical!r} has no sharding rule in kimi_jax.parallel.sharding.RULES"
            )
        return RULES[logical][1 if self.enable_expert_parallel else 0]

    def spec(self, logical_axes: tuple, ndim: int) -> P:
        """PartitionSpec of a parameter with these logical axes (stacked: leading 'layers' axis)."""
        axes = ("layers",) * (ndim - len(logical_axes)) + tuple(logical_axes)
        return P(*[self.axis_rule(a) for a in axes])

    @functools.cached_property
    def mesh(self) -> Mesh:
        devices = jax.devices()
        if len(devices) < self.world:
            raise LayoutError(
                f"layout {self.name} needs {self.world} devices; {len(devices)} visible "
                f"({devices[0].platform})"
            )
        grid = np.asarray(devices[: self.world]).reshape(
            self.data_parallel_size, self.tensor_parallel_size
        )
        return Mesh(grid, MESH_AXES)

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    # -- the MoE's view ---------------------------------------------------------------------------
    def moe_parallel(self) -> Optional["MoEParallel"]:
        if self.world == 1:
            return None
        return MoEParallel(mesh=self.mesh, batch=_axes(self.axis_rule("batch")),
                           experts=_axes(self.axis_rule("experts")),
                           expert_mlp=_axes(self.axis_rule("expert_mlp")),
                           heads=_axes(self.axis_rule("q_heads")))

    def check_divisible(self, cfg) -> None:
        """Refuse a layout the model's dimensions cannot be split by, naming the dimension."""
        tp, world = self.tensor_parallel_size, self.world
        checks = [
            ("num_attention_heads", cfg.num_attention_heads, tp),
            ("intermediate_size", cfg.intermediate_size, tp),
            ("the shared experts' width", cfg.shared_expert_width or cfg.moe_intermediate_size, tp),
            ("vocab_size", cfg.vocab_size, tp),
        ]
        if self.enable_expert_parallel:
            checks.append(("n_routed_experts", cfg.n_routed_experts, world))
        else:
            checks.append(("moe_intermediate_size", cfg.moe_intermediate_size, tp))
            if (
                cfg.quantization is not None
                and (cfg.moe_intermediate_size // tp) % cfg.quantization.group_size
            ):
                raise LayoutError(
                    f"layout {self.name}: moe_intermediate_size/tp = "
                    f"{cfg.moe_intermediate_size // tp} is not a multiple of the INT4 group "
                    f"size {cfg.quantization.group_size}; use enable_expert_parallel"
                )
        for what, n, k in checks:
            if n % k:
                raise LayoutError(f"layout {self.name}: {what} = {n} is not divisible by {k}")


@dataclasses.dataclass(frozen=True)
class MoEParallel:
    """What the kernels run inside shard_map need (ops.routed_experts, ops.mla_paged_attention)."""

    mesh: Mesh
    batch: tuple[str, ...]        # mesh axes the tokens are split over
    experts: tuple[str, ...]      # mesh axes the expert dimension is split over
    expert_mlp: tuple[str, ...]   # mesh axes each expert's FFN width is split over
    heads: tuple[str, ...] = ()   # mesh axes the attention heads are split over


def _axes(rule) -> tuple[str, ...]:
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def logical_axes_of(state) -> dict[tuple[str, ...], tuple]:
    """{parameter path: logical axes} from an nnx.State (stacked parameters keep their names)."""
    from flax import nnx
    return {tuple(str(k) for k in path): getattr(v, "axes", None) or ()
            for path, v in nnx.to_flat_state(state)}


def param_shardings(layout: Layout, state) -> dict[tuple[str, ...], NamedSharding]:
    from flax import nnx
    out = {}
    for path, v in nnx.to_flat_state(state):
        axes = getattr(v, "axes", None) or ()
        out[tuple(str(k) for k in path)] = layout.sharding(layout.spec(axes, len(v.shape)))
    return out


def per_device_bytes(layout: Layout, state) -> int:
    """Bytes of parameters one device holds under `layout` (largest shard, from shapes alone)."""
    from flax import nnx
    total = 0
    for path, v in nnx.to_flat_state(state):
        axes = getattr(v, "axes", None) or ()
        spec = layout.spec(axes, len(v.shape))
        local = list(v.shape)
        sizes = dict(zip(MESH_AXES, (layout.data_parallel_size, layout.tensor_parallel_size)))
        for d, rule in enumerate(spec):
            for ax in _axes(rule):
                local[d] = -(-local[d] // sizes[ax])
        total += int(np.prod(local)) * np.dtype(v.dtype).itemsize
    return total


def device_memory_bytes() -> Optional[int]:
    """Memory of one device as the runtime reports it (None on CPU, where it is not reported)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats
        return None
    return None if not stats else stats.get("bytes_limit")


def check_fits(
    layout: Layout, state, *, cache_bytes: int = 0, capacity: Optional[int] = None
) -> int:
    """Refuse (before allocating) a layout whose per-device bytes exceed the device memory."""
    need = per_device_bytes(layout, state) + cache_bytes
    capacity = capacity if capacity is not None else device_memory_bytes()
    if capacity is not None and need > capacity:
        raise LayoutError(
            f"layout {layout.name} needs {need / 2**30:.2f} GiB per device "
            f"(parameters {per_device_bytes(layout, state) / 2**30:.2f} GiB + cache "
            f"{cache_bytes / 2**30:.2f} GiB) but a device has {capacity / 2**30:.2f} GiB"
        )
    return need
