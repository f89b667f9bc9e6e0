"""Checkpoints with torch.distributed.checkpoint (DCP), complete or not at all.

A checkpoint is a directory ``step_<N>`` holding the DCP shards, each rank's
RNG state and, written last and atomically by rank 0 after every rank has
finished, ``COMPLETE`` (JSON with the step).  Only directories with that
marker are ever loaded, so a save cut short is ignored on resume.

Saves are asynchronous by default (``dcp.async_save``): the training thread
only stages the state (a CPU copy) and goes on; a background thread writes the
shards and runs DCP's own gather on a dedicated gloo group, so it never
interleaves with the training collectives.  DCP's coordinator (rank 0) writes
``.metadata`` only after every rank's shards are written, and rank 0's future
completes after that, so rank 0 writes ``COMPLETE`` from its completion
callback.  One save is in flight at a time: a save that comes due while the
previous one is still writing waits for it.

DCP reports a failed save (a full disk, a peer lost mid-save) as
``CheckpointException``, which derives from ``BaseException``: an ``except
Exception`` lets it through.  Here it becomes :class:`SaveFailed` (a
``RuntimeError`` carrying DCP's message, which names each rank's failure) in
the training thread, and a failed record in the background, so that a failed
save is reported, an in-process recovery still recognises a lost peer in it,
and the next save never waits for a write that will not finish.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["Checkpointer", "LoadFailed", "SaveFailed", "SaveRecord", "complete_checkpoints", "latest_complete"]

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
_ERROR_CHARS = 4000   # DCP's message holds every failed rank's traceback
_STEP_DIR = re.compile(r"^step_(\d+)$")


class SaveFailed(RuntimeError):
    """A save that DCP failed (its ``CheckpointException``, as an ordinary exception)."""


class LoadFailed(RuntimeError):
    """Complete checkpoints exist, and none of them could be loaded."""


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root`` as ``(step, path)``, newest first."""
    found = []
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if not m or not (entry / MARKER).is_file():
            continue
        try:
            step = int(json.loads((entry / MARKER).read_text())["step"])
        except (ValueError, KeyError, OSError):
            log.warning("rankwatch: ignoring checkpoint %s with an unreadable marker", entry)
            continue
        found.append((step, entry))
    return sorted(found, key=lambda sp: sp[0], reverse=True)


def latest_complete(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root`` as ``(step, path)``, or None."""
    found = complete_checkpoints(root)
    return found[0] if found else None


@dataclass
class SaveRecord:
    """One save as this rank saw it."""

    step: int
    path: Path
    started_at: float
    """Unix seconds."""
    blocked: float = 0.0
    """Seconds the training thread spent on it."""
    completed_after: float = 0.0
    """Seconds from the start until this rank's part was written (and, on rank 0, marked)."""
    asynchronous: bool = False
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(kw_only=True)
class Checkpointer:
    root: Path
    """Directory holding ``step_<N>`` checkpoints."""
    interval: int = 0
    """Save every this many steps; 0 saves only on request."""
    keep: int = 3
    """Complete checkpoints kept; older ones are deleted."""
    asynchronous: bool = True
    """Write in the background (``dcp.async_save``); False blocks until written."""
    _group: Any = field(default=None, init=False, repr=False)
    _pending: tuple[SaveRecord, threading.Event] | None = field(default=None, init=False, repr=False)
    _finished: list[SaveRecord] = field(default_factory=list, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def setup(self) -> None:
        """Create the background saves' gloo group (collective: every rank calls it, once)."""
        if self.asynchronous and self._group is None:
            self._group = dist.new_group(backend="gloo")

    def regroup(self) -> None:
        """After an in-process recovery (collective over the new world): create the background
        saves' group anew, so that no later save runs on a group of the old world.

        A save still in flight on the old groups never completes: a lost peer cut it (its
        marker is never written, and its record comes out of :meth:`finished` failed).  A
        recovery that the job chose (admitting joiners) waits for it first (:meth:`wait`,
        which the tier's ``drain`` calls): its save is written and marked."""
        if self._pending is not None:
            rec, written = self._pending
            if not written.is_set():
                log.warning("rankwatch: the save of step %d was cut short by the failure; it is not "
                            "marked complete", rec.step)
            self._pending = None
        self._group = None
        self.setup()

    def due(self, step: int) -> bool:
        return self.interval > 0 and step > 0 and step % self.interval == 0

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any] | None = None) -> SaveRecord:
        """Save ``step`` on every rank (collective); rank 0 marks it complete once all have written.

        Returns this rank's record; an asynchronous save's record is finished
        later and handed out by :meth:`finished`.  Raises if the synchronous part
        fails (the state could not be staged).
        """
        t0 = time.perf_counter()
        self.wait()  # one save in flight
        rec = SaveRecord(step=step, path=self.root / f"step_{step:08d}", started_at=time.time(),
                         asynchronous=self.asynchronous)
        rank = dist.get_rank()
        if rank == 0:
            if (rec.path / MARKER).exists():  # an old run's complete save of this step
                shutil.rmtree(rec.path)
            rec.path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        torch.save({"cpu": torch.get_rng_state()}, rec.path / f"rng_rank{rank}.pt")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        marker = json.dumps({"step": step, **(extra or {})})
        if not self.asynchronous:
            try:
                dcp.save(state, checkpoint_id=str(rec.path))
            except CheckpointException as exc:
                raise SaveFailed(str(exc)) from exc
            dist.barrier()
            if rank == 0:
                self._complete(rec.path, marker)
            rec.blocked = rec.completed_after = time.perf_counter() - t0
            with self._lock:
                self._finished.append(rec)
            return rec
        if self._group is None:
            self.setup()
        try:
            future = dcp.async_save(state, checkpoint_id=str(rec.path), process_group=self._group)
        except CheckpointException as exc:
            raise SaveFailed(str(exc)) from exc
        if not isinstance(future, Future):  # an AsyncSaveResponse (a non-default stager)
            future = future.upload_completion
        written = threading.Event()
        self._pending = (rec, written)
        future.add_done_callback(lambda f: self._done(rec, f, t0, marker if rank == 0 else None, written))
        rec.blocked = time.perf_counter() - t0
        return rec

    def _done(self, rec: SaveRecord, future: Future, t0: float, marker: str | None,
              written: threading.Event) -> None:
        """The background write finished (on the writer thread); whatever happened, the save
        is recorded and ``written`` set, or the next save would wait for it for ever."""
        try:
            future.result()
            if marker is not None:
                self._complete(rec.path, marker)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported through finished()
            rec.error = f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]
            log.error("rankwatch: checkpoint of step %d failed: %s", rec.step, rec.error)
        finally:
            rec.completed_after = time.perf_counter() - t0
            with self._lock:
                self._finished.append(rec)
            written.set()

    def finished(self) -> list[SaveRecord]:
        """Saves that completed (or failed) since the last call; cheap, call it every step."""
        if not self._finished:
            return []
        with self._lock:
            done, self._finished = self._finished, []
        if self._pending is not None and self._pending[0] in done:
            self._pending = None
        return done

    def wait(self) -> float:
        """Block until the save in flight (if any) is written; return the seconds waited."""
        if self._pending is None:
            return 0.0
        t0 = time.perf_counter()
        self._pending[1].wait()
        return time.perf_counter() - t0

    def _complete(self, path: Path, marker: str) -> None:
        _atomic_write(path / MARKER, marker)
        self._prune()

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, dict]:
        """Load the newest complete checkpoint that every rank can read; return ``(step, extra)``,
        or ``(0, {})`` when there is none (collective: every rank calls it).

        A complete checkpoint that fails to load on any rank (a shard cut short or corrupted
        after its marker was written, an unreadable RNG file) is skipped by every rank alike,
        and the one before it is tried: a restart must not fail on the same bad checkpoint
        every time.  Rank 0 renames the bad one's marker to ``COMPLETE.unreadable`` (its
        files are kept for a look).  Raises :class:`LoadFailed` if complete checkpoints exist
        and none loads: starting again from step 0 would lose the run's progress silently.
        """
        found = complete_checkpoints(self.root)
        errors = []
        for step, path in found:
            try:
                extra = self._load_one(path, model, optimizer)
                error = ""
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - agreed on, then the next
                error = f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]
            # Every rank moves on together: a failure on one rank fails the load for all.
            said: list[str] = [""] * dist.get_world_size()
            dist.all_gather_object(said, error)
            failed = [(r, e) for r, e in enumerate(said) if e]
            if not failed:
                log.info("rankwatch: resumed from %s (step %d)", path, step)
                return step, extra
            rank, why = failed[0]
            # DCP's message opens with the failed ranks and ends with the cause.
            lines = why.strip().splitlines()
            why = lines[-1] if lines[0].startswith("CheckpointException") else lines[0]
            log.error("rankwatch: checkpoint %s could not be loaded (rank %d: %s); trying the one before it",
                      path, rank, why[:500])
            errors.append(f"{path.name}: {why[:500]}")
            if dist.get_rank() == 0:
                with contextlib.suppress(OSError):
                    os.replace(path / MARKER, path / f"{MARKER}.unreadable")
            dist.barrier()   # no rank lists the checkpoints again before the marker is gone
        if errors:
            raise LoadFailed(f"none of the {len(found)} complete checkpoint(s) in {self.root} could be loaded: "
                             + "; ".join(errors))
        return 0, {}

    def _load_one(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        extra = json.loads((path / MARKER).read_text())
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        rng = path / f"rng_rank{dist.get_rank()}.pt"
        if rng.is_file():  # absent when resuming at a larger world size
            torch.set_rng_state(torch.load(rng, weights_only=True)["cpu"])
        return extra

    def _prune(self) -> None:
        complete = sorted(
            (int(m.group(1)), p) for p in self.root.iterdir()
            if (m := _STEP_DIR.match(p.name)) and (p / MARKER).is_file())
        for _, path in complete[:-self.keep] if self.keep > 0 else []:
            shutil.rmtree(path, ignore_errors=True)
        newest = complete[-1][0] if complete else -1
        for p in self.root.iterdir():  # half-written saves older than the newest complete one
            m = _STEP_DIR.match(p.name)
            if m and int(m.group(1)) < newest and not (p / MARKER).is_file():
                shutil.rmtree(p, ignore_errors=True)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
