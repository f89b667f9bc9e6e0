"""A real Prometheus scrapes real agents watching a real torchrun job with injected faults.

Every dashboard query (panels, annotations, template variables) goes through
Prometheus's HTTP API: it must be valid PromQL, and it must return data for
the run.  Three agents, three jobs:

- n0 is the coordinator of n1's job, as on a multi-node cluster, and has no
  ranks of its own;
- n1 runs a job with a hang (rank 0 stuck in Python), periodic and requested
  checkpoints, one undecodable message, and scripted GPU faults (thermal
  slowdown, ECC, row remaps, NVLink and PCIe errors, an XID 79, a lost GPU);
- n2 is a standalone node whose job has a straggler (rank 1's compute slowed), then
  a short 4-rank pipeline job with experts (the stage and expert panels); its agent is
  stopped at the end.

The alert rules are loaded too: they must evaluate without error, and the
alerts those faults call for must go pending or fire.

PENDING names the dashboards' metrics that no agent exports yet.  The test
asserts each is still absent, so it fails the day one lands: then remove it
from PENDING, and its panels are checked for data like every other.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from conftest import AgentProcess, parse_metrics, torchrun, wait_for
from rankwatch.agent.cli.ports import free_port
from test_dashboards import (
    DASHBOARDS,
    HISTOGRAM_SUFFIXES,
    all_values,
    load,
    metric_names,
    queries,
    require_tool,
    substitute,
    variable_queries,
)

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "dashboards" / "prometheus" / "alerts.yml"

PENDING: set[str] = set()

# Alerts the run's faults must drive at least to pending (most have a longer `for:` than the run).
EXPECTED_ALERTS = {
    "RankwatchTrainingHang",          # rank 0 stuck in forward
    "RankwatchStragglerDetected",     # rank 1 of n2's job
    "RankwatchGPUFatalXid",           # scripted XID 79
    "RankwatchGPULost",               # scripted lost GPU
    "RankwatchGPUThermalThrottling",  # scripted hw_thermal_slowdown
    "RankwatchGPURowRemapFailed",     # scripted failed remap
    "RankwatchGPUUncorrectableECC",   # scripted uncorrected ECC errors
    "RankwatchAgentDown",             # n2's agent is stopped
}

GPU_SCRIPT = {
    "gpus": {"count": 2, "name": "NVIDIA H100 80GB HBM3", "nvlinks": 2},
    "events": [  # seconds after the agent started
        {"at": 8, "gpu": 0, "throttle": ["hw_thermal_slowdown"]},
        {"at": 10, "gpu": 0, "ecc": {"corrected": 4, "uncorrected": 1}, "pcie_replays": 3,
         "nvlink": {"1": {"crc_flit": 2, "replay": 1}}},
        {"at": 10, "gpu": 1, "remap": {"correctable": 2, "pending": 1, "failed": 1}},
        {"at": 12, "gpu": 1, "xid": 79},
        {"at": 14, "gpu": 1, "lost": True},
        {"at": 40, "gpu": 0, "throttle": []},
    ],
}

PACE = ("--log-every", "0", "--step-sleep", "0.1", "--peak-tflops", "1")
HANG_JOB = ("--steps", "150", *PACE, "--checkpoint-interval", "50",
            "--fault", "sleep_forward:0:110:8")    # rank 0 stuck 8 s in forward at step 110
STRAGGLER_JOB = ("--steps", "120", *PACE,
                 "--fault", "slow_compute:1:20:0.5")  # rank 1's forward slower from step 20
# Then, on n2, a head-heavy two-stage pipeline with experts, for the stage and expert panels.
PIPELINE_JOB = ("--steps", "40", "--pp", "2", "--ep", "2", "--layers", "4", "--pp-split", "1,3")
SCRAPE = "1s"
RATE_INTERVAL = "5s"


def _epoch(rfc3339: str) -> float:
    """Prometheus's RFC 3339 time (nanosecond fractions, ``Z``) as seconds since the epoch."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", rfc3339)
    assert m, rfc3339
    zone = "+00:00" if m[3] == "Z" else m[3]
    return datetime.datetime.fromisoformat(m[1] + zone).timestamp() + float("0" + (m[2] or ""))


class Prometheus:
    """The Debian ``prometheus`` binary on a free loopback port with a throwaway TSDB."""

    def __init__(self, tmp: Path, targets: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "prometheus.log"
        self.config = tmp / "prometheus.yml"
        self.config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": SCRAPE, "evaluation_interval": SCRAPE},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "rankwatch", "static_configs": [{"targets": targets}]}],
        }))
        self.cmd = [require_tool("prometheus"), f"--config.file={self.config}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"]
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    def start(self) -> Prometheus:
        self.started_at = time.time()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._ready, 30, interval=0.2, what="Prometheus ready")
        return self

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited: {self.log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> dict:
        """GET /api/v1/<path>; a query Prometheus refuses comes back as its error payload."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read())

    def scraped_since(self, t: float, targets: int) -> bool:
        """Every one of ``targets`` scraped after ``t`` (the time of its last ``up`` sample)."""
        result = self.api("query", query="timestamp(up)")["data"]["result"]
        return len(result) == targets and all(float(r["value"][1]) > t for r in result)

    def rules_evaluated_since(self, t: float) -> bool:
        """Every rule group evaluated after ``t``."""
        groups = self.api("rules")["data"]["groups"]
        return bool(groups) and all(_epoch(g["lastEvaluation"]) > t for g in groups)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def send_undecodable(agent: AgentProcess) -> None:
    """One message the agent cannot decode: it must count it and carry on."""
    with grpc.insecure_channel(agent.addr.grpc_target()) as channel:
        try:
            channel.stream_unary("/rankwatch.v1.Agent/Report")(iter([b"\xff\xff\xff\xff"]), timeout=5)
        except grpc.RpcError:
            pass


def request_checkpoint(agent: AgentProcess) -> None:
    out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "checkpoint", "--agent", str(agent.addr)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


def exported_names(agents: list[AgentProcess]) -> set[str]:
    return {name for a in agents for name, _ in parse_metrics(a.metrics())}


def pending_in(expr: str) -> set[str]:
    def base(m: str) -> str:
        return next((m[: -len(s)] for s in HISTOGRAM_SUFFIXES if m.endswith(s)), m)

    return {m for m in metric_names(expr) if base(m) in PENDING}


@pytest.fixture
def stack(tmp_path):
    """Agents n0 (coordinator), n1 (coordinated, scripted GPUs) and n2 (standalone).
    --min-nodes 2 keeps the coordinator from excluding n1 for its faults, so its job runs on."""
    coord = f"127.0.0.1:{free_port()}"
    script = tmp_path / "gpu-script.json"
    script.write_text(json.dumps(GPU_SCRIPT))
    ports = [free_port() for _ in range(3)]
    job_args = ("--coordinator", coord, "--min-nodes", "2", "--hang-floor", "2")
    extras = [("--listen", coord, *job_args, "--gpu-source", "none"),
              (*job_args, "--gpu-source", f"script:{script}", "--gpu-interval", "0.5"),
              ("--gpu-source", "none", "--hang-floor", "2")]
    agents = [AgentProcess(tmp_path / f"n{i}.sock", node=f"n{i}", extra=(*extra, "--metrics-port", str(port)))
              for i, (extra, port) in enumerate(zip(extras, ports))]
    # Prometheus first, so that it sees every agent from its first second on.
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}" for port in ports]).start()
    try:
        for a in agents:
            a.start()
        yield prom, agents
    finally:
        prom.stop()
        for a in agents:
            a.stop()


def test_dashboards_and_alerts_on_a_real_stack(stack, tmp_path):
    prom, agents = stack
    coordinator, job_agent, standalone = agents
    started = prom.started_at
    jobs = [torchrun(2, *HANG_JOB, "--checkpoint-dir", str(tmp_path / "ckpt"), agent=job_agent.addr,
                     log=tmp_path / "job-n1.log"),
            torchrun(2, *STRAGGLER_JOB, agent=standalone.addr, log=tmp_path / "job-n2.log")]
    try:
        wait_for(lambda: any(r["step"] >= 30 for r in job_agent.status()["ranks"]), 60, interval=0.5,
                 what="step 30")
        send_undecodable(job_agent)
        request_checkpoint(job_agent)
        # n2's pipeline job follows its straggler job, while n1's job is still in its hang.
        assert jobs[1].wait(150) == 0, (tmp_path / "job-n2.log").read_text()[-3000:]
        jobs.append(torchrun(4, *PIPELINE_JOB, agent=standalone.addr, log=tmp_path / "job-n2-pp.log"))
        for job, log in zip((jobs[0], jobs[2]), ("job-n1.log", "job-n2-pp.log")):
            assert job.wait(150) == 0, (tmp_path / log).read_text()[-3000:]
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGCONT)
                os.killpg(job.pid, signal.SIGKILL)
                job.wait(30)
    finished = time.time()
    wait_for(lambda: prom.scraped_since(finished + 1.0, len(agents)), 20, interval=0.5,
             what="two scrapes of every agent after the jobs ended")
    exported = exported_names(agents)
    standalone.stop()
    instance = f"127.0.0.1:{standalone.metrics_port}"
    wait_for(lambda: prom.api("query", query=f'up{{instance="{instance}"}} == 0')["data"]["result"], 20,
             interval=0.5, what="Prometheus to see the stopped agent down")
    down = time.time()
    wait_for(lambda: prom.rules_evaluated_since(down), 20, interval=0.5, what="the rules evaluated once more")
    # A group's evaluation that started just after ``down`` may be stamped before the failed
    # scrape's sample: wait for the evaluation that sees it (the alert's own series), bounded.
    wait_for(lambda: prom.api("query", query='ALERTS{alertname="RankwatchAgentDown"}')["data"]["result"], 20,
             interval=0.5, what="RankwatchAgentDown pending for the stopped agent")
    end = time.time()
    span = f"{int(end - started) + 1}s"

    landed = {m for m in PENDING if any(n == m + s for n in exported for s in ("", *HISTOGRAM_SUFFIXES))}
    assert not landed, f"now exported, remove from PENDING: {sorted(landed)}"

    checked, with_data, failures = 0, 0, []
    for path in DASHBOARDS:
        dash = load(path)
        values = {**all_values(dash), "__rate_interval": RATE_INTERVAL, "__interval": SCRAPE, "__range": span}
        exprs = [(where, substitute(e, values)) for where, e in queries(dash)]
        exprs += [(f'{dash["uid"]}: variable {name}', f"group by ({label}) ({substitute(sel, values)})")
                  for name, sel, label in variable_queries(dash)]
        for where, expr in exprs:
            checked += 1
            instant = prom.api("query", query=expr, time=f"{end:.3f}")
            if instant["status"] != "success":
                failures.append(f"{where}: {instant.get('error')}\n    {expr}")
                continue
            if pending_in(expr):
                continue
            ranged = prom.api("query_range", query=expr, start=f"{started:.3f}", end=f"{end:.3f}", step="1")
            if ranged["status"] != "success" or not ranged["data"]["result"]:
                failures.append(f"{where}: no data over the run\n    {expr}")
                continue
            with_data += 1
    print(f"\n{checked} dashboard queries valid, {with_data} returned data, "
          f"{checked - with_data} pending on {sorted(PENDING)}")
    assert not failures, "\n".join(failures)

    rules = prom.api("rules")["data"]["groups"]
    broken = [(r["name"], r.get("lastError")) for g in rules for r in g["rules"] if r["health"] != "ok"]
    assert not broken, broken
    # (one step past ``end``: the range's points fall on whole seconds from ``started``, and the
    # stopped agent's alert may be stamped within the last second before ``end``)
    fired = prom.api("query_range", query="group by (alertname) (ALERTS)", start=f"{started:.3f}",
                     end=f"{end + 1:.3f}", step="1")["data"]["result"]
    fired_names = {s["metric"]["alertname"] for s in fired}
    incidents = [(i["kind"], i["node"], i["rank"], i["step"]) for i in coordinator.status()["incidents"]]
    assert EXPECTED_ALERTS <= fired_names, (
        f"alerts never pending or firing: {EXPECTED_ALERTS - fired_names}; the coordinator's incidents: {incidents}")
    print(f"alerts pending or firing during the run: {sorted(fired_names)}")
