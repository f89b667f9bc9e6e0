"""torchrun's word on how its workers ended, told to the node agent (``ReportWorkerExits``).

Only torchrun's elastic agent knows a worker's exit code or the signal that killed it
(SIGKILL from outside, the out-of-memory killer), and only it reads the error file
``@record`` writes (``TORCHELASTIC_ERROR_FILE``).  The ``rankwatch`` rendezvous handler is
loaded inside torchrun's process, so it wraps the agent's worker check: each
``RunResult`` that is failed is sent to the node agent -- every failed worker (pid, ranks,
exit code, signal name, torchrun's error file data) and every other worker of the group,
which torchrun now stops (SIGTERM) because of it.

This is torch's private API (``LocalElasticAgent._monitor_workers``, ``RunResult.failures``
of ``ProcessFailure``): every use of it is here, and each fails open -- a torch release that
moves it leaves torchrun as it is, with one warning.  The report is one unary call with a
one-second deadline, made from torchrun's monitor loop (a thread could die with torchrun,
which exits right after its workers failed); an agent that does not answer costs that second once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from datetime import timedelta
from typing import Any

from rankwatch.address import AGENT_ENV, NODE_ID_ENV, Address
from rankwatch.proto import pb

__all__ = ["REPORT_TIMEOUT", "report_of", "watch", "watch_from_env"]

log = logging.getLogger(__name__)

REPORT_TIMEOUT = timedelta(seconds=1)
_MAX_ERROR_FILE = 60 << 10
_PATCHED = "_rankwatch_watched"


def report_of(worker_group: Any, result: Any, node: str, run_id: str, now: float) -> pb.WorkerExits:
    """The ``WorkerExits`` message for a failed ``RunResult`` of ``worker_group``."""
    msg = pb.WorkerExits(node_id=node, run_id=run_id)
    failures = dict(getattr(result, "failures", {}) or {})
    # Once a worker failed, torchrun stops the others with SIGTERM; one that died of it before
    # torchrun collected the result is listed too, but did not fail of its own.
    first = any(int(f.exitcode) != -signal.SIGTERM for f in failures.values())
    for global_rank, f in failures.items():
        code = int(f.exitcode)
        written = os.path.isfile(str(getattr(f, "error_file", "") or ""))   # else torchrun made it up
        data = json.dumps(f.error_file_data) if written and getattr(f, "error_file_data", None) else ""
        msg.exits.append(pb.WorkerExit(
            pid=int(f.pid), rank=int(global_rank), local_rank=int(f.local_rank), exitcode=max(-255, min(255, code)),
            signal=f.signal_name() if code < 0 else "", error_file=data if len(data) <= _MAX_ERROR_FILE else "",
            at=now, failed=not (first and code == -signal.SIGTERM)))
    for w in getattr(worker_group, "workers", []) or []:
        if w.global_rank in failures or not isinstance(w.id, int) or w.id <= 0:
            continue
        msg.exits.append(pb.WorkerExit(pid=w.id, rank=int(w.global_rank), local_rank=int(w.local_rank),
                                       exitcode=0, at=now, failed=False))
    return msg


def _send(agent: Address, msg: pb.WorkerExits) -> None:
    from rankwatch.credentials import ClientCredentials, open_channel
    from rankwatch.proto import pb_grpc

    try:
        creds = ClientCredentials.from_env()
    except ValueError:
        creds = ClientCredentials()
    with open_channel(agent, creds) as channel:
        pb_grpc.AgentStub(channel).ReportWorkerExits(msg, timeout=REPORT_TIMEOUT.total_seconds())


def watch(agent: Address, node: str) -> bool:
    """Wrap torchrun's worker check (once per process) so that failed workers are reported to
    ``agent``.  False (logged) when this torch keeps it elsewhere."""
    try:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        original = LocalElasticAgent._monitor_workers
    except (ImportError, AttributeError) as exc:
        log.warning("rankwatch: torchrun's worker results are not reported to the agent (%s)", exc)
        return False
    if getattr(original, _PATCHED, False):
        return True
    told: set[tuple[int, int]] = set()   # (pid, failed) already reported

    def monitor(self: Any, worker_group: Any) -> Any:
        result = original(self, worker_group)
        try:
            if result.is_failed():
                run_id = str(getattr(getattr(worker_group.spec, "rdzv_handler", None), "get_run_id", lambda: "")())
                msg = report_of(worker_group, result, node, run_id or os.environ.get("TORCHELASTIC_RUN_ID", ""),
                                time.time())
                fresh = [e for e in msg.exits if (e.pid, e.failed) not in told]
                if fresh:
                    del msg.exits[:]
                    msg.exits.extend(fresh)
                    if len(told) > 4096:
                        told.clear()
                    told.update((e.pid, e.failed) for e in fresh)
                    _send(agent, msg)
        except Exception as exc:  # noqa: BLE001 - never take torchrun down
            log.warning("rankwatch: could not tell the agent how the workers ended (%s)", exc)
        return result

    setattr(monitor, _PATCHED, True)
    LocalElasticAgent._monitor_workers = monitor   # type: ignore[method-assign]
    return True


def watch_from_env() -> None:
    """In torchrun's own process under ``rankwatch run`` (``RANKWATCH_AGENT`` set; not a
    worker, which has ``TORCHELASTIC_RESTART_COUNT``), :func:`watch`.  Never raises."""
    agent = os.environ.get(AGENT_ENV)
    if not agent or "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return
    try:
        watch(Address.parse(agent), os.environ.get(NODE_ID_ENV) or socket.gethostname())
    except Exception as exc:  # noqa: BLE001 - torchrun runs on without it
        log.warning("rankwatch: torchrun's worker results not reported (%s)", exc)
