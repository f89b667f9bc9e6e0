"""The node agent's view of its ranks: validation, ingestion and snapshots.

Everything that reaches the agent from a rank passes :meth:`NodeState.hello`
or :meth:`NodeState.ingest`, which check it before it touches any state.  A
bad message is refused with a :class:`Rejected` naming the reason; the rank's
stream and every other rank go on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

from rankwatch.agent.node.histogram import COLLECTIVE_BUCKETS, STEP_BUCKETS, HistogramSet
from rankwatch.agent.wire import bounds, inflight as in_flight, ranges, report
from rankwatch.agent.wire.ranges import Rejected, parse_flight_recorder
from rankwatch.agent.durable.incidents import Incident
from rankwatch.agent.node.rankrecord import ACTIVITY, OP_INDEX, OPS, PHASES, STATES, RankState
from rankwatch.agent.node.transitions import next_state
from rankwatch.proto import pb

__all__ = ["OPS", "PHASES", "STATES", "NodeState", "RankState", "Rejected"]

log = logging.getLogger(__name__)

class NodeState:
    """All ranks reporting to this node's agent, and the node's aggregates.

    Args:
        node_id: this node's id.
        clock: injected for tests.

    ``step_listeners`` (the exporters) are called with each batch's validated step columns
    after the batch is applied, outside the lock, on the ingesting thread: they must be cheap.
    With none, ingestion pays one attribute test per batch.
    """

    def __init__(self, node_id: str, clock=time.time) -> None:
        self.node_id = node_id
        self.clock = clock
        self.started_at = clock()
        self.lock = threading.Lock()
        self.ranks: dict[int, RankState] = {}
        self.step_hist = HistogramSet(1, STEP_BUCKETS)
        self.coll_hist = HistogramSet(len(OPS), COLLECTIVE_BUCKETS)
        self.coll_bytes = np.zeros(len(OPS), np.float64)
        self.steps_total = 0
        self.tokens_total = 0.0
        self.flops_total = 0.0
        self.records = {"collective": 0, "step": 0}
        self.rejected: dict[str, int] = {}
        self.incidents: list[Incident] = []  # replaced by the agent's IncidentLog items
        self._next_stream = 0
        self._last_log: dict[str, float] = {}
        self.step_listeners: list[Callable[[RankState, pb.StepColumns], None]] = []
        # Called as the step listeners are, with the batch's collective records: (rank, the
        # agent's op index per record, the decoded columns, the rank's process-group names).
        self.collective_listeners: list[Callable[[RankState, np.ndarray, dict, list[str]], None]] = []
        self.max_ranks = bounds.MAX_RANK_IDS

    # -- streams ----------------------------------------------------------
    def hello(self, msg: pb.Hello, alive=None, replace: bool = False) -> RankState:
        """Register a rank's stream.

        Args:
            msg: the stream's first message.
            alive: ``pid -> bool``; a live rank's slot is not taken over.
            replace: take the slot over anyway (agent/rpc/identity.py decided so).

        Raises:
            Rejected: invalid identity, or the rank is already live on another stream.
        """
        report.check_hello(msg)
        with self.lock:
            old = self.ranks.get(msg.rank)
            if (not replace and old is not None and old.connected
                    and (old.pid == msg.pid or (alive or _pid_alive)(old.pid))):
                raise self._reject("duplicate_rank", f"rank {msg.rank} is already reporting "
                                   f"from pid {old.pid} on this node")
            try:  # a bounded number of rank ids: a new one takes the place of one gone longest
                evict = bounds.rank_to_evict(self.ranks, msg.rank, self.max_ranks)
            except LookupError as exc:
                raise self._reject("too_many_ranks", str(exc)) from None
            if evict is not None:
                del self.ranks[evict]
            self._next_stream += 1
            op_map = np.array([OP_INDEX.get(name, OP_INDEX["other"]) for name in msg.op_names]
                              or [OP_INDEX["other"]], dtype=np.uint8)   # one byte: a radix sort
            state = RankState(
                rank=msg.rank, node=self.node_id, pid=msg.pid,
                local_rank=msg.local_rank, world_size=msg.world_size, backend=msg.backend,
                device=msg.device, device_uuid=msg.device_uuid, job_id=msg.job_id,
                collective_source=msg.collective_source, instrumentation=msg.instrumentation,
                peak_flops=msg.peak_flops,
                mesh_coords=dict(msg.mesh_coords), mesh_shape=dict(msg.mesh_shape),
                op_map=op_map, op_identity=bool(np.array_equal(op_map, np.arange(op_map.size))),
                stream=self._next_stream, last_seen=self.clock(),
                progress_at=self.clock())
            self.ranks[msg.rank] = state
            log.info("rank %d (pid %d, %s) connected", msg.rank, msg.pid, msg.backend)
            if msg.node_id and msg.node_id != self.node_id:
                log.warning("rank %d calls its node %r; this agent is node %r (set RANKWATCH_NODE_ID)",
                            msg.rank, msg.node_id, self.node_id)
            return state

    def goodbye(self, rank: RankState, clean: bool) -> None:
        with self.lock:
            if self.ranks.get(rank.rank) is rank:
                rank.connected = False
                rank.exited_cleanly = clean
                if not clean and not _pid_alive(rank.pid):
                    rank.state = next_state(rank.state, "exited")
        log.info("rank %d stream closed (%s)", rank.rank, "clean" if clean else "broken")

    # -- data -------------------------------------------------------------
    def ingest(self, rank: RankState, batch: pb.Batch) -> int:
        """Validate and apply one batch; return the number of records taken.

        Raises:
            Rejected: the batch is malformed; nothing of it is applied.
        """
        coll = report.decode_collectives(batch.collectives, len(rank.op_map)) if batch.HasField("collectives") else None
        steps = report.check_step_shapes(batch.steps) if batch.HasField("steps") else None
        if batch.HasField("progress"):
            report.check_progress_shape(batch.progress)
        report.check_batch(batch, coll)
        with self.lock:
            if batch.seq <= rank.last_batch_seq:
                raise self._reject("duplicate_batch",
                                   f"rank {rank.rank} batch {batch.seq} after {rank.last_batch_seq}")
            if self.ranks.get(rank.rank) is not rank:
                raise self._reject("stale_stream", f"rank {rank.rank} has a newer stream")
            rank.last_batch_seq = batch.seq
            rank.last_seen = self.clock()
            rank.dropped = max(rank.dropped, batch.dropped_total)
            n = 0
            if coll is not None:
                n += self._apply_collectives(rank, coll)
            if steps is not None:
                n += self._apply_steps(rank, steps)
            before = (rank.step, rank.last_collective_seq, rank.steps_completed)
            if batch.HasField("progress"):
                self._apply_progress(rank, batch.progress)
            for load in batch.expert_loads:
                rank.expert_tokens.append(sum(load.tokens))
            if batch.HasField("snapshot"):
                rank.snapshot = pb.SnapshotStats()
                rank.snapshot.CopyFrom(batch.snapshot)
            if batch.HasField("mesh"):
                rank.mesh_coords = dict(batch.mesh.mesh_coords)
                rank.mesh_shape = dict(batch.mesh.mesh_shape)
            if (rank.step, rank.last_collective_seq, rank.steps_completed) != before:
                rank.progress_at = rank.last_seen
        if coll is not None and self.collective_listeners:
            self._notify_collectives(rank, coll, list(batch.collectives.pg_names))
        if steps is not None and self.step_listeners:
            self._notify_steps(rank, steps)
        return n

    def _notify_collectives(self, rank: RankState, cols: dict[str, np.ndarray], names: list[str]) -> None:
        ops = cols["op"] if rank.op_identity else rank.op_map[cols["op"]]
        for listener in list(self.collective_listeners):
            try:
                listener(rank, ops, cols, names)
            except Exception:  # noqa: BLE001 - a listener never fails ingestion
                log.exception("collective listener %r failed on rank %d", listener, rank.rank)

    def _notify_steps(self, rank: RankState, steps: pb.StepColumns) -> None:
        for listener in list(self.step_listeners):
            try:
                listener(rank, steps)
            except Exception:  # noqa: BLE001 - an exporter never fails ingestion
                log.exception("step listener %r failed on rank %d", listener, rank.rank)

    def _apply_progress(self, rank: RankState, p: pb.Progress) -> None:
        rank.activity = ACTIVITY.get(p.phase, "train")
        rank.step_started_at = p.step_started_at
        rank.step = max(rank.step, p.step)
        rank.last_collective_seq = max(rank.last_collective_seq, p.last_collective_seq)
        for group, seq in p.group_seqs.items():
            if seq > rank.group_seqs.get(group, -1):
                rank.group_seqs[group] = seq
                rank.progress_at = rank.last_seen
        rank.inflight = in_flight.to_dict(p.inflight) if p.HasField("inflight") else None
        if p.stacks or p.flight_recorder:
            rank.stacks, rank.stacks_at = p.stacks or None, rank.last_seen
            rank.flight_recorder = parse_flight_recorder(p.flight_recorder)

    def _apply_collectives(self, rank: RankState, cols: dict[str, np.ndarray]) -> int:
        ops = cols["op"] if rank.op_identity else rank.op_map[cols["op"]]   # codes checked < op_map.size
        durations = cols["duration"]
        self.coll_hist.observe_many(ops, durations)
        counts = np.bincount(ops, minlength=len(OPS))
        rank.collective_counts += counts
        rank.op_latency.observe(ops, durations, counts)
        # bincount takes its weights as float64 (sizes are below 2^53, so exactly).
        self.coll_bytes += np.bincount(ops, weights=cols["nbytes"], minlength=len(OPS))
        seq = cols["seq"]
        if seq.size:
            rank.last_collective_seq = max(rank.last_collective_seq, int(seq.max()))
        n = int(ops.size)
        self.records["collective"] += n
        return n

    def _apply_steps(self, rank: RankState, s: pb.StepColumns) -> int:
        n = len(s.step)
        rank.steps_completed += n
        for i in range(n):
            wait = s.wait[i] if s.wait else 0.0
            rank.own_work.append(max(0.0, s.duration[i] - wait))
            rank.data_wait.append(s.data[i])
            rank.comm_wait.append(wait)
            rank.step_durations.append(s.duration[i])
            rank.step_tokens.append(s.tokens[i])
            rank.step_flops.append(s.flops[i])
            rank.step = max(rank.step, s.step[i])
            marked = s.data[i] + s.forward[i] + s.backward[i] + s.optimizer[i]
            rank.phase_window.append((s.data[i], s.forward[i], s.backward[i], s.optimizer[i],
                                      max(0.0, s.duration[i] - marked)))
        self.step_hist.observe_many(np.zeros(n, np.int64), np.asarray(s.duration, np.float64))
        self.steps_total += n
        self.tokens_total += float(sum(s.tokens))
        self.flops_total += float(sum(s.flops))
        self.records["step"] += n
        return n

    def take_recoveries(self, rank: RankState, records: Iterable[pb.RecoveryRecord]) -> list[pb.RecoveryRecord]:
        """The valid ones of a batch's in-process recovery records (the batch was taken).

        A bad record is refused alone (counted and logged as a rejected message); the rest
        of its batch stands.  A successful recovery moves the rank into its new world: its
        world size and rank there, which the coordinator counts the job's nodes by.
        """
        now = self.clock()
        valid = []
        for rec in records:
            try:
                report.check_recovery(rec, now)
            except Rejected as exc:
                detail = str(exc).removeprefix(f"{exc.reason}: ")
                self.note_rejected(Rejected(exc.reason, f"rank {rank.rank}'s recovery record: {detail}"))
                continue
            valid.append(rec)
            if rec.ok:
                with self.lock:
                    if self.ranks.get(rank.rank) is rank:
                        rank.world_size, rank.world_rank = rec.new_world_size, rec.rank_after
        return valid

    # -- rejects ----------------------------------------------------------
    @staticmethod
    def _reject(reason: str, detail: str) -> Rejected:
        return Rejected(reason, detail)

    def note_rejected(self, exc: Rejected) -> None:
        """Count a refused message and log it: one line per reason per 10 s."""
        with self.lock:
            reason = ranges.reason_label(exc.reason)
            count = self.rejected[reason] = self.rejected.get(reason, 0) + 1
            now = self.clock()
            loud = now - self._last_log.get(exc.reason, 0.0) >= 10.0
            if loud:
                self._last_log[exc.reason] = now
        if loud:
            log.warning("rejected message (%s) [%d so far]", exc, count)

    # -- views ------------------------------------------------------------
    def snapshot(self) -> list[RankState]:
        with self.lock:
            return sorted(self.ranks.values(), key=lambda r: r.rank)

    def _recent(self) -> list[RankState]:
        """Ranks streaming now or within the last 10 s (a job that just ended still counts)."""
        now = self.clock()
        return [r for r in self.snapshot() if r.connected or now - r.last_seen < 10.0]

    def tokens_per_second(self) -> float:
        return sum(r.tokens_per_second for r in self._recent())

    def mfu(self) -> float | None:
        ranks = self._recent()
        peak = sum(r.peak_flops for r in ranks)
        if not ranks or peak <= 0 or any(r.peak_flops <= 0 for r in ranks):
            return None
        return sum(r.flops_per_second for r in ranks) / peak


def _pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
