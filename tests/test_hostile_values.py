"""Values out of range, against a live agent: refused with a clear error, counted by reason,
and the agent's Status and Sync go on answering (issue 13, the values half).

The agent is a real ``rankwatch agent`` subprocess that coordinates its own node; the
hostile rank is a real gRPC Report stream.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from conftest import AgentProcess, parse_metrics, wait_for
from rankstream import REPORT, Stream, hello
from rankwatch.agent.wire import ranges as validate, report as validate_stream, summary as validate_sync, windows as work_windows
from rankwatch.agent.link.uplink import forward_checkpoint
from rankwatch.proto import pb, pb_grpc

@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    sock = tmp_path_factory.mktemp("values") / "agent.sock"
    a = AgentProcess(sock, extra=("--coordinator", str(sock))).start()
    wait_for(lambda: a.status()["coordinator"], 10, what="the agent to coordinate its node")
    yield a
    a.stop()


@pytest.fixture()
def channel(agent):
    ch = grpc.insecure_channel(agent.addr.grpc_target())
    yield ch
    ch.close()


def rejected(agent, reason: str) -> float:
    return parse_metrics(agent.metrics()).get(
        ("rankwatch_messages_rejected_total", frozenset({("node", "n0"), ("reason", reason)})), 0.0)


def rank_of(agent, rank: int) -> dict | None:
    return next((r for r in agent.status()["ranks"] if r["rank"] == rank), None)


def test_step_beyond_2_53_then_a_checkpoint_request_leaves_status_answering(agent, channel):
    # The reproduced failure: step 2^63-1, then a checkpoint request, overflowed the
    # decision's int64 and Status failed for good.
    before = rejected(agent, "invalid_value")
    s = Stream(channel, hello(1))
    s.batch(progress=pb.Progress(step=2**63 - 1, sampled_at=time.time()))
    s.batch(steps=pb.StepColumns(step=[2**62], start=[time.time()], duration=[0.1], data=[0], forward=[0],
                                 backward=[0], optimizer=[0], tokens=[0], flops=[0]))
    wait_for(lambda: rejected(agent, "invalid_value") >= before + 2, 10, what="both batches refused")
    # The largest step in range is taken, and a checkpoint after it still fits.
    s.batch(progress=pb.Progress(step=2**53 - 1, sampled_at=time.time()))
    wait_for(lambda: (rank_of(agent, 1) or {}).get("step") == 2**53 - 1, 10, what="the step in range")
    # The coordinator decides from the node's last sync (4 a second), which may predate the step:
    # a request answered from it saves at an early step, and the next one decides anew.
    wait_for(lambda: forward_checkpoint(agent.addr, "test").step > 2**53 - 1, 10,
             what="a checkpoint decision after the step")
    status = agent.status()
    d = max((d for d in status["decisions"] if d["kind"] == "checkpoint"), key=lambda d: d["step"])
    assert 2**53 - 1 < d["step"] < 2**63
    assert rank_of(agent, 1)["step"] == 2**53 - 1
    summary = s.close()
    assert (summary.batches_accepted, summary.batches_rejected) == (1, 2)
    agent.status()  # still answering


def test_checkpoint_records_out_of_range_are_refused_and_counted(agent, channel):
    before = rejected(agent, "invalid_value")
    s = Stream(channel, hello(2))
    now = time.time()
    bad = [pb.CheckpointRecord(step=-5, started_at=now, duration=1.0, ok=True),
           pb.CheckpointRecord(step=10, started_at=now, duration=math.nan, ok=True),
           pb.CheckpointRecord(step=11, started_at=now, duration=math.inf, ok=True),
           pb.CheckpointRecord(step=12, started_at=now, duration=1.0, completed_after=1e300, ok=True),
           pb.CheckpointRecord(step=13, started_at=1e300, duration=1.0, ok=True),
           pb.CheckpointRecord(step=2**60, started_at=now, duration=1.0, ok=True)]
    for rec in bad:
        s.batch(checkpoints=[rec])
    # A 6 MB error string is kept cut, without its control characters.
    s.batch(checkpoints=[pb.CheckpointRecord(step=20, started_at=now, duration=0.5, ok=False,
                                             error="\x1b[31mdisk\x00 full " + "x" * (6 << 20))])
    summary = s.close()
    assert (summary.batches_accepted, summary.batches_rejected) == (1, len(bad))
    assert rejected(agent, "invalid_value") - before == len(bad)
    incidents = [i for i in agent.status()["incidents"] if i["kind"] == "checkpoint" and i["rank"] == 2]
    assert [i["step"] for i in incidents] == [20]
    error = incidents[0]["detail"]["error"]
    assert error.startswith("[31mdisk full x") and len(error) <= validate.MAX_TEXT + 1
    assert not any(ord(c) < 32 for c in error)


def test_durations_and_times_out_of_range_are_refused(agent, channel):
    before = rejected(agent, "invalid_value")
    s = Stream(channel, hello(3))
    now = time.time()

    def steps(**over):
        cols = dict(step=[1], start=[now], duration=[0.1], data=[0.0], forward=[0.0], backward=[0.0],
                    optimizer=[0.0], tokens=[0.0], flops=[0.0])
        cols.update(over)
        return pb.StepColumns(**cols)

    def colls(**over):
        cols = dict(op=np.zeros(1, "<u1"), pg=np.zeros(1, "<u2"), seq=np.ones(1, "<i8"),
                    start=np.full(1, now, "<f8"), duration=np.full(1, 0.01, "<f8"), nbytes=np.ones(1, "<i8"))
        cols.update({k: np.asarray(v, cols[k].dtype) for k, v in over.items()})
        return pb.CollectiveColumns(**{k: v.tobytes() for k, v in cols.items()})

    bad = [dict(steps=steps(duration=[1e300])), dict(steps=steps(start=[1e300])),
           dict(steps=steps(forward=[86401.0])), dict(steps=steps(tokens=[1e300])),
           dict(collectives=colls(duration=[1e300])), dict(collectives=colls(seq=[2**62])),
           dict(collectives=colls(start=[-5.0])), dict(collectives=colls(nbytes=[2**60])),
           dict(progress=pb.Progress(step=1, step_started_at=1e300)),
           dict(progress=pb.Progress(step=1, group_seqs={"0": 2**62})),
           dict(progress=pb.Progress(step=1, inflight=pb.InFlight(op="all_reduce", seq=2**62, since=now))),
           dict(dropped_total=2**63)]
    for fields in bad:
        s.batch(**fields)
    s.batch(steps=steps(), collectives=colls())  # the same rank, in range: taken
    summary = s.close()
    assert (summary.batches_accepted, summary.batches_rejected) == (1, len(bad))
    assert rejected(agent, "invalid_value") - before == len(bad)
    assert agent.status()["goodput"] is None or agent.status()["time_seconds"]["elapsed"] < 1e6


def test_flight_recorder_out_of_range_is_refused(agent, channel):
    before = rejected(agent, "malformed")
    s = Stream(channel, hello(4))
    for doc in ({"pending": [{"group": "0", "op": "all_reduce", "seq": 2**62, "since": 1.0}]},
                {"pending": [{"group": "0", "op": "all_reduce", "seq": 1, "since": 1e300}]},
                {"completed": {"0": 2**63}}):
        s.batch(progress=pb.Progress(step=1, stacks="x", flight_recorder=json.dumps(doc)))
    summary = s.close()
    assert (summary.batches_accepted, summary.batches_rejected) == (0, 3)
    assert rejected(agent, "malformed") - before == 3


def test_hello_out_of_range_is_refused_with_invalid_argument(agent, channel):
    for bad in (pb.Hello(rank=5, world_size=64, pid=2**40), hello(5, mesh_coords={"dp": -1})):
        call = channel.stream_unary(REPORT, request_serializer=pb.ReportMessage.SerializeToString,
                                    response_deserializer=pb.ReportSummary.FromString)
        with pytest.raises(grpc.RpcError) as err:
            call(iter([pb.ReportMessage(hello=bad)]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def summary(seq: int, **rank) -> pb.NodeSummary:
    now = time.time()
    r = dict(rank=9, pid=os.getpid(), step=5, step_seconds=0.1, steps_completed=5, activity="train",
             progress_at=now, last_seen=now, connected=False, alive=False)
    r.update(rank)
    return pb.NodeSummary(node_id="intruder", seq=seq, sent_at=now, ranks=[pb.RankSummary(**r)])


_RANK_NUMBERS = [("rank", -1), ("pid", -1), ("pid", 2**53), ("step", -2), ("steps_completed", -1),
                 ("local_rank", -1), ("world_size", validate.MAX_WORLD_SIZE + 1), ("world_rank", validate.MAX_WORLD_SIZE),
                 ("step_seconds", math.nan), ("step_seconds", -0.5), ("step_seconds", math.inf),
                 ("step_period", validate.MAX_DURATION * 2), ("progress_at", math.nan), ("last_seen", -1.0),
                 ("stacks_at", time.time() + 2 * validate.MAX_CLOCK_AHEAD), ("tokens_per_second", math.inf),
                 ("tokens_per_second", -1.0), ("group_seqs", {"0": -2}), ("group_seqs", {"0": 2**53}),
                 ("group_seqs", {"\x1b": 1})]


@pytest.mark.parametrize("field,value", _RANK_NUMBERS,
                         ids=[f"{field}-{i}" for i, (field, _) in enumerate(_RANK_NUMBERS)])
def test_a_rank_number_out_of_range_is_refused_by_name(field, value):
    """The range check reads a rank's numbers in one expression and names the one out of
    range only when that fails: each bound still holds, and the refusal says which."""
    s = summary(1, **{field: value})
    with pytest.raises(validate.Rejected) as err:
        validate_sync.check_summary(s)
    assert ("group" if field == "group_seqs" else field) in str(err.value), err.value


def test_rank_numbers_at_their_bounds_pass():
    now = time.time()
    validate_sync.check_summary(summary(1, pid=2**53 - 1, step=-1, world_size=validate.MAX_WORLD_SIZE,
                                        world_rank=validate.MAX_WORLD_SIZE - 1, step_seconds=validate.MAX_DURATION,
                                        progress_at=now + validate.MAX_CLOCK_AHEAD / 2, group_seqs={"0": -1},
                                        phase_seconds={"fwd": 1e9}, mesh_coords={"dp": 3}, backend="gloo"), now)


def test_sync_summaries_out_of_range_get_invalid_argument_and_status_answers(agent, channel):
    stub = pb_grpc.AgentStub(channel)
    before = rejected(agent, "invalid_value") + rejected(agent, "oversized") + rejected(agent, "malformed")
    now = time.time()
    bad = [summary(1, step=2**63 - 1), summary(2, step_seconds=math.inf), summary(3, own_work=[1e300]),
           summary(4, progress_at=1e300), summary(5, group_seqs={"0": 2**62}),
           summary(6, stacks="x" * (validate.MAX_STACKS + 1)),
           summary(7, flight_recorder=json.dumps({"completed": {"0": 2**62}})),
           summary(15, step_period=-1.0), summary(16, step_period=math.nan),
           # what a coordinator's status shows of another node's ranks as they came
           summary(21, phase_seconds={"fwd": math.nan}), summary(22, backend="gl\x1b[2Joo"),
           summary(23, mesh_coords={"dp": -1}), summary(24, collectives=2**60),
           summary(25, op_latency={"all_reduce": pb.OpLatency(count=1, p50_seconds=0.1, p99_seconds=math.inf)}),
           summary(26, phase_seconds={f"p{i}": 1.0 for i in range(validate.MAX_OP_NAMES + 1)}),
           pb.NodeSummary(node_id="intruder", seq=8, sent_at=math.nan),
           pb.NodeSummary(node_id="in\ntruder", seq=9, sent_at=now),
           pb.NodeSummary(node_id="intruder", seq=10, sent_at=now, incidents=[pb.Incident(
               id="x", kind="checkpoint", node="intruder", detected_at=now, detail_json='{"a": NaN}')]),
           pb.NodeSummary(node_id="intruder", seq=11, sent_at=now, incidents=[pb.Incident(
               id="x", kind="checkpoint", node="intruder", detected_at=now, detail_json="[" * 50_000)]),
           pb.NodeSummary(node_id="intruder", seq=13, sent_at=now, incidents=[pb.Incident(
               id="x", kind="checkpoint", node="intruder", detected_at=now, detail_json='{"seconds": 1e300}')]),
           pb.NodeSummary(node_id="intruder", seq=14, sent_at=now, incidents=[pb.Incident(
               id="x", kind="checkpoint", node="intruder", detected_at=now, detail_json='{"n": 9223372036854775807}')]),
           pb.NodeSummary(node_id="intruder", seq=12, sent_at=now, decisions=[pb.Decision(
               id="j/checkpoint-1", kind="checkpoint", generation=0, step=2**62, seq=1, decided_at=now)])]
    for msg in bad:
        with pytest.raises(grpc.RpcError) as err:
            stub.Sync(msg, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, msg
    after = rejected(agent, "invalid_value") + rejected(agent, "oversized") + rejected(agent, "malformed")
    assert after - before == len(bad)
    reply = stub.Sync(summary(20), timeout=5)  # in range: taken
    assert reply.coordinator == "n0"
    t0 = time.monotonic()
    agent.status()
    assert time.monotonic() - t0 < 1.0


def test_rejection_reasons_are_a_bounded_label_set(agent):
    assert validate.reason_label("invalid_value") == "invalid_value"
    assert validate.reason_label("x" * 200) == "other"
    text = agent.metrics()
    reasons = {dict(labels)["reason"] for (name, labels) in parse_metrics(text)
               if name == "rankwatch_messages_rejected_total"}
    assert reasons and reasons <= set(validate.REASONS)


def test_status_cli_still_prints(agent):
    out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "status", "--agent", str(agent.addr),
                          "--json"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["node"] == "n0"


def test_markup_and_control_characters_never_reach_the_terminal(agent, channel):
    # A mesh key "[/x]" crashed `rankwatch status` for everyone with rich's MarkupError.
    s = Stream(channel, hello(6, mesh_coords={"[/x]": 0, "[bold red]tp": 1}))
    s.batch(progress=pb.Progress(step=3, sampled_at=time.time()))
    wait_for(lambda: rank_of(agent, 6), 10, what="the rank with markup in its mesh")
    # Another node's id and its rank's state, through Sync, reach the coordinator's table too.
    now = time.time()
    pb_grpc.AgentStub(channel).Sync(pb.NodeSummary(node_id="[/y]", seq=1, sent_at=now, ranks=[pb.RankSummary(
        rank=40, pid=1, step=3, state="ok[/z]", connected=True, alive=True, progress_at=now, last_seen=now)]),
        timeout=5)
    # A C1 control character (a terminal escape introducer) in a hello is refused.
    call = channel.stream_unary(REPORT, request_serializer=pb.ReportMessage.SerializeToString,
                                response_deserializer=pb.ReportSummary.FromString)
    with pytest.raises(grpc.RpcError) as err:
        call(iter([pb.ReportMessage(hello=hello(7, mesh_coords={"\x9b31m": 0}))]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "status", "--agent", str(agent.addr)],
                         capture_output=True, text=True, timeout=30)
    s.close()
    assert out.returncode == 0, out.stderr
    assert "[/x]0" in out.stdout and "[bold red]tp1" in out.stdout
    assert "[/y]" in out.stdout and "ok[/z]" in out.stdout


def test_views_escape_every_wire_string():
    from rich.console import Console

    from rankwatch.agent.cli.status_tables import rank_table, timeline

    rank = {"rank": 0, "node": "[/n]\x1b[2J", "pid": 1, "mesh": {"[/x]": 0}, "step": 1, "step_seconds": 0.1,
            "phase_seconds": {}, "collectives": 0, "dropped": 0, "slowdown": 1.0, "state": "[/s]",
            "connected": True}
    status = {"node": "[/me]", "ranks": [rank], "tokens_per_second": 0.0, "incidents": [
        {"kind": "[/k]", "node": "[/n]", "rank": 0, "step": 1, "detected_at": 1.0,
         "detail": {"error": "[/e]\x07" + "y" * 5000}}]}
    console = Console(width=400, record=True, force_terminal=False)
    console.print(rank_table(status))
    console.print(timeline(status, 0.0))
    text = console.export_text()
    for s in ("[/n]", "[/x]0", "[/s]", "[/me]", "[/k]", "[/e]"):
        assert s in text, s
    assert "\x1b" not in text and "\x07" not in text
    assert "y" * 1100 not in text


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1e-9, validate.MAX_DURATION * 1.01, 1e300])
@pytest.mark.parametrize("where", ["own_work", "data_wait", "comm_wait"])
def test_every_value_of_a_summary_window_is_checked(bad, where):
    """The windows are checked a few values at a time in C: a bad value anywhere in any window
    (a NaN hidden between good ones too) is refused and named as before."""
    good = [0.5] * 16
    windows = {"own_work": list(good), "data_wait": list(good), "comm_wait": list(good)}
    windows[where][7] = bad
    validate_sync.check_summary(summary(1, **{k: good for k in windows}))
    with pytest.raises(ValueError, match="invalid_value: a per-step time"):
        validate_sync.check_summary(summary(2, **windows))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1e-9, validate.MAX_DURATION * 1.01, 1e300])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_every_value_of_packed_windows_is_checked(bad, where):
    """Packed windows (``RankSummary.work``, as a node agent sends them) are checked for the whole
    summary in one pass: a bad value in any window of any rank is refused and named."""
    good = [0.5] * 16
    windows = [list(good), list(good), list(good)]
    windows[where][7] = bad
    ok = dict(work=work_windows.pack(good, good, good))
    two = [pb.RankSummary(rank=1, **ok), pb.RankSummary(rank=2, work=work_windows.pack(*windows))]
    validate_sync.check_summary(summary(1, **ok))
    with pytest.raises(ValueError, match="invalid_value: a per-step time"):
        validate_sync.check_summary(summary(2, work=work_windows.pack(*windows)))
    s = summary(3, **ok)
    s.ranks.extend(two)   # one good rank, then the bad one: still refused
    with pytest.raises(ValueError, match="invalid_value: a per-step time"):
        validate_sync.check_summary(s)


@pytest.mark.parametrize(("work", "extra", "reason"), [
    (b"\x00" * 23, {}, "malformed: rank summary work of 23 bytes: not whole steps"),
    (b"\x00" * 24 * (validate.MAX_WINDOW + 1), {}, "oversized: rank summary window too long"),
    (b"\x00" * 24, {"own_work": [0.1]}, "malformed: rank summary has its windows both packed and repeated"),
])
def test_packed_windows_of_a_wrong_shape_are_refused(work, extra, reason):
    validate_sync.check_summary(summary(1, work=b"\x00" * 24 * validate.MAX_WINDOW))
    with pytest.raises(ValueError, match=reason):
        validate_sync.check_summary(summary(2, work=work, **extra))


@pytest.mark.parametrize("label", ["a\nb", "a\tb", "a\x00b", "a\x7fb", "a\x9fb", "x" * (validate.MAX_LABEL + 1)])
def test_labels_with_control_characters_or_too_long_are_refused(label):
    validate.check_label("ok label é", "name")
    with pytest.raises(ValueError, match="name is too long or has control characters"):
        validate.check_label(label, "name")


# -- in-process recovery records ------------------------------------------------------

def recovery(**over) -> pb.RecoveryRecord:
    fields = dict(started_at=time.time(), step=120, old_world_size=8, new_world_size=6, dropped_nodes=["n1"],
                  ok=True, rank_after=3, phases={"left_step": 0.5, "agreed": 1.0, "reinitialised": 2.0,
                                                 "restored": 2.5, "first_step": 4.0})
    fields.update(over)
    return pb.RecoveryRecord(**fields)


HOSTILE_RECOVERIES = {
    "started_at NaN": dict(started_at=math.nan), "started_at inf": dict(started_at=math.inf),
    "started_at negative": dict(started_at=-1.0), "started_at unset": dict(started_at=0.0),
    "started_at far ahead": dict(started_at=1e300),
    "step negative": dict(step=-5), "step huge": dict(step=2**60),
    "old world 0": dict(old_world_size=0), "old world negative": dict(old_world_size=-8),
    "old world huge": dict(old_world_size=2**30), "new world huge": dict(new_world_size=2**30),
    "ok with new world 0": dict(new_world_size=0), "new world negative": dict(ok=False, new_world_size=-1),
    "rank_after beyond the new world": dict(rank_after=6), "rank_after negative": dict(rank_after=-1),
    "failed rank_after below -1": dict(ok=False, rank_after=-2),
    "phase NaN": dict(phases={"agreed": math.nan}), "phase inf": dict(phases={"agreed": math.inf}),
    "phase negative": dict(phases={"left_step": -0.1}), "phase huge": dict(phases={"first_step": 1e300}),
    "phase over an hour": dict(phases={"first_step": validate.MAX_RECOVERY_SECONDS + 1}),
    "unknown phase": dict(phases={"left_step": 0.5, "warmup": 1.0}),
    "phases decreasing": dict(phases={"left_step": 0.5, "agreed": 3.0, "reinitialised": 2.0}),
    "10k dropped nodes": dict(dropped_nodes=[f"n{i}" for i in range(10_000)]),
    "dropped node with a newline": dict(dropped_nodes=["n1\nn2"]),
    "dropped node too long": dict(dropped_nodes=["n" * (validate.MAX_LABEL + 1)]),
}


@pytest.mark.parametrize("over", list(HOSTILE_RECOVERIES.values()), ids=list(HOSTILE_RECOVERIES))
def test_recovery_records_out_of_range_are_refused(over):
    validate_stream.check_recovery(recovery())
    with pytest.raises(validate.Rejected) as err:
        validate_stream.check_recovery(recovery(**over))
    assert err.value.reason in ("invalid_value", "oversized")
    assert "recovery" in str(err.value)


def test_recovery_records_in_range_are_taken():
    validate_stream.check_recovery(recovery(phases={}))                      # reported before any phase ended
    validate_stream.check_recovery(recovery(phases={"left_step": 1.0, "first_step": 1.0}))   # equal is not decreasing
    validate_stream.check_recovery(recovery(ok=False, new_world_size=0, rank_after=-1, phases={"left_step": 0.2},
                                     error="x" * (1 << 20)))          # a failed attempt, its error cut when kept
    validate_stream.check_recovery(recovery(step=-1, dropped_nodes=[]))       # before the first step; nobody named


def test_recovery_records_out_of_range_are_refused_alone_and_counted(agent, channel):
    before = rejected(agent, "invalid_value") + rejected(agent, "oversized")
    s = Stream(channel, hello(8))
    now = time.time()
    bad = [recovery(started_at=now - 600 + n, **over) for n, over in enumerate(HOSTILE_RECOVERIES.values())
           if "started_at" not in over]
    # Every bad record rides with a step of the rank: the steps are all taken.
    for n, rec in enumerate(bad):
        s.batch(recoveries=[rec], steps=pb.StepColumns(step=[n + 1], start=[now], duration=[0.1], data=[0],
                                                       forward=[0], backward=[0], optimizer=[0], tokens=[0],
                                                       flops=[0]))
    # A 1 MB error string is kept cut, without its control characters.
    s.batch(recoveries=[recovery(started_at=now, ok=False, new_world_size=0, rank_after=-1, phases={"left_step": 0.3},
                                 error="\x1b[31mstore\x00 timeout " + "x" * (1 << 20))])
    # More records in one batch than a rank ever buffers: that batch is refused whole.
    s.batch(recoveries=[recovery(started_at=now - 3000 + 20 * n) for n in range(validate.MAX_RECOVERIES_PER_BATCH + 1)])
    summary_ = s.close()
    assert (summary_.batches_accepted, summary_.batches_rejected) == (len(bad) + 1, 1)
    after = rejected(agent, "invalid_value") + rejected(agent, "oversized")
    assert after - before == len(bad) + 1
    assert rank_of(agent, 8)["step"] == len(bad)
    incidents = [i for i in agent.status()["incidents"] if i["kind"] == "restart" and i["rank"] == 8]
    (inc,) = incidents
    assert inc["detail"]["tier"] == "in_process" and inc["detail"]["ok"] is False
    error = inc["detail"]["error"]
    assert error.startswith("[31mstore timeout x") and len(error) <= validate.MAX_TEXT + 1
    assert not any(ord(c) < 32 for c in error)


@pytest.mark.parametrize("phases", ['{"agreed": NaN}', '{"agreed": 1e299}', '{"agreed": "soon"}', '[1, 2]',
                                    '{"left_step": 2.0, "agreed": 1.0}', '{"warmup": 1.0}'])
def test_a_nodes_recovery_incident_with_hostile_phases_is_refused(phases):
    # A node's summary carries its recovery incidents to the coordinator, whose goodput reads the phases.
    now = time.time()
    detail = '{"tier": "in_process", "ok": true, "phases": %s, "started_at": %r}' % (phases, now)
    good = detail.replace(phases, '{"left_step": 0.5, "first_step": 4.0}')
    msg = pb.NodeSummary(node_id="n5", seq=1, sent_at=now, incidents=[pb.Incident(
        id="restart-1", kind="restart", node="n5", detected_at=now, detail_json=good)])
    validate_sync.check_summary(msg)
    msg.incidents[0].detail_json = detail
    with pytest.raises(validate.Rejected):
        validate_sync.check_summary(msg)
