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
WIDE = ("seq", "bytes")
"""The optional integer columns kept as int64; the others (and ``rank``) fit int32."""


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
    """One table of ``parts`` (their names merged; indices remapped).  The parts are consumed:
    each column is freed as soon as it is joined, so the rows are held about once."""
    if not parts:
        raise TraceError(source or "(no input)", "no operations were read")
    names: dict[str, int] = {}
    luts = [np.array([names.setdefault(s, len(names)) for s in t.names] or [0], np.int32) for t in parts]
    sizes = [len(t) for t in parts]

    def joined(attr: str, fill: int | None = None, key: str | None = None) -> np.ndarray:
        cols = []
        for t, lut, n in zip(parts, luts, sizes):
            a = t.ints.pop(key, None) if key else getattr(t, attr)
            if a is None:
                a = np.full(n, NOT_SET, np.int32 if fill is None else np.int64)
            elif fill is None and attr in ("op", "node", "group"):
                a = np.where(a >= 0, lut[np.clip(a, 0, None)], NOT_SET).astype(np.int32)
            cols.append(a)
            if not key:
                setattr(t, attr, None)
        return np.concatenate(cols)

    has = any(t.node is not None for t in parts), any(t.group is not None for t in parts)
    keys = sorted({k for t in parts for k in t.ints})
    out = OpTable(rank=joined("rank"), step=joined("step"), op=joined("op"), kind=joined("kind"),
                  start=joined("start"), duration=joined("duration"), names=list(names),
                  node=joined("node") if has[0] else None, group=joined("group") if has[1] else None,
                  source=source or ", ".join(t.source for t in parts))
    out.ints = {k: joined("ints", fill=NOT_SET, key=k) for k in keys}
    return out


def short(s: object) -> str:
    """A name from a file, cut to :data:`MAX_NAME` characters."""
    text = s if isinstance(s, str) else ("" if s is None or (isinstance(s, float) and math.isnan(s)) else str(s))
    return text[:MAX_NAME]
