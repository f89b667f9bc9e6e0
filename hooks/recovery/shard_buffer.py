"""Where each shard lies in a peer snapshot's buffer, and copying the job's tensors into it.

A snapshot is one flat host buffer per rank: every local shard of the parameters and of the
optimizer state, each at an aligned offset, with a header entry that says what it is and
where its piece lies in the whole tensor (:func:`layout`).  :mod:`snapshot` takes and sends
them; :mod:`reshard` puts a new world's shards together from them.
"""

from __future__ import annotations

from typing import Any

from rankwatch.hooks.recovery.decide import Job

__all__ = ["before_next_step", "copy_in", "copy_into", "layout", "shard_tensors"]

_ALIGN = 64


def shard_tensors(job: Job) -> list[tuple[str, str, str, Any, Any]]:
    """(kind, parameter name, state key, local tensor, its DTensor or None) for every shard."""
    opt_state = job.optimizer.state
    out = []
    for name, p in job.model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out.append(("p", name, "", local.detach(), p))
        for k, v in (opt_state.get(p) or {}).items():
            if hasattr(v, "detach"):
                v_local = v.to_local() if hasattr(v, "to_local") else v
                whole = v_local.dim() > 0 and tuple(v_local.shape) == tuple(local.shape)
                out.append(("o", name, str(k), v_local.detach(), p if whole else None))
    return out


def layout(job: Job) -> tuple[list[dict], int]:
    """Each shard's header entry (its name, dtype, local shape, the whole tensor's shape and
    the shard's offset in it, its bytes' offset in the buffer) and the buffer's size."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    entries, off = [], 0
    for kind, name, key, t, p in shard_tensors(job):
        shape = list(t.shape)
        if isinstance(p, DTensor):
            lshape, goff = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            if list(lshape) != shape:
                raise ValueError(f"{name}: a local shard of {shape} where its placement gives {list(lshape)}")
            whole, goff = list(p.shape), list(goff)
        elif p is not None:
            whole, goff = shape, [0] * len(shape)
        else:   # a value every rank holds alike (AdamW's step count)
            whole, goff = None, None
        nbytes = t.numel() * t.element_size()
        entries.append({"kind": kind, "name": name, "key": key, "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": shape, "whole": whole, "offset": goff, "at": off, "bytes": nbytes})
        off += -(-nbytes // _ALIGN) * _ALIGN
    return entries, off


def copy_in(job: Job, entries: list[dict], buf: Any, non_blocking: bool) -> None:
    """Copy the job's tensors into ``buf`` at the places ``entries`` (its :func:`layout`) give."""
    copy_into(entries, [t for _, _, _, t, _ in shard_tensors(job)], buf, non_blocking)


def copy_into(entries: list[dict], tensors: list, buf: Any, non_blocking: bool) -> None:
    """Copy ``tensors`` (:func:`shard_tensors`' order) into ``buf`` at their entries' places."""
    for e, t in zip(entries, tensors):
        buf[e["at"]:e["at"] + e["bytes"]].view(t.dtype).view(t.shape).copy_(t, non_blocking=non_blocking)


def before_next_step(job: Job, wait: Any) -> None:
    """Run ``wait()`` once, before ``job.optimizer``'s next step (which changes the tensors copied)."""
    handle = None

    def hook(*_: Any) -> None:
        handle.remove()
        wait()

    handle = job.optimizer.register_step_pre_hook(hook)
