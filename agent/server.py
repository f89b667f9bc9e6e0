"""The node agent: its lifecycle, its parts, and the loop that sequences its detectors.

An :class:`Agent` owns the node's state (:class:`NodeState`), its detectors
(:class:`NodeWatch`), its link to the job (:class:`JobLink`, and the
:class:`Coordinator` it runs when it is the coordinator), its logs, and its
servers: gRPC (Unix socket, optional TCP; the RPCs are :mod:`.servicer`'s, what
they show :mod:`.views`') and HTTP /metrics (the collectors of :mod:`.export`).
It decides nothing itself: each decision lives in the module named for it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from concurrent import futures
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from rankwatch.agent import checkpoint_policy
from rankwatch.agent.export import otel
from rankwatch.address import Address
from rankwatch.agent.gate import Gate, StreamLimits
from rankwatch.agent.identity import RankStreams
from rankwatch.peercred import CredListener, PeerCred
from rankwatch.agent.tls import TlsConfig
from rankwatch.credentials import ClientCredentials
from rankwatch.agent.coordinator import Coordinator, PolicyConfig
from rankwatch.agent.decisions import Decision, DecisionLog
from rankwatch.agent.hang import HangConfig
from rankwatch.agent.export.host import HostCollector
from rankwatch.agent import bounds, goodput, views
from rankwatch.agent.export import storemetrics
from rankwatch.agent.restarting import shown_state
from rankwatch.agent.statedir import Snapshots, write_pointer
from rankwatch.agent.gpu import GpuCollector, GpuConfig, GpuMonitor, RankDevice
from rankwatch.agent.incidents import Incident, IncidentLog
from rankwatch.agent.export.jobmetrics import JobCollector
from rankwatch.agent.jobsync import CommandHub, JobLink, forward_checkpoint
from rankwatch.agent.export.metrics import NodeCollector
from rankwatch.agent.election import Election, parse_endpoints
from rankwatch.agent.recoveries import RecoveryLog
from rankwatch.agent.relay import Relay
from rankwatch.agent.relay_policy import RelayConfig
from rankwatch.agent.nodewatch import NodeWatch
from rankwatch.agent.rankexit import ExitConfig
from rankwatch.agent.servicer import Servicer
from rankwatch.agent.status_ranks import DEFAULT_MAX_RANKS
from rankwatch.agent.validate import clean_text
from rankwatch.agent.state import NodeState, RankState, Rejected
from rankwatch.agent.straggler import StragglerConfig
from rankwatch.proto import pb
from rankwatch.status import status_dict

__all__ = ["Agent", "AgentConfig"]

log = logging.getLogger(__name__)

_MAX_MESSAGE = 16 << 20
_MAX_RPCS = 512


class AgentConfig:
    """Args:
        node_id: this node's id (the ``node`` label).
        listen: addresses to serve gRPC on; Unix sockets get mode 0600.
        metrics_port: HTTP port for ``/metrics``; 0 picks a free one, None disables.
        metrics_addr: interface for ``/metrics``.
        state_dir: where incidents are kept (``incidents.jsonl``); None keeps them in memory.
        hang: hang-detection thresholds.
        straggler: straggler-detection thresholds.
        coordinators: the job's coordinator candidates, in node-rank order (this agent's own
            address may be among them); empty: this agent coordinates its node alone.
        policy: the coordinator's policy (exclusions, minimum nodes).
        token: the job's shared token: every TCP call needs it, and Sync and
            RequestCheckpoint on the socket too (None: no check).
        tls: mutual TLS for the TCP listeners and for calls to the coordinator (None: plain TCP).
        streams: stream caps, the server threads kept for control calls, the hello deadline.
        gpu: GPU health source and thresholds (default: NVML if it initialises, else none).
        exits: how long a rank's broken stream is watched for its process's exit.
        election: ``etcd://HOST:PORT[,...]``: the coordinator is whichever agent of ``job_id``
            holds the coordinator key in etcd (:mod:`.election`); needs a TCP ``listen``.
        advertise: this agent's address for the other agents (default: its first TCP one).
        rank_grace: seconds a disconnected rank stays in /metrics.
        status_max_ranks: the most ranks a ``Status`` answer lists unless asked for all
            (:mod:`.status_ranks`).
        relay: how a big job's nodes are grouped behind relays (:mod:`.relay_policy`; the
            coordinator's setting).
    """

    def __init__(self, *, node_id: str, listen: list[Address], metrics_port: int | None = 9478,
                 metrics_addr: str = "0.0.0.0", state_dir: Path | None = None,
                 hang: HangConfig | None = None, straggler: StragglerConfig | None = None,
                 coordinators: list[Address] | None = None, policy: PolicyConfig | None = None,
                 sync_interval: float = 0.25, token: str | None = None, gpu: GpuConfig | None = None,
                 exits: ExitConfig | None = None, election: str | None = None, job_id: str = "",
                 advertise: str | None = None, tls: TlsConfig | None = None,
                 streams: StreamLimits | None = None, rank_grace: float = 60.0,
                 status_max_ranks: int = DEFAULT_MAX_RANKS, relay: RelayConfig | None = None) -> None:
        if not listen:
            raise ValueError("AgentConfig.listen needs at least one address")
        if election is not None:
            parse_endpoints(election)
            if not job_id or "/" in job_id or len(job_id) > 128:
                raise ValueError("an election needs a job id (--job-id: 1-128 characters, no '/')")
            if coordinators:
                raise ValueError("an election and a --coordinator list exclude each other")
            if all(a.is_unix for a in listen) and advertise is None:
                raise ValueError("an election needs a TCP address the other agents reach (--listen HOST:PORT)")
        if status_max_ranks < 1:
            raise ValueError(f"AgentConfig.status_max_ranks {status_max_ranks} must be at least 1")
        if metrics_port is not None and not 0 <= metrics_port < 65536:
            raise ValueError(f"AgentConfig.metrics_port {metrics_port} out of range")
        self.node_id, self.listen = node_id, listen
        self.metrics_port, self.metrics_addr = metrics_port, metrics_addr
        self.state_dir = state_dir
        self.hang = hang or HangConfig()
        self.straggler = straggler or StragglerConfig()
        self.coordinators = list(coordinators or [])
        self.policy = policy or PolicyConfig()
        self.sync_interval = sync_interval
        self.token = token
        self.gpu = gpu or GpuConfig()
        self.exits = exits or ExitConfig()
        self.election, self.job_id, self.advertise = election, job_id, advertise
        self.tls = tls
        self.rank_grace = rank_grace
        self.status_max_ranks = status_max_ranks
        self.streams = streams or StreamLimits()
        self.relay = relay or RelayConfig()

    def client_credentials(self) -> ClientCredentials:
        """What this agent presents when it calls another agent (its coordinator)."""
        return self.tls.client_credentials(self.token) if self.tls else ClientCredentials(self.token)


class Agent:
    """One node's agent.  ``start()`` returns once it serves; ``stop()`` shuts it down."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.state = NodeState(config.node_id)
        self.incidents = IncidentLog(config.state_dir / "incidents.jsonl" if config.state_dir else None)
        self.state.incidents = self.incidents.items
        self.decision_log = DecisionLog(config.state_dir / "decisions.jsonl" if config.state_dir else None)
        self.watch = NodeWatch(self.state, self.incidents, hang=config.hang, straggler=config.straggler,
                               exits=config.exits, gpu_throttle=self.gpu_throttle_for_rank)
        self._detector: threading.Thread | None = None
        self.coordinator = Coordinator(config.node_id, incidents=self.incidents, decisions=self.decision_log,
                                       hang=config.hang,
                                       straggler=config.straggler, policy=config.policy,
                                       on_incident=self._own_job_incident,
                                       refusals=lambda: self.gate.capacity_refusals(), relay=config.relay)
        self.commands = CommandHub()
        self.relay: Relay | None = None
        """This agent as a relay for its group (set once it serves TCP)."""
        self.link = JobLink(self, config.coordinators, config.sync_interval, elected=config.election is not None)
        self.progress = goodput.StepProgress()
        self._checkpoint_steps = bounds.RecentSet(4096)   # (step, ok) keys already recorded
        self.recoveries = RecoveryLog(config.node_id, self.incidents)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeCollector(self.state, lambda: self.watch.straggler_view, config.rank_grace))
        self.registry.register(JobCollector(self))
        self.registry.register(storemetrics.StorageCollector(self))
        self.registry.register(HostCollector(config.node_id, self._rank_pids))
        self.gpu = GpuMonitor(config.node_id, config.gpu, self.incidents, self._rank_devices)
        self.gpu_listeners = self.gpu.listeners  # called with every fatal and risk GpuEvent
        self.gpu_listeners.append(self._on_gpu_event)
        self._risk_requested: dict[tuple[int, str], float] = {}
        self._pending_risk: str | None = None
        self.registry.register(GpuCollector(self.gpu))
        self.gate = Gate(config.token, config.streams, node=config.node_id,
                         on_unauthenticated=lambda method, peer: self.state.note_rejected(
                             Rejected("unauthenticated", f"{method} from {peer}")))
        self.registry.register(self.gate)
        self.rank_streams = RankStreams()
        self._creds: list[CredListener] = []
        self._grpc: grpc.Server | None = None
        self._http: Any = None
        self.metrics_port: int | None = None
        self.tcp_ports: list[int] = []
        self._stopped = threading.Event()
        self._owns_sockets = False
        self._otel: otel.OtelExport | None = None
        self._snapshots = Snapshots(config.state_dir, lambda: status_dict(views.status_response(self)),
                                    lambda: self.incidents.run_id)

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> None:
        # /metrics first: once gRPC answers, Status must report the metrics port.
        if self.config.metrics_port is not None:
            self._http, _ = start_http_server(self.config.metrics_port, self.config.metrics_addr,
                                              registry=self.registry)
            self.metrics_port = self._http.server_port
        self._otel = otel.install(self)
        try:
            self._start_grpc()
            me = self.advertised()
            if me and (self.config.coordinators or self.config.election is not None):
                self.relay = Relay(me, cfg=self.config.relay)   # a node of a job of several can relay
            self.gpu.start()
        except BaseException:
            self.stop(timedelta(0))
            raise
        self._detector = threading.Thread(target=self._detect_loop, name="rankwatch-detect", daemon=True)
        self._detector.start()
        if self.config.election is not None:
            self.link.election = self._election(self.config.election)
        self.link.start()
        if self.config.state_dir is not None:
            write_pointer(self.config.listen, self.config.state_dir)
        log.info("agent %s serving gRPC on %s, /metrics on port %s", self.config.node_id,
                 ", ".join(map(str, self.config.listen)), self.metrics_port)

    def _start_grpc(self) -> None:
        server = grpc.server(
            # Streams never take more than limits.total threads: the rest serve control calls.
            futures.ThreadPoolExecutor(max_workers=self.gate.limits.threads,
                                       thread_name_prefix="rankwatch-grpc"),
            interceptors=(self.gate,),
            maximum_concurrent_rpcs=_MAX_RPCS,
            options=[("grpc.max_receive_message_length", _MAX_MESSAGE),
                     ("grpc.max_send_message_length", _MAX_MESSAGE),
                     ("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((Servicer(self).handlers(),))
        # Sockets are made 0600 from the start (chmod below only confirms it): no moment with
        # the process's default mode (the agent's threads create no other files meanwhile).
        for addr in self.config.listen:
            if addr.is_unix:
                _prepare_socket_path(addr.path)  # type: ignore[arg-type]
        umask = os.umask(0o177)
        try:
            self._bind(server)
        finally:
            os.umask(umask)
        for addr in self.config.listen:
            if addr.is_unix:
                os.chmod(addr.path, 0o600)  # type: ignore[arg-type]
                self._creds.append(CredListener(addr.path))  # type: ignore[arg-type]
                self._creds[-1].start()
        self._grpc = server
        self._owns_sockets = True

    def _bind(self, server: grpc.Server) -> None:
        for addr in self.config.listen:
            if addr.is_unix:
                server.add_insecure_port(addr.grpc_target())
            elif self.config.tls is not None:
                self.tcp_ports.append(server.add_secure_port(addr.grpc_target(),
                                                             self.config.tls.server_credentials()))
            else:
                self.tcp_ports.append(server.add_insecure_port(addr.grpc_target()))
        server.start()

    def advertised(self) -> str:
        """This agent's address for the other agents ('' if it serves no TCP address)."""
        if self.config.advertise is not None:
            return self.config.advertise
        tcp = next((a for a in self.config.listen if not a.is_unix), None)
        if tcp is None or not self.tcp_ports:
            return ""
        host = tcp.host if tcp.host not in ("0.0.0.0", "::", "") else socket.getfqdn()
        return f"{host}:{self.tcp_ports[0]}"

    def _election(self, endpoints: str) -> Election:
        """Campaign for the job's coordinator key under this agent's TCP address."""
        election = Election(parse_endpoints(endpoints), self.config.job_id, self.advertised())
        self.decision_log.sink = election.decisions.append
        return election

    def peer_cred(self, nonce: bytes) -> PeerCred | None:
        """Who presented ``nonce`` on a credentials socket (rankwatch/peercred.py)."""
        for listener in self._creds:
            cred = listener.take(nonce)
            if cred is not None:
                return cred
        return None

    def stop(self, grace: timedelta = timedelta(seconds=1)) -> None:
        self._stopped.set()
        self.link.stop()
        self.gpu.stop()
        if self._detector is not None:
            self._detector.join(2)
            self._snapshots.write()  # the last view, for status and diagnose once the agent is gone
        if self._grpc is not None:
            self._grpc.stop(grace.total_seconds()).wait()
            self._grpc = None
        for listener in self._creds:
            listener.stop()
        self._creds.clear()
        if self._otel is not None:
            self._otel.shutdown()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._owns_sockets:
            for addr in self.config.listen:
                if addr.is_unix and os.path.exists(addr.path):  # type: ignore[arg-type]
                    os.unlink(addr.path)  # type: ignore[arg-type]
            self._owns_sockets = False
        self._stopped.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        return self._stopped.wait(timeout.total_seconds() if timeout else None)

    # -- detection ------------------------------------------------------------
    def _detect_loop(self) -> None:
        while not self._stopped.wait(0.25):
            try:
                now = self.state.clock()
                watch = self.watch
                if self.link.generation > 0:
                    watch.forget_gone(now)
                watch.unmark_progressed()
                self._observe_progress(now)
                watch.check_exits(now, restarts=(d.decided_at for d in self.decisions() if d.kind == "exclude"))
                if self.is_coordinator():
                    self.coordinator.evaluate()
                elif not self.link.coordinated(now):
                    watch.check_hang(now)
                # This node's ranks against each other; the coordinator compares nodes.
                watch.check_stragglers(now)
                if self._pending_risk and any(r.connected and r.steps_completed
                                              for r in self.state.snapshot()):
                    self._risk_checkpoint(self._pending_risk)
                self._snapshots.maybe_write(now)
            except Exception:  # noqa: BLE001 - the agent never dies of a detector bug
                log.exception("detector error")

    # -- the job: coordinator, commands ------------------------------------------
    def serves(self, addr: Address) -> bool:
        return any(str(addr) == str(mine) for mine in self.config.listen)

    def summary(self, seq: int) -> pb.NodeSummary:
        """This node's compact summary for the coordinator (:func:`views.node_summary`)."""
        return views.node_summary(self, seq)

    def _observe_progress(self, now: float) -> None:
        ranks = self.state.snapshot()
        live = [r for r in ranks if r.connected]
        self.progress.observe(now, [r.step for r in live], max((r.step_seconds for r in ranks), default=0.0),
                              [(r.pid, r.step, r.steps_completed) for r in live])

    def goodput(self, now: float) -> dict[str, float] | None:
        """Where the job's time went (:func:`goodput.breakdown` over this agent's view)."""
        return goodput.breakdown(now, incidents=self.incident_view(), decisions=self.decisions(),
                                 progress=self.progress.snapshot())

    def restarting(self, state: str, last_seen: float, now: float) -> bool:
        """Whether a dead rank's worker was stopped by a restart (:mod:`restarting`)."""
        return shown_state(state, last_seen=last_seen, now=now,
                           restarts=[d.decided_at for d in self.decisions() if d.kind == "exclude"]) == "restarting"

    def is_coordinator(self) -> bool:
        return self.link.coordinates_job

    def decisions(self) -> list[Decision]:
        """The job's decisions this agent made or applied (one log, whether it coordinates or not)."""
        return self.decision_log.items

    def incident_view(self) -> list[Incident]:
        """This agent's incidents, plus, on the coordinator, the other nodes' own."""
        with self.state.lock:
            items = list(self.state.incidents)
        if self.is_coordinator():
            items += [i for i in self.coordinator.job_incidents() if i.node != self.state.node_id]
        return items

    def on_checkpoints(self, rank: RankState, records: Any) -> None:
        """A rank finished (or failed) a save: one ``checkpoint`` incident per step and node."""
        for rec in records:
            if rec.request_id:
                self.commands.done(rec.request_id)
            key = rec.step if rec.ok else -rec.step - 1
            with self.state.lock:
                if key in self._checkpoint_steps:
                    continue
                self._checkpoint_steps.add(key)
            decision = self.decision_log.get(rec.request_id) if rec.request_id else None
            reason = decision.reason if decision is not None else "periodic"
            complete_after = max(rec.completed_after, rec.duration)
            detail = {"step": rec.step, "ok": rec.ok, "seconds": round(rec.duration, 6),
                      "complete_seconds": round(complete_after, 6), "asynchronous": rec.asynchronous,
                      "path": clean_text(rec.path), "request": rec.request_id or None, "reason": reason,
                      "started_at": rec.started_at}
            if not rec.ok:
                detail["error"] = clean_text(rec.error)
            self.incidents.add(kind="checkpoint", node=self.state.node_id, rank=rank.rank, step=rec.step,
                               detected_at=rec.started_at + complete_after, detail=detail)
            (log.info if rec.ok else log.warning)(
                "checkpoint at step %d %s (training thread %.3fs, complete after %.2fs, %s)", rec.step,
                "saved" if rec.ok else "FAILED", rec.duration, complete_after, reason)

    def on_recoveries(self, rank: RankState, records: Any) -> None:
        """A rank reports in-process recoveries: each valid one moves the rank into its new
        world and is recorded once per recovery and node (:mod:`.recoveries`)."""
        for rec in self.state.take_recoveries(rank, records):
            inc = self.recoveries.record(rank.rank, rec)
            if inc is not None:
                (log.warning if rec.ok else log.error)(
                    "in-process recovery after step %d %s: world %d -> %d%s", rec.step,
                    "done" if rec.ok else "FAILED", rec.old_world_size, rec.new_world_size,
                    f" ({clean_text(rec.error, 200)})" if rec.error else "")

    def on_exclusion(self, decision: Decision) -> None:
        """A coordinator decision: mark this node's ranks excluded, or forget old-generation ranks."""
        if decision.node == self.state.node_id:
            self.watch.exclude_all()
            log.warning("this node is excluded from the job: %s", decision.reason)

    def on_job_incident(self, coordinator: str, inc: pb.Incident) -> None:
        """A job incident the coordinator decided about one of this node's ranks.

        Kept under ``<coordinator>/<id>``; a later change (its resolution) is recorded as an
        update of the copy, so this node's file tells the story too.
        """
        incident = Incident.from_pb(inc, id=f"{coordinator}/{inc.id}")
        if self.incidents.merge(incident):
            self.watch.mark(incident)
            return
        self.incidents.update(incident.id, **incident.detail)
        if incident.resolved_at is not None:
            self.watch.lift(incident)

    def _own_job_incident(self, incident: Incident) -> None:
        """The coordinator's verdict about a rank of the coordinator's own node."""
        if incident.node != self.state.node_id:
            return
        if incident.resolved_at is not None:
            self.watch.lift(incident)
        else:
            self.watch.mark(incident)

    def _on_gpu_event(self, event: Any) -> None:
        """A GPU risk (rising ECC, a pending row remap, throttling): checkpoint while it is cheap.

        Fatal faults need nothing here: they are ``gpu_fault`` incidents, which reach the
        coordinator in this node's summary, and its policy excludes the node.
        """
        if event.kind != "risk":
            return
        key = (event.gpu, event.reason)
        if not checkpoint_policy.risk_due(event.at, self._risk_requested.get(key)):
            return
        self._risk_requested[key] = event.at
        self._risk_checkpoint(f"gpu risk: {event.reason} on gpu {event.gpu} of {event.node}")

    def _risk_checkpoint(self, reason: str) -> None:
        reply = self.checkpoint(reason)
        # Before the job's first step there is nothing to save yet: ask again once it trains.
        self._pending_risk = reason if not reply.accepted and "no rank" in reply.message else None
        log.warning("%s: checkpoint %s", reason, f"at step {reply.step}" if reply.accepted
                    else f"not taken yet ({reply.message})")

    def checkpoint(self, reason: str) -> pb.CheckpointReply:
        """Ask the job for a checkpoint: through the coordinator, or this agent's own node."""
        if not self.link.acting and self.link.coordinator_addr is not None:
            try:
                return forward_checkpoint(self.link.coordinator_addr, reason,
                                          self.config.client_credentials())
            except grpc.RpcError as exc:
                return pb.CheckpointReply(accepted=False, message=f"coordinator unreachable: {exc.code().name}")
        try:
            d = self.coordinator.request_checkpoint(reason)
        except LookupError as exc:
            return pb.CheckpointReply(accepted=False, message=str(exc))
        self.commands.publish_checkpoint(d)
        return pb.CheckpointReply(accepted=True, step=d.step, id=d.id,
                                  message=f"every rank saves after step {d.step}")

    def gpu_throttle_for_rank(self, rank: int) -> list[str]:
        """Slowdown reasons active on the GPU this node's ``rank`` uses; [] if none or no GPU."""
        r = self.state.ranks.get(rank)
        return (self.gpu.throttle_for_rank(RankDevice(r.rank, r.device, r.local_rank, r.step,
                                                      r.device_uuid)) if r is not None else [])

    def _rank_devices(self) -> list[RankDevice]:
        """The node's ranks that are streaming, or were in the last minute (a GPU fault may kill them)."""
        now = self.state.clock()
        return [RankDevice(r.rank, r.device, r.local_rank, r.step, r.device_uuid)
                for r in self.state.snapshot()
                if r.connected or now - r.last_seen < 60]

    def _rank_pids(self) -> dict[int, int]:
        return {r.rank: r.pid for r in self.state.snapshot() if r.connected}


def _prepare_socket_path(path: str) -> None:
    """Make the socket's directory (0700 if we create it) and clear a stale socket.

    Raises:
        RuntimeError: another agent is listening on ``path``.
    """
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody home: a crashed agent's leftover
        else:
            raise RuntimeError(f"an agent is already listening on {path}")
        finally:
            probe.close()
