"""How a node agent is set up: :class:`AgentConfig`, checked as it is made."""

from __future__ import annotations

from pathlib import Path

from rankwatch.address import Address
from rankwatch.agent.job.coordinator import PolicyConfig
from rankwatch.agent.link.election import parse_endpoints
from rankwatch.agent.rpc.limits import StreamLimits
from rankwatch.agent.durable.steplog import DEFAULT_MAX_BYTES
from rankwatch.agent.gpu import GpuConfig
from rankwatch.agent.detect.hang_verdict import HangConfig
from rankwatch.agent.node.rankexit import ExitConfig
from rankwatch.agent.relays.routing import RelayConfig
from rankwatch.agent.views.rank_list import DEFAULT_MAX_RANKS
from rankwatch.agent.detect.straggler import StragglerConfig
from rankwatch.agent.rpc.tls import TlsConfig
from rankwatch.credentials import ClientCredentials

__all__ = ["AgentConfig"]


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
            (:mod:`.views.rank_list`).
        relay: how a big job's nodes are grouped behind relays (:mod:`.routing`; the
            coordinator's setting).
        job_nodes: how many nodes the job has, if known (0: not known); a big job's agents
            spread their first syncs by it (:func:`~.pacing.first_sync_delay`).
        history_bytes: the most bytes its ranks' step history keeps in ``<state_dir>/history``
            (:mod:`.durable.steplog`; oldest files deleted first); 0 keeps none.
    """

    def __init__(self, *, node_id: str, listen: list[Address], metrics_port: int | None = 9478,
                 metrics_addr: str = "0.0.0.0", state_dir: Path | None = None,
                 hang: HangConfig | None = None, straggler: StragglerConfig | None = None,
                 coordinators: list[Address] | None = None, policy: PolicyConfig | None = None,
                 sync_interval: float = 0.25, token: str | None = None, gpu: GpuConfig | None = None,
                 exits: ExitConfig | None = None, election: str | None = None, job_id: str = "",
                 advertise: str | None = None, tls: TlsConfig | None = None,
                 streams: StreamLimits | None = None, rank_grace: float = 60.0,
                 status_max_ranks: int = DEFAULT_MAX_RANKS, relay: RelayConfig | None = None,
                 job_nodes: int = 0, history_bytes: int = DEFAULT_MAX_BYTES) -> None:
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
        if not 0 <= job_nodes <= 1_000_000:
            raise ValueError(f"AgentConfig.job_nodes {job_nodes} out of range (0 to 1,000,000)")
        if history_bytes < 0:
            raise ValueError(f"AgentConfig.history_bytes {history_bytes} must be 0 (none) or more")
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
        self.job_nodes = job_nodes
        self.history_bytes = history_bytes

    def client_credentials(self) -> ClientCredentials:
        """What this agent presents when it calls another agent (its coordinator)."""
        return self.tls.client_credentials(self.token) if self.tls else ClientCredentials(self.token)
