"""Agent ingestion over real gRPC: 8 rank clients, one long-lived stream each.

    python benchmarks/ingest.py [--seconds 10] [--total 50000000]

A real ``rankwatch agent`` process; 8 client processes stream 1,024-record
collective batches, pre-serialised so the clients cost little and the figure
is the agent's.  Reports: sustained records/s at full speed with the agent's
CPU, the agent's CPU at 100,000 records/s, and its RSS after ``--total``
records.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import AgentProcess  # noqa: E402

CLIENTS = 8
# Clients start fresh: a child forked from this process, which has used gRPC (the agent's
# status), can hang for good in its first channel (gRPC's threads do not survive a fork).
SPAWN = mp.get_context("spawn")
BATCH = 1024
REPORT = "/rankwatch.v1.Agent/Report"


def body() -> bytes:
    from rankwatch.proto import pb

    rng = np.random.default_rng(0)
    cols = pb.CollectiveColumns(
        op=rng.integers(0, 3, BATCH).astype("<u1").tobytes(), pg=np.zeros(BATCH, "<u2").tobytes(),
        seq=np.arange(BATCH, dtype="<i8").tobytes(), start=np.full(BATCH, 1.7e9, "<f8").tobytes(),
        duration=rng.exponential(1e-3, BATCH).astype("<f8").tobytes(),
        nbytes=np.full(BATCH, 1 << 20, "<i8").tobytes())
    return pb.ReportMessage(batch=pb.Batch(collectives=cols)).SerializeToString()


def paced_batches(rank: int, rate: float, stop_at: float) -> Iterator[bytes]:
    """One client's stream, serialised: its hello, then the shared body as fast as it goes, or
    at ``rate`` records/s, until ``stop_at`` (monotonic)."""
    from rankwatch.hooks.instrument.recorder import OPS
    from rankwatch.proto import pb

    yield pb.ReportMessage(hello=pb.Hello(rank=rank, world_size=CLIENTS, pid=mp.current_process().pid,
                                          op_names=list(OPS))).SerializeToString()
    payload = body()
    seq = 0
    t0 = time.monotonic()
    while time.monotonic() < stop_at:
        seq += 1
        # Concatenated encodings merge: this sets batch.seq on the shared body.
        yield pb.ReportMessage(batch=pb.Batch(seq=seq)).SerializeToString() + payload
        if rate:
            delay = t0 + seq * BATCH / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)


def client(addr: str, rank: int, rate: float, stop_at: float) -> None:
    import grpc

    with grpc.insecure_channel(addr) as ch:
        ch.stream_unary(REPORT)(paced_batches(rank, rate, stop_at))


def measure(agent: AgentProcess, client_process: Callable[[int, float], mp.Process], seconds: float,
            warmup: float = 3.0) -> tuple[float, float]:
    """Run ``CLIENTS`` client processes (``client_process(rank, stop_at)``); return (records/s at
    the agent, agent CPU as a fraction of one core) over ``seconds`` after ``warmup``."""
    proc = psutil.Process(agent.proc.pid)
    stop_at = time.monotonic() + seconds + warmup
    procs = [client_process(r, stop_at) for r in range(CLIENTS)]
    for p in procs:
        p.start()
    time.sleep(warmup)  # connect and warm up
    n0, c0, t0 = agent.status()["records_received"], _cpu(proc), time.monotonic()
    time.sleep(seconds - 0.5)
    n1, c1, t1 = agent.status()["records_received"], _cpu(proc), time.monotonic()
    for p in procs:
        p.join()
    return (n1 - n0) / (t1 - t0), (c1 - c0) / (t1 - t0)


def phase(agent: AgentProcess, seconds: float, rate_per_client: float) -> tuple[float, float]:
    """Run the clients; return (records/s at the agent, agent CPU as a fraction of one core)."""
    target = agent.addr.grpc_target()
    return measure(agent, lambda r, stop_at: SPAWN.Process(target=client, args=(target, r, rate_per_client, stop_at)),
                   seconds)


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--total", type=int, default=50_000_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentProcess(Path(tmp) / "agent.sock").start()
        try:
            rates = [phase(agent, args.seconds, 0) for _ in range(3)]
            rps = sorted(r for r, _ in rates)[1]
            cpu = sorted(c for _, c in rates)[1]
            print(f"| full speed, 8 clients | {rps:,.0f} records/s (median of 3) | agent CPU {cpu:.0%} of a core |")
            low = [phase(agent, args.seconds, 100_000 / CLIENTS) for _ in range(3)]
            print(f"| 100,000 records/s offered | {sorted(r for r, _ in low)[1]:,.0f} records/s | "
                  f"agent CPU {sorted(c for _, c in low)[1]:.1%} of a core |")
            while agent.status()["records_received"] < args.total:
                phase(agent, 10, 0)
            rss = psutil.Process(agent.proc.pid).memory_info().rss
            print(f"| after {agent.status()['records_received']:,} records | agent RSS {rss / 2**20:.0f} MiB |")
        finally:
            agent.stop()


if __name__ == "__main__":
    main()
