"""``rankwatch demo``: a local CPU job on four "nodes" under rankwatch, with faults, watched live.

Four "nodes" on this machine, each with its own agent and its own
``rankwatch run`` (torchrun, one rank each, ``--nnodes 2:3``, the rankwatch
rendezvous backend): three train and the fourth, started once they do, finds
the job full and stands by as a hot spare.  Node 0's agent listens at the default
address and is the coordinator, so ``rankwatch status`` in another terminal
shows the whole job, and its ``/metrics`` is on port 9478 (or a free one).
Injected, all from outside the code under test, in this order:

* node 1's rank computes 50% slower from step 20 (a straggler), and its
  scripted GPU throttles from its step 22 and gathers corrected ECC errors at
  step 35 (each a risk: the coordinator asks for a checkpoint, saved before the hang);
* node 2's rank gets stuck in Python inside forward at step 100 (a hang): the
  coordinator names it and excludes node 2, whose relay kills its worker; the
  others regroup without it in their own processes (in-process recovery: the
  harness runs HSDP, one replica per node), and the spare (node 3), standing by,
  takes node 2's place in that same recovery, its state sent by a live replica (no
  worker restarts, nothing read from disk): the world stays three ranks;
* once the spare trains, node 1's scripted GPU raises XID 79 (fatal: reboot):
  node 1 is excluded, and nodes 0 and 3 regroup in process and finish the job.

In a terminal the demo shows one full-screen live view (:mod:`screen`): the
ranks and nodes, a running feed of incidents and decisions, goodput as it goes and
a line on what happens next; the agents log to ``agents.log`` and each node's
``rankwatch run`` to ``<node>.log`` in the demo's directory.  ``--no-live`` (or an
output that is not a terminal) prints plain lines instead.  It ends with the final
view, the timeline, the goodput breakdown and a comparison with plain torchrun.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any
from datetime import timedelta
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.markup import escape

from rankwatch.address import AGENT_ENV, NODE_ID_ENV, Address, resolve
from rankwatch.agent.job.coordinator import PolicyConfig
from rankwatch.agent.cli.screen import (
    HANG_ALLOWANCE_SECONDS, HANG_STEP, DemoNotes, progress_line, screen, versus_torchrun,
)
from rankwatch.agent.gpu import GpuConfig, load_script
from rankwatch.agent.gpu.script import ScriptedSource
from rankwatch.agent.detect.hang_verdict import HangConfig
from rankwatch.agent.cli.ports import free_port
from rankwatch.agent.cli.run import DEFAULT_METRICS_PORT
from rankwatch.agent.durable.safedir import UnsafeDirectory, check_default
from rankwatch.agent.server import Agent, AgentConfig
from rankwatch.agent.detect.straggler import StragglerConfig
from rankwatch.agent.cli.status_tables import goodput_line, rank_table, timeline
from rankwatch.status import AgentUnreachable, fetch_status, reachable

__all__ = ["run_demo"]

_NODES = ("demo-n0", "demo-n1", "demo-n2", "demo-n3")
_SPARE = 3
_RDZV_CONF = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=120"
# Node 1's scripted GPU.  Its faults come at steps of the story, not at times, so they land in
# the same place on a fast machine and a slow one: heat throttling once node 1 straggles, then
# corrected ECC errors (each a risk: the coordinator asks for a checkpoint), both before the
# hang; the fatal XID once the spare trains.
_GPU_SCRIPT = {"gpus": {"count": 1, "name": "NVIDIA H100 80GB HBM3 (scripted)"}, "events": []}
_GPU_CHANGES: tuple[tuple[int, dict[str, Any]], ...] = ((22, {"throttle": ["hw_thermal_slowdown"]}), (35, {"ecc": {"corrected": 6}}))


# Steps enough for the whole story after the hang at HANG_STEP: the spare's torchrun starts its
# worker only once the hung node is out, and that worker (Python, torch, the model) takes
# about 10 s on 2 cores before the survivors admit it; then the XID, and training again.
# With 160 steps of ~0.11-0.18 s the job could end before the spare was in; with 170 steps of
# ~35 ms on two busy cores the spare came in 155 steps after the hang, and the fatal XID at the
# job's last step (the survivors then finished without it).
DEMO_STEPS = HANG_STEP + 240


def run_demo(steps: int = DEMO_STEPS, live: bool = True, out: Console | None = None) -> int:
    console = out or Console(width=None if sys.stdout.isatty() else 140)
    live = live and console.is_terminal  # plain lines into a pipe or a file (CI)
    addr = resolve(None)
    if not _may_start(addr, console):
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="rankwatch-demo-"))
    logs = _agent_logs_to(workdir / "agents.log") if live else None
    agents = _start_agents(addr, workdir)
    _announce(console, agents, addr, steps, workdir)
    rdzv_port = free_port()
    started = time.time()
    notes = DemoNotes(nodes=_NODES, spare=_NODES[_SPARE], hung=_NODES[2], xid=_NODES[1], steps=steps,
                      started=started)

    def launch(i: int) -> subprocess.Popen:
        return _launch(_NODES[i], i, agents[i].config.listen[0], workdir, rdzv_port, steps)

    jobs = [launch(i) for i in range(len(_NODES)) if i != _SPARE]
    story = _Story(agents, jobs, launch, notes, console, live)
    status = None
    watch = _Watch()
    try:
        status = watch.run(jobs, addr, console, live, story, notes)
    finally:
        _stop_jobs(jobs, logs)
    codes = [j.returncode for j in jobs]
    _report(console, _final_status(addr, status), started, watch, codes)
    if live:
        console.print(f"logs: {workdir}/agents.log and {workdir}/<node>.log")
    console.print(f"nodes exited with {codes} after {time.time() - started:.0f} s")
    for agent in agents:
        agent.stop(timedelta(seconds=1))
    return 0 if all(c == 0 for c in codes) else 1


def _may_start(addr: Address, console: Console) -> bool:
    """No agent answers at the default address yet, and its directory is safe to use (else False,
    the reason printed)."""
    if reachable(addr):
        console.print(f"[red]an agent already answers at {addr}; stop it (or set {AGENT_ENV}) "
                      "and run the demo again[/]")
        return False
    try:
        check_default([addr])   # the coordinator's socket goes in the default directory
    except UnsafeDirectory as exc:
        console.print(f"[red]refusing the default directory: {escape(str(exc))}[/]")
        return False
    return True


def _start_agents(addr: Address, workdir: Path) -> list[Agent]:
    """The four nodes' agents, started: node 0's at ``addr`` and a TCP port (the coordinator)."""
    script = workdir / "gpu-n1.json"
    script.write_text(json.dumps(_GPU_SCRIPT))
    coord = Address.parse(f"127.0.0.1:{free_port()}")
    agents = []
    for i, node in enumerate(_NODES):
        agent = Agent(_agent_config(i, node, addr, coord, workdir, script))
        agent.start()
        agents.append(agent)
    return agents


def _agent_config(i: int, node: str, addr: Address, coord: Address, workdir: Path, script: Path) -> AgentConfig:
    """Node ``i``'s agent, set for a short job: node 1's GPU scripted, the others' none."""
    listen = [addr, coord] if i == 0 else [Address(path=str(workdir / f"{node}.sock"))]
    port = DEFAULT_METRICS_PORT if i == 0 else 0   # the agent moves off it by itself if it is taken
    # A short job: a throttle is a risk after 3 s of it, not the default 10 s.
    gpu = (GpuConfig(source="script", script=load_script(script), throttle_sustain=timedelta(seconds=3))
           if i == 1 else GpuConfig(source="none"))
    return AgentConfig(node_id=node, listen=listen, metrics_port=port,
                       # A short job: score ranks after 30 steps, not the default
                       # warm-up, and flag a confirmed slowdown at once, with no
                       # hold.  The coordinator's straggler pass runs once a second,
                       # so a hold of 1-2 s is 2-3 passes: 50-80 steps of this job,
                       # more on a faster machine, and the straggler came after the
                       # hang.  Node 1's slowdown is injected and large (x2), and the
                       # warm-up keeps the job's uneven first steps out.
                       straggler=StragglerConfig(warmup_steps=30, hold_seconds=0.0),
                       hang=HangConfig(floor_seconds=HANG_ALLOWANCE_SECONDS),
                       metrics_addr="127.0.0.1", state_dir=workdir / node,
                       coordinators=[coord], gpu=gpu,
                       # The straggler stays (it is shown, not evicted), so the
                       # hang on node 2 is what takes a node out.
                       policy=PolicyConfig(min_nodes=2, evict_straggler_speedup=float("inf"),
                                           # Fast steps: save half a second ahead.
                                           checkpoint_lead_seconds=0.5))


def _announce(console: Console, agents: list[Agent], addr: Address, steps: int, workdir: Path) -> None:
    taken = "" if agents[0].metrics_port == DEFAULT_METRICS_PORT else f" (port {DEFAULT_METRICS_PORT} is taken)"
    console.print(f"coordinator agent [bold]{_NODES[0]}[/] at {addr}; metrics at "
                  f"http://127.0.0.1:{agents[0].metrics_port}/metrics{taken}")
    console.print(f"the job in a browser: http://127.0.0.1:{agents[0].metrics_port}/")
    console.print(f"job: 3 nodes x 1 rank and a hot spare (--nnodes 2:3, gloo, FSDP2), {steps} steps; "
                  f"logs and checkpoints in {workdir}")
    console.print("faults: demo-n1 computes 50% slower from step 20 and its GPU throttles, then "
                  f"logs ECC errors; demo-n2 is stuck in forward at step {HANG_STEP}; once the spare "
                  "demo-n3 trains, demo-n1's GPU raises XID 79")
    console.print("try [bold]rankwatch status[/] in another terminal")


def _launch(node: str, i: int, agent_addr: Address, workdir: Path, rdzv_port: int, steps: int) -> subprocess.Popen:
    """Node ``i``'s ``rankwatch run`` (torchrun, one rank), its faults injected, logging to ``<node>.log``."""
    fault = {1: ["--fault", "slow_compute:-1:20:0.5"], 2: ["--fault", f"sleep_forward:-1:{HANG_STEP}:120"]}
    cmd = [sys.executable, "-m", "rankwatch.agent.cli", "run", "--agent", str(agent_addr),
           "--node-id", node, "--",
           "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", "rankwatch-demo",
           "--rdzv-conf", f"{_RDZV_CONF},is_host={int(i == 0)}",
           "--max-restarts", "0", "--monitor-interval", "0.1",
           "-m", "rankwatch.hooks.train", "--steps", str(steps), "--log-every", "0",
           "--checkpoint-dir", str(workdir / "checkpoints"), "--checkpoint-interval", "40",
           "--replicate", "3", "--in-process-recovery",
           *fault.get(i, [])]
    env = {**os.environ, AGENT_ENV: str(agent_addr), NODE_ID_ENV: node, "OMP_NUM_THREADS": "1"}
    log = open(workdir / f"{node}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


class _Story:
    """The demo's own moves, at each status: start the spare once three ranks train; change
    node 1's GPU at its steps; fire the fatal XID once the spare trains."""

    def __init__(self, agents: list[Agent], jobs: list[subprocess.Popen], launch: Callable[[int], subprocess.Popen],
                 notes: DemoNotes, console: Console, live: bool) -> None:
        self.agents, self.jobs, self.launch, self.notes = agents, jobs, launch, notes
        self.console, self.live = console, live
        self.fired = False
        self.changes = list(_GPU_CHANGES)

    def say(self, text: str) -> None:
        self.notes.note(text)
        if not self.live:
            self.console.print(text)

    def __call__(self, status: dict) -> None:
        training = {r["node"] for r in status["ranks"] if r["connected"] and r["step"] > 0}
        source = self.agents[1].gpu.source
        n1_step = max((r["step"] for r in status["ranks"] if r["node"] == _NODES[1]), default=-1)
        while self.changes and n1_step >= self.changes[0][0] and isinstance(source, ScriptedSource):
            source.change(0, **self.changes.pop(0)[1])
        if len(self.jobs) < len(_NODES) and len(training) >= 3:
            self.jobs.append(self.launch(_SPARE))
            self.notes.spare_started = True
            self.say(f"hot spare {_NODES[_SPARE]} started: the job is full, so it stands by")
        if not self.fired and _NODES[2] in status["excluded_nodes"] and _NODES[_SPARE] in training:
            if isinstance(source, ScriptedSource):
                source.fire(0, 79)
                self.fired = self.notes.xid_fired = True
                self.say(f"{_NODES[_SPARE]} took {_NODES[2]}'s place; {_NODES[1]}'s GPU 0 now raises XID 79")


def _stop_jobs(jobs: list[subprocess.Popen], logs: logging.FileHandler | None) -> None:
    """The agents' log file closed; every node's ``rankwatch run`` still running stopped."""
    if logs is not None:
        logs.close()
    for job in jobs:
        if job.poll() is None:
            job.terminate()
            try:
                job.wait(10)
            except subprocess.TimeoutExpired:
                job.kill()


def _final_status(addr: Address, last: dict | None) -> dict | None:
    """The coordinator's view now; the last one the watch saw if it no longer answers."""
    try:
        return fetch_status(addr)
    except AgentUnreachable:
        return last


def _report(console: Console, status: dict | None, started: float, watch: _Watch, codes: list[int | None]) -> None:
    """The final view, the timeline, goodput, and the comparison with plain torchrun."""
    if status is None:
        return
    console.print(rank_table(status, title="final view (the coordinator's)"))
    console.print(timeline(status, started))
    console.print(goodput_line(status))
    versus = versus_torchrun(status, started, watch.productive_at_hang,
                             finished=all(c == 0 for c in codes))
    if versus:
        console.print(versus, soft_wrap=True)


class _Watch:
    """Polls the coordinator until the jobs end: the live screen, or a plain line every 5 s."""

    def __init__(self) -> None:
        self.productive_at_hang: float | None = None
        """Productive seconds when the first hang showed (for the comparison with plain torchrun)."""

    def run(self, jobs: list[subprocess.Popen], addr: Address, console: Console, live: bool,
            story: Callable[[dict], None], notes: DemoNotes) -> dict | None:
        status = None
        last_print = 0.0
        with (Live(screen(None, notes), console=console, refresh_per_second=4, screen=True)
              if live else _NoLive()) as view:
            while any(j.poll() is None for j in jobs):
                time.sleep(0.5)
                try:
                    status = fetch_status(addr, timedelta(seconds=1))
                except AgentUnreachable:
                    continue
                story(status)
                if self.productive_at_hang is None and any(i["kind"] == "hang" for i in status["incidents"]):
                    self.productive_at_hang = (status.get("time_seconds") or {}).get("productive", 0.0)
                if live:
                    view.update(screen(status, notes))
                elif time.monotonic() - last_print > 5:
                    last_print = time.monotonic()
                    console.print(progress_line(status))
        return status


def _agent_logs_to(path: Path) -> logging.FileHandler:
    """Send this process's log lines (the four agents') to ``path``, off the live screen."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s rankwatch %(levelname)s %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    return handler


class _NoLive:
    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, renderable: object) -> None:
        pass
