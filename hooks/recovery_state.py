"""The in-process recovery's state: each rank's own shards, kept across a recovery or sent to
a rank that lacks them.

A survivor copies its own shards of the parameters and of the optimizer state out of the
failed job (:func:`local_state`) and into the job rebuilt for the new world
(:func:`restore`): within a replica the layout does not change, so nothing is read from
disk.  A joiner, or a survivor at another step, receives the same from the source
replica's rank at its position (:func:`transfer`), point to point.
"""

from __future__ import annotations

import math
from typing import Any

from rankwatch.hooks.recovery_decide import Decision, Job

__all__ = ["StateMismatch", "local_state", "recv_state", "restore", "send_state", "transfer"]


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
    fresh member).  Returns the bytes of tensors this rank sent or received.
    """
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
            moved += send_state(own, q)
        elif rank == q:
            # The job's own shards, and the optimizer's state for them: AdamW keeps two more.
            limit = 4 * sum(_local(p).numel() * _local(p).element_size() for p in job.model.parameters())
            state = recv_state(src, limit=limit + (1 << 20))
            restore(job, state)
            moved += _nbytes(state)
    return moved


_BULK = 1 << 12
"""Tensors of at least this many elements, on the backend's device, travel as tensors; the
rest (AdamW's step counts, small buffers) inside the pickled header."""


def send_state(state: dict[str, Any], dst: int) -> int:
    """Send ``state`` (as :func:`local_state` makes it) to rank ``dst``: a small pickled header
    that names every tensor's shape and dtype, then each large tensor as it is, with no
    pickling and no copy to the host (device to device on NCCL).  Returns the tensor bytes."""
    import torch.distributed as dist

    device = _wire_device()
    bulk: list[Any] = []

    def entry(t: Any) -> Any:
        if hasattr(t, "numel") and t.numel() >= _BULK and t.device.type == device.type:
            bulk.append(t.contiguous())
            return _Slot(tuple(t.shape), t.dtype)
        return t

    header = {"params": {n: entry(t) for n, t in state["params"].items()},
              "optim": {n: {k: entry(v) for k, v in per.items()} for n, per in state["optim"].items()}}
    dist.send_object_list([header], dst=dst)
    for t in bulk:
        dist.send(t, dst=dst)
    return _nbytes(state)


def recv_state(src: int, limit: int | None = None) -> dict[str, Any]:
    """Receive what :func:`send_state` sent from rank ``src``, in this rank's device memory;
    a header that announces more than ``limit`` bytes of tensors is refused before any is
    allocated."""
    import torch
    import torch.distributed as dist

    box: list[Any] = [None]
    dist.recv_object_list(box, src=src)
    header = box[0]
    if not isinstance(header, dict) or set(header) != {"params", "optim"}:
        raise StateMismatch("the source sent no state")
    slots = [v for v in header["params"].values() if isinstance(v, _Slot)]
    slots += [v for per in header["optim"].values() for v in per.values() if isinstance(v, _Slot)]
    for v in slots:
        if (not isinstance(v.dtype, torch.dtype) or not isinstance(v.shape, tuple) or len(v.shape) > 8
                or not all(isinstance(d, int) and d >= 0 for d in v.shape)):
            raise StateMismatch(f"the source announced a tensor of shape {str(v.shape)[:64]} and dtype "
                                f"{str(v.dtype)[:32]}")
    announced = sum(math.prod(v.shape) * torch.empty((), dtype=v.dtype).element_size() for v in slots)
    if limit is not None and announced > limit:
        raise StateMismatch(f"the source announced {announced} bytes of state; this rank's job holds "
                            f"at most {limit}")
    device = _wire_device()

    def fill(v: Any) -> Any:
        if isinstance(v, _Slot):
            t = torch.empty(v.shape, dtype=v.dtype, device=device)
            dist.recv(t, src=src)
            return t
        return v

    # In the order the sender filled its header: the same dict order on both sides.
    params = {n: fill(v) for n, v in header["params"].items()}
    optim = {n: {k: fill(v) for k, v in per.items()} for n, per in header["optim"].items()}
    return {"params": params, "optim": optim}


class _Slot:
    """A tensor of the header that follows it on the wire."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.shape, self.dtype = shape, dtype

    def __reduce__(self) -> tuple:
        return (_Slot, (self.shape, self.dtype))


def _wire_device() -> Any:
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _nbytes(state: dict[str, Any]) -> int:
    total = sum(t.numel() * t.element_size() for t in state["params"].values())
    for per in state["optim"].values():
        total += sum(v.numel() * v.element_size() for v in per.values() if hasattr(v, "element_size"))
    return total
