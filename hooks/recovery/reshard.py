"""A new world's shards, assembled in memory from the peer snapshots (:mod:`snapshot`).

After a recovery decided from snapshots (:func:`~rankwatch.hooks.recovery.decide.from_snapshots`),
every old member's snapshot at the decided step is on some survivor: its own, or the copy
its buddy holds.  Each provider broadcasts the snapshots it provides over the snapshots'
gloo group of the new world; every rank then puts each whole tensor (a parameter, an
optimizer state) together from the old shards' pieces, by each piece's offset in it, and
copies out the slice its new placement gives it.

That is the simplest correct resharding: an all-gather of the whole state.  Its cost: every
rank receives the whole model's parameters and optimizer state once (the old world's
snapshots, in host memory, for the length of the recovery), and builds one whole tensor at
a time.  Any placement the snapshot layout records (FSDP2's ``Shard(0)``, with TP within a
node too) is put back, since pieces are placed by their offsets.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from rankwatch.hooks.recovery.decide import Job
from rankwatch.hooks.recovery.snapshot import HEADER_MAX, Piece, PeerSnapshots

__all__ = ["ReshardFailed", "assemble"]

_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool")


class ReshardFailed(RuntimeError):
    """The snapshots do not make the new world's state."""


def _broadcast(piece: Piece | None, src: int, group: Any) -> Piece:
    import torch
    import torch.distributed as dist

    raw = json.dumps(piece.header).encode() if piece is not None else b""
    sizes = torch.tensor([len(raw), piece.payload.numel() if piece is not None else 0], dtype=torch.int64)
    dist.broadcast(sizes, src=src, group=group)
    hlen, plen = int(sizes[0]), int(sizes[1])
    if not (0 < hlen <= HEADER_MAX and 0 <= plen <= 1 << 40):
        raise ReshardFailed(f"rank {src} announced a snapshot of {hlen} + {plen} bytes")
    if piece is not None:
        dist.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8), src=src, group=group)
        dist.broadcast(piece.payload, src=src, group=group)
        return piece
    h = torch.empty(hlen, dtype=torch.uint8)
    dist.broadcast(h, src=src, group=group)
    payload = torch.empty(plen, dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=group)
    header = json.loads(h.numpy().tobytes())
    return Piece(step=int(header["step"]), header=header, payload=payload)


def _views(piece: Piece) -> dict[tuple[str, str, str], tuple[dict, Any]]:
    """Each entry of a snapshot, checked against its buffer, with its tensor view."""
    import torch

    out = {}
    n = piece.payload.numel()
    for e in piece.header.get("entries", ()):
        dtype = getattr(torch, str(e["dtype"]), None) if e["dtype"] in _DTYPES else None
        shape = [int(d) for d in e["shape"]]
        at, nbytes = int(e["at"]), int(e["bytes"])
        if dtype is None or len(shape) > 8 or min(shape, default=0) < 0 or not 0 <= at <= at + nbytes <= n \
                or math.prod(shape) * torch.empty((), dtype=dtype).element_size() != nbytes:
            raise ReshardFailed(f"a snapshot entry out of its buffer: {str(e)[:200]}")
        out[(str(e["kind"]), str(e["name"]), str(e["key"]))] = (e, piece.payload[at:at + nbytes].view(dtype).view(shape))
    return out


def _whole(parts: list[tuple[dict, Any]], shape: Sequence[int], like: Any) -> Any:
    """The whole tensor of ``shape``, from its pieces at their offsets."""
    import torch

    full = torch.empty(tuple(shape), dtype=like.dtype)
    seen, filled = set(), 0
    for e, v in parts:
        off = tuple(int(o) for o in e["offset"])
        if len(off) != len(shape) or any(o < 0 or o + s > w for o, s, w in zip(off, v.shape, shape)):
            raise ReshardFailed(f"{e['name']}: a piece at {off} outside the whole {list(shape)}")
        full[tuple(slice(o, o + s) for o, s in zip(off, v.shape))] = v
        if off not in seen:   # a piece replicated on several ranks counts once
            seen.add(off)
            filled += v.numel()
    if filled != full.numel():
        raise ReshardFailed(f"the snapshots hold {filled} of the {full.numel()} elements of a tensor")
    return full


def _mine(full: Any, p: Any) -> Any:
    """This rank's slice of ``full`` under ``p``'s placement (the whole of it for a plain tensor)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return full
    shape, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(off, shape))]


def assemble(job: Job, snaps: PeerSnapshots, providers: Sequence[tuple[int, int]], members: Sequence[int],
             rank: int, step: int) -> int:
    """Fill the job just built for the new world (``members``; this rank ``rank``) from the
    old members' snapshots, each broadcast by its provider (collective).  Restores this
    rank's CPU RNG state when its own snapshot is of the step.  Returns the bytes received."""
    import torch
    from torch.distributed.tensor import DTensor

    me = members[rank]
    pieces, got = [], 0
    for owner, provider in providers:
        src = members.index(provider)
        piece = _broadcast(snaps.piece(owner, me, step) if src == rank else None, src, snaps.group)
        got += 0 if src == rank else piece.payload.numel()
        if piece.step != step:
            raise ReshardFailed(f"member {owner}'s snapshot is of step {piece.step}, not {step}")
        pieces.append(_views(piece))
    with torch.no_grad():
        for name, p in job.model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            parts = [v[("p", name, "")] for v in pieces if ("p", name, "") in v]
            if len(parts) != len(pieces):
                raise ReshardFailed(f"{name}: not in every snapshot")
            local.copy_(_mine(_whole(parts, p.shape, local), p))
            keys = sorted({k for v in pieces for (kind, n, k) in v if kind == "o" and n == name})
            state = {}
            for k in keys:
                kparts = [v[("o", name, k)] for v in pieces if ("o", name, k) in v]
                e0, v0 = kparts[0]
                if e0["whole"] is None:   # the same on every rank (a step count)
                    val = v0.clone().to(local.device)
                else:
                    # A copy of its own: a view would keep the whole tensor alive, and DCP's
                    # async staging fails on a DTensor whose local tensor starts inside its storage.
                    mine = _mine(_whole(kparts, e0["whole"], v0), p).to(local.device, copy=True,
                                                                         memory_format=torch.contiguous_format)
                    val = DTensor.from_local(mine, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                             run_check=False) if isinstance(p, DTensor) else mine
                state[k] = val
            if state:
                job.optimizer.state[p] = state
    own = snaps.own_at(step)
    if own is not None and own.rng is not None:
        torch.set_rng_state(own.rng)
    return got
