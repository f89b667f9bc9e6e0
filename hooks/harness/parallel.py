"""Parallelise the model on a DeviceMesh: TP with parallelize_module, then FSDP2; the
mesh's other dimensions (pipeline stages, expert and context parallelism) set up here too.

The mesh is ``(replicate, pp, dp | shard, ep, cp, tp)``, with ``replicate``, ``pp``, ``ep``
and ``cp`` only where they are above 1: replicas outermost, so that one replica (every
stage of it) is consecutive ranks.  The ``ep`` and ``dp`` ranks read different data (the
data-parallel width is dp x ep); ``cp`` ranks read the same samples and hold consecutive
chunks of their sequence.  Dense weights are FSDP2-sharded over dp x ep x cp, experts over dp.
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

__all__ = ["ParallelDims", "build_mesh", "dp_mesh", "loss_mesh", "parallelize"]


@dataclass(kw_only=True)
class ParallelDims:
    dp: int
    """Data-parallel degree: ``replicate`` replicas, each FSDP2-sharded over ``dp // replicate`` ranks."""
    tp: int
    """Tensor-parallel degree."""
    world_size: int
    replicate: int = 1
    """HSDP replicas (1: plain FSDP2 over all of dp)."""
    pp: int = 1
    """Pipeline stages."""
    ep: int = 1
    """Expert parallelism: ranks that split the experts between them (and read different data)."""
    cp: int = 1
    """Context parallelism: ranks that split each sample's sequence between them."""

    def __post_init__(self) -> None:
        if min(self.dp, self.tp, self.replicate, self.pp, self.ep, self.cp) < 1:
            raise ValueError(f"--dp {self.dp}, --tp {self.tp}, --pp {self.pp}, --ep {self.ep}, --cp {self.cp} "
                             f"and --replicate {self.replicate} must be at least 1")
        if self.dp * self.tp * self.pp * self.ep * self.cp != self.world_size:
            raise ValueError(f"--dp {self.dp} x --tp {self.tp} x --pp {self.pp} x --ep {self.ep} x --cp {self.cp}"
                             f" != world size {self.world_size}")
        if self.dp % self.replicate:
            raise ValueError(f"--replicate {self.replicate} must divide the data-parallel degree {self.dp}")
        if self.replicate > 1 and (self.ep > 1 or self.cp > 1):
            raise ValueError("--replicate with --ep or --cp is not supported (HSDP shards within a replica)")
        if self.ep > 1 and (self.tp > 1 or self.cp > 1):
            raise ValueError("--ep with --tp or --cp is not supported: the experts are neither TP- nor CP-sharded")

    @property
    def data(self) -> int:
        """Ranks that read different samples: dp x ep."""
        return self.dp * self.ep

    @property
    def shard(self) -> int:
        """FSDP2 shards per replica."""
        return self.dp // self.replicate

    @property
    def replica_size(self) -> int:
        """Consecutive ranks that hold one whole copy of the model (every stage of it)."""
        return self.world_size // self.replicate

    @classmethod
    def from_flags(cls, dp: int | None, tp: int, world_size: int, replicate: int = 1, *, pp: int = 1,
                   ep: int = 1, cp: int = 1) -> ParallelDims:
        """dp defaults to filling the world: world_size // (tp x pp x ep x cp).  ``replicate`` is
        the most replicas: a world that shrank (an elastic restart) gets the most that divide its dp."""
        rest = tp * pp * ep * cp
        if min(tp, pp, ep, cp) < 1 or world_size % rest:
            raise ValueError(f"--tp {tp} x --pp {pp} x --ep {ep} x --cp {cp} must divide the world size {world_size}")
        dp = dp if dp is not None else world_size // rest
        replicate = max((r for r in range(1, max(replicate, 1) + 1) if dp % r == 0), default=1)
        return cls(dp=dp, tp=tp, world_size=world_size, replicate=replicate, pp=pp, ep=ep, cp=cp)


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """A ``(dp, tp)`` mesh; with replicas, ``(replicate, shard, tp)`` with ``dp`` their flattening;
    ``pp``, ``ep`` and ``cp`` where above 1 (the module's docstring has the order)."""
    named = [("replicate", dims.replicate if dims.replicate > 1 else 0), ("pp", dims.pp if dims.pp > 1 else 0)]
    named += [("shard", dims.shard)] if dims.replicate > 1 else [("dp", dims.dp)]
    named += [("ep", dims.ep if dims.ep > 1 else 0), ("cp", dims.cp if dims.cp > 1 else 0), ("tp", dims.tp)]
    names = tuple(n for n, size in named if size)
    mesh = init_device_mesh(device_type, tuple(size for _, size in named if size), mesh_dim_names=names)
    if dims.replicate > 1:
        mesh.rankwatch_dp = mesh["replicate", "shard"]._flatten("dp")  # type: ignore[attr-defined]
    elif dims.ep > 1:  # the ranks that read different samples
        mesh.rankwatch_dp = mesh["dp", "ep"]._flatten("dp_ep")  # type: ignore[attr-defined]
    if dims.cp > 1:  # the dense weights' FSDP2 ranks (their gradients average over cp too)
        mesh.rankwatch_fsdp = mesh["dp", "cp"]._flatten("dp_cp")  # type: ignore[attr-defined]
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that read different samples: ``dp``, or the flattened ``(replicate, shard)``
    or ``(dp, ep)``."""
    flat = getattr(mesh, "rankwatch_dp", None)
    return flat if flat is not None else mesh["dp"]


def loss_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks whose losses make the step's mean: the data-parallel ones, and the
    context-parallel chunks of their samples."""
    flat = getattr(mesh, "rankwatch_fsdp", None)
    return flat if flat is not None else dp_mesh(mesh)


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
        for block in model.layers.values():  # type: ignore[attr-defined]
            parallelize_module(block, mesh["tp"], plan)
    if dims.cp > 1:
        for block in model.layers.values():  # type: ignore[attr-defined]
            block.attention.cp_group, block.attention.cp_rank = mesh["cp"].get_group(), mesh["cp"].get_local_rank()
    # HSDP: a 2-D (replicate, shard) mesh shards within a replica, all-reduces across them.
    fsdp = mesh["replicate", "shard"] if dims.replicate > 1 else loss_mesh(mesh)
    for block in model.layers.values():  # type: ignore[attr-defined]
        if dims.ep > 1:  # each ep rank's own experts: sharded over dp, their gradients scaled as the dense ones
            block.feed_forward.group = mesh["ep"].get_group()
            experts = block.feed_forward.experts
            fully_shard(experts, mesh=mesh["dp"])
            experts.set_gradient_divide_factor(float(dims.data))  # type: ignore[attr-defined]
        fully_shard(block, mesh=fsdp)
    fully_shard(model, mesh=fsdp)
    return model


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
