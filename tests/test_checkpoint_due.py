"""``Monitor.checkpoint_due``: every rank answers the same at the same step (real gloo, 2 ranks).

The agent's request reaches ranks at different times; here rank 0 hears of a
request for step 5 at step 3 and rank 1 never does.  Both must say "due" from
step 5 on, and neither before.  (The request's path from the agent to the rank
is covered end to end by test_e2e_checkpoint.)
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.multiprocessing as mp

from rankwatch.hooks.instrument.monitor import Monitor, NullMonitor
from rankwatch.hooks.instrument.recorder import Recorder


class _HeardAt:
    """The one call checkpoint_due makes of the rank's agent client."""

    def __init__(self, request_step: int, heard_at: int) -> None:
        self.request_step, self.heard_at, self.now = request_step, heard_at, 0

    def requested_checkpoint(self) -> tuple[int, str, str] | None:
        return (self.request_step, "r1", "manual") if self.now >= self.heard_at else None


def _rank(rank: int, store_path: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    client = _HeardAt(5, 3) if rank == 0 else _HeardAt(5, 10**9)
    mon = Monitor(Recorder(), None, client)
    answers = []
    for step in range(1, 9):
        client.now = step
        answers.append(mon.checkpoint_due(step))
    answers.append(NullMonitor().checkpoint_due(8))
    Path(out, f"rank{rank}").write_text(",".join(str(int(a)) for a in answers))
    dist.destroy_process_group()


def test_every_rank_agrees_on_the_step_of_a_requested_checkpoint(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    expected = "0,0,0,0,1,1,1,1,0"  # steps 1-8, then a NullMonitor
    assert (tmp_path / "rank0").read_text() == expected
    assert (tmp_path / "rank1").read_text() == expected
