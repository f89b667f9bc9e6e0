"""What one ``Sync`` costs the coordinator in Python, part by part (microbenchmark).

    python benchmarks/sync_cost.py [--profile]

Medians over repeats, in µs per call, single-threaded, no network:

- the gate's wrapper around a unary call (a token holder over TCP, its request there
  already), less the bare handler: credentials, the waiting bookkeeping, the request
  deadline armed and disarmed;
- the request deadline alone (``Watchdog.after`` + ``cancel``);
- the range check of a node's summary (8 ranks, shaped as ``coordinator_load.py`` sends it);
- ``Coordinator.sync`` for that summary (the range check included), 2,048 nodes known;
- decoding the summary from its bytes;
- the coordinator's straggler inputs for 2,048 nodes of 8 ranks (µs per *evaluation*, not
  per sync): built from a snapshot of every rank, as before ``JobView.straggler_work``; read
  by it with nothing sent whole since its last run (kept); and with every node read again
  (the most a run can cost: every node sent whole since).

``--profile`` prints the top of a cProfile of the gate and of ``Coordinator.sync``.
``--repeated-windows``: the summaries carry each rank's windows as an older agent sends
them (repeated doubles, not ``RankSummary.work``).

``--served N``: also a real gRPC server in this process, the gate in front of a ``Sync``
that answers at once, and N calls from a client process (64 at a time, with the token):
this process's CPU per call (server threads, the gate's deadline thread, gRPC's poller),
the part of a Sync's cost that is not the coordinator's own work (``--no-gate``: the same
server without the gate, for reference).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

import coordinator_load
from coordinator_load import TOKEN, SimNode
from rankwatch.agent.wire import summary as validate_sync
from rankwatch.agent.job.coordinator import Coordinator
from rankwatch.agent.detect.evaluate import evaluate
from rankwatch.agent.rpc.gate import Gate
from rankwatch.agent.rpc.deadlines import Watchdog
from rankwatch.agent.durable.incidents import IncidentLog
from rankwatch.agent.detect.work_scores import recent_window
from rankwatch.proto import pb

REPEATS = 7


class _Context:
    """What the gate asks of a ``grpc.ServicerContext``: a TCP peer holding the token."""

    def __init__(self, token: str) -> None:
        self._md = (("authorization", f"Bearer {token}"),)

    def peer(self) -> str:
        return "ipv4:10.0.0.2:51234"

    def invocation_metadata(self):
        return self._md

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> float:
        return 1.0

    def cancel(self) -> None:
        pass

    def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")


def per_call(fn, n: int) -> float:
    """Median µs per call of ``fn()`` over :data:`REPEATS` loops of ``n``."""
    runs = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def _gate_call(gate: Gate):
    handler = grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)
    details = type("D", (), {"method": "/rankwatch.v1.Agent/Sync"})()
    wrapped = gate.intercept_service(lambda d: handler, details).stream_unary
    ctx = _Context(TOKEN)
    req = pb.SyncReply()
    return lambda: wrapped(iter((req,)), ctx), lambda: handler.unary_unary(next(iter((req,))), ctx)


def _coordinator(nodes: int):
    coord = Coordinator("coord", incidents=IncidentLog(None))
    sims = [SimNode(i, 8, slow=False, born=time.time() - 30) for i in range(nodes)]
    for s in sims:
        coord.sync(s.summary(time.time()))
    return coord, sims


_CLIENT = """
import asyncio, sys, grpc
from rankwatch.proto import pb, pb_grpc
async def main(port, n, token):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub, md = pb_grpc.AgentStub(ch), (("authorization", f"Bearer {token}"),)
        msg = pb.NodeSummary(node_id="n1", seq=1)
        await stub.Sync(msg, metadata=md)
        sem = asyncio.Semaphore(64)
        async def one():
            async with sem:
                await stub.Sync(msg, metadata=md, timeout=10)
        print("ready", flush=True)
        sys.stdin.readline()
        await asyncio.gather(*(one() for _ in range(n)))
asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
"""


def served(n: int, gated: bool = True) -> tuple[float, float]:
    """(server CPU µs per call, calls per second) for ``n`` Syncs through a real gRPC server
    (``gated``: with the gate in front, as the agent serves; else bare, for reference)."""
    gate = Gate(TOKEN)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=gate.limits.threads),
                         interceptors=(gate,) if gated else ())
    handler = grpc.unary_unary_rpc_method_handler(
        lambda req, ctx: pb.SyncReply(coordinator="c"), request_deserializer=pb.NodeSummary.FromString,
        response_serializer=pb.SyncReply.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("rankwatch.v1.Agent", {"Sync": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, str(port), str(n), TOKEN],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None and client.stdin is not None
        client.stdout.readline()   # connected, one call made
        t0, c0 = time.perf_counter(), os.times()
        client.stdin.write("go\n")
        client.stdin.flush()
        client.wait(300)
        t1, c1 = time.perf_counter(), os.times()
    finally:
        client.kill()
        server.stop(0)
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    return cpu / n * 1e6, n / (t1 - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--served", type=int, default=0, metavar="N")
    ap.add_argument("--no-gate", action="store_true", help="--served without the gate, for reference")
    ap.add_argument("--repeated-windows", action="store_true",
                    help="summaries carry each rank's windows as repeated doubles (an older agent's form)")
    args = ap.parse_args()
    coordinator_load.REPEATED_WINDOWS = args.repeated_windows

    gate = Gate(TOKEN)
    wrapped, bare = _gate_call(gate)
    dog = Watchdog()
    summary = SimNode(7, 8, slow=False, born=time.time() - 30).summary(time.time())
    data = summary.SerializeToString()
    coord, sims = _coordinator(2048)
    k = [0]

    def sync() -> None:
        s = sims[k[0] % len(sims)]
        k[0] += 1
        coord.sync(s.summary(time.time()))

    def make() -> None:
        s = sims[k[0] % len(sims)]
        k[0] += 1
        s.summary(time.time())

    rows = [
        ("gate wrapper, less the bare handler", per_call(wrapped, 20_000) - per_call(bare, 20_000)),
        ("request deadline: after + cancel", per_call(lambda: dog.cancel(dog.after(2.0, _noop)), 20_000)),
        ("range check of an 8-rank summary", per_call(lambda: validate_sync.check_summary(summary), 2_000)),
        ("Coordinator.sync (2,048 nodes), less making the summary", per_call(sync, 2_000) - per_call(make, 2_000)),
        ("decode the summary", per_call(lambda: pb.NodeSummary.FromString(data), 20_000)),
    ]
    now = time.time()

    def read_all() -> None:
        coord.view._work.clear()
        coord.view.straggler_work(now)

    rows += [
        ("straggler inputs, 2,048 nodes: from a snapshot", per_call(
            lambda: evaluate(now, coord.snapshot(now), coord.hang).work, 5)),
        ("straggler inputs, 2,048 nodes: kept (nothing new)", per_call(lambda: coord.view.straggler_work(now), 5)),
        ("straggler inputs, 2,048 nodes: every node read again", per_call(read_all, 5)),
    ]
    work = coord.view.straggler_work(now)
    window = coord.stragglers.cfg.window
    last = min(w.completed for w in work)
    rows.append(("straggler windows lined up, 2,048 nodes (each detector run)",
                 per_call(lambda: recent_window(work, last, window), 5)))
    if args.served:
        us, rate = served(args.served, gated=not args.no_gate)
        rows.append((f"served{', no gate' if args.no_gate else ''}: server CPU per call ({rate:,.0f} calls/s)", us))
    width = max(len(name) for name, _ in rows)
    for name, us in rows:
        print(f"{name:<{width}}  {us:8.1f} µs")
    if args.profile:
        for what, fn, n in (("gate", wrapped, 20_000), ("Coordinator.sync", sync, 2_000)):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                fn()
            prof.disable()
            print(f"\n-- {what}, {n} calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def _noop() -> None:
    pass


if __name__ == "__main__":
    main()
