"""``rankwatch analyze`` beside Holistic Trace Analysis (HTA) on the same PyTorch profiler traces.

HTA is never a project dependency: it runs in a Python of its own (``--hta-python``, an
environment with ``holistictraceanalysis`` installed; see BENCHMARKS.md for how), in a
subprocess, and each side is timed from its process's start to its answer.

    python benchmarks/hta_side_by_side.py --make-job OUT [--slow-rank 1] --hta-python PY
    python benchmarks/hta_side_by_side.py --traces DIR --hta-python PY

``--make-job OUT`` first runs the harness on 2 ranks (gloo) under torchrun with
``RANKWATCH_PROFILE_DIR=OUT/traces`` (steps 5-49 profiled), the slowed rank's compute doubled
from step 15 on.  Printed: what each tool names (the slow or idle rank), its analyses that
answered or failed, and each tool's wall and CPU time (its process and children) per round.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Run by the HTA interpreter: each analysis timed, its answer (or its failure) as JSON.
HTA_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
from importlib.metadata import version
out = {"load_s": time.perf_counter() - t0, "analyses": {},
       "versions": {p: version(p) for p in ("holistictraceanalysis", "pandas", "numpy")}}
calls = [("get_profiler_steps", {}), ("get_temporal_breakdown", {"visualize": False}), ("get_comm_comp_overlap", {"visualize": False}),
         ("get_idle_time_breakdown", {"visualize": False}), ("get_potential_stragglers", {}),
         ("critical_path_analysis", {"rank": 0, "annotation": "ProfilerStep", "instance_id": None})]
for name, kw in calls:
    t = time.perf_counter()
    try:
        r = getattr(a, name)(**kw)
        r = r[0] if isinstance(r, tuple) else r
        text = r.to_string() if hasattr(r, "to_string") else repr(r)
        out["analyses"][name] = {"ok": True, "answer": text[:2000], "seconds": time.perf_counter() - t}
    except Exception as exc:
        out["analyses"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300],
                                 "seconds": time.perf_counter() - t}
print("HTA-JSON " + json.dumps(out))
"""


def make_job(out: Path, slow_rank: int, steps: int = 52) -> Path:
    """The profiled 2-rank harness job; returns its trace directory."""
    traces = out / "traces"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANKWATCH_PROFILE_DIR": str(traces),
           "RANKWATCH_PROFILE_STEPS": "5:50"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "rankwatch.hooks.train", "--steps", str(steps), "--log-every", "0", "--no-rankwatch",
           "--fault", f"slow_compute:{slow_rank}:15:1.0"]
    with open(out / "job.log", "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=600)
    return traces


def timed(cmd: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float, float]:
    """``cmd``'s result, its wall time and the CPU time of it and its children (user + system)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run_rankwatch(traces: Path) -> dict:
    done, wall, cpu = timed([sys.executable, "-m", "rankwatch.agent.cli", "analyze", str(traces), "--json"], 600)
    if done.returncode != 0:
        return {"wall_s": wall, "cpu_s": cpu, "error": done.stderr[-500:]}
    out = json.loads(done.stdout)
    stragglers = [{"rank": i["rank"], "step": i["step"], "cause": i["detail"].get("cause"),
                   "slowdown": i["detail"].get("slowdown")} for i in out["incidents"] if i["kind"] == "straggler"]
    ranks = [w for w in out["whatif"] if w["kind"] == "rank"]
    return {"wall_s": wall, "cpu_s": cpu, "stragglers": stragglers, "whatif_top_rank": ranks[0] if ranks else None,
            "bottleneck": out.get("bottleneck"), "replay": out.get("replay"), "steps": out["steps"]}


def run_hta(traces: Path, python: str) -> dict:
    done, wall, cpu = timed([python, "-c", HTA_SCRIPT, str(traces)], 1200)
    line = next((x for x in done.stdout.splitlines() if x.startswith("HTA-JSON ")), None)
    if line is None:
        return {"wall_s": wall, "cpu_s": cpu, "error": (done.stderr or done.stdout)[-800:]}
    return {"wall_s": wall, "cpu_s": cpu, **json.loads(line[len("HTA-JSON "):])}


def report(rw: dict, hta: dict) -> None:
    print(f"rankwatch analyze: {rw['wall_s']:.2f} s wall, {rw['cpu_s']:.2f} s CPU")
    if "error" in rw:
        print("  failed:", rw["error"])
    else:
        for s in rw["stragglers"]:
            print(f"  straggler: rank {s['rank']} from step {s['step']} (cause {s['cause']}, {s['slowdown']}x own work)")
        print(f"  what-if top rank: {rw['whatif_top_rank']}; bottleneck {rw['bottleneck']}; replay {rw['replay']}")
    print(f"HTA: {hta['wall_s']:.2f} s wall, {hta['cpu_s']:.2f} s CPU" + (f" (load {hta['load_s']:.2f} s)" if "load_s" in hta else "")
          + f" {hta.get('versions', '')}")
    if "error" in hta:
        print("  failed:", hta["error"])
        return
    for name, r in hta["analyses"].items():
        if r["ok"]:
            print(f"  {name} ({r['seconds']:.2f} s):\n    " + r["answer"].replace("\n", "\n    "))
        else:
            print(f"  {name} ({r['seconds']:.2f} s): FAILED {r['error']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--traces", type=Path, help="a directory of profiler traces, one per rank")
    src.add_argument("--make-job", type=Path, metavar="OUT", help="run the profiled 2-rank job into OUT first")
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--hta-python", required=True, help="a Python with holistictraceanalysis installed")
    p.add_argument("--rounds", type=int, default=3, help="runs of each tool (the median times are printed)")
    p.add_argument("--json", type=Path, help="also write both answers here")
    args = p.parse_args()
    traces = args.traces
    if args.make_job:
        args.make_job.mkdir(parents=True, exist_ok=True)
        traces = make_job(args.make_job, args.slow_rank)
    sizes = sorted(f.stat().st_size for f in traces.iterdir() if f.is_file())
    print(f"traces: {len(sizes)} files, {sum(sizes) / 1e6:.1f} MB in {traces}")
    runs = [(run_rankwatch(traces), run_hta(traces, args.hta_python)) for _ in range(args.rounds)]
    last = []
    for side, i in (("rankwatch", 0), ("hta", 1)):
        ok = [r[i] for r in runs if "error" not in r[i]] or [runs[-1][i]]  # failed rounds are not timed
        walls, cpus = [r["wall_s"] for r in ok], [r["cpu_s"] for r in ok]
        print(f"{side}: {len(ok)} of {len(runs)} rounds answered; wall {', '.join(f'{w:.2f}' for w in walls)} s "
              f"(median {statistics.median(walls):.2f}); CPU {', '.join(f'{c:.2f}' for c in cpus)} s "
              f"(median {statistics.median(cpus):.2f})")
        last.append(ok[-1])
    rw, hta = last
    report(rw, hta)
    if args.json:
        args.json.write_text(json.dumps({"rankwatch": rw, "hta": hta}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
