"""What a node's link to the job reads (:class:`LinkParts`, its configuration's part
:class:`LinkConfig`), and the two calls it makes that others make too: asking an agent for a
checkpoint (:func:`forward_checkpoint`) and choosing the incidents a summary carries
(:func:`summary_incidents`).  The link itself is :mod:`.uplink`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc

from rankwatch.address import Address
from rankwatch.credentials import ClientCredentials, open_channel
from rankwatch.agent.durable.decisions import Decision
from rankwatch.agent.durable.incidents import Incident
from rankwatch.agent.job.policy import PolicyConfig
from rankwatch.agent.relays.routing import RelayConfig
from rankwatch.agent.node.recoveries import is_in_process
from rankwatch.proto import pb, pb_grpc

if TYPE_CHECKING:
    from rankwatch.agent.durable.decisions import DecisionLog
    from rankwatch.agent.job.coordinator import Coordinator
    from rankwatch.agent.relays.relay import Relay

__all__ = ["RPC_TIMEOUT", "LinkConfig", "LinkParts", "ask_checkpoint", "forward_checkpoint", "summary_incidents"]

RPC_TIMEOUT = 1.0
_INCIDENTS_SENT = 50


class LinkConfig(Protocol):
    """What the link reads of the agent's configuration."""

    @property
    def node_id(self) -> str: ...
    @property
    def listen(self) -> Sequence[Address]: ...
    @property
    def job_nodes(self) -> int: ...
    @property
    def policy(self) -> PolicyConfig: ...
    @property
    def relay(self) -> RelayConfig: ...

    def client_credentials(self) -> ClientCredentials: ...


@dataclass(frozen=True, kw_only=True)
class LinkParts:
    """What the link reads from its node, and where the coordinator's reply goes."""

    config: LinkConfig
    """The node's id, addresses, credentials and the job's policy, relay and size."""
    decision_log: DecisionLog
    """The job's decisions: the coordinator's are adopted here."""
    coordinator: Coordinator
    """This agent's own coordinator, which takes the node's summary while it coordinates."""
    summary: Callable[[int], pb.NodeSummary]
    """This node's summary, numbered."""
    relay: Callable[[], Relay | None]
    """This agent as a relay for its group (None until it serves TCP, or never)."""
    on_checkpoint: Callable[[Decision], None]
    on_exclusion: Callable[[Decision], None]
    on_job_incident: Callable[[str, pb.Incident], None]

    def serves(self, addr: Address) -> bool:
        """Whether ``addr`` is one of this agent's own listening addresses."""
        return any(str(addr) == str(mine) for mine in self.config.listen)


def forward_checkpoint(addr: Address, reason: str,
                       creds: ClientCredentials | str | None = None) -> pb.CheckpointReply:
    """Ask the agent at ``addr`` for a checkpoint (raises grpc.RpcError).

    ``creds``: the job's credentials, or just its token."""
    if not isinstance(creds, ClientCredentials):
        creds = ClientCredentials(creds)
    with open_channel(addr, creds) as ch:
        return pb_grpc.AgentStub(ch).RequestCheckpoint(pb.CheckpointRequest(reason=reason),
                                                       timeout=3 * RPC_TIMEOUT)


def ask_checkpoint(reason: str, coordinator_addr: Address | None, creds: Callable[[], ClientCredentials],
                   request: Callable[[str], Decision], publish: Callable[[Decision], None]) -> pb.CheckpointReply:
    """Ask the job for a checkpoint: forwarded to the coordinator at ``coordinator_addr``, or,
    where this agent decides (None), decided here (``request``) and published to its ranks."""
    if coordinator_addr is not None:
        try:
            return forward_checkpoint(coordinator_addr, reason, creds())
        except grpc.RpcError as exc:
            return pb.CheckpointReply(accepted=False, message=f"coordinator unreachable: {exc.code().name}")
    try:
        d = request(reason)
    except LookupError as exc:
        return pb.CheckpointReply(accepted=False, message=str(exc))
    publish(d)
    return pb.CheckpointReply(accepted=True, step=d.step, id=d.id, message=f"every rank saves after step {d.step}")


def summary_incidents(items: list[Incident], node: str) -> list[Incident]:
    """This node's own incidents a coordinator needs (newest first, bounded)."""
    own = [i for i in items if i.node == node and "/" not in i.id
           and (i.kind in ("gpu_fault", "checkpoint", "rank_exit") or is_in_process(i))]
    return own[-_INCIDENTS_SENT:]
