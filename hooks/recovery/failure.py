"""Which failures the in-process tier answers: a collective that failed because a peer died or hung."""

from __future__ import annotations

from rankwatch.hooks.recovery.commit import CommitIncomplete
from rankwatch.hooks.recovery.protocol import RecoveryFailed

__all__ = ["is_peer_failure"]

_PEER_FAILURE_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe", "Read error",
    "Write error", "Timed out waiting", "NCCL communicator was aborted", "ProcessGroupNCCL is aborted",
    "Socket Timeout", "Connection refused",
)


def is_peer_failure(exc: BaseException) -> bool:
    """True for a collective that failed because a peer died or hung (the tier's business)."""
    import torch.distributed as dist

    if isinstance(exc, RecoveryFailed):
        return False
    if isinstance(exc, CommitIncomplete):
        return True
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _PEER_FAILURE_MARKERS)
