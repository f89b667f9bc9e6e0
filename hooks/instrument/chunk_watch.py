"""The pipeline microbatch a rank's stage began last: ``torch.distributed.pipelining``'s chunks.

A schedule runs each microbatch through its stage's ``forward_one_chunk`` and
``backward_one_chunk``; their first argument is the microbatch's index.  Both are wrapped
once the pipelining library is loaded (looked for at every flush, so a script that imports
it after ``init()`` is covered); the wrapper sets ``Recorder.microbatch`` to ``(pass,
index)`` and nothing more.  A hang's in-flight record carries it (``InFlight.microbatch``):
the stage stopped in or after that microbatch.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from rankwatch.hooks.instrument.recorder import Recorder

__all__ = ["ChunkWatch"]

_MODULE = "torch.distributed.pipelining.stage"
_CHUNKS = (("forward_one_chunk", "forward", "fwd_chunk_id"), ("backward_one_chunk", "backward", "bwd_chunk_id"))


class ChunkWatch:
    """Wraps the pipeline stage's chunk methods through ``patch`` (which keeps the originals)."""

    def __init__(self, recorder: Recorder, patch: Callable[[Any, str, Callable], None]) -> None:
        self._rec, self._patch = recorder, patch
        self.installed = False

    def refresh(self) -> None:
        """Wrap the chunk methods if the library is loaded and they are not wrapped yet."""
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
                self._patch(base, name, _marked(fn, kind, keyword, self._rec))


def _marked(fn: Callable, kind: str, keyword: str, rec: Recorder) -> Callable:
    @functools.wraps(fn)
    def marked(stage: Any, *args: Any, **kwargs: Any) -> Any:
        chunk = args[0] if args else kwargs.get(keyword)
        rec.microbatch = (kind, chunk) if type(chunk) is int else None
        return fn(stage, *args, **kwargs)

    return marked
