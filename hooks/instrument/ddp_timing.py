"""DDP's gradient all-reduce, timed from the autograd side, with DDP's own C++ path untouched.

``DistributedDataParallel`` all-reduces its gradient buckets from C++ (its Reducer calls the
process group directly), so the Python wrappers of :mod:`.collectives` never see them.  A
Python communication hook would, but it replaces DDP's built-in reduction with Python on
every bucket (a call into Python per bucket and a ``Future.then`` callback that needs the
GIL on the backend's thread: on a tiny GPT-2, +0.3 ms a step, ~5 %), and an exception in its
callback chain reaches the user wrapped in "Got the following error when running the
callback".  So no hook is registered, and nothing of DDP is patched.  Instead, for a backward
that :mod:`.step_hooks` sees begin on a DDP model's output:

* the group's sequence number is read at the backward's start and at its end: if it moved,
  DDP reduced in this backward (under ``no_sync()`` it does not, and nothing is recorded);
* the reduction is one ``all_reduce`` record per backward: from the moment the last gradient
  was ready (the autograd graph has run: DDP has launched its last bucket, and from there the
  training thread can only wait) to the end of the backward (DDP's finalizer has waited for
  every bucket), the way an async collective is timed to its ``wait()``; its sequence number
  is the group's last (the last bucket's), its size the model's gradients.  That span is the
  backward's time blocked in collectives (a rank that waits there for a slower peer is not
  the slow one).  Earlier buckets overlap the backward's compute and get no record of their own.

Records go to the current sink (the recorder and collective bookkeeping of the monitor in
charge).  Nothing here raises into the backward: errors are counted.
"""

from __future__ import annotations

import weakref
from typing import Any

from rankwatch.hooks.instrument.recorder import OP_CODE

__all__ = ["DdpTiming"]

_ALL_REDUCE = OP_CODE["all_reduce"]
_MAX_MODELS = 16   # DDP models remembered (the roots a script calls)


class DdpTiming:
    """Times the gradient reduction of the DDP models whose backward :mod:`.step_hooks` sees.

    ``sink()`` returns (recorder, collective instrumentation) or None (record nothing).
    """

    def __init__(self, sink: Any) -> None:
        self._sink = sink
        # id -> (a weak reference to the model: a model kept alive to the interpreter's end can
        # abort it in gloo's threads; its timing or None)
        self._models: dict[int, tuple[Any, Any]] = {}
        self._open: tuple[Any, Any, int] | None = None   # (group, seq getter, bytes)
        self._seq0 = 0
        self.errors = 0

    def begin(self, model: Any) -> None:
        """A backward through ``model``'s output begins (training thread)."""
        try:
            seen = self._models.get(id(model))
            known = seen[1] if seen is not None and seen[0]() is model else self._learn(model)
            self._open = known
            if known is not None:
                self._seq0 = known[1]()
        except Exception:  # noqa: BLE001 - never raise into the backward
            self.errors += 1
            self._open = None

    def end(self, ready_ns: int, end_ns: int) -> bool:
        """The backward that :meth:`begin` opened has ended; True if DDP reduced in it."""
        known, self._open = self._open, None
        if known is None:
            return False
        try:
            seq = known[1]()
            if seq == self._seq0:   # no_sync(): no reduction in this backward
                return False
            sink = self._sink()
            if sink is not None:
                rec, instr = sink
                rec.collective(_ALL_REDUCE, instr.group_code(known[0]), int(seq), ready_ns, end_ns, known[2])
            return True
        except Exception:  # noqa: BLE001
            self.errors += 1
            return False

    def _learn(self, model: Any) -> tuple[Any, Any, int] | None:
        """(its group, the group's sequence number getter, gradient bytes) for a DDP model;
        None for any other."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        known = None
        if isinstance(model, DDP):
            pg = model.process_group
            params = getattr(model, "_module_parameters", None) or list(model.parameters())
            nbytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
            known = (pg, pg._get_sequence_number_for_group, int(nbytes))
        if len(self._models) >= _MAX_MODELS:
            self._models.clear()
        self._models[id(model)] = (weakref.ref(model), known)
        return known
