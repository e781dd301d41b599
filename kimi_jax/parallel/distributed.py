"""Multi-process start-up: every process calls `initialize(...)` before touching devices and builds
the same LLM; the mesh spans every process's devices (gloo between CPU processes)."""
from __future__ import annotations

from typing import Optional, Sequence

import jax


def initialize(
    coordinator_address: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    local_device_ids: Optional[Sequence[int]] = None,
) -> None:
    """jax.distributed.initialize with the usual flags (all None: auto-detect SLURM/MPI/k8s)."""
    if num_processes is not None and num_processes <= 1:
        return
    if jax.config.jax_platforms in ("cpu",) or _platform_is_cpu():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids)


def _platform_is_cpu() -> bool:
    import os
    return os.environ.get("JAX_PLATFORMS", "") == "cpu"
