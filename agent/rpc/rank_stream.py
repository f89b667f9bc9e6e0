"""The ``Report`` RPC: one rank's stream of batches, from its hello to its goodbye.

The first message must be the rank's hello: :mod:`.identity` decides which stream may speak for
the rank id.  Each batch goes to the node's state; its checkpoints, recoveries and exit record
to the parts that own them.  A stream that ends without a goodbye (or with one after an exit
record that says the rank dies) is a broken stream, told to the node's watch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from rankwatch.agent.node.intake import Rejected
from rankwatch.proto import pb

if TYPE_CHECKING:
    from rankwatch.agent.node.exit_evidence import ExitEvidence
    from rankwatch.agent.node.intake import NodeState, RankState
    from rankwatch.agent.rpc.identity import RankStreams

__all__ = ["CODES", "ReportParts", "ReportStream", "refuse"]

CODES = {"duplicate_rank": grpc.StatusCode.ALREADY_EXISTS, "pid_not_peer": grpc.StatusCode.PERMISSION_DENIED,
         "uid_not_agent": grpc.StatusCode.PERMISSION_DENIED, "node_taken": grpc.StatusCode.ALREADY_EXISTS}


@dataclass(frozen=True, kw_only=True)
class ReportParts:
    """What a rank's stream hands over to."""

    state: NodeState
    """A rank's batches go here, and every refusal is counted here."""
    rank_streams: RankStreams
    """Which stream may speak for a rank id."""
    peer_cred: Any
    """Who presented a nonce on a credentials socket (``RankStreams.admit`` asks)."""
    run_id: Callable[[str], None]
    """Told the job's run id a rank's hello names (every incident and decision carries it)."""
    exit_evidence: ExitEvidence
    """A rank's fault file and exit record, for the story of how it ended."""
    stream_broke: Callable[[RankState, str, bool], None]
    """Told of a stream that broke without a goodbye."""
    checkpoints: Callable[[RankState, Any], None]
    """A batch's checkpoint records."""
    recoveries: Callable[[RankState, Any], None]
    """A batch's in-process recovery records."""


def refuse(state: NodeState, context: grpc.ServicerContext, exc: Rejected) -> NoReturn:
    """Count a refusal and end the call with its status code."""
    state.note_rejected(exc)
    context.abort(CODES.get(exc.reason, grpc.StatusCode.INVALID_ARGUMENT), str(exc))
    raise AssertionError("context.abort raises")  # for the type checker: abort never returns


class ReportStream:
    def __init__(self, parts: ReportParts) -> None:
        self.parts = parts

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
                        refuse(st, context, Rejected("no_hello", f"stream opened with {body!r}"))
                    try:
                        rank = parts.rank_streams.admit(st, msg.hello, context, parts.peer_cred)
                    except Rejected as exc:
                        refuse(st, context, exc)
                    if rank.job_id:  # the job's run id, on every incident and decision
                        parts.run_id(rank.job_id)
                    parts.exit_evidence.hello(rank.stream, rank.pid, msg.hello.fault_file)
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
                        parts.checkpoints(rank, batch.checkpoints)
                    if batch.recoveries:
                        parts.recoveries(rank, batch.recoveries)
                    if batch.HasField("exit"):
                        parts.exit_evidence.recorded(rank.stream, batch.exit)
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
                dying = parts.exit_evidence.dying(rank.stream)
                st.goodbye(rank, said_goodbye and not dying)
                if not said_goodbye or dying:
                    parts.stream_broke(rank, error, said_goodbye)
        return pb.ReportSummary(batches_accepted=accepted, batches_rejected=rejected)
