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
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from rankwatch.agent.relays.relay import RelayBusy, RelayUnavailable
from rankwatch.agent.node.exit_evidence import check_worker_exits
from rankwatch.agent.node.intake import Rejected
from rankwatch.agent.rpc.auth import authorized
from rankwatch.agent.rpc.rank_stream import CODES, ReportParts, ReportStream
from rankwatch.agent.wire.ranges import clean_text
from rankwatch.proto import pb

if TYPE_CHECKING:
    from rankwatch.agent.job.coordinator import Coordinator
    from rankwatch.agent.node.exit_evidence import ExitEvidence
    from rankwatch.agent.node.intake import NodeState
    from rankwatch.agent.relays.relay import Relay
    from rankwatch.agent.rpc.command_stream import CommandHub

__all__ = ["SERVICE", "ControlParts", "ReportParts", "Servicer", "SyncParts"]

SERVICE = "rankwatch.v1.Agent"


R = TypeVar("R")


@dataclass(frozen=True, kw_only=True)
class SyncParts:
    """What ``Sync`` and ``SyncGroup`` hand over to: the coordinator while this agent
    coordinates, else this agent as its group's relay."""

    node_id: str
    coordinator: Coordinator
    coordinates: Callable[[], bool]
    """Whether this agent coordinates the job now (else a summary is relayed)."""
    relay: Callable[[], Relay | None]


@dataclass(frozen=True, kw_only=True)
class ControlParts:
    """What the other calls hand over to."""

    token: str | None
    """The job's token: the calls that move the job need it, on the socket too."""
    state: NodeState
    """Refusals are counted here; ``Commands`` reads a rank's step from it."""
    commands: CommandHub
    status: Callable[[pb.StatusRequest], pb.StatusResponse]
    checkpoint: Callable[[str], pb.CheckpointReply]
    exit_evidence: ExitEvidence
    """torchrun's word on how this node's workers ended (``ReportWorkerExits``)."""


class Servicer:
    """The RPCs of ``rankwatch.v1.Agent``, each over the parts it hands over to."""

    def __init__(self, report: ReportParts, sync: SyncParts, control: ControlParts) -> None:
        self.reports = ReportStream(report)
        self.syncs = sync
        self.parts = control

    def handlers(self) -> grpc.GenericRpcHandler:
        # (method, gRPC kind, handler, request type, response type)
        table = (
            ("Report", grpc.stream_unary_rpc_method_handler, self.reports.report, pb.ReportMessage, pb.ReportSummary),
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
        parts = self.syncs
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
            code = CODES.get(exc.reason) if isinstance(exc, Rejected) else None
            context.abort(code or grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise

    def sync_group(self, request: pb.GroupSummary, context: grpc.ServicerContext) -> pb.GroupReply:
        """A relay's summaries: the coordinator takes each; a bad one is refused alone."""
        parts = self.syncs
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
        self.parts.exit_evidence.torchrun_reported(reports)
        return pb.WorkerExitsReply(accepted=len(reports))

    # -- refusals -------------------------------------------------------------------
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
