"""A rank's three per-step windows on the wire: own work, data wait, collective wait.

A node agent sends each rank's windows in one ``RankSummary.work`` field, ``3n``
little-endian float64s (own work, then data wait, then collective wait, each the same
``n`` steps, oldest first).  Read as repeated doubles, the 192 values of a rank's 64-step
windows cost the coordinator a Python float each, twice: once in its range check and once
when the straggler detector lines the ranks up.  Read from bytes they are a numpy view,
and a whole summary's windows are checked in one pass (:func:`all_windows`).

An older agent sends the repeated fields ``own_work``, ``data_wait`` and ``comm_wait``
instead; :func:`windows` reads either form.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np

from rankwatch.proto import pb

__all__ = ["VALUE_BYTES", "all_windows", "pack", "steps", "windows"]

VALUE_BYTES = 8
_DTYPE = np.dtype("<f8")
Window = Sequence[float]
_EMPTY = np.zeros(0, _DTYPE)


def pack(own: Sequence[float], data: Sequence[float], wait: Sequence[float]) -> bytes:
    """``RankSummary.work`` for three windows of the same steps, newest last.  Windows of
    different lengths (never from the agent's lockstep deques) keep their newest steps in
    common: a node's summary is always built, whatever its windows hold."""
    n = min(len(own), len(data), len(wait))
    if not n:
        return b""
    return np.array([list(w)[len(w) - n:] for w in (own, data, wait)], _DTYPE).tobytes()


def steps(work: bytes) -> int | None:
    """How many steps a rank's ``work`` field holds; None when its size is not a whole
    number of steps of three windows."""
    n, rest = divmod(len(work), 3 * VALUE_BYTES)
    return None if rest else n


def windows(r: pb.RankSummary) -> tuple[Window, Window, Window]:
    """The rank's own work, data wait and collective wait windows, oldest first: read-only
    views of ``work`` when it is set (checked to be whole steps), else the repeated fields."""
    if not r.work:
        return r.own_work, r.data_wait, r.comm_wait
    a = np.frombuffer(r.work, _DTYPE)
    n = len(a) // 3
    # Read as the repeated fields are: lengths, slices, iteration (and numpy on the slices).
    return cast(Window, a[:n]), cast(Window, a[n:2 * n]), cast(Window, a[2 * n:3 * n])


def all_windows(works: Iterable[bytes]) -> np.ndarray:
    """Every value of the ranks' ``work`` fields (each read once: a read copies it), as one
    array (to range-check in one pass)."""
    blob = b"".join(works)
    return np.frombuffer(blob, _DTYPE) if blob else _EMPTY
