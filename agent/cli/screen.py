"""The demo's screen: one full-screen layout while it runs, and the comparison at its end.

Pure functions of the coordinator's status (and the demo's own notes), so the
screen can be rendered and checked without a job:

* :func:`screen`: a header (time, goodput so far, tokens/s), the ranks, the nodes,
  a running feed of incidents and decisions, and a one-line story of what happens next;
* :func:`next_line`: that story, from where the demo's faults have got to;
* :func:`progress_line`: the plain line printed every few seconds instead (``--no-live``);
* :func:`versus_torchrun`: one line comparing the run with plain torchrun under the
  same faults, from measured figures whose source it names.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Group
from rich.layout import Layout
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from rankwatch.agent.cli.status_tables import shown

from rankwatch.agent.views.story import recovery_line
from rankwatch.agent.cli.status_tables import brief

__all__ = ["DemoNotes", "GLOO_TIMEOUT_SECONDS", "HANG_ALLOWANCE_SECONDS", "HANG_STEP", "feed", "next_line",
           "progress_line", "screen", "versus_torchrun"]

GLOO_TIMEOUT_SECONDS = 1800.0
"""torch.distributed's default process-group timeout for gloo (30 minutes): what ends a hung
job under plain torchrun, which never notices a rank that is alive but stuck (BENCHMARKS.md,
"The demo")."""

HANG_STEP = 120
"""The step at which the demo's node 2 gets stuck in forward: late enough that node 1's
straggle (from step 20, scored from step 30) and both its GPU risks come before it."""

HANG_ALLOWANCE_SECONDS = 2.0
"""The demo's hang allowance: its steps take about 45 ms, so 2 s (some 40 steps), not an
agent's default floor of 5 s that suits long steps."""


@dataclass
class DemoNotes:
    """What the demo itself did, for the feed and the story."""

    nodes: tuple[str, ...]
    spare: str
    hung: str
    xid: str
    steps: int
    started: float = field(default_factory=time.time)
    events: list[tuple[float, str]] = field(default_factory=list)
    spare_started: bool = False
    xid_fired: bool = False

    def note(self, text: str, at: float | None = None) -> None:
        self.events.append((time.time() if at is None else at, text))


def feed(status: dict[str, Any], notes: DemoNotes, limit: int = 14) -> list[tuple[float, str, str]]:
    """The newest ``limit`` incidents, decisions and demo notes: ``(t, style, text)``, oldest first."""
    rows: list[tuple[float, str, str]] = []
    for i in status["incidents"]:
        style = {"hang": "bold red", "gpu_fault": "red", "straggler": "yellow", "rank_exit": "red",
                 "restart": "cyan", "checkpoint": "green"}.get(i["kind"], "")
        where = f"{i['node']} rank {i['rank']}" if i["kind"] != "restart" else i["node"]
        rows.append((i["detected_at"], style, f"{i['kind']:<10} {where} step {i['step']}: {_says(i)}"))
    for d in status.get("decisions", []):
        what = f"exclude {d['node']}" if d["kind"] == "exclude" else f"{d['kind']} at step {d['step']}"
        rows.append((d["decided_at"], "bold magenta", f"DECISION   {what}: {d['reason']}"))
    rows += [(at, "dim", f"demo       {text}") for at, text in notes.events]
    rows.sort(key=lambda r: r[0])
    return rows[-limit:]


def _says(incident: dict[str, Any]) -> str:
    """An incident in a few words for the feed (``diagnose`` has the rest)."""
    d, kind = incident["detail"], incident["kind"]
    if kind == "straggler":
        return f"{d.get('cause')}, own work x{d.get('slowdown', 0):.2f}"
    if kind == "hang":
        c = d.get("collective") or {}
        where = f"others wait in {c['op']} seq {c['seq']}" if c else "no collective"
        return f"{where}; {'stopped' if d.get('stopped') else 'alive' if d.get('alive') else 'gone'}"
    if kind == "restart" and d.get("tier") == "in_process":
        return recovery_line(d)
    if kind == "restart":
        back = d.get("recovered_after_seconds")
        return f"without {d.get('excluded')}" + (f", training again after {back:.1f}s" if back else "")
    if kind == "checkpoint":
        return f"saved ({d.get('reason', '')})" if d.get("ok") else f"failed: {d.get('error', '')}"
    if kind == "gpu_fault":
        return f"gpu {d.get('gpu')} xid {d.get('xid')}: {d.get('action')}"
    if kind == "rank_exit":
        if d.get("how") == "node_lost":
            return f"lost with its node ({d.get('why', '')})"
        return f"process gone ({d.get('stream', '')})"
    return brief(d)


def next_line(status: dict[str, Any], notes: DemoNotes) -> str:
    """What the demo's faults do next, given how far they have got."""
    kinds = {i["kind"] for i in status["incidents"]}
    excluded = set(status.get("excluded_nodes", []))
    steps = [r["step"] for r in status["ranks"] if r.get("connected")]
    top = max(steps, default=0)
    if not steps and not status["incidents"]:
        return "the nodes start: torchrun on each, the rendezvous, FSDP2 wraps the model"
    if notes.xid in excluded:
        if not steps:
            return f"{notes.xid} is out: the nodes left regroup without it in process, then finish the job"
        return (f"the nodes left finish the job at step {notes.steps}: the final view, the "
                "timeline and the goodput breakdown follow")
    if notes.xid_fired:
        return (f"{notes.xid}'s GPU raised XID 79 (fatal: reset the GPU): the coordinator "
                f"excludes {notes.xid}, kills its worker, and the others regroup without it in process")
    if notes.hung in excluded:
        if not notes.spare_started:
            return (f"{notes.hung} is out: the others regrouped without it in their own processes "
                    "(in-process recovery), in well under a second")
        return (f"{notes.hung} is out: the spare {notes.spare}, standing by, took its place as the others "
                "regrouped in process (its state from a live replica, no restart); then "
                f"{notes.xid}'s GPU raises XID 79")
    if "hang" in kinds:
        return (f"the coordinator named the hung rank (stacks, collective, alive): it excludes "
                f"{notes.hung} and kills its worker; the others regroup without it in process")
    if top < 20:
        return f"training; from step 20 {notes.xid} computes 50% slower (a straggler)"
    if "straggler" not in kinds:
        return f"{notes.xid} computes 50% slower: its own work rises over the others', a flag follows"
    return (f"at step {HANG_STEP} {notes.hung} gets stuck in forward: no progress for "
            f"{HANG_ALLOWANCE_SECONDS:.0f} s is a hang, "
            f"named with its stacks (plain torchrun would wait {GLOO_TIMEOUT_SECONDS / 60:.0f} min)")


def _ranks(status: dict[str, Any]) -> Table:
    """The rank table cut to what fits beside the feed."""
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=True)
    for col in ("rank", "node", "step", "step ms", "own ms", "wait ms", "slow", "state"):
        t.add_column(col, justify="left" if col in ("node", "state") else "right", no_wrap=True)
    for r in sorted(status["ranks"], key=lambda r: (r["node"], r["rank"])):
        state = "restarting" if r.get("restarting") else r["state"]
        state = shown(state if r.get("connected") else f"{state}, gone")
        color = "green" if state == "ok" else "yellow" if state in ("straggler", "restarting") else "red"
        t.add_row(str(r["rank"]), shown(r["node"]), str(r["step"]), f"{r['step_seconds'] * 1e3:.0f}",
                  f"{r.get('own_work_seconds', 0) * 1e3:.0f}", f"{r.get('collective_wait_seconds', 0) * 1e3:.0f}",
                  f"{r.get('slowdown', 1.0):.2f}", f"[{color}]{state}[/]")
    return t


def _nodes(status: dict[str, Any], notes: DemoNotes) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=True)
    for col in ("node", "state", "ranks", "step"):
        t.add_column(col, justify="right" if col in ("ranks", "step") else "left", no_wrap=True)
    excluded = set(status.get("excluded_nodes", []))
    for node in notes.nodes:
        ranks = [r for r in status["ranks"] if r["node"] == node]
        live = [r for r in ranks if r.get("connected")]
        if node in excluded:
            state = "[red]excluded[/]"
        elif live:
            state = "[green]training[/]" if any(r["step"] > 0 for r in live) else "[cyan]joining[/]"
        elif ranks:
            state = "[yellow]restarting[/]"
        elif node == notes.spare:
            state = "[cyan]hot spare, standing by[/]" if notes.spare_started else "[dim]not started[/]"
        else:
            state = "[dim]starting[/]"
        t.add_row(node, state, str(len(live)), str(max((r["step"] for r in live), default="-")))
    return t


def _header(status: dict[str, Any], notes: DemoNotes, now: float) -> Text:
    t = status.get("time_seconds") or {}
    good = (f"goodput {status['goodput']:.1%} ({t.get('productive', 0):.1f}s productive of "
            f"{t.get('elapsed', 0):.1f}s)") if status.get("goodput") is not None else "goodput: no steps yet"
    lost = ", ".join(f"{k} {t[k]:.1f}s" for k in ("hang", "restart", "recompute", "checkpoint") if t.get(k))
    text = Text.assemble(("rankwatch demo", "bold"), f"  t+{now - notes.started:.0f}s  ", (good, "bold green"),
                         f"  lost: {lost or 'nothing yet'}  tokens/s {status.get('tokens_per_second', 0):.0f}")
    return text


def screen(status: dict[str, Any] | None, notes: DemoNotes, now: float | None = None) -> Layout:
    """The full-screen layout for one refresh (``status`` None: no answer from the coordinator yet)."""
    now = time.time() if now is None else now
    status = status or {"ranks": [], "incidents": [], "decisions": [], "excluded_nodes": [],
                        "goodput": None, "time_seconds": {}, "tokens_per_second": 0.0, "node": notes.nodes[0]}
    root = Layout(name="root")
    root.split_column(Layout(name="header", size=3), Layout(name="body", ratio=1),
                      Layout(name="story", size=4))
    root["body"].split_row(Layout(name="left", ratio=3), Layout(name="feed", ratio=2))
    root["left"].split_column(Layout(name="ranks", ratio=3), Layout(name="nodes", ratio=2))
    root["header"].update(Panel(_header(status, notes, now), box=box.ROUNDED))
    ranks = _ranks(status) if status["ranks"] else Text("waiting for ranks")
    root["ranks"].update(Panel(ranks, title="ranks (the coordinator's view)", title_align="left"))
    root["nodes"].update(Panel(_nodes(status, notes), title="nodes", title_align="left"))
    lines = [Text.assemble((f"t+{t - notes.started:5.1f}s ", "dim"), (text, style))
             for t, style, text in feed(status, notes)]
    root["feed"].update(Panel(Group(*lines) if lines else Text("no incidents yet", style="dim"),
                              title="incidents and decisions", title_align="left"))
    root["story"].update(Panel(Text(next_line(status, notes)), title="what happens next",
                               title_align="left", box=box.ROUNDED))
    return root


def progress_line(status: dict[str, Any]) -> str:
    """The job's progress on one plain line (``--no-live``): ranks, steps, tokens/s, incidents.

    The job's ranks are those of the nodes still in it, connected or not: a rank that finished
    (or is between workers) keeps its last step in the coordinator's view, and the demo's last
    lines come while torchrun shuts down after its ranks are done.
    """
    excluded = set(status.get("excluded_nodes", []))
    ranks = [r for r in status["ranks"] if r["node"] not in excluded and r.get("state") != "excluded"]
    steps = [r["step"] for r in ranks]
    gone = sum(1 for r in ranks if not r.get("connected"))
    return (f"ranks {len(ranks)}" + (f" steps {min(steps)}..{max(steps)}" if steps else "")
            + (f" ({gone} gone)" if gone else "")
            + f" tokens/s {status['tokens_per_second']:.0f} incidents {len(status['incidents'])}")


def versus_torchrun(status: dict[str, Any], started: float, productive_at_hang: float | None,
                    finished: bool = True) -> str | None:
    """One line: this run's goodput against plain torchrun under the same faults.

    Plain torchrun never notices the hung rank (alive, stuck in Python): the job sits until
    gloo's 30-minute timeout ends it (BENCHMARKS.md), having trained what this run had trained
    when the hang was called (``productive_at_hang``, read from the live view then).  None if
    the run had no hang.
    """
    hangs = [i for i in status["incidents"] if i["kind"] == "hang"]
    t = status.get("time_seconds") or {}
    if not hangs or status.get("goodput") is None or productive_at_hang is None:
        return None
    first = min(hangs, key=lambda i: i["detected_at"])
    stuck_for = (first["detail"].get("started_at") or first["detected_at"]) - started
    plain_elapsed = stuck_for + GLOO_TIMEOUT_SECONDS
    return (f"vs plain torchrun, same faults: stuck at step {first['step']} until gloo's "
            f"{GLOO_TIMEOUT_SECONDS / 60:.0f}-minute timeout ends the job unfinished (BENCHMARKS.md, "
            f"'The demo'): goodput {productive_at_hang / plain_elapsed:.1%} "
            f"({productive_at_hang:.1f}s trained of {plain_elapsed:.0f}s), against "
            f"{status['goodput']:.1%} with rankwatch ({t.get('productive', 0):.1f}s of "
            f"{t.get('elapsed', 0):.0f}s{', the job finished' if finished else ''})")
