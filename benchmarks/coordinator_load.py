"""Load on one coordinator: a real ``rankwatch agent`` driven by simulated node agents over TCP.

Each simulated node syncs as ``JobLink`` does: a ``NodeSummary`` of its ranks
(progress, group sequence numbers, own-work windows, shaped like
``Agent.summary()``), at the interval the coordinator's last reply asked for
(0.25 s to start).  All of them run in one asyncio process (``grpc.aio``, a few
channels), which stands in for the nodes' agents.

Faults, each at ``--fault-at`` seconds:

* ``--stall N``: the job hangs, node N's ranks one collective behind the others
  (which wait in an all_reduce); time until the coordinator names a rank of
  node N in a ``hang`` incident;
* ``--silence N``: node N stops syncing (its agent died); time until node N is
  excluded;
* ``--slow N``: node N's ranks do 25 % more own work from the start; whether the
  coordinator flags node N;
* ``--pause S``: the coordinator's process is SIGSTOPped for S seconds (a long GC
  pause, a starved VM): no healthy node may be excluded for it.

Reported: syncs done (and asked for at 4 Hz), Sync latency p50/p99, failures
by status code, exclusions of healthy nodes, the coordinator's CPU (cores) and
RSS, the load generator's own CPU, and the sync interval the coordinator asked
for at the end.

    python benchmarks/coordinator_load.py --nodes 2048 --seconds 60 --stall 7 --fault-at 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import psutil

from rankwatch.agent.incidents import Incident, IncidentLog
from rankwatch.agent.load_policy import LoadConfig, first_sync_delay
from rankwatch.agent.ports import free_port
from rankwatch.agent.statedir import read_decisions
from rankwatch.proto import pb, pb_grpc

WINDOW = 16      # own-work window per rank, as the node agent sends it
STEP = 0.1       # simulated seconds per step
RPC_TIMEOUT = 1.0
TOKEN = "load-test-token"


def _incidents(state: Path) -> list[Incident]:
    path = state / "incidents.jsonl"
    return IncidentLog.replay(path) if path.exists() else []


def _exclusions(state: Path) -> list[dict]:
    """The coordinator's ``exclude`` decisions, from its ``decisions.jsonl``."""
    return [d for d in read_decisions(state / "decisions.jsonl") if d["kind"] == "exclude"]


class SimNode:
    """One node's agent: 8 ranks that step every ``STEP`` seconds until a fault."""

    def __init__(self, index: int, ranks: int, slow: bool, born: float) -> None:
        self.name = f"sim{index:05d}"
        self.index, self.ranks, self.slow, self.born = index, ranks, slow, born
        self.seq = 0
        self.interval = 0.25
        self.stalled_at: float | None = None
        self.behind = False
        self.silent = False
        self.pids = [10_000_000 + index * 64 + r for r in range(ranks)]

    def summary(self, now: float) -> pb.NodeSummary:
        self.seq += 1
        t = min(now, self.stalled_at) if self.stalled_at is not None else now
        step = int((t - self.born) / STEP)
        out = pb.NodeSummary(node_id=self.name, seq=self.seq, sent_at=now, run_id="load")
        own = 0.08 * (1.25 if self.slow else 1.0)
        for r in range(self.ranks):
            rank = self.index * self.ranks + r
            seq = 3 * step + (0 if self.behind else 1 if self.stalled_at is not None else 0)
            rs = pb.RankSummary(
                rank=rank, pid=self.pids[r], step=step, step_seconds=STEP, steps_completed=step,
                activity="train", progress_at=t, last_seen=now, connected=True, alive=True,
                group_seqs={"0": seq, "1": step, "2": step}, local_rank=r, state="ok",
                own_work=[own + random.random() * 1e-3 for _ in range(WINDOW)],
                data_wait=[1e-3] * WINDOW, comm_wait=[0.02] * WINDOW, tokens_per_second=4096.0)
            if self.stalled_at is not None and not self.behind:
                rs.inflight.CopyFrom(pb.InFlight(op="all_reduce", group="0", seq=seq, since=self.stalled_at))
            out.ranks.append(rs)
        return out


async def _drive(node: SimNode, stubs: list, end: float, lat: list, fails: dict, failed_at: list,
                 done: list) -> None:
    # The first sync comes when a node agent's would (JobLink: spread over the first seconds).
    await asyncio.sleep(first_sync_delay(random.random(), False, LoadConfig()))
    while time.time() < end:
        if not node.silent:
            t0 = time.perf_counter()
            try:
                t_sent = time.time()
                reply = await stubs[node.index % len(stubs)].Sync(node.summary(time.time()), timeout=RPC_TIMEOUT,
                                                                  metadata=(("authorization", f"Bearer {TOKEN}"),))
                lat.append((t_sent, time.perf_counter() - t0))
                done[0] += 1
                asked = getattr(reply, "sync_interval_seconds", 0.0)   # a coordinator before backpressure
                if asked > 0:
                    node.interval = min(5.0, max(0.25, asked))
            except grpc.aio.AioRpcError as exc:
                fails[exc.code().name] = fails.get(exc.code().name, 0) + 1
                failed_at.append(time.time())
        await asyncio.sleep(node.interval)


def _start_coordinator(tmp: Path, port: int) -> subprocess.Popen:
    addr = f"127.0.0.1:{port}"
    env = dict(os.environ)
    return subprocess.Popen(
        [sys.executable, "-m", "rankwatch.agent.cli", "agent", "--node-id", "coord", "--listen", addr,
         "--listen", f"unix:{tmp / 'coord.sock'}", "--coordinator", addr, "--metrics-port", "0",
         "--state-dir", str(tmp / "state"), "--gpu-source", "none"],
        env={**env, "RANKWATCH_TOKEN": TOKEN},   # as a job runs it: every node holds the token
        stdout=open(tmp / "coord.log", "w"), stderr=subprocess.STDOUT)


def _wait_serving(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"coordinator exited with {proc.returncode}")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                grpc.channel_ready_future(ch).result(timeout=0.5)
                return
            except grpc.FutureTimeoutError:
                continue
    raise TimeoutError("coordinator did not start")


async def _run(args: argparse.Namespace, port: int, state: Path, proc: psutil.Process) -> dict:
    born = time.time() - 30.0
    nodes = [SimNode(i, args.ranks, slow=i == args.slow, born=born) for i in range(args.nodes)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                          options=[("grpc.max_receive_message_length", 64 << 20)])
                for _ in range(args.channels)]
    stubs = [pb_grpc.AgentStub(ch) for ch in channels]
    lat: list[float] = []
    fails: dict[str, int] = {}
    failed_at: list[float] = []
    done = [0]
    start = time.time()
    end = start + args.seconds
    me = psutil.Process()
    cpu0, me0 = proc.cpu_times(), me.cpu_times()
    tasks = [asyncio.create_task(_drive(n, stubs, end, lat, fails, failed_at, done)) for n in nodes]
    fault = {}
    fault_at = start + args.fault_at
    named = silenced = None
    while time.time() < end:
        await asyncio.sleep(0.1)
        now = time.time()
        if now >= fault_at and not fault:
            fault = {"at": now}
            if args.stall is not None:
                for n in nodes:
                    n.stalled_at = now
                nodes[args.stall].behind = True
            if args.silence is not None:
                nodes[args.silence].silent = True
            if args.pause:
                proc.suspend()
                await asyncio.sleep(args.pause)
                proc.resume()
        if fault and args.stall is not None and named is None:
            hangs = [i for i in _incidents(state) if i.kind == "hang"]
            if hangs:
                named = {"seconds": round(hangs[0].detected_at - fault["at"], 2), "node": hangs[0].node,
                         "rank": hangs[0].rank}
        if fault and args.silence is not None and silenced is None:
            gone = [d for d in _exclusions(state) if d["node"] == nodes[args.silence].name]
            if gone:
                silenced = round(gone[0]["decided_at"] - fault["at"], 2)
    await asyncio.gather(*tasks)
    wall = time.time() - start
    cpu1, me1 = proc.cpu_times(), me.cpu_times()
    for ch in channels:
        await ch.close()
    steady = sorted(d for t, d in lat if t >= start + args.warmup)
    lat = sorted(d for _, d in lat)
    expected = {nodes[i].name for i in (args.silence, args.stall) if i is not None}
    excluded = [d["node"] for d in _exclusions(state)]
    flagged = sorted({i.node for i in _incidents(state) if i.kind == "straggler"})
    return {
        "nodes": args.nodes, "ranks": args.nodes * args.ranks, "seconds": round(wall, 1),
        "syncs_per_second": round(done[0] / wall, 1), "asked_at_4hz": args.nodes * 4,
        "sync_p50_ms": round(1e3 * lat[len(lat) // 2], 1) if lat else None,
        "sync_p99_ms": round(1e3 * lat[int(len(lat) * 0.99)], 1) if lat else None,
        "steady_p50_ms": round(1e3 * steady[len(steady) // 2], 1) if steady else None,
        "steady_p99_ms": round(1e3 * steady[int(len(steady) * 0.99)], 1) if steady else None,
        "failed": sum(fails.values()), "failed_by_code": fails,
        "failures_between_s": [round(min(failed_at) - start, 1), round(max(failed_at) - start, 1)] if failed_at else None,
        "healthy_excluded": [n for n in excluded if n not in expected],
        "coordinator_cores": round((sum(cpu1[:2]) - sum(cpu0[:2])) / wall, 2),
        "coordinator_rss_mb": round(proc.memory_info().rss / 2**20),
        "generator_cores": round((sum(me1[:2]) - sum(me0[:2])) / wall, 2),
        "final_interval_s": round(max(n.interval for n in nodes), 2),
        "hang_named": named, "silent_excluded_after_s": silenced,
        "straggler_nodes_flagged": flagged,
    }


def status_seconds(sock: Path, *flags: str) -> tuple[float, int]:
    """Seconds and bytes of ``rankwatch status --json`` (the CLI, as a user runs it)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "status", "--json", "--agent",
                          f"unix:{sock}", *flags], capture_output=True, check=True, timeout=60).stdout
    return round(time.perf_counter() - t0, 2), len(out)


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="rw-load-") as d:
        tmp = Path(args.keep) if args.keep else Path(d)
        tmp.mkdir(parents=True, exist_ok=True)
        port = free_port()
        coord = _start_coordinator(tmp, port)
        try:
            _wait_serving(port, coord)
            result = asyncio.run(_run(args, port, tmp / "state", psutil.Process(coord.pid)))
            # The default (summarised past 1,024 ranks) and the full view.
            result["status_json_seconds"], result["status_json_bytes"] = status_seconds(tmp / "coord.sock")
            result["status_all_ranks_seconds"], result["status_all_ranks_bytes"] = status_seconds(
                tmp / "coord.sock", "--all-ranks")
            return result
        finally:
            coord.terminate()
            try:
                coord.wait(10)
            except subprocess.TimeoutExpired:
                coord.kill()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--ranks", type=int, default=8, help="ranks per node")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--channels", type=int, default=16, help="client channels the nodes share")
    p.add_argument("--fault-at", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=10.0, help="seconds left out of the steady p50/p99")
    p.add_argument("--stall", type=int, help="node whose ranks fall behind when the job hangs")
    p.add_argument("--silence", type=int, help="node whose agent stops syncing")
    p.add_argument("--slow", type=int, help="node whose ranks do 25%% more own work")
    p.add_argument("--keep", help="keep the coordinator's log and state in this folder")
    p.add_argument("--pause", type=float, default=0.0, help="SIGSTOP the coordinator this long")
    return p


if __name__ == "__main__":
    print(json.dumps(run(parser().parse_args()), indent=1))
