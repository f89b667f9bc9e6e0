"""Several "nodes" on one machine: one agent and one torchrun each, joined by c10d rendezvous.

Node ``n0``'s agent also listens on loopback TCP and is every agent's
coordinator candidate, as ``rankwatch agent --coordinator`` would be set on
a real cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import AgentProcess, wait_for
from rankwatch.agent.cli.ports import free_port
from rankwatch.status import AgentUnreachable

__all__ = ["Cluster", "check_buckets", "free_port", "seconds_per_step"]


def seconds_per_step(status_of, steps: int = 10, timeout: float = 60.0) -> float:
    """The job's step time by the test's own clock: the time its slowest rank takes for
    ``steps`` more steps.  ``status_of()`` is an agent's status."""
    def slowest() -> int:
        return min(r["step"] for r in status_of()["ranks"])

    t0, s0 = time.monotonic(), slowest()
    wait_for(lambda: slowest() >= s0 + steps, timeout, what=f"{steps} more steps")
    return (time.monotonic() - t0) / steps


def check_buckets(status: dict, seconds_per_step: float, lost: tuple[str, ...],
                  unjudged: tuple[str, ...] = ()) -> None:
    """``status``'s goodput buckets: the kinds in ``lost`` cost time, the others none (but
    those in ``unjudged``), they add up to the elapsed time, and the productive time is the
    steps trained at the measured step time, within a factor of 3."""
    t = status["time_seconds"]
    for kind in {"hang", "restart", "recompute", "checkpoint"} - set(unjudged):
        assert (t[kind] > 0) == (kind in lost), (kind, t)
    parts = t["productive"] + t["hang"] + t["restart"] + t["recompute"] + t["checkpoint"]
    assert parts == pytest.approx(t["elapsed"], abs=0.01), t
    assert status["goodput"] == pytest.approx(t["productive"] / t["elapsed"], rel=1e-3), (status["goodput"], t)
    trained = max(r["step"] for r in status["ranks"]) * seconds_per_step
    assert trained / 3 <= t["productive"] <= trained * 3, (t, trained)


class Cluster:
    """``nodes`` agents, each with a Unix socket ``n<i>.sock``.  By default node n0's agent
    listens on TCP and is every agent's ``--coordinator``; given an etcd endpoint in
    ``election``, every agent listens on TCP and campaigns for the job's coordinator seat
    there (``--election``) instead."""

    def __init__(self, tmp: Path, nodes: int, agent_args: tuple[str, ...] = (),
                 node_args: dict[int, tuple[str, ...]] | None = None, election: str | None = None) -> None:
        self.tmp = tmp
        self.coord = f"127.0.0.1:{free_port()}"
        self.rdzv_port = free_port()
        self.election = election
        self.agents: list[AgentProcess] = []
        self.jobs: list[subprocess.Popen] = []
        for i in range(nodes):
            if election:
                seat = ["--election", f"etcd://{election}", "--job-id", "job", "--listen", "127.0.0.1:0"]
            else:
                seat = (["--listen", self.coord] if i == 0 else []) + ["--coordinator", self.coord]
            extra = [*seat, *agent_args, *(node_args or {}).get(i, ())]
            self.agents.append(AgentProcess(tmp / f"n{i}.sock", node=f"n{i}", extra=tuple(extra)))

    def __enter__(self) -> Cluster:
        for i, a in enumerate(self.agents):
            a.start()
            if self.election and i == 0:
                # The tests take n0 for the first coordinator: it holds the seat before the
                # others campaign (an agent answers Status before its campaign is in, and
                # another one started a moment later could win it).
                wait_for(lambda: a.status()["coordinator"], 15, what="n0 holding the coordinator's seat")
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.print_logs()
        for job in self.jobs:
            if job.poll() is None:
                try:
                    os.killpg(job.pid, signal.SIGCONT)
                    os.killpg(job.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                job.wait(30)
        for a in self.agents:
            a.stop()

    def kill_node(self, node: int, job: subprocess.Popen, worker_pids: list[int]) -> None:
        """SIGKILL a whole node: its torchrun's process group, its workers (each in a session
        of its own) and its agent."""
        os.killpg(job.pid, signal.SIGKILL)
        for pid in worker_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.agents[node].kill()

    def print_logs(self, lines: int = 40) -> None:
        """Print each job's exit code and the tail of each node's logs (shown when a test fails)."""
        print("jobs:", [(job.pid, job.poll()) for job in self.jobs])
        for log in sorted(self.tmp.glob("job-n*.log")) + sorted(self.tmp.glob("n*.log")):
            text = log.read_text(errors="replace").splitlines()
            fatal = next((i for i, line in enumerate(text) if line.startswith("Fatal Python error")), None)
            if fatal is not None:   # a crash's head, which its thread dump pushes out of the tail
                print(f"==== {log.name} (crash)", *text[max(0, fatal - 20):fatal + 20], sep="\n")
            tail = text[-lines:]
            print(f"==== {log.name} (last {len(tail)} lines)", *tail, sep="\n")

    def torchrun(self, node: int, nnodes: str, nproc: int, *train_args: str, launcher: str = "torchrun",
                 rdzv_conf: str = "", env: dict | None = None, launcher_args: tuple[str, ...] = (),
                 etcd: str | None = None, script: str | None = None) -> subprocess.Popen:
        """Start node ``node``'s torchrun (or ``rankwatch run``) of the harness (or of a user's
        ``script``): on c10d, whose store node n0 hosts, or, given an ``etcd`` endpoint, on
        torch's etcd-v2 backend."""
        agent = self.agents[node]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "RANKWATCH_AGENT": str(agent.addr),
                    "RANKWATCH_NODE_ID": agent.node, **(env or {})}
        # On c10d node n0 hosts the rendezvous store, as the endpoint's own node would.
        backend, endpoint, host = (("etcd-v2", etcd, "") if etcd else
                                   ("c10d", f"127.0.0.1:{self.rdzv_port}", f"is_host={int(node == 0)}"))
        tr = ["--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-backend", backend,
              "--rdzv-endpoint", endpoint, "--rdzv-id", "job",
              "--rdzv-conf", ",".join(filter(None, [rdzv_conf, host])),
              *launcher_args,
              *([script] if script else ["-m", "rankwatch.hooks.train"]), *train_args]
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", *tr]
        else:
            cmd = [sys.executable, "-m", "rankwatch.agent.cli", "run", "--agent", str(agent.addr),
                   "--node-id", agent.node, "--", *tr]
        log = open(self.tmp / f"job-n{node}.log", "a")
        job = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
        self.jobs.append(job)
        return job

    @property
    def coordinator(self) -> AgentProcess:
        """The coordinating agent: n0's, or with an election the live agent that holds the seat."""
        if not self.election:
            return self.agents[0]

        def holder() -> AgentProcess | None:
            for a in self.agents:
                if a.proc.poll() is None:
                    try:
                        if a.status()["coordinator"]:
                            return a
                    except AgentUnreachable:  # a SIGSTOPped agent
                        continue
            return None

        return wait_for(holder, 15, what="an agent holding the coordinator seat")
