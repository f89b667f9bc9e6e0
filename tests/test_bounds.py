"""The bounds on what an agent keeps (agent/wire/bounds.py), without an agent."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rankwatch.agent.wire import bounds, summary as validate_sync, windows as work_windows
from rankwatch.agent.durable.incidents import IncidentLog
from rankwatch.proto import pb


def rank(r, connected, seen):
    return SimpleNamespace(rank=r, connected=connected, last_seen=seen)


def test_a_new_rank_id_takes_the_place_of_the_one_gone_longest():
    ranks = {0: rank(0, True, 5.0), 1: rank(1, False, 9.0), 2: rank(2, False, 3.0)}
    assert bounds.rank_to_evict(ranks, 7, limit=4) is None       # room left
    assert bounds.rank_to_evict(ranks, 1, limit=3) is None       # a known id
    assert bounds.rank_to_evict(ranks, 7, limit=3) == 2          # gone longest
    with pytest.raises(LookupError):
        bounds.rank_to_evict({0: rank(0, True, 1.0)}, 7, limit=1)  # all connected: refused


def test_recent_set_keeps_the_newest_keys():
    s = bounds.RecentSet(3)
    for k in range(10):
        s.add(k)
    assert len(s) == 3 and 9 in s and 7 in s and 6 not in s


def test_an_oversized_detail_is_cut_to_the_bound_keeping_the_innermost_frames():
    stacks = "outer\n" + "x" * (1 << 20) + "\ninnermost frame"
    d = bounds.cap_detail({"stacks": stacks, "error": "e" * 100_000, "step": 3, "alive": True})
    assert len(json.dumps(d)) <= bounds.MAX_INCIDENT_BYTES
    assert d["stacks"].endswith("innermost frame") and d["step"] == 3 and d["alive"] is True
    assert set(d["truncated"]) == {"stacks", "error"}
    small = {"a": 1}
    assert bounds.cap_detail(small) == small


def test_incidents_are_bounded_per_rank_and_per_node_in_memory(tmp_path):
    log = IncidentLog(None)
    for n in range(500):   # one hostile rank
        log.add(kind="checkpoint", node="n0", rank=3, step=n, detected_at=float(n), detail={"n": n})
    kept = [i for i in log.items if i.rank == 3]
    assert len(kept) == bounds.MAX_INCIDENTS_PER_RANK
    assert [i.step for i in kept] == list(range(500 - bounds.MAX_INCIDENTS_PER_RANK, 500))  # the newest
    for r in range(100):   # many ranks
        for n in range(30):
            log.add(kind="checkpoint", node="n0", rank=r + 10, step=n, detected_at=1.0, detail={})
    assert len(log.items) == bounds.MAX_INCIDENTS
    assert log.items[-1].rank == 109 and log.dropped == 500 + 3000 - bounds.MAX_INCIDENTS
    ids = [i.id for i in log.items]
    assert len(set(ids)) == len(ids) and ids[-1] == "checkpoint-3500"   # ids never repeat
    big = "s" * (60 << 10)
    for n in range(300):   # large details: the byte bound
        log.add(kind="hang", node="n0", rank=1000 + n, step=1, detected_at=1.0, detail={"stacks": big})
    assert sum(len(json.dumps(dict(i.detail))) for i in log.items) <= bounds.MAX_INCIDENT_TOTAL_BYTES


def test_the_incidents_file_is_bounded_per_run(tmp_path, monkeypatch):
    monkeypatch.setattr(bounds, "MAX_FILE_RECORDS_PER_RUN", 50)
    path = tmp_path / "incidents.jsonl"
    log = IncidentLog(path, run_id="job1")
    for n in range(80):
        log.add(kind="checkpoint", node="n0", rank=n, step=n, detected_at=1.0, detail={})
    assert len(path.read_text().splitlines()) == 50 and log.file_dropped == 30
    log.run_id = "job2"   # a new run starts its own count
    log.add(kind="checkpoint", node="n0", rank=0, step=1, detected_at=1.0, detail={})
    assert len(path.read_text().splitlines()) == 51


def test_a_summary_is_cut_below_its_bound_least_needed_first():
    s = pb.NodeSummary(node_id="n0", seq=1, sent_at=1.0)
    for r in range(80):
        s.ranks.append(pb.RankSummary(rank=r, connected=r < 40, last_seen=float(r), stacks="s" * (200 << 10),
                                      own_work=[0.1] * 64))
    for n in range(300):
        s.incidents.append(pb.Incident(id=f"checkpoint-{n}", kind="checkpoint", detail_json="{}" + " " * 4000))
    for n in range(200):
        s.decisions.append(pb.Decision(id=f"d-{n}", kind="checkpoint", seq=n + 1))
    assert s.ByteSize() > 16 << 20
    out = bounds.cap_summary(s)
    assert out.ByteSize() <= bounds.MAX_SUMMARY_BYTES
    assert len(out.ranks) == 80            # every rank is still there
    assert out.ranks[0].stacks == "" and out.incidents[-1].id == "checkpoint-299"
    assert out.decisions[-1].id == "d-199"


@pytest.mark.parametrize("packed", [True, False])
def test_a_summary_still_too_big_keeps_each_ranks_last_8_steps(packed):
    """4,096 ranks' 64-step windows are 6 MiB: each rank keeps its last 8 steps, packed
    (as a node agent sends them) or repeated (an older agent's form), and every rank stays."""
    steps = [float(n) for n in range(64)]
    s = pb.NodeSummary(node_id="n0", seq=1, sent_at=1.0)
    for r in range(4096):
        windows = (steps, [0.5] * 64, [0.25] * 64)
        s.ranks.append(pb.RankSummary(rank=r, connected=True, **(
            dict(work=work_windows.pack(*windows)) if packed
            else dict(own_work=windows[0], data_wait=windows[1], comm_wait=windows[2]))))
    assert s.ByteSize() > bounds.MAX_SUMMARY_BYTES
    out = bounds.cap_summary(s)
    assert out.ByteSize() <= bounds.MAX_SUMMARY_BYTES and len(out.ranks) == 4096
    own, data, wait = work_windows.windows(out.ranks[-1])
    assert list(own) == steps[-8:] and list(data) == [0.5] * 8 and list(wait) == [0.25] * 8
    validate_sync.check_summary(out, now=1.0)


def test_a_status_answer_stays_below_the_message_limit_oldest_incidents_out():
    resp = pb.StatusResponse(node_id="n0")
    for n in range(400):
        resp.incidents.append(pb.Incident(id=f"hang-{n}", kind="hang", detail_json="x" * (60 << 10)))
    assert resp.ByteSize() > 16 << 20
    out = bounds.cap_status(resp)
    assert out.ByteSize() <= bounds.MAX_STATUS_BYTES
    assert out.incidents[-1].id == "hang-399" and len(out.incidents) > 150


def test_packed_windows_read_back_as_sent_and_uneven_ones_keep_their_common_newest_steps():
    r = pb.RankSummary(work=work_windows.pack([0.1, 0.2, 0.3], [0.0, 0.01, 0.02], [0.5, 0.6, 0.7]))
    assert [list(w) for w in work_windows.windows(r)] == [[0.1, 0.2, 0.3], [0.0, 0.01, 0.02], [0.5, 0.6, 0.7]]
    r = pb.RankSummary(work=work_windows.pack([0.1, 0.2, 0.3], [0.01, 0.02], [0.6, 0.7]))
    assert [list(w) for w in work_windows.windows(r)] == [[0.2, 0.3], [0.01, 0.02], [0.6, 0.7]]
    assert work_windows.pack([], [0.1], [0.2]) == b""
