"""One rank's collective latency per op: recent p50/p99 and a count, for ``status``.

``/metrics`` has the node's histograms by op (never per rank, by design); ``status``
shows each rank's own figures, so a slow link or a rank that waits more stands out.
Each op keeps a ring of its most recent durations. A batch of several ops is grouped by op
with one stable sort (a radix sort for the agent's one-byte op indices), then each op's run is
copied into its ring as one or two slices. Quantiles are taken with one partial sort per op,
and only for an op called since they were last taken (``status`` and the node's sync ask for
them several times a second).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rankwatch.proto import pb

__all__ = ["OpLatency", "OpSummary", "quantiles", "to_pb"]


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
        self._summary: dict[int, OpSummary] = {}   # op -> its summary at its count then

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
        grouped = durations[np.argsort(ops, kind="stable")]   # by op, each op's calls in order
        start = 0
        for op in present:   # ascending, as the sort put them
            end = start + n[op]
            self._write(op, grouped[start:end], n[op])
            start = end

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
            s = self._summary.get(i)
            if s is None or s.count != count:
                n = min(count, self.window)
                p50, p99 = quantiles(self._ring[i][:n], (0.5, 0.99))
                s = self._summary[i] = OpSummary(count=count, p50=p50, p99=p99, window=n)
            out[self.ops[i]] = s
        return out


def quantiles(x: np.ndarray, qs: Sequence[float]) -> list[float]:
    """``np.quantile(x, qs)`` (its default, linear interpolation), from one partial sort: the
    same values at a tenth of the cost for a few hundred values."""
    last = x.size - 1
    pos = [last * q for q in qs]
    lo = [int(p) for p in pos]
    part = np.partition(x, sorted({k for lower in lo for k in (lower, min(lower + 1, last))}))
    out = []
    for p, lower in zip(pos, lo):
        a, b, t = float(part[lower]), float(part[min(lower + 1, last)]), p - lower
        # numpy's lerp: from the nearer end, so a quantile of equal values is that value exactly
        out.append(b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t)
    return out


def to_pb(latency: OpLatency) -> dict[str, pb.OpLatency]:
    """The wire form of a rank's :meth:`OpLatency.summary` (``RankStatus``/``RankSummary.op_latency``)."""
    return {op: pb.OpLatency(count=s.count, p50_seconds=s.p50, p99_seconds=s.p99, window=s.window)
            for op, s in latency.summary().items()}
