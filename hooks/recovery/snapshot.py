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
from rankwatch.hooks.recovery.shard_buffer import before_next_step, copy_in, copy_into, layout, shard_tensors

__all__ = ["HEADER_MAX", "Piece", "PeerSnapshots", "layout"]

log = logging.getLogger(__name__)

HEADER_MAX = 8 << 20
"""The most bytes of header a rank takes from a peer."""


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
    work_seconds: float = 0.0
    """CPU seconds of the last snapshot's background thread (its copy, if there, and the exchange)."""
    window_seconds: float = 0.0
    """The last snapshot's copy and exchange, start to end: its exchange window."""
    every: int = 0
    """Steps between snapshots (the plan's; 0: off)."""
    reason: int = 0
    """Why (an index into :data:`~rankwatch.hooks.recovery.budget.REASONS`)."""

    @property
    def cost_seconds(self) -> float:
        """What one snapshot costs the training: the step's stall and the background CPU time."""
        return self.copy_seconds + self.work_seconds

    @property
    def bandwidth(self) -> float:
        """Bytes a second of the last exchange (sent)."""
        return self.sent_bytes / self.send_seconds if self.send_seconds > 0 else 0.0


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
        self.nodes = 0
        """The current world's nodes."""
        self._copied: Any = None   # set once a background copy is done (threading.Event)
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
        self.nodes = len(set(nodes))
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
            copy_in(job, entries, buf, non_blocking=False)
            header = {"step": step, "position": None, "entries": entries}
            self.now = Piece(step=step, header=header, payload=buf, rng=torch.get_rng_state())
        except Exception as exc:  # noqa: BLE001 - the snapshots still recover, from their step
            log.warning("rankwatch: copying the state of step %d for the joiners failed: %s", step, exc)

    # -- taking ----------------------------------------------------------------------
    def take(self, job: Job, step: int, position: int | None = None, background: bool = False) -> Stats:
        """Copy this rank's shards, then exchange them with the buddies in the background;
        returns the stats (the exchange's are the last one's).  With ``background`` the copy
        runs beside the next step too (on a GPU: a side stream; on the CPU: the exchange's
        thread), and that step's ``job.optimizer.step()`` waits for it first, so the copy is
        the step's state, whole.  Never raises: a failed snapshot leaves the last."""
        self._take(job, step, position, background)
        self.stats.memory_bytes = self.memory_bytes()
        return self.stats

    def _take(self, job: Job, step: int, position: int | None, background: bool) -> None:
        import torch

        try:
            self.wait()
            t0 = time.perf_counter()
            entries, size = layout(job)
            tensors = [t for _, _, _, t, _ in shard_tensors(job)]
            buf = self._spare.get(-1)
            if buf is None or buf.numel() != size:
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=self._device == "cuda")
                self._spare[-1] = buf
            self.own = None   # being overwritten
            header = {"step": step, "position": position, "entries": entries}
            piece = Piece(step=step, header=header, payload=buf, rng=torch.get_rng_state())
            pending, ready = None, None
            if background and self._device == "cpu":
                pending = (entries, tensors)
                self._copied = threading.Event()
                before_next_step(job, self._copy_done)
            elif self._device == "cuda":
                ready = self._launch(entries, tensors, buf, job if background else None)
                self.own = piece
            else:
                copy_into(entries, tensors, buf, non_blocking=False)
                self.own = piece
            self.stats.copy_seconds = time.perf_counter() - t0
            self.stats.step = step
            if pending is None and not self._partners():
                return
            self._thread = threading.Thread(target=self._background, args=(piece, ready, pending), daemon=True,
                                            name="rankwatch-snapshot")
            self._thread.start()
        except Exception as exc:  # noqa: BLE001 - a snapshot never stops training
            self.stats.failures += 1
            log.warning("rankwatch: peer snapshot at step %d failed: %s", step, exc)

    def _partners(self) -> bool:
        return not (self._group is None or self._buddy < 0 or (self._buddy == _rank() and not self._sources))

    def _launch(self, entries: list[dict], tensors: list, buf: Any, job: Job | None) -> Any:
        """On a GPU (not run on this project's CPU machines): the copy into the pinned buffer,
        enqueued without a host synchronisation; returns its event.  With ``job``, on a side
        stream that starts after the step's work, and the next optimizer step's work waits for
        it on the device; else on the current stream, ahead of the next step's kernels."""
        import torch

        if job is None:
            copy_into(entries, tensors, buf, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            return ready
        side = self._stream = getattr(self, "_stream", None) or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            copy_into(entries, tensors, buf, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(side)
        before_next_step(job, lambda: torch.cuda.current_stream().wait_event(ready))
        return ready

    def _copy_done(self) -> None:
        """Before the next optimizer step: wait for the background copy (the step's stall)."""
        t0 = time.perf_counter()
        if self._copied is not None and not self._copied.wait(60.0):
            log.warning("rankwatch: the peer snapshot's copy took over 60 s; the step goes on")
        self.stats.copy_seconds += time.perf_counter() - t0

    def _background(self, own: Piece, ready: Any, pending: tuple | None) -> None:
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            if pending is not None:
                try:
                    copy_into(*pending, own.payload, non_blocking=False)
                    self.own = own
                finally:
                    self._copied.set()
            if self._partners():
                self._exchange(own, ready)
        except Exception as exc:  # noqa: BLE001 - a snapshot never stops training
            self.stats.failures += 1
            log.warning("rankwatch: peer snapshot at step %d failed: %s", own.step, exc)
        finally:
            self.stats.work_seconds = time.thread_time() - c0
            self.stats.window_seconds = time.perf_counter() - t0

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


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()
