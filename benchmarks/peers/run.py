"""Peer comparison: how fast the survivors of a lost member train again, and what each
system costs per step in steady state.  rankwatch's in-process recovery tier, torchft and
nvidia-resiliency-ext's ``inprocess.Wrapper``, on the same job (``_job.py``: three members
of one process each, gloo on loopback, a 4x512 MLP, batch 32, AdamW).

Install the peers in a benchmark-only venv, never in the project's dependencies::

    python -m venv .bench-venv && . .bench-venv/bin/activate
    pip install torch==2.13.0 wheel && pip install -e .
    pip install --no-deps torchft-nightly
    # nvidia-resiliency-ext 0.7.0 ships only a cp312 / glibc 2.39 wheel; its compiled part
    # serves straggler attribution only, so retag the pure-Python rest for this interpreter:
    pip download --no-deps --python-version 3.12 --platform manylinux_2_39_x86_64 \
        --only-binary=:all: nvidia-resiliency-ext==0.7.0
    python -m wheel tags --python-tag cp311 --abi-tag cp311 --platform-tag linux_x86_64 \
        nvidia_resiliency_ext-0.7.0-cp312-cp312-manylinux_2_39_x86_64.whl
    pip install --no-deps nvidia_resiliency_ext-0.7.0-cp311-cp311-linux_x86_64.whl
    pip install defusedxml pydantic pydantic-settings pyyaml httpx packaging \
        opentelemetry-exporter-otlp-proto-http

Run (from the repository root, with that venv's python; one configuration at a time, on an
otherwise idle machine)::

    python benchmarks/peers/run.py kill rankwatch --runs 10
    python benchmarks/peers/run.py steady rankwatch rankwatch-off --runs 5   # alternating

``kill``: start the three members, wait until all have completed ``--warm`` steps in a
world of three, SIGKILL every process of member 2 (its launcher, its worker and whatever
they started, found by an environment tag), and read the survivors' own step logs: the
recovery time is the later survivor's first step completed in a world of two minus the
kill's wall time.  ``steady``: no fault; the mean step time over ``--steps`` steps after
``--warm``, configurations alternating run by run.  Each run appends a JSON line to
``benchmarks/out/peers/<mode>-<config>.jsonl``; the summary is printed.  With
``--digest-every N`` the members log a hash of their parameters every N steps and ``kill``
compares the survivors'; ``--after S`` keeps watching them S seconds longer (still
training, and in the same processes?).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "out" / "peers"
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run"]
MEMBERS = 3
TAG = "PEERS_RUN"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """One launch of a configuration's three members (and its helpers), each process tagged
    in its environment so that the whole tree, daemons included, can be found and killed."""

    def __init__(self, config: str) -> None:
        self.config = config
        self.token = uuid.uuid4().hex
        self.dir = Path(tempfile.mkdtemp(prefix="peers-"))
        self.procs: list[subprocess.Popen] = []
        self.system, _, self.variant = config.partition("-")

    def env(self, member: str, **extra: str) -> dict[str, str]:
        return {**os.environ, "OMP_NUM_THREADS": "1", TAG: self.token, "PEERS_MEMBER": member,
                "PEERS_OUT": str(self.dir), "RANKWATCH_TMPDIR": str(self.dir), "PYTHONUNBUFFERED": "1",
                "PEERS_FT": "0" if self.variant == "off" else "1",
                "PEERS_TUNED": "1" if self.variant == "tuned" else "0", **extra}

    def spawn(self, member: str, cmd: list[str], **extra: str) -> None:
        log = open(self.dir / f"log-{member}.txt", "a")
        self.procs.append(subprocess.Popen(cmd, env=self.env(member, **extra), stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True, cwd=HERE))

    def c10d(self, i: int, port: int, nnodes: str) -> list[str]:
        return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "peers",
                "--rdzv-conf", f"is_host={int(i == 0)}"]

    def start(self) -> None:
        port = free_port()
        for i in range(MEMBERS):
            if self.system == "rankwatch":
                cmd = [PY, "-m", "rankwatch.agent.cli", "run", "--agent", f"unix:{self.dir}/n{i}.sock",
                       "--node-id", f"n{i}", "--", *self.c10d(i, port, "2:3"), "mlp_rankwatch.py"]
                self.spawn(str(i), cmd)
            elif self.system == "torchft" and self.variant != "off":
                if i == 0:
                    self.lighthouse = free_port()
                    lh = [str(Path(PY).parent / "torchft_lighthouse"), "--min_replicas", "1",
                          "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
                          "--bind", f"127.0.0.1:{self.lighthouse}"]
                    if self.variant == "tuned":
                        lh += ["--heartbeat_timeout_ms", "1000"]
                    self.spawn("lighthouse", lh)
                cmd = [*TORCHRUN, "--nnodes", "1", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                       "--master-port", str(free_port()), "mlp_torchft.py"]
                self.spawn(str(i), cmd, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{self.lighthouse}")
            elif self.system == "torchft":
                self.spawn(str(i), [*TORCHRUN, *self.c10d(i, port, "3"), "mlp_torchft.py"])
            elif self.system == "nvrx":
                if i == 0:
                    self.nvrx_port = free_port()
                self.spawn(str(i), [*TORCHRUN, *self.c10d(i, port, "3"), "mlp_nvrx.py"],
                           PEERS_NVRX_PORT=str(self.nvrx_port))
            else:
                raise SystemExit(f"unknown configuration {self.config}")
            if i == 0:
                time.sleep(0.5)  # member 0 joins first (it hosts the stores; rank 0 is its)

    def steps(self, member: int) -> list[tuple[float, int]]:
        try:
            text = (self.dir / f"member{member}.steps").read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and not line.startswith("#"):
                out.append((float(parts[0]), int(parts[1])))
        return out

    def pids(self, member: int) -> int:
        try:
            return (self.dir / f"member{member}.steps").read_text().count("# pid ")
        except FileNotFoundError:
            return 0

    def digests(self, member: int) -> dict[int, str]:
        try:
            text = (self.dir / f"member{member}.steps").read_text()
        except FileNotFoundError:
            return {}
        out = {}
        for line in text.splitlines():
            if line.startswith("# digest "):
                _, _, step, h = line.split()
                out[int(step)] = h  # a step trained again after a recovery: the last one counts
        return out

    def tagged(self, member: str | None = None) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                env = p.environ()
            except (psutil.Error, OSError):
                continue
            if env.get(TAG) == self.token and (member is None or env.get("PEERS_MEMBER") == member):
                found.append(p)
        return found

    def kill(self, member: str | None = None) -> int:
        procs = self.tagged(member)
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        return len(procs)

    def close(self) -> None:
        for _ in range(3):
            if not self.kill():
                break
            time.sleep(0.2)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def wait_all(self, n: int, world: int, timeout: float) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if all(sum(1 for _, w in self.steps(m) if w == world) >= n for m in range(MEMBERS)):
                return True
            if all(p.poll() is not None for p in self.procs):
                return False
            time.sleep(0.1)
        return False

    def tail(self, lines: int = 15) -> str:
        out = []
        for f in sorted(self.dir.glob("log-*.txt")):
            out.append(f"==== {f.name}")
            out += f.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(out)


def kill_once(config: str, warm: int, limit: float, victim: int = 2, watch: float = 0.0) -> dict:
    run = Run(config)
    try:
        t0 = time.time()
        run.start()
        if not run.wait_all(warm, MEMBERS, 240):
            return {"config": config, "ok": False, "error": "did not train in a world of 3", "log": run.tail()}
        killed_at = time.time()
        n = run.kill(str(victim))
        survivors = [m for m in range(MEMBERS) if m != victim]
        first: dict[int, float] = {}
        deadline = killed_at + limit
        while time.time() < deadline and len(first) < len(survivors):
            for m in survivors:
                if m not in first:
                    after = [t for t, w in run.steps(m) if t > killed_at and w == MEMBERS - 1]
                    if after:
                        first[m] = after[0]
            time.sleep(0.05)
        ok = len(first) == len(survivors)
        result = {"config": config, "ok": ok, "killed_processes": n, "startup_s": killed_at - t0,
                  "recovery_s": max(first.values()) - killed_at if ok else None,
                  "first_step_after_kill_s": {m: t - killed_at for m, t in first.items()}}
        if ok:  # do they go on training?
            target = {m: sum(1 for t, _ in run.steps(m) if t > killed_at) + 10 for m in survivors}
            t0 = time.time()
            while time.time() < t0 + 10 and any(len([1 for t, _ in run.steps(m) if t > killed_at]) < target[m]
                                                for m in survivors):
                time.sleep(0.1)
            result["kept_training"] = all(len([1 for t, _ in run.steps(m) if t > killed_at]) >= target[m]
                                          for m in survivors)
            if watch:  # a longer look: still training, in the same processes?
                time.sleep(watch)
                result["watched_s"] = watch
                result["steps_in_last_second"] = {m: sum(1 for t, _ in run.steps(m) if t > time.time() - 1)
                                                  for m in survivors}
            result["worker_starts"] = {m: run.pids(m) for m in survivors}  # >1: the worker was restarted
            stale = [(t, w) for m in survivors for t, w in run.steps(m) if t > killed_at and w != MEMBERS - 1]
            result["steps_after_kill_in_other_worlds"] = len(stale)
            if os.environ.get("PEERS_DIGEST_EVERY"):
                a, b = (run.digests(m) for m in survivors)
                common = sorted(set(a) & set(b))
                differ = [s for s in common if a[s] != b[s]]
                result["digests"] = {"compared": len(common), "last_step": common[-1] if common else None,
                                     "differ": len(differ), "first_differing_step": differ[0] if differ else None}
        else:
            result["log"] = run.tail()
        return result
    finally:
        run.close()


def steady_once(config: str, warm: int, steps: int) -> dict:
    run = Run(config)
    try:
        run.start()
        if not run.wait_all(warm + steps + 1, MEMBERS, 240):
            return {"config": config, "ok": False, "error": "did not finish the steady window", "log": run.tail()}
        per = []
        for m in range(MEMBERS):
            ts = [t for t, w in run.steps(m) if w == MEMBERS]
            per.append((ts[warm + steps] - ts[warm]) / steps)
        return {"config": config, "ok": True, "step_s": statistics.mean(per), "per_member_s": per}
    finally:
        run.close()


def summary(rows: list[dict], mode: str) -> str:
    good = [r for r in rows if r["ok"]]
    if mode == "kill":
        rec = sorted(r["recovery_s"] for r in good)
        if not rec:
            return f"0/{len(rows)} recovered"
        return (f"{len(good)}/{len(rows)} recovered within the limit; kill -> training again median "
                f"{statistics.median(rec):.2f} s (range {rec[0]:.2f}-{rec[-1]:.2f}); kept training after: "
                f"{sum(1 for r in good if r.get('kept_training'))}/{len(good)}")
    st = sorted(r["step_s"] for r in good)
    if not st:
        return f"0/{len(rows)} ran"
    return f"{len(good)}/{len(rows)} ran; step time median {statistics.median(st) * 1e3:.1f} ms " \
           f"(range {st[0] * 1e3:.1f}-{st[-1] * 1e3:.1f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("kill", "steady"))
    p.add_argument("configs", nargs="+", help="rankwatch, rankwatch-off, torchft, torchft-tuned, torchft-off, "
                                              "nvrx, nvrx-tuned, nvrx-off")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--warm", type=int, default=30, help="steps before the kill / the steady window")
    p.add_argument("--steps", type=int, default=150, help="the steady window")
    p.add_argument("--limit", type=float, default=60.0, help="seconds the survivors get to train again")
    p.add_argument("--after", type=float, default=0.0,
                   help="kill: seconds to keep watching the survivors after they trained again")
    p.add_argument("--digest-every", type=int, default=0,
                   help="kill: the members log a digest of their parameters every N steps, and the "
                        "survivors' are compared (replicas that drifted apart differ)")
    args = p.parse_args()
    if args.digest_every:
        os.environ["PEERS_DIGEST_EVERY"] = str(args.digest_every)
    OUT.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {c: [] for c in args.configs}
    for i in range(args.runs):
        for config in args.configs:  # alternating: drifts in the machine's load hit all alike
            r = kill_once(config, args.warm, args.limit, watch=args.after) if args.mode == "kill" else \
                steady_once(config, args.warm, args.steps)
            r["run"] = i
            rows[config].append(r)
            with open(OUT / f"{args.mode}-{config}.jsonl", "a") as f:
                f.write(json.dumps(r) + "\n")
            brief = {k: v for k, v in r.items() if k != "log"}
            print(json.dumps(brief), flush=True)
            if not r["ok"]:
                print(r.get("log", ""), flush=True)
    for config, rs in rows.items():
        print(f"{args.mode} {config}: {summary(rs, args.mode)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
