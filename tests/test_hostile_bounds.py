"""Bounds against a live agent: rank-id churn, incident floods, summaries near the message
limit (issue 13, the values half).  Real ``rankwatch agent`` subprocesses, real gRPC streams."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest

from conftest import AgentProcess, parse_metrics, wait_for
from rankstream import REPORT, Stream, hello
from rankwatch.agent.wire import bounds
from rankwatch.agent.link.uplink import forward_checkpoint
from rankwatch.hooks.instrument.recorder import OPS
from rankwatch.proto import pb

WORLD = 4096


def one_stream(channel: grpc.Channel, messages: list[pb.ReportMessage]) -> pb.ReportSummary:
    call = channel.stream_unary(REPORT, request_serializer=pb.ReportMessage.SerializeToString,
                                response_deserializer=pb.ReportSummary.FromString)
    return call(iter(messages), timeout=30)


def churn_rank(channel: grpc.Channel, rank: int) -> None:
    """A rank id that connects, reports one step, and leaves."""
    now = time.time()
    one_stream(channel, [
        pb.ReportMessage(hello=pb.Hello(rank=rank, world_size=WORLD, pid=os.getpid(), backend="gloo",
                                        op_names=list(OPS), mesh_coords={"dp": rank})),
        pb.ReportMessage(batch=pb.Batch(seq=1, steps=pb.StepColumns(
            step=[1], start=[now], duration=[0.1], data=[0.01], forward=[0.03], backward=[0.05],
            optimizer=[0.01], tokens=[10.0], flops=[1.0]), progress=pb.Progress(step=1, sampled_at=now))),
        pb.ReportMessage(goodbye=pb.Goodbye())])


def rank_series(text: str) -> int:
    return sum(1 for (name, labels) in parse_metrics(text) if any(k == "rank" for k, _ in labels))


def test_churn_of_2000_rank_ids_stays_bounded(tmp_path):
    agent = AgentProcess(tmp_path / "agent.sock", extra=("--rank-grace", "3")).start()
    try:
        channel = grpc.insecure_channel(agent.addr.grpc_target())
        rss = psutil.Process(agent.proc.pid).memory_info().rss
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda r: churn_rank(channel, r), range(2000)))
        status = agent.status()
        assert len(status["ranks"]) == 256   # bounds.MAX_RANK_IDS, stated here so a change shows
        assert {r["rank"] for r in status["ranks"]} >= set(range(2000 - 100, 2000))  # the newest kept
        text = agent.metrics()
        per_rank = rank_series(text) / max(1, len(status["ranks"]))
        assert rank_series(text) <= bounds.MAX_RANK_IDS * per_rank
        # Gone ranks leave /metrics after the grace period; a live rank stays.
        live = Stream(channel, hello(4000, WORLD))
        wait_for(lambda: 'rank="1999"' not in agent.metrics(), 15, what="gone ranks to leave /metrics")
        text = agent.metrics()
        assert 'rankwatch_rank_connected{node="n0",rank="4000"} 1.0' in text
        assert {dict(labels)["rank"] for (name, labels) in parse_metrics(text)
                if any(k == "rank" for k, _ in labels)} == {"4000"}
        assert len(text) < 64 << 10
        live.close()
        grown = psutil.Process(agent.proc.pid).memory_info().rss - rss
        assert grown < 60 << 20, f"agent RSS grew {grown >> 20} MiB over 2000 rank ids"
        channel.close()
    finally:
        agent.stop()


def test_a_flood_of_checkpoint_records_keeps_status_small(tmp_path):
    agent = AgentProcess(tmp_path / "agent.sock").start()
    try:
        channel = grpc.insecure_channel(agent.addr.grpc_target())
        now = time.time()
        hello = pb.ReportMessage(hello=pb.Hello(rank=0, world_size=8, pid=os.getpid(), op_names=list(OPS)))
        batches = [pb.ReportMessage(batch=pb.Batch(seq=b + 1, checkpoints=[
            pb.CheckpointRecord(step=b * 64 + i, started_at=now, duration=0.1, ok=False, error="e" * (1 << 20))
            for i in range(4)])) for b in range(100)]
        summary = one_stream(channel, [hello, *batches, pb.ReportMessage(goodbye=pb.Goodbye())])
        assert summary.batches_accepted == 100
        t0 = time.monotonic()
        status = agent.status()
        assert time.monotonic() - t0 < 1.0
        assert len([i for i in status["incidents"] if i["rank"] == 0]) == bounds.MAX_INCIDENTS_PER_RANK
        size = os.path.getsize(tmp_path / "state-n0" / "incidents.jsonl")
        assert size < 400 * 2 << 10   # 400 records, each error cut to ~1 KiB
        channel.close()
    finally:
        agent.stop()


@pytest.mark.e2e
def test_summaries_stay_below_the_message_limit_so_the_node_stays_in_the_job(tmp_path):
    # 60 ranks of node n1 (the agent serves 64 streams), each with 250 KiB of stacks and a
    # 50 KiB Flight Recorder extract: 18 MB of summary without the cap, over gRPC's 16 MiB
    # limit, and the coordinator (n0) would lose the node.
    coord = AgentProcess(tmp_path / "n0.sock", node="n0", extra=("--coordinator", str(tmp_path / "n0.sock"))).start()
    # The 60 streams come from this one process, without credentials: one Unix peer, whose cap
    # (--max-streams-per-peer, 32 by default) is raised to let them all in.
    node = AgentProcess(tmp_path / "n1.sock", node="n1", extra=("--coordinator", str(tmp_path / "n0.sock"),
                                                               "--max-streams-per-peer", "64")).start()
    channel = grpc.insecure_channel(node.addr.grpc_target())
    streams = []
    try:
        wait_for(lambda: coord.status()["nodes"] == ["n0", "n1"], 15, what="n1 to join")
        streams = [Stream(channel, hello(r, 60)) for r in range(60)]
        fr = json.dumps({"pending": [{"group": "0", "desc": "d" * 120, "seq": n, "op": "all_reduce",
                                      "state": "scheduled", "since": time.time()} for n in range(256)]})
        for s in streams:   # fresh stacks (a hung rank's sender takes them): kept 10 s in summaries
            s.batch(progress=pb.Progress(step=10, sampled_at=time.time(),
                                         stacks=f"rank {s.seq}\n" + "f" * (250 << 10), flight_recorder=fr))
        wait_for(lambda: len([r for r in node.status()["ranks"] if r["step"] == 10]) == 60, 15,
                 what="n1 to take every rank's stacks")
        wait_for(lambda: len([r for r in coord.status()["ranks"] if r["node"] == "n1" and r["step"] == 10]) == 60,
                 5, what="the coordinator to see n1's 60 ranks")
        reply = forward_checkpoint(coord.addr, "test")
        assert reply.accepted, reply.message
        status = coord.status()
        assert status["excluded_nodes"] == []
        log = node.log.read_text()
        assert "RESOURCE_EXHAUSTED" not in log
        assert "evicted" not in log   # every one of the 60 streams kept its seat
    finally:
        for s in streams:
            s.cancel()
        channel.close()
        node.stop()
        coord.stop()
