"""Which reader takes each path given to ``rankwatch analyze``.

* a directory holding ``history/``: an agent's state directory, its record of the job
  (:mod:`.agent_record`);
* another directory: every trace file in it (the trace format, or profiler traces);
* ``.json`` / ``.json.gz``: a PyTorch profiler Chrome trace, one per rank (:mod:`.profiler`);
* ``.jsonl``, ``.jsonl.gz``, ``.csv``, ``.csv.gz``, ``.parquet``: the rankwatch trace format
  (:mod:`.trace_format`).

The operations of every path form one job.
"""

from __future__ import annotations

from pathlib import Path

from rankwatch.agent.analyze.table import OpTable, TraceError, concat
from rankwatch.agent.analyze.trace_format import MAX_OPS, SUFFIXES, read_trace

__all__ = ["read_paths"]

_PROFILER = (".json", ".json.gz")


def read_paths(paths: list[str], max_ops: int = MAX_OPS) -> OpTable:
    """One table of every operation the paths hold.

    Raises:
        TraceError: a path that does not exist, holds nothing to read, or is malformed (its
            message names the file, and the row and field where there is one).
    """
    parts: list[OpTable] = []
    left = max_ops
    for raw in paths:
        for f in _files(Path(raw)):
            part = _read(f, left)
            left -= len(part)
            parts.append(part)
    return concat(parts, source=", ".join(paths))


def _files(p: Path) -> list[Path]:
    if not p.exists():
        raise TraceError(str(p), "no such file or directory")
    if not p.is_dir():
        return [p]
    if (p / "history").is_dir():
        return [p]
    found = sorted(f for f in p.iterdir() if f.is_file() and f.name.lower().endswith(SUFFIXES + _PROFILER))
    if not found:
        raise TraceError(str(p), f"holds no trace files ({', '.join(SUFFIXES + _PROFILER)}) and no history/")
    return found


def _read(f: Path, max_ops: int) -> OpTable:
    if f.is_dir():
        from rankwatch.agent.analyze.agent_record import read_history

        return read_history(f)
    if f.name.lower().endswith(_PROFILER):
        from rankwatch.agent.analyze.profiler import is_profiler_trace, read_profiler

        if not is_profiler_trace(str(f)):
            raise TraceError(str(f), "not a PyTorch profiler trace (no traceEvents)")
        return read_profiler(str(f))
    return read_trace(f, max_ops)
