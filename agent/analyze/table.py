"""The operations of a recorded job as columns: what every reader of ``rankwatch analyze`` returns.

One row per timed operation, the rankwatch trace format (``docs/analyze.md``): ``rank``,
``step``, ``op``, ``kind``, ``start``, ``duration``, and the optional mesh coordinates, pairing
keys and size.  Every reader (the trace format's JSON Lines, CSV and Parquet, PyTorch profiler
traces, an agent's step history) produces an :class:`OpTable`; everything downstream reads
only this.  :func:`checked` refuses out-of-range values with the file, the row and the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["KINDS", "BLOCKING", "LIMITS", "OpTable", "TraceError", "checked", "concat"]

KINDS = ("compute", "collective", "p2p", "data", "optimizer", "host")
BLOCKING = ("collective", "p2p")
"""Kinds whose duration is time the rank was blocked on others (its wait)."""

NOT_SET = -1
"""An optional integer column's value where a row has none."""

LIMITS = {
    "rank": (0, 1 << 20), "step": (0, 1 << 40), "duration": (0.0, 86400.0),
    "start": (-1e12, 1e12), "seq": (0, 1 << 62), "peer": (0, 1 << 20), "bytes": (0, 1 << 50),
    "microbatch": (0, 1 << 20), "dp": (0, 1 << 20), "pp": (0, 4096), "tp": (0, 1 << 20),
    "ep": (0, 1 << 20), "cp": (0, 1 << 20),
}
"""Each numeric field's range (inclusive).  A start is seconds on the step's clock, a duration
at most a day."""
MAX_NAME = 128
"""Op, group and node names are cut to this many characters."""

INT_OPTIONAL = ("dp", "pp", "tp", "ep", "cp", "microbatch", "peer", "seq", "bytes")


class TraceError(ValueError):
    """A file that cannot be analysed, with where: ``file:row: field: why``."""

    def __init__(self, path: str, why: str, row: int | None = None, column: str | None = None) -> None:
        where = path + (f":{row}" if row is not None else "") + (f": {column}" if column else "")
        super().__init__(f"{where}: {why}")
        self.path, self.row, self.column, self.why = path, row, column, why


@dataclass
class OpTable:
    """Columns of equal length.  ``op``, ``group`` and ``node`` are indices into ``names``;
    ``kind`` indexes :data:`KINDS`; an optional integer column is :data:`NOT_SET` where unknown
    (``group`` and ``node`` too).  ``source`` names what was read, for messages."""

    rank: np.ndarray           # int64
    step: np.ndarray           # int64
    op: np.ndarray             # int32 into names
    kind: np.ndarray           # int8 into KINDS
    start: np.ndarray          # float64 seconds
    duration: np.ndarray       # float64 seconds
    names: list[str] = field(default_factory=list)
    node: np.ndarray | None = None      # int32 into names, or None: no row has one
    group: np.ndarray | None = None     # int32 into names
    ints: dict[str, np.ndarray] = field(default_factory=dict)   # the INT_OPTIONAL columns present
    source: str = ""

    def __len__(self) -> int:
        return int(self.rank.shape[0])

    def column(self, name: str) -> np.ndarray | None:
        """An optional integer column (``pp``, ``seq``, ...), or None where no row has it."""
        return self.ints.get(name)

    def take(self, index: np.ndarray) -> OpTable:
        """The rows at ``index`` (a mask or indices), names shared."""
        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[index]
        return OpTable(rank=self.rank[index], step=self.step[index], op=self.op[index], kind=self.kind[index],
                       start=self.start[index], duration=self.duration[index], names=self.names,
                       node=pick(self.node), group=pick(self.group),
                       ints={k: v[index] for k, v in self.ints.items()}, source=self.source)


def checked(t: OpTable, first_row: int = 1) -> OpTable:
    """``t`` if every value is in range, else a :class:`TraceError` naming the first bad row
    (``first_row`` is the file's row number of ``t``'s first row: 1 for JSON Lines, 2 for CSV)."""
    cols = {"rank": t.rank, "step": t.step, "start": t.start, "duration": t.duration, **t.ints}
    for name, values in cols.items():
        lo, hi = LIMITS[name]
        bad = ~np.isfinite(values) if values.dtype.kind == "f" else np.zeros(len(values), bool)
        present = values != NOT_SET if name in INT_OPTIONAL else np.ones(len(values), bool)
        bad |= present & ((values < lo) | (values > hi))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TraceError(t.source, f"{values[i].item()!r} is out of range [{lo}, {hi}]", first_row + i, name)
    return t


def concat(parts: list[OpTable], source: str = "") -> OpTable:
    """One table of ``parts`` (their names merged; indices remapped)."""
    if not parts:
        raise TraceError(source or "(no input)", "no operations were read")
    names: dict[str, int] = {}
    def remap(t: OpTable, a: np.ndarray | None, n: int) -> np.ndarray:
        if a is None:
            return np.full(n, NOT_SET, np.int32)
        lut = np.array([names.setdefault(s, len(names)) for s in t.names] or [0], np.int32)
        return np.where(a >= 0, lut[np.clip(a, 0, None)], NOT_SET).astype(np.int32)
    ops, nodes, groups = [], [], []
    for t in parts:
        ops.append(remap(t, t.op, len(t)))
        nodes.append(remap(t, t.node, len(t)))
        groups.append(remap(t, t.group, len(t)))
    keys = sorted({k for t in parts for k in t.ints})
    ints = {k: np.concatenate([t.ints.get(k, np.full(len(t), NOT_SET, np.int64)) for t in parts]) for k in keys}
    has = any(t.node is not None for t in parts), any(t.group is not None for t in parts)
    return OpTable(rank=np.concatenate([t.rank for t in parts]), step=np.concatenate([t.step for t in parts]),
                   op=np.concatenate(ops), kind=np.concatenate([t.kind for t in parts]),
                   start=np.concatenate([t.start for t in parts]),
                   duration=np.concatenate([t.duration for t in parts]), names=list(names),
                   node=np.concatenate(nodes) if has[0] else None, group=np.concatenate(groups) if has[1] else None,
                   ints=ints, source=source or ", ".join(t.source for t in parts))


def short(s: object) -> str:
    """A name from a file, cut to :data:`MAX_NAME` characters."""
    text = s if isinstance(s, str) else ("" if s is None or (isinstance(s, float) and math.isnan(s)) else str(s))
    return text[:MAX_NAME]
