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

__all__ = ["ParallelDims", "build_mesh", "parallelize"]


@dataclass(kw_only=True)
class ParallelDims:
    dp: int
    """Data-parallel (FSDP2) degree."""
    tp: int
    """Tensor-parallel degree."""
    world_size: int

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1:
            raise ValueError(f"--dp {self.dp} and --tp {self.tp} must be at least 1")
        if self.dp * self.tp != self.world_size:
            raise ValueError(f"--dp {self.dp} x --tp {self.tp} != world size {self.world_size}")

    @classmethod
    def from_flags(cls, dp: int | None, tp: int, world_size: int) -> ParallelDims:
        """dp defaults to filling the world: world_size // tp."""
        if tp < 1 or world_size % tp:
            raise ValueError(f"--tp {tp} must divide the world size {world_size}")
        return cls(dp=dp if dp is not None else world_size // tp, tp=tp, world_size=world_size)


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))


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
    dp_mesh = mesh["dp"]
    for block in model.layers:  # type: ignore[attr-defined]
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
