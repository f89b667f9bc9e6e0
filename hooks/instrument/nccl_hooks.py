"""NCCL's own GPU timing of collectives: a completion hook on every NCCL process group.

With ``TORCH_NCCL_ENABLE_TIMING=1`` on an NCCL job, each group calls a hook when a collective
completes, with the time it was active on the GPU; the hook runs on the group's own thread,
never the training thread, and records the collective.  Groups made later (a DeviceMesh, a
``new_group``) are hooked from the sender thread's next flush (:meth:`NcclHooks.refresh`).
A hook cannot be removed: :meth:`NcclHooks.off` makes it record nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from rankwatch.hooks.instrument.op_record import _NCCL_OP_CODES, backend_of
from rankwatch.hooks.instrument.recorder import OP_CODE, Recorder

__all__ = ["NcclHooks"]

log = logging.getLogger(__name__)


class NcclHooks:
    """Args:
        rec: where completed collectives are recorded.
        pg_code: a process group's code in the records.
        error: counts a bookkeeping error (never raised into training).
    """

    def __init__(self, rec: Recorder, pg_code: Callable[[Any], int], error: Callable[[], None]) -> None:
        self._rec, self._pg_code, self._error = rec, pg_code, error
        self.on = False
        self._hooked: set[int] = set()   # id() of the groups whose completion hook is ours

    def install(self, dist: Any) -> bool:
        """Use NCCL's GPU timing when the default group is NCCL with timing on."""
        if not dist.is_initialized() or backend_of() != "nccl":
            return False
        if os.environ.get("TORCH_NCCL_ENABLE_TIMING") != "1":
            log.info("rankwatch: NCCL without TORCH_NCCL_ENABLE_TIMING=1; timing in Python")
            return False
        self.on = True
        try:
            self.refresh(dist)
        except Exception as exc:  # noqa: BLE001
            log.warning("rankwatch: NCCL completion hook unavailable (%s); timing in Python", exc)
            self.on = False
        return self.on

    def off(self) -> None:
        self.on = False

    def refresh(self, dist: Any) -> None:
        """Register the completion hook on every NCCL group not hooked yet.

        The default group's failure is raised (the caller falls back to the Python
        wrappers); a subgroup's is counted, and the group is not tried again.
        """
        c10d = dist.distributed_c10d
        default = c10d._get_default_group()
        for pg in [default, *c10d._world.pg_map]:
            if id(pg) in self._hooked:
                continue
            try:
                if backend_of(pg) != "nccl":
                    self._hooked.add(id(pg))
                    continue
                pg._register_on_completion_hook(functools.partial(self._completed, self._pg_code(pg)))
            except Exception:
                if pg is default:
                    raise
                self._error()
            self._hooked.add(id(pg))

    def _completed(self, pgc: int, info: Any) -> None:
        # Runs on the group's hook thread, never the training thread.
        if not self.on:
            return
        try:
            op = _NCCL_OP_CODES.get(str(info.op_type).rsplit(".", 1)[-1].lower(), OP_CODE["other"])
            t1_ns = time.perf_counter_ns()
            dur_ns = int(info.active_duration.total_seconds() * 1e9)
            self._rec.collective(op, pgc, int(info.seq), t1_ns - dur_ns, t1_ns, 0)
        except Exception:  # noqa: BLE001
            self._error()
