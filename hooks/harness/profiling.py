"""Optional ``torch.profiler`` traces of the harness's steps, one Chrome trace per rank.

With ``RANKWATCH_PROFILE_DIR`` set, each rank profiles a window of its steps (the CPU, and CUDA
where there is one) and writes ``rank<R>.<ns>.pt.trace.json`` there through
``tensorboard_trace_handler``: the traces ``rankwatch analyze`` and other trace tools read.
``RANKWATCH_PROFILE_STEPS=FIRST:LAST`` picks the window (default ``5:45``: 40 steps recorded
after 4 waited and 1 warm-up).  ``ProfilerStep#N`` in the trace is this run's step ``N + 1``
(the profiler counts from 0 at its start, before the loop's first step).

A job that ends before ``LAST`` writes no trace.  Unset, nothing is imported or recorded.
A profiler that fails is logged and switched off: it never raises into the training loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["PROFILE_DIR_ENV", "PROFILE_STEPS_ENV", "StepProfiler", "profiled_steps"]

log = logging.getLogger("rankwatch.train")

PROFILE_DIR_ENV = "RANKWATCH_PROFILE_DIR"
PROFILE_STEPS_ENV = "RANKWATCH_PROFILE_STEPS"
DEFAULT_STEPS = (5, 45)


class StepProfiler:
    """Marks each step's end for the profiler; a no-op when ``prof`` is None."""

    def __init__(self, prof: Any = None, last: int = 0) -> None:
        self._prof, self._last, self._done = prof, last, 0

    @property
    def active(self) -> bool:
        return self._prof is not None

    def step(self) -> None:
        """One step ended: the next begins (the trace is written when the window closes)."""
        if self._prof is None:
            return
        self._done += 1
        try:
            self._prof.step()
            if self._done >= self._last:  # the window is written; stop recording step spans
                self._prof.stop()
                self._prof = None
        except Exception:  # noqa: BLE001 - never into the training loop
            log.exception("torch.profiler failed; profiling is off for the rest of the run")
            self._prof = None


def window(text: str | None) -> tuple[int, int]:
    """``FIRST:LAST`` (the steps recorded are FIRST..LAST-1, FIRST >= 1) or the default."""
    if not text:
        return DEFAULT_STEPS
    try:
        first, last = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"{PROFILE_STEPS_ENV}={text!r}: expected FIRST:LAST, e.g. 5:45") from None
    if not 1 <= first < last:
        raise ValueError(f"{PROFILE_STEPS_ENV}={text!r}: need 1 <= FIRST < LAST")
    return first, last


def profiled_steps(rank: int, env: Mapping[str, str] | None = None) -> StepProfiler:
    """A started profiler for ``rank`` when ``RANKWATCH_PROFILE_DIR`` is set in ``env``
    (default: this process's environment), else a no-op :class:`StepProfiler`."""
    env = os.environ if env is None else env
    out = env.get(PROFILE_DIR_ENV)
    if not out:
        return StepProfiler()
    first, last = window(env.get(PROFILE_STEPS_ENV))
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, schedule=schedule(wait=first - 1, warmup=1, active=last - first, repeat=1),
                   on_trace_ready=tensorboard_trace_handler(out, worker_name=f"rank{rank}"))
    prof.start()
    log.info("rank %d: torch.profiler records steps %d-%d into %s", rank, first, last - 1, out)
    return StepProfiler(prof, last)
