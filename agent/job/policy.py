"""What the coordinator's policy may do, and its limits (``rankwatch agent`` flags set them)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PolicyConfig"]


@dataclass(kw_only=True)
class PolicyConfig:
    min_nodes: int = 1
    """Never exclude a node if fewer than this many would remain (torchrun's --nnodes MIN)."""
    node_timeout_seconds: float = 3.0
    """A node whose agent has not synced for this long is silent."""
    silent_burst_share: float = 0.02
    """More nodes than this share of the job (and than ``silent_burst_nodes``) silent at once
    are not taken for that many dead nodes: none is excluded for its silence alone
    (:func:`~rankwatch.agent.job.node_death.silence_is_evidence`)."""
    silent_burst_nodes: int = 4
    silent_burst_seconds: float = 30.0
    """A node excluded for its silence still counts as silent in the burst for this long, so
    that nodes falling silent one evaluation apart are counted together: at most the burst's
    size are excluded for silence in any such window."""
    exclude_hung: bool = True
    exclude_dead: bool = True
    exclude_gpu_fatal: bool = True
    checkpoint_lead_seconds: float = 2.0
    """A requested checkpoint's step is at least this far ahead of the fastest rank."""
    evict_straggler_speedup: float = 1.25
    """Evict a straggling node at the next checkpoint when the job would step this much
    faster without it (``inf`` never evicts)."""
    restart_quiet_seconds: float = 120.0
    """After an exclusion, no new hang is called for this long or until every node trains
    again: the restart itself stops every rank (its time counts as ``restart`` in goodput)."""
    max_nodes: int = 65536
    """The most node ids the coordinator keeps (a bound on what Sync callers can make it hold)."""
    crashed_grace_seconds: float = 60.0
    """A node whose agent is alive but whose ranks all died is dead only if no rank has come
    back for this long: torchrun restarts workers itself, and every restart (ours included)
    kills all of a node's ranks until the new ones connect: after starting Python, importing
    torch and, joining in process, being admitted.  That took over 15 s on a loaded 2-core
    host (a GPU node adds CUDA and NCCL start-up), and a node excluded meanwhile is refused."""

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise ValueError("PolicyConfig.min_nodes must be at least 1")
        if not self.node_timeout_seconds > 0 or not self.checkpoint_lead_seconds > 0:
            raise ValueError("PolicyConfig timeouts must be positive")
        if not 0 <= self.silent_burst_share <= 1 or self.silent_burst_nodes < 1 or not self.silent_burst_seconds >= 0:
            raise ValueError("PolicyConfig needs 0 <= silent_burst_share <= 1, silent_burst_nodes >= 1 and "
                             "silent_burst_seconds >= 0")
