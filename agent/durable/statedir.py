"""What an agent leaves in its state directory, and reading it back once the agent is gone.

An agent keeps four things there:

* ``incidents.jsonl``: every incident and each later change (:mod:`incidents`);
* ``decisions.jsonl``: the coordinator decisions it made or applied;
* ``last-status.json``: its last ``status`` view (ranks, goodput, ...), rewritten every
  second or so and when it stops, with the job's run id and when it was written;
* ``history/``: its ranks' steps in the rankwatch trace format, for ``rankwatch analyze``
  (:mod:`steplog`).

Beside a unix socket it serves, the agent leaves ``<socket>.state-dir``, naming the
directory, so ``rankwatch diagnose --agent SOCKET`` finds it after the socket is gone.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rankwatch.address import Address, default_address, default_dir
from rankwatch.agent.durable.incidents import Incident, IncidentLog

__all__ = ["STATE_DIR_ENV", "LeftBehind", "Snapshots", "default_state_dir", "locate", "read", "read_decisions", "write_pointer",
           "write_snapshot"]

log = logging.getLogger(__name__)

STATE_DIR_ENV = "RANKWATCH_STATE_DIR"
SNAPSHOT = "last-status.json"


def default_state_dir(node: str) -> Path:
    """``$RANKWATCH_STATE_DIR``, else ``<the default directory>/<node-id>`` (``/tmp/rankwatch-<uid>``)."""
    env = os.environ.get(STATE_DIR_ENV)
    return Path(env) if env else Path(default_dir()) / node


def _pointer(addr: Address) -> Path | None:
    return Path(f"{addr.path}.state-dir") if addr.is_unix else None


def write_pointer(listen: Iterable[Address], state_dir: Path) -> None:
    """Name ``state_dir`` beside each unix socket (never fails the agent)."""
    for addr in listen:
        path = _pointer(addr)
        if path is None:
            continue
        try:
            path.write_text(str(state_dir.resolve()) + "\n")
        except OSError as exc:
            log.warning("could not write %s: %s", path, exc)


def locate(addr: Address, node: str, explicit: Path | None = None) -> Path:
    """The state directory of the agent at ``addr``: ``explicit``, else the one its socket
    names, else ``$RANKWATCH_STATE_DIR``, else (for the default address only)
    ``/tmp/rankwatch-<uid>/<node>``, where ``rankwatch agent`` keeps it by default."""
    if explicit is not None:
        return explicit
    pointer = _pointer(addr)
    if pointer is not None and pointer.is_file():
        try:
            return Path(pointer.read_text().strip())
        except OSError:
            pass
    env = os.environ.get(STATE_DIR_ENV)
    if env or str(addr) == str(default_address()):
        return default_state_dir(node)
    raise FileNotFoundError(f"no state directory known for {addr} (give --state-dir)")


def write_snapshot(state_dir: Path, status: dict[str, Any], run_id: str, now: float) -> None:
    """Replace ``last-status.json`` at once (a reader never sees half of it).

    Raises:
        OSError: the directory cannot be written.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=state_dir, prefix=".status-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"written_at": now, "run_id": run_id, "status": status}, f)
        os.replace(tmp, state_dir / SNAPSHOT)
    except BaseException:
        os.unlink(tmp)
        raise


class LeftBehind:
    """What a state directory holds: the last status view and the latest run's incidents.

    Attributes:
        status: the ``status --json`` form, its incidents and decisions those of the latest run
            (as the files hold them, resolutions included).
        written_at: when the agent last wrote its view (None: it left none).
        run_id: the latest run's id ("" if unknown).
        earlier: how many incidents of earlier runs the files hold (not in ``status``).
        every: every incident in the files, earlier runs' included, in the ``status`` form.
    """

    def __init__(self, status: dict[str, Any], written_at: float | None, run_id: str,
                 every: list[dict[str, Any]]) -> None:
        self.status, self.written_at, self.run_id, self.every = status, written_at, run_id, every
        self.earlier = len(every) - len(status["incidents"])

    def line(self, addr: Address | None, state_dir: Path) -> str:
        """One line saying where this view comes from (``addr``: the agent that did not answer)."""
        when = (f"its view of {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.written_at))}"
                if self.written_at is not None else "its incidents (no status view)")
        run = f", run {self.run_id}" if self.run_id else ""
        older = f"; {self.earlier} incidents of earlier runs not shown" if self.earlier else ""
        why = f"no agent answers at {addr}: " if addr is not None else ""
        return f"{why}reading what the agent left in {state_dir} ({when}{run}{older})"


def read(state_dir: Path) -> LeftBehind:
    """Raises:
        FileNotFoundError: the directory holds neither a status view nor incidents.
    """
    snap_path, inc_path = state_dir / SNAPSHOT, state_dir / "incidents.jsonl"
    snap: dict[str, Any] = {}
    if snap_path.is_file():
        try:
            snap = json.loads(snap_path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("%s unreadable: %s", snap_path, exc)
    if not snap and not inc_path.is_file():
        raise FileNotFoundError(f"no agent state in {state_dir} (neither {SNAPSHOT} nor incidents.jsonl)")
    incidents = IncidentLog.replay(inc_path) if inc_path.is_file() else []
    run_id = str(snap.get("run_id") or "") or _latest_run(incidents)
    mine = _of_run(incidents, run_id)
    status = dict(snap.get("status") or _empty_status(state_dir.name))
    status["incidents"] = [i.to_json() for i in mine]
    status["decisions"] = read_decisions(state_dir / "decisions.jsonl", run_id) or status.get("decisions", [])
    return LeftBehind(status, snap.get("written_at"), run_id, [i.to_json() for i in incidents])


def _latest_run(incidents: list[Incident]) -> str:
    return next((i.run_id for i in reversed(incidents) if i.run_id), "")


def _of_run(incidents: list[Incident], run_id: str) -> list[Incident]:
    """The run's incidents, with those recorded before the agent learned the run's id (just
    before its first); all of them if no run is named."""
    if not run_id:
        return incidents
    first = next((n for n, i in enumerate(incidents) if i.run_id == run_id), len(incidents))
    start = first
    while start > 0 and not incidents[start - 1].run_id:
        start -= 1
    return [i for i in incidents[start:] if i.run_id in (run_id, "")]


def read_decisions(path: Path, run_id: str = "") -> list[dict[str, Any]]:
    """The decisions a ``decisions.jsonl`` holds (of ``run_id``, if given); a torn line is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and (not run_id or d.get("run_id") == run_id):
            out.append({k: d.get(k) for k in ("id", "kind", "node", "generation", "step", "reason",
                                             "decided_at")})
    return out


def _empty_status(node: str) -> dict[str, Any]:
    return {"node": node, "agent_started_at": None, "metrics_port": None, "ranks": [], "incidents": [],
            "goodput": None, "time_seconds": {}, "coordinator": False, "coordinator_node": None,
            "nodes": [], "excluded_nodes": [], "decisions": [], "tokens_per_second": 0.0, "mfu": None,
            "records_received": 0, "messages_rejected": 0}


class Snapshots:
    """Writes an agent's ``last-status.json`` at most every ``every`` seconds, and once more at stop.

    A big job's view is costly to build and write (a coordinator of thousands of ranks):
    the interval stretches so that writing takes at most ``share`` of the agent's time.
    (At 2,048 nodes a write took 0.2-0.47 s of the thread whose GIL the syncs share, and
    the seconds with the most syncs over 250 ms were those of the writes: at 1 %, one every
    20-45 s.  Decisions and incidents are written as they happen, apart from this view.)

    Args:
        state_dir: where (None: nowhere).
        view: the agent's status, in the ``status --json`` form.
        run_id: the job's run id as the agent knows it now.
    """

    def __init__(self, state_dir: Path | None, view: Callable[[], dict[str, Any]],
                 run_id: Callable[[], str], every: float = 1.0, share: float = 0.01) -> None:
        self.state_dir, self.view, self.run_id, self.every = state_dir, view, run_id, every
        self.share = share
        self._last = float("-inf")
        self._took = 0.0   # seconds the last write took

    def maybe_write(self, now: float) -> None:
        if now - self._last >= max(self.every, self._took / self.share):
            self.write(now)

    def write(self, now: float | None = None) -> None:
        """Write the view now; an error is logged, never raised (the agent goes on)."""
        if self.state_dir is None:
            return
        now = time.time() if now is None else now
        self._last = now
        started = time.perf_counter()
        try:
            write_snapshot(self.state_dir, self.view(), self.run_id(), now)
            self._took = time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001 - a post-mortem aid never stops the agent
            log.warning("could not write %s: %s", self.state_dir / SNAPSHOT, exc)
