"""One rank's collective latency per op: recent p50/p99 and a count, for ``status``.

``/metrics`` has the node's histograms by op (never per rank, by design); ``status``
shows each rank's own figures, so a slow link or a rank that waits more stands out.
Each op keeps a ring of its most recent durations; a batch of records costs a few
numpy calls, one per op present in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rankwatch.proto import pb

__all__ = ["OpLatency", "OpSummary", "to_pb"]


@dataclass(frozen=True)
class OpSummary:
    count: int
    """Calls since the rank connected."""
    p50: float
    """Seconds, over the recent window."""
    p99: float
    window: int
    """Calls the quantiles are over."""


class OpLatency:
    """Args:
        ops: the op names, by the agent's op index.
        window: recent calls kept per op.
    """

    def __init__(self, ops: Sequence[str], window: int = 512) -> None:
        self.ops = tuple(ops)
        self.window = window
        # One ring per op the rank has called, made on its first call: a rank uses a few of
        # the ops, and an agent keeps hundreds of ranks (and sees thousands come and go).
        self._ring: dict[int, np.ndarray] = {}
        self._count = [0] * len(self.ops)   # calls per op since the rank connected

    def observe(self, ops: np.ndarray, durations: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Add ``durations[i]`` (seconds) to op ``ops[i]`` for every i.

        ``counts``, if the caller has it, is ``np.bincount(ops, minlength=len(self.ops))``: the
        ops present are read off it rather than found by a sort of ``ops``.
        """
        if counts is None:
            counts = np.bincount(ops, minlength=len(self.ops))
        n = counts.tolist()
        present = [op for op, k in enumerate(n) if k]
        if len(present) == 1:   # a batch of one op: its durations are the whole column
            self._write(present[0], durations, n[present[0]])
            return
        for op in present:
            self._write(op, durations[ops == op], n[op])

    def _write(self, op: int, values: np.ndarray, n: int) -> None:
        """Op ``op``'s ``n`` new durations ``values`` into its ring, after the ones before."""
        window = self.window
        ring = self._ring.get(op)
        if ring is None:
            ring = self._ring[op] = np.zeros(window, dtype=np.float64)
        values = values[-window:]
        m = values.size
        start = self._count[op] % window
        first = min(m, window - start)   # up to the ring's end, then the rest from its start
        ring[start:start + first] = values[:first]
        if m > first:
            ring[:m - first] = values[first:]
        self._count[op] += n

    def summary(self) -> dict[str, OpSummary]:
        """Each op the rank has called: its count and recent quantiles."""
        out = {}
        for i, count in enumerate(self._count):
            if not count:
                continue
            n = min(count, self.window)
            p50, p99 = np.quantile(self._ring[i][:n], (0.5, 0.99))
            out[self.ops[i]] = OpSummary(count=count, p50=float(p50), p99=float(p99), window=n)
        return out


def to_pb(latency: OpLatency) -> dict[str, pb.OpLatency]:
    """The wire form of a rank's :meth:`OpLatency.summary` (``RankStatus``/``RankSummary.op_latency``)."""
    return {op: pb.OpLatency(count=s.count, p50_seconds=s.p50, p99_seconds=s.p99, window=s.window)
            for op, s in latency.summary().items()}
