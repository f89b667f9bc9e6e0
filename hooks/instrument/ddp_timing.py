"""DDP's gradient all-reduces, timed through its communication hook.

``DistributedDataParallel`` all-reduces its gradient buckets from C++ (its Reducer calls the
process group directly), so the Python wrappers of :mod:`.collectives` never see them.  A DDP
communication hook does: it is called with each bucket and returns the future of its
reduction.  So, at a DDP module's first forward:

* if the script registered no hook, a timing hook that does what DDP does by default
  (divide by the group's size, all-reduce, hand the bucket back) is registered;
* if it registered a Python hook (``register_comm_hook``), its hook is wrapped by the
  timer instead, and still does its own work;
* a built-in C++ hook (``_register_builtin_comm_hook``) cannot be wrapped: that model's
  buckets go untimed.

A bucket's record runs from the hook's call (the bucket is ready) to its future's
completion, as the backend's thread sees it.  The training thread waits for all of them at
the end of the backward: the backward's time after the last bucket was ready is its time
blocked in collectives (``Recorder.comm_ready_ns``; a rank that waits there for a slower
peer is not the slow one).  Records go to the current sink (the
recorder and collective bookkeeping of the monitor in charge, which ``rw.init`` may replace).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rankwatch.hooks.instrument.recorder import OP_CODE

__all__ = ["DdpTiming"]

log = logging.getLogger(__name__)

_ALL_REDUCE = OP_CODE["all_reduce"]


class DdpTiming:
    """Patches ``DistributedDataParallel`` so its buckets' all-reduces are recorded.

    ``sink()`` returns (recorder, collective instrumentation) or None (record nothing).
    """

    def __init__(self, sink: Any) -> None:
        self._sink = sink
        self._saved: list[tuple[Any, str, Any]] = []
        self.errors = 0

    def install(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if self._saved:
            return
        forward, register = DDP.forward, DDP.register_comm_hook
        builtin = DDP._register_builtin_comm_hook
        timing = self

        def first_forward(ddp: Any, *args: Any, **kwargs: Any) -> Any:
            if not getattr(ddp, "_rankwatch_hooked", False):
                ddp._rankwatch_hooked = True
                timing._hook_default(ddp, register)
            return forward(ddp, *args, **kwargs)

        def register_comm_hook(ddp: Any, state: object, hook: Any) -> Any:
            ddp._rankwatch_hooked = True
            return register(ddp, state, timing._timed(hook))

        def register_builtin(ddp: Any, comm_hook_type: Any) -> Any:
            ddp._rankwatch_hooked = True   # C++: nothing to wrap
            return builtin(ddp, comm_hook_type)

        for name, fn in (("forward", first_forward), ("register_comm_hook", register_comm_hook),
                         ("_register_builtin_comm_hook", register_builtin)):
            original = getattr(DDP, name)
            fn.__doc__, fn.__wrapped__ = original.__doc__, original  # type: ignore[attr-defined]
            self._saved.append((DDP, name, original))
            setattr(DDP, name, fn)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    # -- internals ----------------------------------------------------------
    def _hook_default(self, ddp: Any, register: Any) -> None:
        """DDP's default reduction, timed (never raises: the model trains untimed instead)."""
        try:
            register(ddp, ddp.process_group, self._timed(_average))
        except Exception as exc:  # noqa: BLE001 - e.g. a hook registered some other way
            self.errors += 1
            log.info("rankwatch: DDP buckets untimed (%s)", exc)

    def _timed(self, hook: Any) -> Any:
        clock = time.perf_counter_ns

        def timed(state: Any, bucket: Any) -> Any:
            t0 = clock()
            fut = hook(state, bucket)
            try:
                sink = self._sink()
                if sink is None:
                    return fut
                rec, instr = sink
                rec.comm_ready_ns = t0
                group = getattr(state, "process_group", state) if state is not None else None
                pg = group if _is_group(group) else _default_group()
                pgc, seq = instr.group_code(pg), int(pg._get_sequence_number_for_group())
                buf = bucket.buffer()
                nbytes = buf.numel() * buf.element_size()
            except Exception:  # noqa: BLE001 - never raise into the backward
                self.errors += 1
                return fut

            def done(f: Any) -> Any:
                rec.collective(_ALL_REDUCE, pgc, seq, t0, clock(), nbytes)
                return f.value()

            return fut.then(done)

        # DDP checks a hook's annotations (``bucket: dist.GradBucket``); these are strings here.
        timed.__annotations__ = {}
        return timed


def _average(process_group: Any, bucket: Any) -> Any:
    """DDP's default: the bucket divided by the group's size, all-reduced (a future of it)."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    pg = group if _is_group(group) else _default_group()
    return pg.allreduce([buf]).get_future().then(lambda f: f.value()[0])


def _is_group(obj: Any) -> bool:
    return hasattr(obj, "_get_sequence_number_for_group")


def _default_group() -> Any:
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_group()
