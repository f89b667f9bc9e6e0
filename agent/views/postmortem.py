"""``rankwatch diagnose`` of a ``rank_exit``: who failed first and how, and what followed.

The story of a failure reads: the root cause (the first worker to fail, as
``agent/detect/root_cause.py`` named it), how it ended (the exception's type and message and
its innermost frame; the signal and the crashing thread's stack; the OOM kill; the exit
code), what it was doing (step, the collective it was in), and then each exit that followed
as a consequence, one line each.  Asked about a consequence, it says so and tells its root.

A root that ended with its node (``how: node_lost``) is told as the node's loss first, with
every rank it took, then the consequences.  An agent that holds only consequences (its ranks
died of peer errors while another node was lost) never says one of its own "failed first":
it says they were the consequence of a lost peer, and where the job's story is told.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rankwatch.agent.detect.root_cause import is_consequence

__all__ = ["how_line", "root_of", "tell_exit"]


def _when(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"


def how_line(d: dict[str, Any]) -> str:
    """How a worker ended, in one line."""
    how = d.get("how")
    if how == "exception":
        return f"raised {d.get('type') or 'an exception'}: {d.get('message', '')}"
    if how == "node_lost":
        return f"was lost with its node ({d.get('why') or 'its node was judged dead'})"
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


def _head(root: dict[str, Any], lost: list[dict[str, Any]]) -> list[str]:
    """The root's first lines: who failed first (or was lost, or only followed a lost peer)."""
    d = root["detail"]
    pid = f", pid {d['pid']}" if d.get("pid") else ""
    if lost:
        out = [f"node {root['node']} was lost first: {d.get('why') or 'judged dead'} (last heard "
               f"{_when(d.get('last_heard'))}, judged dead {_when(root['detected_at'])}); its ranks ended with it:"]
        for i in lost:
            pid = f", pid {i['detail']['pid']}" if i["detail"].get("pid") else ""
            out.append(f"  {i['id']}: rank {i['rank']}{pid}, last seen at step {i['step']} "
                       f"({_when(i['detail'].get('started_at'))})")
        return out
    if is_consequence(d):
        return [f"{root['id']}: rank {root['rank']} on node {root['node']}{pid} ended at step {root['step']}, "
                f"a consequence of a lost peer (ended {_when(d.get('started_at'))}, detected "
                f"{_when(root['detected_at'])})",
                "  every exit this agent holds followed another rank's end; the cause is not in its view "
                "(the coordinator's `rankwatch diagnose` names it)"]
    return [f"{root['id']}: rank {root['rank']} on node {root['node']}{pid} failed first, at step {root['step']} "
            f"(ended {_when(d.get('started_at'))}, detected {_when(root['detected_at'])})"]


def _lost_with(root: dict[str, Any], incidents: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``node_lost`` exits of the loss ``root`` is one of (same node, judged at once), by rank."""
    if root["detail"].get("how") != "node_lost":
        return []
    same = [i for i in incidents if i["kind"] == "rank_exit" and i["node"] == root["node"]
            and i["detail"].get("how") == "node_lost" and i["detected_at"] == root["detected_at"]]
    return sorted({i["id"]: i for i in [*same, root]}.values(), key=lambda i: i["rank"])


def tell_exit(incident: dict[str, Any], incidents: Sequence[dict[str, Any]] = ()) -> str:
    """A ``rank_exit`` (``status --json`` form) as the story of its failure."""
    root = root_of(incident, incidents)
    lost = _lost_with(root, incidents)
    roots = {i["id"] for i in lost} or {root["id"]}
    out = []
    if incident["id"] not in roots:
        first = (f"node {root['node']} was lost" if lost else f"rank {root['rank']} failed first"
                 if not is_consequence(root["detail"]) else f"rank {root['rank']} ended first here")
        out += [f"{incident['id']}: rank {incident['rank']} on node {incident['node']} {how_line(incident['detail'])}",
                f"  a consequence of {root['id']} ({first}); its story:", ""]
    d = root["detail"]
    out += _head(root, lost)
    if not lost:
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
    followed = [i for i in incidents if i["kind"] == "rank_exit" and i["id"] not in roots
                and i["detail"].get("root_cause") in roots]
    if followed:
        also = " also" if is_consequence(d) else ""
        out.append(f"  then,{also} as consequences ({len(followed)}):")
        out += [f"    {i['id']}: rank {i['rank']} on node {i['node']} {how_line(i['detail'])}"[:300] for i in followed]
    else:
        out.append("  no other worker's exit followed from it")
    return "\n".join(out + _frames(d))
