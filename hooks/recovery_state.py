"""The in-process recovery's state: each rank's own shards, kept across a recovery or sent to
a rank that lacks them.

A survivor copies its own shards of the parameters and of the optimizer state out of the
failed job (:func:`local_state`) and into the job rebuilt for the new world
(:func:`restore`): within a replica the layout does not change, so nothing is read from
disk.  A joiner, or a survivor at another step, receives the same from the source
replica's rank at its position (:func:`transfer`), point to point.
"""

from __future__ import annotations

from typing import Any

from rankwatch.hooks.recovery_decide import Decision, Job

__all__ = ["StateMismatch", "local_state", "restore", "transfer"]


class StateMismatch(RuntimeError):
    """The rebuilt job's parameters do not match the state to restore."""


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def local_state(job: Job) -> dict[str, Any]:
    """This rank's shards of the parameters and the optimizer state, as plain tensors (no
    process group referenced), by parameter name."""
    from torch.distributed.fsdp import FSDPModule

    for module in job.model.modules():  # a step cut short may leave parameters unsharded
        if isinstance(module, FSDPModule):
            module.reshard()
    opt_state = job.optimizer.state
    params, optim = {}, {}
    for name, p in job.model.named_parameters():
        params[name] = _local(p).detach()
        if p in opt_state:
            optim[name] = {k: _local(v).detach() if hasattr(v, "detach") else v for k, v in opt_state[p].items()}
    return {"params": params, "optim": optim}


def restore(job: Job, shards: dict[str, Any]) -> None:
    """Copy this rank's shards into the job just built (same layout within a replica)."""
    import torch
    from torch.distributed.tensor import DTensor

    params, optim = shards["params"], shards["optim"]
    names = [n for n, _ in job.model.named_parameters()]
    if set(names) != set(params):
        raise StateMismatch("the rebuilt model's parameters differ from the failed one's")
    with torch.no_grad():
        for name, p in job.model.named_parameters():
            local, saved = _local(p), params[name]
            if local.shape != saved.shape:
                raise StateMismatch(f"{name}: this rank's shard changed shape {tuple(saved.shape)} -> "
                                     f"{tuple(local.shape)} in the new world")
            local.copy_(saved)
            if name not in optim:
                continue
            state = {}
            for k, v in optim[name].items():
                if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == local.shape and v.dim():
                    v = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                           run_check=False)
                state[k] = v
            job.optimizer.state[p] = state


def transfer(job: Job, decision: Decision, rank: int, own: dict[str, Any] | None) -> int:
    """Send the source replica's state to each fresh member; collective over the new world.

    Each fresh member at position ``p`` of its replica receives from the source replica's
    rank at ``p`` (the same shard layout).  ``own`` is this rank's restored state (None on a
    fresh member).  Returns the bytes this rank sent or received (pickled).
    """
    import torch.distributed as dist

    rs, members = job.replica_size, decision.members
    fresh = set(decision.fresh)
    moved = 0
    for q, member in enumerate(members):
        if member not in fresh:
            continue
        src = decision.source * rs + q % rs
        if rank == src:
            if own is None:
                raise StateMismatch("the source replica's rank has no state to send")
            box: list[Any] = [own]
            dist.send_object_list(box, dst=q)
            moved += _nbytes(own)
        elif rank == q:
            box = [None]
            dist.recv_object_list(box, src=src)
            restore(job, box[0])
            moved += _nbytes(box[0])
    return moved


def _nbytes(state: dict[str, Any]) -> int:
    total = sum(t.numel() * t.element_size() for t in state["params"].values())
    for per in state["optim"].values():
        total += sum(v.numel() * v.element_size() for v in per.values() if hasattr(v, "element_size"))
    return total
