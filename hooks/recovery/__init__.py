"""In-process recovery: surviving workers regroup and train on without exiting.

A user's loop imports the tier from here::

    from rankwatch.hooks.recovery import InProcessRecovery, Job, Membership

The protocol's parts live beside it: ``decide`` (who trains on, from which step), ``commit``
(every rank applies a step or none does), ``protocol`` (the workers' side of a round), ``store``
(where members agree), ``net`` (proving a process gone), ``state`` (each rank's shards),
``joins`` (workers asking to join), ``failure`` (which failures the tier answers), ``report``
(what it tells the monitor).
"""

from rankwatch.hooks.recovery.inprocess import (
    Decision, InProcessRecovery, Job, JobFinished, Membership, RecoveryFailed, decide, is_peer_failure,
)

__all__ = ["Decision", "InProcessRecovery", "Job", "JobFinished", "Membership", "RecoveryFailed", "decide",
           "is_peer_failure"]
