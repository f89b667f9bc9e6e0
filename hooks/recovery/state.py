"""The in-process recovery's state: each rank's own shards, kept across a recovery or sent to
a rank that lacks them.

A survivor copies its own shards of the parameters and of the optimizer state out of the
failed job (:func:`local_state`) and into the job rebuilt for the new world
(:func:`restore`): within a replica the layout does not change, so nothing is read from
disk.  A joiner, or a survivor at another step, receives the same from the source
replica's rank at its position (:func:`transfer`), point to point.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from rankwatch.hooks.recovery.decide import Decision, Job

__all__ = ["StateMismatch", "local_state", "recv_state", "restore", "send_state", "transfer"]


class StateMismatch(RuntimeError):
    """The rebuilt job's parameters do not match the state to restore."""


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _reshard(model: Any) -> None:
    """Put every FSDP2 module of ``model`` back on its sharded parameters: the ones its
    optimizer holds state for.  A step cut short leaves modules unsharded, and FSDP2's own
    ``reshard()`` keeps a module that does not reshard after forward (the root, always)
    unsharded while its forward is under way: a failure in the forward would otherwise
    leave the root's parameters unsharded, and their optimizer state not found by them."""
    from torch.distributed.fsdp import FSDPModule

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        idle: Any = TrainingState.IDLE
    except ImportError:  # pragma: no cover - FSDP2's layout in another torch
        idle = None
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        as_idle = getattr(group, "use_training_state", None)
        with as_idle(idle) if as_idle is not None and idle is not None else contextlib.nullcontext():
            module.reshard()


def local_state(job: Job) -> dict[str, Any]:
    """This rank's shards of the parameters and the optimizer state, as plain tensors (no
    process group referenced), by parameter name.

    Raises:
        StateMismatch: the optimizer holds state for a tensor the model does not name (a
            module left on other parameters): that state would be lost without a word.
    """
    _reshard(job.model)
    opt_state = job.optimizer.state
    named = {id(p) for p in job.model.parameters()}
    lost = sum(1 for p in opt_state if id(p) not in named)
    if lost:
        raise StateMismatch(f"the optimizer holds state for {lost} tensor(s) that are not the model's "
                            "parameters after the failed step: their state cannot be carried over")
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
rest (AdamW's step counts, small buffers) inside the header."""
_HEADER_MAX = 64 << 20
"""The most bytes of header a receiver takes (its tensors are all under ``_BULK`` elements)."""
_SLOT = "rankwatch.slot"


def send_state(state: dict[str, Any], dst: int) -> int:
    """Send ``state`` (as :func:`local_state` makes it) to rank ``dst``: a small header that
    names every large tensor's shape and dtype and holds the small values, then each large
    tensor as it is, with no serialising and no copy to the host (device to device on NCCL).
    Returns the tensor bytes."""
    import torch.distributed as dist

    device = _wire_device()
    bulk: list[Any] = []

    def entry(t: Any) -> Any:
        if hasattr(t, "numel") and t.numel() >= _BULK and t.device.type == device.type:
            bulk.append(t.contiguous())
            return (_SLOT, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        return t

    _send_header({"params": {n: entry(t) for n, t in state["params"].items()},
                  "optim": {n: {k: entry(v) for k, v in per.items()} for n, per in state["optim"].items()}}, dst)
    for t in bulk:
        dist.send(t, dst=dst)
    return _nbytes(state)


def _send_header(header: Any, dst: int, raw: bytes | None = None) -> None:
    """The header: its length, then its bytes (``torch.save``'s format; ``raw``: these bytes)."""
    import io

    import torch
    import torch.distributed as dist

    if raw is None:
        buf = io.BytesIO()
        torch.save(header, buf)
        raw = buf.getvalue()
    device = _wire_device()
    dist.send(torch.tensor([len(raw)], dtype=torch.int64, device=device), dst=dst)
    dist.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device), dst=dst)


def _recv_header(src: int) -> Any:
    """What :func:`_send_header` sent, loaded as plain data only (tensors, numbers, strings,
    containers: ``torch.load``'s ``weights_only``): a peer's header runs no code here."""
    import io

    import torch
    import torch.distributed as dist

    device = _wire_device()
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src=src)
    n = int(size.item())
    if not 0 < n <= _HEADER_MAX:
        raise StateMismatch(f"the source announced a header of {n} bytes (at most {_HEADER_MAX})")
    data = torch.empty(n, dtype=torch.uint8, device=device)
    dist.recv(data, src=src)
    try:
        return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler's refusals vary
        raise StateMismatch(f"the source's state header is not plain data: {str(exc).splitlines()[0][:200]}") from None


def _slot(v: Any) -> tuple[tuple[int, ...], Any] | None:
    """A header entry's (shape, dtype) when it names a tensor that follows; None for a value.

    Raises:
        StateMismatch: a slot with a negative, non-integer or too deep shape, or no dtype.
    """
    import torch

    if not (isinstance(v, tuple) and len(v) == 3 and v[0] == _SLOT):
        return None
    shape, name = v[1], v[2]
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if (not isinstance(dtype, torch.dtype) or not isinstance(shape, tuple) or len(shape) > 8
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise StateMismatch(f"the source announced a tensor of shape {str(shape)[:64]} and dtype {str(name)[:32]}")
    return shape, dtype


def recv_state(src: int, limit: int | None = None) -> dict[str, Any]:
    """Receive what :func:`send_state` sent from rank ``src``, in this rank's device memory;
    a header that announces more than ``limit`` bytes of tensors is refused before any is
    allocated."""
    import torch
    import torch.distributed as dist

    header = _recv_header(src)
    if (not isinstance(header, dict) or set(header) != {"params", "optim"} or not isinstance(header["params"], dict)
            or not isinstance(header["optim"], dict) or not all(isinstance(p, dict) for p in header["optim"].values())):
        raise StateMismatch("the source sent no state")
    values = list(header["params"].values()) + [v for per in header["optim"].values() for v in per.values()]
    slots = [s for s in map(_slot, values) if s is not None]
    announced = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in slots)
    if limit is not None and announced > limit:
        raise StateMismatch(f"the source announced {announced} bytes of state; this rank's job holds "
                            f"at most {limit}")
    device = _wire_device()

    def fill(v: Any) -> Any:
        slot = _slot(v)
        if slot is None:
            return v
        t = torch.empty(slot[0], dtype=slot[1], device=device)
        dist.recv(t, src=src)
        return t

    # In the order the sender filled its header: the same dict order on both sides.
    params = {n: fill(v) for n, v in header["params"].items()}
    optim = {n: {k: fill(v) for k, v in per.items()} for n, per in header["optim"].items()}
    return {"params": params, "optim": optim}


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
