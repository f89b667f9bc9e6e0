"""The in-process recovery's network side: proving a process gone, and leaving a failed step.

* A worker's liveness port (:class:`Liveness`) lives exactly as long as its process, so a
  refused connection proves the process gone, in milliseconds, even when its node lives on.
* Gloo cannot cancel a pending collective; shutting a survivor's own connections of the
  failed groups (:func:`shut_group_sockets`) breaks its neighbours' collectives in turn.
  NCCL aborts its communicators (:func:`abort_nccl`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import Iterator, Mapping

__all__ = ["Liveness", "abort_nccl", "destroy_groups", "nccl_errors_to_caller", "refused", "shut_group_sockets",
           "store_endpoints", "tcp_sockets"]

log = logging.getLogger(__name__)


# -- liveness ------------------------------------------------------------------------------
class Liveness:
    """A listening socket that lives exactly as long as this process: a peer's connection to
    it is refused once the process is gone, even when the node lives on.  A daemon thread
    accepts and closes probes, so the backlog never fills while the process runs."""

    def __init__(self) -> None:
        import threading

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("0.0.0.0", 0))
        self._sock.listen(128)
        self.address = f"{socket.gethostname()}:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._drain, name="rankwatch-liveness", daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.close()

    def close(self) -> None:
        """Stop answering (as the process's end does); wakes the accepting thread."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def refused(address: str, timeout: float = 0.05) -> bool:
    """True when ``address`` refuses a connection: proof that its process is gone.  A timeout
    (a host down, a partition) proves nothing."""
    host, _, port = address.rpartition(":")
    if not host:
        return False
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


# -- the failed groups' connections -------------------------------------------------------
def tcp_sockets() -> set[tuple]:
    import psutil

    try:
        return {(c.fd, c.laddr, c.raddr) for c in psutil.Process().net_connections(kind="tcp") if c.raddr}
    except psutil.Error:
        return set()


def store_endpoints(env: Mapping[str, str]) -> set[tuple[str, int]]:
    """Connections that must survive: the stores' and the agent's."""
    from rankwatch.hooks.recovery.store import STORE_ENV

    out = set()
    for host, port in ((env.get("MASTER_ADDR"), env.get("MASTER_PORT")),
                       tuple((env.get(STORE_ENV) or ":").rpartition(":")[::2]),
                       tuple((env.get("RANKWATCH_AGENT") or ":").rpartition(":")[::2])):
        if host and port and port.isdigit():
            for info in _resolve(host, int(port)):
                out.add(info)
    return out


def _resolve(host: str, port: int) -> set[tuple[str, int]]:
    try:
        return {(ai[4][0], port) for ai in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
    except OSError:
        return {(host, port)}


def shut_group_sockets(baseline: set[tuple], keep: set[tuple[str, int]]) -> int:
    """Shut down this process's TCP connections opened since the tier started (the process
    groups'), but the stores' and the agent's.  Each peer's pending collective on them then
    fails at once, and so does that peer's, and so on: every survivor leaves the step."""
    import psutil

    shut = 0
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except psutil.Error:
        return 0
    for c in conns:
        if not c.raddr or c.fd < 0 or (c.fd, c.laddr, c.raddr) in baseline:
            continue
        ip = c.raddr.ip[len("::ffff:"):] if c.raddr.ip.startswith("::ffff:") else c.raddr.ip  # v4 on a v6 socket
        if (ip, c.raddr.port) in keep or (c.raddr.ip, c.raddr.port) in keep or c.status != psutil.CONN_ESTABLISHED:
            continue
        try:
            s = socket.socket(fileno=c.fd)
        except OSError:  # closed meanwhile (its group tore it down)
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            shut += 1
        except OSError:
            pass
        finally:
            s.detach()  # the fd stays the group's to close
    return shut


ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_ABORT_ONLY = "2"        # abort the communicators, keep the process
_TORCHRUN_DEFAULT = "1"  # what torchrun gives its workers unless told otherwise: abort, then exit


def nccl_errors_to_caller() -> None:
    """Make NCCL's watchdog abort a failed or timed-out collective's communicators and leave
    the process alive, so that the training thread sees the failure (in the step commit,
    :mod:`commit`) and the tier recovers in process.  torchrun's own setting (1)
    and PyTorch's default (3) end the process, and then only torchrun's restart recovers.
    Takes effect for process groups created after it."""
    mode = os.environ.get(ASYNC_ERROR_HANDLING)
    if mode == _ABORT_ONLY:
        return
    os.environ[ASYNC_ERROR_HANDLING] = _ABORT_ONLY
    log.log(logging.INFO if mode in (None, _TORCHRUN_DEFAULT) else logging.WARNING,
            "rankwatch: %s=%s (was %s): NCCL's watchdog aborts a failed collective and leaves the worker "
            "to the in-process recovery", ASYNC_ERROR_HANDLING, _ABORT_ONLY, mode or "unset")


def abort_nccl() -> bool:
    """Abort every NCCL communicator: a collective stuck on a dead peer returns at once.
    (Gloo has no such call: :func:`shut_group_sockets` does its part.)  False where no
    group was left to abort: NCCL's watchdog had aborted them first (torch then forgets the
    default group)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group

    if not dist.is_initialized():
        return False
    _abort_process_group()
    return True


def destroy_groups() -> None:
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a broken group may not tear down cleanly
        log.warning("rankwatch: tearing down the failed process groups: %s", exc)
        from torch.distributed import distributed_c10d as c10d

        c10d._world.default_pg = None  # the next init_process_group starts clean


def forget_old_meshes() -> None:
    """Clear DTensor's caches of sharding results, before a new generation's mesh is built.

    They are keyed by specs whose meshes compare equal by shape and rank order, not by their
    process groups.  A world that grows back to an earlier shape (a node lost, then a node
    joined) would otherwise be handed an earlier generation's mesh with its destroyed groups
    (``param.detach().full_tensor()`` then fails to resolve a group by name).  The caches are
    the training thread's own; this runs there."""
    try:
        import torch
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import _redistribute
        from torch.distributed.tensor._collective_utils import MeshTopoInfo

        clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
        if clear_native is not None:   # the C++ dispatch fast path's own cache
            clear_native()
        propagator = DTensor._op_dispatcher.sharding_propagator
        propagator.propagate_op_sharding.cache_clear()
        _redistribute._gen_transform_infos.cache_clear()
        _redistribute.clear_redistribute_planner_cache()
        MeshTopoInfo.build_from_mesh.cache_clear()
    except Exception as exc:  # noqa: BLE001 - private API: warn, the recovery goes on
        log.warning("rankwatch: could not clear DTensor's sharding caches (%s); a world that grows "
                    "back to an earlier shape may reuse stale process groups", exc)


@contextlib.contextmanager
def deferred_termination() -> Iterator[None]:
    """Hold a SIGTERM that arrives inside the block until its end, then deliver it.

    Only the main thread may change signal handlers; elsewhere the block runs as is."""
    pending: list[int] = []
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, _frame: pending.append(signum))
    except ValueError:   # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if pending:
            log.warning("rankwatch: a SIGTERM waited for this worker's recovery decision; it takes effect now")
            os.kill(os.getpid(), signal.SIGTERM)
