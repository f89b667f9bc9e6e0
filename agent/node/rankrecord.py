"""What the node agent keeps of one rank (:class:`RankState`), and the vocabularies it is kept in.

A rank's record is written only by :class:`~rankwatch.agent.node.intake.NodeState` (from the
rank's validated messages) and by the detectors through
:func:`~rankwatch.agent.node.transitions.next_state` (its ``state``); everything else reads it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankwatch.agent.node.oplatency import OpLatency
from rankwatch.agent.node.transitions import INITIAL, STATES

__all__ = ["ACTIVITY", "OPS", "OP_INDEX", "PHASES", "STATES", "STEP_WINDOW", "WORK_WINDOW", "RankState"]

# The agent's own op vocabulary: a rank's op names map onto it, unknown ones to "other".
OPS: tuple[str, ...] = (
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier",
    "reduce", "gather", "scatter", "send", "recv", "all_reduce_coalesced",
    "all_gather_coalesced", "reduce_scatter_coalesced", "other",
)
OP_INDEX = {name: i for i, name in enumerate(OPS)}
assert len(OPS) <= 256, "a rank's op indices are kept in one byte"
PHASES = ("data", "forward", "backward", "optimizer", "other")

STEP_WINDOW = 32
WORK_WINDOW = 64
ACTIVITY = {1: "train", 2: "eval", 3: "checkpoint", 4: "idle", 5: "recovery"}


@dataclass
class RankState:
    rank: int
    node: str
    pid: int
    local_rank: int
    world_size: int
    backend: str
    device: str
    job_id: str
    peak_flops: float
    mesh_coords: dict[str, int]
    mesh_shape: dict[str, int]
    op_map: np.ndarray                      # the rank's op code -> agent op index
    stream: int                             # id of the stream that owns this rank
    op_identity: bool = False               # op_map maps each code to itself (a rank on our OPS)
    device_uuid: str = ""                   # the GPU's UUID ("GPU-..."), "" without CUDA
    collective_source: str = ""             # nccl_completion_hook, python_wrappers or none
    instrumentation: str = ""               # explicit (rw.init), auto (zero-code) or "" (older ranks)
    connected: bool = True
    exited_cleanly: bool = False
    last_seen: float = field(default_factory=time.time)
    last_batch_seq: int = 0
    step: int = -1
    activity: str = "idle"
    step_started_at: float = 0.0
    last_collective_seq: int = -1
    dropped: int = 0
    step_durations: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    step_tokens: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    step_flops: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    expert_tokens: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    """Tokens its local experts received, per step it reported (a mixture of experts)."""
    snapshot: Any = None
    """Its peer snapshots' latest stats (a checked ``pb.SnapshotStats``), or None."""
    # Per step: the rank's own work (wall time not blocked in collectives),
    # its data-loader wait, and its time blocked in collectives.
    own_work: deque = field(default_factory=lambda: deque(maxlen=WORK_WINDOW))
    data_wait: deque = field(default_factory=lambda: deque(maxlen=WORK_WINDOW))
    comm_wait: deque = field(default_factory=lambda: deque(maxlen=WORK_WINDOW))
    # Per step, over the same window as step_durations: (data, forward, backward, optimizer, other).
    phase_window: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    collective_counts: np.ndarray = field(default_factory=lambda: np.zeros(len(OPS), np.int64))
    op_latency: OpLatency = field(default_factory=lambda: OpLatency(OPS))   # per op, for status
    state: str = INITIAL
    steps_completed: int = 0
    progress_at: float = 0.0                # agent clock: last time step or a sequence moved
    group_seqs: dict[str, int] = field(default_factory=dict)
    inflight: dict | None = None
    stacks: str | None = None
    stacks_at: float = 0.0
    flight_recorder: dict | None = None   # taken with the stacks (see parse_flight_recorder)
    slowdown: float = 1.0                   # own work over the other ranks' median
    # The rank's rank in its world once an in-process recovery renumbered it (world_size is
    # that world's size then); None: as its hello said.
    world_rank: int | None = None

    @property
    def step_seconds(self) -> float:
        return float(np.median(self.step_durations)) if self.step_durations else 0.0

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Median of each phase over the steps that ``step_seconds`` is the median of."""
        if not self.phase_window:
            return {}
        medians = np.median(np.asarray(self.phase_window, np.float64), axis=0)
        return dict(zip(PHASES, (float(m) for m in medians)))

    @property
    def own_work_seconds(self) -> float:
        return float(np.median(self.own_work)) if self.own_work else 0.0

    @property
    def comm_wait_seconds(self) -> float:
        return float(np.median(self.comm_wait)) if self.comm_wait else 0.0

    @property
    def tokens_per_second(self) -> float:
        total = sum(self.step_durations)
        return sum(self.step_tokens) / total if total > 0 else 0.0

    @property
    def expert_tokens_per_step(self) -> float:
        """The mean of its recent steps' expert tokens; NaN: it reports none."""
        return sum(self.expert_tokens) / len(self.expert_tokens) if self.expert_tokens else math.nan

    @property
    def flops_per_second(self) -> float:
        total = sum(self.step_durations)
        return sum(self.step_flops) / total if total > 0 else 0.0
