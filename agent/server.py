"""The node agent: its lifecycle, its parts, and the loop that sequences its detectors.

An :class:`Agent` owns the node's state (:class:`NodeState`), its detectors
(:class:`NodeWatch`), its link to the job (:class:`JobLink`, and the
:class:`Coordinator` it runs when it is the coordinator), its logs, and its
servers (:mod:`.rpc.listeners`): gRPC (Unix socket, optional TCP; the RPCs are
:mod:`.rpc.servicer`'s, what they show :mod:`.views.answer`') and HTTP: /metrics (the
collectors of :mod:`.export`) and the browser page (:mod:`.export.web`).

It is the one place that wires the parts together: each part is handed what it reads
(each RPC its parts, :mod:`.rpc.servicer`; the link its :class:`LinkParts`, the views and
exporters the state, :class:`JobKnowledge` and the storage report), never the agent.
It decides nothing itself: each decision lives in the module named for it.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from datetime import timedelta
from typing import Any

from prometheus_client import CollectorRegistry

from rankwatch.agent.export import otel
from rankwatch.agent.rpc.gate import Gate
from rankwatch.agent.rpc.identity import RankStreams
from rankwatch.agent.rpc.listeners import Listeners
from rankwatch.agent.job.coordinator import Coordinator
from rankwatch.agent.durable.decisions import Decision, DecisionLog
from rankwatch.agent.export.prom_host import HostCollector
from rankwatch.agent.job import goodput
from rankwatch.agent.views import answer
from rankwatch.agent.export.prom_store import StorageCollector
from rankwatch.agent.export.prom_refusals import GateCollector
from rankwatch.agent.export.prom_exits import ExitCollector
from rankwatch.agent.export.prom_bound import BoundCollector
from rankwatch.agent.export.prom_pipeline import BalanceCollector
from rankwatch.agent.export.web import page_routes
from rankwatch.agent.views.live import LiveView
from rankwatch.agent.views.step_bound import StepBound
from rankwatch.agent.views.work_spread import BalanceWatch
from rankwatch.agent.durable.storage import storage_report
from rankwatch.agent.link.known import JobKnowledge
from rankwatch.agent.durable.statedir import Snapshots, write_pointer
from rankwatch.agent.config import AgentConfig
from rankwatch.agent.node.checkpoints import NodeCheckpoints
from rankwatch.agent.gpu import GpuCollector, GpuMonitor, RankDevice
from rankwatch.agent.detect.hang_side import hang_side
from rankwatch.agent.node import makeup
from rankwatch.agent.durable.incidents import Incident, IncidentLog
from rankwatch.agent.export.prom_job import JobCollector
from rankwatch.agent.rpc.command_stream import CommandHub
from rankwatch.agent.link.link_parts import ask_checkpoint
from rankwatch.agent.link.uplink import JobLink, LinkParts
from rankwatch.agent.export.prom_node import NodeCollector
from rankwatch.agent.link.election import Election, parse_endpoints
from rankwatch.agent.node.recoveries import RecoveryLog
from rankwatch.agent.relays.relay import Relay
from rankwatch.agent.node.rank_snapshot import device_of, rank_devices
from rankwatch.agent.node.sweep import NodeWatch
from rankwatch.agent.node.verdicts import JobVerdicts
from rankwatch.agent.rpc.servicer import ControlParts, ReportParts, Servicer, SyncParts
from rankwatch.agent.wire.ranges import clean_text
from rankwatch.agent.node.intake import OPS, NodeState, RankState, Rejected
from rankwatch.agent.durable.steplog import StepLog
from rankwatch.proto import pb
from rankwatch.status import status_dict

__all__ = ["Agent", "AgentConfig"]

log = logging.getLogger(__name__)


class Agent:
    """One node's agent.  ``start()`` returns once it serves; ``stop()`` shuts it down."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.state = NodeState(config.node_id)
        self.instance = secrets.token_hex(16)
        """This agent's instance id: its summaries carry it, nothing shows it (:mod:`.job.claims`)."""
        self.incidents = IncidentLog(config.state_dir / "incidents.jsonl" if config.state_dir else None)
        self.state.incidents = self.incidents.items
        self.history = StepLog.attach(self.state, config.state_dir, OPS, config.history_bytes)
        """Its ranks' step history in the state directory (None: none kept)."""
        self.decision_log = DecisionLog(config.state_dir / "decisions.jsonl" if config.state_dir else None)
        self.watch = NodeWatch(self.state, self.incidents, hang=config.hang, straggler=config.straggler,
                               exits=config.exits, gpu_throttle=self.gpu_throttle_for_rank)
        self._detector: threading.Thread | None = None
        self.verdicts = JobVerdicts(self.state.node_id, self.incidents, self.watch)
        """The coordinator's decisions and verdicts about this node's ranks, applied to them."""
        self.coordinator = Coordinator(config.node_id, incidents=self.incidents, decisions=self.decision_log,
                                       hang=config.hang,
                                       straggler=config.straggler, policy=config.policy,
                                       on_incident=lambda inc: self.verdicts.own_job_incident(inc),
                                       refusals=lambda: self.gate.capacity_refusals(), relay=config.relay)
        self.commands = CommandHub()
        self.relay: Relay | None = None
        """This agent as a relay for its group (set once it serves TCP)."""
        self.link = JobLink(LinkParts(config=config, decision_log=self.decision_log, coordinator=self.coordinator,
                                      summary=self.summary, relay=lambda: self.relay,
                                      on_checkpoint=self.commands.publish_checkpoint,
                                      on_exclusion=lambda d: self.verdicts.exclusion(d),
                                      on_job_incident=self.on_job_incident),
                            config.coordinators, config.sync_interval, elected=config.election is not None)
        self.progress = goodput.StepProgress()
        self.job = JobKnowledge(self.state, self.decision_log, self.coordinator,
                                coordinates=self.is_coordinator, coordinator_node=lambda: self.link.coordinator_node,
                                progress=self.progress, relay=lambda: self.relay)
        """What this agent knows of the job: the views and the job's exporter read it."""
        self.recoveries = RecoveryLog(config.node_id, self.incidents)
        self.bound = StepBound(self.is_coordinator)
        """What bounds this node's ranks' steps, and the job's while coordinating (:mod:`.views.step_bound`)."""
        self.balance = BalanceWatch()
        """How the work falls over pipeline stages and experts (:mod:`.detect.imbalance`)."""
        self.gpu = GpuMonitor(config.node_id, config.gpu, self.incidents, self._rank_devices)
        self.gpu_listeners = self.gpu.listeners  # called with every fatal and risk GpuEvent
        self.checkpoints = NodeCheckpoints(config.node_id, self.incidents, self.decision_log, self.commands.done,
                                           ask=self.checkpoint)
        self.gpu_listeners.append(self.checkpoints.on_gpu_event)
        self.gate = Gate(config.token, config.streams, node=config.node_id,
                         on_unauthenticated=lambda method, peer: self.state.note_rejected(
                             Rejected("unauthenticated", f"{method} from {peer}")))
        self.gate.tls = config.tls is not None   # a Sync speaks only for its certificate's node
        self.registry = self._exporters()
        self.rank_streams = RankStreams(seat=self.gate.identify_report)
        self.servers = Listeners(config)
        self.peer_cred = self.servers.peer_cred
        """Who presented a nonce on a credentials socket (the servicer's Hello asks)."""
        self._stopped = threading.Event()
        self._otel: otel.OtelExport | None = None
        self._snapshots = Snapshots(config.state_dir, lambda: status_dict(self.status()),
                                    lambda: self.incidents.run_id)

    def _exporters(self) -> CollectorRegistry:
        """/metrics: each collector given what it reads."""
        node = self.config.node_id
        registry = CollectorRegistry(auto_describe=False)
        for collector in (NodeCollector(self.state, lambda: self.watch.straggler_view, self.config.rank_grace),
                          JobCollector(node, self.state.clock, self.job, self.recoveries),
                          StorageCollector(node, self.incidents, self.decision_log),
                          ExitCollector(node, lambda: self.watch.exit_counts),
                          BoundCollector(node, self.bound.verdicts), BalanceCollector(node, self.balance.findings),
                          HostCollector(node, self._rank_pids), GpuCollector(self.gpu), GateCollector(node, self.gate)):
            registry.register(collector)
        return registry

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> None:
        # /metrics (and the page beside it) first: once gRPC answers, Status must report the port.
        self.servers.serve_metrics(self.registry, page_routes(LiveView(self.status), self.config.token))
        self._otel = otel.install(self.config.node_id, self.state, self.incidents, self.gpu)
        try:
            self.servers.serve_grpc(self._servicer().handlers(), self.gate)
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

    @property
    def metrics_port(self) -> int | None:
        """The port /metrics serves on (None: not served)."""
        return self.servers.metrics_port

    def advertised(self) -> str:
        """This agent's address for the other agents ('' if it serves no TCP address)."""
        return self.servers.advertised()

    def _election(self, endpoints: str) -> Election:
        """Campaign for the job's coordinator key under this agent's TCP address."""
        election = Election(parse_endpoints(endpoints), self.config.job_id, self.advertised())
        self.decision_log.sink = election.decisions.append
        return election

    def stop(self, grace: timedelta = timedelta(seconds=1)) -> None:
        self._stopped.set()
        self.link.stop()
        self.gpu.stop()
        if self._detector is not None:
            self._detector.join(2)
            self._final_exits()
            self._snapshots.write()  # the last view, for status and diagnose once the agent is gone
        self.servers.stop_grpc(grace)
        if self.history is not None:
            self.history.close()
        if self._otel is not None:
            self._otel.shutdown()
        self.servers.stop()
        self._stopped.set()

    def _final_exits(self) -> None:
        """The rank exits still waiting for evidence, recorded before the agent goes."""
        try:
            self.watch.check_exits(self.state.clock(), final=True)
        except Exception:  # noqa: BLE001 - stopping never fails
            log.exception("rank exits at stop")

    def wait(self, timeout: timedelta | None = None) -> bool:
        return self._stopped.wait(timeout.total_seconds() if timeout else None)

    # -- detection ------------------------------------------------------------
    def _detect_loop(self) -> None:
        woke = time.monotonic()
        while not self._stopped.wait(0.25):
            try:
                late, woke = time.monotonic() - woke - 0.25, time.monotonic()
                if self.relay is not None:   # a paused relay vouches for no node's absence
                    self.relay.woke_late(late)
                now = self.state.clock()
                watch = self.watch
                if self.link.generation > 0:
                    watch.forget_gone(now)
                watch.unmark_progressed()
                self._observe_progress(now)
                watch.check_exits(now, restarts=(d.decided_at for d in self.decisions() if d.kind == "exclude"))
                side = hang_side(coordinator=self.is_coordinator(), covered=self.link.coordinated(now))
                if side == "job":
                    self.coordinator.evaluate()
                elif side == "node":
                    watch.check_hang(now)
                # This node's ranks against each other; the coordinator compares nodes.
                watch.check_stragglers(now)
                self._check_bottleneck(now)
                if self.checkpoints.pending_risk and any(r.connected and r.steps_completed
                                                         for r in self.state.snapshot()):
                    self.checkpoints.ask_for_risk(self.checkpoints.pending_risk)
                self._snapshots.maybe_write(now)
            except Exception:  # noqa: BLE001 - the agent never dies of a detector bug
                log.exception("detector error")

    def _check_bottleneck(self, now: float) -> None:
        """What bounds the node's ranks' steps, every tick, and the job's once a second on the
        coordinator (:mod:`.views.step_bound`); the pipeline stages' and experts' balance with
        the job's (:mod:`.views.work_spread`)."""
        node = makeup.node_part(self.state, self.bound.node.cfg, self._gpu_utilization)
        if self.bound.update(now, node, lambda: self.coordinator.view.makeups(now)):
            self.balance.update(self.state, self.coordinator.view if self.is_coordinator() else None)

    def _servicer(self) -> Servicer:
        """The RPCs, each handed the parts it uses."""
        def run_id(job_id: str) -> None:
            self.incidents.run_id = self.decision_log.run_id = job_id

        report = ReportParts(state=self.state, rank_streams=self.rank_streams, peer_cred=self.peer_cred,
                             run_id=run_id, exit_evidence=self.watch.exit_evidence,
                             stream_broke=self.watch.stream_broke, checkpoints=self.checkpoints.recorded,
                             recoveries=self.on_recoveries)
        sync = SyncParts(node_id=self.config.node_id, coordinator=self.coordinator, coordinates=self.is_coordinator,
                         relay=lambda: self.relay)
        control = ControlParts(token=self.config.token, state=self.state, commands=self.commands,
                               status=self.status, checkpoint=self.checkpoint,
                               exit_evidence=self.watch.exit_evidence)
        return Servicer(report, sync, control)

    # -- what it shows ------------------------------------------------------------
    def status(self, request: pb.StatusRequest | None = None) -> pb.StatusResponse:
        """The agent's ``Status`` answer (:func:`answer.status_response`)."""
        storage = storage_report(self.incidents, self.decision_log, self.history)
        return answer.status_response(self.state, self.job, storage,
                                     metrics_port=self.metrics_port, max_ranks=self.config.status_max_ranks,
                                     request=request, bottleneck=self.bound.shown(),
                                     balance=self.balance.shown())

    def summary(self, seq: int) -> pb.NodeSummary:
        """This node's compact summary for the coordinator (:func:`answer.node_summary`)."""
        return answer.node_summary(self.state, seq, decisions=self.decision_log.items, run_id=self.incidents.run_id,
                                  relay_address=self.relay.address if self.relay is not None else None,
                                  step_period=self.watch.step_period, makeup=self.bound.node.part,
                                  instance=self.instance)

    def _observe_progress(self, now: float) -> None:
        ranks = self.state.snapshot()
        live = [r for r in ranks if r.connected]
        self.progress.observe(now, [r.step for r in live], max((r.step_seconds for r in ranks), default=0.0),
                              [(r.pid, r.step, r.steps_completed) for r in live])

    def goodput(self, now: float) -> dict[str, float] | None:
        """Where the job's time went (:meth:`JobKnowledge.goodput`)."""
        return self.job.goodput(now)

    def is_coordinator(self) -> bool:
        return self.link.coordinates_job

    def decisions(self) -> list[Decision]:
        """The job's decisions this agent made or applied (one log, whether it coordinates or not)."""
        return self.decision_log.items

    def incident_view(self) -> list[Incident]:
        """This agent's incidents, plus, on the coordinator, the other nodes' own."""
        return self.job.incidents()

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

    def on_job_incident(self, coordinator: str, inc: pb.Incident) -> None:
        """A job incident the coordinator decided about one of this node's ranks (:mod:`.node.verdicts`)."""
        self.verdicts.job_incident(coordinator, inc)

    def checkpoint(self, reason: str) -> pb.CheckpointReply:
        """Ask the job for a checkpoint: through the coordinator, or this agent's own node."""
        forward = self.link.coordinator_addr if not self.link.acting else None
        return ask_checkpoint(reason, forward, self.config.client_credentials, self.coordinator.request_checkpoint,
                              self.commands.publish_checkpoint)

    def gpu_throttle_for_rank(self, rank: int) -> list[str]:
        """Slowdown reasons active on the GPU this node's ``rank`` uses; [] if none or no GPU."""
        r = self.state.ranks.get(rank)
        return self.gpu.throttle_for_rank(device_of(r)) if r is not None else []

    def _rank_devices(self) -> list[RankDevice]:
        return rank_devices(self.state)

    def _gpu_utilization(self) -> float | None:
        """The mean utilisation of the GPUs this node's ranks use (None: no GPU reading)."""
        return self.gpu.utilization(rank_devices(self.state))

    def _rank_pids(self) -> dict[int, int]:
        return {r.rank: r.pid for r in self.state.snapshot() if r.connected}
