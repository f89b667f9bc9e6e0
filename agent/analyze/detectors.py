"""The live agent's detectors over a recorded job's steps, unchanged.

* **Stragglers**: the live :class:`~rankwatch.agent.detect.straggler.StragglerDetector`,
  fed one step at a time as if each had just completed (its windows, CUSUM, hold and
  hysteresis as live).  Two settings follow the recording's length (:func:`offline_config`):
  a short trace cannot spare the live 30 warm-up steps, nor two seconds of hold in a run of
  six.
* **Pipeline stages and bottleneck**: :func:`~rankwatch.agent.detect.imbalance.pipeline` and
  :func:`~rankwatch.agent.detect.bottleneck.decide`, with windows over the whole recording.
* **Hangs**: :func:`~rankwatch.agent.detect.hang_verdict.detect_hang` at the recording's end,
  when its ranks stop at different sequence numbers of a group (a recording that just ends
  leaves every member of every group at the same one).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import cast

import numpy as np

from rankwatch.agent.analyze.rank_steps import StepMatrix
from rankwatch.agent.analyze.table import KINDS, NOT_SET, OpTable
from rankwatch.agent.detect.bottleneck import BottleneckConfig, BottleneckState, combine, decide, rank_part
from rankwatch.agent.detect.evaluate import straggler_detail
from rankwatch.agent.detect.hang_verdict import HangConfig, RankProgress, detect_hang
from rankwatch.agent.detect.imbalance import BalanceConfig, Pipeline, pipeline
from rankwatch.agent.detect.straggler import RankWork, StragglerConfig, StragglerDetector

__all__ = ["bottleneck", "hang", "offline_config", "stages", "stragglers"]

HISTORY = 64   # steps of each rank the detector is given (as a node agent keeps)


def offline_config(sm: StepMatrix, base: StragglerConfig | None = None) -> StragglerConfig:
    """The live settings, with the warm-up cut to a fifth of the steps and the hold to a tenth
    of the recording's time where the recording is short."""
    cfg = base or StragglerConfig()
    steps = len(sm.steps)
    wall = float(np.nanmax(sm.end) - np.nanmin(sm.start)) if steps else 0.0
    return dataclasses.replace(cfg, warmup_steps=min(cfg.warmup_steps, steps // 5),
                               hold_seconds=min(cfg.hold_seconds, 0.1 * wall))


def _rolling_median(x: np.ndarray, n: int) -> np.ndarray:
    """(R, S): each cell the median of the row's last ``n`` finite values up to it."""
    padded = np.concatenate([np.full((x.shape[0], n - 1), np.nan), x], axis=1)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(np.lib.stride_tricks.sliding_window_view(padded, n, axis=1), axis=2)


def _work(sm: StepMatrix, k: int, step_seconds: np.ndarray) -> Iterator[RankWork]:
    lo = max(0, k + 1 - HISTORY)
    late = None if np.isnan(sm.late).all() else sm.late
    known = np.isfinite(sm.own[:, k])
    for i, rank in enumerate(sm.ranks.tolist()):
        if not known[i]:
            continue
        yield RankWork(rank=rank, node=sm.nodes[i], step=int(sm.steps[k]), own=_seq(sm.own[i, lo:k + 1]),
                       data=_seq(sm.data[i, lo:k + 1]), wait=_seq(sm.wait[i, lo:k + 1]),
                       step_seconds=float(step_seconds[i, k]), completed=k + 1,
                       start=list(sm.start[i, lo:k + 1]), late=None if late is None else list(late[i, lo:k + 1]),
                       role=int(sm.role[i]))


def stragglers(sm: StepMatrix, cfg: StragglerConfig) -> list[dict]:
    """Every straggler flag raised over the recording, as ``status --json`` incidents."""
    det = StragglerDetector(cfg=cfg)
    out = []
    step_seconds = _rolling_median(sm.span, 16)
    for k in range(len(sm.steps)):
        for ev in det.update(list(_work(sm, k, step_seconds))):
            if ev.kind != "flagged":
                continue
            detail = straggler_detail(ev, cfg.window, "job")
            detail["offline"] = True
            i = int(np.searchsorted(sm.ranks, ev.score.rank))
            out.append({"kind": "straggler", "node": ev.work.node, "rank": ev.score.rank, "step": ev.work.step,
                        "detected_at": round(float(np.nan_to_num(sm.end[i, k], nan=0.0)), 6), "detail": detail})
    return out


def stages(sm: StepMatrix) -> Pipeline | None:
    if not sm.staged:
        return None
    n = len(sm.steps)
    cfg = BalanceConfig(window=max(1, n), min_steps=max(1, min(10, n)))
    return pipeline(((int(sm.role[i]), _finite(sm.own[i]), _finite(sm.wait[i])) for i in range(len(sm.ranks))), cfg)


def bottleneck(sm: StepMatrix) -> dict | None:
    n = len(sm.steps)
    cfg = BottleneckConfig(window=max(1, n), min_steps=max(1, min(10, n)))
    part = combine((rank_part(_finite(sm.own[i]), _finite(sm.data[i]), _finite(sm.wait[i]), cfg)
                    for i in range(len(sm.ranks))), cfg)
    v = decide(0.0, BottleneckState(), part, cfg).verdict
    if v is None:
        return None
    return {"kind": v.kind, "share": round(v.share, 4), "shares": {k: round(s, 4) for k, s in v.shares.items()},
            "step_seconds": round(v.part.step, 6), "scope": "job"}


def _finite(x: np.ndarray) -> Sequence[float]:
    return _seq(x[np.isfinite(x)])


def _seq(x: np.ndarray) -> Sequence[float]:
    """An array where the detectors take a sequence of floats (they index and convert it)."""
    return cast(Sequence[float], x)


def hang(t: OpTable, sm: StepMatrix) -> list[dict]:
    """A hang at the recording's end: a group's last collective was issued by fewer of its
    members than its others were, and the members that issued it wait in it."""
    seq = t.column("seq")
    if t.group is None or seq is None:
        return []
    coll = np.flatnonzero((t.kind == KINDS.index("collective")) & (t.group != NOT_SET) & (seq != NOT_SET))
    if not coll.size:
        return []
    seqs, inflight = _last_collectives(t, coll, seq)
    if not inflight:
        return []
    cfg = HangConfig()
    ends = np.nanmax(sm.end, axis=1)
    now = float(np.nanmax(ends))
    later = now + 3600.0   # judged an hour on: past any allowance, every rank heard, none progressing
    ranks = []
    for i, r in enumerate(sm.ranks.tolist()):
        done = np.flatnonzero(np.isfinite(sm.end[i]))
        ranks.append(RankProgress(
            rank=r, node=sm.nodes[i], step=int(sm.steps[done[-1]]), step_seconds=float(np.nanmedian(sm.span[i])),
            steps_completed=len(done), activity="train", progress_at=float(ends[i]), last_seen=later, connected=True,
            group_seqs=seqs.get(r, {}), inflight=inflight.get(r), own=_finite(sm.own[i]), data=_finite(sm.data[i]),
            wait=_finite(sm.wait[i]), role=int(sm.role[i])))
    verdict = detect_hang(later, ranks, cfg)
    if verdict is None:
        return []
    c = verdict.culprit
    return [{"kind": "hang", "node": c.node, "rank": c.rank, "step": c.step, "detected_at": round(now, 6),
             "detail": {"collective": verdict.collective, "alive": None, "stacks": None, "reason": verdict.reason,
                        "offline": True}}]


def _last_collectives(t: OpTable, coll: np.ndarray, seq: np.ndarray) -> tuple[dict, dict]:
    """Each rank's last sequence number per group, and the ranks inside a group's last
    collective when fewer members issued it than issued the group's others (``inflight``)."""
    assert t.group is not None
    g, q, r = t.group[coll], seq[coll], t.rank[coll]
    seqs: dict[int, dict[str, int]] = {}
    inflight: dict[int, dict] = {}
    for gid in np.unique(g).tolist():
        mine = g == gid
        gq, gr = q[mine], r[mine]
        members = np.unique(gr)
        last = int(gq.max())
        issued = np.unique(gr[gq == last])
        name = t.names[gid]
        for rank in members.tolist():
            seqs.setdefault(rank, {})[name] = int(gq[gr == rank].max())
        if len(issued) < len(members):
            op = t.names[int(t.op[coll][mine][gq == last][0])]
            for rank in issued.tolist():
                inflight[rank] = {"op": op, "group": name, "seq": last, "since": 0.0}
    return seqs, inflight
