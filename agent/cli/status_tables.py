"""Human views of a status: the per-rank table and the incident timeline.

Every string in a status may come from the wire (a rank's mesh names, another node's id,
an incident's detail): each is cut, stripped of control characters and escaped before
rich renders it, so no text can carry markup (a mesh key ``[/x]``) or terminal escapes.
"""

from __future__ import annotations

import time
from typing import Any

from rich import box
from rich.markup import escape
from rich.table import Table

from rankwatch.agent.views.story import recovery_line
from rankwatch.agent.wire.ranges import clean_text

__all__ = ["bottleneck_line", "brief", "conflicts_line", "goodput_line", "latency_table", "rank_table", "recovery_table", "timeline"]


def shown(value: Any, limit: int = 128) -> str:
    """``value`` as text safe to give rich: cut, without control characters, markup escaped."""
    return escape(clean_text(str(value), limit).replace("\n", " ").replace("\t", " "))


def rank_table(status: dict[str, Any], title: str | None = None) -> Table:
    t = Table(title=title or f"rankwatch — node {shown(status['node'])}", title_justify="left",
              box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("rank", "node", "pid", "mesh", "step", "step ms", "data", "fwd", "bwd", "opt",
                "colls", "drop", "slow", "state"):
        t.add_column(col, justify="right" if col not in ("node", "mesh", "state") else "left",
                     no_wrap=True)
    for r in status["ranks"]:
        ph = r["phase_seconds"]
        state = "restarting" if r.get("restarting") else r["state"]
        state = state if r["connected"] else f"{state}, gone"
        state = shown(state)
        t.add_row(str(r["rank"]), shown(r["node"]), str(r["pid"]),
                  shown(" ".join(f"{k}{v}" for k, v in sorted(r["mesh"].items()))), str(r["step"]),
                  f"{r['step_seconds'] * 1e3:.1f}", *(f"{ph.get(p, 0.0) * 1e3:.1f}" for p in
                                                     ("data", "forward", "backward", "optimizer")),
                  str(r["collectives"]), str(r["dropped"]), f"{r.get('slowdown', 1.0):.2f}",
                  f"[green]{state}[/]" if state.startswith("ok") else f"[red]{state}[/]")
    caption = f"tokens/s {status['tokens_per_second']:.0f}"
    if status.get("mfu") is not None:
        caption += f"  MFU {status['mfu']:.1%}"
    if status.get("goodput") is not None:
        caption += f"  goodput {status['goodput']:.1%}"
    if status.get("bottleneck"):
        caption += f"  {bottleneck_line(status)}"
    t.caption = caption + f"  incidents {len(status['incidents'])}"
    return t


def latency_table(status: dict[str, Any]) -> Table:
    """Each rank's collective latency by op: calls, and p50/p99 over its recent calls."""
    t = Table(title="collective latency per rank (p50/p99 over each op's recent calls)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("rank", "node", "op", "calls", "p50 ms", "p99 ms"):
        t.add_column(col, justify="left" if col in ("node", "op") else "right", no_wrap=True)
    for r in status["ranks"]:
        for op, v in sorted(r.get("op_latency", {}).items()):
            t.add_row(str(r["rank"]), shown(r["node"]), shown(op), str(v["count"]), f"{v['p50_seconds'] * 1e3:.2f}",
                      f"{v['p99_seconds'] * 1e3:.2f}")
    return t


def recovery_table(status: dict[str, Any], last: int = 8) -> Table | None:
    """The ``last`` in-process recoveries among the status' incidents; None if there are none."""
    found = [i for i in status["incidents"] if i["kind"] == "restart" and i["detail"].get("tier") == "in_process"]
    if not found:
        return None
    t = Table(title=f"in-process recoveries ({len(found)})", title_justify="left", box=box.SIMPLE_HEAD,
              pad_edge=False)
    for col in ("caught", "id", "node", "recovery"):
        t.add_column(col, no_wrap=col != "recovery")
    for inc in sorted(found, key=lambda i: i["detected_at"])[-last:]:
        line = shown(recovery_line(inc["detail"]), 1024)
        t.add_row(time.strftime("%H:%M:%S", time.localtime(inc["detected_at"])), shown(inc["id"]),
                  shown(inc["node"]), line if inc["detail"].get("ok") else f"[red]{line}[/]")
    return t


def timeline(status: dict[str, Any], started_at: float) -> Table:
    t = Table(title="timeline", title_justify="left")
    for col in ("t+s", "kind", "node", "rank", "step", "detail"):
        t.add_column(col)
    for inc in sorted(status["incidents"], key=lambda i: i["detected_at"]):
        t.add_row(f"{inc['detected_at'] - started_at:.1f}", shown(inc["kind"]), shown(inc["node"]),
                  str(inc["rank"]), str(inc["step"]), shown(brief(inc["detail"]), 1024))
    if not status["incidents"]:
        t.add_row(f"{time.time() - started_at:.1f}", "-", "-", "-", "-", "no incidents")
    return t


def bottleneck_line(status: dict[str, Any]) -> str:
    """What bounds the steps (the job's on the coordinator, else the node's ranks'), in a few words."""
    b = status.get("bottleneck")
    if not b:
        return "bound: not enough steps yet"
    shares = b.get("shares") or {}
    rest = " ".join(f"{shown(k)[:4]} {v:.0%}" for k, v in shares.items() if k != b["kind"])
    gpu = f", GPU {b['gpu_utilization']:.0%} busy" if b.get("gpu_utilization") is not None else ""
    return f"{shown(b.get('scope') or 'node')} {shown(b['kind'])}-bound {b['share']:.0%} ({rest}{gpu})"


def conflicts_line(status: dict[str, Any], shown_most: int = 4) -> str | None:
    """The rank ids a second live node claims (the coordinator's view), or None: none."""
    conflicts = status.get("rank_conflicts") or []
    if not conflicts:
        return None
    each = "; ".join(f"rank {c.get('rank', 0)} is {shown(c['node'], 64)}'s, claimed by {shown(c['claimed_by'], 64)}"
                     for c in conflicts[:shown_most])
    more = f" (and {len(conflicts) - shown_most} more)" if len(conflicts) > shown_most else ""
    return f"rank conflicts, the second claim left out: {each}{more}"


def goodput_line(status: dict[str, Any]) -> str:
    """Goodput and where the rest of the time went, in one line."""
    t = status.get("time_seconds") or {}
    if status.get("goodput") is None or not t:
        return "goodput: no steps yet"
    lost = ", ".join(f"{k} {t[k]:.1f}s" for k in ("hang", "restart", "recompute", "checkpoint") if t.get(k))
    return (f"goodput {status['goodput']:.1%}: {t['productive']:.1f}s productive of "
            f"{t['elapsed']:.1f}s" + (f"; lost to {lost}" if lost else ""))


# Evidence kept for `diagnose`, too long for a timeline row.
_LONG = {"stacks", "stacks_note", "flight_recorder", "path", "started_at", "resolved_at", "nodes", "inflight", "silent_ranks",
         "scope", "decision", "allowance_seconds", "pid", "uuid", "window_steps"}


def brief(detail: dict[str, Any]) -> str:
    """An incident's detail in one line, without the long evidence (stacks, ...)."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {fmt(x)}" for k, x in v.items()) + "}"
        return str(v)
    if detail.get("tier") == "in_process":
        return recovery_line(detail)
    return ", ".join(f"{k}={fmt(v)}" for k, v in detail.items() if k not in _LONG and v is not None)
