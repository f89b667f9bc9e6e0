"""How a worker ended: the ``rank_exit`` incident's ``how`` and its evidence, decided from what
the agent has.  Pure functions; the evidence is gathered by :mod:`.exit_evidence`.

The sources, strongest first:

* the rank's **exit record** (its exception hook, ``hooks/instrument/exit_capture.py``): an
  uncaught exception in the main thread is ``how: exception`` with its type, message and
  innermost frames, whatever killed the process after;
* the **memory cgroup's ``oom_kill`` counter** grew while the rank lived (or the kernel logged
  the kill of its pid), and the process was killed (SIGKILL, or no word from torchrun):
  ``how: oom``;
* the rank's **faulthandler file**: a fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL)
  with the crashing thread's stack: ``how: signal``;
* **torchrun's report** (``hooks/rendezvous/worker_results.py``): an exit by signal is
  ``how: signal`` (SIGKILL from outside is only seen here); a nonzero exit code with
  torchrun's error file (``TORCHELASTIC_ERROR_FILE``, written by ``@record``) holding an
  exception is ``how: exception``; else ``how: exit_code``; a worker torchrun stopped
  because another failed is ``how: signal`` (SIGTERM), ``stopped_by: torchrun``;
* a thread's uncaught exception, when nothing above says more;
* nothing: ``how: exit_code`` with ``exit_code`` null (the stream ended, the process is gone,
  and no one said how).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["FAULT_SIGNALS", "HOWS", "classify", "error_file_exception", "parse_fault_text", "signal_name"]

HOWS = ("exception", "signal", "oom", "exit_code")
"""The values of ``detail.how`` a node agent decides (the metric's label set); the contract's
fifth, ``node_lost``, is the coordinator's record of a rank its dead node took with it
(:mod:`rankwatch.agent.job.node_lost`)."""

FAULT_SIGNALS = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
                 "Floating-point exception": "SIGFPE", "Floating point exception": "SIGFPE",
                 "Illegal instruction": "SIGILL"}
_SIGNALS = {1: "SIGHUP", 2: "SIGINT", 3: "SIGQUIT", 4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE",
            9: "SIGKILL", 10: "SIGUSR1", 11: "SIGSEGV", 12: "SIGUSR2", 13: "SIGPIPE", 14: "SIGALRM",
            15: "SIGTERM"}
_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.*)$')
_FATAL = re.compile(r"^Fatal Python error: (?P<what>[^\n]*)$", re.M)
_ERROR_HEAD = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning|Fault)?): (?P<msg>.*)",
                         re.S)
MAX_FRAMES = 8
_MAX_TEXT = 2000


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9 (Linux numbering), ``SIG<n>`` for one not named here."""
    return _SIGNALS.get(number, f"SIG{number}")


def parse_fault_text(text: str) -> dict[str, Any] | None:
    """A faulthandler dump: ``{signal, error, frames}`` of the thread that crashed (its
    innermost :data:`MAX_FRAMES` frames, outermost first), or None if ``text`` holds none."""
    m = _FATAL.search(text)
    if m is None:
        return None
    what = m["what"].strip()
    lines = text[m.end():].splitlines()
    start = next((n for n, line in enumerate(lines) if line.startswith("Current thread")), None)
    if start is None:   # one thread only: "Stack (most recent call first):"
        start = next((n for n, line in enumerate(lines) if "most recent call first" in line), None)
    frames: list[dict[str, Any]] = []
    for line in lines[start + 1:] if start is not None else []:
        f = _FRAME.match(line)
        if f is None:
            break
        frames.append({"file": f["file"][-512:], "line": int(f["line"]), "function": f["function"][:512]})
    frames = frames[:MAX_FRAMES][::-1]   # faulthandler writes the innermost first
    return {"signal": FAULT_SIGNALS.get(what, "SIGSEGV" if "fault" in what.lower() else what[:64]),
            "error": what[:256], "frames": frames}


def error_file_exception(data: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """torchrun's error file (``@record``'s JSON) as ``{type, message, frames}``, or None.

    Its ``message`` is ``{"message": "RuntimeError: ...", "extraInfo": {"py_callstack": ...}}``
    (or a plain string)."""
    if not isinstance(data, Mapping):
        return None
    msg = data.get("message")
    extra: Any = {}
    if isinstance(msg, Mapping):
        extra = msg.get("extraInfo") or {}
        msg = msg.get("message")
    if not isinstance(msg, str) or not msg.strip() or msg.strip() in ("<NONE>", "<N/A>"):
        return None
    head = _ERROR_HEAD.match(msg.strip())
    etype, text = (head["type"], head["msg"]) if head else ("", msg.strip())
    frames = []
    stack = extra.get("py_callstack") if isinstance(extra, Mapping) else None
    if isinstance(stack, str):
        for line in stack.splitlines():
            f = re.match(r'^\s*File "(?P<file>.*)", line (?P<line>\d+), in (?P<function>.*)$', line)
            if f:
                frames.append({"file": f["file"][-512:], "line": int(f["line"]), "function": f["function"][:512]})
    return {"type": etype[:256], "message": text[:_MAX_TEXT], "frames": frames[-MAX_FRAMES:]}


def _from_record(rec: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": rec.get("type", ""), "message": rec.get("message", ""), "frames": list(rec.get("frames") or []),
            "thread": rec.get("thread", "")}


def _reason(d: Mapping[str, Any]) -> str:
    how = d["how"]
    if how == "exception":
        return f"{d.get('type') or 'an exception'}: {d.get('message', '')}"[:300]
    if how == "oom":
        return "killed for memory (the out-of-memory killer)"
    if how == "signal":
        by = " by torchrun, after another worker failed" if d.get("stopped_by") == "torchrun" else ""
        return f"killed by {d.get('signal') or 'a signal'}{by}"
    code = d.get("exit_code")
    return f"exited with code {code}" if code is not None else "its process is gone; how it ended is unknown"


def classify(*, record: Mapping[str, Any] | None, fault: Mapping[str, Any] | None,
             torchrun: Mapping[str, Any] | None, oom: bool) -> dict[str, Any]:
    """The ``rank_exit`` detail fields that say how the worker ended (see the module's order).

    Args:
        record: the rank's exit record (``type``, ``message``, ``frames``, ``step``, ``at``,
            ``thread``, ``main_thread``), or None.
        fault: :func:`parse_fault_text` of its faulthandler file, or None.
        torchrun: torchrun's report (``exitcode``, ``signal``, ``error_file`` as JSON text or
            "", ``failed``), or None.
        oom: the rank's memory cgroup counted an OOM kill while it lived, or the kernel's
            log names its pid.
    """
    evidence = [name for name, have in (("exit_record", record), ("faulthandler", fault),
                                        ("torchrun", torchrun), ("oom_kill", oom)) if have]
    code = torchrun.get("exitcode") if torchrun else None
    killed = code is not None and code < 0
    tsignal = (torchrun.get("signal") or signal_name(-int(code))) if killed and torchrun and code is not None else None
    d: dict[str, Any] = {"evidence": evidence, "exit_code": code}
    main = record is not None and bool(record.get("main_thread"))
    if main and record is not None:
        d.update(how="exception", **_from_record(record))
    elif oom and (tsignal in (None, "SIGKILL")) and fault is None:
        d.update(how="oom", signal="SIGKILL")
    elif fault is not None:
        d.update(how="signal", signal=fault["signal"], fatal_error=fault["error"], frames=list(fault["frames"]))
    elif torchrun is not None and not torchrun.get("failed", True):   # stopped, or SIGTERMed, by torchrun
        d.update(how="signal", signal="SIGTERM", stopped_by="torchrun")
    elif tsignal is not None:
        d.update(how="signal", signal=tsignal)
    elif code:
        exc = error_file_exception(_json(torchrun.get("error_file") if torchrun else None))
        d.update(how="exception", **exc) if exc else d.update(how="exit_code")
    elif record is not None:   # a thread died of an exception, and then the process
        d.update(how="exception", **_from_record(record))
    else:
        d.update(how="exit_code")
    if record is not None and not main and d["how"] != "exception":
        d["thread_exception"] = _from_record(record)
    d["reason"] = _reason(d)
    return d


def _json(text: Any) -> Any:
    if isinstance(text, Mapping):
        return text
    if not isinstance(text, str) or not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None
