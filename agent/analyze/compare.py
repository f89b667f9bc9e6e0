"""``rankwatch analyze NEW --compare BASE``: where two runs' step time differs, per phase, stage and op.

Pure functions of two :class:`~rankwatch.agent.analyze.table.OpTable`\\ s.  The step time of a
run is, per step, the latest end less the earliest start over all ranks, its median over the
steps.  A phase (an op ``kind``), a stage (the ``pp`` column: its ranks' own work, the
non-blocking kinds) and an op name each get seconds per step two ways:

- ``base``/``new``: on the rank that set each step's time, the one that waited least in
  collectives and P2P (it arrived last; among the ranks that have it), then the median over
  steps.  The changes are ranked by these: a rank whose loader slows makes its peers wait as
  long, and the change in their wait is the consequence, not the cause.
- ``all_ranks``: the sum over each rank-step that has it, then the median over those rank-steps
  (the typical rank: one slow rank of many leaves it unmoved).

:func:`regressed` says whether the step time grew by more than a percentage, for a CI job's
exit code; :func:`compare_main` is the command's body.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from rankwatch.agent.analyze.table import BLOCKING, KINDS, NOT_SET, OpTable, TraceError

__all__ = ["TOP_OPS", "RunSummary", "compare", "compare_main", "regressed", "summarise", "text"]

TOP_OPS = 20
"""The ops a comparison lists: those whose seconds per step changed most."""
_SHOWN = 5   # stages and ops the text names

Figures = dict[Any, tuple[float, float]]
"""Per phase, stage or op: (its seconds a step on the step-setting rank, on the typical rank)."""


class _Run:
    """One run's rank-steps: each row's rank-step, each rank-step's step and blocked seconds."""

    def __init__(self, t: OpTable) -> None:
        if len(t) == 0:
            raise TraceError(t.source or "(no input)", "no operations to compare")
        self.t = t
        keys = t.step.astype(np.int64) * (int(t.rank.max()) + 1) + t.rank
        uniq, self.rs = np.unique(keys, return_inverse=True)
        self.rs = self.rs.ravel()
        self.rs_step = uniq // (int(t.rank.max()) + 1)
        blocking = np.isin(t.kind, [KINDS.index(k) for k in BLOCKING])
        self.blocked = np.bincount(self.rs, weights=np.where(blocking, t.duration, 0.0), minlength=len(uniq))
        self.own = ~blocking

    def step_seconds(self) -> float:
        """Per step the latest end less the earliest start over every rank; the median over steps."""
        order = np.argsort(self.t.step, kind="stable")
        step = self.t.step[order]
        cut = np.flatnonzero(np.r_[True, step[1:] != step[:-1]])
        first = np.minimum.reduceat(self.t.start[order], cut)
        last = np.maximum.reduceat((self.t.start + self.t.duration)[order], cut)
        return float(np.median(last - first))

    def per_step(self, label: np.ndarray, rows: np.ndarray | None = None) -> dict[int, tuple[float, float]]:
        """For each label (rows with ``label`` < 0 or outside ``rows`` left out):
        (the median over steps of the least-blocked rank-step's sum, the median over rank-steps)."""
        keep = label >= 0 if rows is None else (label >= 0) & rows
        lab, rs = label[keep].astype(np.int64), self.rs[keep]
        n = len(self.rs_step)
        pairs, inverse = np.unique(lab * n + rs, return_inverse=True)
        sums = np.bincount(inverse.ravel(), weights=self.t.duration[keep], minlength=len(pairs))
        g, r = pairs // n, pairs % n
        step, blocked = self.rs_step[r], self.blocked[r]
        order = np.lexsort((blocked, step, g))          # per (label, step): the least-blocked rank first
        g, step, sums_by = g[order], step[order], sums[order]
        first = np.r_[True, (g[1:] != g[:-1]) | (step[1:] != step[:-1])]
        out: dict[int, tuple[float, float]] = {}
        bounds = np.flatnonzero(np.r_[True, g[1:] != g[:-1], True])
        for a, b in zip(bounds[:-1], bounds[1:]):
            seg = slice(a, b)
            out[int(g[a])] = (float(np.median(sums_by[seg][first[seg]])), float(np.median(sums_by[seg])))
        return out


def _change(base: float | None, new: float | None) -> dict[str, Any]:
    b, n = base or 0.0, new or 0.0
    pct = 100.0 * (n - b) / b if b > 0 else (0.0 if n == 0 else None)
    return {"base": base, "new": new, "change_s": n - b, "change_pct": pct}


def _rows(base: Figures, new: Figures, key: str, name: Any) -> list[dict[str, Any]]:
    """One row per label of either run, the largest change (on the step-setting rank) first."""
    rows = []
    for label in sorted(set(base) | set(new), key=str):
        b, n = base.get(label), new.get(label)
        row = {key: name(label), **_change(b and b[0], n and n[0]),
               "all_ranks": _change(b and b[1], n and n[1])}
        rows.append(row)
    return sorted(rows, key=lambda r: -abs(r["change_s"]))


@dataclass(frozen=True)
class RunSummary:
    """What a comparison keeps of one run (its table can go once this is made)."""

    source: str
    step: float
    phases: Figures      # by phase name
    stages: Figures      # by stage; empty without a ``pp`` column
    ops: Figures         # by op name


def summarise(t: OpTable) -> RunSummary:
    """One run's step time and its seconds a step per phase, stage and op."""
    run = _Run(t)
    phases = {KINDS[k]: v for k, v in run.per_step(t.kind.astype(np.int64)).items()}
    pp = t.column("pp")
    stages = {} if pp is None else run.per_step(np.where(pp == NOT_SET, -1, pp), rows=run.own)
    ops = {t.names[i]: v for i, v in run.per_step(t.op.astype(np.int64)).items()}
    return RunSummary(t.source, run.step_seconds(), phases, stages, ops)


def compare(new: OpTable | RunSummary, base: OpTable | RunSummary) -> dict[str, Any]:
    """NEW against BASE: ``step`` (``{base, new, change_pct}``), ``phases``, ``stages``, ``ops``
    (the :data:`TOP_OPS` largest changes) and ``worst`` (the phase whose seconds grew most)."""
    b = base if isinstance(base, RunSummary) else summarise(base)
    n = new if isinstance(new, RunSummary) else summarise(new)
    phases = _rows(b.phases, n.phases, "phase", str)
    grew = max(phases, key=lambda r: r["change_s"])
    worst = {"kind": "phase", "what": grew["phase"], "change_pct": grew["change_pct"], "change_s": grew["change_s"]}
    return {"step": _change(b.step, n.step), "phases": phases, "stages": _rows(b.stages, n.stages, "stage", int),
            "ops": _rows(b.ops, n.ops, "op", str)[:TOP_OPS], "worst": worst,
            "base_source": b.source, "new_source": n.source}


def regressed(cmp: dict[str, Any], fail_over_pct: float) -> bool:
    """Whether NEW's step time is more than ``fail_over_pct`` percent over BASE's."""
    pct = cmp["step"]["change_pct"]
    return pct is None or pct > fail_over_pct


def _secs(v: float | None, sign: str = "") -> str:
    return "-" if v is None else f"{v:{sign}.3f} s" if abs(v) >= 1 else f"{v * 1000:{sign}.1f} ms"


def _line(what: str, row: dict[str, Any]) -> str:
    pct = row["change_pct"]
    rel = "new" if pct is None else f"{pct:+.0f} %"
    return (f"  {what:<28} {rel:>8} ({_secs(row['change_s'], '+')} a step: {_secs(row['base'])} -> "
            f"{_secs(row['new'])})")


def text(cmp: dict[str, Any]) -> str:
    """The comparison for a terminal: the step time, then the largest changes first."""
    s = cmp["step"]
    pct = "n/a" if s["change_pct"] is None else f"{s['change_pct']:+.1f} %"
    out = [f"step time {_secs(s['base'])} -> {_secs(s['new'])} ({pct}), median over steps",
           f"  base: {cmp.get('base_source', '')}", f"  new:  {cmp.get('new_source', '')}", "",
           "per phase, on the rank that set each step's time (largest change first):"]
    out += [_line(r["phase"], r) for r in cmp["phases"]]
    if cmp["stages"]:
        out += ["", "per stage (its own work):"] + [_line(f"stage {r['stage']}", r) for r in cmp["stages"][:_SHOWN]]
    if cmp["ops"]:
        out += ["", "per op:"] + [_line(str(r["op"])[:28], r) for r in cmp["ops"][:_SHOWN]]
    w = cmp["worst"]
    if w["change_s"] > 0:
        rel = "new" if w["change_pct"] is None else f"{w['change_pct']:+.0f} %"
        out += ["", f"largest: {w['what']} {rel} ({_secs(w['change_s'], '+')} a step)"]
    return "\n".join(out)


def compare_main(new_paths: Sequence[str], base_paths: Sequence[str], fail_over: float | None, as_json: bool,
                 out: TextIO) -> int:
    """``rankwatch analyze NEW... --compare BASE... [--fail-over PCT] [--json]``: prints the
    comparison to ``out``; 0, 1 when the step time regressed by more than PCT, 2 when a run
    cannot be read (its :class:`TraceError` on stderr)."""
    import json

    from rankwatch.agent.analyze.readers import read_paths

    try:
        base = summarise(read_paths(list(base_paths)))   # one run's table held at a time
        cmp = compare(summarise(read_paths(list(new_paths))), base)
    except TraceError as e:
        print(f"rankwatch analyze: {e}", file=sys.stderr)
        return 2
    bad = fail_over is not None and regressed(cmp, fail_over)
    if as_json:
        out.write(json.dumps({**cmp, "fail_over": fail_over, "regressed": bad}, default=_jsonable) + "\n")
    else:
        out.write(text(cmp) + "\n")
        if fail_over is not None:
            verdict = "REGRESSED" if bad else "within"
            out.write(f"{verdict}: step time {_pct(cmp['step']['change_pct'])} against --fail-over {fail_over:g} %\n")
    return 1 if bad else 0


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.1f} %"


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.floating, np.integer)):
        f = float(v)
        return f if math.isfinite(f) else None
    raise TypeError(f"{type(v).__name__} is not JSON")
