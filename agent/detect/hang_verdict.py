"""Hang detection: a pure function of the ranks' progress and a clock.

Progress is a rank's step and collective sequence numbers moving, as seen by
the agent; a heartbeat is not progress (a rank's sender thread keeps beating
while its main thread is stuck).  The job is hung when no rank has made
progress for longer than its allowance:

* a multiple of the rank's median step time, never below a floor;
* a longer allowance before the first step completes (warm-up), and while a
  rank marks itself in ``checkpoint``, ``eval`` or ``recovery`` (in-process).

Then the culprit is localised: a rank whose stream went silent (its whole
process is stopped or gone) while others wait, else the rank behind on a group's collective
sequence numbers, else the rank stuck longest outside a collective.

Evidence of its own outranks silence: a rank still heard, whose copy is current, that
sits outside any collective and has not entered the collective the others wait in (its
group's sequence number is below the one they wait at).  That collective cannot finish
without it, whatever a silent rank did; and a rank can look silent when its node's reports
were lost to an overloaded coordinator or network rather than to a stopped process.  Among
silent ranks, one whose last (current) report shows it short of that collective, and in no
other, is named before the others.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rankwatch.agent.detect import p2p_wait
from rankwatch.knobs import require_positive

__all__ = ["HangConfig", "HangVerdict", "RankProgress", "detect_hang", "flight_recorder_evidence", "hang_possible"]


@dataclass(kw_only=True)
class HangConfig:
    floor_seconds: float = 5.0
    """No allowance is shorter than this."""
    step_multiple: float = 5.0
    """Allowance in multiples of the rank's median step time."""
    first_step_seconds: float = 120.0
    """Allowance before a rank has completed a step (start-up, warm-up)."""
    checkpoint_seconds: float = 600.0
    """Allowance while a rank is in a checkpoint save."""
    eval_seconds: float = 600.0
    """Allowance while a rank is in evaluation."""
    recovery_seconds: float = 60.0
    """Allowance while a rank is inside an in-process recovery: leaving the step, agreeing,
    rebuilding its groups, taking state (a joiner's from a peer).  The tier bounds each of its
    own waits; past them it gives up to torchrun's restart."""
    silence_seconds: float = 2.0
    """A rank whose stream has sent nothing for this long is silent (stopped or gone)."""
    stale_copy_seconds: float = 10.0
    """The coordinator waits for current copies of every node's ranks at most this long past
    the allowance before it names a culprit from the copies it has (see :func:`detect_hang`)."""

    def __post_init__(self) -> None:
        require_positive(self, "floor_seconds", "step_multiple", "first_step_seconds", "checkpoint_seconds",
                         "eval_seconds", "recovery_seconds", "silence_seconds", "stale_copy_seconds")

    def allowance(self, r: RankProgress) -> float:
        if r.activity == "checkpoint":
            return self.checkpoint_seconds
        if r.activity == "eval":
            return self.eval_seconds
        if r.activity == "recovery":
            return self.recovery_seconds
        if r.steps_completed == 0:
            return self.first_step_seconds
        return max(self.floor_seconds, self.step_multiple * r.step_seconds)


@dataclass(kw_only=True)
class RankProgress:
    rank: int
    node: str
    step: int
    step_seconds: float
    steps_completed: int
    activity: str
    progress_at: float          # agent clock: last time step or a sequence number moved
    last_seen: float            # agent clock: last message
    connected: bool
    exited_cleanly: bool = False
    group_seqs: Mapping[str, int] = field(default_factory=dict)
    inflight: dict[str, Any] | None = None   # {op, group, seq, since}
    stacks: str | None = None                # fresh stacks only (taken within the last 10 s)
    flight_recorder: dict | None = None      # {pending: [{group, seq, op, ...}], completed}
    pid: int = 0
    alive: bool | None = None                # None: unknown (its node's agent is silent)
    stopped: bool = False                    # SIGSTOPped
    # The straggler detector's windows, oldest first: own work, data wait, collective wait.
    own: Sequence[float] = ()
    data: Sequence[float] = ()
    wait: Sequence[float] = ()
    period: float = 0.0
    """Seconds from step start to step start as the rank's node measured them (0: unknown)."""
    role: int = 0
    """The rank's pipeline stage: stragglers are compared within it (``work_scores.role_of``)."""
    reported_at: float | None = None
    """Agent clock: the rank's last message as its node reported it (the coordinator's
    ``last_seen`` runs on from there while the node is heard); None: ``last_seen``."""
    current: bool = True
    """False: the coordinator's copy of this rank predates its latest progress (its node moved
    on since the copy was sent whole; only beats said so).  Its sequence numbers and in-flight
    collective are then older than the rank's."""


@dataclass(kw_only=True)
class HangVerdict:
    culprit: RankProgress
    reason: str
    stalled_for: float
    allowance: float
    collective: dict[str, Any] | None     # what the others wait in: {op, seq, group}
    silent: list[int]
    reported_for: float = 0.0
    """The shortest stall any rank still heard showed in its last report (its last message
    less its last progress, both on its node's clock): how long the ranks themselves say they
    stood still, whatever the lag before their reports arrived.  0 when no rank is heard."""
    by_silence: bool = False
    """The culprit was named for its silence alone (not for a report of its own)."""
    p2p: dict[str, Any] | None = None
    """A rank waits in a send or receive on the culprit: both ends (:func:`.p2p_wait.ends`)."""


def hang_possible(now: float, latest_progress: float, cfg: HangConfig) -> bool:
    """Whether any verdict could come of ranks whose latest progress was at ``latest_progress``.

    A cheap test before :func:`detect_hang`: no allowance is shorter than the shortest knob.
    """
    shortest = min(cfg.floor_seconds, cfg.first_step_seconds, cfg.checkpoint_seconds, cfg.eval_seconds,
                   cfg.recovery_seconds)
    return now - latest_progress >= shortest


def detect_hang(now: float, ranks: list[RankProgress], cfg: HangConfig) -> HangVerdict | None:
    """Return a verdict if every live rank is stalled beyond its allowance, else None."""
    live = [r for r in ranks if not r.exited_cleanly]
    if not live:
        return None
    allowance = max(cfg.allowance(r) for r in live)
    stalled_for = min(now - r.progress_at for r in live)
    if stalled_for < allowance:
        return None
    silent: list[RankProgress] = []   # one pass: ``r in silent`` would compare dataclasses, n x m
    waiting: list[RankProgress] = []
    for r in live:
        (silent if not r.connected or now - r.last_seen > cfg.silence_seconds else waiting).append(r)
    if stalled_for < allowance + cfg.stale_copy_seconds and any(not r.current for r in waiting):
        # A copy older than its rank's last progress would show that rank behind the others on
        # sequence numbers it has long passed: wait for every node's current copy (a relay
        # sends a stalled node whole within about two seconds and an interval), within a bound.
        return None
    if not waiting and all(r.alive is False for r in silent):
        # Every process is gone (a crash of all, or torchrun restarting the workers): nothing
        # waits on anything, so nothing hangs.  Whether their nodes are dead is judged by the
        # nodes' own rule (all ranks died, past a grace for the restart).
        return None
    collective = _waited_collective(waiting)
    by_silence = False
    heard = _holding_up(waiting, collective) if silent else None
    if heard is not None and collective is not None:
        culprit = heard
        reason = (f"behind the others on collective sequence numbers of group {collective['group']}: it has "
                  f"not entered the collective they wait in (sequence {collective['seq']}) and waits in none; "
                  f"{len(silent)} rank(s) went silent meanwhile")
    elif silent:
        short = _holding_up(silent, collective)
        culprit = short or min(silent, key=lambda r: (r.last_seen, r.rank))
        by_silence = short is None
        reason = "its stream went silent while the others wait"
        if short is not None and collective is not None:
            reason += (f", and its last report shows it short of the collective they wait in "
                       f"(group {collective['group']}, sequence {collective['seq']})")
    else:
        culprit, reason = _p2p_culprit(live) or _heard_culprit(live)
    p2p = p2p_wait.ends(waiting, culprit)
    if p2p is not None and "point-to-point" not in reason:
        reason += f"; {p2p_wait.describe(p2p)}"
    return HangVerdict(culprit=culprit, reason=reason, stalled_for=stalled_for, allowance=allowance,
                       collective=collective, silent=[r.rank for r in silent],
                       reported_for=min((_reported(r) - r.progress_at for r in waiting), default=0.0),
                       by_silence=by_silence, p2p=p2p)


def _p2p_culprit(live: list[RankProgress]) -> tuple[RankProgress, str] | None:
    """Every rank heard: a point-to-point wait cycle (its longest stalled member is named), or
    the rank a send or receive waits on that is inside no operation (it never posted the
    matching one); None: neither (:mod:`.p2p_wait`)."""
    cycle = p2p_wait.deadlock(live)
    if cycle is not None:
        links = (p2p_wait.ends([a], b) for a, b in zip(cycle, cycle[1:] + cycle[:1]))
        return (min(cycle, key=lambda r: (r.progress_at, r.rank)),
                "a point-to-point deadlock: " + "; ".join(p2p_wait.describe(e) for e in links if e))
    by_rank = {r.rank: r for r in live}
    idle = [by_rank[p] for p in set(p2p_wait.waits_on(live).values()) if p in by_rank and by_rank[p].inflight is None]
    if not idle:
        return None
    culprit = min(idle, key=lambda r: (r.progress_at, r.rank))
    return culprit, "it never posted the point-to-point operation a peer waits in: " + \
        p2p_wait.describe(p2p_wait.ends(live, culprit) or {})


def _heard_culprit(live: list[RankProgress]) -> tuple[RankProgress, str]:
    """Every rank heard, no P2P wait to follow: the rank behind on a group's sequence numbers,
    else the one stuck outside any collective, else the longest stalled."""
    behind = _behind_on_sequence(live)
    if behind is not None:
        culprit, group = behind
        return culprit, f"behind the others on collective sequence numbers of group {group}"
    outside = [r for r in live if r.inflight is None]
    culprit = min(outside or live, key=lambda r: (r.progress_at, r.rank))
    return culprit, ("stuck outside any collective while the others wait" if outside
                     else "every rank is inside a collective; the longest stalled is named")


def _waited_collective(waiting: list[RankProgress]) -> dict[str, Any] | None:
    """The collective most waiting ranks are blocked in: from the hooks' records, else
    (a collective issued where no hook sees it, e.g. from C++) from the Flight Recorder."""
    keys = [(i["op"], i["group"], i["seq"]) for i in (r.inflight for r in waiting) if i]
    source = "hooks"
    if not keys:
        # Each waiting rank's oldest collective not yet retired.
        oldest = [min(fr["pending"], key=lambda e: e["since"]) for fr in
                  (r.flight_recorder for r in waiting) if fr and fr.get("pending")]
        keys = [(e["op"], e["group"], e["seq"]) for e in oldest]
        source = "flight_recorder"
    if not keys:
        return None
    # (one count per key: ``keys.count`` per distinct key is quadratic when each tensor-parallel
    # group waits in its own collective; ties go to the key seen first)
    (op, group, seq), _ = Counter(keys).most_common(1)[0]
    return {"op": op, "group": group, "seq": seq, "source": source}


def _reported(r: RankProgress) -> float:
    return r.last_seen if r.reported_at is None else r.reported_at


def _holding_up(ranks: list[RankProgress], collective: dict[str, Any] | None) -> RankProgress | None:
    """The rank stalled longest of ``ranks`` whose copies are current, inside no collective and
    behind the sequence number of the collective the others wait in (from the hooks' records:
    the Flight Recorder numbers its entries its own way)."""
    if collective is None or collective["source"] != "hooks" or collective["seq"] < 0:
        return None
    group, seq = collective["group"], collective["seq"]
    stuck = [r for r in ranks
             if r.inflight is None and r.current and r.group_seqs.get(group, seq) < seq]
    return min(stuck, key=lambda r: (r.progress_at, r.rank)) if stuck else None


def _behind_on_sequence(ranks: list[RankProgress]) -> tuple[RankProgress, str] | None:
    """The rank furthest behind its group's top sequence number, and the group (ties: the
    first group by name, then the first rank in ``ranks``' order).

    Two passes over the ranks' groups, whatever their number: a job with a tensor-parallel
    group per node has thousands, and a pass over every rank per group was quadratic."""
    top: dict[str, int] = {}
    for r in ranks:
        seqs = r.group_seqs
        for g in seqs:   # (keys, then each value: a protobuf map's items() is Python-level)
            seq = seqs[g]
            t = top.get(g)
            if t is None or seq > t:
                top[g] = seq
    gap, worst, group = 0, None, ""
    for r in ranks:
        seqs = r.group_seqs
        for g in seqs:
            d = top[g] - seqs[g]
            if d > gap or (d == gap and d > 0 and g < group):
                gap, worst, group = d, r, g
    return (worst, group) if worst is not None else None


def flight_recorder_evidence(ranks: list[RankProgress]) -> dict[str, dict] | None:
    """Every rank's fresh Flight Recorder extract, by rank, for a ``hang`` incident."""
    out = {str(r.rank): r.flight_recorder for r in sorted(ranks, key=lambda r: r.rank)
           if r.flight_recorder}
    return out or None
