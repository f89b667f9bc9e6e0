"""The timers of a collective's wait: ``Work.wait()`` and a functional collective's wait.

A collective issued through a timed verb (:mod:`.collectives`) is pending until the issuing
thread waits for it; its record runs from its issue to the wait's return, and the wait is the
rank's time blocked in collectives.  A wait on anything not pending runs as it would bare.
Either way an exception from the wait reaches the user as PyTorch raised it
(:mod:`.untouched`): no frame of these wrappers in its traceback.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from rankwatch.hooks.instrument.op_record import _storage_key
from rankwatch.hooks.instrument.recorder import Recorder
from rankwatch.hooks.instrument.untouched import raise_bare

__all__ = ["funcol_wait", "work_wait"]


def work_wait(wait: Callable, rec: Recorder, pending: dict, pgs: list) -> Callable:
    """``Work.wait`` timed: ``pending`` maps id(work) -> (op, pg code, seq, t0, bytes, peer)."""
    clock = time.perf_counter_ns

    @functools.wraps(wait)
    def timed_wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        p = pending.pop(id(work), None) if pending else None
        if p is not None:
            rec.inflight = (p[0], pgs[p[1]], p[3], p[5])
        tw = clock()
        try:
            out = wait(work, *args, **kwargs)
        except BaseException as exc:
            raise_bare(exc)   # PyTorch's error as PyTorch raised it: no frame of ours
            raise
        if p is None:
            return out
        op, pgc, seq, t0, nbytes, _peer = p
        t1 = clock()
        rec.inflight = None
        rec.blocked_ns += t1 - tw
        rec.collective(op, pgc, seq, t0, t1, nbytes)
        return out

    return timed_wait


def funcol_wait(wait: Callable, rec: Recorder, pending: dict, pgs: list) -> Callable:
    """An ``AsyncCollectiveTensor`` wait timed: ``pending`` maps a result's storage key ->
    (op, pg code or -1, seq, t0, bytes)."""
    clock = time.perf_counter_ns

    @functools.wraps(wait)
    def timed_wait(act: Any) -> Any:
        p = pending.pop(_storage_key(act), None) if pending else None
        if p is not None:
            rec.inflight = (p[0], pgs[p[1]] if p[1] >= 0 else None, p[3], None)
        tw = clock()
        try:
            out = wait(act)
        except BaseException as exc:
            raise_bare(exc)   # PyTorch's error as PyTorch raised it: no frame of ours
            raise
        if p is None:
            return out
        op, pgc, seq, t0, nbytes = p
        t1 = clock()
        rec.inflight = None
        rec.blocked_ns += t1 - tw
        rec.collective(op, max(pgc, 0), seq, t0, t1, nbytes)
        return out

    return timed_wait
