"""What a collective is, as the timers record it: its op name, the bytes of its buffer and
its group, read from a ``torch.distributed`` or functional-collective call's arguments, and
the backend a process group runs on."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from rankwatch.hooks.instrument.recorder import OP_CODE

__all__ = ["backend_of"]

# torch.distributed primitive -> op name.
_DIST_OPS = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce_coalesced",
    "all_gather": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_coalesced": "all_gather_coalesced",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "isend": "send",
    "irecv": "recv",
}
# Functional collectives (DTensor's path) -> op name.  Wrappers such as
# all_gather_tensor delegate to these through module globals.
_FUNCOL_OPS = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "all_reduce_coalesced": "all_reduce_coalesced",
    "all_gather_single_coalesced": "all_gather_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_coalesced",
}
# The verb's parameter that holds the whole buffer, whose bytes a record carries (as
# nccl-tests' "size": an all-gather's output, a reduce-scatter's input, else the tensor).
_PAYLOAD = {
    "all_reduce": "tensor", "all_reduce_coalesced": "tensors", "all_gather": "tensor_list",
    "all_gather_single": "output_tensor", "all_gather_coalesced": "output_tensor_lists",
    "reduce_scatter": "input_list", "reduce_scatter_single": "input",
    "all_to_all": "input_tensor_list", "all_to_all_single": "input", "broadcast": "tensor",
    "reduce": "tensor", "gather": "tensor", "scatter": "tensor", "send": "tensor", "recv": "tensor",
    "isend": "tensor", "irecv": "tensor",
}
# ProcessGroupNCCL's OpType names (lower case) -> op code; unlisted ones are "other".
_NCCL_OP_CODES = {name: OP_CODE[op] for name, op in {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather", "_allgather_base": "all_gather",
    "allgather_coalesced": "all_gather_coalesced", "allgather_into_tensor_coalesced": "all_gather_coalesced",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_coalesced",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all", "broadcast": "broadcast",
    "barrier": "barrier", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv",
}.items()}


def backend_of(pg: Any = None) -> str:
    """The backend of a process group (default: the world's), however the group was made.

    ``dist.get_backend`` answers "undefined" for a group that ``init_device_mesh``
    made without a backend named; the group's own name, or its per-device backend
    config ("cpu:gloo,cuda:nccl": the one of the device this process computes
    on), tell.
    """
    import torch
    import torch.distributed as dist

    name = str(dist.get_backend(pg))
    if name not in ("", "undefined"):
        return name
    group = pg if pg is not None else dist.distributed_c10d._get_default_group()
    try:
        name = str(group.name())
    except Exception:  # noqa: BLE001 - older torch
        name = "undefined"
    if name not in ("", "undefined"):
        return name
    by_device = dict(part.split(":", 1) for part in str(dist.get_backend_config(pg)).split(",") if ":" in part)
    return by_device.get("cuda" if torch.cuda.is_available() else "cpu", name)


def _storage_key(act: Any) -> int:
    return act.elem.untyped_storage().data_ptr()


def _nbytes(obj: Any) -> int:
    """Bytes of a tensor, or of the tensors in (nested) lists of them; 0 for anything else."""
    nbytes = getattr(obj, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(t) for t in obj)
    return 0


def _arg_reader(fn: Callable, name: str | None) -> Callable[[tuple, dict], Any]:
    """``(args, kwargs) -> `` the argument ``fn`` got for its parameter ``name``, or None."""
    params = list(inspect.signature(fn).parameters)
    if name is None or name not in params:
        return lambda args, kwargs: None
    index = params.index(name)
    return lambda args, kwargs: args[index] if len(args) > index else kwargs.get(name)


def _payload_reader(fn: Callable, name: str | None) -> Callable[[tuple, dict], int]:
    """``(args, kwargs) -> bytes`` of ``fn``'s parameter ``name``, passed by position or by keyword.

    One call on the training thread: a tensor's size is read in it; a list of them goes on
    to :func:`_nbytes`."""
    params = list(inspect.signature(fn).parameters)
    if name is None or name not in params:
        return lambda args, kwargs: 0
    index = params.index(name)

    def read(args: tuple, kwargs: dict) -> int:
        obj = args[index] if len(args) > index else kwargs.get(name)
        nbytes = getattr(obj, "nbytes", None)
        return int(nbytes) if nbytes is not None else _nbytes(obj)
    return read


_PEER_ARGS = {"send": ("dst", "group_dst"), "isend": ("dst", "group_dst"),
              "recv": ("src", "group_src"), "irecv": ("src", "group_src")}


def _no_peer(args: tuple, kwargs: dict) -> None:
    return None


def _peer_reader(fn: Callable, fname: str) -> Callable[[tuple, dict], tuple[Any, Any] | None]:
    """``(args, kwargs) -> (world rank, group rank)`` of a send's or receive's other end, as
    passed (either may be None; :func:`peer_rank` makes one world rank of them); None for
    any other verb.  Read on the training thread: two argument lookups, nothing resolved."""
    names = _PEER_ARGS.get(fname)
    if names is None:
        return _no_peer
    world, in_group = _arg_reader(fn, names[0]), _arg_reader(fn, names[1])
    return lambda args, kwargs: (world(args, kwargs), in_group(args, kwargs))


def peer_rank(pg: Any, peer: tuple[Any, Any] | None) -> int | None:
    """The world rank of a send's or receive's other end, from :func:`_peer_reader`'s pair
    (off the training thread); -1: any source, or one it cannot tell; None: not a P2P op."""
    if peer is None:
        return None
    world, in_group = peer
    if world is not None:
        return int(world)
    if in_group is None or pg is None:
        return -1
    try:
        import torch.distributed as dist

        return int(dist.get_global_rank(pg, int(in_group)))
    except Exception:  # noqa: BLE001 - a group this process is not in, or torn down
        return -1


def _group_key(group: Any) -> Any:
    """A hashable key for a functional collective's ``group`` argument."""
    if isinstance(group, tuple):  # (DeviceMesh, dim)
        return tuple(id(g) if not isinstance(g, (int, str)) else g for g in group)
    if isinstance(group, list):   # ranks
        return tuple(tuple(g) if isinstance(g, list) else g for g in group)
    return group if isinstance(group, str) else id(group)
