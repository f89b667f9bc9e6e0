"""The agent's record of its ranks' steps: the rankwatch trace format, written in its state
directory as the records arrive, so that ``rankwatch analyze <state dir>`` reads any past job.

Where and how much: ``<state_dir>/history/steps-<node>-<seq>.jsonl.gz``, gzip-compressed JSON
Lines, one row per timed operation (``docs/analyze.md``); rows of a rank-step tile the step
as :mod:`.step_rows` says, so an analyser reads the same own work, data wait and collective
wait the live detectors used.  All files together hold at most ``max_bytes``
(:data:`DEFAULT_MAX_BYTES`, ``rankwatch agent --history-bytes``; 0 writes nothing): the
oldest file is deleted first (:mod:`.rotating`).  A file is finished at an eighth of that
(at most 16 MiB), and what was taken is written as one gzip member every ``flush_seconds``
or ``flush_bytes`` of rows, so a crash loses at most that.

Cost on the ingest path: :class:`StepLog` is a :class:`NodeState` listener of both kinds; a
listener call appends a reference to the batch's columns to a bounded queue (a lock, an
append, a counter).  When the queue holds ``queue_records`` records the batch is dropped
and counted, never waited for.  Rows are made, compressed and written on the writer's own
thread.  A failed write (a full disk) is logged once, counted, and the agent goes on.
"""

from __future__ import annotations

import gzip
import logging
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rankwatch.agent.durable.rotating import RotatingFiles
from rankwatch.agent.durable.step_rows import RankRows
from rankwatch.agent.wire.bounds import MAX_RANK_IDS

__all__ = ["DEFAULT_MAX_BYTES", "HISTORY_DIR", "StepLog"]

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 << 20
"""The agent's step history holds at most this much by default (256 MiB: some 400,000
rank-steps of the harness, about 650 bytes each compressed)."""
HISTORY_DIR = "history"
_STEP_WEIGHT = 8   # a step record counts as this many records in the queue (the rows it makes)


class StepLog:
    """Args:
        directory: the history directory (``<state_dir>/history``).
        node: this node's id (in the file names and every row).
        op_names: the names of the agent's op indices (the collective listener's ``ops``).
        max_bytes: the bound on the directory's files (> 0).
        flush_seconds, flush_bytes: a gzip member is written this often, or once the rows
            taken hold this many bytes (uncompressed).
        queue_records: records taken and not yet written before a batch is dropped.
        background: the first records start the writer thread (False: the caller drains).
    """

    def __init__(self, directory: Path, node: str, op_names: Sequence[str], max_bytes: int = DEFAULT_MAX_BYTES,
                 *, flush_seconds: float = 2.0, flush_bytes: int = 1 << 20, queue_records: int = 1 << 18,
                 background: bool = True) -> None:
        if max_bytes <= 0:
            raise ValueError("StepLog.max_bytes must be positive (0 turns the history off: make no StepLog)")
        self.directory, self.node, self.op_names = directory, node, list(op_names)
        stem = "steps-" + (re.sub(r"[^A-Za-z0-9_.-]", "_", node)[:64] or "node")
        self.files = RotatingFiles(directory, stem, max_bytes, min(max(max_bytes // 8, 1), 16 << 20))
        self.flush_seconds, self.flush_bytes, self.queue_records = flush_seconds, flush_bytes, queue_records
        self._queue: deque[tuple] = deque()
        self._queued = 0
        self._lock = threading.Lock()
        self._drain_lock = threading.Lock()   # one drain at a time (the writer's, or a caller's)
        self._ranks: OrderedDict[int, tuple[int, RankRows]] = OrderedDict()   # rank -> (pid, rows)
        self._buffer: list[str] = []
        self._job = ""   # the job whose rows the current file holds
        self._buffered = 0
        self._flushed_at = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._background = background
        self.dropped = 0
        """Records dropped because the queue was full."""
        self.busy_seconds = 0.0
        """Writer thread time spent making, compressing and writing rows."""

    @classmethod
    def attach(cls, state: Any, state_dir: Path | None, op_names: Sequence[str], max_bytes: int) -> StepLog | None:
        """A step log listening to ``state`` (a ``NodeState``); None without a state
        directory or with ``max_bytes`` 0."""
        if state_dir is None or max_bytes <= 0:
            return None
        steplog = cls(state_dir / HISTORY_DIR, state.node_id, op_names, max_bytes)
        state.collective_listeners.append(steplog.on_collectives)
        state.step_listeners.append(steplog.on_steps)
        return steplog

    # -- listeners: the ingesting thread --------------------------------------------------
    def on_collectives(self, rank: Any, ops: Any, cols: dict, names: list[str]) -> None:
        self._put(len(ops), ("c", rank.rank, rank.pid, rank.node, ops, cols, names))

    def on_steps(self, rank: Any, steps: Any) -> None:
        self._put(len(steps.step) * _STEP_WEIGHT,
                  ("s", rank.rank, rank.pid, rank.node, rank.mesh_coords, steps, getattr(rank, "job_id", "")))

    def _put(self, n: int, item: tuple) -> None:
        with self._lock:
            if self._queued + n > self.queue_records:
                self.dropped += n
                return
            self._queued += n
            self._queue.append((n, item))
            if self._thread is None and self._background:   # the first records: the writer starts
                self.start()

    @property
    def queued(self) -> int:
        return self._queued

    # -- the writer thread ------------------------------------------------------------
    def start(self) -> None:
        """Start the writer thread (the first records taken start it)."""
        self._thread = threading.Thread(target=self._run, name="rankwatch-history", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Write what was taken and stop the writer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self.drain(final=True)

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(0.2)
            try:
                self.drain(final=stopping)
            except Exception:  # noqa: BLE001 - the history never stops the agent
                log.exception("step history writer")
            if stopping:
                return

    def drain(self, final: bool = False) -> None:
        """Make rows of everything queued; write a member when one is due (or ``final``)."""
        with self._drain_lock:
            self._drain(final)

    def _drain(self, final: bool) -> None:
        started = time.perf_counter()
        while True:
            with self._lock:
                if not self._queue:
                    break
                n, item = self._queue.popleft()
                self._queued -= n
            self._take(item)
            if self._buffered >= self.flush_bytes:
                self._flush()
        if self._buffer and (final or time.monotonic() - self._flushed_at >= self.flush_seconds):
            self._flush()
        self.busy_seconds += time.perf_counter() - started

    def _take(self, item: tuple) -> None:
        kind, rank, pid, node = item[:4]
        rows = self._rows_of(rank, pid, node)
        if kind == "c":
            rows.add_collectives(*item[4:])
            return
        coords, steps, job = item[4:]
        if job != self._job:   # a file holds one job's rows (a reader picks the latest job's files)
            if self._buffer:
                self._flush()
            self.files.next_file()
            self._job = job
        lines = rows.lines(steps, coords, job)
        self._buffer.extend(lines)
        self._buffered += sum(map(len, lines)) + len(lines)

    def _rows_of(self, rank: int, pid: int, node: str) -> RankRows:
        """The rank's rows; started again when its process changes (a restarted worker)."""
        held = self._ranks.get(rank)
        if held is None or held[0] != pid:
            held = (pid, RankRows(rank, node, self.op_names))
            self._ranks[rank] = held
            while len(self._ranks) > MAX_RANK_IDS:
                self._ranks.popitem(last=False)
        self._ranks.move_to_end(rank)
        return held[1]

    def _flush(self) -> None:
        rows = len(self._buffer)
        data = ("\n".join(self._buffer) + "\n").encode()
        self._buffer, self._buffered = [], 0
        self._flushed_at = time.monotonic()
        self.files.write(gzip.compress(data, compresslevel=6, mtime=0), rows)

    @property
    def outside(self) -> int:
        """Collective records that fell in no step (between steps, or in an evaluation)."""
        return sum(rows.outside for _, rows in list(self._ranks.values()))
