"""Recovery from a hung or a dead node: rankwatch's exclusion path against plain torchrun.

Three torchrun "nodes" on this machine (one rank each, ``--nnodes 2:3``), each
with its own agent (node 0's coordinates).  Once all train, node 2 fails:

* ``--fault hang``: its worker is SIGSTOPped;
* ``--fault kill``: its whole process tree (torchrun, worker) and its agent
  are SIGKILLed.

Measured from the fault:

* ``named``: the coordinator names node 2 (a ``hang`` incident, or node 2
  excluded as dead);
* ``back``: nodes 0 and 1 train again (a rank of theirs completes steps with a
  new pid), or never within ``--timeout``.

``--victim 0`` fails the first node instead (with c10d it hosts the store), and
``--rdzv etcd`` runs the rendezvous on a real etcd (one member on loopback) with the
agents electing their coordinator there (``--election``).

Launchers:

* ``rankwatch``: ``rankwatch run`` (the rankwatch rendezvous backend, c10d tuned:
  last_call_timeout=1, keep_alive 1 s x 2, ``--monitor-interval 0.1``,
  ``--max-restarts`` 0 for a hang, 1 for a kill);
* ``rankwatch-default``: the user's own command from the README: ``rankwatch run``
  with no ``--rdzv-conf``, ``--max-restarts`` or ``--monitor-interval`` (its defaults);
* ``rankwatch-inprocess``: the user's command (as ``rankwatch-default``) on the harness with
  ``--replicate 3 --in-process-recovery``: the survivors regroup in their own processes.
  ``back`` is then exact: the recovery incident's first step after the failure, from the
  workers' own clocks, minus the kill's wall time;
* ``rankwatch-snapshots``: as ``rankwatch-inprocess`` without replicas (plain FSDP2 over the
  three ranks) and with ``--snapshot-every 5``: the survivors reshard from the peer snapshots
  in their own processes;
* ``rankwatch-reload``: as ``rankwatch-snapshots`` without the snapshots: no survivor holds
  the lost rank's shards, so the survivors load the newest complete checkpoint in their own
  processes (DCP reshards it for two ranks);
* ``rankwatch-standby``: as ``rankwatch-snapshots`` with a fourth node started once the job
  is full: it stands by, and at the kill its worker takes the lost node's place in process
  (the world keeps three ranks; ``world`` reports the recovery's new world size);
* ``torchrun``: plain torchrun, c10d tuned the same way, with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it tuned restarts fail),
  ``--max-restarts 3``;
* ``torchrun-default``: plain torchrun with c10d's defaults (keep-alive 5 s x 3,
  30 s last call, the shared worker store), ``--max-restarts 3``.

The same agents watch every launcher.  With several launchers, the runs alternate between
them (run 1 of each, then run 2 of each, ...), so that they share the machine's minutes.

    python benchmarks/restart.py --fault kill --runs 10 --launchers rankwatch
    python benchmarks/restart.py --fault kill --runs 10 --launchers rankwatch-default --rdzv etcd --victim 0
    python benchmarks/restart.py --fault kill --runs 10 --launchers rankwatch-standby,rankwatch-snapshots --timeout 60
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from etcdcluster import EtcdCluster  # noqa: E402  (real etcd members on loopback)
from multinode import Cluster  # noqa: E402  (the tests' multi-node launcher)

from rankwatch.status import AgentUnreachable  # noqa: E402

_RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60"


def once(launcher: str, fault: str, timeout: float, victim: int = 2, rdzv: str = "c10d") -> dict:
    os.environ["RANKWATCH_BENCH_TAG"] = tag = uuid.uuid4().hex
    try:
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
            etcd = EtcdCluster(Path(tmp)) if rdzv == "etcd" else None
            try:
                return _once(Path(tmp), launcher, fault, timeout, victim, etcd.endpoints[0] if etcd else None)
            finally:
                if etcd is not None:
                    etcd.stop()
    finally:
        _kill_tagged(tag)


def _kill_tagged(tag: str) -> None:
    """torchrun's workers live in their own sessions: kill every process of this run."""
    import psutil

    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("RANKWATCH_BENCH_TAG") == tag:
                p.send_signal(signal.SIGCONT)
                p.kill()
        except (psutil.Error, OSError):
            pass


def _launch_args(launcher: str, fault: str) -> tuple[str, tuple[str, ...]]:
    """(--rdzv-conf, more launcher flags) for ``launcher``."""
    if launcher.startswith("rankwatch-"):
        return "", ()
    restarts = ("0" if fault == "hang" else "1") if launcher == "rankwatch" else "3"
    return ("" if launcher == "torchrun-default" else _RDZV), ("--max-restarts", restarts, "--monitor-interval", "0.1")


def _once(tmp: Path, launcher: str, fault: str, timeout: float, victim: int, etcd: str | None) -> dict:
    standby = launcher == "rankwatch-standby"
    with Cluster(tmp, 4 if standby else 3, ("--min-nodes", "2"), election=etcd) as c:
        rdzv_conf, flags = _launch_args(launcher, fault)
        inprocess = {"rankwatch-inprocess": ("--replicate", "3", "--in-process-recovery"),
                     "rankwatch-snapshots": ("--in-process-recovery", "--snapshot-every", "5"),
                     "rankwatch-standby": ("--in-process-recovery", "--snapshot-every", "5"),
                     "rankwatch-reload": ("--in-process-recovery", "--snapshot-every", "off")}.get(launcher, ())
        # The harness recovers in process by default over several nodes: the restart launchers turn it off.
        tier = inprocess or ("--no-in-process-recovery",)

        def start(i: int):
            return c.torchrun(
                i, "2:3", 1, "--steps", "100000", "--log-every", "0", *tier,
                "--checkpoint-dir", f"{tmp}/ck", "--checkpoint-interval", "20",
                launcher="torchrun" if launcher.startswith("torchrun") else "rankwatch",
                rdzv_conf=rdzv_conf, etcd=etcd,
                env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if launcher == "torchrun" else None,
                launcher_args=flags)

        jobs = [start(i) for i in range(3)]
        deadline = time.monotonic() + 180
        while True:
            ranks = [r for a in c.agents for r in a.status()["ranks"] if r["node"] == a.node]
            if len(ranks) == 3 and min(r["step"] for r in ranks) >= 25:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the job did not start")
            time.sleep(0.2)
        if standby:
            _stand_by(tmp, start(3))
        name = f"n{victim}"
        survivors = [a for a in c.agents if a.node != name]
        victim_rank = next(r for r in ranks if r["node"] == name)
        old = {r["pid"] for r in ranks}
        if fault == "hang":
            os.kill(victim_rank["pid"], signal.SIGSTOP)
        else:
            c.kill_node(victim, jobs[victim], [victim_rank["pid"]])
        t0, killed_at = time.monotonic(), time.time()
        named = back = recomputed = world = None
        while time.monotonic() - t0 < timeout and back is None:
            if inprocess and (rec := _in_process(c, name)):
                # named: the survivors caught the failure (their collective broke).
                named, back, recomputed, world = rec[0] - killed_at, rec[1] - killed_at, rec[2], rec[3]
                break
            moving = set()
            for a in survivors:
                try:
                    s = a.status()
                except AgentUnreachable:
                    continue
                if named is None and s["coordinator"] and (
                        any(i["kind"] == "hang" and i["node"] == name for i in s["incidents"])
                        or name in s["excluded_nodes"]):
                    named = time.monotonic() - t0
                if any(r["node"] == a.node and r["connected"] and r["pid"] not in old and r["step"] > 0
                       for r in s["ranks"]):
                    moving.add(a.node)
            if len(moving) == len(survivors):
                back = time.monotonic() - t0
            time.sleep(0.2)
        try:
            os.kill(victim_rank["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
        keep = os.environ.get("RANKWATCH_BENCH_KEEP_LOGS")
        if keep and inprocess and (back is None or not _in_process(c, name)):
            import shutil

            dest = Path(keep) / uuid.uuid4().hex[:8]
            dest.mkdir(parents=True)
            for log in tmp.glob("*.log"):
                shutil.copy(log, dest / log.name)
            print(f"in-process recovery did not happen: logs in {dest}", flush=True)
        return {"named": named, "back": back, "recomputed": recomputed, "world": world}


def _stand_by(tmp: Path, spare) -> None:
    """Until the fourth node's worker stands by (asked to join ahead of any loss)."""
    deadline = time.monotonic() + 120
    while "at the next lost node's place" not in (tmp / "job-n3.log").read_text():
        if time.monotonic() > deadline or spare.poll() is not None:
            raise RuntimeError("the spare did not stand by")
        time.sleep(0.2)


def _in_process(c: Cluster, victim: str) -> tuple[float, float, int | None, int] | None:
    """Wall times (failure caught, first step after the in-process recovery), the steps
    recomputed and the new world's size, once the coordinator has the recovery's incident
    with its first step."""
    for a in c.agents:
        if a.node == victim:
            continue
        try:
            s = a.status()
        except AgentUnreachable:
            continue
        if not s["coordinator"]:
            continue
        for i in s["incidents"]:
            d = i["detail"]
            if i["kind"] == "restart" and d.get("tier") == "in_process" and d.get("ok") and \
                    "first_step" in d.get("phases", {}):
                return (d["started_at"], d["started_at"] + d["phases"]["first_step"], d.get("recomputed_steps"),
                        d.get("new_world_size"))
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=90.0)
    p.add_argument("--launchers", default="rankwatch,torchrun,torchrun-default")
    p.add_argument("--fault", choices=("hang", "kill"), default="hang")
    p.add_argument("--victim", type=int, choices=(0, 1, 2), default=2, help="the node that fails")
    p.add_argument("--rdzv", choices=("c10d", "etcd"), default="c10d")
    args = p.parse_args()
    launchers = args.launchers.split(",")
    runs: dict[str, list[dict]] = {launcher: [] for launcher in launchers}
    for _ in range(args.runs):
        for launcher in launchers:
            runs[launcher].append(once(launcher, args.fault, args.timeout, args.victim, args.rdzv))
            r = runs[launcher][-1]
            print(f"{launcher}: named {r['named']}, back {r['back']}, recomputed {r['recomputed']}, "
                  f"world {r['world']}", flush=True)
    for launcher, results in runs.items():
        named = [r["named"] for r in results if r["named"] is not None]
        back = [r["back"] for r in results if r["back"] is not None]
        print(f"{launcher}: hang named in {len(named)}/{len(results)} "
              f"(median {statistics.median(named):.1f} s)" if named else f"{launcher}: never named",
              flush=True)
        print(f"{launcher}: training again in {len(back)}/{len(results)} within {args.timeout:.0f} s"
              + (f" (median {statistics.median(back):.2f} s, {min(back):.2f}-{max(back):.2f} s)" if back else ""),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
