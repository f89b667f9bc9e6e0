"""``rankwatch diagnose`` of a ``rank_exit``: who failed first and how, and what followed.

The story of a failure reads: the root cause (the first worker to fail, as
``agent/job/root_cause.py`` named it), how it ended (the exception's type and message and
its innermost frame; the signal and the crashing thread's stack; the OOM kill; the exit
code), what it was doing (step, the collective it was in), and then each exit that followed
as a consequence, one line each.  Asked about a consequence, it says so and tells its root.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

__all__ = ["how_line", "root_of", "tell_exit"]


def _when(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"


def how_line(d: dict[str, Any]) -> str:
    """How a worker ended, in one line."""
    how = d.get("how")
    if how == "exception":
        return f"raised {d.get('type') or 'an exception'}: {d.get('message', '')}"
    if how == "oom":
        return "was killed for memory (the out-of-memory killer, SIGKILL)"
    if how == "signal":
        by = " from torchrun, after another worker failed" if d.get("stopped_by") == "torchrun" else ""
        fatal = f" ({d['fatal_error']})" if d.get("fatal_error") else ""
        return f"was killed by {d.get('signal') or 'a signal'}{fatal}{by}"
    code = d.get("exit_code")
    return f"exited with code {code}" if code is not None else "ended; how is unknown (no record, no exit code)"


def root_of(incident: dict[str, Any], incidents: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The incident named as ``incident``'s root cause (itself if it is, or if that one is not here)."""
    root = incident["detail"].get("root_cause")
    return next((i for i in incidents if i["id"] == root), incident)


def _frames(d: dict[str, Any]) -> list[str]:
    frames = [f for f in d.get("frames") or [] if isinstance(f, dict)]
    if not frames:
        return []
    out = ["  innermost frames (most recent call last):"]
    out += [f"    File \"{f.get('file')}\", line {f.get('line')}, in {f.get('function')}" for f in frames]
    return out


def tell_exit(incident: dict[str, Any], incidents: Sequence[dict[str, Any]] = ()) -> str:
    """A ``rank_exit`` (``status --json`` form) as the story of its failure."""
    root = root_of(incident, incidents)
    out = []
    if root is not incident and root["id"] != incident["id"]:
        out += [f"{incident['id']}: rank {incident['rank']} on node {incident['node']} {how_line(incident['detail'])}",
                f"  a consequence of {root['id']} (rank {root['rank']} failed first); its story:", ""]
    d = root["detail"]
    pid = f", pid {d['pid']}" if d.get("pid") else ""
    out.append(f"{root['id']}: rank {root['rank']} on node {root['node']}{pid} failed first, at step {root['step']} "
               f"(ended {_when(d.get('started_at'))}, detected {_when(root['detected_at'])})")
    out.append(f"  how:      {how_line(d)}")
    frames = [f for f in d.get("frames") or [] if isinstance(f, dict)]
    if frames:
        f = frames[-1]
        out.append(f"  where:    {f.get('function')} ({f.get('file')}:{f.get('line')})")
    coll = d.get("last_collective") or d.get("inflight")
    if isinstance(coll, dict):
        out.append(f"  last in:  {coll.get('op', '?')} on group {coll.get('group', '?')}, seq {coll.get('seq', '?')}")
    if d.get("exit_code") is not None and d.get("how") != "exit_code":
        out.append(f"  exit code (torchrun): {d['exit_code']}")
    out.append(f"  evidence: {', '.join(d.get('evidence') or []) or 'its stream ended and its process was gone'}")
    followed = [i for i in incidents if i["kind"] == "rank_exit" and i["id"] != root["id"]
                and i["detail"].get("root_cause") == root["id"]]
    if followed:
        out.append(f"  then, as consequences ({len(followed)}):")
        out += [f"    {i['id']}: rank {i['rank']} on node {i['node']} {how_line(i['detail'])}"[:300] for i in followed]
    else:
        out.append("  no other worker's exit followed from it")
    return "\n".join(out + _frames(d))
