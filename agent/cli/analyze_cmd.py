"""``rankwatch analyze``: the live detectors over a recorded job (:mod:`rankwatch.agent.analyze`).

Exit status: 0, 1 when ``--compare`` finds a regression beyond ``--fail-over``, 2 when an
input cannot be analysed (the message names the file, the row and the field).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    a = sub.add_parser("analyze", help="the live detectors over a recorded job: stragglers, stages, "
                                       "bottleneck, workload imbalance and a what-if cost by replay")
    a.add_argument("paths", nargs="+", metavar="PATH",
                   help="an agent's state directory, PyTorch profiler traces (one per rank) or files in "
                        "the rankwatch trace format (.jsonl[.gz], .csv[.gz], .parquet), or folders of them")
    a.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    a.add_argument("--html", type=Path, default=None, metavar="FILE", help="write a self-contained report")
    a.add_argument("--compare", nargs="+", default=None, metavar="BASE",
                   help="compare with a base run: the change in step time per phase, stage and op")
    a.add_argument("--fail-over", type=float, default=None, metavar="PCT",
                   help="with --compare: exit 1 when the step time regressed by more than PCT percent")
    a.add_argument("--max-ops", type=int, default=None, metavar="N",
                   help="refuse inputs of more operations than this (default 20,000,000: about 2 GB)")
    a.add_argument("--no-whatif", action="store_true", help="skip the replay (faster on huge traces)")


def run(args: argparse.Namespace) -> int:
    from rankwatch.agent.analyze.table import TraceError
    from rankwatch.agent.analyze.trace_format import MAX_OPS

    max_ops = args.max_ops or MAX_OPS
    try:
        if args.compare:
            from rankwatch.agent.analyze.compare import compare_main

            return int(compare_main(args.paths, args.compare, args.fail_over, args.json, sys.stdout))
        return _analyze(args, max_ops)
    except TraceError as e:
        print(f"rankwatch analyze: {e}", file=sys.stderr)
        return 2


def _analyze(args: argparse.Namespace, max_ops: int) -> int:
    from rankwatch.agent.analyze.engine import analyze
    from rankwatch.agent.analyze.readers import read_paths

    result = analyze(read_paths(args.paths, max_ops), whatif=not args.no_whatif)
    if args.html is not None:
        from rankwatch.agent.analyze.html_page import render

        args.html.write_text(render(result), encoding="utf-8")
    if args.json:
        json.dump(result, sys.stdout, separators=(",", ":"))
        sys.stdout.write("\n")
    else:
        print(text(result))
    return 0


def text(r: dict) -> str:
    """The findings in a few lines."""
    lines = [f"{r['ranks']} ranks, {r['steps']} steps, {r['operations']:,} operations"
             + (f", {1000 * r['step_seconds']:.1f} ms a step" if r.get("step_seconds") else "")]
    for inc in r["incidents"]:
        d = inc["detail"]
        what = (f"cause {d.get('cause')}, {d.get('slowdown', 0):.2f}x own work" if inc["kind"] == "straggler"
                else d.get("reason", ""))
        lines.append(f"{inc['kind']}: rank {inc['rank']} from step {inc['step']} ({what})")
    for inc in r.get("dismissed", []):
        lines.append(f"not a straggler: rank {inc['rank']} ({inc['reason']})")
    for key in ("pipeline", "workload_imbalance"):
        if r.get(key):
            lines.append(f"{key.replace('_', ' ')}: {r[key]['text']}")
    if r.get("bottleneck"):
        lines.append(f"bottleneck: {r['bottleneck']['kind']} ({100 * r['bottleneck']['share']:.0f}% of the step)")
    if r.get("whatif"):
        lines.append("what if (the job's speed-up with it at its peers' median):")
        lines += [f"  {w['kind']:<6} {str(w['what']):<24} {w['speedup']:.3f}x" for w in r["whatif"][:8]]
    if r.get("replay") and r["replay"]["note"]:
        lines.append(f"replay: {r['replay']['note']}")
    return "\n".join(lines)
