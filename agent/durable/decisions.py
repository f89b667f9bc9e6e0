"""The job's decision log: typed coordinator decisions, ids that never repeat.

A decision's id is the job's run id plus its place in the log (``job1/exclude-3``), and
an exclusion moves the restart generation on by one.  Both continue whatever the log
already holds: decisions this agent made or applied, decisions the node agents report
in their summaries (:meth:`DecisionLog.adopt`), and the counters of the decisions file
in the state directory.  So a coordinator that takes over, or one restarted for the
same job, never reissues an id or a generation that nodes and the rendezvous store
already know (they would drop it as applied, and no node would restart).

Each decision is appended to ``decisions.jsonl`` with the run id.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankwatch.agent.durable import jsonl
from rankwatch.proto import pb

__all__ = ["Decision", "DecisionLog"]

log = logging.getLogger(__name__)

_KINDS = ("exclude", "checkpoint")
_MAX_INT = 1 << 53
_MAX_TEXT = 4096


@dataclass(frozen=True, kw_only=True)
class Decision:
    id: str
    kind: str
    """exclude or checkpoint."""
    node: str = ""
    """The node concerned (exclude)."""
    generation: int
    """The restart generation after this decision."""
    step: int = 0
    """The step every rank saves at (checkpoint)."""
    reason: str
    decided_at: float
    run_id: str = ""
    seq: int = 0
    """Its place in the job's log, from 1."""

    def to_pb(self) -> pb.Decision:
        return pb.Decision(id=self.id, kind=self.kind, node=self.node, generation=self.generation,
                           step=self.step, reason=self.reason, decided_at=self.decided_at,
                           run_id=self.run_id, seq=self.seq)

    @classmethod
    def from_pb(cls, d: pb.Decision) -> Decision:
        return cls(id=d.id, kind=d.kind, node=d.node, generation=d.generation, step=d.step,
                   reason=d.reason, decided_at=d.decided_at, run_id=d.run_id, seq=d.seq)

    @classmethod
    def from_json(cls, r: Mapping[str, Any]) -> Decision:
        """A decision read back from a store another process writes (etcd).

        Raises:
            ValueError: a field missing, of the wrong type or out of range.
        """
        try:
            kind, ints, text = r["kind"], {k: r[k] for k in ("generation", "step", "seq")}, \
                {k: r[k] for k in ("id", "node", "reason", "run_id")}
            decided_at = float(r["decided_at"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"decision record: {exc!r}") from None
        if kind not in _KINDS:
            raise ValueError(f"decision kind {kind!r}")
        for k, v in ints.items():
            if type(v) is not int or not 0 <= v <= _MAX_INT:
                raise ValueError(f"decision {k} {v!r} out of range")
        for k, v in text.items():
            if not isinstance(v, str) or len(v) > _MAX_TEXT:
                raise ValueError(f"decision {k}: not a string of at most {_MAX_TEXT} characters")
        if not math.isfinite(decided_at):
            raise ValueError("decision decided_at is not finite")
        return cls(kind=kind, decided_at=decided_at, **ints, **text)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "node": self.node, "generation": self.generation,
                "step": self.step, "reason": self.reason, "decided_at": self.decided_at,
                "run_id": self.run_id, "seq": self.seq}


class DecisionLog:
    """Args:
        path: ``decisions.jsonl``, appended to; its counters (highest seq and generation)
            are read at start, never its decisions (they may be an earlier run's).
            None keeps the log in memory only.
        run_id: the job's run id, stamped on each decision (set later once known).
    """

    def __init__(self, path: Path | None = None, run_id: str = "") -> None:
        self.path = path
        self.writer = jsonl.Writer(path) if path is not None else None
        self.run_id = run_id
        self._lock = threading.Lock()
        self._items: list[Decision] = []
        self._ids: set[str] = set()
        self._excluded: dict[str, str] = {}   # node -> its first exclusion's reason, kept as they come
        self._seq = 0
        self._generation = 0
        self.sink: Callable[[Decision], None] | None = None
        """Also called with each decision made here (the job's log in etcd, with an election)."""
        if path is not None:
            self._seq, self._generation = _counters(path)

    @property
    def items(self) -> list[Decision]:
        with self._lock:
            return list(self._items)

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    @property
    def excluded(self) -> dict[str, str]:
        """Excluded node -> why (its first exclusion's reason)."""
        with self._lock:
            return dict(self._excluded)

    def knows(self, decision_id: str) -> bool:
        return decision_id in self._ids

    def __len__(self) -> int:
        return len(self._items)

    def get(self, decision_id: str) -> Decision | None:
        with self._lock:
            return next((d for d in self._items if d.id == decision_id), None)

    def decide(self, kind: str, *, now: float, reason: str, node: str = "", step: int = 0) -> Decision:
        """Append a new decision; an ``exclude`` moves the restart generation on."""
        with self._lock:
            self._seq += 1
            if kind == "exclude":
                self._generation += 1
            tag = f"{self.run_id}/" if self.run_id else ""
            d = Decision(id=f"{tag}{kind}-{self._seq}", kind=kind, node=node, generation=self._generation,
                         step=step, reason=reason, decided_at=now, run_id=self.run_id, seq=self._seq)
            self._append(d)
        if self.sink is not None:
            try:
                self.sink(d)
            except Exception as exc:  # noqa: BLE001 - the decision stands; the store is best effort
                log.warning("decision %s not recorded in the job's store: %s", d.id, exc)
        return d

    def adopt(self, decisions: Iterable[Decision]) -> list[Decision]:
        """Keep decisions made elsewhere (an earlier coordinator's); return those new here.

        The counters move past them, so the next :meth:`decide` continues after them.
        """
        fresh = []
        with self._lock:
            for d in decisions:
                if d.id in self._ids:
                    continue
                self._append(d)
                self._seq = max(self._seq, d.seq)
                self._generation = max(self._generation, d.generation)
                fresh.append(d)
        return fresh

    def _append(self, d: Decision) -> None:
        """Keep and write ``d`` (the lock held)."""
        self._items.append(d)
        self._ids.add(d.id)
        if d.kind == "exclude":
            self._excluded.setdefault(d.node, d.reason)
        self._write(d)

    def _write(self, d: Decision) -> None:
        if self.writer is not None:
            self.writer.append(d.to_json())   # a failed write waits in the writer's spool, retried


def _counters(path: Path) -> tuple[int, int]:
    """The highest seq and generation a decisions file holds ((0, 0) if none)."""
    seq = generation = 0
    try:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                    seq = max(seq, int(record.get("seq") or 0))
                    generation = max(generation, int(record.get("generation") or 0))
                except (ValueError, TypeError, AttributeError):
                    continue  # a line cut short by a crash
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not read %s: %s", path, exc)
    return seq, generation
