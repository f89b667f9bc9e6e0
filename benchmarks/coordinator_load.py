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

Relays (``agent/relays/routing.py``): the coordinator groups the nodes behind relays in
a job of ``--relay-min-nodes`` or more (its defaults: 64 per group from 128 nodes;
``--relay-group 0`` turns them off).  Each simulated node offers an address to relay
on, and follows the coordinator's replies exactly as ``JobLink`` does: a node sent to
a relay hands its summary to that relay, and a relay holding summaries sends them on
in one ``SyncGroup`` call.  The relays are the agent's own ``Relay`` objects, run in
this process (on a cluster each runs on its own node; here 32 relay processes would
only share the same two cores).  ``--relay-process``: node 0 is a real ``rankwatch
agent`` process instead (no ranks of its own), started first so that the coordinator
puts it at the head of the first group; the nodes the coordinator sends to it sync
with it over gRPC, as ``JobLink`` does, and their calls' latency is what a node sees
through a relay (``Sync via a relay process``).

Reported: node summaries the coordinator took (directly or in a relay's group; asked for
at 4 Hz; a relay sends on only a node's latest, so two of its syncs between the relay's
calls count once) and, in the steady window, the node syncs answered (by a relay or the
coordinator: the rate the nodes sync at), latency
p50/p99 of the calls the coordinator served (``Sync`` and ``SyncGroup`` apart),
failures by status code and by call, exclusions of healthy nodes, the coordinator's CPU (cores)
and RSS, the load generator's own CPU, and the sync interval the coordinator asked
for at the end.

    python benchmarks/coordinator_load.py --nodes 2048 --seconds 60 --stall 7 --fault-at 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import psutil

from rankwatch.agent.wire import windows as work_windows
from rankwatch.agent.durable.incidents import Incident, IncidentLog
from rankwatch.agent.job.pacing import LoadConfig, first_sync_delay, retry_delay, silence_allowance
from rankwatch.agent.job.policy import PolicyConfig
from rankwatch.agent.cli.ports import free_port
from rankwatch.agent.relays.relay import Relay, RelayBusy, RelayUnavailable
from rankwatch.agent.relays.routing import RelayConfig
from rankwatch.agent.node.rankrecord import WORK_WINDOW
from rankwatch.agent.durable.statedir import read_decisions
from rankwatch.proto import pb, pb_grpc

WINDOW = WORK_WINDOW   # own-work window per rank, as the node agent sends it (64 steps)
STEP = 0.1       # simulated seconds per step (--step-seconds)
RPC_TIMEOUT = 1.0
TOKEN = "load-test-token"
BACKOFF = True   # --no-backoff: retry at the interval after a busy failure (as before load_policy.retry_delay)
REPEATED_WINDOWS = False   # --repeated-windows: each rank's windows as repeated doubles (an older agent's form)
RELAY_KEEPS_ON = True   # --relay-refuses-when-busy: a relay whose call failed busy refuses its nodes at once
_BUSY = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)
VIA_PROCESS = "Sync via a relay process"
RELAY_HOLDS_WHILE_ASKING = True   # --relay-refuses-while-asking: a call in flight is not busy (as before)
JOB_NODES = 0   # the job's size as each agent knows it (--job-nodes); 0 with --job-size-unknown
RELAY_WORD = True   # --relays-silent-on-absence: relays name no unheard member (as before)
PART_GAP = 1.5   # seconds between generator processes' nodes joining (--processes)
SYNC_AT_RATE = True   # --interval-after-sync: the next sync an interval after the last ended (as before)


def _incidents(state: Path) -> list[Incident]:
    path = state / "incidents.jsonl"
    return IncidentLog.replay(path) if path.exists() else []


def _exclusions(state: Path) -> list[dict]:
    """The coordinator's ``exclude`` decisions, from its ``decisions.jsonl``."""
    return [d for d in read_decisions(state / "decisions.jsonl") if d["kind"] == "exclude"]


class SimNode:
    """One node's agent: 8 ranks that step every ``STEP`` seconds until a fault."""

    def __init__(self, index: int, ranks: int, slow: bool, born: float, relay_cfg: RelayConfig | None = None) -> None:
        self.name = f"sim{index:05d}"
        self.index, self.ranks, self.slow, self.born = index, ranks, slow, born
        self.address = f"10.{index >> 16 & 255}.{index >> 8 & 255}.{index & 255}:9479"   # never dialled
        self.relay = Relay(self.address, cfg=relay_cfg)   # this node as its group's relay, as its agent would be
        self.relay_addr = ""               # where the coordinator told it to sync
        self.home_relay = ""               # the relay the coordinator's last reply named
        self.seq = 0
        self.interval = 0.25
        self.refused_by_relay = False   # its relay refused its last sync
        self.answered = False   # the coordinator answered it once
        self.last_ok = 0.0   # when a sync of its last succeeded (a relay's answer included)
        self.busy_failures = 0   # as JobLink's: syncs in a row a busy coordinator did not answer
        self.stalled_at: float | None = None
        self.behind = False
        self.silent = False
        self.pids = [10_000_000 + index * 64 + r for r in range(ranks)]
        self._built: tuple | None = None   # (step, stalled, behind) the ranks show
        own = 0.8 * STEP * (1.25 if slow else 1.0)
        self._ranks = [pb.RankSummary(
            rank=index * ranks + r, pid=self.pids[r], step_seconds=STEP, activity="train", connected=True,
            alive=True, local_rank=r, state="ok", tokens_per_second=4096.0) for r in range(ranks)]
        for rs in self._ranks:   # the windows as the node agent sends them (--repeated-windows: as before)
            windows = ([own + random.random() * 1e-3 for _ in range(WINDOW)], [1e-3] * WINDOW, [0.2 * STEP] * WINDOW)
            if REPEATED_WINDOWS:
                rs.own_work[:], rs.data_wait[:], rs.comm_wait[:] = windows
            else:
                rs.work = work_windows.pack(*windows)
        self.own()

    def summary(self, now: float) -> pb.NodeSummary:
        self.seq += 1
        t = min(now, self.stalled_at) if self.stalled_at is not None else now
        step = int((t - self.born) / STEP)
        key = (step, self.stalled_at, self.behind)
        if key != self._built:   # a new step: set its fields in place (rebuilding costs the generator)
            self._built = key
            seq = 3 * step + (0 if self.behind else 1 if self.stalled_at is not None else 0)
            for rs in self._ranks:
                rs.step = rs.steps_completed = step
                rs.progress_at = t
                seqs = rs.group_seqs
                seqs["0"], seqs["1"], seqs["2"] = seq, step, step
                if self.stalled_at is not None and not self.behind:
                    rs.inflight.CopyFrom(pb.InFlight(op="all_reduce", group="0", seq=seq, since=self.stalled_at))
        for rs in self._ranks:
            rs.last_seen = now
        out = self._out
        out.seq, out.sent_at = self.seq, now
        return out

    def own(self) -> None:
        """The summary last given out may be kept elsewhere (a relay that refused its node
        may hold an older one): the next is a new message.  Else it is the same one, changed
        in place: a relay reads it only when it takes it or sends it on, both at once after
        :meth:`summary`, so what it holds is what the node last gave it (a copy of 13 KB per
        sync would cost the generator as much as the relay's own work)."""
        self._out = pb.NodeSummary(node_id=self.name, run_id="load", relay_address=self.address)
        self._out.ranks.extend(self._ranks)
        self._ranks = list(self._out.ranks)

    def apply(self, interval: float, relay: str) -> None:
        if interval > 0:
            self.interval = min(5.0, max(0.25, interval))
        self.relay_addr = self.home_relay = relay if relay != self.address else ""


class Stats:
    """What the nodes saw: latencies of the coordinator's calls by kind, failures, syncs done."""

    def __init__(self) -> None:
        self.lat: dict[str, list[tuple[float, float]]] = {"Sync": [], "SyncGroup": [], VIA_PROCESS: []}
        self.steady_parts: list[list] = []   # the other generator processes' ``steady``
        self.behind_process: set[str] = set()   # nodes that synced through the relay process
        self.fails: dict[str, int] = {}
        self.fails_by_call: dict[str, int] = {}
        self.node_fails: dict[str, list[float]] = {}   # node -> when each of its syncs failed
        self.lags: list[tuple[float, float]] = []   # (when, how late the generator's own loop woke)
        self.failed_at: list[float] = []
        self.held = 0   # node syncs a busy relay held for its next call (the node backed off)
        self.direct: dict[str, int] = {}   # direct Syncs, by why the node went to the coordinator
        self.sent_at: list[float] = []   # when each call to the coordinator (Sync, SyncGroup) began
        self.cpu: list[tuple[float, float, float]] = []   # (when, coordinator CPU s, generator CPU s)
        self.done = 0         # node summaries the coordinator took, directly or in a group
        self.relayed = 0      # of those, through a relay
        self.beats = 0        # of those, beats (the node's last whole summary stands)
        self.answered = 0     # node syncs answered: by a relay from its last reply, by the coordinator,
        #                       or a relay's own in its SyncGroup (a relay sends on a node's latest only)
        self.steady: list[tuple[float, int, int]] = []   # (when, done, answered) at the steady window's ends
        self.cores = 0.0      # this generator process's CPU over its run (cores)
        self.relays_used = 0  # relays that sent summaries of other nodes on
        self.relays_silenced = 0   # of those, relays the fault silenced (a member took each group over)
        self.final_interval = 0.0   # the longest sync interval a node was asked for at the end

    _KEEP = ("lat", "behind_process", "fails", "fails_by_call", "node_fails", "lags", "failed_at", "held",
             "direct", "sent_at", "done", "relayed", "beats", "answered", "steady", "cores", "relays_used",
             "relays_silenced", "final_interval")

    def to_json(self) -> dict:
        """What a generator process found, for the first to add to its own (:meth:`add`)."""
        out = {k: getattr(self, k) for k in self._KEEP}
        out["behind_process"] = sorted(self.behind_process)
        return out

    def add(self, other: dict) -> None:
        """Another generator process's :meth:`to_json`, added to this one's."""
        for kind, samples in other["lat"].items():
            self.lat.setdefault(kind, []).extend(tuple(x) for x in samples)
        self.behind_process.update(other["behind_process"])
        for name in ("fails", "fails_by_call", "direct"):
            mine = getattr(self, name)
            for k, v in other[name].items():
                mine[k] = mine.get(k, 0) + v
        for node, times in other["node_fails"].items():
            self.node_fails.setdefault(node, []).extend(times)
        self.lags.extend(tuple(x) for x in other["lags"])
        self.failed_at.extend(other["failed_at"])
        self.sent_at.extend(other["sent_at"])
        for name in ("held", "done", "relayed", "beats", "answered", "cores", "relays_used", "relays_silenced"):
            setattr(self, name, getattr(self, name) + other[name])
        self.final_interval = max(self.final_interval, other["final_interval"])
        self.steady_parts.append(other["steady"])

    def steady_rate(self) -> tuple[float, float] | None:
        """(summaries taken, node syncs answered) a second over the steady window, every
        generator process's summed."""
        parts = [p for p in [self.steady, *self.steady_parts] if len(p) == 2 and p[1][0] > p[0][0]]
        if not parts:
            return None
        return (sum((b[1] - a[1]) / (b[0] - a[0]) for a, b in parts),
                sum((b[2] - a[2]) / (b[0] - a[0]) for a, b in parts))

    def failed(self, exc: grpc.aio.AioRpcError, node: SimNode, call: str) -> None:
        self.fails[exc.code().name] = self.fails.get(exc.code().name, 0) + 1
        self.fails_by_call[call] = self.fails_by_call.get(call, 0) + 1
        self.node_fails.setdefault(node.name, []).append(time.time())
        self.failed_at.append(time.time())
        busy = exc.code() in _BUSY
        node.busy_failures = node.busy_failures + 1 if busy and BACKOFF else 0


class Ticker:
    """``asyncio.sleep`` for thousands of nodes, woken together in slots of ``slot`` seconds:
    one timer per slot instead of one per node's sync (8,192 a second at 2,048 nodes cost the
    generator a tenth of its core)."""

    def __init__(self, slot: float = 0.005) -> None:
        self.slot = slot
        self._waiting: dict[int, asyncio.Future] = {}

    async def sleep(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        slot = math.ceil((loop.time() + max(0.0, delay)) / self.slot)
        fut = self._waiting.get(slot)
        if fut is None:
            fut = self._waiting[slot] = loop.create_future()
            loop.call_at(slot * self.slot, self._wake, slot)
        await fut

    def _wake(self, slot: int) -> None:
        self._waiting.pop(slot).set_result(None)


async def _drive(node: SimNode, by_addr: dict[str, SimNode], stubs: list, end: float, stats: Stats,
                 process: tuple[str, object] | None, ticker: Ticker, part: tuple[int, int] = (0, 1)) -> None:
    # The first sync comes when a node agent's would (JobLink: spread over the first seconds).
    # (the job's size known to every agent, unless --job-size-unknown, as a node's --job-nodes)
    # With --processes, the k-th of N generator processes draws from the k-th N-th of that
    # spread, PART_GAP s later than the one before: each process's nodes join after the
    # last one's are grouped, so the coordinator groups them behind relays of their own process
    # (a node it sends to another process's relay syncs directly: see direct_syncs_by_why).
    k, of = part
    await asyncio.sleep(first_sync_delay((k + random.random()) / of, False, LoadConfig(), JOB_NODES) + k * PART_GAP)
    md = (("authorization", f"Bearer {TOKEN}"),)
    stub = stubs[node.index % len(stubs)]
    cfg, timeout = LoadConfig(), PolicyConfig().node_timeout_seconds
    while time.time() < end:
        began = time.monotonic()
        if not node.silent:
            await _sync_once(node, by_addr, stub, md, stats, process)
        allowance = silence_allowance(node.interval, timeout, cfg)
        delay = retry_delay(node.busy_failures, node.interval, random.random(), cfg, allowance,
                            time.monotonic() - began if SYNC_AT_RATE else 0.0)
        woke = time.monotonic() + delay
        await ticker.sleep(delay)
        node.relay.woke_late(time.monotonic() - woke)   # as the agent's loop tells its relay


async def _sync_once(node: SimNode, by_addr: dict[str, SimNode], stub, md, stats: Stats,
                     process: tuple[str, object] | None) -> None:
    """One sync, as ``JobLink.sync_once``: as a relay, through a relay, or directly.
    ``process``: (address, stub) of the relay agent process, if one runs."""
    summary = node.summary(time.time())
    if node.relay.pending():
        group = node.relay.group(summary)
        if not RELAY_HOLDS_WHILE_ASKING:   # --relay-refuses-while-asking: as before (a private poke)
            node.relay._asking = False
        if not RELAY_WORD:
            del group.absent[:]
        t_sent, t0 = time.time(), time.perf_counter()
        stats.sent_at.append(t_sent)
        try:
            reply = await stub.SyncGroup(group, timeout=RPC_TIMEOUT, metadata=md)
        except grpc.aio.AioRpcError as exc:
            stats.failed(exc, node, "SyncGroup")
            node.relay.unanswered(group, busy=RELAY_KEEPS_ON and exc.code() in _BUSY)   # as JobLink
            return
        stats.lat["SyncGroup"].append((t_sent, time.perf_counter() - t0))
        node.busy_failures = 0
        node.last_ok = time.time()
        node.relay.answered(reply)
        stats.answered += 1
        taken = len(group.nodes) + len(group.beats) - len(reply.refused)
        stats.done += taken
        stats.relayed += taken - 1
        stats.beats += len(group.beats)
        node.apply(reply.sync_interval_seconds, reply.relays.get(node.name, ""))
        return
    relay = by_addr.get(node.relay_addr)
    if relay is not None and not relay.silent:
        try:
            got = relay.relay.take(summary)
            stats.answered += 1
            node.apply(got.sync_interval_seconds, got.relay)
            node.last_ok = time.time()
            node.busy_failures = 0
            return
        except RelayBusy:   # held for the relay's next call: back off and stay (as JobLink, bounded)
            if time.time() - node.last_ok < node.relay.cfg.busy_hold_seconds:
                stats.held += 1
                node.busy_failures += 1
                return
            node.relay_addr = ""
            node.refused_by_relay = True
        except RelayUnavailable:
            node.relay_addr = ""   # to the coordinator, at once
            node.refused_by_relay = True
    node.own()   # sent over gRPC: a relay that refused it may still hold this one
    if process is not None and node.relay_addr == process[0]:
        t_sent, t0 = time.time(), time.perf_counter()
        try:
            reply = await process[1].Sync(summary, timeout=RPC_TIMEOUT, metadata=md)  # type: ignore[attr-defined]
        except grpc.aio.AioRpcError as exc:
            if (exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    and time.time() - node.last_ok < node.relay.cfg.busy_hold_seconds):
                stats.held += 1   # the relay process holds it: back off and stay (as JobLink)
                node.busy_failures += 1
                return
            stats.failed(exc, node, VIA_PROCESS)
            node.relay_addr = ""   # the relay failed: the coordinator, at once (as JobLink)
        else:
            stats.lat[VIA_PROCESS].append((t_sent, time.perf_counter() - t0))
            stats.behind_process.add(node.name)
            node.busy_failures = 0
            node.last_ok = time.time()
            stats.done += 1   # handed on: the relay process's own SyncGroup calls carry it
            stats.relayed += 1
            stats.answered += 1
            node.apply(reply.sync_interval_seconds, reply.relay)
            return
    t_sent, t0 = time.time(), time.perf_counter()
    stats.sent_at.append(t_sent)
    why = ("relay refused" if node.refused_by_relay else "not placed yet" if not node.answered
           else "relay in another generator process" if node.relay_addr and relay is None else "placed, none")
    stats.direct[why] = stats.direct.get(why, 0) + 1
    node.refused_by_relay = False
    try:
        reply = await stub.Sync(summary, timeout=RPC_TIMEOUT, metadata=md)
    except grpc.aio.AioRpcError as exc:
        stats.failed(exc, node, "Sync")
        node.relay.unanswered(None, busy=RELAY_KEEPS_ON and exc.code() in _BUSY)   # as JobLink
        node.relay_addr = node.home_relay   # its relay again next time (as JobLink)
        return
    stats.lat["Sync"].append((t_sent, time.perf_counter() - t0))
    node.answered = True
    node.last_ok = time.time()
    node.busy_failures = 0
    stats.done += 1
    stats.answered += 1
    node.relay.answered_directly(reply)
    node.apply(reply.sync_interval_seconds, reply.relay)


def _start_agent(tmp: Path, name: str, port: int, coordinator: int, *extra: str) -> subprocess.Popen:
    """A real ``rankwatch agent`` named ``name``, serving TCP on ``port`` and ``tmp/<name>.sock``,
    syncing with the coordinator on ``coordinator``; its log in ``tmp/<name>.log``."""
    return subprocess.Popen(
        [sys.executable, "-m", "rankwatch.agent.cli", "agent", "--node-id", name,
         "--listen", f"127.0.0.1:{port}", "--listen", f"unix:{tmp / f'{name}.sock'}",
         "--coordinator", f"127.0.0.1:{coordinator}", "--gpu-source", "none", *extra],
        env={**os.environ, "RANKWATCH_TOKEN": TOKEN},   # as a job runs it: every node holds the token
        stdout=open(tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT)


def _start_coordinator(tmp: Path, port: int, relay_args: list[str]) -> subprocess.Popen:
    return _start_agent(tmp, "coord", port, port, "--metrics-port", "0", "--state-dir", str(tmp / "state"),
                        *relay_args)


def _start_relay(tmp: Path, port: int, relay_port: int, metrics_port: int, whole: list[str]) -> subprocess.Popen:
    """Node 0's agent as a real process: it syncs with the coordinator and relays on TCP
    (``whole``: its ``--relay-whole-every-*`` flags)."""
    return _start_agent(tmp, "sim00000", relay_port, port, "--metrics-port", str(metrics_port),
                        "--state-dir", str(tmp / "relay-state"), *whole)


def _coordinator_knows(sock: Path, node: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "status", "--json", "--agent",
                          f"unix:{sock}"], capture_output=True, timeout=30)
    return out.returncode == 0 and node in json.loads(out.stdout).get("nodes", {})


def _relayed_by(metrics_port: int) -> float:
    """The summaries the relay process sent on (its ``rankwatch_relayed_summaries_total``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("rankwatch_relayed_summaries_total"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_serving(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the agent on port {port} exited with {proc.returncode}")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                grpc.channel_ready_future(ch).result(timeout=0.5)
                return
            except grpc.FutureTimeoutError:
                continue
    raise TimeoutError(f"the agent on port {port} did not start")


async def _simulate(args: argparse.Namespace, port: int, part: int, born: float, start: float,
                    process: tuple[str, object] | None = None, stats: Stats | None = None,
                    on_tick: Callable[[float], Awaitable[None]] | None = None,
                    coordinator_cpu: Callable[[], float] = lambda: 0.0) -> Stats:
    """Generator process ``part`` of ``args.processes``: its share of the nodes (and their
    relays), syncing from ``start`` for ``args.seconds``, faults at ``args.fault_at``;
    ``process``: (address, stub) of the relay agent process (the first part only);
    ``on_tick(now)``: the first part's own checks, every 0.1 s."""
    relay_cfg = RelayConfig(whole_every_seconds=args.relay_whole_every_seconds,
                            whole_every_intervals=args.relay_whole_every_intervals,
                            whole_every_steps=args.relay_whole_every_steps,
                            long_wait_spread_seconds=args.relay_long_wait_spread_seconds,
                            busy_hold_seconds=args.relay_busy_hold_seconds)
    lo, hi = part * args.nodes // args.processes, (part + 1) * args.nodes // args.processes
    nodes = [SimNode(i, args.ranks, slow=i == args.slow, born=born, relay_cfg=relay_cfg) for i in range(lo, hi)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                          options=[("grpc.max_receive_message_length", 64 << 20)])
                for _ in range(args.channels)]
    stubs = [pb_grpc.AgentStub(ch) for ch in channels]
    by_addr = {n.address: n for n in nodes}
    if process is not None:   # node 0 is the relay process: its own agent syncs it
        nodes[0].silent = True
    stats = stats or Stats()
    end, fault_at = start + args.seconds, start + args.fault_at
    me = psutil.Process()
    ticker = Ticker()
    await asyncio.sleep(max(0.0, start - time.time()))
    me0 = sum(me.cpu_times()[:2])
    tasks = [asyncio.create_task(_drive(n, by_addr, stubs, end, stats, process, ticker, (part, args.processes)))
             for n in nodes if process is None or n.index != 0]
    faulted = False
    while time.time() < end:
        slept = time.time()
        await asyncio.sleep(0.1)
        now = time.time()
        stats.lags.append((now, now - slept - 0.1))
        if now - slept - 0.1 > 1.0:   # as an agent's loop tells its relay when it woke late
            for n in nodes:
                n.relay.woke_late(now - slept - 0.1)
        stats.cpu.append((now, coordinator_cpu(), sum(me.cpu_times()[:2])))
        if not stats.steady and now >= start + args.warmup:
            stats.steady = [(now, stats.done, stats.answered)]
        if now >= fault_at and not faulted:
            faulted = True
            for n in nodes:
                if args.stall is not None:   # every rank of the job stops at once
                    n.stalled_at = fault_at
                    n.behind = n.index == args.stall
                if n.index == args.silence:
                    n.silent = True
                    stats.relays_silenced += bool(n.relay.relayed)
            if getattr(args, "silence_relay", False) and part == 0:   # the relay with the most members
                victim = max(nodes, key=lambda n: len(n.relay._members))
                victim.silent = True
                stats.relays_silenced += bool(victim.relay.relayed)
                args.silence = victim.index   # (this process runs the checks: it names the node)
        if on_tick is not None:
            await on_tick(now)
    stats.steady.append((time.time(), stats.done, stats.answered))
    await asyncio.gather(*tasks)
    stats.cores = (sum(me.cpu_times()[:2]) - me0) / (time.time() - start)
    stats.relays_used = sum(1 for n in nodes if n.relay.relayed)
    stats.final_interval = max(n.interval for n in nodes)
    for ch in channels:
        await ch.close()
    return stats


def _worker(spec: dict) -> dict:
    """A generator process other than the first: its stats, as JSON (``--worker``)."""
    args = argparse.Namespace(**spec["args"])
    _configure(args)
    return asyncio.run(_simulate(args, spec["port"], spec["part"], spec["born"], spec["start"])).to_json()


def _start_workers(args: argparse.Namespace, port: int, born: float, start: float) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(
        {"args": vars(args), "port": port, "part": part, "born": born, "start": start})],
        stdout=subprocess.PIPE, text=True) for part in range(1, args.processes)]


async def _run(args: argparse.Namespace, port: int, state: Path, proc: psutil.Process,
               relay: tuple[str, psutil.Process] | None = None) -> dict:
    born = time.time() - 30.0
    # The other generator processes start at the same planned time (they take a second to start).
    start = time.time() + (2.0 if args.processes > 1 else 0.0)
    workers = _start_workers(args, port, born, start)
    process = channel = None
    if relay is not None:
        channel = grpc.aio.insecure_channel(relay[0])
        process = (relay[0], pb_grpc.AgentStub(channel))
        relay_cpu0 = sum(relay[1].cpu_times()[:2])
    end = start + args.seconds
    fault_at = start + args.fault_at
    fault = {"at": fault_at}
    named = silenced = None
    paused = False
    coordinator_cpu: list[tuple[float, float]] = []   # (when, the coordinator's CPU s) at the steady window's ends
    await asyncio.sleep(max(0.0, start - time.time()))
    cpu0 = proc.cpu_times()

    async def tick(now: float) -> None:
        nonlocal named, silenced, paused
        if not coordinator_cpu and now >= start + args.warmup:
            coordinator_cpu.append((now, sum(proc.cpu_times()[:2])))
        if now >= fault_at and args.pause and not paused:
            paused = True
            proc.suspend()
            await asyncio.sleep(args.pause)
            proc.resume()
        if now >= fault_at and args.stall is not None and named is None:
            hangs = [i for i in _incidents(state) if i.kind == "hang"]
            if hangs:
                named = {"seconds": round(hangs[0].detected_at - fault["at"], 2), "node": hangs[0].node,
                         "rank": hangs[0].rank, "reason": str(hangs[0].detail.get("reason", ""))[:200],
                         "silent_ranks": (len(hangs[0].detail["silent_ranks"])   # None: cut from a big incident
                                          if hangs[0].detail.get("silent_ranks") is not None else None)}
        if now >= fault_at and args.silence is not None and silenced is None:
            gone = [d for d in _exclusions(state) if d["node"] == f"sim{args.silence:05d}"]
            if gone:
                silenced = round(gone[0]["decided_at"] - fault["at"], 2)

    stats = Stats()
    try:
        await _simulate(args, port, 0, born, start, process, stats, tick, lambda: sum(proc.cpu_times()[:2]))
        if channel is not None:
            await channel.close()
        coordinator_cpu.append((time.time(), sum(proc.cpu_times()[:2])))
        for w in workers:
            out, _ = w.communicate(timeout=60)
            if w.returncode:
                raise RuntimeError(f"a generator process failed ({w.returncode})")
            stats.add(json.loads(out))
    finally:   # a failed run leaves no generator process behind (nor one blocked on its output)
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    wall = time.time() - start
    cpu1 = proc.cpu_times()
    steady = None
    rates = stats.steady_rate()
    if rates is not None and len(coordinator_cpu) == 2:
        (t0, c0), (t1, c1) = coordinator_cpu
        cores = (c1 - c0) / (t1 - t0)
        rate, answered = rates
        steady = {"syncs_per_second": round(rate, 1), "node_syncs_per_second": round(answered, 1),
                  "coordinator_cores": round(cores, 2),
                  "coordinator_us_per_summary": round(1e6 * cores / rate, 1) if rate else None}
    latency = {}
    for kind, samples in stats.lat.items():
        every = sorted(d for _, d in samples)
        late = sorted(d for t, d in samples if t >= start + args.warmup)
        latency[kind] = {"calls": len(every), "p50_ms": _ms(every, 0.5), "p99_ms": _ms(every, 0.99),
                         "steady_p50_ms": _ms(late, 0.5), "steady_p99_ms": _ms(late, 0.99)}
    expected = {f"sim{i:05d}" for i in (args.silence, args.stall) if i is not None}
    via = None
    if relay is not None:
        via = {"nodes_behind_it": len(stats.behind_process),
               "cores": round((sum(relay[1].cpu_times()[:2]) - relay_cpu0) / wall, 2)}
    # (the simulated nodes stop syncing at the end: exclusions after it are theirs to have)
    decided = [d for d in _exclusions(state) if d["decided_at"] <= end]
    excluded = [d["node"] for d in decided]
    flagged = sorted({i.node for i in _incidents(state) if i.kind == "straggler"})
    fails, failed_at = stats.fails, stats.failed_at
    lags = sorted(lag for t, lag in stats.lags if t >= start + args.warmup)
    return {
        "nodes": args.nodes, "ranks": args.nodes * args.ranks, "seconds": round(wall, 1),
        "syncs_per_second": round(stats.done / wall, 1), "asked_at_4hz": args.nodes * 4,
        "steady": steady,
        "relayed_share": round(stats.relayed / stats.done, 3) if stats.done else 0.0,
        "beat_share": round(stats.beats / stats.done, 3) if stats.done else 0.0,
        "relays_used": stats.relays_used,
        "relays_silenced": stats.relays_silenced,
        "latency": latency,
        "direct_syncs_by_why": stats.direct,
        "held_by_busy_relays": stats.held,
        "failed": sum(fails.values()), "failed_by_code": fails, "failed_by_call": stats.fails_by_call,
        "failures_between_s": [round(min(failed_at) - start, 1), round(max(failed_at) - start, 1)] if failed_at else None,
        "healthy_excluded": [n for n in excluded if n not in expected],
        # each one's syncs that failed in the 10 s before it was excluded, and how late the
        # generator's loop woke meanwhile (the most)
        "healthy_excluded_syncs": {
            d["node"]: {"failed_in_10s_before": sum(1 for t in stats.node_fails.get(d["node"], ())
                                                    if d["decided_at"] - 10 <= t <= d["decided_at"]),
                        "generator_lag_max_ms": _ms(sorted(lag for t, lag in stats.lags
                                                           if d["decided_at"] - 10 <= t <= d["decided_at"]), 1.0)}
            for d in decided if d["node"] not in expected},
        "coordinator_cores": round((sum(cpu1[:2]) - sum(cpu0[:2])) / wall, 2),
        "coordinator_rss_mb": round(proc.memory_info().rss / 2**20),
        "generator_cores": round(stats.cores, 2),   # every generator process's
        "generator_processes": args.processes,
        # how late the generator's own event loop woke (steady): a late loop lets its calls'
        # deadlines run out on its side, where the coordinator cannot see it
        "generator_loop_lag_ms": {"p50": _ms(lags, 0.5), "p99": _ms(lags, 0.99), "max": _ms(lags, 1.0)},
        "final_interval_s": round(stats.final_interval, 2),
        "hang_named": named, "silent_excluded_after_s": silenced,
        "straggler_nodes_flagged": flagged,
        "relay_process": via,
        "started_at": start,
        "timeline": _timeline(stats, start, min(wall, max(30.0, args.fault_at + 15))),   # the join, and a fault
        "slow_seconds": _slow_seconds(stats, start, args.warmup),
    }


def _timeline(stats: Stats, start: float, seconds: float) -> list[dict]:
    """Second by second from the start: calls to the coordinator begun and failed, the
    generator loop's worst lateness, and each side's cores (where a join's failures come from)."""
    out = []
    for k in range(int(seconds)):
        lo, hi = start + k, start + k + 1
        cpu = [c for c in stats.cpu if lo <= c[0] < hi]
        out.append({
            "s": k, "calls": sum(1 for t in stats.sent_at if lo <= t < hi),
            "failed": sum(1 for t in stats.failed_at if lo <= t < hi),
            "lag_max_ms": _ms(sorted(lag for t, lag in stats.lags if lo <= t < hi), 1.0),
            "coordinator_cores": round((cpu[-1][1] - cpu[0][1]) / (cpu[-1][0] - cpu[0][0]), 2) if len(cpu) > 1 else None,
            "generator_cores": round((cpu[-1][2] - cpu[0][2]) / (cpu[-1][0] - cpu[0][0]), 2) if len(cpu) > 1 else None})
    return out


def _slow_seconds(stats: Stats, start: float, warmup: float, over: float = 0.25) -> list[dict]:
    """The ten seconds after the warmup with the most calls to the coordinator slower than
    ``over`` s, as seconds from the start (a p99 spread out, or a few bad seconds)."""
    by: dict[int, list[float]] = {}
    for samples in stats.lat.values():
        for t, d in samples:
            if t >= start + warmup and d > over:
                by.setdefault(int(t - start), []).append(d)
    worst = sorted(by.items(), key=lambda kv: -len(kv[1]))[:10]
    return [{"s": k, "calls": len(v), "max_ms": round(1e3 * max(v), 1)} for k, v in worst]


_STORY = ("overloaded", "back to normal", "nodes now sync", "silent together", "burst", "is dead")


def _exclusion_story(tmp: Path, start: float, seconds: float) -> dict:
    """The exclusions decided during the run (seconds after the start, and why), and the
    coordinator's log lines about its load and about dead nodes until the end (at most 80)."""
    end = start + seconds
    decided = [{"node": d["node"], "at_s": round(d["decided_at"] - start, 2), "reason": d["reason"]}
               for d in _exclusions(tmp / "state") if d["decided_at"] <= end]
    lines = []
    for line in (tmp / "coord.log").read_text(errors="replace").splitlines():
        if any(word in line for word in _STORY):
            lines.append(line[:300])
    return {"decisions": decided[:80], "log": lines[:80]}


def _ms(sorted_seconds: list[float], q: float) -> float | None:
    return round(1e3 * sorted_seconds[min(len(sorted_seconds) - 1, int(len(sorted_seconds) * q))], 1) \
        if sorted_seconds else None


def status_seconds(sock: Path, *flags: str) -> tuple[float, int]:
    """Seconds and bytes of ``rankwatch status --json`` (the CLI, as a user runs it)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "status", "--json", "--agent",
                          f"unix:{sock}", *flags], capture_output=True, check=True, timeout=60).stdout
    return round(time.perf_counter() - t0, 2), len(out)


def _configure(args: argparse.Namespace) -> None:
    """The generator's module-wide switches, from the command line (in every generator process)."""
    global BACKOFF, RELAY_KEEPS_ON, REPEATED_WINDOWS, STEP, JOB_NODES, RELAY_HOLDS_WHILE_ASKING, RELAY_WORD, SYNC_AT_RATE
    RELAY_HOLDS_WHILE_ASKING = not getattr(args, "relay_refuses_while_asking", False)
    RELAY_WORD = not getattr(args, "relays_silent_on_absence", False)
    SYNC_AT_RATE = not getattr(args, "interval_after_sync", False)
    JOB_NODES = 0 if getattr(args, "job_size_unknown", False) else args.nodes
    BACKOFF = not getattr(args, "no_backoff", False)
    REPEATED_WINDOWS = getattr(args, "repeated_windows", False)
    RELAY_KEEPS_ON = not getattr(args, "relay_refuses_when_busy", False)
    STEP = args.step_seconds


def run(args: argparse.Namespace) -> dict:
    _configure(args)
    with tempfile.TemporaryDirectory(prefix="rw-load-") as d:
        tmp = Path(args.keep) if args.keep else Path(d)
        tmp.mkdir(parents=True, exist_ok=True)
        port = free_port()
        whole = ["--relay-whole-every-seconds", str(args.relay_whole_every_seconds),
                 "--relay-whole-every-intervals", str(args.relay_whole_every_intervals),
                 "--relay-whole-every-steps", str(args.relay_whole_every_steps),
                 "--relay-long-wait-spread-seconds", str(args.relay_long_wait_spread_seconds),
                 "--relay-busy-hold-seconds", str(args.relay_busy_hold_seconds)]
        relay_args = ([] if args.relay_group is None else ["--relay-group", str(args.relay_group)]) + (
            [] if args.relay_min_nodes is None else ["--relay-min-nodes", str(args.relay_min_nodes)]) + [
            *whole]
        coord = _start_coordinator(tmp, port, relay_args)
        relay = None
        try:
            _wait_serving(port, coord)
            if args.relay_process:
                relay_port, metrics_port = free_port(), free_port()
                relay = _start_relay(tmp, port, relay_port, metrics_port, whole)
                _wait_serving(relay_port, relay)
                deadline = time.time() + 30
                while not _coordinator_knows(tmp / "coord.sock", "sim00000"):   # heard: it heads a group
                    if time.time() > deadline:
                        raise TimeoutError("the coordinator never heard the relay process")
                    time.sleep(0.2)
            result = asyncio.run(_run(args, port, tmp / "state", psutil.Process(coord.pid),
                                      None if relay is None else (f"127.0.0.1:{relay_port}",
                                                                  psutil.Process(relay.pid))))
            if relay is not None:
                result["relay_process"]["sent_on"] = _relayed_by(metrics_port)
            if result["healthy_excluded"]:   # what the coordinator said about it, kept with the figures
                result["healthy_excluded_why"] = _exclusion_story(tmp, result["started_at"], result["seconds"])
            # The default (summarised past 1,024 ranks) and the full view.
            result["status_json_seconds"], result["status_json_bytes"] = status_seconds(tmp / "coord.sock")
            result["status_all_ranks_seconds"], result["status_all_ranks_bytes"] = status_seconds(
                tmp / "coord.sock", "--all-ranks")
            return result
        finally:
            if relay is not None:
                relay.terminate()
                relay.wait(10)
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
    p.add_argument("--processes", type=int, default=1,
                   help="generator processes, each with its share of the nodes and their relays")
    p.add_argument("--worker", help=argparse.SUPPRESS)   # a generator process after the first (JSON)
    p.add_argument("--fault-at", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=10.0, help="seconds left out of the steady p50/p99")
    p.add_argument("--stall", type=int, help="node whose ranks fall behind when the job hangs")
    p.add_argument("--silence", type=int, help="node whose agent stops syncing")
    p.add_argument("--slow", type=int, help="node whose ranks do 25%% more own work")
    p.add_argument("--keep", help="keep the coordinator's log and state in this folder")
    p.add_argument("--pause", type=float, default=0.0, help="SIGSTOP the coordinator this long")
    p.add_argument("--relay-group", type=int, help="the coordinator's --relay-group (0: no relays)")
    p.add_argument("--relay-min-nodes", type=int, help="the coordinator's --relay-min-nodes")
    p.add_argument("--relay-whole-every-seconds", type=float, default=RelayConfig().whole_every_seconds,
                   help="the relays': a node goes whole at least this often")
    p.add_argument("--relay-whole-every-intervals", type=float, default=RelayConfig().whole_every_intervals,
                   help="the relays' (0: a node goes whole every --relay-whole-every-seconds however slow the syncs)")
    p.add_argument("--relay-whole-every-steps", type=int, default=RelayConfig().whole_every_steps,
                   help="the relays' steps rule: a node goes whole at least every N steps its ranks completed")
    p.add_argument("--relay-long-wait-spread-seconds", type=float, default=RelayConfig().long_wait_spread_seconds,
                   help="the relays': a stalled node goes whole at its own point of this many seconds (0: all at once)")
    p.add_argument("--silence-relay", action="store_true",
                   help="at the fault, the relay with the most members (of the first generator process) goes silent")
    p.add_argument("--relay-refuses-while-asking", action="store_true",
                   help="a relay whose SyncGroup is still unanswered refuses its nodes once its reply is stale")
    p.add_argument("--interval-after-sync", action="store_true",
                   help="a node's next sync an interval after its last ended, not began (as before)")
    p.add_argument("--relays-silent-on-absence", action="store_true",
                   help="relays name none of their members they have not heard (as before): a busy "
                        "coordinator then calls no node silent")
    p.add_argument("--job-size-unknown", action="store_true",
                   help="the agents do not know the job's size: first syncs spread over 2 s (as before)")
    p.add_argument("--relay-busy-hold-seconds", type=float, default=RelayConfig().busy_hold_seconds,
                   help="a busy coordinator's relays hold their nodes' summaries this long (0: refuse, as before)")
    p.add_argument("--step-seconds", type=float, default=STEP, help="simulated seconds per training step")
    p.add_argument("--relay-process", action="store_true",
                   help="node 0 is a real agent process, relaying for the nodes the coordinator sends to it")
    p.add_argument("--no-backoff", action="store_true",
                   help="nodes retry a sync a busy coordinator did not answer at their interval")
    p.add_argument("--repeated-windows", action="store_true",
                   help="nodes send each rank's windows as repeated doubles, as before RankSummary.work")
    p.add_argument("--relay-refuses-when-busy", action="store_true",
                   help="a relay whose SyncGroup a busy coordinator did not answer refuses its nodes at once, "
                        "sending them to the coordinator directly (as before Relay.unanswered)")
    return p


if __name__ == "__main__":
    _args = parser().parse_args()
    print(json.dumps(_worker(json.loads(_args.worker)) if _args.worker else run(_args), indent=1))
