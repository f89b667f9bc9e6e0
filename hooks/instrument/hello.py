"""What a rank tells its agent when it connects (:func:`hello`: its rank, world, device, backend
and mesh coordinates) and the credentials it calls with (:func:`credentials`)."""

from __future__ import annotations

import logging
import os
from typing import Any

from rankwatch.credentials import ClientCredentials
from rankwatch.hooks.instrument.recorder import OPS

__all__ = ["credentials", "device_uuid", "hello", "mesh_of"]

log = logging.getLogger(__name__)


def credentials() -> ClientCredentials:
    """The job's credentials from the environment; none (with an error logged) if they
    cannot be read: the Unix socket needs none, and training goes on either way."""
    try:
        return ClientCredentials.from_env()
    except ValueError as exc:
        log.error("rankwatch: %s; calling the agent without credentials", exc)
        return ClientCredentials()


def device_uuid(torch: Any) -> str:
    """The current CUDA device's UUID as NVML spells it ("GPU-<uuid>"), or ""."""
    try:
        return f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    except Exception:  # noqa: BLE001 - an identity detail; the local rank is the fallback
        return ""


def hello(mesh: Any, node: str, peak_flops: float | None, job_id: str | None) -> Any:
    import torch
    import torch.distributed as dist

    from rankwatch.hooks.instrument.collectives import backend_of
    from rankwatch.hooks.harness.flops import peak_flops_for
    from rankwatch.proto import pb

    initialized = dist.is_initialized()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    hello = pb.Hello(
        rank=dist.get_rank() if initialized else int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=dist.get_world_size() if initialized else int(os.environ.get("WORLD_SIZE", 1)),
        node_id=node, pid=os.getpid(),
        backend=backend_of() if initialized else "none",
        device=device,
        job_id=job_id or os.environ.get("TORCHELASTIC_RUN_ID", ""),
        peak_flops=peak_flops if peak_flops is not None else peak_flops_for(device),
        op_names=list(OPS),
    )
    if torch.cuda.is_available():
        hello.device_uuid = device_uuid(torch)
    if mesh is not None:
        coords, shape = mesh_of(mesh)
        hello.mesh_coords.update(coords)
        hello.mesh_shape.update(shape)
    return hello


def mesh_of(mesh: Any) -> tuple[dict[str, int], dict[str, int]]:
    """A DeviceMesh's (coordinates of this rank, sizes), by dimension name; empty without names."""
    if not mesh.mesh_dim_names:
        return {}, {}
    coords = mesh.get_coordinate() or []
    names = mesh.mesh_dim_names
    return ({name: int(c) for name, c in zip(names, coords)},
            {name: int(size) for name, size in zip(names, mesh.mesh.shape)})
