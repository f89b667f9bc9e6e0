"""Collective latency: every collective FSDP2, TP/DTensor and the user issue.

Two sources, one record format (:meth:`Recorder.collective`):

* **Python wrappers** (gloo and any backend without GPU timing).  The
  ``torch.distributed`` verbs are wrapped where they are looked up, in both
  ``torch.distributed`` and ``distributed_c10d`` (so ``all_gather_object``'s
  inner ``all_gather`` counts).  Only primitives are wrapped; aliases such as
  ``all_gather_into_tensor`` delegate to a wrapped primitive and count once.
  A collective is timed from issue to completion as the issuing thread sees
  it: a sync call to its return, an async one to the return of its
  ``Work.wait()``, and DTensor's functional collectives to the first wait on
  their ``AsyncCollectiveTensor``.  (A ``Work`` future callback would give the
  backend thread's view, but it costs ~30 us per collective in GIL hand-offs
  and its timestamp waits for the GIL anyway.)
* **NCCL completion hooks**: with ``TORCH_NCCL_ENABLE_TIMING=1``,
  ``ProcessGroup._register_on_completion_hook`` on every NCCL group (the
  default one, DeviceMesh's, and groups made later, found at each flush)
  reports each collective's duration between CUDA events on the NCCL stream,
  funcols included; the wrappers then stand down.  That duration includes the
  time a collective's kernel waited for its slowest peer.  NCCL reports no
  byte counts, so these records carry 0 bytes.

Bookkeeping never raises into training: its errors are counted.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from rankwatch.hooks.instrument.op_record import (
    _DIST_OPS,
    _FUNCOL_OPS,
    _PAYLOAD,
    _arg_reader,
    _group_key,
    _payload_reader,
    _peer_reader,
    _storage_key,
    backend_of,
)
from rankwatch.hooks.instrument.chunk_watch import ChunkWatch
from rankwatch.hooks.instrument.nccl_hooks import NcclHooks
from rankwatch.hooks.instrument.recorder import OP_CODE, Recorder
from rankwatch.hooks.instrument.untouched import raise_bare
from rankwatch.hooks.instrument.waits import funcol_wait, work_wait

__all__ = ["CollectiveInstrumentation", "backend_of"]

log = logging.getLogger(__name__)

_MAX_PENDING = 4096

class CollectiveInstrumentation:
    """Installs and removes the collective timers of one process.

    Args:
        recorder: where records go.
    """

    def __init__(self, recorder: Recorder) -> None:
        self._rec = recorder
        self._saved: list[tuple[Any, str, Any]] = []
        self._pg_codes: dict[Any, int] = {}
        self._group_calls: dict[Any, tuple[int, Callable[[], int]]] = {}   # the timers' per-group cache
        self.pgs: list[Any] = []  # process groups seen, index = pg code
        self.errors = 0
        self.source = "none"
        self._pending: dict[int, tuple[int, int, int, int, int]] = {}  # funcol results not yet waited
        self._default_pg: Any = None
        self._pending_work: dict[int, tuple[int, int, int, int, int]] = {}  # async Works
        self._nccl = NcclHooks(recorder, self._pg_code, self._count_error)   # NCCL's GPU timing, when on
        # _group_key -> (the group argument, kept so its id is not reused; its ProcessGroup)
        self._funcol_groups: dict[Any, tuple[Any, Any]] = {}
        self.chunks = ChunkWatch(recorder, self._patch)   # the pipeline microbatch (any source)

    def _count_error(self) -> None:
        self.errors += 1

    # -- public -----------------------------------------------------------
    def install(self) -> str:
        """Install the best source for this process; return its name."""
        import torch.distributed as dist

        if self._saved or self.source != "none":
            return self.source
        self.chunks.refresh()
        if self._nccl.install(dist):
            self.source = "nccl_completion_hook"
            return self.source
        self._wrap_dist(dist)
        self._wrap_funcol()
        self.source = "python_wrappers"
        return self.source

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        self.chunks.installed = False
        self._default_pg = None
        # A completion hook cannot be removed from its group: it stays and records nothing.
        self._nccl.off()
        self.source = "none"

    def refresh(self) -> None:
        """Hook NCCL groups made since :meth:`install` (sender thread, every flush).

        A DeviceMesh or ``new_group`` made after ``init()`` has its own communicator;
        its collectives are timed from the first flush after it appears.
        """
        if self._nccl.on:
            try:
                import torch.distributed as dist

                self._nccl.refresh(dist)
            except Exception:  # noqa: BLE001 - sampling must not fail
                self.errors += 1

    def group_seqs(self) -> dict[str, int]:
        """Sequence number of every group seen, by group name (sender thread).

        Sampled every flush, so it also hooks NCCL groups made since the last one.
        """
        self.refresh()
        self.chunks.refresh()
        out = {}
        for pg in list(self.pgs):
            try:
                out[str(pg.group_name)] = int(pg._get_sequence_number_for_group())
            except Exception:  # noqa: BLE001 - a destroyed group
                continue
        return out

    def group_names(self) -> list[str]:
        """The c10d name of every group seen, indexed by the code records carry (sender thread)."""
        return [str(getattr(pg, "group_name", "")) for pg in list(self.pgs)]

    def group_code(self, pg: Any) -> int:
        """The code records carry for process group ``pg`` (a new one is given the next)."""
        return self._pg_code(pg)

    def last_seq(self) -> int:
        """Highest collective sequence number on the default group (sender thread)."""
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
        except Exception:  # noqa: BLE001 - progress sampling must not fail
            pass
        return -1

    # -- internals --------------------------------------------------------
    def _patch(self, owner: Any, name: str, wrapper: Callable) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    def _pg_code(self, pg: Any) -> int:
        code = self._pg_codes.get(pg)
        if code is None:
            code = self._pg_codes[pg] = len(self.pgs)
            self.pgs.append(pg)
        return code

    def _patch_everywhere(self, original: Callable, wrapper: Callable) -> None:
        """Replace ``original`` in every loaded torch.distributed module that holds it.

        Modules that imported a verb by name (DTensor's ``_collective_utils``
        does ``from distributed_c10d import scatter``) hold their own reference.
        """
        for modname, module in list(sys.modules.items()):
            if module is None or not modname.startswith("torch.distributed"):
                continue
            for attr, value in list(vars(module).items()):
                if value is original:
                    self._patch(module, attr, wrapper)

    def _wrap_dist(self, dist: Any) -> None:
        c10d = dist.distributed_c10d
        for fname, op in _DIST_OPS.items():
            fn = getattr(c10d, fname, None)
            if fn is not None:
                self._patch_everywhere(fn, self._dist_wrapper(fn, OP_CODE[op], c10d,
                                                              _payload_reader(fn, _PAYLOAD.get(fname)),
                                                              _peer_reader(fn, fname)))
        self._wrap_work_wait(dist.Work)

    def _find_default(self, c10d: Any) -> Any:
        self._default_pg = c10d._get_default_group()
        return self._default_pg

    def _track(self, pending: dict, key: int, value: tuple) -> None:
        if len(pending) > _MAX_PENDING:  # issued and never waited on
            self.errors += len(pending)
            pending.clear()
        pending[key] = value

    def _wrap_work_wait(self, work_cls: type) -> None:
        self._patch(work_cls, "wait", work_wait(work_cls.wait, self._rec, self._pending_work, self.pgs))

    def _dist_wrapper(self, fn: Callable, op: int, c10d: Any, payload: Callable[[tuple, dict], int],
                      peer_of: Callable[[tuple, dict], Any]) -> Callable:
        params = list(inspect.signature(fn).parameters)
        g_index = params.index("group") if "group" in params else None
        rec = self._rec
        clock = time.perf_counter_ns
        groups = self._group_calls   # pg -> (its code, its sequence-number getter), made once

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                group = kwargs.get("group")
                if group is None and g_index is not None and len(args) > g_index:
                    group = args[g_index]
                pg = group if group is not None else (self._default_pg or self._find_default(c10d))
                peer = peer_of(args, kwargs)
            except Exception:  # noqa: BLE001 - the verb itself will report a bad call
                pg = peer = None
            rec.inflight = (op, pg, t0, peer) if pg is not None else None
            try:
                work = fn(*args, **kwargs)
            except BaseException as exc:
                rec.inflight = raise_bare(exc)   # (None) PyTorch's error, no frame of ours
                raise
            rec.inflight = None
            if pg is None:
                return work
            try:
                known = groups.get(pg)
                if known is None:
                    known = groups[pg] = (self._pg_code(pg), pg._get_sequence_number_for_group)
                pgc, seq_of = known
                seq = seq_of()
                nbytes = payload(args, kwargs)
                if work is None:
                    t1 = clock()
                    rec.blocked_ns += t1 - t0
                    rec.collective(op, pgc, seq, t0, t1, nbytes)
                else:
                    self._track(self._pending_work, id(work), (op, pgc, seq, t0, nbytes, peer))
            except Exception:  # noqa: BLE001 - never raise into training
                self.errors += 1
            return work

        return timed

    def _wrap_funcol(self) -> None:
        import torch.distributed._functional_collectives as funcol

        act_cls = funcol.AsyncCollectiveTensor
        for fname, op in _FUNCOL_OPS.items():
            fn = getattr(funcol, fname, None)
            if fn is not None:
                first = next(iter(inspect.signature(fn).parameters), None)  # the input tensor(s)
                self._patch_everywhere(fn, self._funcol_wrapper(fn, OP_CODE[op], act_cls,
                                                                _payload_reader(fn, first),
                                                                _arg_reader(fn, "group")))

        # DTensor waits with .wait(), other uses with .trigger_wait(): time both.
        for method in ("trigger_wait", "wait"):
            self._patch(act_cls, method, self._timed_wait(getattr(act_cls, method)))

    def _timed_wait(self, wait: Callable) -> Callable:
        return funcol_wait(wait, self._rec, self._pending, self.pgs)

    def _funcol_wrapper(self, fn: Callable, op: int, act_cls: type,
                        payload: Callable[[tuple, dict], int],
                        group_arg: Callable[[tuple, dict], Any]) -> Callable:
        rec = self._rec
        clock = time.perf_counter_ns

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                out = fn(*args, **kwargs)
            except BaseException as exc:
                raise_bare(exc)   # PyTorch's error as PyTorch raised it: no frame of ours
                raise
            try:
                nbytes = payload(args, kwargs)
                # The group and its sequence number as c10d (and Flight Recorder) count them.
                pg = self._funcol_group(group_arg(args, kwargs))
                pgc = self._pg_code(pg) if pg is not None else -1
                seq = int(pg._get_sequence_number_for_group()) if pg is not None else -1
                if isinstance(out, act_cls) and not out.completed:
                    # Keyed by storage: views of the result (new ACTs) share it.
                    self._track(self._pending, _storage_key(out), (op, pgc, seq, t0, nbytes))
                else:  # already waited (tracing, or a view that forced the wait)
                    rec.collective(op, max(pgc, 0), seq, t0, clock(), nbytes)
            except Exception:  # noqa: BLE001 - never raise into training
                self.errors += 1
            return out

        return timed

    def _funcol_group(self, group: Any) -> Any:
        """The ProcessGroup behind a functional collective's ``group`` (cached), or None."""
        if group is None:
            return None
        key = _group_key(group)
        hit = self._funcol_groups.get(key)
        if hit is not None:
            return hit[1]
        import torch.distributed._functional_collectives as funcol
        from torch.distributed import distributed_c10d as c10d

        pg = c10d._resolve_process_group(funcol._resolve_group_name(group))
        if len(self._funcol_groups) >= 256:  # groups made per call: keep the cache bounded
            self._funcol_groups.clear()
        self._funcol_groups[key] = (group, pg)
        return pg
