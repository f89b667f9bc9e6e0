"""A human view of GPU events: the demo's GPU timeline."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from rankwatch.agent.gpu.monitor import GpuEvent

__all__ = ["gpu_timeline"]


def gpu_timeline(events: Sequence[GpuEvent], started_at: float) -> Table:
    t = Table(title="GPU health", title_justify="left")
    for col in ("t+s", "kind", "gpu", "reason", "action", "ranks", "detail"):
        t.add_column(col)
    for ev in sorted(events, key=lambda e: e.at):
        reason = f"xid {ev.xid}" if ev.xid is not None else ev.reason.replace("_", " ")
        kind = f"[red]{ev.kind}[/]" if ev.kind == "fatal" else f"[yellow]{ev.kind}[/]"
        t.add_row(f"{ev.at - started_at:.1f}", kind, str(ev.gpu), reason, ev.action,
                  ",".join(map(str, ev.ranks)) or "-",
                  ", ".join(f"{k}={v}" for k, v in ev.detail.items()))
    return t
