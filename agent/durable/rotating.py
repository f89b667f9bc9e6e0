"""Compressed files under a byte bound: gzip members appended to numbered files, the oldest
deleted when the total would pass the bound, a failed write undone.

Each :meth:`RotatingFiles.write` appends one complete gzip member (a reader of a file takes
its members one after another, so a crash loses at most the member being written).  A file
takes members until it holds ``file_bytes``; then the next file is started.  Before a member
is written, the oldest files of the directory are deleted until it fits under ``max_bytes``,
so the directory never holds more, whatever is written into it.

A write that fails (a full disk, a file-size limit, a directory made read-only) is undone:
the file is cut back to its size before the member, so it never holds half a member, and
the member is dropped and counted.  The first failure of a run of them is logged; the
writer goes on, and writes again as soon as the disk takes them.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from rankwatch.agent.durable.jsonl import open_append

__all__ = ["RotatingFiles"]

log = logging.getLogger(__name__)


class RotatingFiles:
    """Args:
        directory: where the files are (made 0700 when first written).
        stem: files are ``<stem>-<seq>.jsonl.gz`` (``seq`` six digits or more, counting on
            from the highest already there).
        max_bytes: the most all files named ``*.jsonl.gz`` in ``directory`` may hold.
        file_bytes: a file is finished once it holds this much.
    """

    def __init__(self, directory: Path, stem: str, max_bytes: int, file_bytes: int) -> None:
        self.directory, self.stem = directory, stem
        self.max_bytes, self.file_bytes = max_bytes, max(1, file_bytes)
        self._files: list[list] = []   # [path, bytes, rows], oldest first; the last is being written
        self._seq = 0
        self._fresh = True             # start a new file before the next member
        self._scanned = False
        self.written_bytes = 0
        self.written_rows = 0
        self.deleted_rows = 0
        """Rows of files deleted to keep the bound (this run's files only: older ones are not counted)."""
        self.dropped_rows = 0
        """Rows of members that could not be written (failed, or one member over the bound)."""
        self.failures = 0
        self.last_error = ""

    @property
    def total_bytes(self) -> int:
        return sum(f[1] for f in self._files)

    def _scan(self) -> None:
        """Count what the directory already holds (an earlier run's files) against the bound."""
        self._scanned = True
        pattern = re.compile(re.escape(self.stem) + r"-(\d+)\.jsonl\.gz$")
        try:
            found = [(p.stat().st_mtime, p.name, p) for p in self.directory.glob("*.jsonl.gz") if p.is_file()]
        except OSError:
            return
        for _, name, path in sorted(found):
            try:
                self._files.append([path, path.stat().st_size, 0])
            except OSError:
                continue
            m = pattern.match(name)
            if m:
                self._seq = max(self._seq, int(m.group(1)) + 1)

    def write(self, member: bytes, rows: int) -> bool:
        """Append one gzip ``member`` holding ``rows`` rows; False if it was dropped."""
        if not self._scanned:
            self._scan()
        size = len(member)
        if size > self.max_bytes:
            self.dropped_rows += rows
            return False
        if self._fresh or not self._files or self._files[-1][1] + size > self.file_bytes:
            self._files.append([self.directory / f"{self.stem}-{self._seq:06d}.jsonl.gz", 0, 0])
            self._seq += 1
            self._fresh = False
        if not self._make_room(size):
            self.dropped_rows += rows
            return False
        return self._append(member, rows)

    def next_file(self) -> None:
        """Start a new file with the next member."""
        self._fresh = True

    def _make_room(self, size: int) -> bool:
        """Delete the oldest files until ``size`` more bytes fit under the bound."""
        while self.total_bytes + size > self.max_bytes:
            oldest = self._files[0]
            if len(self._files) == 1:   # the file being written is all there is: start it again
                oldest[1], oldest[2] = 0, 0
                try:
                    oldest[0].unlink(missing_ok=True)
                except OSError as exc:
                    return self._failed(exc)
                continue
            try:
                oldest[0].unlink(missing_ok=True)
            except OSError as exc:
                return self._failed(exc)
            self.deleted_rows += oldest[2]
            self._files.pop(0)
        return True

    def _append(self, member: bytes, rows: int) -> bool:
        current = self._files[-1]
        try:
            fd = open_append(current[0])
        except OSError as exc:
            self._fresh = True
            return self._failed(exc, rows)
        try:
            before = os.fstat(fd).st_size
            try:
                view = memoryview(member)
                while view:
                    view = view[os.write(fd, view):]
            except OSError as exc:
                self._undo(fd, before)
                return self._failed(exc, rows)
        finally:
            os.close(fd)
        current[1] = before + len(member)
        current[2] += rows
        self.written_bytes += len(member)
        self.written_rows += rows
        if self.last_error:
            log.info("writing %s again", self.directory)
            self.last_error = ""
        return True

    def _undo(self, fd: int, before: int) -> None:
        """Cut a file back to ``before`` bytes; if even that fails, the next member starts a
        new file (a reader stops at a torn member: nothing may follow one)."""
        try:
            os.ftruncate(fd, before)
        except OSError:
            self._fresh = True

    def _failed(self, exc: OSError, rows: int = 0) -> bool:
        self.failures += 1
        self.dropped_rows += rows
        if not self.last_error:
            log.warning("cannot write the step history in %s (%s): its rows are dropped and "
                        "counted until writes succeed again", self.directory, exc)
        self.last_error = f"{type(exc).__name__}: {exc}"
        return False
