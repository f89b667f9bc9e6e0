"""``rankwatch diagnose`` for people: an incident told as a story, stacks as real tracebacks.

A hang reads: who is stuck, where (the collective the others wait in, with its
group and sequence number, and Flight Recorder's view beside the hooks'), whether
the process is alive, stopped or gone, how the hang ended, and then the stuck
rank's Python stacks, one traceback per thread, the main thread first.  Other
incidents list their evidence, one field a line.  ``diagnose --json`` keeps the
machine form.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["recovery_line", "split_stacks", "tell"]

_SOURCES = {"hooks": "rankwatch's hooks", "flight_recorder": "Flight Recorder"}
_THREAD = re.compile(r"^Thread (?P<name>.*) \((?P<ident>\d+)\):$")


def tell(incident: dict[str, Any], incidents: Sequence[dict[str, Any]] = ()) -> str:
    """The incident (``status --json`` form) as text for a terminal; ``incidents``: the others
    of the view (a rank exit's story names the exits that followed from it)."""
    if incident["kind"] == "hang":
        return _hang(incident)
    if incident["kind"] == "rank_exit" and incident["detail"].get("how"):
        from rankwatch.agent.views.postmortem import tell_exit

        return tell_exit(incident, incidents)
    if incident["kind"] == "restart" and incident["detail"].get("tier") == "in_process":
        return _recovery(incident)
    return _generic(incident)


def _when(t: float | None) -> str:
    return "?" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _collective(c: dict[str, Any] | None) -> str:
    if not c:
        return "no collective"
    group = f" on group {c['group']}" if c.get("group") not in (None, "") else ""
    return f"{c.get('op', '?')}{group}, seq {c.get('seq', '?')}"


def _hang(inc: dict[str, Any]) -> str:
    d = inc["detail"]
    out = [f"{inc['id']}: the job hung at step {inc['step']} (detected {_when(inc['detected_at'])}, "
           f"no progress for {d.get('stalled_seconds', 0):.1f} s; allowance "
           f"{d.get('allowance_seconds', 0):.1f} s)", ""]
    pid = f", pid {d['pid']}" if d.get("pid") else ""
    out.append(f"  stuck:    rank {inc['rank']} on node {inc['node']}{pid}")
    out.append(f"            {d.get('reason', '')}")
    out.append(f"  process:  {_process(d)}")
    coll = d.get("collective")
    source = (f" (seen by {_SOURCES.get(coll['source'], coll['source'])})"
              if coll and coll.get("source") else "")
    out.append(f"  others:   wait in {_collective(coll)}{source}" if coll else
               "  others:   in no collective the hooks or Flight Recorder saw")
    inflight = d.get("inflight")
    out.append(f"  the stuck rank: inside {_collective(inflight)}" if inflight else
               "  the stuck rank: outside any collective")
    if d.get("silent_ranks"):
        out.append(f"  silent:   ranks {', '.join(map(str, d['silent_ranks']))} sent nothing")
    fr = d.get("flight_recorder")
    if fr:
        out.append("  Flight Recorder (per rank: oldest collective not retired; last completed/issued seq):")
        out.extend(f"    rank {rank}: {_fr_line(view)}" for rank, view in sorted(fr.items(), key=lambda kv: int(kv[0])))
    out.append(f"  outcome:  {_outcome(inc)}")
    out.append("")
    stacks = d.get("stacks")
    if stacks:
        threads = split_stacks(stacks)
        out.append(f"Python stacks of rank {inc['rank']}{pid} ({len(threads)} threads, main thread first):")
        for name, lines in threads:
            out.append("")
            out.append(f"Thread {name}:")
            out.append("Traceback (most recent call last):")
            out.extend(lines)
    else:
        out.append(f"No Python stacks: {d.get('stacks_note') or 'none were sent'}.")
    return "\n".join(out)


def _process(d: dict[str, Any]) -> str:
    if d.get("stopped"):
        return "alive but stopped (SIGSTOP): it runs nothing until SIGCONT"
    if d.get("alive") is True:
        return "alive and running when the hang was called"
    if d.get("alive") is False:
        return "gone (the process had exited)"
    return "unknown (its node's agent was silent)"


def _outcome(inc: dict[str, Any]) -> str:
    d = inc["detail"]
    at = d.get("resolved_at")
    if at is None:
        return "still hung when last seen"
    after = f"{_when(at)}, {at - inc['detected_at']:.1f} s after detection"
    if d.get("outcome") == "ended":
        return f"the job ended while hung ({after}); it never resumed"
    if d.get("outcome") == "resumed":
        return f"progress resumed ({after})"
    if d.get("superseded_by"):
        return f"handed to {d['superseded_by']} ({after})"
    return f"over ({after}; a restart or the coordinator took it over)"


# The phases of an in-process recovery, in order (agent/wire/ranges.py RECOVERY_PHASES), as read.
_RECOVERY_PHASES = (("left_step", "left the failed step"), ("agreed", "agreed on the new membership"),
                    ("reinitialised", "process groups and mesh rebuilt"),
                    ("resharded", "shards assembled from peer snapshots"),
                    ("reloaded", "the newest checkpoint loaded in process"), ("restored", "state restored"),
                    ("first_step", "first step done"))


def _recovery_phases(d: dict[str, Any]) -> dict[str, float]:
    phases = d.get("phases")
    return {k: float(v) for k, v in phases.items() if isinstance(v, (int, float))} if isinstance(phases, dict) else {}


def recovery_line(d: dict[str, Any]) -> str:
    """An in-process recovery's detail in one line (the timeline's and ``status``' form)."""
    phases = _recovery_phases(d)
    took = phases.get("first_step", max(phases.values(), default=0.0))
    dropped = d.get("dropped_nodes") or []
    left_out = f" without {', '.join(map(str, dropped))}" if dropped else ""
    world = f"world {d.get('old_world_size', '?')} -> {d.get('new_world_size', '?')}{left_out}"
    steps = ", ".join(f"{k} {phases[k]:.2f}s" for k, _ in _RECOVERY_PHASES if k in phases)
    if d.get("ok"):
        head = f"in-process recovery after step {d.get('step', '?')}: {world}, training again after {took:.2f}s"
    else:
        head = (f"in-process recovery after step {d.get('step', '?')} FAILED after {took:.2f}s "
                f"({world}): {d.get('error') or 'no error given'}")
    return head + (f" ({steps})" if steps else "")


def _recovery(inc: dict[str, Any]) -> str:
    d = inc["detail"]
    phases = _recovery_phases(d)
    outcome = "recovered" if d.get("ok") else "FAILED"
    out = [f"{inc['id']}: in-process recovery on node {inc['node']} after step {inc['step']}: {outcome} "
           f"(failure caught {_when(d.get('started_at', inc['detected_at']))})", ""]
    dropped = d.get("dropped_nodes") or []
    out.append(f"  world:    {d.get('old_world_size', '?')} ranks -> {d.get('new_world_size', '?')} ranks"
               + (f"; nodes left out: {', '.join(map(str, dropped))}" if dropped else "; no node left out"))
    out.append("  phases (seconds after the failure was caught):")
    for key, what in _RECOVERY_PHASES:
        out.append(f"    {key:<14}{phases[key]:8.2f} s  {what}" if key in phases else
                   f"    {key:<14}{'-':>8}    not reached")
    if d.get("ok"):
        out.append(f"  outcome:  training went on in the new world; reported first by rank {inc['rank']}")
    else:
        out.append(f"  outcome:  the attempt failed: {d.get('error') or 'no error given'}")
        out.append("            torchrun's elastic restart (the fallback tier) takes over")
    return "\n".join(out)


def _fr_line(view: dict[str, Any]) -> str:
    pending = view.get("pending") or []
    head = "nothing pending"
    if pending:
        oldest = min(pending, key=lambda e: e.get("since", 0))
        head = f"{_collective(oldest)} ({oldest.get('state') or 'pending'})"
    groups = sorted(set(view.get("completed") or {}) | set(view.get("enqueued") or {}))
    seqs = "; ".join(f"group {g}: {view.get('completed', {}).get(g, '?')}/{view.get('enqueued', {}).get(g, '?')}"
                     for g in groups)
    return head + (f" ({seqs})" if seqs else "")


def split_stacks(text: str) -> list[tuple[str, list[str]]]:
    """The hooks' stacks (``Thread NAME (ID):`` then ``traceback.format_stack`` lines) as
    ``[(name, lines)]``, the main thread first."""
    threads: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            threads.append((m["name"], []))
        elif line.strip():
            if not threads:
                threads.append(("?", []))
            threads[-1][1].append(line)
    return sorted(threads, key=lambda t: t[0] != "MainThread")


def _generic(inc: dict[str, Any]) -> str:
    out = [f"{inc['id']}: {inc['kind']} on node {inc['node']}, rank {inc['rank']}, step {inc['step']} "
           f"(detected {_when(inc['detected_at'])})"]
    for key, value in inc["detail"].items():
        if isinstance(value, str) and "\n" in value:
            out.append(f"  {key}:")
            out.extend(f"    {line}" for line in value.splitlines())
        elif isinstance(value, (int, float)) and (key.endswith("_at") or key == "last_seen"):
            out.append(f"  {key}: {_when(value)}")
        else:
            out.append(f"  {key}: {_value(value)}")
    return "\n".join(out)


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return str(v)
