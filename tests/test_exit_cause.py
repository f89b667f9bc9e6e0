"""How a worker ended (agent/node/exit_cause.py) and which exit is the job's root cause
(agent/detect/root_cause.py): pure decisions, over real evidence where it can be made here
(a real faulthandler dump, real files); plus the checks on what reaches the agent about it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rankwatch.agent.detect.root_cause import ExitView, exit_view, is_consequence, root_causes
from rankwatch.agent.node.exit_cause import HOWS, classify, error_file_exception, parse_fault_text
from rankwatch.agent.node.exit_evidence import (ExitEvidence, check_exit_record, check_worker_exits, oom_kills,
                                               read_fault_file)
from rankwatch.agent.wire.ranges import Rejected
from rankwatch.hooks.instrument.exit_capture import exit_record
from rankwatch.proto import pb

RECORD = {"type": "RuntimeError", "message": "boom", "frames": [{"file": "t.py", "line": 3, "function": "f"}],
          "step": 20, "at": 100.0, "thread": "MainThread", "main_thread": True}


def _segv_dump(tmp_path) -> str:
    """A real faulthandler dump of a SIGSEGV, as a rank's exit capture leaves it."""
    out = tmp_path / "dump.txt"
    code = ("import faulthandler, os, signal\nf = open(%r, 'w')\nfaulthandler.enable(file=f, all_threads=True)\n"
            "def crash_here():\n    os.kill(os.getpid(), signal.SIGSEGV)\ncrash_here()\n") % str(out)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)
    assert proc.returncode == -11
    return out.read_text()


def test_a_faulthandler_dump_names_the_signal_and_the_crashing_frames(tmp_path):
    fault = parse_fault_text(_segv_dump(tmp_path))
    assert fault["signal"] == "SIGSEGV" and fault["error"] == "Segmentation fault"
    assert fault["frames"][-1]["function"] == "crash_here", "innermost last"
    assert parse_fault_text("no dump here") is None


def test_classification_order():
    sigkill = {"exitcode": -9, "signal": "SIGKILL", "error_file": "", "failed": True}
    both = classify(record=RECORD, fault=None, torchrun={**sigkill, "exitcode": 1, "signal": ""}, oom=False)
    assert (both["how"], both["exit_code"], both["evidence"]) == ("exception", 1, ["exit_record", "torchrun"])
    exc = classify(record=RECORD, fault=None, torchrun=None, oom=False)
    assert (exc["how"], exc["type"], exc["message"], exc["frames"][0]["function"]) == ("exception", "RuntimeError",
                                                                                      "boom", "f")
    assert classify(record=None, fault=None, torchrun=sigkill, oom=True)["how"] == "oom"
    assert classify(record=None, fault=None, torchrun=None, oom=True)["how"] == "oom"
    killed = classify(record=None, fault=None, torchrun=sigkill, oom=False)
    assert (killed["how"], killed["signal"], killed["exit_code"]) == ("signal", "SIGKILL", -9)
    segv = classify(record=None, fault={"signal": "SIGSEGV", "error": "Segmentation fault", "frames": []},
                    torchrun={**sigkill, "exitcode": -11, "signal": "SIGSEGV"}, oom=True)
    assert (segv["how"], segv["signal"]) == ("signal", "SIGSEGV"), "a fault file outranks the OOM counter"
    code = classify(record=None, fault=None, torchrun={**sigkill, "exitcode": 3, "signal": ""}, oom=False)
    assert (code["how"], code["exit_code"]) == ("exit_code", 3)
    stopped = classify(record=None, fault=None, torchrun={"exitcode": 0, "failed": False}, oom=False)
    assert (stopped["how"], stopped["signal"], stopped["stopped_by"]) == ("signal", "SIGTERM", "torchrun")
    nothing = classify(record=None, fault=None, torchrun=None, oom=False)
    assert (nothing["how"], nothing["exit_code"], nothing["evidence"]) == ("exit_code", None, [])
    thread = {**RECORD, "main_thread": False, "thread": "loader"}
    assert classify(record=thread, fault=None, torchrun=sigkill, oom=False)["thread_exception"]["thread"] == "loader"
    for d in (exc, killed, segv, code, stopped, nothing):
        assert d["how"] in HOWS and d["reason"]


def test_torchruns_error_file_gives_an_uninstrumented_workers_exception():
    data = {"message": {"message": "ValueError: bad batch", "extraInfo": {
        "py_callstack": 'Traceback (most recent call last):\n  File "/x/train.py", line 9, in main\n    f()\n'
                        'ValueError: bad batch\n', "timestamp": "1"}}}
    d = classify(record=None, fault=None, torchrun={"exitcode": 1, "signal": "", "failed": True,
                                                    "error_file": json.dumps(data)}, oom=False)
    assert (d["how"], d["type"], d["message"], d["frames"][-1]["line"]) == ("exception", "ValueError", "bad batch", 9)
    assert error_file_exception({"message": "<NONE>"}) is None, "torchrun's stand-in for no file"


def _view(i, at, **detail):
    return ExitView(id=i, ended_at=at, consequence=is_consequence(detail))


def test_the_root_cause_is_the_first_failure_that_is_not_a_consequence():
    peer = {"how": "exception", "type": "RuntimeError", "message": "[pair.cc:553] Connection closed by peer [x]:1"}
    cause = {"how": "exception", "type": "RuntimeError", "message": "CUDA error: an illegal memory access"}
    # The survivor's error is stamped a hair before the dead rank's stream end: still a consequence.
    exits = [_view("a", 10.00, **peer), _view("b", 10.01, **cause), _view("c", 10.5, how="signal", signal="SIGTERM",
                                                                           stopped_by="torchrun")]
    assert root_causes(exits) == {"a": "b", "b": "b", "c": "b"}
    assert root_causes([_view("a", 1.0, **peer), _view("b", 2.0, **peer)]) == {"a": "a", "b": "a"}, \
        "consequences only (the root's node died with its agent): the earliest"
    later = root_causes([_view("a", 1.0, **cause), _view("b", 1000.0, how="signal", signal="SIGKILL")])
    assert later == {"a": "a", "b": "b"}, "an exit long after is a new failure"
    assert root_causes([]) == {}
    assert exit_view("x", 50.0, {"started_at": 49.0}).ended_at == 49.0
    assert exit_view("x", 50.0, {"started_at": "soon"}).ended_at == 50.0


def test_an_exit_record_is_capped_and_checked():
    try:
        raise RuntimeError("x" * 5000)
    except RuntimeError as exc:
        rec = exit_record(type(exc), exc, exc.__traceback__, 7, None, True)
    assert len(rec.message) == 2000 and rec.type == "RuntimeError" and rec.frames[-1].function.startswith("test_")
    kept = check_exit_record(rec)
    assert kept["step"] == 7 and kept["main_thread"] is True
    with pytest.raises(Rejected):
        check_exit_record(pb.ExitRecord(at=float("nan")))
    ok = pb.WorkerExits(exits=[pb.WorkerExit(pid=10, rank=1, exitcode=-9, signal="SIGKILL", at=5.0, failed=True)])
    assert check_worker_exits(ok)[0]["signal"] == "SIGKILL"
    for bad in (pb.WorkerExit(pid=0), pb.WorkerExit(pid=1, exitcode=999), pb.WorkerExit(pid=1, at=float("inf"))):
        with pytest.raises(Rejected):
            check_worker_exits(pb.WorkerExits(exits=[bad]))
    with pytest.raises(Rejected):
        check_worker_exits(pb.WorkerExits(exits=[pb.WorkerExit(pid=1)] * 300))


def test_a_fault_file_is_read_only_where_a_ranks_capture_made_it(tmp_path):
    where = tmp_path / "faults"
    where.mkdir(mode=0o700)
    good = where / "fault-4242-0a1b2c3d.txt"
    good.write_text("Fatal Python error: Aborted\n")
    other = where / "fault-4343-0a1b2c3d.txt"
    other.write_text("x")
    assert read_fault_file(str(other), 4242) is None, "another pid's"
    assert read_fault_file(str(where / "notes.txt"), 4242) is None
    link = where / "fault-4242-ffffffff.txt"
    link.symlink_to(other)
    assert read_fault_file(str(link), 4242) is None and other.exists()
    assert read_fault_file(str(good), 4242) == "Fatal Python error: Aborted\n" and not good.exists()
    os.chmod(where, 0o777)
    good.write_text("x")
    assert read_fault_file(str(good), 4242) is None, "a directory others may write"


def test_oom_counters_of_cgroup_v1_and_v2(tmp_path):
    v2, v1 = tmp_path / "memory.events", tmp_path / "memory.oom_control"
    v2.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert oom_kills([str(v2)]) == 2 and oom_kills([str(v1), str(v2)]) == 5
    assert oom_kills([str(tmp_path / "gone")]) is None
    ev = ExitEvidence()
    ev.hello(1, os.getpid(), "")
    assert ev.gather(1, os.getpid())["oom"] is False, "no OOM kill since the hello"


def test_the_fault_directory_is_made_private_with_the_per_user_one_above_it(tmp_path, monkeypatch):
    from rankwatch.hooks.instrument.exit_capture import ExitCapture

    monkeypatch.setenv("RANKWATCH_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RANKWATCH_FAULT_DIR", raising=False)
    import faulthandler

    was = faulthandler.is_enabled()
    faulthandler.disable()
    try:
        capture = ExitCapture(lambda: 1, lambda record, wait: None)
        capture.install()
        assert capture.fault_file.startswith(str(tmp_path / f"rankwatch-{os.getuid()}" / "faults"))
        for d in (tmp_path / f"rankwatch-{os.getuid()}", tmp_path / f"rankwatch-{os.getuid()}" / "faults"):
            assert d.stat().st_mode & 0o777 == 0o700, "the agent refuses a per-user directory open to others"
        capture.uninstall()
        assert not os.listdir(tmp_path / f"rankwatch-{os.getuid()}" / "faults"), "an empty fault file is removed"
    finally:
        if was:
            faulthandler.enable()


def test_a_worker_torchrun_sigtermed_after_another_failed_is_stopped_not_failed():
    """torchrun stops a group's other workers with SIGTERM once one failed; one that died of
    it before torchrun collected the result is listed among the failures with -15.  It is
    reported as stopped by torchrun (a consequence), not as killed by a signal of its own;
    a group that all died of SIGTERM (a scheduler's preemption) stays as it was."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from rankwatch.hooks.rendezvous.worker_results import report_of

    def exits(*codes: int) -> dict[int, object]:
        result = RunResult(state=WorkerState.FAILED, failures={
            r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=c, error_file="") for r, c in enumerate(codes)})
        msg = report_of(SimpleNamespace(workers=[]), result, "n0", "run", 5.0)
        return {e.rank: e for e in msg.exits}

    raised, stopped = exits(1, -15)[0], exits(1, -15)[1]
    assert raised.failed and not stopped.failed and stopped.exitcode == -15
    d = classify(record=None, fault=None, torchrun={"exitcode": -15, "signal": "SIGTERM", "failed": stopped.failed},
                 oom=False)
    assert (d["how"], d["signal"], d["stopped_by"]) == ("signal", "SIGTERM", "torchrun")
    assert all(e.failed for e in exits(-15, -15).values())
    d = classify(record=None, fault=None, torchrun={"exitcode": -15, "signal": "SIGTERM", "failed": True}, oom=False)
    assert (d["how"], d["signal"]) == ("signal", "SIGTERM") and "stopped_by" not in d


PEER = {"how": "exception", "type": "RuntimeError", "message": "[pair.cc:589] Read error [x]:1: Connection reset by peer"}


def test_a_rank_lost_with_its_node_is_its_own_root_and_the_survivors_errors_follow_it():
    lost = {"how": "node_lost", "why": "its agent went silent"}
    # The survivors' peer errors end a hair after the lost rank was last heard; the order they
    # come in (detected first: silence takes seconds to confirm) changes nothing.
    exits = [_view("s0", 10.2, **PEER), _view("s1", 10.3, **PEER), ExitView(id="l2", ended_at=10.0,
                                                                            consequence=False, lost=True)]
    assert root_causes(exits) == {"s0": "l2", "s1": "l2", "l2": "l2"}
    assert exit_view("l2", 13.0, {**lost, "started_at": 10.0}) == exits[2]
    assert not is_consequence(lost)
    # Two ranks lost with their node: each is its own root; the consequences follow the first.
    two = [exits[0], ExitView(id="l3", ended_at=10.1, consequence=False, lost=True), exits[2]]
    assert root_causes(two) == {"s0": "l2", "l3": "l3", "l2": "l2"}
    # A rank that failed before the node was lost stays the root; the lost rank is never its consequence.
    cause = _view("c", 9.0, how="exception", type="ValueError", message="bad batch")
    assert root_causes([cause, *exits]) == {"c": "c", "s0": "c", "s1": "c", "l2": "l2"}
    # Without the lost node's exit (a survivor's own agent), the earliest consequence stays the root.
    assert root_causes(exits[:2]) == {"s0": "s0", "s1": "s0"}


def test_the_ranks_a_lost_node_took_are_one_exit_each_at_their_last_word():
    from rankwatch.agent.job.node_lost import LastSeen, lost_exits

    ranks = [LastSeen(rank=4, pid=40, step=30, last_seen=99.5), LastSeen(rank=5, pid=50, step=31, last_seen=0.0),
             LastSeen(rank=4, pid=41, step=29, last_seen=90.0),                    # an older process of rank 4
             LastSeen(rank=6, pid=60, step=31, last_seen=99.0, exited_cleanly=True),
             LastSeen(rank=7, pid=70, step=12, last_seen=80.0),                    # its agent told its exit
             LastSeen(rank=8, pid=80, step=31, last_seen=101.0),                   # seen after the last summary?
             LastSeen(rank=9, pid=90, step=31, last_seen=97.0, connected=False),   # its end not told yet
             LastSeen(rank=10, pid=95, step=20, last_seen=60.0, connected=False)]  # stopped long before
    out = lost_exits("n2", "its agent went silent", heard_at=100.0, now=103.5, ranks=ranks, told_pids={70})
    assert [(x.rank, x.step, x.detail["pid"]) for x in out] == [(4, 30, 40), (5, 31, 50), (8, 31, 80), (9, 31, 90)]
    assert [x.detail["started_at"] for x in out] == [99.5, 100.0, 100.0, 97.0], "last heard, never after the node"
    for x in out:
        d = x.detail
        assert (d["how"], d["why"], d["last_heard"], d["silent_seconds"]) == ("node_lost", "its agent went silent",
                                                                             100.0, 3.5)
        assert "node n2 was lost" in d["reason"] and not is_consequence(d)
    assert lost_exits("n2", "x", heard_at=1.0, now=2.0, ranks=[]) == []


def _inc(id_, node, rank, step, at, **detail):
    return {"id": id_, "kind": "rank_exit", "node": node, "rank": rank, "step": step, "detected_at": at,
            "detail": detail}


def test_the_story_of_a_lost_node_tells_the_node_first_then_the_consequences():
    from rankwatch.agent.views.postmortem import tell_exit

    lost = dict(how="node_lost", why="its agent went silent", pid=22, started_at=100.0, last_heard=100.2,
                root_cause="rank_exit-n0-5", evidence=["node_death"])
    incidents = [
        _inc("rank_exit-n0-3", "n0", 0, 31, 101.0, **PEER, pid=20, started_at=100.4, root_cause="rank_exit-n0-5"),
        _inc("rank_exit-n1-1", "n1", 1, 31, 101.5, **PEER, pid=21, started_at=100.5, root_cause="rank_exit-n0-5"),
        _inc("rank_exit-n0-5", "n2", 2, 30, 104.0, **lost),
        _inc("rank_exit-n0-6", "n2", 3, 30, 104.0, **{**lost, "pid": 23, "root_cause": "rank_exit-n0-6"})]
    text = tell_exit(incidents[0], incidents)
    lines = text.splitlines()
    assert lines[0].startswith("rank_exit-n0-3: rank 0 on node n0 raised RuntimeError"), text
    assert lines[1] == "  a consequence of rank_exit-n0-5 (node n2 was lost); its story:", text
    head = lines.index(next(x for x in lines if x.startswith("node n2 was lost first: its agent went silent")))
    assert lines[head + 1].startswith("  rank_exit-n0-5: rank 2, pid 22, last seen at step 30"), text
    assert lines[head + 2].startswith("  rank_exit-n0-6: rank 3, pid 23, last seen at step 30"), text
    then = lines.index("  then, as consequences (2):")
    assert then > head + 2 and "failed first" not in text
    assert "rank_exit-n1-1: rank 1 on node n1 raised RuntimeError" in lines[then + 2]
    assert tell_exit(incidents[2], incidents).splitlines()[0].startswith("node n2 was lost first"), \
        "asked about the lost rank itself, the story starts with its node"


def test_an_agent_holding_only_consequences_says_so_and_never_failed_first():
    from rankwatch.agent.views.postmortem import tell_exit

    incidents = [_inc("rank_exit-n1-1", "n1", 1, 31, 101.5, **PEER, pid=21, started_at=100.5,
                      root_cause="rank_exit-n1-1"),
                 _inc("rank_exit-n1-2", "n1", 4, 31, 101.6, **PEER, pid=24, started_at=100.6,
                      root_cause="rank_exit-n1-1")]
    for asked in incidents:
        text = tell_exit(asked, incidents)
        assert "failed first" not in text, text
        assert "rank_exit-n1-1: rank 1 on node n1, pid 21 ended at step 31, a consequence of a lost peer" in text
    assert "then, also as consequences (1):" in tell_exit(incidents[0], incidents)
