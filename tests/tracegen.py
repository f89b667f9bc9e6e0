"""Production-shaped traces in the rankwatch trace format, simulated: data × pipeline parallel
with microbatches (GPipe: every microbatch's forward, then every backward), P2P between the
stages, a data-parallel all-reduce per stage and an optimizer step.

Every time is simulated, not drawn: a receive ends when its send is posted plus a transfer, an
all-reduce when its last member arrives plus the reduction, so the trace has the dependencies
a real job's has.  Faults: one rank's compute slower (``slow_rank``), one rank's loader slower
(``slow_loader``), a heavier last stage (``last_stage``), a random per-step, per-replica
workload (``imbalance``: sequence lengths).  Rank ``d * pp + s`` is replica ``d``, stage ``s``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COLUMNS = ("rank", "step", "op", "kind", "start", "duration", "dp", "pp", "microbatch", "peer", "group", "seq")


@dataclass
class Job:
    dp: int = 8
    pp: int = 4
    steps: int = 60
    microbatches: int = 4
    layers: int = 1                 # compute ops per microbatch per direction
    fwd: float = 0.004              # seconds per microbatch-stage forward (all layers)
    data: float = 0.003
    xfer: float = 0.0004
    allreduce: float = 0.003
    optimizer: float = 0.002
    noise: float = 0.02
    seed: int = 0
    slow_rank: int | None = None
    slow_factor: float = 1.3
    slow_from: int = 0
    slow_loader: int | None = None
    loader_extra: float = 0.02
    last_stage: float = 1.0
    imbalance: float = 0.0          # sd of each replica's per-step work factor (lognormal)


def generate(job: Job) -> dict[str, list]:
    """The trace's columns (every row of every rank and step)."""
    rng = np.random.default_rng(job.seed)
    out: dict[str, list] = {c: [] for c in COLUMNS}
    clock = np.zeros((job.dp, job.pp))
    for step in range(job.steps):
        work = np.exp(rng.normal(0.0, job.imbalance, job.dp)) if job.imbalance else np.ones(job.dp)
        for d in range(job.dp):
            _replica(job, rng, step, d, clock[d], work[d], out)
        _allreduce(job, step, clock, out)
        clock += 0.0005
    return out


def _emit(out: dict[str, list], rank: int, step: int, op: str, kind: str, start: float, dur: float,
          dp: int, pp: int, mb: int = -1, peer: int = -1, group: str = "", seq: int = -1) -> None:
    for c, v in zip(COLUMNS, (rank, step, op, kind, start, dur, dp, pp, mb, peer, group, seq)):
        out[c].append(v)


def _layers(out: dict[str, list], n: int, dur: float, rank: int, step: int, op: str, start: float,
            dp: int, pp: int, mb: int) -> None:
    """``n`` compute operations of ``dur`` each, one after another, as one chunk of rows."""
    if n == 1:
        _emit(out, rank, step, op, "compute", start, dur, dp, pp, mb)
        return
    starts = start + dur * np.arange(n)
    for c, v in zip(COLUMNS, (rank, step, op, "compute", starts, dur, dp, pp, mb, -1, "", -1)):
        out[c].append(np.full(n, v) if c != "start" else v)


def columns(cols: dict[str, list]) -> dict[str, np.ndarray]:
    """The generated columns as arrays (chunks of rows flattened)."""
    return {c: np.concatenate([np.atleast_1d(np.asarray(x)) for x in v]) for c, v in cols.items()}


def _factor(job: Job, rng: np.random.Generator, rank: int, stage: int, step: int, work: float) -> float:
    f = work * float(np.exp(rng.normal(0.0, job.noise)))
    if stage == job.pp - 1:
        f *= job.last_stage
    if rank == job.slow_rank and step >= job.slow_from:
        f *= job.slow_factor
    return f


def _replica(job: Job, rng: np.random.Generator, step: int, d: int, t: np.ndarray, work: float,
             out: dict[str, list]) -> None:
    """One replica's forward and backward passes (GPipe), advancing its stages' clocks ``t``."""
    P, M = job.pp, job.microbatches
    rank = [d * P + s for s in range(P)]
    load = job.data + (job.loader_extra if rank[0] == job.slow_loader and step >= job.slow_from else 0.0)
    _emit(out, rank[0], step, "dataloader_next", "data", t[0], load, d, 0)
    t[0] += load
    for direction, stages, cost in (("forward", range(P), job.fwd), ("backward", range(P - 1, -1, -1), 2 * job.fwd)):
        posted: dict[tuple[int, int], float] = {}
        step_dir = 1 if direction == "forward" else -1
        for m in range(M):
            for s in stages:
                src = s - step_dir
                seq = (step * 2 + (direction == "backward")) * M + m
                if 0 <= src < P:
                    arrive = t[s]
                    end = max(arrive, posted[(src, m)]) + job.xfer
                    _emit(out, rank[s], step, f"recv_{direction}", "p2p", arrive, end - arrive, d, s, m, rank[src], "", seq)
                    t[s] = end
                f = _factor(job, rng, rank[s], s, step, work)
                _layers(out, job.layers, cost * f / job.layers, rank[s], step, f"{direction}_layer", t[s], d, s, m)
                t[s] += cost * f
                dst = s + step_dir
                if 0 <= dst < P:
                    posted[(s, m)] = t[s]
                    _emit(out, rank[s], step, f"send_{direction}", "p2p", t[s], 0.0001, d, s, m, rank[dst], "", seq)
                    t[s] += 0.0001


def _allreduce(job: Job, step: int, clock: np.ndarray, out: dict[str, list]) -> None:
    """Each stage's gradient all-reduce over the replicas, then its optimizer step."""
    for s in range(job.pp):
        done = clock[:, s].max() + job.allreduce
        for d in range(job.dp):
            rank = d * job.pp + s
            _emit(out, rank, step, "all_reduce", "collective", clock[d, s], done - clock[d, s], d, s,
                  group=f"dp_stage{s}", seq=step)
            opt = job.optimizer * (job.slow_factor if rank == job.slow_rank and step >= job.slow_from else 1.0)
            _emit(out, rank, step, "optimizer_step", "optimizer", done, opt, d, s)
            clock[d, s] = done + opt


def write(job: Job, path: str) -> str:
    """The trace as a file: ``.jsonl``/``.jsonl.gz``, ``.csv`` or ``.parquet``."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    cols = generate(job)
    if job.layers > 1:
        cols = columns(cols)   # type: ignore[assignment]
    table = pa.table(cols)
    if path.endswith(".parquet"):
        pq.write_table(table, path)
    elif path.endswith(".csv"):
        pcsv.write_csv(table, path)
    else:
        import gzip
        import json
        rows = ("".join(json.dumps(dict(zip(COLUMNS, (x.item() if hasattr(x, "item") else x for x in r)))) + "\n"
                        for r in zip(*cols.values())))
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "wt") as f:  # type: ignore[operator]
            f.write(rows)
    return path
