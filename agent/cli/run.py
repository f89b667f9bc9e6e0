"""``rankwatch run``: torchrun with the agent wired in.

Everything after ``--`` goes to torchrun, changed only as ``torchrun_args.plan``
decides (rankwatch's rendezvous backend, fast rendezvous timings and restarts for a
multi-node job, each printed).  If no agent answers at the address, a local one is
started for the job's lifetime.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta

from rankwatch.address import AGENT_ENV, AUTO_ENV, EXIT_NOTE_ENV, NODE_ID_ENV, Address
from rankwatch.agent.cli.torchrun_args import plan
from rankwatch.status import AgentUnreachable, fetch_status, reachable

__all__ = ["DEFAULT_METRICS_PORT", "ensure_local_agent", "metrics_port_line", "page_line", "run_torchrun", "start_local_agent"]

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9478
_AGENT_START = timedelta(seconds=15)
_AGENT_ATTEMPTS = 3
_AGENT_RETRY = timedelta(seconds=0.5)   # backoff after a failed start, times the attempt


def start_local_agent(addr: Address, node: str, metrics_port: int | None = None) -> subprocess.Popen:
    """Start ``rankwatch agent`` at ``addr`` and wait until it answers.

    Raises:
        RuntimeError: it did not come up in time (its stderr is in the message).
    """
    if metrics_port is None:
        metrics_port = DEFAULT_METRICS_PORT   # the agent moves off it by itself if it is taken
    cmd = [sys.executable, "-m", "rankwatch.agent.cli", "agent", "--listen", str(addr),
           "--node-id", node, "--metrics-port", str(metrics_port)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + _AGENT_START.total_seconds()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the local agent exited with code {proc.returncode}")
        if reachable(addr):
            return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the local agent did not answer at {addr} within {_AGENT_START}")


def ensure_local_agent(addr: Address, node: str, attempts: int = _AGENT_ATTEMPTS) -> subprocess.Popen | None:
    """A live agent at ``addr``: the one already there (None), or a local one started here.

    Two ``rankwatch run`` of one host may race for one address: the loser's agent finds the
    winner's socket and exits, and the next attempt finds the winner's agent answering.  Each
    failed attempt is said on stderr; after the last, training goes on without an agent
    (fail-open: the ranks keep retrying the address), and that is said loudly."""
    for attempt in range(1, attempts + 1):
        if reachable(addr):
            return None
        log.info("no agent at %s; starting a local one", addr)
        try:
            agent = start_local_agent(addr, node)
        except (RuntimeError, OSError) as exc:
            print(f"rankwatch run: the local agent for node {node} failed to start (attempt {attempt} of "
                  f"{attempts}): {exc}", file=sys.stderr, flush=True)
            time.sleep(_AGENT_RETRY.total_seconds() * attempt)
            continue
        print(metrics_port_line(addr), file=sys.stderr, flush=True)
        if page := page_line(addr):
            print(page, file=sys.stderr, flush=True)
        return agent
    if reachable(addr):
        return None
    print(f"rankwatch run: WARNING: node {node} has no agent at {addr} after {attempts} attempts: this "
          "node's ranks train unwatched (no status, no hang or straggler detection) until one answers "
          "there", file=sys.stderr, flush=True)
    return None


def metrics_port_line(addr: Address) -> str:
    """Where the agent at ``addr`` serves ``/metrics``, saying so when the default port was taken."""
    try:
        port = fetch_status(addr)["metrics_port"]
    except AgentUnreachable:
        return f"rankwatch: the agent at {addr} does not answer"
    if port is None:
        return f"rankwatch: agent at {addr}, no /metrics"
    taken = f" (port {DEFAULT_METRICS_PORT} is taken)" if port != DEFAULT_METRICS_PORT else ""
    return f"rankwatch: agent at {addr}, /metrics on port {port}{taken}"


def page_line(addr: Address) -> str:
    """Where the agent at ``addr`` serves its page (on the /metrics port; '' if none)."""
    try:
        port = fetch_status(addr)["metrics_port"]
    except AgentUnreachable:
        return ""
    return f"rankwatch: the job in a browser: http://127.0.0.1:{port}/" if port else ""


def stop_process(proc: subprocess.Popen, timeout: timedelta = timedelta(seconds=5)) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout.total_seconds())
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


RDZV_ENV = "RANKWATCH_RDZV"


def excluded_reason(addr: Address, node: str) -> str | None:
    """Why the coordinator excluded ``node``, as this node's agent knows it; None if not."""
    from rankwatch.status import AgentUnreachable, fetch_status

    try:
        status = fetch_status(addr)
    except AgentUnreachable:
        return None
    return next((d["reason"] for d in status["decisions"] if d["kind"] == "exclude" and d["node"] == node),
                None)


def run_torchrun(addr: Address, node: str, torchrun_args: Sequence[str],
                 start_agent: bool = True) -> int:
    """Run torchrun with the agent's address in the workers' environment; return its exit code."""
    agent = ensure_local_agent(addr, node) if start_agent else None
    env = dict(os.environ)
    env[AGENT_ENV] = str(addr)
    env[NODE_ID_ENV] = node
    env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    zero_code(env)
    launch = plan(torchrun_args, env, wrap=env.get(RDZV_ENV, "1") != "0")
    env.update(launch.env)
    for note in launch.notes:
        print(f"rankwatch run: {note}", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch.args]
    with tempfile.NamedTemporaryFile(prefix="rankwatch-exit-", suffix=".txt", delete=False) as exit_note:
        env[EXIT_NOTE_ENV] = exit_note.name
    proc = subprocess.Popen(cmd, env=env)
    forwarded = {}

    def forward(signum: int, _frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        forwarded[sig] = signal.signal(sig, forward)
    try:
        code = proc.wait()
        if code != 0 and (why := _refusal(exit_note.name) or excluded_reason(addr, node)) is not None:
            # torchrun itself exits non-zero after a graceful rendezvous exit.
            log.warning("node %s left the job: excluded by the coordinator (%s)", node, why)
            return 0
        return code
    finally:
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
        if agent is not None:
            stop_process(agent)
        try:
            os.unlink(exit_note.name)
        except OSError:
            pass


def zero_code(env: dict[str, str]) -> None:
    """Put the bootstrap directory first on the workers' ``PYTHONPATH`` (zero-code
    instrumentation: ``rankwatch.hooks.instrument.zerocode``), unless ``RANKWATCH_AUTO=0``."""
    if env.get(AUTO_ENV, "1") == "0":
        return
    spec = importlib.util.find_spec("rankwatch.hooks")   # its location only: nothing of it runs here
    if spec is None or not spec.submodule_search_locations:
        return
    here = os.path.join(list(spec.submodule_search_locations)[0], "autostart")
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != here]
    env["PYTHONPATH"] = os.pathsep.join([here, *rest])


def _refusal(path: str) -> str | None:
    """What the rendezvous handler wrote when it refused this node; None if it did not."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(1000).strip() or None
    except OSError:
        return None
