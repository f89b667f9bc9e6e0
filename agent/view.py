"""Human views of a status: the per-rank table and the incident timeline."""

from __future__ import annotations

import time
from typing import Any

from rich import box
from rich.table import Table

__all__ = ["rank_table", "timeline"]


def rank_table(status: dict[str, Any], title: str | None = None) -> Table:
    t = Table(title=title or f"rankwatch — node {status['node']}", title_justify="left",
              box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("rank", "node", "pid", "mesh", "step", "step ms", "data", "fwd", "bwd", "opt",
                "colls", "drop", "slow", "state"):
        t.add_column(col, justify="right" if col not in ("node", "mesh", "state") else "left",
                     no_wrap=True)
    for r in status["ranks"]:
        ph = r["phase_seconds"]
        state = r["state"] if r["connected"] else f"{r['state']}, gone"
        t.add_row(str(r["rank"]), r["node"], str(r["pid"]),
                  " ".join(f"{k}{v}" for k, v in sorted(r["mesh"].items())), str(r["step"]),
                  f"{r['step_seconds'] * 1e3:.1f}", *(f"{ph.get(p, 0.0) * 1e3:.1f}" for p in
                                                     ("data", "forward", "backward", "optimizer")),
                  str(r["collectives"]), str(r["dropped"]), f"{r.get('slowdown', 1.0):.2f}",
                  f"[green]{state}[/]" if state.startswith("ok") else f"[red]{state}[/]")
    caption = f"tokens/s {status['tokens_per_second']:.0f}"
    if status.get("mfu") is not None:
        caption += f"  MFU {status['mfu']:.1%}"
    if status.get("goodput") is not None:
        caption += f"  goodput {status['goodput']:.1%}"
    t.caption = caption + f"  incidents {len(status['incidents'])}"
    return t


def timeline(status: dict[str, Any], started_at: float) -> Table:
    t = Table(title="timeline", title_justify="left")
    for col in ("t+s", "kind", "node", "rank", "step", "detail"):
        t.add_column(col)
    for inc in sorted(status["incidents"], key=lambda i: i["detected_at"]):
        t.add_row(f"{inc['detected_at'] - started_at:.1f}", inc["kind"], inc["node"],
                  str(inc["rank"]), str(inc["step"]),
                  ", ".join(f"{k}={v}" for k, v in inc["detail"].items() if k != "stacks"))
    if not status["incidents"]:
        t.add_row(f"{time.time() - started_at:.1f}", "-", "-", "-", "-", "no incidents")
    return t
