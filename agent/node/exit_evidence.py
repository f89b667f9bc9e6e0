"""What the node agent gathers about how its workers end, for :mod:`.exit_cause` to judge.

Per rank stream: the faulthandler file its Hello names, its memory cgroup's ``oom_kill``
count when it connected, and its exit record (an uncaught exception).  Per worker pid:
torchrun's report of its end (the ``ReportWorkerExits`` RPC).  And the kernel's log, where
it is readable, for the pids the out-of-memory killer killed.

Everything from the wire is checked and capped here; everything read from the system fails
to "no evidence", never to an error.  A fault file is read only where a rank's own
exit capture could have made it: a name ``fault-<its pid>-<8 hex>.txt``, a regular file of
this agent's user, in a directory of that user that no one else may write, at most
:data:`MAX_FAULT_BYTES`; it is removed once read.  Every table is bounded.
"""

from __future__ import annotations

import logging
import math
import os
import re
import stat
import threading
from collections import OrderedDict, deque
from typing import Any

from rankwatch.agent.node.exit_cause import parse_fault_text
from rankwatch.agent.wire.ranges import Rejected, clean_text
from rankwatch.proto import pb

__all__ = ["ExitEvidence", "KernelLog", "MAX_FAULT_BYTES", "check_exit_record", "check_worker_exits",
           "oom_kills", "read_fault_file"]

log = logging.getLogger(__name__)

MAX_FAULT_BYTES = 256 << 10
MAX_REPORTS = 256          # worker exits in one ReportWorkerExits call
_MAX_ERROR_FILE = 64 << 10
_FAULT_NAME = re.compile(r"^fault-(?P<pid>\d+)-[0-9a-f]{8}\.txt$")
_LIMIT = 1024              # streams and pids kept


def check_exit_record(rec: pb.ExitRecord) -> dict[str, Any]:
    """A rank's exit record as the agent keeps it (strings capped, numbers in range).

    Raises:
        Rejected: a time or step out of range."""
    if not math.isfinite(rec.at) or not 0 <= rec.at < 1e11 or not -1 <= rec.step < 1 << 62:
        raise Rejected("invalid_exit", f"exit record at {rec.at} / step {rec.step} out of range")
    frames = [{"file": clean_text(f.file, 512), "line": min(max(0, f.line), 1 << 24),
               "function": clean_text(f.function, 256)} for f in list(rec.frames)[-8:]]
    return {"type": clean_text(rec.type, 256), "message": clean_text(rec.message, 2000), "frames": frames,
            "step": rec.step, "at": rec.at, "thread": clean_text(rec.thread, 256),
            "main_thread": bool(rec.main_thread)}


def check_worker_exits(msg: pb.WorkerExits) -> list[dict[str, Any]]:
    """torchrun's reports, checked (the call is refused whole if one is out of range).

    Raises:
        Rejected: too many, or a field out of range."""
    if len(msg.exits) > MAX_REPORTS:
        raise Rejected("invalid_exit", f"{len(msg.exits)} worker exits in one call (at most {MAX_REPORTS})")
    out = []
    for e in msg.exits:
        if not 0 < e.pid < 1 << 32 or not 0 <= e.rank < 1 << 24 or not 0 <= e.local_rank < 1 << 16:
            raise Rejected("invalid_exit", f"worker exit pid {e.pid} rank {e.rank} out of range")
        if not -256 < e.exitcode < 256 or not math.isfinite(e.at) or not 0 <= e.at < 1e11:
            raise Rejected("invalid_exit", f"worker exit code {e.exitcode} / time {e.at} out of range")
        if len(e.error_file) > _MAX_ERROR_FILE:
            raise Rejected("invalid_exit", "torchrun's error file over 64 KiB")
        out.append({"pid": e.pid, "rank": e.rank, "local_rank": e.local_rank, "exitcode": e.exitcode,
                    "signal": clean_text(e.signal, 32), "error_file": e.error_file, "at": e.at,
                    "failed": bool(e.failed), "run_id": clean_text(msg.run_id, 256)})
    return out


def read_fault_file(path: str, pid: int) -> str | None:
    """The faulthandler text a rank left at ``path`` (then removed), or None (no file, empty,
    or not one its exit capture could have made: see the module docstring)."""
    if not path or len(path) > 4096 or "\0" in path or not os.path.isabs(path):
        return None
    m = _FAULT_NAME.match(os.path.basename(path))
    if m is None or int(m["pid"]) != pid:
        return None
    try:
        parent = os.lstat(os.path.dirname(path))
        if not stat.S_ISDIR(parent.st_mode) or parent.st_uid != os.getuid() or parent.st_mode & 0o022:
            return None
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                return None
            data = os.read(fd, MAX_FAULT_BYTES)
        finally:
            os.close(fd)
        os.unlink(path)
    except OSError:
        return None
    return data.decode("utf-8", "replace") or None


def _cgroup_counters(pid: int) -> list[str]:
    """The files holding ``pid``'s memory cgroup's ``oom_kill`` count (v2 and v1)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read(1 << 16).splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if ".." in path.split("/"):
            continue
        if controllers == "":
            out += [f"/sys/fs/cgroup{path}/memory.events", f"/sys/fs/cgroup/unified{path}/memory.events"]
        elif "memory" in controllers.split(","):
            out.append(f"/sys/fs/cgroup/memory{path}/memory.oom_control")
    return [p.replace("//", "/") for p in out]


def oom_kills(files: list[str]) -> int | None:
    """The largest ``oom_kill`` count the files hold (None: none readable)."""
    best = None
    for path in files:
        try:
            with open(path) as f:
                for line in f.read(1 << 16).splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and value.strip().isdigit():
                        best = max(best or 0, int(value))
        except OSError:
            continue
    return best


class KernelLog:
    """The pids the kernel's log says the out-of-memory killer killed, from the agent's start
    on (``/dev/kmsg``, where this user may read it; else it says nothing)."""

    _KILLED = re.compile(r"(?:Killed process |oom-kill:.*,pid=)(\d+)")

    def __init__(self, path: str = "/dev/kmsg") -> None:
        self._fd: int | None = None
        self._killed: deque[int] = deque(maxlen=_LIMIT)
        self._lock = threading.Lock()
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self._fd, 0, os.SEEK_END)
        except OSError:
            self._fd = None

    def killed(self, pid: int) -> bool:
        with self._lock:
            self._read()
            return pid in self._killed

    def _read(self, most: int = 10000) -> None:
        if self._fd is None:
            return
        for _ in range(most):
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                return
            except OSError:   # EPIPE: records were overwritten before they were read
                continue
            if not record:
                return
            m = self._KILLED.search(record.decode("utf-8", "replace"))
            if m:
                self._killed.append(int(m[1]))


class ExitEvidence:
    """Args:
        kernel: the kernel's OOM record (None: not read)."""

    def __init__(self, kernel: KernelLog | None = None) -> None:
        self._lock = threading.Lock()
        self._kernel = kernel
        # stream id -> {"pid", "fault_file", "cgroup": [files], "oom_base", "record"}
        self._streams: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._torchrun: OrderedDict[int, dict[str, Any]] = OrderedDict()   # pid -> report
        self.reports_received = 0

    def _bound(self, table: OrderedDict) -> None:
        while len(table) > _LIMIT:
            table.popitem(last=False)

    def hello(self, stream: int, pid: int, fault_file: str) -> None:
        """A rank's stream opened: note its fault file, and its memory cgroup's OOM count now."""
        files = _cgroup_counters(pid)
        facts = {"pid": pid, "fault_file": clean_text(fault_file, 4096), "cgroup": files,
                 "oom_base": oom_kills(files), "record": None}
        with self._lock:
            self._streams[stream] = facts
            self._bound(self._streams)

    def recorded(self, stream: int, rec: pb.ExitRecord) -> None:
        """A rank's exit record (raises Rejected if out of range); a main thread's stands over
        a thread's."""
        checked = check_exit_record(rec)
        with self._lock:
            facts = self._streams.get(stream)
            if facts is not None and not (facts["record"] or {}).get("main_thread"):
                facts["record"] = checked

    def dying(self, stream: int) -> bool:
        """The rank said its main thread dies of an exception (its goodbye is no clean end)."""
        with self._lock:
            facts = self._streams.get(stream)
            return bool(facts and (facts["record"] or {}).get("main_thread"))

    def torchrun_reported(self, reports: list[dict[str, Any]]) -> None:
        with self._lock:
            for r in reports:
                old = self._torchrun.get(r["pid"])
                if old is None or (r["failed"] and not old["failed"]):
                    self._torchrun[r["pid"]] = r
            self._bound(self._torchrun)
            self.reports_received += len(reports)

    def torchrun_for(self, pid: int) -> dict[str, Any] | None:
        with self._lock:
            return self._torchrun.get(pid)

    def settled(self, stream: int, pid: int) -> bool:
        """Nothing more is to come: torchrun told its end (its exit code; the rank's own
        exit record, if any, came before its stream ended)."""
        return self.torchrun_for(pid) is not None

    def reports(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._torchrun.values())

    def gather(self, stream: int | None, pid: int) -> dict[str, Any]:
        """Everything known of how ``pid`` ended, as :func:`.exit_cause.classify` takes it."""
        with self._lock:
            facts = dict(self._streams.get(stream, {})) if stream is not None else {}
        text = read_fault_file(facts.get("fault_file") or "", pid)
        fault = parse_fault_text(text) if text else None
        after, base = oom_kills(facts.get("cgroup") or []), facts.get("oom_base")
        oom = (after is not None and after > (base or 0)) or (self._kernel is not None and self._kernel.killed(pid))
        return {"record": facts.get("record"), "fault": fault, "torchrun": self.torchrun_for(pid), "oom": oom}

