"""No number of streams can starve an agent's Status or its coordinator's Sync.

Two real agents: n0 coordinates the job on TCP, n1 syncs with it.  An attacker
opens 100 idle streams on n0's TCP port, then 500 concurrent ones that stream.
Throughout, n0 answers Status in under a second (over TCP and on its socket), the
streams beyond the caps are refused with RESOURCE_EXHAUSTED, the idle ones are
closed once their hello is overdue, and n1 is never called silent or excluded.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from datetime import timedelta

import grpc
import pytest

from conftest import AgentProcess, parse_metrics, wait_for
from multinode import free_port
from rankwatch.address import Address
from rankwatch.proto import pb, pb_grpc
from rankwatch.status import AgentUnreachable, fetch_status

pytestmark = pytest.mark.e2e

PER_PEER = 32      # the agent's default streams per TCP host
SPARE = 4          # streams that may wait beyond a cap to be decided (an eighth of the reserve)
HELLO_TIMEOUT = 5  # seconds, the agent's default
# grpc.aio's client ends a call with INTERNAL when its own write races the agent's
# early status (the refusal); the agent's counter is the authority on those.
WRITE_RACE = "refused while writing"


class StatusProbe:
    """Calls Status every 50 ms on each address, keeping the worst latency and any failure."""

    def __init__(self, *addrs: Address) -> None:
        self.addrs = addrs
        self.worst = 0.0
        self.failures: list[str] = []
        self.calls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for addr in self.addrs:
                t0 = time.monotonic()
                try:
                    fetch_status(addr, timedelta(seconds=3))
                except Exception as exc:  # noqa: BLE001 - recorded, asserted on below
                    self.failures.append(f"{addr}: {exc}")
                self.worst = max(self.worst, time.monotonic() - t0)
                self.calls += 1
            self._stop.wait(0.05)

    def __enter__(self) -> StatusProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _hello(rank: int) -> pb.ReportMessage:
    return pb.ReportMessage(hello=pb.Hello(rank=rank, world_size=4096, pid=os.getpid(), node_id="n0",
                                           backend="gloo", op_names=["all_reduce"]))


async def _idle_streams(target: str, n: int) -> list[grpc.StatusCode]:
    """Open ``n`` Report streams that never send a message; the codes they end with."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.AgentStub(ch)
        calls = [stub.Report() for _ in range(n)]

        async def end(call) -> grpc.StatusCode:
            try:
                await asyncio.wait_for(call, HELLO_TIMEOUT + 10)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return await asyncio.gather(*(end(c) for c in calls))


async def _busy_streams(target: str, n: int, seconds: float) -> list[grpc.StatusCode | str]:
    """``n`` streams at once, each sending its hello and then a batch every 20 ms."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.AgentStub(ch)

        async def one(i: int) -> grpc.StatusCode:
            call = stub.Report(timeout=seconds + 20)
            try:
                await call.write(_hello(1000 + i))
                await asyncio.sleep(0.2)   # a refused stream's status arrives before its batches
                deadline, seq = time.monotonic() + seconds, 0
                while time.monotonic() < deadline:
                    seq += 1
                    await call.write(pb.ReportMessage(batch=pb.Batch(seq=seq)))
                    await asyncio.sleep(0.02)
                await call.write(pb.ReportMessage(goodbye=pb.Goodbye()))
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass   # the agent ended the call: its status is what counts, below
            try:
                await call
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                if "SendMessageOperation" in (exc.debug_error_string() or ""):
                    return WRITE_RACE
                return exc.code()
        return await asyncio.gather(*(one(i) for i in range(n)))


def _refused(agent: AgentProcess, reason: str) -> float:
    return parse_metrics(agent.metrics()).get(
        ("rankwatch_rpcs_refused_total", frozenset({("node", agent.node), ("reason", reason)})), 0.0)


def test_streams_cannot_starve_status_or_sync(tmp_path):
    tcp = Address.parse(f"127.0.0.1:{free_port()}")
    n0 = AgentProcess(tmp_path / "n0.sock", "n0", extra=("--listen", str(tcp), "--coordinator", str(tcp))).start()
    n1 = AgentProcess(tmp_path / "n1.sock", "n1", extra=("--coordinator", str(tcp))).start()
    try:
        wait_for(lambda: "n1" in n0.status()["nodes"], 15, what="n1 synced with its coordinator")
        with StatusProbe(tcp, n0.addr) as probe:
            idle = asyncio.run(_idle_streams(tcp.grpc_target(), 100))
            worst_idle = probe.worst
            busy = asyncio.run(_busy_streams(tcp.grpc_target(), 500, seconds=4.0))
        # The job first: Status answered throughout, and n1 was never called silent.
        assert worst_idle < 1.0 and probe.worst < 1.0, (worst_idle, probe.worst)
        assert not probe.failures, probe.failures[:5]
        assert probe.calls > 50
        status = n0.status()
        assert status["excluded_nodes"] == [] and "n1" in status["nodes"], status
        assert not [d for d in status["decisions"] if d["kind"] == "exclude"], status["decisions"]
        # Then the streams: beyond the cap refused or evicted by newer ones (a silent stream
        # waiting on a spare seat gives way), with a clear code; the idle ones closed.
        cancelled = idle.count(grpc.StatusCode.CANCELLED)   # closed: no hello
        assert PER_PEER <= cancelled <= PER_PEER + SPARE, idle
        assert idle.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 100 - cancelled, idle
        ok, exhausted = busy.count(grpc.StatusCode.OK), busy.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert ok + exhausted + busy.count(WRITE_RACE) == 500, busy
        assert PER_PEER - SPARE <= ok < 100 and exhausted >= 400, (ok, exhausted)
        assert _refused(n0, "streams_per_peer") + _refused(n0, "evicted") >= 100 - PER_PEER - SPARE + 400
        assert _refused(n0, "no_hello") == cancelled
        log = n0.log.read_text()
        assert "refused: Report from ipv4:127.0.0.1" in log and "sent no hello" in log
        assert log.count("refused:") < 20, "refusals are logged without a rate limit"
    finally:
        n1.stop()
        n0.stop()


def test_calls_that_never_send_their_request_cannot_starve_status(tmp_path):
    """gRPC runs a unary handler only once its message is there, on a thread that waits for
    it: 100 Status and 100 Commands calls that never send one must not take every thread."""
    tcp = Address.parse(f"127.0.0.1:{free_port()}")
    agent = AgentProcess(tmp_path / "a.sock", extra=("--listen", str(tcp))).start()
    hold = threading.Event()

    def never():
        hold.wait(30)
        yield from ()

    channel = grpc.insecure_channel(tcp.grpc_target())
    try:
        calls = [channel.stream_unary("/rankwatch.v1.Agent/Status").future(never(), timeout=20)
                 for _ in range(100)]
        streams = [channel.stream_stream("/rankwatch.v1.Agent/Commands")(never(), timeout=20)
                   for _ in range(100)]
        # The attacker's own host shares its quota: a Status from there is refused, at once.
        t0 = time.monotonic()
        with pytest.raises(AgentUnreachable, match="RESOURCE_EXHAUSTED"):
            fetch_status(tcp, timedelta(seconds=3))
        assert time.monotonic() - t0 < 1.0
        with StatusProbe(agent.addr) as probe:   # everyone else is served
            wait_for(lambda: all(c.done() for c in calls), 10, what="the silent Status calls ended")
        assert not probe.failures and probe.worst < 1.0, (probe.worst, probe.failures[:3])
        codes = [c.exception().code() for c in calls]
        # Two wait at a time from one host, and are closed after 2 s; the rest are refused.
        assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}, set(codes)
        for s in streams:
            with pytest.raises(grpc.RpcError) as err:
                next(s)
            assert err.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)
        assert _refused(agent, "waiting") >= 100 and _refused(agent, "no_request") >= 2
    finally:
        hold.set()
        channel.close()
        agent.stop()
