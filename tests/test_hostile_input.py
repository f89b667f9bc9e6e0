"""Over 10,000 malformed or hostile messages at a live agent process.

The agent is a real ``rankwatch agent`` subprocess; the attack uses real gRPC
streams.  A well-behaved rank streams all along, and must be served
throughout: still connected, its records still counted, nothing of the
attack counted as its data.
"""

from __future__ import annotations

import math
import os
import threading
import time
from datetime import timedelta

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import AgentProcess, wait_for
from rankwatch.hooks.instrument.client import AgentClient
from rankwatch.hooks.instrument.recorder import OPS, Recorder
from rankwatch.proto import pb

REPORT = "/rankwatch.v1.Agent/Report"
SENT = {"messages": 0}
TARGET_MESSAGES = 10_000


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    agent = AgentProcess(tmp_path_factory.mktemp("hostile") / "agent.sock").start()
    rec = Recorder()
    hello = pb.Hello(rank=0, world_size=8, pid=os.getpid(), node_id="n0", backend="gloo",
                     op_names=list(OPS))
    client = AgentClient(rec, hello, agent.addr, flush_interval=timedelta(milliseconds=50))
    client.start()
    stop = threading.Event()
    fed = {"n": 0}

    def feeder() -> None:  # the well-behaved rank: 100 collectives every 10 ms
        while not stop.is_set():
            t = time.perf_counter_ns()
            for _ in range(100):
                rec.collective(0, 0, fed["n"], t, t + 5000, 256)
                fed["n"] += 1
            time.sleep(0.01)

    threading.Thread(target=feeder, daemon=True).start()
    channel = grpc.insecure_channel(agent.addr.grpc_target())
    yield agent, channel, fed
    stop.set()
    client.close()
    channel.close()
    agent.stop()


floats = st.floats(allow_nan=True, allow_infinity=True, width=64)


@st.composite
def columns(draw):
    n = draw(st.integers(0, 40))
    good_len = draw(st.booleans())

    def col(dtype, elems):
        if good_len:
            return np.asarray(draw(st.lists(elems, min_size=n, max_size=n)), dtype).tobytes()
        return draw(st.binary(max_size=64))

    return pb.CollectiveColumns(
        op=col("<u1", st.integers(0, 255)), pg=col("<u2", st.integers(0, 65535)),
        seq=col("<i8", st.integers(-(2**63), 2**63 - 1)), start=col("<f8", floats),
        duration=col("<f8", floats), nbytes=col("<i8", st.integers(-(2**63), 2**63 - 1)))


@st.composite
def steps(draw):
    n = draw(st.integers(0, 5))
    lst = lambda e: st.lists(e, min_size=n, max_size=n + draw(st.integers(0, 1)))  # noqa: E731
    return pb.StepColumns(step=draw(lst(st.integers(-(2**63), 2**63 - 1))), start=draw(lst(floats)),
                          duration=draw(lst(floats)), data=draw(lst(floats)), forward=draw(lst(floats)),
                          backward=draw(lst(floats)), optimizer=draw(lst(floats)),
                          tokens=draw(lst(floats)), flops=draw(lst(floats)))


@st.composite
def batches(draw):
    b = pb.Batch(seq=draw(st.integers(0, 2**64 - 1)), dropped_total=draw(st.integers(0, 2**64 - 1)))
    if draw(st.booleans()):
        b.collectives.CopyFrom(draw(columns()))
    if draw(st.booleans()):
        b.steps.CopyFrom(draw(steps()))
    if draw(st.booleans()):
        b.progress.CopyFrom(pb.Progress(step=draw(st.integers(-(2**63), 2**63 - 1)),
                                        step_started_at=draw(floats), phase=draw(st.integers(0, 9)),
                                        sampled_at=draw(floats)))
    return pb.ReportMessage(batch=b).SerializeToString()


names = st.text(max_size=200)
hellos = st.builds(
    lambda rank, world, pid, node, backend, ops, peak: pb.ReportMessage(hello=pb.Hello(
        rank=rank, world_size=world, pid=pid, node_id=node, backend=backend, op_names=ops,
        peak_flops=peak)).SerializeToString(),
    st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1),
    st.integers(-(2**63), 2**63 - 1), names, names, st.lists(names, max_size=80), floats)
garbage = st.binary(min_size=1, max_size=300)
message = st.one_of(garbage, hellos, batches())


def send_stream(channel, messages) -> pb.ReportSummary | grpc.StatusCode:
    """One Report stream of raw messages: the agent's summary, or the status code it ended with."""
    call = channel.stream_unary(REPORT, response_deserializer=pb.ReportSummary.FromString)
    SENT["messages"] += len(messages)
    try:
        return call(iter(messages), timeout=10)
    except grpc.RpcError as exc:
        return exc.code()


def decodes(raw: bytes) -> bool:
    try:
        pb.ReportMessage.FromString(raw)
        return True
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
        return False


def expected(messages: list[bytes]) -> set:
    """What the agent is designed to answer a stream with (agent/server.py ``_report``).

    An undecodable message ends the stream (grpc's INTERNAL, from the decoder); a stream
    that opens with anything but a hello is refused (INVALID_ARGUMENT); a hello is refused
    as invalid (INVALID_ARGUMENT) or as a live rank's duplicate (ALREADY_EXISTS); after an
    accepted hello each decodable message is counted, accepted or rejected, and the stream
    goes on.
    """
    first, rest = messages[0], messages[1:]
    if not decodes(first):
        return {grpc.StatusCode.INTERNAL}
    if pb.ReportMessage.FromString(first).WhichOneof("body") != "hello":
        return {grpc.StatusCode.INVALID_ARGUMENT}
    refused = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS}
    if not all(decodes(m) for m in rest):
        return refused | {grpc.StatusCode.INTERNAL}
    return refused | {len(rest)}


def outcome(result: pb.ReportSummary | grpc.StatusCode):
    """A status code as it is, a summary as the number of batches it counted."""
    if isinstance(result, grpc.StatusCode):
        return result
    return result.batches_accepted + result.batches_rejected


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(first=st.one_of(hellos, garbage, batches()), rest=st.lists(message, min_size=20, max_size=80))
def test_fuzzed_streams(live, first, rest):
    agent, channel, _ = live
    result = send_stream(channel, [first, *rest])
    assert outcome(result) in expected([first, *rest]), result
    assert agent.proc.poll() is None


def test_valid_hello_then_hostile_batches(live):
    # A plausible rank whose batches are all broken: each refused, the stream kept.
    agent, channel, _ = live
    before = agent.status()["messages_rejected"]
    hello = pb.ReportMessage(hello=pb.Hello(rank=3, world_size=8, pid=os.getpid(), node_id="n0",
                                            op_names=list(OPS))).SerializeToString()
    n = len(OPS) + 10
    bad = [pb.ReportMessage(batch=pb.Batch(seq=i + 1, collectives=pb.CollectiveColumns(
        op=np.full(2, n, "<u1").tobytes(), pg=bytes(4), seq=bytes(16), start=bytes(16),
        duration=np.array([math.nan, -1], "<f8").tobytes(), nbytes=bytes(16)))).SerializeToString()
        for i in range(2000)]
    summary = send_stream(channel, [hello, *bad])
    assert isinstance(summary, pb.ReportSummary), summary
    assert (summary.batches_accepted, summary.batches_rejected) == (0, 2000)
    assert agent.status()["messages_rejected"] - before == 2000


def test_flood_and_oversized(live):
    agent, channel, _ = live
    big = b"\x0a" + b"\xff" * 10 + os.urandom(17 << 20)  # over the 16 MiB limit
    assert send_stream(channel, [big]) == grpc.StatusCode.RESOURCE_EXHAUSTED
    hello = pb.ReportMessage(hello=pb.Hello(rank=5, world_size=8, pid=os.getpid(),
                                            op_names=list(OPS))).SerializeToString()
    flood = [pb.ReportMessage(batch=pb.Batch(seq=i + 1)).SerializeToString() for i in range(5000)]
    summary = send_stream(channel, [hello, *flood])
    assert isinstance(summary, pb.ReportSummary), summary
    assert summary.batches_accepted + summary.batches_rejected == 5000


def test_agent_survived_and_kept_serving_the_good_rank(live):
    agent, _, fed = live
    assert SENT["messages"] >= TARGET_MESSAGES, SENT
    assert agent.proc.poll() is None
    before = {r["rank"]: r for r in agent.status()["ranks"]}[0]["collectives"]
    wait_for(lambda: {r["rank"]: r for r in agent.status()["ranks"]}[0]["collectives"] > before + 500,
             10, what="the good rank's records still flowing")
    good = {r["rank"]: r for r in agent.status()["ranks"]}[0]
    assert good["connected"] and good["pid"] == os.getpid() and good["dropped"] == 0
    assert agent.status()["messages_rejected"] > 1000
    text = agent.metrics()
    assert 'rankwatch_messages_rejected_total{node="n0",reason="undecodable"}' in text
