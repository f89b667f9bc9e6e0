"""Peer snapshots: every ``K`` steps each rank copies its own shards into host memory and
sends that copy to a buddy rank on another node (:mod:`buddies`), so that a job without
whole replicas on nodes (plain FSDP2 over every rank) still finds every shard of a lost
node on a survivor.

What a snapshot holds: this rank's local shards of every parameter and of the optimizer
state (with each shard's place in the whole tensor), the step, the loop's data position
and the CPU RNG state.  It is taken as the asynchronous DCP save stages: the training
thread copies the shards into a host buffer it reuses (on a GPU: pinned, copied without a
host synchronisation, then an event), and a background thread sends it to the buddy and
receives the copies this rank holds, on a gloo process group of its own.  The step waits
for the copy only.  One exchange is in flight at a time: the next snapshot first waits
for the last one's.

Memory: the rank's own snapshot and the copies it holds, about 2x its shard bytes (the
buddy map gives each rank one source when the nodes have the same number of ranks).  A
copy being received is not a copy: its holder marks it incomplete until every byte came,
so a node lost during an exchange (its seconds are reported) may leave no copy of its
shards at that snapshot's step, and the tier falls back.  Assembling the new world's
shards from the snapshots is :mod:`reshard`'s.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from rankwatch.hooks.recovery.buddies import buddy_map, sources_of
from rankwatch.hooks.recovery.decide import Job

__all__ = ["HEADER_MAX", "Piece", "PeerSnapshots", "layout"]

log = logging.getLogger(__name__)

HEADER_MAX = 8 << 20
"""The most bytes of header a rank takes from a peer."""
_ALIGN = 64


@dataclass
class Piece:
    """One rank's snapshot: its header (plain data) and its bytes."""

    step: int
    header: dict
    payload: Any
    """A flat uint8 host tensor; the header's entries are views of it."""
    rng: Any = None
    """The CPU RNG state (own snapshots only)."""


@dataclass
class Stats:
    """What the last snapshot cost, for the monitor."""

    step: int = -1
    copy_seconds: float = 0.0
    send_seconds: float = 0.0
    sent_bytes: int = 0
    held_bytes: int = 0
    exchanges: int = 0
    failures: int = 0
    memory_bytes: int = 0

    @property
    def bandwidth(self) -> float:
        """Bytes a second of the last exchange (sent)."""
        return self.sent_bytes / self.send_seconds if self.send_seconds > 0 else 0.0


def _tensors(job: Job) -> list[tuple[str, str, str, Any, Any]]:
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
    for kind, name, key, t, p in _tensors(job):
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


class PeerSnapshots:
    """Args:
        every: take a snapshot every this many steps (0: never).
        device: the job's device type (``cuda``: pinned buffers, copied asynchronously).
    """

    def __init__(self, every: int, device: str = "cpu") -> None:
        if every < 0:
            raise ValueError(f"snapshot every {every} steps: must be >= 0")
        self.every = every
        self._device = device
        self._group: Any = None
        self._ids: tuple[int, ...] = ()
        self._buddy = -1
        self._sources: list[int] = []
        self.own: Piece | None = None
        self.held: dict[int, Piece] = {}
        """Complete copies this rank holds, by their owner's member id."""
        self.now: Piece | None = None
        """This rank's state at the step it completed, taken at a recovery that joiners wait
        for (the world grows from it); the own snapshot stays for a lost node's sake."""
        self._spare: dict[int, Any] = {}   # buffers to reuse, by owner id (own: -1)
        self._thread: threading.Thread | None = None
        self.stats = Stats()

    # -- the world -------------------------------------------------------------------
    def regroup(self, members: tuple[int, ...], node: str) -> None:
        """After each generation's default group exists (collective): the snapshots' own
        gloo group, every rank's node, and the buddy map.  The old snapshots stay until a
        recovery has used them (:meth:`forget`)."""
        import torch.distributed as dist

        self._group = dist.new_group(backend="gloo")
        nodes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, str(node)[:64], group=self._group)
        buddies = buddy_map([str(n) for n in nodes])
        rank = dist.get_rank()
        self._ids = tuple(members)
        self._buddy = buddies[rank]
        self._sources = sources_of(buddies, rank)

    @property
    def group(self) -> Any:
        return self._group

    def forget(self) -> None:
        """Drop every snapshot (a new world's layout makes them stale)."""
        self.own, self.held, self.now = None, {}, None

    def renew(self, job: Job, step: int) -> None:
        """After a recovery: the old world's snapshots dropped, this world's taken at ``step``."""
        self.wait()
        self.forget()
        self.take(job, step)

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def holdings(self) -> dict[str, Any]:
        """What this rank can provide after a failure: its own snapshot's step and the
        complete copies it holds (owner id -> step)."""
        return {"own": self.own.step if self.own is not None else -1,
                "now": self.now.step if self.now is not None else -1,
                "held": {str(o): p.step for o, p in self.held.items()}}

    def own_at(self, step: int) -> Piece | None:
        """This rank's own state of ``step``: the one kept now, or its snapshot."""
        return next((p for p in (self.now, self.own) if p is not None and p.step == step), None)

    def piece(self, owner: int, me: int, step: int) -> Piece:
        """The snapshot of member ``owner`` at ``step`` that this rank (member ``me``) holds."""
        got = self.own_at(step) if owner == me else self.held.get(owner)
        if got is None:
            raise KeyError(f"no snapshot of member {owner} at step {step} here")
        return got

    def keep_now(self, job: Job, step: int) -> None:
        """Copy this rank's state of ``step`` (just completed) beside the snapshots, for a
        recovery that lets joiners in (collective-free; its buffer goes at :meth:`forget`).
        Never raises: without it, the newest snapshot serves."""
        import torch

        try:
            entries, size = layout(job)
            buf = torch.empty(size, dtype=torch.uint8)
            _copy_in(job, entries, buf, non_blocking=False)
            header = {"step": step, "position": None, "entries": entries}
            self.now = Piece(step=step, header=header, payload=buf, rng=torch.get_rng_state())
        except Exception as exc:  # noqa: BLE001 - the snapshots still recover, from their step
            log.warning("rankwatch: copying the state of step %d for the joiners failed: %s", step, exc)

    # -- taking ----------------------------------------------------------------------
    def take(self, job: Job, step: int, position: int | None = None) -> Stats:
        """Copy this rank's shards (the step waits for this only), then exchange them with
        the buddies in the background; returns the stats (the exchange's are the last one's).
        Never raises: a failed snapshot leaves the last."""
        self._take(job, step, position)
        self.stats.memory_bytes = self.memory_bytes()
        return self.stats

    def _take(self, job: Job, step: int, position: int | None) -> None:
        import torch

        try:
            self.wait()
            t0 = time.perf_counter()
            entries, size = layout(job)
            buf = self._spare.get(-1)
            if buf is None or buf.numel() != size:
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=self._device == "cuda")
                self._spare[-1] = buf
            self.own = None   # being overwritten
            _copy_in(job, entries, buf, non_blocking=self._device == "cuda")
            ready = None
            if self._device == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            header = {"step": step, "position": position, "entries": entries}
            self.own = Piece(step=step, header=header, payload=buf, rng=torch.get_rng_state())
            self.stats.copy_seconds = time.perf_counter() - t0
            self.stats.step = step
            if self._group is None or self._buddy < 0 or (self._buddy == _rank() and not self._sources):
                return
            self._thread = threading.Thread(target=self._exchange, args=(self.own, ready), daemon=True,
                                            name="rankwatch-snapshot")
            self._thread.start()
        except Exception as exc:  # noqa: BLE001 - a snapshot never stops training
            self.stats.failures += 1
            log.warning("rankwatch: peer snapshot at step %d failed: %s", step, exc)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the exchange in flight; False if it is still running after ``timeout``."""
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                return False
            self._thread = None
        return True

    def _exchange(self, own: Piece, ready: Any) -> None:
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        try:
            if ready is not None:
                ready.synchronize()
            g = self._group
            raw = json.dumps(own.header).encode()
            sizes = torch.tensor([len(raw), own.payload.numel()], dtype=torch.int64)
            theirs = {q: torch.zeros(2, dtype=torch.int64) for q in self._sources}
            for q in self._sources:
                self.held.pop(self._ids[q], None)   # incomplete from here on
            works = [dist.isend(sizes, self._buddy, group=g)] + [dist.irecv(t, q, group=g) for q, t in theirs.items()]
            for w in works:
                w.wait()
            bufs = {}
            for q, t in theirs.items():
                hlen, plen = int(t[0]), int(t[1])
                if not (0 < hlen <= HEADER_MAX and 0 <= plen <= 1 << 40):
                    raise ValueError(f"rank {q} announced a snapshot of {hlen} + {plen} bytes")
                spare = self._spare.get(self._ids[q])
                payload = spare if spare is not None and spare.numel() == plen else torch.empty(plen, dtype=torch.uint8)
                self._spare[self._ids[q]] = payload
                bufs[q] = (torch.empty(hlen, dtype=torch.uint8), payload)
            works = [dist.isend(torch.frombuffer(bytearray(raw), dtype=torch.uint8), self._buddy, group=g),
                     dist.isend(own.payload, self._buddy, group=g)]
            works += [dist.irecv(b, q, group=g) for q, pair in bufs.items() for b in pair]
            for w in works:
                w.wait()
            for q, (h, payload) in bufs.items():
                header = json.loads(h.numpy().tobytes())
                self.held[self._ids[q]] = Piece(step=int(header["step"]), header=header, payload=payload)
            self.stats.send_seconds = time.perf_counter() - t0
            self.stats.sent_bytes = own.payload.numel()
            self.stats.held_bytes = sum(p.payload.numel() for p in self.held.values())
            self.stats.exchanges += 1
        except Exception as exc:  # noqa: BLE001 - a peer lost mid-exchange: the tier decides from what is whole
            self.stats.failures += 1
            log.warning("rankwatch: peer snapshot exchange of step %d failed: %s", own.step,
                        str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)

    def memory_bytes(self) -> int:
        """Host bytes the snapshots hold (own and copies, with the buffers kept for reuse)."""
        return sum(b.numel() for b in self._spare.values())


def _copy_in(job: Job, entries: list[dict], buf: Any, non_blocking: bool) -> None:
    """Copy the job's tensors into ``buf`` at the places ``entries`` (its :func:`layout`) give."""
    for e, (_, _, _, t, _) in zip(entries, _tensors(job)):
        buf[e["at"]:e["at"] + e["bytes"]].view(t.dtype).view(t.shape).copy_(t, non_blocking=non_blocking)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()
