"""The coordinator's load: how often nodes sync, and when a silent node is evidence of anything.

One coordinator serves every node's ``Sync``.  Python's gRPC server is bound by
one core (the GIL), so a big job can ask for more syncs than it can serve.  Two
rules keep an overloaded coordinator from harming the job:

* **Backpressure.**  Each reply tells the node how often to sync
  (:func:`sync_interval`): the base rate while the coordinator has room, slower
  as the job grows past what it can serve, by its measured load.
* **Silence is evidence only from a coordinator that could have heard.**  A node
  whose summaries stop arriving is silent after the longer of the timeout and a
  few of its sync intervals (:func:`node_silent`).  While the coordinator itself
  shows overload (:func:`overload`): its own loop ran late (it was paused or
  starved), its process is saturating a core, summaries arrive late against
  each node's best, it refused calls for lack of capacity, it answered syncs after
  their callers had given up on them, or it heard under half the summaries due, either
  while busy or with more nodes' worth missing than ever die at once (the burst rule's
  size, :func:`~rankwatch.agent.job.node_death.burst_size`), no node is called silent, and
  for a grace period after it, so every node gets a fair chance to be heard.  (A job-wide
  shortfall while the coordinator idles is the network's or the senders' trouble: each
  evaluation then finds only a trickle of nodes past their silence allowance, under the
  burst rule's size, and would exclude them one by one.)  Positive evidence (a node that
  reports its ranks dead, a hang's culprit, a fatal GPU fault) still acts, and so does a
  relay's word: a node its relay, listening to the rest of its group, has not heard for
  longer than the allowance is silent even then (:func:`node_silent`).
* **A hang is acted on while overloaded only as the ranks report it.**  A late
  coordinator sees every rank's progress late, so a job that trains can look hung to
  it.  Until its quiet period ends, a hang verdict stands only if every rank still
  heard reported itself, at its own last report, stalled past the allowance, and the
  culprit was not named for its silence alone (:func:`hang_shown_by_reports`).
* **Only a node heard steadily can fall silent.**  A node is called silent only after
  this coordinator heard ``min_syncs`` of its summaries.  When thousands of nodes
  join at once (a job's start, a new coordinator taking over), syncs fail at the door
  before the load window has measured the overload; a node heard once and then
  refused was not silent, and excluding it would restart a healthy job.  A node that
  dies that early leaves the rendezvous round all the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rankwatch.knobs import require_positive

__all__ = ["Load", "LoadConfig", "detector_due", "first_sync_delay", "hang_shown_by_reports", "interval_floor", "node_silent",
           "overload", "quiet_until", "retry_delay", "silence_allowance", "straggler_due", "sync_interval"]


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    base_interval: float = 0.25
    """Seconds between a node's syncs while the coordinator has room."""
    max_interval: float = 5.0
    """Never ask a node to sync less often than this."""
    target_cores: float = 0.7
    """Slow the nodes down while the coordinator's process uses more CPU than this (cores);
    speed them up again below 70 % of it."""
    busy_cores: float = 0.9
    """The process using this many cores or more is saturated (one core: the GIL)."""
    lag_seconds: float = 1.0
    """The coordinator's own loop running this much late: it was paused or starved."""
    delay_seconds: float = 0.5
    """Summaries arriving this much later than each node's best (median): overloaded."""
    max_syncs_per_second: float = 2000.0
    """About what one core serves: nodes never sync faster than this allows together, so a
    big job's first seconds (every node joining at once) do not swamp the coordinator."""
    silent_intervals: float = 3.0
    """A node is silent after this many of its sync intervals (or the node timeout, if longer)."""
    min_syncs: int = 3
    """A node is called silent only once this coordinator heard this many of its summaries."""
    first_sync_spread: float = 2.0
    """A node's first sync comes at a random point within this many seconds of its agent's
    start (:func:`first_sync_delay`) ..."""
    first_syncs_per_second: float = 400.0
    """... or, in a job whose size the agent knows, within as many seconds as it takes this
    many first syncs a second to bring in every node, if that is longer."""
    detector_share: float = 1 / 3
    """The hang detector's pass over every rank runs at most this share of the time
    (:func:`detector_due`) ..."""
    detector_paced_from: float = 0.05
    """... once a pass takes this many seconds (a cheaper one runs at every tick)."""
    straggler_every_overloaded: float = 5.0
    """While the coordinator is overloaded, its straggler pass over every node runs at most
    this often (:func:`straggler_due`)."""
    straggler_share: float = 0.05
    """... and, however loaded, its pass runs at most this share of the time (a pass over
    16,384 ranks took 0.1-0.15 s on a slow machine: then every 2-3 s)."""
    max_backoff: float = 16.0
    """A node whose syncs a busy coordinator did not answer waits at most this many of its
    intervals (and never more than ``max_interval``) before the next (:func:`retry_delay`)."""

    def __post_init__(self) -> None:
        if not 0 < self.base_interval <= self.max_interval:
            raise ValueError("LoadConfig needs 0 < base_interval <= max_interval")
        require_positive(self, "target_cores", "busy_cores", "lag_seconds", "delay_seconds",
                         "max_syncs_per_second", "silent_intervals", "min_syncs", "first_sync_spread",
                         "first_syncs_per_second",
                         "max_backoff", "detector_share", "detector_paced_from", "straggler_every_overloaded",
                         "straggler_share")


@dataclass(frozen=True, kw_only=True)
class Load:
    """What the coordinator measured of itself over its last window."""

    cores: float
    """Process CPU seconds per wall second."""
    loop_lag: float
    """How much later than planned its evaluation loop last ran (seconds)."""
    sync_delay: float
    """Median over recent summaries of (arrival - sending) minus that node's smallest."""
    refused: int = 0
    """Calls the agent refused for lack of capacity in the window (its own caps)."""
    late: int = 0
    """Syncs answered in the window after their callers' deadlines had passed: the caller
    saw a failure, and the node may look silent, because the coordinator was slow."""
    heard: float = 1.0
    """Summaries received over those the nodes were told to send in the window."""
    nodes: int = 0
    """Nodes the summaries were due from (neither dead nor excluded)."""


def overload(load: Load, cfg: LoadConfig, burst: float = math.inf) -> str | None:
    """Why the coordinator is itself a bottleneck now, or None.  ``burst``: the most nodes
    taken for dead at once (:func:`~rankwatch.agent.job.node_death.burst_size` of the job)."""
    if load.loop_lag >= cfg.lag_seconds:
        return f"its own loop ran {load.loop_lag:.1f}s late (paused or starved)"
    if load.cores >= cfg.busy_cores:
        return f"it uses {load.cores:.2f} cores (saturated)"
    if load.sync_delay >= cfg.delay_seconds:
        return f"summaries arrive {load.sync_delay:.2f}s late (median)"
    if load.refused > 0:
        return f"it refused {load.refused} calls for lack of capacity"
    if load.late > 0:
        return f"it answered {load.late} syncs after their callers' deadlines"
    if load.heard < 0.5 and load.cores >= cfg.target_cores:
        return f"it heard {load.heard:.0%} of the summaries due while busy ({load.cores:.2f} cores)"
    if load.heard < 0.5 and (missing := (1.0 - load.heard) * load.nodes) > burst:
        return (f"it heard {load.heard:.0%} of the summaries due: {missing:.0f} nodes' worth missing, "
                f"more than the {burst:.0f} taken for dead at once")
    return None


def detector_due(now: float, last_at: float, last_cost: float, cfg: LoadConfig) -> bool:
    """Whether the hang detector may take its snapshot of every rank again at ``now``
    (monotonic seconds), its last pass having begun at ``last_at`` and taken ``last_cost``.

    While a hang is possible (the job's latest progress is older than the shortest allowance)
    the coordinator looks for one at every tick, a snapshot of every rank each time: at 16,384
    ranks on a slow machine 0.2–0.3 s a pass, so at 4 ticks a second the detector alone can
    hold the GIL the gRPC threads serve syncs with.  (In two of five 2,048-node runs whose ranks
    all stalled at once, the coordinator stayed overloaded for the rest of the run, most of its
    failed calls direct syncs of nodes their relays no longer answered.)  Spaced to ``detector_share`` of the time, a pass of
    0.3 s comes every 0.9 s (a verdict at most that much later); one cheaper than
    ``detector_paced_from``, every tick.
    """
    return last_cost < cfg.detector_paced_from or now - last_at >= last_cost / cfg.detector_share


def straggler_due(now: float, last_at: float, interval: float, overloaded: bool, cfg: LoadConfig,
                  last_cost: float = 0.0) -> bool:
    """Whether the coordinator's straggler pass runs again at ``now``, its last having run at
    ``last_at`` and taken ``last_cost`` seconds, with nodes syncing every ``interval`` s.

    Once per sync interval (at least a second apart): a node's windows change no faster.
    While the coordinator is overloaded, at most every ``straggler_every_overloaded`` s: in a
    2,048-node job's start, every summary is whole and the pass reads every node's windows
    again (0.15–0.2 s on a slow machine), a fifth of the time at once a second, taken from
    the threads that serve the syncs.  A straggler is judged over many steps; a verdict a
    few seconds later costs the job little.  Nor does one spaced to ``straggler_share`` of the
    time by its own cost: the pass reads every step completed since the last, so no evidence
    is skipped, and at 2,048 nodes once a second it held the GIL a seventh of the time that the
    syncs at 4 Hz needed."""
    every = max(1.0, interval, cfg.straggler_every_overloaded if overloaded else 0.0,
                max(0.0, last_cost) / cfg.straggler_share)
    return now - last_at >= every


def quiet_until(now: float, interval: float, node_timeout: float, cfg: LoadConfig) -> float:
    """After overload at ``now``: the time before which no node is called silent."""
    return now + silence_allowance(interval, node_timeout, cfg)


def silence_allowance(interval: float, node_timeout: float, cfg: LoadConfig, relayed: bool = False) -> float:
    """Seconds without a summary after which a node syncing every ``interval`` is silent.

    A node heard through a relay (``relayed``) has one interval more: its summary waits in
    the relay for the relay's next call, so the coordinator hears it up to an interval (and
    a call) later than a node that syncs itself.  With three intervals, a relay call that
    ran out its deadline at a 1.1 s interval left members unheard past the allowance, and a
    2,048-node run excluded ten healthy nodes at once."""
    return max(node_timeout, (cfg.silent_intervals + (1 if relayed else 0)) * interval)


def node_silent(now: float, received_at: float, interval: float, node_timeout: float,
                quiet: float, cfg: LoadConfig, syncs: int | None = None,
                witness: tuple[float, float] | None = None, relayed: bool = False) -> bool:
    """Whether a node whose last summary arrived at ``received_at`` has gone silent
    (``syncs``: how many of its summaries this coordinator heard; None: enough;
    ``relayed``: it came through a relay, :func:`silence_allowance`).

    ``witness``: ``(unheard_since, said_at)``, its relay's latest word (said at ``said_at``)
    that it had not heard the node since ``unheard_since`` (all on this clock).  Before the
    quiet period after the coordinator's overload ends, a node is silent only on that word:
    a relay that heard the rest of its group, but not this node, for longer than the
    allowance (a word no older than the allowance).  The coordinator's own view then is
    no evidence; the relay's is, as the relay was not the bottleneck."""
    if syncs is not None and syncs < cfg.min_syncs:
        return False
    allowance = silence_allowance(interval, node_timeout, cfg, relayed)
    if now - received_at <= allowance:
        return False
    if now >= quiet:
        return True
    if witness is None:
        return False
    unheard_since, said_at = witness
    return said_at - unheard_since > allowance and now - said_at <= allowance


def hang_shown_by_reports(now: float, quiet: float, reported_for: float, allowance: float,
                          by_silence: bool) -> bool:
    """Whether a hang verdict may be acted on at ``now``: always once the quiet period after
    the coordinator's overload (``quiet``) is over; before that, only when the ranks still
    heard reported themselves stalled ``reported_for`` seconds, past the ``allowance``, and
    the culprit was not named for its silence alone."""
    return now >= quiet or (not by_silence and reported_for >= allowance)


def first_sync_delay(u: float, coordinates: bool, cfg: LoadConfig, nodes: int = 0) -> float:
    """Seconds before a node's first sync, for ``u`` drawn uniformly from [0, 1), in a job of
    ``nodes`` nodes (0: not known).

    The agents of a big job start together (a Slurm prolog on every node, a DaemonSet
    rolled out at once); their first syncs would reach the coordinator as one burst, more
    calls than it can answer in time, before any reply has asked them to slow down.
    They are spread over ``first_sync_spread`` seconds, or, when the agent knows the job's
    size, over ``nodes / first_syncs_per_second`` seconds if longer: 2,048 nodes over 5.1 s.
    (A first sync is a whole summary sent to the coordinator itself, before any relay is
    assigned: the costliest call it serves.)  The agent that is itself the first coordinator
    candidate syncs at once: it takes the coordinator's role then, and the others are
    answered from the start."""
    spread = max(cfg.first_sync_spread, max(0, nodes) / cfg.first_syncs_per_second)
    return 0.0 if coordinates else max(0.0, min(1.0, u)) * spread


def retry_delay(busy_failures: int, interval: float, u: float, cfg: LoadConfig, allowance: float,
                took: float = 0.0) -> float:
    """Seconds before a node's next sync, after ``busy_failures`` syncs in a row that a busy
    coordinator did not answer (its deadline passed, refused for capacity, cancelled), for
    ``u`` drawn uniformly from [0, 1), and ``allowance``: how long a coordinator waits to hear
    from this node before it calls it silent (:func:`silence_allowance`); ``took``: how long
    the last sync ran.

    None: the interval from when the last sync began, and at least half of it after the sync
    ended.  Counted from its end, a relay whose calls took 65 ms synced at 3.2 Hz, not the
    4 Hz asked for; its nodes' summaries reached the coordinator that much later.  The half
    keeps a slow answer from turning into syncs back to back; and never does a node sync
    more often than the interval.  Then the interval doubles with each, up to ``max_backoff`` of them,
    ``max_interval`` and a third of the allowance, and the node waits a random point in the
    upper half of that: a
    coordinator swamped by a big job's first syncs sheds its callers, spread out, instead of
    hearing them all again a quarter second later.  Its load rules keep it from calling any
    of them silent while it is overloaded; the bound by the allowance keeps a node's silence
    short of that call once it no longer is (a wait, then a sync that runs out its deadline,
    then the next).  A coordinator that is gone (its connection refused) is no
    reason to wait: the node tries the next candidate at its interval, so a failover is not
    slowed.
    """
    if busy_failures <= 0:
        return max(interval - max(0.0, took), interval / 2)
    top = min(cfg.max_interval, allowance / 3, interval * min(cfg.max_backoff, 2.0 ** min(busy_failures, 32)))
    return max(interval, top * (0.5 + 0.5 * max(0.0, min(1.0, u))))


def interval_floor(nodes: int, cfg: LoadConfig) -> float:
    """The shortest interval for ``nodes`` nodes together (before any load is measured)."""
    return max(cfg.base_interval, min(cfg.max_interval, nodes / cfg.max_syncs_per_second))


def sync_interval(current: float, load: Load, cfg: LoadConfig) -> float:
    """How often every node should sync next, so that the coordinator keeps room to spare.

    Multiplicative steps on the measured load: 1.5x slower while the coordinator is over
    its CPU target or overloaded, 0.8x faster while it is well under it and summaries
    arrive on time.  (Its CPU has a fixed part, so a per-sync cost model would misjudge
    small rates; the steps need none.)
    """
    if overload(load, cfg) is not None or load.cores >= cfg.target_cores:
        return min(cfg.max_interval, current * 1.5)
    if load.cores < 0.7 * cfg.target_cores and load.sync_delay < cfg.delay_seconds / 2:
        return max(cfg.base_interval, current * 0.8)
    return current
