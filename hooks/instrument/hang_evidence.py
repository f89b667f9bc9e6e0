"""What a hang needs from a rank, read by its sender thread (never the training thread):
every thread's Python stack, and PyTorch's Flight Recorder cut to the collectives still pending."""

from __future__ import annotations

import json
import sys
import threading
import traceback

__all__ = ["all_stacks", "flight_recorder_pending"]


def all_stacks(limit: int = 64 << 10) -> str:
    """Every thread's Python stack, read from this (sender) thread."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, '?')} ({ident}):\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)[-limit:]


def flight_recorder_pending(limit: int = 32) -> str:
    """PyTorch's Flight Recorder, cut to what a hang needs, as JSON (``""`` if it is off).

    ``pending``: the collectives issued and not yet retired (newest ``limit``),
    each ``{group, desc, seq, op, state, since}``; ``completed`` and ``enqueued``:
    every process group's last completed and last issued sequence numbers.  Read by the sender thread:
    the dump takes the recorder's own lock, never the GIL-holding main thread's help.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return ""
    try:
        dump = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(
            includeCollectives=True, onlyActive=True))
    except Exception:  # noqa: BLE001 - diagnostics only; an old or FR-less build
        return ""
    entries = dump.get("entries") or []
    if not entries and not dump.get("pg_status"):
        return ""
    pending = []
    for e in entries:
        if e.get("retired") or e.get("state") == "completed":
            continue
        group = e.get("process_group") or ["", ""]
        pending.append({"group": str(group[0]), "desc": str(group[1]) if len(group) > 1 else "",
                        "seq": int(e.get("collective_seq_id", -1)),
                        "op": str(e.get("profiling_name", "")).rpartition(":")[2],
                        "state": str(e.get("state", "")),
                        "since": e.get("time_created_ns", 0) * 1e-9})
    last: dict[str, dict[str, int]] = {"completed": {}, "enqueued": {}}
    for group, st in (dump.get("pg_status") or {}).items():
        for key in last:
            try:
                last[key][str(group)] = int(st[f"last_{key}_collective"])
            except (KeyError, TypeError, ValueError):
                continue
    return json.dumps({"pending": pending[-limit:], **last})
