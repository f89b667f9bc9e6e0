"""``rankwatch analyze`` at production scale: 128 ranks x 50 steps x 1,000 operations per rank-step.

A trace of a data x pipeline parallel job (32 x 4, 8 microbatches, 60 compute operations per
microbatch and direction, P2P between stages, a DP all-reduce per stage; one rank 30 % slower
from step 10) is simulated (tests/tracegen.py) and written as Parquet and as gzipped JSON
Lines.  Each is analysed by the CLI in a fresh process: its wall time and peak memory
(the child's maximum resident set) are printed, with what it named.

    python benchmarks/analyze_scale.py [--runs 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import tracegen  # noqa: E402

JOB = tracegen.Job(dp=32, pp=4, steps=50, microbatches=8, layers=60, slow_rank=77, slow_from=10)


# The CLI in a child that reports its own peak resident set on exit (a child's ru_maxrss seen
# from the parent would count the parent's pages it was forked with).
_CHILD = ("import resource, sys\n"
          "from rankwatch.agent.cli.app import main\n"
          "sys.argv = ['rankwatch', 'analyze', sys.argv[1], '--json']\n"
          "try:\n    main()\n"
          "finally:\n    print('peak_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n")


def measure(path: str) -> tuple[float, float, dict]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, path], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    peak = int(out.stderr.split("peak_kib")[-1].split()[0])
    return wall, peak / 1024 ** 2, json.loads(out.stdout)


def _generate(d: str) -> list[str]:
    """The traces, written by a child (the rows it holds while it writes are not the parent's)."""
    code = ("import sys; sys.path.insert(0, sys.argv[2]); import tracegen, analyze_scale as a\n"
            "for p in sys.argv[3:]: tracegen.write(a.JOB, p)\n")
    paths = [os.path.join(d, "job.parquet"), os.path.join(d, "job.jsonl.gz")]
    here = str(Path(__file__).resolve().parent)
    subprocess.run([sys.executable, "-c", code, here, str(Path(here).parent / "tests"), *paths],
                   check=True, cwd=here, env={**os.environ, "PYTHONPATH": here})
    return paths


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--reuse", action="store_true", help="analyse the traces already in --dir")
    args = p.parse_args()
    d = args.dir or tempfile.mkdtemp(prefix="analyze-scale-")
    t0 = time.perf_counter()
    reuse = [os.path.join(d, n) for n in ("job.parquet", "job.jsonl.gz")]
    paths = reuse if args.reuse and all(os.path.exists(x) for x in reuse) else _generate(d)
    print(f"generated in {time.perf_counter() - t0:.1f} s: " +
          ", ".join(f"{Path(x).name} {os.path.getsize(x) / 1e6:.0f} MB" for x in paths))
    for path in paths:
        walls, peaks, r = [], [], {}
        for _ in range(args.runs if path.endswith(".parquet") else 1):
            wall, peak, r = measure(path)
            walls.append(wall)
            peaks.append(peak)
        named = [(i["kind"], i["rank"], i["detail"].get("cause")) for i in r["incidents"]]
        print(f"{Path(path).name}: {r['operations']:,} operations, median {statistics.median(walls):.1f} s "
              f"(runs {', '.join(f'{w:.1f}' for w in walls)}), peak RSS {max(peaks):.2f} GiB; named {named}; "
              f"what-if {r['whatif'][:2]}; replay error {r['replay']['error']:.2%}")


if __name__ == "__main__":
    main()
