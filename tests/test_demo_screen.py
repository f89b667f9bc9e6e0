"""The demo's live screen and its end line, rendered from a status (no job needed)."""

from __future__ import annotations

from rich.console import Console

from rankwatch.agent.cli.screen import DemoNotes, next_line, progress_line, screen, versus_torchrun

T0 = 1_800_000_000.0
NODES = ("demo-n0", "demo-n1", "demo-n2", "demo-n3")


def notes(**kw) -> DemoNotes:
    return DemoNotes(nodes=NODES, spare="demo-n3", hung="demo-n2", xid="demo-n1", steps=160, started=T0, **kw)


def rank(r: int, node: str, step: int, connected: bool = True) -> dict:
    return {"rank": r, "node": node, "pid": 100 + r, "step": step, "step_seconds": 0.1, "state": "ok",
            "phase_seconds": {"forward": 0.03}, "mesh": {"dp": r}, "collectives": 10, "dropped": 0,
            "slowdown": 1.0, "connected": connected, "op_latency": {}}


HANG = {"id": "hang-1", "kind": "hang", "node": "demo-n2", "rank": 2, "step": 70, "detected_at": T0 + 40,
        "detail": {"collective": {"op": "all_gather", "group": "0", "seq": 700}, "alive": True,
                   "started_at": T0 + 35, "stacks": "Thread MainThread (1):\n  File 'x'\n"}}
STATUS = {"node": "demo-n0", "ranks": [rank(0, "demo-n0", 72), rank(1, "demo-n1", 72), rank(2, "demo-n2", 70)],
          "incidents": [HANG], "decisions": [{"id": "exclude-1", "kind": "exclude", "node": "demo-n2",
                                             "generation": 1, "step": 0, "reason": "hang: rank 2",
                                             "decided_at": T0 + 41}],
          "excluded_nodes": ["demo-n2"], "goodput": 0.5, "tokens_per_second": 900.0,
          "time_seconds": {"productive": 30.0, "elapsed": 60.0, "hang": 6.0, "restart": 24.0},
          "incidents_total": 1}


def render(status, n) -> str:
    console = Console(width=160, height=40, record=True, color_system=None)
    console.print(screen(status, n, now=T0 + 60))
    return console.export_text()


def test_the_screen_has_every_part():
    n = notes(spare_started=True)
    n.note("hot spare demo-n3 started: the job is full, so it stands by", at=T0 + 20)
    text = render(STATUS, n)
    print(text)
    assert "t+60s" in text and "goodput 50.0% (30.0s productive of 60.0s)" in text
    assert "lost: hang 6.0s, restart 24.0s" in text
    assert "ranks (the coordinator's view)" in text and "incidents and decisions" in text
    assert "t+ 20.0s demo       hot spare demo-n3 started" in text
    assert "hang       demo-n2 rank 2 step 70" in text and "DECISION   exclude demo-n2: hang: rank 2" in text
    assert "stacks" not in text.split("incidents and decisions")[1]  # evidence stays in diagnose
    assert "what happens next" in text and "demo-n2 is out" in text
    nodes = text[text.index("nodes"):]
    assert "excluded" in nodes and "hot spare, standing by" in nodes
    # The spare, once it had a rank, restarts with the others: never a waiting spare again.
    later = {**STATUS, "ranks": STATUS["ranks"] + [rank(3, "demo-n3", 71, connected=False)]}
    assert "hot spare" not in render(later, n).split("nodes")[-1]


def test_the_story_follows_the_faults():
    bare = {"ranks": [], "incidents": [], "excluded_nodes": []}
    assert "start" in next_line(bare, notes())
    early = {**bare, "ranks": [rank(0, "demo-n0", 5)]}
    assert "from step 20 demo-n1 computes 50% slower" in next_line(early, notes())
    assert "XID 79" in next_line({**STATUS}, notes(spare_started=True))
    assert "excludes demo-n1" in next_line(STATUS, notes(spare_started=True, xid_fired=True))
    done = {**STATUS, "excluded_nodes": ["demo-n2", "demo-n1"]}
    assert "finish the job at step 160" in next_line(done, notes(xid_fired=True))
    between = {**done, "ranks": [rank(0, "demo-n0", 55, connected=False)]}
    assert "regroup without it in process" in next_line(between, notes(xid_fired=True))


def test_the_comparison_with_plain_torchrun():
    line = versus_torchrun(STATUS, T0, productive_at_hang=25.0)
    # Stuck from t+35 s, then gloo's 1800 s: 25 s trained of 1835 s.
    assert line == ("vs plain torchrun, same faults: stuck at step 70 until gloo's 30-minute timeout ends "
                    "the job unfinished (BENCHMARKS.md, 'The demo'): goodput 1.4% "
                    "(25.0s trained of 1835s), against 50.0% with rankwatch (30.0s of 60s, the job finished)")
    assert versus_torchrun({**STATUS, "incidents": []}, T0, 25.0) is None


def test_the_progress_line_shows_the_jobs_ranks_when_they_are_done():
    # The demo's last plain lines come while torchrun shuts down: the job's ranks finished and
    # their streams closed, but the coordinator still holds their last steps.
    out = {"state": "excluded"}
    done = {**STATUS, "excluded_nodes": ["demo-n2", "demo-n1"], "tokens_per_second": 0.0,
            "ranks": [rank(0, "demo-n0", 160, connected=False), {**rank(1, "demo-n1", 141, connected=False), **out},
                      {**rank(2, "demo-n2", 120, connected=False), **out}, rank(3, "demo-n3", 160, connected=False)]}
    assert progress_line(done) == "ranks 2 steps 160..160 (2 gone) tokens/s 0 incidents 1"
    # While it trains: the ranks of the nodes in the job, not those of an excluded one.
    assert progress_line(STATUS) == "ranks 2 steps 72..72 tokens/s 900 incidents 1"
    between = {**STATUS, "ranks": [rank(0, "demo-n0", 75), rank(1, "demo-n1", 74, connected=False)]}
    assert progress_line(between) == "ranks 2 steps 74..75 (1 gone) tokens/s 900 incidents 1"
    bare = {"ranks": [], "incidents": [], "excluded_nodes": [], "tokens_per_second": 0.0}
    assert progress_line(bare) == "ranks 0 tokens/s 0 incidents 0"


def test_a_rank_lost_with_its_node_says_so_in_the_feed():
    from rankwatch.agent.cli.screen import feed

    lost = {"id": "rank_exit-n0-3", "kind": "rank_exit", "node": "n2", "rank": 2, "step": 26, "detected_at": 5.0,
            "detail": {"how": "node_lost", "why": "its agent went silent"}}
    gone = {**lost, "id": "rank_exit-n0-2", "node": "n0", "rank": 0, "detail": {"how": "signal", "stream": "closed"}}
    rows = [text for _, _, text in feed({"incidents": [lost, gone]}, notes())]
    assert rows == ["rank_exit  n2 rank 2 step 26: lost with its node (its agent went silent)",
                    "rank_exit  n0 rank 0 step 26: process gone (closed)"]
