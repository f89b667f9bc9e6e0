"""Durable JSON Lines: one record per line, flushed to disk before the call returns.

Files are opened with ``O_NOFOLLOW`` (a symlink planted in their place is never followed)
and created with mode 0600, in a directory created 0700.  A write that fails (a full
disk, an unwritable directory, a path that is not a file) loses nothing at once: the
:class:`Writer` keeps the lines in a bounded in-memory spool, retries them every second,
and reports the failure (its counters feed ``/metrics`` and ``status``).  A line cut short
by a crash or a full disk is ended before the next one is written, so it never spoils the
line after it (readers skip it).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any

__all__ = ["SPOOL_LIMIT", "Writer", "append", "open_append"]

log = logging.getLogger(__name__)

SPOOL_LIMIT = 4096
"""Lines a writer keeps in memory while its file cannot be written; beyond, the oldest go."""
RETRY_SECONDS = 1.0


def open_append(path: Path) -> int:
    """A file descriptor appending to ``path`` (created 0600; never through a symlink).

    Raises:
        OSError: it cannot be opened (``ELOOP`` for a symlink).
    """
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.fchmod(fd, 0o600)   # a file an older version left readable by others
    except BaseException:
        os.close(fd)
        raise
    return fd


def _end_torn_line(fd: int) -> None:
    """If the file's last line was cut short, end it, so the next line stands on its own."""
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        os.write(fd, b"\n")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def append(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one line and fsync it (the state survives the agent's crash).

    Raises:
        OSError: the file cannot be written.
    """
    fd = open_append(path)
    try:
        _end_torn_line(fd)
        _write_all(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


class Writer:
    """Appends records to one JSONL file; what cannot be written yet waits in a spool.

    Args:
        path: the file.
        spool_limit: the most lines kept while the file cannot be written.

    Counters (read without a lock; each is one int): ``written``, ``failures`` (failed
    attempts), ``dropped`` (lines the full spool let go), ``spooled`` (lines waiting now),
    and ``last_error`` ("" once a write succeeds again).
    """

    def __init__(self, path: Path, spool_limit: int = SPOOL_LIMIT) -> None:
        self.path = path
        self._spool: deque[bytes] = deque()
        self._limit = spool_limit
        self._lock = threading.Lock()
        self._retrying = False
        self._closed = threading.Event()
        self.written = self.failures = self.dropped = 0
        self.last_error = ""

    @property
    def spooled(self) -> int:
        return len(self._spool)

    def append(self, record: dict[str, Any]) -> bool:
        """Write ``record`` (after anything spooled); False if it waits in the spool."""
        line = (json.dumps(record) + "\n").encode()
        with self._lock:
            if len(self._spool) >= self._limit:
                self._spool.popleft()
                self.dropped += 1
            self._spool.append(line)
            return self._flush()

    def probe(self) -> bool:
        """Open the file once (creating it): a clear warning at start if it cannot be written."""
        with self._lock:
            return self._flush(probe=True)

    def flush(self) -> bool:
        with self._lock:
            return self._flush()

    def _flush(self, probe: bool = False) -> bool:
        if not self._spool and not probe and not self.last_error:
            return True
        sent = 0
        try:
            fd = open_append(self.path)
            try:
                _end_torn_line(fd)
                for line in self._spool:   # (appends wait for the lock this holds)
                    _write_all(fd, line)
                    sent += 1
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            self._sent(sent)   # those lines are in the file: never written twice
            self.failures += 1
            first = not self.last_error
            self.last_error = f"{type(exc).__name__}: {exc.strerror or exc}"
            if first:
                log.error("cannot write %s (%s); %d record(s) kept in memory and retried every %.0f s",
                          self.path, self.last_error, len(self._spool), RETRY_SECONDS)
            self._retry_later()
            return False
        if self.last_error:
            log.warning("%s is writable again; the spooled records are written", self.path)
            self.last_error = ""   # before the spool empties: a status that shows it empty shows it ok
        self._sent(sent)
        return True

    def _sent(self, lines: int) -> None:
        """The first ``lines`` spooled lines are in the file (call with the lock held).  Counted
        before they leave the spool: a status that shows the spool empty shows them written."""
        self.written += lines
        for _ in range(lines):
            self._spool.popleft()

    def _retry_later(self) -> None:
        if self._retrying or self._closed.is_set():
            return
        self._retrying = True
        threading.Thread(target=self._retry_loop, name="rankwatch-spool", daemon=True).start()

    def close(self) -> None:
        """Stop retrying (what is still spooled stays unwritten)."""
        self._closed.set()

    def _retry_loop(self) -> None:
        while not self._closed.wait(RETRY_SECONDS):
            with self._lock:
                if self._flush():
                    self._retrying = False
                    return

    def status(self) -> dict[str, Any]:
        """The ``status --json`` form."""
        return {"path": str(self.path), "ok": not self.last_error, "written": self.written,
                "spooled": self.spooled, "failures": self.failures, "dropped": self.dropped,
                "last_error": self.last_error or None}
