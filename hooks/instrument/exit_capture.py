"""A rank's last words: the uncaught exception that ends it, and a fatal signal's stacks.

Installed by :func:`rankwatch.hooks.init` (``_init``), so every instrumented worker leaves
evidence of how it ended:

* ``sys.excepthook`` and ``threading.excepthook`` are wrapped (the previous hooks are
  called after, always: nothing is swallowed).  An uncaught exception becomes an
  ``ExitRecord`` (its type, its message capped, the innermost frames as file/line/function,
  the step, the time, the thread) sent on the rank's ``Report`` stream; the hook waits for
  it to be handed to gRPC at most :data:`FLUSH_WAIT` seconds before the process goes on dying.
* ``faulthandler`` writes into a file of this process's own (``fault-<pid>-*.txt``) in a
  directory only its user may write (mode 0700, checked), so SIGSEGV, SIGABRT, SIGBUS,
  SIGFPE and SIGILL leave the crashing thread's stack; the agent reads it (capped) once the
  process is gone, and removes it.  A faulthandler the user enabled already is left as it
  is (no file then).  An empty file is removed when the rank closes.

What the agent makes of this (``how``: exception, signal, oom, exit_code) is decided in
``agent/node/exit_cause.py``.  Nothing here may raise into the training process.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import secrets
import stat
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

from rankwatch.address import default_dir
from rankwatch.proto import pb

__all__ = ["FAULT_DIR_ENV", "FLUSH_WAIT", "MAX_FRAMES", "MAX_MESSAGE", "ExitCapture", "exit_record", "fault_dir",
           "install"]

log = logging.getLogger(__name__)

FAULT_DIR_ENV = "RANKWATCH_FAULT_DIR"
FLUSH_WAIT = 1.0      # seconds the hook waits for its record to leave
MAX_FRAMES = 8
MAX_MESSAGE = 2000
_MAX_FIELD = 512      # a frame's file or function name
# The process's fault file, shared by every capture in it (a rank that calls init twice):
# [open file, path, captures using it].
_FAULT: list[Any] = [None, "", 0]
_FAULT_LOCK = threading.Lock()


def exit_record(etype: type[BaseException], value: BaseException | None, tb: TracebackType | None,
                step: int, thread: threading.Thread | None, main: bool) -> pb.ExitRecord:
    """The wire form of an uncaught exception (innermost :data:`MAX_FRAMES` frames, outermost first)."""
    name = etype.__qualname__
    module = getattr(etype, "__module__", "builtins")
    if module not in ("builtins", "__main__"):
        name = f"{module}.{name}"
    try:
        message = str(value) if value is not None else ""
    except Exception:  # noqa: BLE001 - a __str__ that raises
        message = "<unprintable>"
    rec = pb.ExitRecord(type=name[:_MAX_FIELD], message=message[:MAX_MESSAGE], step=max(-1, int(step)),
                        at=time.time(), thread=(thread.name if thread is not None else "")[:_MAX_FIELD],
                        main_thread=main)
    for fs in traceback.extract_tb(tb)[-MAX_FRAMES:] if tb is not None else []:
        rec.frames.append(pb.Frame(file=str(fs.filename)[-_MAX_FIELD:], line=max(0, int(fs.lineno or 0)),
                                   function=str(fs.name)[:_MAX_FIELD]))
    return rec


def fault_dir() -> str:
    """``$RANKWATCH_FAULT_DIR``, else ``<the per-user directory>/faults``."""
    return os.environ.get(FAULT_DIR_ENV) or os.path.join(default_dir(), "faults")


def _private_dir(path: str) -> None:
    """Make ``path`` (and its parent: the per-user directory the agent also uses, which it
    wants 0700) mode 0700 if missing; raise unless it is a directory of this user that no one
    else may write."""
    for p in (os.path.dirname(path), path):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass
    for p in (path, os.path.dirname(path)):
        st = os.lstat(p)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise PermissionError(f"{p} is not a directory of this user only")


def _prune(where: str, older: float = 7 * 86400, most: int = 1000) -> None:
    """Remove fault files no agent took (a crash with no agent running) after a week."""
    cutoff = time.time() - older
    try:
        with os.scandir(where) as entries:
            for n, e in enumerate(entries):
                if n >= most:
                    return
                if e.name.startswith("fault-") and e.is_file(follow_symlinks=False) and e.stat().st_mtime < cutoff:
                    os.unlink(e.path)
    except OSError:
        pass


class ExitCapture:
    """Args:
        step: the rank's current step (the recorder's).
        send: hands a record to the client and waits at most the given seconds for it to leave.
    """

    def __init__(self, step: Callable[[], int], send: Callable[[pb.ExitRecord, float], None]) -> None:
        self._step = step
        self._send = send
        self._prev_sys: Any = None
        self._prev_thread: Any = None
        self._fault_held = False
        self.fault_file = ""

    def install(self) -> None:
        self._prev_sys, sys.excepthook = sys.excepthook, self._sys_hook
        self._prev_thread, threading.excepthook = threading.excepthook, self._thread_hook
        try:
            self._enable_faulthandler()
        except Exception as exc:  # noqa: BLE001 - evidence only; training goes on
            log.warning("rankwatch: no fault file for fatal signals (%s)", exc)

    def _enable_faulthandler(self) -> None:
        with _FAULT_LOCK:
            if _FAULT[0] is None:
                if faulthandler.is_enabled():   # the user's (or PYTHONFAULTHANDLER): theirs stays
                    return
                where = fault_dir()
                _private_dir(where)
                _prune(where)
                path = os.path.join(where, f"fault-{os.getpid()}-{secrets.token_hex(4)}.txt")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                             | getattr(os, "O_CLOEXEC", 0), 0o600)
                _FAULT[0], _FAULT[1] = os.fdopen(fd, "w"), path
                faulthandler.enable(file=_FAULT[0], all_threads=True)
            _FAULT[2] += 1
            self._fault_held, self.fault_file = True, _FAULT[1]

    def uninstall(self) -> None:
        """Restore the hooks (where they are still ours); remove an empty fault file."""
        if sys.excepthook == self._sys_hook:
            sys.excepthook = self._prev_sys
        if threading.excepthook == self._thread_hook:
            threading.excepthook = self._prev_thread
        with _FAULT_LOCK:
            if not self._fault_held:
                return
            self._fault_held = False
            _FAULT[2] -= 1
            if _FAULT[2] > 0 or _FAULT[0] is None:
                return
            try:   # the last capture of the process: an empty file goes (a full one stays for the agent)
                if os.fstat(_FAULT[0].fileno()).st_size == 0:
                    faulthandler.disable()
                    _FAULT[0].close()
                    os.unlink(_FAULT[1])
                    _FAULT[0], _FAULT[1] = None, ""
            except OSError:
                pass

    def _report(self, etype: Any, value: Any, tb: Any, thread: threading.Thread | None, main: bool) -> None:
        try:
            self._send(exit_record(etype, value, tb, self._step(), thread, main), FLUSH_WAIT)
        except Exception:  # noqa: BLE001 - the previous hook still runs
            pass

    def _sys_hook(self, etype: Any, value: Any, tb: Any) -> None:
        self._report(etype, value, tb, threading.current_thread(), True)
        (self._prev_sys or sys.__excepthook__)(etype, value, tb)

    def _thread_hook(self, args: Any) -> None:
        if args.exc_type is not SystemExit:
            main = args.thread is threading.main_thread()
            self._report(args.exc_type, args.exc_value, args.exc_traceback, args.thread, main)
        (self._prev_thread or threading.__excepthook__)(args)


def install(recorder: Any, client: Any, hello: pb.Hello) -> ExitCapture | None:
    """Capture this rank's end for ``client`` (before it starts: ``hello`` then names the fault
    file); undone when the client closes.  None (logged) if it could not be installed."""
    try:
        capture = ExitCapture(lambda: recorder.step, client.exit_record)
        capture.install()
        hello.fault_file = capture.fault_file
        client.on_close.append(capture.uninstall)
        return capture
    except Exception:  # noqa: BLE001 - rankwatch never stops training
        log.exception("rankwatch: exit capture not installed")
        return None
