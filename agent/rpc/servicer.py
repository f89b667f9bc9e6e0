"""The agent's gRPC service: decode, authorise, validate, hand over.

Each handler turns a call into a record for the agent's state or a question to
one of its parts, and nothing else: what a batch means is :class:`NodeState`'s,
what a rank may claim is :mod:`.identity`'s, what the job does about a summary
is the :class:`Coordinator`'s, what ``Status`` shows is :mod:`.views`'s.  The
front door (credentials, stream caps, deadlines) is :mod:`.gate`'s interceptor.

The handlers are registered by hand, not through the generated
``add_AgentServicer_to_server``, so that a message that fails to decode is
counted and logged by the agent before gRPC refuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc

from rankwatch.agent.relays.relay import RelayBusy, RelayUnavailable
from rankwatch.agent.node.exit_evidence import check_worker_exits
from rankwatch.agent.node.intake import Rejected
from rankwatch.agent.rpc.auth import authorized
from rankwatch.agent.wire.ranges import clean_text
from rankwatch.proto import pb

if TYPE_CHECKING:
    from rankwatch.agent.durable.incidents import IncidentLog
    from rankwatch.agent.job.coordinator import Coordinator
    from rankwatch.agent.durable.decisions import DecisionLog
    from rankwatch.agent.relays.relay import Relay
    from rankwatch.agent.node.checkpoints import NodeCheckpoints
    from rankwatch.agent.node.intake import NodeState, RankState
    from rankwatch.agent.node.sweep import NodeWatch
    from rankwatch.agent.rpc.command_stream import CommandHub
    from rankwatch.agent.rpc.identity import RankStreams

__all__ = ["SERVICE", "ServiceParts", "Servicer"]

SERVICE = "rankwatch.v1.Agent"

_CODES = {"duplicate_rank": grpc.StatusCode.ALREADY_EXISTS, "pid_not_peer": grpc.StatusCode.PERMISSION_DENIED,
          "uid_not_agent": grpc.StatusCode.PERMISSION_DENIED, "node_taken": grpc.StatusCode.ALREADY_EXISTS}

R = TypeVar("R")


@dataclass(frozen=True, kw_only=True)
class ServiceParts:
    """The parts of a node agent its RPCs hand over to: each owns one call's concern."""

    node_id: str
    token: str | None
    """The job's token: the calls that move the job need it, on the socket too."""
    state: NodeState
    """A rank's batches go here (``Report``), and every refusal is counted here."""
    incidents: IncidentLog
    decision_log: DecisionLog
    """Both carry the job's run id, which a rank's hello names."""
    rank_streams: RankStreams
    """Which stream may speak for a rank id."""
    peer_cred: Any
    """Who presented a nonce on a credentials socket (``RankStreams.admit`` asks)."""
    watch: NodeWatch
    """Told of a stream that broke without a goodbye."""
    checkpoints: NodeCheckpoints
    commands: CommandHub
    on_recoveries: Callable[[RankState, Any], None]
    status: Callable[[pb.StatusRequest], pb.StatusResponse]
    checkpoint: Callable[[str], pb.CheckpointReply]
    coordinator: Coordinator
    coordinates: Callable[[], bool]
    """Whether this agent coordinates the job now (else a summary is relayed)."""
    relay: Callable[[], Relay | None]


class Servicer:
    """The RPCs of ``rankwatch.v1.Agent`` over one node agent's parts."""

    def __init__(self, parts: ServiceParts) -> None:
        self.parts = parts

    def handlers(self) -> grpc.GenericRpcHandler:
        # (method, gRPC kind, handler, request type, response type)
        table = (
            ("Report", grpc.stream_unary_rpc_method_handler, self.report, pb.ReportMessage, pb.ReportSummary),
            ("Status", grpc.unary_unary_rpc_method_handler, self.status, pb.StatusRequest, pb.StatusResponse),
            ("Commands", grpc.unary_stream_rpc_method_handler, self.commands, pb.CommandRequest, pb.Command),
            ("Sync", grpc.unary_unary_rpc_method_handler, self.sync, pb.NodeSummary, pb.SyncReply),
            ("SyncGroup", grpc.unary_unary_rpc_method_handler, self.sync_group, pb.GroupSummary, pb.GroupReply),
            ("RequestCheckpoint", grpc.unary_unary_rpc_method_handler, self.request_checkpoint,
             pb.CheckpointRequest, pb.CheckpointReply),
            ("ReportWorkerExits", grpc.unary_unary_rpc_method_handler, self.report_worker_exits,
             pb.WorkerExits, pb.WorkerExitsReply),
        )
        return grpc.method_handlers_generic_handler(SERVICE, {
            name: kind(fn, request_deserializer=self._decoder(req), response_serializer=resp.SerializeToString)
            for name, kind, fn, req, resp in table})

    def _decoder(self, cls: Any) -> Callable[[bytes], Any]:
        def decode(data: bytes) -> Any:
            try:
                return cls.FromString(data)
            except Exception as exc:
                self.parts.state.note_rejected(Rejected("undecodable", f"{cls.__name__}: {exc}"))
                raise
        return decode

    # -- a rank's stream -----------------------------------------------------------
    def report(self, requests: Iterator[pb.ReportMessage], context: grpc.ServicerContext) -> pb.ReportSummary:
        parts = self.parts
        st = parts.state
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
                        rank = parts.rank_streams.admit(st, msg.hello, context, parts.peer_cred)
                    except Rejected as exc:
                        self._refuse(context, exc)
                    if rank.job_id:  # the job's run id, on every incident and decision
                        parts.incidents.run_id = parts.decision_log.run_id = rank.job_id
                    parts.watch.exit_evidence.hello(rank.stream, rank.pid, msg.hello.fault_file)
                    continue
                if body == "goodbye":
                    said_goodbye = True
                    continue
                try:
                    if body != "batch":
                        raise Rejected("malformed", f"rank {rank.rank} sent {body!r} mid-stream")
                    batch = msg.batch
                    st.ingest(rank, batch)
                    accepted += 1
                    if batch.checkpoints:
                        parts.checkpoints.recorded(rank, batch.checkpoints)
                    if batch.recoveries:
                        parts.on_recoveries(rank, batch.recoveries)
                    if batch.HasField("exit"):
                        parts.watch.exit_evidence.recorded(rank.stream, batch.exit)
                except Rejected as exc:
                    st.note_rejected(exc)
                    rejected += 1
        except grpc.RpcError:  # the rank went away; goodbye() below records how
            error = "cancelled" if not context.is_active() else "broken"
        finally:
            # Only a rank's goodbye makes its end clean: a rank whose process died can end
            # the stream as a close does (the iteration just stops), not only as an error.
            if rank is not None:
                parts.rank_streams.release(rank.rank, context)
                # A goodbye after an exit record that says the rank dies is no clean end.
                dying = parts.watch.exit_evidence.dying(rank.stream)
                st.goodbye(rank, said_goodbye and not dying)
                if not said_goodbye or dying:
                    parts.watch.stream_broke(rank, error, said_goodbye)
        return pb.ReportSummary(batches_accepted=accepted, batches_rejected=rejected)

    def commands(self, request: pb.CommandRequest, context: grpc.ServicerContext) -> Iterator[pb.Command]:
        ranks = self.parts.state.ranks

        def step() -> int:
            r = ranks.get(request.rank)
            return r.step if r is not None else -1
        yield from self.parts.commands.stream(request.rank, context, step)

    # -- control calls ------------------------------------------------------------
    def status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        return self.parts.status(request)

    def sync(self, request: pb.NodeSummary, context: grpc.ServicerContext) -> pb.SyncReply:
        """The coordinator takes the summary; any other agent relays it for its group."""
        parts = self.parts
        self._authorize(context, "Sync")
        try:
            if parts.coordinates():
                return _timed(context, parts.coordinator, parts.coordinator.sync(request, self._summary_refused))
            relay = parts.relay()
            if relay is None:   # an agent alone, or one without a TCP address
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{parts.node_id} is not the job's coordinator")
                raise AssertionError("context.abort raises")
            return relay.take(request)
        except RelayBusy as exc:   # held: the node backs off and stays behind this relay
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{parts.node_id}: {exc}")
            raise  # context.abort raised already
        except RelayUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"{parts.node_id} is not the job's coordinator, and cannot relay: {exc}")
            raise  # context.abort raised already
        except ValueError as exc:
            self._summary_refused(exc)
            code = _CODES.get(exc.reason) if isinstance(exc, Rejected) else None
            context.abort(code or grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise

    def sync_group(self, request: pb.GroupSummary, context: grpc.ServicerContext) -> pb.GroupReply:
        """A relay's summaries: the coordinator takes each; a bad one is refused alone."""
        parts = self.parts
        self._authorize(context, "SyncGroup")
        if not parts.coordinates():
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{parts.node_id} is not the job's coordinator")
        try:
            return _timed(context, parts.coordinator, parts.coordinator.sync_group(request, self._summary_refused))
        except ValueError as exc:
            self._summary_refused(exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise

    def _summary_refused(self, exc: ValueError) -> None:
        self.parts.state.note_rejected(exc if isinstance(exc, Rejected) else Rejected("malformed", f"summary: {exc}"))

    def request_checkpoint(self, request: pb.CheckpointRequest,
                           context: grpc.ServicerContext) -> pb.CheckpointReply:
        self._authorize(context, "RequestCheckpoint")
        return self.parts.checkpoint(clean_text(request.reason, 256) or "operator")

    def report_worker_exits(self, request: pb.WorkerExits, context: grpc.ServicerContext) -> pb.WorkerExitsReply:
        """torchrun's word on how this node's workers ended (its rendezvous handler calls)."""
        self._authorize(context, "ReportWorkerExits")
        try:
            reports = check_worker_exits(request)
        except Rejected as exc:
            self.parts.state.note_rejected(exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise
        self.parts.watch.exit_evidence.torchrun_reported(reports)
        return pb.WorkerExitsReply(accepted=len(reports))

    # -- refusals -------------------------------------------------------------------
    def _refuse(self, context: grpc.ServicerContext, exc: Rejected) -> NoReturn:
        self.parts.state.note_rejected(exc)
        context.abort(_CODES.get(exc.reason, grpc.StatusCode.INVALID_ARGUMENT), str(exc))
        raise AssertionError("context.abort raises")  # for the type checker: abort never returns

    def _authorize(self, context: grpc.ServicerContext, what: str) -> None:
        """The job's token, on the socket too, for the calls that move the job."""
        if not authorized(context, self.parts.token):
            self.parts.state.note_rejected(Rejected("unauthenticated", f"{what} from {context.peer()}"))
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{what} needs the job's token")


def _timed(context: grpc.ServicerContext, coordinator: Any, reply: R) -> R:
    """``reply``, counted in the coordinator's load when its caller's deadline has passed:
    the caller saw the sync fail, and the coordinator's slowness, not the node, was why."""
    remaining = context.time_remaining()
    if (remaining is not None and remaining <= 0) or not context.is_active():
        coordinator.load.answered_late()
    return reply
