"""The restart path, phase by phase: where the seconds go from a node's loss to training again.

Three torchrun "nodes" on this machine (one rank each, ``--nnodes 2:3``), each under
``rankwatch run`` with its own agent, the user's plain command (no ``--rdzv-conf``,
``--max-restarts`` or ``--monitor-interval``).  Once every rank trains, node n2's whole
process tree (torchrun, worker, agent) is SIGKILLed.  Two shapes:

* ``ddp``: ``tests/data/ddp_multinode.py``, the DDP tutorial series' multi-node script,
  unmodified (it resumes from its own snapshot file);
* ``harness``: ``-m rankwatch.hooks.train`` (checkpoints every 20 steps; in-process recovery
  off, so this is torchrun's restart path).

Each phase is a wall-clock time after the kill, the later of the two survivors, from:

* ``detect``: the survivor's worker raised (its collective broke; an ``excepthook`` marker);
* ``atexit``: the worker's exit handlers done (rankwatch's client flushes and says goodbye);
* ``exit``: its torchrun saw the worker group fail (torchrun's own log line, ``LOGLEVEL=INFO``,
  stamped as it is written);
* ``round``: its torchrun's new rendezvous round closed (``Rendezvous complete``);
* ``exec``, ``python``, ``torch``: the new worker's process started (``/proc``), its interpreter
  reached ``site``, ``import torch`` done;
* ``pg``: the script's ``init_process_group`` returned;
* ``step``: its first optimizer step done (kill to training again).

The worker markers come from ``benchmarks/phase_probe/sitecustomize.py``, put on the workers'
``PYTHONPATH`` (``rankwatch run``'s own start-up hook chains to it); the scripts are not
touched.  Medians over ``--runs``; the shapes alternate run by run.

    python benchmarks/restart_phases.py --runs 5 [--shapes ddp,harness] [--rdzv-conf K=V,...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from multinode import Cluster  # noqa: E402  (the tests' multi-node launcher)

PHASES = ("detect", "atexit", "exit", "round", "exec", "python", "torch", "pg", "step")
_LOG_EVENTS = {"exit": re.compile(r"Worker group (FAILED|UNHEALTHY)"),
               "round": re.compile(r"Rendezvous complete for workers")}


class _LogStamps(threading.Thread):
    """Stamps each torchrun log line of the watched files with the wall time it appeared."""

    def __init__(self, paths: dict[str, Path]) -> None:
        super().__init__(daemon=True)
        self.paths, self.seen = paths, {n: [] for n in paths}
        self._stop_at = threading.Event()

    def run(self) -> None:
        offsets = {n: 0 for n in self.paths}
        while not self._stop_at.wait(0.01):
            for n, p in self.paths.items():
                try:
                    with open(p, "rb") as f:
                        f.seek(offsets[n])
                        text = f.read()
                except OSError:
                    continue
                offsets[n] += len(text)
                now = time.time()
                self.seen[n] += [(_logged_at(line) or now, line) for line in text.decode(errors="replace").splitlines()]

    def stop(self) -> None:
        self._stop_at.set()
        self.join()

    def first(self, node: str, event: str, after: float) -> float | None:
        return next((t for t, line in self.seen[node] if t >= after and _LOG_EVENTS[event].search(line)), None)


_TORCH_LOG = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) ")


def _logged_at(line: str) -> float | None:
    """The wall time in a torch log line's own prefix (``I1208 00:47:39.988000 ...``), local time."""
    m = _TORCH_LOG.match(line)
    if not m:
        return None
    mon, day, hh, mm, ss = m.groups()
    year = time.localtime().tm_year
    return time.mktime((year, int(mon), int(day), int(hh), int(mm), 0, 0, 0, -1)) + float(ss)


def _kill_tagged(out: str) -> None:
    """torchrun's workers live in sessions of their own: kill every process of this run."""
    import psutil

    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("RANKWATCH_PHASES_OUT") == out:
                p.kill()
        except (psutil.Error, OSError):
            pass


def _markers(out: Path) -> list[dict]:
    rows = []
    for p in out.glob("*.jsonl"):
        rows += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return rows


def _harness_args(tmp: Path) -> list[str]:
    import subprocess

    helptext = subprocess.run([sys.executable, "-m", "rankwatch.hooks.train", "--help"],
                              capture_output=True, text=True).stdout
    off = ["--no-in-process-recovery"] if "--no-in-process-recovery" in helptext else []
    return ["--steps", "100000", "--log-every", "0", "--checkpoint-dir", f"{tmp}/ck",
            "--checkpoint-interval", "20", *off]


def once(shape: str, timeout: float, rdzv_conf: str, harness: list[str] | None) -> dict:
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as d:
        tmp = Path(d)
        out = tmp / "phases"
        out.mkdir()
        env = {"RANKWATCH_PHASES_OUT": str(out), "LOGLEVEL": "INFO",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE / "phase_probe"),
                                                           os.environ.get("PYTHONPATH")]))}
        script = str(HERE.parent / "tests" / "data" / "ddp_multinode.py") if shape == "ddp" else None
        args = ["100000", "5", "--snapshot_path", f"{tmp}/snapshot.pt"] if shape == "ddp" else \
            (harness or _harness_args(tmp))
        if shape == "harness":
            args = [a.replace("{tmp}", str(tmp)) for a in args]
        with Cluster(tmp, 3, ("--min-nodes", "2")) as c:
            stamps = _LogStamps({f"n{i}": tmp / f"job-n{i}.log" for i in range(2)})
            stamps.start()
            try:
                jobs = [c.torchrun(i, "2:3", 1, *args, launcher="rankwatch", rdzv_conf=rdzv_conf, env=env,
                                   script=script) for i in range(3)]
                return _kill_and_watch(c, jobs, out, stamps, timeout)
            finally:
                stamps.stop()
                _kill_tagged(str(out))
                if keep := os.environ.get("RANKWATCH_BENCH_KEEP_LOGS"):
                    import shutil

                    dest = Path(keep) / f"{shape}-{time.time():.0f}"
                    dest.mkdir(parents=True)
                    for f in [*tmp.glob("*.log"), *out.glob("*.jsonl")]:
                        shutil.copy(f, dest / f.name)


def _kill_and_watch(c: Cluster, jobs: list, out: Path, stamps: _LogStamps, timeout: float) -> dict:
    deadline = time.monotonic() + 180
    while len({m["node"] for m in _markers(out) if m["event"] == "step"}) < 3:
        if time.monotonic() > deadline or any(j.poll() is not None for j in jobs):
            c.print_logs()
            raise RuntimeError("the job did not start")
        time.sleep(0.1)
    time.sleep(3.0)   # a few seconds of steady training, not only the first step
    before = _markers(out)
    old = {m["pid"] for m in before}
    victim = [m["pid"] for m in before if m["node"] == "n2"]
    c.kill_node(2, jobs[2], sorted(set(victim)))
    killed = time.time()
    survivors = ("n0", "n1")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = [m for m in _markers(out) if m["pid"] not in old and m["event"] == "step"]
        if {m["node"] for m in new} >= set(survivors):
            break
        time.sleep(0.05)
    else:
        c.print_logs()
        return {"step": None}
    time.sleep(0.1)   # the log stamper's last lines
    marks = _markers(out)
    row: dict = {}
    for phase in PHASES:
        times = []
        for node in survivors:
            if phase in _LOG_EVENTS:
                t = stamps.first(node, phase, killed)
            else:
                first = phase in ("detect", "atexit")   # the failed worker's, else its successor's
                event = {"detect": "error", "atexit": "exit"}.get(phase, phase)
                t = min((m["at"] for m in marks if m["node"] == node and m["event"] == event
                         and (m["pid"] in old) == first and m["at"] >= killed - 1), default=None)
            times.append(t)
        row[phase] = max(times) - killed if None not in times else None
    return row


def _table(rows: list[dict], label: str) -> None:
    print(f"\n{label}: {sum(r['step'] is not None for r in rows)}/{len(rows)} runs back")
    print("| phase | " + " | ".join(PHASES) + " |")
    print("|---|" + "---|" * len(PHASES))
    med = []
    for phase in PHASES:
        vals = [r[phase] for r in rows if r.get(phase) is not None]
        med.append(f"{statistics.median(vals):.2f}" if vals else "–")
    print(f"| kill → (s, median) | " + " | ".join(med) + " |")
    for phase in ("step",):
        vals = sorted(r[phase] for r in rows if r.get(phase) is not None)
        if vals:
            print(f"kill → training again: median {statistics.median(vals):.2f} s ({vals[0]:.2f}–{vals[-1]:.2f}), "
                  f"{len(vals)} runs", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--shapes", default="ddp,harness")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--rdzv-conf", default="", help="passed to torchrun (default: rankwatch run's own timings)")
    args = p.parse_args()
    shapes = args.shapes.split(",")
    rows: dict[str, list[dict]] = {s: [] for s in shapes}
    for _ in range(args.runs):
        for shape in shapes:
            rows[shape].append(once(shape, args.timeout, args.rdzv_conf, None))
            print(shape, {k: (round(v, 2) if v is not None else None) for k, v in rows[shape][-1].items()},
                  flush=True)
    for shape in shapes:
        _table(rows[shape], shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
