"""Typed incidents and their file: resolutions reach ``incidents.jsonl`` and replay."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from rankwatch.address import Address
from rankwatch.agent.job.coordinator import Coordinator, PolicyConfig
from rankwatch.agent.durable.incidents import Incident, IncidentLog
from rankwatch.agent.server import Agent, AgentConfig
from rankwatch.proto import pb
from test_coordinator import Clock, summary


def test_a_resolution_is_appended_to_the_file_and_replayed(tmp_path):
    path = tmp_path / "incidents.jsonl"
    log = IncidentLog(path, run_id="job-7")
    hang = log.add(kind="hang", node="n1", rank=3, step=50, detected_at=100.0,
                   detail={"collective": None, "alive": True, "stacks": None})
    log.add(kind="checkpoint", node="n1", rank=0, step=40, detected_at=101.0, detail={"ok": True})
    assert log.resolve(hang.id, 130.0) is not None
    assert log.resolve(hang.id, 140.0) is None, "the first resolution stands"

    lines = path.read_text().splitlines()
    assert len(lines) == 3, "two incidents and one update, appended; nothing rewritten"
    assert json.loads(lines[0])["detail"] == {"collective": None, "alive": True, "stacks": None}
    assert json.loads(lines[2]) == {"update": hang.id, "detail": {"resolved_at": 130.0}, "run_id": "job-7"}

    replayed = IncidentLog.replay(path)
    assert replayed == log.items
    assert [i.resolved_at for i in replayed] == [130.0, None]
    assert {i.run_id for i in replayed} == {"job-7"}


def test_replay_starts_a_new_incident_when_an_id_is_recorded_again(tmp_path):
    """An agent restarted on the same state directory counts ids from 1 again."""
    path = tmp_path / "incidents.jsonl"
    first = IncidentLog(path)
    first.resolve(first.add(kind="hang", node="n0", rank=0, step=5, detected_at=1.0, detail={}).id, 2.0)
    with open(path, "a") as f:
        f.write('{"id": "hang-2", "kind": "ha')  # a write cut short by a crash
        f.write("\n")
    second = IncidentLog(path)
    second.add(kind="hang", node="n0", rank=1, step=9, detected_at=3.0, detail={})
    replayed = IncidentLog.replay(path)
    assert [(i.id, i.rank, i.resolved_at) for i in replayed] == [("hang-1", 0, 2.0), ("hang-1", 1, None)]


def test_incidents_are_read_only_and_have_one_proto_form():
    inc = Incident(id="hang-1", kind="hang", node="n0", rank=1, step=2, detected_at=3.5,
                   detail={"alive": False}, run_id="r")
    with pytest.raises(TypeError):
        inc.detail["resolved_at"] = 4.0  # type: ignore[index]
    back = Incident.from_pb(pb.Incident.FromString(inc.to_pb().SerializeToString()))
    assert back == inc
    assert inc.as_status() == {"id": "hang-1", "kind": "hang", "node": "n0", "rank": 1, "step": 2,
                               "detected_at": 3.5, "detail": {"alive": False}}
    with pytest.raises(ValueError):
        Incident.from_pb(pb.Incident(id="x", detail_json="[1]"))


def test_the_coordinators_restart_recoveries_replay_from_its_file(tmp_path):
    """A restart superseded before it recovered, and the next one's recovery, both reach the file."""
    path = tmp_path / "incidents.jsonl"
    clock = Clock()
    c = Coordinator("n0", incidents=IncidentLog(path), policy=PolicyConfig(min_nodes=1), clock=clock)
    t = clock.t
    for n in ("n0", "n1", "n2"):
        s = summary(n, 1, t, [dict(rank=int(n[1]), step=5, pid=10 + int(n[1]), progress_at=t, last_seen=t)])
        s.run_id = "job-9"
        c.sync(s)
    c.exclude("n1", "first")
    clock.t += 3
    c.exclude("n2", "second")  # before the first restart recovered
    clock.t += 5
    c.sync(summary("n0", 2, clock.t, [dict(rank=0, step=6, pid=20, progress_at=clock.t, last_seen=clock.t)]))
    c.evaluate()

    first, second = [i for i in IncidentLog.replay(path) if i.kind == "restart"]
    assert first.detail["superseded_by"] == second.detail["decision"]
    assert first.detail["recovered_after_seconds"] == pytest.approx(3, abs=0.01)
    assert second.detail["recovered_after_seconds"] == pytest.approx(5, abs=0.01)
    assert first.run_id == second.run_id == "job-9"
    assert IncidentLog.replay(path) == c.incidents.items


def test_a_node_agent_records_the_coordinators_resolution_in_its_own_file(tmp_path):
    agent = Agent(AgentConfig(node_id="n0", listen=[Address(path=str(tmp_path / "a.sock"))],
                              metrics_port=None, state_dir=tmp_path))
    try:
        flagged = pb.Incident(id="straggler-1", kind="straggler", node="n0", rank=1, step=50,
                              detected_at=100.0, run_id="job-3",
                              detail_json=json.dumps({"cause": "compute", "slowdown": 1.4, "ranks": [1]}))
        agent.on_job_incident("n9", flagged)
        agent.on_job_incident("n9", flagged)  # synced again: nothing new
        resolved = pb.Incident()
        resolved.CopyFrom(flagged)
        resolved.detail_json = json.dumps({"cause": "compute", "slowdown": 1.4, "ranks": [1],
                                           "resolved_at": 120.0})
        agent.on_job_incident("n9", resolved)
        agent.on_job_incident("n9", resolved)
        (kept,) = IncidentLog.replay(tmp_path / "incidents.jsonl")
        assert (kept.id, kept.run_id, kept.resolved_at) == ("n9/straggler-1", "job-3", 120.0)
        assert len((tmp_path / "incidents.jsonl").read_text().splitlines()) == 2
    finally:
        agent.stop(timedelta(0))


def test_diagnose_replays_the_state_directory_after_the_agent_is_gone(tmp_path, capsys):
    from rankwatch.agent.cli.app import main

    log = IncidentLog(tmp_path / "incidents.jsonl", run_id="job-2")
    hang = log.add(kind="hang", node="n0", rank=1, step=7, detected_at=50.0, detail={"alive": True})
    log.add(kind="checkpoint", node="n0", rank=0, step=5, detected_at=60.0, detail={"ok": True})
    log.resolve(hang.id, 58.0)
    assert main(["diagnose", "--json", "--state-dir", str(tmp_path), hang.id]) == 0
    out = capsys.readouterr()
    assert out.err.startswith(f"rankwatch diagnose: reading what the agent left in {tmp_path}")
    shown = json.loads(out.out)
    assert shown == {**hang.as_status(), "detail": {"alive": True, "resolved_at": 58.0}, "run_id": "job-2"}
    assert main(["diagnose", "--state-dir", str(tmp_path / "none")]) == 1
