"""Parallelise the model on a (dp, tp) DeviceMesh: TP with parallelize_module, then FSDP2.

The same code runs on gloo/CPU and NCCL/GPU; only the mesh's device type differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

__all__ = ["ParallelDims", "build_mesh", "dp_mesh", "parallelize"]


@dataclass(kw_only=True)
class ParallelDims:
    dp: int
    """Data-parallel degree: ``replicate`` replicas, each FSDP2-sharded over ``dp // replicate`` ranks."""
    tp: int
    """Tensor-parallel degree."""
    world_size: int
    replicate: int = 1
    """HSDP replicas (1: plain FSDP2 over all of dp)."""

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1 or self.replicate < 1:
            raise ValueError(f"--dp {self.dp}, --tp {self.tp} and --replicate {self.replicate} must be at least 1")
        if self.dp * self.tp != self.world_size:
            raise ValueError(f"--dp {self.dp} x --tp {self.tp} != world size {self.world_size}")
        if self.dp % self.replicate:
            raise ValueError(f"--replicate {self.replicate} must divide the data-parallel degree {self.dp}")

    @property
    def shard(self) -> int:
        """FSDP2 shards per replica."""
        return self.dp // self.replicate

    @property
    def replica_size(self) -> int:
        """Consecutive ranks that hold one whole copy of the model."""
        return self.shard * self.tp

    @classmethod
    def from_flags(cls, dp: int | None, tp: int, world_size: int, replicate: int = 1) -> ParallelDims:
        """dp defaults to filling the world: world_size // tp.  ``replicate`` is the most
        replicas: a world that shrank (an elastic restart) gets the most that divide its dp."""
        if tp < 1 or world_size % tp:
            raise ValueError(f"--tp {tp} must divide the world size {world_size}")
        dp = dp if dp is not None else world_size // tp
        replicate = max((r for r in range(1, max(replicate, 1) + 1) if dp % r == 0), default=1)
        return cls(dp=dp, tp=tp, world_size=world_size, replicate=replicate)


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """A ``(dp, tp)`` mesh; with replicas, ``(replicate, shard, tp)`` with ``dp`` their flattening."""
    if dims.replicate == 1:
        return init_device_mesh(device_type, (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))
    mesh = init_device_mesh(device_type, (dims.replicate, dims.shard, dims.tp),
                            mesh_dim_names=("replicate", "shard", "tp"))
    mesh.rankwatch_dp = mesh["replicate", "shard"]._flatten("dp")  # type: ignore[attr-defined]
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel ranks' mesh: ``dp``, or the flattened ``(replicate, shard)``."""
    flat = getattr(mesh, "rankwatch_dp", None)
    return flat if flat is not None else mesh["dp"]


def parallelize(model: nn.Module, mesh: DeviceMesh, dims: ParallelDims) -> nn.Module:
    """Apply TP (colwise in, rowwise out) to every block, then FSDP2 over dp."""
    if dims.tp > 1:
        cfg = model.cfg  # type: ignore[attr-defined]
        if cfg.n_heads % dims.tp or cfg.hidden_dim % dims.tp:
            raise ValueError(f"--tp {dims.tp} must divide n_heads={cfg.n_heads} "
                             f"and hidden_dim={cfg.hidden_dim}")
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
        for block in model.layers:  # type: ignore[attr-defined]
            parallelize_module(block, mesh["tp"], plan)
    # HSDP: a 2-D (replicate, shard) mesh shards within a replica, all-reduces across them.
    dp_mesh = mesh["replicate", "shard"] if dims.replicate > 1 else mesh["dp"]
    for block in model.layers:  # type: ignore[attr-defined]
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
