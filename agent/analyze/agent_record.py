"""Reading an agent's own record of a job: the step history in its state directory
(``<state_dir>/history/steps-<node>-<seq>.jsonl.gz``, :mod:`rankwatch.agent.durable.steplog`).

The files are the rankwatch trace format (gzip members one after another), read by
:func:`~.trace_format.read_trace`.  A state directory outlives jobs, so only the latest job's
files are read: each file holds one job's rows, named in their ``job`` column (torchrun's
run id), and the newest file's job is the one read.  A file whose last member a crash cut
short is read up to that member.
"""

from __future__ import annotations

import json
import tempfile
import zlib
from pathlib import Path

from rankwatch.agent.analyze.table import OpTable, TraceError, concat
from rankwatch.agent.analyze.trace_format import MAX_OPS, read_trace

__all__ = ["HISTORY_DIR", "history_files", "read_history"]

HISTORY_DIR = "history"
_FIRST_LINE = 64 << 10   # bytes decompressed to read a file's first row


def history_files(directory: str | Path) -> list[Path]:
    """The step files of the latest job in a state directory (or its ``history/``), oldest first.

    Raises:
        TraceError: no step files there.
    """
    d = Path(directory)
    hist = d / HISTORY_DIR if (d / HISTORY_DIR).is_dir() else d
    files = sorted((p for p in hist.glob("*.jsonl.gz") if p.is_file()), key=_age)
    if not files:
        raise TraceError(str(d), f"no step history ({HISTORY_DIR}/*.jsonl.gz): was its agent "
                                 "run with --history-bytes 0, or without a state directory?")
    jobs = [_job_of(p) for p in files]
    latest = jobs[-1]
    return [p for p, job in zip(files, jobs) if job == latest]


def read_history(directory: str | Path, max_ops: int = MAX_OPS) -> OpTable:
    """Every operation of the latest job an agent recorded in ``directory``.

    Raises:
        TraceError: no step files, a malformed row (file, row and field named), or more than
            ``max_ops`` operations.
    """
    parts, left = [], max_ops
    for path in history_files(directory):
        part = _read(path, left)
        left -= len(part)
        parts.append(part)
    return concat(parts, source=str(directory))


def _age(p: Path) -> tuple[float, str]:
    try:
        return p.stat().st_mtime, p.name
    except OSError:
        return 0.0, p.name


def _job_of(path: Path) -> str:
    """The ``job`` of a file's first row ('' if none, or unreadable)."""
    try:
        head = zlib.decompressobj(wbits=31).decompress(path.read_bytes()[:_FIRST_LINE], _FIRST_LINE)
        row = json.loads(head.split(b"\n", 1)[0])
    except (OSError, zlib.error, ValueError):
        return ""
    return str(row.get("job", "")) if isinstance(row, dict) else ""


def _read(path: Path, max_ops: int) -> OpTable:
    try:
        return read_trace(path, max_ops)
    except TraceError as exc:
        whole = _whole_members(path)
        if whole is None:
            raise
        if not whole:
            raise TraceError(str(path), f"holds no whole member ({exc.why})") from None
    with tempfile.TemporaryDirectory(prefix="rankwatch-history-") as tmp:
        plain = Path(tmp) / (path.name[: -len(".gz")])
        plain.write_bytes(whole)
        try:
            table = read_trace(plain, max_ops)
        except TraceError as exc:   # name the agent's file, not the copy
            raise TraceError(str(path), exc.why, exc.row, exc.column) from None
    table.source = str(path)
    return table


def _whole_members(path: Path) -> bytes | None:
    """The rows of a file's whole gzip members, if its last member is cut short (a crash while
    it was written); None if the file is otherwise unreadable."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    out = []
    while data:
        d = zlib.decompressobj(wbits=31)
        try:
            rows = d.decompress(data)
        except zlib.error:
            return None
        if not d.eof:
            break   # the torn member: what it held is not kept
        out.append(rows)
        data = d.unused_data
    else:
        return None   # every member whole: the file's fault lies elsewhere
    return b"".join(out)

