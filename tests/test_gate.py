"""The gate's deadlines, in one process: its watchdog, and unary calls that never send their request.

A real gRPC server with the gate in front of a one-method service; the calls are real
gRPC over TCP from this process.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent import futures
from datetime import timedelta

import grpc
import pytest

from conftest import wait_for
from rankwatch.agent.rpc.gate import Gate, StreamLimits
from rankwatch.agent.rpc.deadlines import Watchdog
from rankwatch.proto import pb

TOKEN = "gate-test-token"
SYNC = "/rankwatch.v1.Agent/Sync"
REQUEST_TIMEOUT = 0.5


# -- the watchdog ---------------------------------------------------------------------

def test_watchdog_runs_due_callbacks_and_skips_cancelled_ones():
    dog = Watchdog()
    ran: list[str] = []
    done = threading.Event()
    dog.after(0.2, lambda: ran.append("late"))
    dropped = dog.after(0.1, lambda: ran.append("cancelled"))
    dog.after(0.3, lambda: (ran.append("last"), done.set()))
    dog.cancel(dropped)
    assert done.wait(5)
    assert ran == ["late", "last"]


def test_an_earlier_deadline_armed_later_still_runs_on_time():
    """The thread sleeps towards the head; a new, earlier head must wake it."""
    dog = Watchdog()
    dog.after(30.0, lambda: None)
    # The thread now sleeps towards 30 s: its innermost Python frame is the condition's wait.
    wait_for(lambda: (f := sys._current_frames().get(dog._thread.ident)) is not None and f.f_code.co_name == "wait",
             5, 0.001, "the deadline thread asleep")
    fired = threading.Event()
    t0 = time.monotonic()
    dog.after(0.1, fired.set)
    assert fired.wait(5)
    assert time.monotonic() - t0 < 1.0


def test_cancelled_deadlines_are_dropped():
    dog = Watchdog()
    for _ in range(1000):
        dog.cancel(dog.after(0.05, lambda: pytest.fail("a cancelled deadline ran")))
    deadline = time.monotonic() + 5
    while dog.pending() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert dog.pending() == 0


# -- unary calls behind the gate ------------------------------------------------------

@pytest.fixture
def served():
    """Start a server with a gate (token or none) in front of ``Sync``; yields (port, gate)."""
    servers: list[grpc.Server] = []

    def start(token: str | None, **limits) -> tuple[int, Gate]:
        gate = Gate(token, StreamLimits(request_timeout=timedelta(seconds=REQUEST_TIMEOUT), **limits))
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=gate.limits.threads), interceptors=(gate,))
        handler = grpc.unary_unary_rpc_method_handler(
            lambda req, ctx: pb.SyncReply(coordinator=req.node_id),
            request_deserializer=pb.NodeSummary.FromString, response_serializer=pb.SyncReply.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("rankwatch.v1.Agent",
                                                                             {"Sync": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return port, gate

    yield start
    for s in servers:
        s.stop(0)


def _silent_call(channel: grpc.Channel, hold: threading.Event, metadata=()) -> grpc.Future:
    """A Sync whose request message never comes (until ``hold`` is set, long after the test)."""
    def never():
        hold.wait(30)
        yield from ()
    return channel.stream_unary(SYNC).future(never(), timeout=20, metadata=metadata)


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token holder", "no token configured"])
def test_a_unary_call_that_never_sends_its_request_is_cancelled(served, token):
    """Token holders skip the waiting caps, not the deadline: either way the call is
    cancelled after request_timeout and its thread is free again."""
    port, gate = served(token)
    hold = threading.Event()
    metadata = (("authorization", f"Bearer {TOKEN}"),) if token else ()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            t0 = time.monotonic()
            calls = [_silent_call(ch, hold, metadata) for _ in range(2)]
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    call.result(timeout=10)
                assert err.value.code() == grpc.StatusCode.CANCELLED
            assert REQUEST_TIMEOUT * 0.8 < time.monotonic() - t0 < REQUEST_TIMEOUT + 3
            assert gate.refused.get("no_request") == 2
            # A call whose message comes is served as before.
            reply = ch.unary_unary(SYNC, request_serializer=pb.NodeSummary.SerializeToString,
                                   response_deserializer=pb.SyncReply.FromString)(
                pb.NodeSummary(node_id="n7"), timeout=5, metadata=metadata)
            assert reply.coordinator == "n7"
        finally:
            hold.set()


def test_token_holders_are_not_held_to_the_waiting_caps(served):
    """Callers without the job's credentials may keep at most waiting_per_peer calls waiting;
    a token holder's silent calls neither count towards that nor are refused by it."""
    port, gate = served(TOKEN, waiting_per_peer=1)
    hold = threading.Event()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            calls = [_silent_call(ch, hold, (("authorization", f"Bearer {TOKEN}"),)) for _ in range(4)]
            codes = []
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    call.result(timeout=10)
                codes.append(err.value.code())
            assert codes == [grpc.StatusCode.CANCELLED] * 4
            assert "waiting" not in gate.refused and gate._waiting_all == 0
        finally:
            hold.set()


def test_callers_without_credentials_are_capped_while_they_wait(served):
    port, gate = served(None, waiting_per_peer=1)
    hold = threading.Event()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            first = _silent_call(ch, hold)
            wait_for(lambda: gate._waiting_all == 1, 10, what="the first call waiting for its message")
            second = _silent_call(ch, hold)
            with pytest.raises(grpc.RpcError) as err:
                second.result(timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.RpcError) as err:
                first.result(timeout=10)
            assert err.value.code() == grpc.StatusCode.CANCELLED
            assert gate.refused == {"waiting": 1, "no_request": 1}
            # The caller sees its call cancelled before the server's thread has unwound it.
            wait_for(lambda: gate._waiting_all == 0 and gate._waiting == {}, 10, what="the wait released")
        finally:
            hold.set()
