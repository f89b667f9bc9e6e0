"""The node agent's servers: gRPC (Unix socket, optional TCP) and HTTP /metrics.

The gRPC handlers are registered by hand, not through the generated
``add_AgentServicer_to_server``, so that a message that fails to decode is
counted and logged by the agent before gRPC refuses it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import grpc
import numpy as np
from prometheus_client import CollectorRegistry, start_http_server

from rankwatch.agent import otel
from rankwatch.address import Address
from rankwatch.agent.auth import authorized
from rankwatch.agent.coordinator import Coordinator, PolicyConfig
from rankwatch.agent.decisions import Decision, DecisionLog
from rankwatch.agent.hangend import hang_end, steps_at
from rankwatch.agent.restarting import shown_state
from rankwatch.agent.statedir import Snapshots, write_pointer
from rankwatch.agent.hang import HangConfig, RankProgress, detect_hang, flight_recorder_evidence
from rankwatch.agent.host import HostCollector
from rankwatch.agent import goodput, oplatency
from rankwatch.agent.gpu import GpuCollector, GpuConfig, GpuMonitor, RankDevice
from rankwatch.agent.incidents import Incident, IncidentLog
from rankwatch.agent.jobmetrics import JobCollector
from rankwatch.agent.jobsync import CommandHub, JobLink, forward_checkpoint, summary_incidents
from rankwatch.agent.metrics import NodeCollector
from rankwatch.agent.rankexit import BrokenStream, ExitConfig, ExitWatch, exit_detail
from rankwatch.agent.state import NodeState, RankState, Rejected, _pid_alive
from rankwatch.agent.starvation import StarvationTracker
from rankwatch.agent.stepstarts import StepStarts
from rankwatch.agent.straggler import RankWork, StragglerConfig, StragglerDetector, score
from rankwatch.proto import pb
from rankwatch.status import status_dict

__all__ = ["Agent", "AgentConfig"]

log = logging.getLogger(__name__)

_SERVICE = "rankwatch.v1.Agent"
_MAX_MESSAGE = 16 << 20
_MAX_RPCS = 512
_RISK_CHECKPOINT_EVERY = 600.0   # seconds between risk checkpoints for the same GPU and signal
_DECISIONS_SENT = 64   # the newest decisions a node's summary carries to its coordinator


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
        token: the job's shared token for Sync and RequestCheckpoint (None: no check).
        gpu: GPU health source and thresholds (default: NVML if it initialises, else none).
        exits: how long a rank's broken stream is watched for its process's exit.
    """

    def __init__(self, *, node_id: str, listen: list[Address], metrics_port: int | None = 9478,
                 metrics_addr: str = "0.0.0.0", state_dir: Path | None = None,
                 hang: HangConfig | None = None, straggler: StragglerConfig | None = None,
                 coordinators: list[Address] | None = None, policy: PolicyConfig | None = None,
                 sync_interval: float = 0.25, token: str | None = None, gpu: GpuConfig | None = None,
                 exits: ExitConfig | None = None) -> None:
        if not listen:
            raise ValueError("AgentConfig.listen needs at least one address")
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


class Agent:
    """One node's agent.  ``start()`` returns once it serves; ``stop()`` shuts it down."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.state = NodeState(config.node_id)
        self.incidents = IncidentLog(config.state_dir / "incidents.jsonl" if config.state_dir else None)
        self.state.incidents = self.incidents.items
        self.decision_log = DecisionLog(config.state_dir / "decisions.jsonl" if config.state_dir else None)
        self._open_hang: Incident | None = None
        self._hang_steps: dict[tuple[str, int], int] = {}   # each rank's completed steps at the verdict
        self._exits = ExitWatch(config.exits)
        self._stragglers = StragglerDetector(config.straggler, gpu_throttle=self.gpu_throttle_for_rank)
        self._starvation = StarvationTracker()
        self._step_starts = StepStarts()
        self.state.step_listeners.append(self._step_starts.on_steps)
        self._straggler_view: tuple[dict[int, str], float] = ({}, 1.0)
        self._evaluated_steps = 0
        self._detector: threading.Thread | None = None
        self.coordinator = Coordinator(config.node_id, incidents=self.incidents, decisions=self.decision_log,
                                       hang=config.hang,
                                       straggler=config.straggler, policy=config.policy,
                                       on_incident=self._own_job_incident)
        self._marked_at: dict[int, float] = {}   # rank -> when a job verdict marked it hung
        self._job_stragglers: set[int] = set()   # ranks the coordinator flags as stragglers
        self.commands = CommandHub()
        self.link = JobLink(self, config.coordinators, config.sync_interval)
        self.progress = goodput.StepProgress()
        self._checkpoint_steps: set[int] = set()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeCollector(self.state, lambda: self._straggler_view))
        self.registry.register(JobCollector(self))
        self.registry.register(HostCollector(config.node_id, self._rank_pids))
        self.gpu = GpuMonitor(config.node_id, config.gpu, self.incidents, self._rank_devices)
        self.gpu_listeners = self.gpu.listeners  # called with every fatal and risk GpuEvent
        self.gpu_listeners.append(self._on_gpu_event)
        self._risk_requested: dict[tuple[int, str], float] = {}
        self._pending_risk: str | None = None
        self.registry.register(GpuCollector(self.gpu))
        self._grpc: grpc.Server | None = None
        self._http: Any = None
        self.metrics_port: int | None = None
        self.tcp_ports: list[int] = []
        self._stopped = threading.Event()
        self._owns_sockets = False
        self._otel: otel.OtelExport | None = None
        self._snapshots = Snapshots(config.state_dir, lambda: status_dict(self._status(pb.StatusRequest(), None)),
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
            self.gpu.start()
        except BaseException:
            self.stop(timedelta(0))
            raise
        self._detector = threading.Thread(target=self._detect_loop, name="rankwatch-detect", daemon=True)
        self._detector.start()
        self.link.start()
        if self.config.state_dir is not None:
            write_pointer(self.config.listen, self.config.state_dir)
        log.info("agent %s serving gRPC on %s, /metrics on port %s", self.config.node_id,
                 ", ".join(map(str, self.config.listen)), self.metrics_port)

    def _start_grpc(self) -> None:
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="rankwatch-grpc"),
            maximum_concurrent_rpcs=_MAX_RPCS,
            options=[("grpc.max_receive_message_length", _MAX_MESSAGE),
                     ("grpc.max_send_message_length", _MAX_MESSAGE),
                     ("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((self._handlers(),))
        for addr in self.config.listen:
            if addr.is_unix:
                _prepare_socket_path(addr.path)  # type: ignore[arg-type]
                server.add_insecure_port(addr.grpc_target())
            else:
                self.tcp_ports.append(server.add_insecure_port(addr.grpc_target()))
        server.start()
        for addr in self.config.listen:
            if addr.is_unix:
                os.chmod(addr.path, 0o600)  # type: ignore[arg-type]
        self._grpc = server
        self._owns_sockets = True

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

    # -- handlers -----------------------------------------------------------
    def _handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(_SERVICE, {
            "Report": grpc.stream_unary_rpc_method_handler(
                self._report, request_deserializer=self._decoder(pb.ReportMessage),
                response_serializer=pb.ReportSummary.SerializeToString),
            "Status": grpc.unary_unary_rpc_method_handler(
                self._status, request_deserializer=self._decoder(pb.StatusRequest),
                response_serializer=pb.StatusResponse.SerializeToString),
            "Commands": grpc.unary_stream_rpc_method_handler(
                self._commands, request_deserializer=self._decoder(pb.CommandRequest),
                response_serializer=pb.Command.SerializeToString),
            "Sync": grpc.unary_unary_rpc_method_handler(
                self._sync, request_deserializer=self._decoder(pb.NodeSummary),
                response_serializer=pb.SyncReply.SerializeToString),
            "RequestCheckpoint": grpc.unary_unary_rpc_method_handler(
                self._request_checkpoint, request_deserializer=self._decoder(pb.CheckpointRequest),
                response_serializer=pb.CheckpointReply.SerializeToString),
        })

    def _decoder(self, cls: Any) -> Callable[[bytes], Any]:
        def decode(data: bytes) -> Any:
            try:
                return cls.FromString(data)
            except Exception as exc:
                self.state.note_rejected(Rejected("undecodable", f"{cls.__name__}: {exc}"))
                raise
        return decode

    def _report(self, requests: Iterator[pb.ReportMessage], context: grpc.ServicerContext) -> pb.ReportSummary:
        st = self.state
        rank = None
        accepted = rejected = 0
        said_goodbye = False
        error = "closed"   # how a stream without a goodbye ended (gRPC reports a dead peer either way)
        try:
            for msg in requests:
                body = msg.WhichOneof("body")
                if rank is None:
                    if body != "hello":
                        self._refuse(context, Rejected("no_hello", f"stream opened with {body!r}"))
                    try:
                        rank = st.hello(msg.hello)
                    except Rejected as exc:
                        self._refuse(context, exc)
                    if rank.job_id:  # the job's run id, on every incident and decision
                        self.incidents.run_id = self.decision_log.run_id = rank.job_id
                    continue
                if body == "goodbye":
                    said_goodbye = True
                    continue
                try:
                    if body != "batch":
                        raise Rejected("malformed", f"rank {rank.rank} sent {body!r} mid-stream")
                    st.ingest(rank, msg.batch)
                    accepted += 1
                    if msg.batch.checkpoints:
                        self._on_checkpoints(rank, msg.batch.checkpoints)
                except Rejected as exc:
                    st.note_rejected(exc)
                    rejected += 1
        except grpc.RpcError:  # the rank went away; goodbye() below records how
            error = "cancelled" if not context.is_active() else "broken"
        finally:
            # Only a rank's goodbye makes its end clean: a rank whose process died can end
            # the stream as a close does (the iteration just stops), not only as an error.
            if rank is not None:
                st.goodbye(rank, said_goodbye)
                if not said_goodbye:
                    self._stream_broke(rank, error)
        return pb.ReportSummary(batches_accepted=accepted, batches_rejected=rejected)

    def _refuse(self, context: grpc.ServicerContext, exc: Rejected) -> NoReturn:
        self.state.note_rejected(exc)
        code = grpc.StatusCode.ALREADY_EXISTS if exc.reason == "duplicate_rank" else grpc.StatusCode.INVALID_ARGUMENT
        context.abort(code, str(exc))
        raise AssertionError("context.abort raises")  # for the type checker: abort never returns

    def _status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        st = self.state
        resp = pb.StatusResponse(node_id=st.node_id, started_at=st.started_at,
                                 metrics_port=self.metrics_port or 0,
                                 records_received=sum(st.records.values()),
                                 messages_rejected=sum(st.rejected.values()),
                                 tokens_per_second=st.tokens_per_second())
        mfu = st.mfu()
        if mfu is not None:
            resp.mfu = mfu
        link = self.link
        resp.coordinator = self.is_coordinator()
        resp.coordinator_node = link.coordinator_node
        resp.decisions.extend(d.to_pb() for d in self.decisions())
        job = resp.coordinator
        now = st.clock()
        breakdown = self.goodput(now)
        if breakdown is not None:
            resp.goodput = breakdown["productive"] / breakdown["elapsed"]
            resp.time_seconds.update(breakdown)
        if job:
            resp.nodes.extend(sorted(self.coordinator.nodes))
            resp.excluded_nodes.extend(sorted(self.coordinator.excluded))
        for r in st.snapshot():
            resp.ranks.append(pb.RankStatus(
                rank=r.rank, node=r.node, pid=r.pid, step=r.step, step_seconds=r.step_seconds,
                state=self._shown_state(r.state, r.last_seen, now), phase_seconds=r.phase_seconds, mesh_coords=r.mesh_coords,
                backend=r.backend, collectives=int(r.collective_counts.sum()),
                last_collective_seq=r.last_collective_seq, dropped=r.dropped,
                last_seen=r.last_seen, connected=r.connected,
                tokens_per_second=r.tokens_per_second, slowdown=r.slowdown,
                own_work_seconds=r.own_work_seconds, collective_wait_seconds=r.comm_wait_seconds,
                collective_source=r.collective_source, device_uuid=r.device_uuid,
                op_latency=oplatency.to_pb(r.op_latency)))
        if job:
            for node, r, excluded in self.coordinator.rank_summaries():
                if node != st.node_id:
                    resp.ranks.append(pb.RankStatus(
                        rank=r.rank, node=node, pid=r.pid, step=r.step, step_seconds=r.step_seconds,
                        state="excluded" if excluded else self._shown_state(r.state, r.last_seen, now),
                        connected=r.connected,
                        last_seen=r.last_seen, tokens_per_second=r.tokens_per_second,
                        phase_seconds=r.phase_seconds, mesh_coords=r.mesh_coords, op_latency=r.op_latency,
                        backend=r.backend, collectives=r.collectives,
                        own_work_seconds=_median(r.own_work), collective_wait_seconds=_median(r.comm_wait)))
        with st.lock:
            incidents = list(st.incidents)
        if job:
            # Other nodes' own incidents; a checkpoint shows once per step however many nodes saved it.
            saved = {i.step for i in incidents if i.kind == "checkpoint"}
            for i in sorted(self.coordinator.job_incidents(), key=lambda i: i.detected_at):
                if i.node == st.node_id or (i.kind == "checkpoint" and i.step in saved):
                    continue
                if i.kind == "checkpoint":
                    saved.add(i.step)
                incidents.append(i)
        resp.incidents.extend(inc.to_pb() for inc in incidents)
        return resp

    # -- detection ------------------------------------------------------------
    def _detect_loop(self) -> None:
        while not self._stopped.wait(0.25):
            try:
                now = self.state.clock()
                self._observe_progress(now)
                self.check_exits(now)
                if self.link.acting and self.config.coordinators:
                    self.coordinator.evaluate()
                elif not self.link.coordinated(now):
                    self.check_hang(now)
                # This node's ranks against each other; the coordinator compares nodes.
                self.check_stragglers(now)
                if self._pending_risk and any(r.connected and r.steps_completed
                                              for r in self.state.snapshot()):
                    self._risk_checkpoint(self._pending_risk)
                self._snapshots.maybe_write(now)
            except Exception:  # noqa: BLE001 - the agent never dies of a detector bug
                log.exception("detector error")

    def check_hang(self, now: float) -> Incident | None:
        """Run the hang detector once; record a ``hang`` incident per stall."""
        st = self.state
        with st.lock:
            ranks = list(st.ranks.values())
            views = [RankProgress(
                rank=r.rank, node=r.node, step=r.step, step_seconds=r.step_seconds,
                steps_completed=r.steps_completed, activity=r.activity, progress_at=r.progress_at,
                last_seen=r.last_seen, connected=r.connected, exited_cleanly=r.exited_cleanly,
                group_seqs=dict(r.group_seqs), inflight=r.inflight, stacks=r.stacks,
                flight_recorder=r.flight_recorder if now - r.stacks_at < 10 else None) for r in ranks]
        verdict = detect_hang(now, views, self.config.hang)
        if self._open_hang is not None:
            end = hang_end(views, self._hang_steps)
            if end is not None:
                log.info("progress resumed after hang %s" if end == "resumed" else
                         "the job's ranks ended while hang %s was open", self._open_hang.id)
                self.incidents.resolve(self._open_hang.id, now, outcome=end)
                with st.lock:
                    for r in ranks:
                        if r.state == "hung" and end == "resumed":
                            r.state = "ok"
                self._open_hang = None
            return None
        if verdict is None:
            return None
        culprit = next(r for r in ranks if r.rank == verdict.culprit.rank)
        alive, stopped = _process_state(culprit.pid)
        fresh = culprit.stacks if culprit.stacks and now - culprit.stacks_at < 10 else None
        detail = {
            "collective": verdict.collective, "alive": alive, "stopped": stopped,
            "stacks": fresh, "reason": verdict.reason, "pid": culprit.pid,
            "stalled_seconds": round(verdict.stalled_for, 3),
            "allowance_seconds": round(verdict.allowance, 3), "silent_ranks": verdict.silent,
            "started_at": round(now - verdict.stalled_for, 3),
            "inflight": culprit.inflight,
            "flight_recorder": flight_recorder_evidence(views),
        }
        if fresh is None:
            detail["stacks_note"] = ("the process is stopped (SIGSTOP): its threads cannot run"
                                     if stopped else "no stacks: the rank's sender thread is silent"
                                     if verdict.culprit.rank in verdict.silent else
                                     "the step had not yet run long enough for stacks")
        with st.lock:
            culprit.state = "hung"
        self._open_hang = self.incidents.add(kind="hang", node=culprit.node, rank=culprit.rank,
                                             step=culprit.step, detected_at=now, detail=detail)
        self._hang_steps = steps_at(views)
        log.warning("HANG: rank %d (pid %d, %s) %s; stalled %.1fs (allowance %.1fs); "
                    "others wait in %s", culprit.rank, culprit.pid,
                    "stopped" if stopped else "alive" if alive else "gone", verdict.reason,
                    verdict.stalled_for, verdict.allowance, verdict.collective)
        return self._open_hang

    def _stream_broke(self, rank: RankState, error: str) -> None:
        """Keep what the agent knew of a rank whose stream broke, for :meth:`check_exits`."""
        with self.state.lock:
            broken = BrokenStream(
                rank=rank.rank, node=rank.node, pid=rank.pid, stream=rank.stream, step=rank.step,
                activity=rank.activity, last_seen=rank.last_seen, ended_at=self.state.clock(),
                error=error, inflight=dict(rank.inflight) if rank.inflight else None)
        self._exits.broke(broken)

    def check_exits(self, now: float) -> list[Incident]:
        """Judge each broken stream once more; record a ``rank_exit`` incident per dead rank."""
        st = self.state
        with st.lock:
            streaming = {r.pid: r.stream for r in st.ranks.values() if r.connected}
        exited = self._exits.review(now, alive=lambda pid: _process_state(pid)[0], streaming=streaming,
                                    restarts=(d.decided_at for d in self.decisions() if d.kind == "exclude"))
        made = []
        for b in exited:
            with st.lock:
                r = st.ranks.get(b.rank)
                if r is not None and r.stream == b.stream and r.state in ("ok", "straggler", "hung"):
                    r.state = "dead"  # as goodbye() marks it when the process is gone already
            made.append(self.incidents.add(kind="rank_exit", node=b.node, rank=b.rank, step=b.step,
                                           detected_at=now, detail=exit_detail(b, now)))
            log.warning("RANK EXIT: rank %d (pid %d) died at step %d (%s, stream %s)", b.rank, b.pid,
                        b.step, b.activity, b.error)
        return made

    def check_stragglers(self, now: float) -> list[Incident]:
        """Score the ranks once per completed step of the slowest; record incidents.

        Each rank's run delay (CPU starvation of its training thread) is sampled
        here, and its step starts come from a step listener, so the detector can
        tell a starved host or late collectives from slow compute.
        """
        st = self.state
        with st.lock:
            ranks = [r for r in st.ranks.values() if r.connected]
            done = min((r.steps_completed for r in ranks), default=0)
            if done <= self._evaluated_steps or len(ranks) < 2:
                return []
            self._evaluated_steps = done
            work = [RankWork(rank=r.rank, node=r.node, step=r.step, own=list(r.own_work),
                             data=list(r.data_wait), wait=list(r.comm_wait),
                             step_seconds=r.step_seconds, completed=r.steps_completed) for r in ranks]
            pids = {r.rank: r.pid for r in ranks}
        for w in work:
            self._starvation.sample(w.rank, pids[w.rank], w.completed)
            w.delay = self._starvation.per_step(w.rank)
            w.start = self._step_starts.for_rank(w.rank, w.completed)
            w.gap = self._step_starts.gaps_for_rank(w.rank, w.completed)
        events = self._stragglers.update(work, done)
        scores = {s.rank: s for s in score(work, self.config.straggler, self.gpu_throttle_for_rank)}
        flagged = self._stragglers.flagged
        with st.lock:
            for r in ranks:
                if r.rank in scores:
                    r.slowdown = scores[r.rank].slowdown
                if r.state in ("ok", "straggler"):
                    job = r.rank in self._job_stragglers   # the coordinator's flag, kept until lifted
                    r.state = "straggler" if r.rank in flagged or job else "ok"
        job_step = max(w.step_seconds for w in work)
        self._straggler_view = ({rank: s.cause for rank, s in flagged.items()},
                                self._stragglers.cost_ratio(job_step))
        made = []
        for ev in events:
            s = ev.score
            if ev.kind == "cleared":
                log.info("rank %d is no longer a straggler (slowdown %.2f)", s.rank, s.slowdown)
                continue
            made.append(self.incidents.add(kind="straggler", node=ev.work.node, rank=s.rank,
                                           step=ev.work.step, detected_at=now,
                                           detail=ev.detail(self.config.straggler.window)))
            log.warning("STRAGGLER: %s at step %d, %.0f%% slower own work (%s); "
                        "the job would step %.2fx faster without it",
                        f"node {ev.work.node} (ranks {ev.ranks})" if ev.scope == "node" else f"rank {s.rank}",
                        ev.work.step, (s.slowdown - 1) * 100, s.cause, s.speedup)
        return made

    # -- the job: coordinator, commands ------------------------------------------
    def serves(self, addr: Address) -> bool:
        return any(str(addr) == str(mine) for mine in self.config.listen)

    def summary(self, seq: int) -> pb.NodeSummary:
        """This node's compact summary for the coordinator."""
        st = self.state
        now = st.clock()
        out = pb.NodeSummary(node_id=st.node_id, seq=seq, sent_at=now)
        with st.lock:
            if self.link.generation > 0:  # forget workers of earlier generations once gone
                for k in [k for k, r in st.ranks.items()
                          if not r.connected and not r.exited_cleanly and now - r.last_seen > 5
                          and not _pid_alive(r.pid)]:
                    del st.ranks[k]
            for k, at in list(self._marked_at.items()):
                r = st.ranks.get(k)
                if r is None or (r.state == "hung" and r.progress_at > at):
                    if r is not None:
                        r.state = "ok"  # progress after the verdict: the hang is over
                    del self._marked_at[k]
            ranks = list(st.ranks.values())
            rows = [(r, dict(r.group_seqs), r.inflight, list(r.own_work), list(r.data_wait),
                     list(r.comm_wait)) for r in ranks]
            incidents = summary_incidents(list(st.incidents), st.node_id)
        for r, seqs, inflight, own, data, wait in rows:
            alive, stopped = _process_state(r.pid)
            fresh = r.stacks if r.stacks and now - r.stacks_at < 10 else ""
            fr = r.flight_recorder if r.flight_recorder and now - r.stacks_at < 10 else None
            rs = pb.RankSummary(
                rank=r.rank, pid=r.pid, step=r.step, step_seconds=r.step_seconds,
                steps_completed=r.steps_completed, activity=r.activity, progress_at=r.progress_at,
                last_seen=r.last_seen, connected=r.connected, exited_cleanly=r.exited_cleanly,
                group_seqs=seqs, stacks=fresh, stacks_at=r.stacks_at, alive=alive, stopped=stopped,
                own_work=own, data_wait=data, comm_wait=wait, state=self._shown_state(r.state, r.last_seen, now),
                local_rank=r.local_rank, tokens_per_second=r.tokens_per_second,
                flight_recorder=json.dumps(fr) if fr else "",
                phase_seconds=r.phase_seconds, mesh_coords=r.mesh_coords,
                op_latency=oplatency.to_pb(r.op_latency), backend=r.backend,
                collectives=int(r.collective_counts.sum()))
            if inflight:
                rs.inflight.CopyFrom(pb.InFlight(op=inflight["op"], group=inflight["group"],
                                                 seq=inflight["seq"], since=inflight["since"]))
            out.ranks.append(rs)
        out.incidents.extend(i.to_pb() for i in incidents)
        out.decisions.extend(d.to_pb() for d in self.decision_log.items[-_DECISIONS_SENT:])
        out.run_id = self.incidents.run_id
        return out

    def _observe_progress(self, now: float) -> None:
        ranks = self.state.snapshot()
        self.progress.observe(now, [r.step for r in ranks if r.connected],
                              max((r.step_seconds for r in ranks), default=0.0))

    def goodput(self, now: float) -> dict[str, float] | None:
        """Where the job's time went (:func:`goodput.breakdown` over this agent's view)."""
        return goodput.breakdown(now, incidents=self.incident_view(), decisions=self.decisions(),
                                 progress=self.progress.snapshot())

    def _shown_state(self, state: str, last_seen: float, now: float) -> str:
        """A rank's state, ``restarting`` for one a restart stopped (:mod:`restarting`)."""
        return shown_state(state, last_seen=last_seen, now=now,
                           restarts=[d.decided_at for d in self.decisions() if d.kind == "exclude"])

    def is_coordinator(self) -> bool:
        return self.link.acting and bool(self.config.coordinators)

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

    def _on_checkpoints(self, rank: RankState, records: Any) -> None:
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
                      "path": rec.path, "request": rec.request_id or None, "reason": reason,
                      "started_at": rec.started_at}
            if not rec.ok:
                detail["error"] = rec.error
            self.incidents.add(kind="checkpoint", node=self.state.node_id, rank=rank.rank, step=rec.step,
                               detected_at=rec.started_at + complete_after, detail=detail)
            (log.info if rec.ok else log.warning)(
                "checkpoint at step %d %s (training thread %.3fs, complete after %.2fs, %s)", rec.step,
                "saved" if rec.ok else "FAILED", rec.duration, complete_after, reason)

    def on_exclusion(self, decision: Decision) -> None:
        """A coordinator decision: mark this node's ranks excluded, or forget old-generation ranks."""
        st = self.state
        with st.lock:
            if decision.node == st.node_id:
                for r in st.ranks.values():
                    r.state = "excluded"
                log.warning("this node is excluded from the job: %s", decision.reason)

    def on_job_incident(self, coordinator: str, inc: pb.Incident) -> None:
        """A job incident the coordinator decided about one of this node's ranks.

        Kept under ``<coordinator>/<id>``; a later change (its resolution) is recorded as an
        update of the copy, so this node's file tells the story too.
        """
        incident = Incident.from_pb(inc, id=f"{coordinator}/{inc.id}")
        if self.incidents.merge(incident):
            self._mark(incident)
            return
        self.incidents.update(incident.id, **incident.detail)
        if incident.resolved_at is not None:
            self._resolve(incident)

    def _own_job_incident(self, incident: Incident) -> None:
        """The coordinator's verdict about a rank of the coordinator's own node."""
        if incident.node != self.state.node_id:
            return
        if incident.resolved_at is not None:
            self._resolve(incident)
        else:
            self._mark(incident)

    def _mark(self, incident: Incident) -> None:
        """A job verdict sets the rank's state.  A hung rank returns to ok once it progresses
        again; a job straggler once the coordinator resolves the incident (:meth:`_resolve`)."""
        state = {"hang": "hung", "straggler": "straggler"}.get(incident.kind)
        if state is None or (state == "straggler" and incident.resolved_at is not None):
            return
        with self.state.lock:
            for rank in incident.detail.get("ranks") or [incident.rank]:
                if state == "straggler":
                    self._job_stragglers.add(rank)
                r = self.state.ranks.get(rank)
                if r is not None and r.state in ("ok", "straggler", "hung"):
                    r.state = state
                    if state == "hung":
                        self._marked_at[rank] = self.state.clock()

    def _resolve(self, incident: Incident) -> None:
        """The coordinator lifted a job straggler flag: its ranks are ok again (unless this
        node's own detector flags them)."""
        if incident.kind != "straggler":
            return
        with self.state.lock:
            for rank in incident.detail.get("ranks") or [incident.rank]:
                self._job_stragglers.discard(rank)
                r = self.state.ranks.get(rank)
                if r is not None and r.state == "straggler" and rank not in self._stragglers.flagged:
                    r.state = "ok"

    def _commands(self, request: pb.CommandRequest, context: grpc.ServicerContext) -> Iterator[pb.Command]:
        def step() -> int:
            r = self.state.ranks.get(request.rank)
            return r.step if r is not None else -1
        yield from self.commands.stream(request.rank, context, step)

    def _sync(self, request: pb.NodeSummary, context: grpc.ServicerContext) -> pb.SyncReply:
        self._authorize(context, "Sync")
        if not (self.link.acting and self.config.coordinators):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{self.config.node_id} is not the job's coordinator")
        try:
            return self.coordinator.sync(request)
        except ValueError as exc:
            self.state.note_rejected(Rejected("malformed", f"summary: {exc}"))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # context.abort raised already

    def _on_gpu_event(self, event: Any) -> None:
        """A GPU risk (rising ECC, a pending row remap, throttling): checkpoint while it is cheap.

        Fatal faults need nothing here: they are ``gpu_fault`` incidents, which reach the
        coordinator in this node's summary, and its policy excludes the node.
        """
        if event.kind != "risk":
            return
        key = (event.gpu, event.reason)
        if event.at - self._risk_requested.get(key, float("-inf")) < _RISK_CHECKPOINT_EVERY:
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
                return forward_checkpoint(self.link.coordinator_addr, reason, self.config.token)
            except grpc.RpcError as exc:
                return pb.CheckpointReply(accepted=False, message=f"coordinator unreachable: {exc.code().name}")
        try:
            d = self.coordinator.request_checkpoint(reason)
        except LookupError as exc:
            return pb.CheckpointReply(accepted=False, message=str(exc))
        self.commands.publish_checkpoint(d)
        return pb.CheckpointReply(accepted=True, step=d.step, id=d.id,
                                  message=f"every rank saves after step {d.step}")

    def _request_checkpoint(self, request: pb.CheckpointRequest,
                            context: grpc.ServicerContext) -> pb.CheckpointReply:
        self._authorize(context, "RequestCheckpoint")
        return self.checkpoint(request.reason or "operator")

    def _authorize(self, context: grpc.ServicerContext, what: str) -> None:
        if not authorized(context, self.config.token):
            self.state.note_rejected(Rejected("unauthenticated", f"{what} from {context.peer()}"))
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{what} needs the job's token")

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


def _process_state(pid: int) -> tuple[bool, bool]:
    """(alive, stopped) of a local process."""
    import psutil

    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return False, False
    if status == psutil.STATUS_ZOMBIE:
        return False, False
    return True, status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


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


def _median(values: Any) -> float:
    return float(np.median(values)) if len(values) else 0.0
