"""A pipeline schedule's chunks: the microbatch a rank's stage began last, its phases, its stage.

A schedule of ``torch.distributed.pipelining`` runs each microbatch through its stage's
``forward_one_chunk`` and ``backward_one_chunk``; their first argument is the microbatch's
index.  Both are wrapped once the pipelining library is loaded (looked for at every flush, so
a script that imports it after ``init()`` is covered).  On the training thread the wrapper

* sets ``Recorder.microbatch`` to ``(pass, index)``: a hang's in-flight record carries it
  (``InFlight.microbatch``), the stage stopped in or after that microbatch;
* marks the step's phases around the chunk (``Recorder.mark``): the chunk itself is
  ``forward`` or ``backward``, the schedule's time before a forward chunk, or before the
  first backward chunk after a forward (its sends, the loss), ``forward``, and between
  backward chunks ``backward``.  So a schedule's step is split by microbatch, never one
  forward; zero-code's own module and autograd marks nest inside and agree;
* keeps the stage object it ran (one attribute store).

The sender thread (:meth:`ChunkWatch.refresh`, every flush) reads that stage's
``stage_index``, ``num_stages`` and pipeline group, and hands the rank's ``(stage, stages)``
(:func:`~.stage_infer.stage_of`) to ``on_stage`` once: the monitor reports it as the rank's
``pp`` coordinate, as a ``pp`` DeviceMesh would.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from rankwatch.hooks.instrument.recorder import Recorder
from rankwatch.hooks.instrument.stage_infer import stage_of

__all__ = ["ChunkWatch"]

_MODULE = "torch.distributed.pipelining.stage"
_CHUNKS = (("forward_one_chunk", "forward", "fwd_chunk_id"), ("backward_one_chunk", "backward", "bwd_chunk_id"))


class ChunkWatch:
    """Wraps the pipeline stage's chunk methods through ``patch`` (which keeps the originals).

    Args:
        recorder: where the microbatch and the phase marks go.
        patch: ``(owner, name, wrapper)``: installs a wrapper, keeping the original to restore.
    """

    def __init__(self, recorder: Recorder, patch: Callable[[Any, str, Callable], None]) -> None:
        self._rec, self._patch = recorder, patch
        self.installed = False
        self.stage: Any = None        # the stage object a chunk last ran on (training thread)
        self.last = ""                # the pass of the last chunk: "forward" or "backward"
        self.on_stage: Callable[[int, int], None] | None = None
        self.found: tuple[int, int] | None = None   # (stage, stages) handed to on_stage
        self.errors = 0

    def refresh(self) -> None:
        """Wrap the chunk methods if the library is loaded and they are not wrapped yet, and
        report the rank's stage once a chunk has run (sender thread)."""
        self._report()
        if self.installed:
            return
        module = sys.modules.get(_MODULE)
        base = getattr(module, "_PipelineStageBase", None)
        if base is None:
            return
        self.installed = True
        for name, kind, keyword in _CHUNKS:
            fn = getattr(base, name, None)
            if fn is not None:
                self._patch(base, name, _marked(fn, kind, keyword, self._rec, self))

    def _report(self) -> None:
        stage, on_stage = self.stage, self.on_stage
        if stage is None or on_stage is None or self.found is not None:
            return
        try:
            found = stage_of(int(stage.stage_index), int(stage.num_stages),
                             int(stage.group_rank), int(stage.group_size))
        except Exception:  # noqa: BLE001 - a stage of another shape: no stage, counted
            self.errors += 1
            found = None
        self.found = found or (-1, 0)
        if found is not None:
            on_stage(*found)


def _marked(fn: Callable, kind: str, keyword: str, rec: Recorder, watch: ChunkWatch) -> Callable:
    mark = rec.mark

    @functools.wraps(fn)
    def marked(stage: Any, *args: Any, **kwargs: Any) -> Any:
        chunk = args[0] if args else kwargs.get(keyword)
        rec.microbatch = (kind, chunk) if type(chunk) is int else None
        watch.stage = stage
        mark("backward" if kind == "backward" and watch.last == "backward" else "forward")
        try:
            return fn(stage, *args, **kwargs)
        finally:
            mark(kind)
            watch.last = kind

    return marked
