"""The Slurm prolog and epilog (deploy/slurm/), under a real Slurm and on their own.

The end-to-end test runs Debian's slurmctld and slurmd (one node, loopback,
foreground) with a munged of its own, configured with the repository's prolog
and epilog, and submits the repository's sbatch example.  slurmd gives prologs
no environment of ours, so Prolog= and Epilog= name two-line wrappers that only
point the scripts at a settings file in the test's tmp dir.

The other tests run the scripts directly, as root, in the environment slurmd
builds for them (SLURM_* only, no PATH).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from conftest import wait_for
from etcdcluster import EtcdCluster
from rankwatch.address import Address
from rankwatch.agent.durable.incidents import IncidentLog
from rankwatch.agent.cli.ports import free_port
from rankwatch.status import fetch_status

# Its e2e tests mostly wait on timers: they may run beside another light file (tests/cores.py).
pytestmark = pytest.mark.light

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "deploy" / "slurm"
PROLOG, EPILOG, SBATCH = SLURM_DIR / "prolog.sh", SLURM_DIR / "epilog.sh", SLURM_DIR / "train.sbatch"
RANKWATCH = Path(sys.executable).parent / "rankwatch"
_TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
             "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _require(*tools: str, root: bool = True) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: install the Debian packages in "
                    f".ci/apt-packages (slurmctld slurmd slurm-client munge shellcheck)")
    if root and os.geteuid() != 0:
        pytest.fail("the prolog and epilog run as root under slurmd; run this test as root")


def _write_settings(path: Path, root: Path, agent_args: str = "--hang-floor 2",
                    coordinator_port: int | None = None) -> dict[str, Path]:
    """The prolog/epilog settings file, everything under ``root``; returns the paths."""
    paths = {"run": root / "run", "state": root / "state", "log": root / "log" / "slurm.log"}
    path.write_text(f"RANKWATCH={shlex.quote(str(RANKWATCH))}\n"
                    f"RUN_DIR={shlex.quote(str(paths['run']))}\n"
                    f"STATE_DIR={shlex.quote(str(paths['state']))}\n"
                    f"LOG_FILE={shlex.quote(str(paths['log']))}\n"
                    "METRICS_PORT=0\n"
                    f"AGENT_ARGS={shlex.quote(agent_args + ' --metrics-addr 127.0.0.1')}\n"
                    f"COORDINATOR_PORT={coordinator_port or ''}\n")
    return paths


def _alive(pid: int) -> bool:
    """A live process (a zombie awaiting its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _logged_pid(log: Path, job: str) -> int:
    m = re.search(rf"prolog job={job} .*agent started \(pid (\d+)\)", log.read_text())
    assert m, f"the prolog logged no agent start for job {job}:\n{log.read_text()}"
    return int(m.group(1))


def _stop_leftover_agents(run_dir: Path) -> None:
    """Teardown after a failed test: stop agents our prologs started and no epilog stopped."""
    for pidfile in run_dir.glob("*.pid"):
        pid = int(pidfile.read_text() or 0)
        if pid and _alive(pid) and "rankwatch" in Path(f"/proc/{pid}/cmdline").read_text():
            os.kill(pid, signal.SIGKILL)


# -- the scripts on their own ------------------------------------------------------------

def test_scripts_pass_shellcheck():
    _require("shellcheck", root=False)
    r = subprocess.run(["shellcheck", "--severity=style", str(PROLOG), str(EPILOG), str(SBATCH)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _slurmd_env(job: int, settings: Path, context: str) -> dict[str, str]:
    """What slurmd gives a prolog/epilog (22.05): SLURM_* variables only, no PATH."""
    return {"SLURM_JOB_ID": str(job), "SLURM_JOBID": str(job), "SLURMD_NODENAME": "n1",
            "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_GID": str(os.getgid()),
            "SLURM_JOB_USER": "root", "SLURM_UID": str(os.getuid()), "SLURM_CLUSTER_NAME": "test",
            "SLURM_JOB_PARTITION": "debug", "SLURM_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1",
            "SLURM_SCRIPT_CONTEXT": f"{context}_slurmd", "RANKWATCH_SLURM_CONFIG": str(settings)}


def _run_script(script: Path, job: int, settings: Path, **env: str) -> None:
    context = "prolog" if script == PROLOG else "epilog"
    r = subprocess.run([str(script)], env={**_slurmd_env(job, settings, context), **env},
                       capture_output=True, text=True, timeout=40)
    assert r.returncode == 0, f"{script.name} exited {r.returncode}: {r.stderr}"


def test_prolog_is_idempotent_and_epilog_keeps_the_evidence(tmp_path):
    _require("setpriv", "setsid")
    paths = _write_settings(tmp_path / "settings", tmp_path)
    job, sock = 41, paths["run"] / "41" / "agent.sock"
    try:
        _run_script(PROLOG, job, tmp_path / "settings")
        pid = _logged_pid(paths["log"], "41")
        assert (paths["run"] / "41.pid").read_text().strip() == str(pid)
        assert fetch_status(Address(path=str(sock)))["node"] == "n1"
        assert sock.stat().st_mode & 0o777 == 0o600

        _run_script(PROLOG, job, tmp_path / "settings")           # a second prolog: a no-op
        assert f"agent already running (pid {pid})" in paths["log"].read_text()
        assert (paths["run"] / "41.pid").read_text().strip() == str(pid) and _alive(pid)

        _run_script(EPILOG, job, tmp_path / "settings")
        wait_for(lambda: not _alive(pid), 5, what="the agent to exit")
        assert not (paths["run"] / "41").exists() and not (paths["run"] / "41.pid").exists()
        kept = paths["state"] / "41" / "n1"
        assert json.loads((kept / "status.json").read_text())["node"] == "n1"
        assert "serving gRPC" in (kept / "agent.log").read_text()

        _run_script(EPILOG, job, tmp_path / "settings")           # nothing left to stop
        assert "no agent recorded for the job" in paths["log"].read_text()
    finally:
        _stop_leftover_agents(paths["run"])


def test_epilog_never_kills_a_process_that_is_not_the_jobs_agent(tmp_path):
    _require("setpriv")
    paths = _write_settings(tmp_path / "settings", tmp_path)
    paths["run"].mkdir()
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        (paths["run"] / "42.pid").write_text(f"{bystander.pid}\n")
        _run_script(EPILOG, 42, tmp_path / "settings")
        assert bystander.poll() is None, "the epilog killed a process that is not the job's agent"
        assert f"agent (pid {bystander.pid}) already gone" in paths["log"].read_text()
        assert not (paths["run"] / "42.pid").exists()
    finally:
        bystander.kill()
        bystander.wait()


def test_prolog_failure_is_logged_and_never_fails_the_job(tmp_path):
    _require("setpriv", "setsid")
    paths = _write_settings(tmp_path / "settings", tmp_path, agent_args="--hang-floor -1")
    _run_script(PROLOG, 43, tmp_path / "settings")               # the agent refuses its flags
    log = paths["log"].read_text()
    assert "error: agent exited at start" in log and "--hang-floor" in log, log
    assert not (paths["run"] / "43.pid").exists()

    env = _slurmd_env(45, tmp_path / "settings", "prolog")
    env["SLURM_JOB_ID"] = "45/../../etc"
    assert subprocess.run([str(PROLOG)], env=env, timeout=20).returncode == 0
    assert "error: SLURM_JOB_ID '45/../../etc' is not a job id" in paths["log"].read_text()


def test_coordinator_port_and_token_key_give_the_job_a_token_its_agents_require(tmp_path):
    _require("setpriv", "setsid", "scontrol", "sha256sum")
    port = free_port()
    paths = _write_settings(tmp_path / "settings", tmp_path, coordinator_port=port)
    key = tmp_path / "token.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    with open(tmp_path / "settings", "a") as f:
        f.write(f"TOKEN_KEY_FILE={shlex.quote(str(key))}\n")
    # scontrol expands the job's node list with slurm.conf, which slurmd names in SLURM_CONF.
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=test\nSlurmctldHost=localhost\nNodeName=localhost\n")
    job_env = {"SLURMD_NODENAME": "localhost", "SLURM_NODELIST": "localhost,n2", "SLURM_CONF": str(conf)}
    cli_env = {k: v for k, v in os.environ.items() if k != "RANKWATCH_TOKEN"}
    try:
        _run_script(PROLOG, 46, tmp_path / "settings", **job_env)
        token = paths["run"] / "46" / "token"
        assert token.stat().st_mode & 0o777 == 0o600
        assert token.read_text().strip() == hashlib.sha256(key.read_bytes() + b":46").hexdigest()
        agent = Address(path=str(paths["run"] / "46" / "agent.sock"))
        wait_for(lambda: fetch_status(agent)["coordinator"], 10, what="the agent to coordinate")
        assert fetch_status(agent)["coordinator_node"] == "localhost"

        ask = [str(RANKWATCH), "checkpoint", "--agent", f"localhost:{port}"]
        r = subprocess.run(ask, capture_output=True, text=True, timeout=30, env=cli_env)
        assert r.returncode == 1 and "refused" in r.stderr and "--token-file" in r.stderr, r.stderr
        r = subprocess.run([*ask, "--token-file", str(token)], capture_output=True, text=True,
                           timeout=30, env=cli_env)
        assert "--token-file" not in r.stderr, r.stderr        # past the token check

        _run_script(EPILOG, 46, tmp_path / "settings", **job_env)
        assert not token.exists()

        key.chmod(0o640)                                        # a key others may read: refused
        _run_script(PROLOG, 47, tmp_path / "settings", **job_env)
        assert "must be root's, mode 0600" in paths["log"].read_text()
        assert not (paths["run"] / "47.pid").exists()
    finally:
        _stop_leftover_agents(paths["run"])


def test_ca_key_gives_the_job_per_node_certificates_for_mutual_tls(tmp_path):
    from rankwatch.credentials import ClientCredentials
    from rankwatch.status import AgentUnreachable
    from tlscerts import CertAuthority

    _require("setpriv", "setsid", "scontrol", "sha256sum")
    port = free_port()
    paths = _write_settings(tmp_path / "settings", tmp_path, coordinator_port=port)
    key = tmp_path / "token.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    ca = CertAuthority(tmp_path / "ca", "slurm-ca")
    ca_key = ca.root / "ca.key"   # `rankwatch certs init` made it 0600
    with open(tmp_path / "settings", "a") as f:
        f.write(f"TOKEN_KEY_FILE={shlex.quote(str(key))}\nTLS_CA_DIR={shlex.quote(str(ca.root))}\n")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=test\nSlurmctldHost=localhost\nNodeName=localhost\n")
    job_env = {"SLURMD_NODENAME": "localhost", "SLURM_NODELIST": "localhost", "SLURM_CONF": str(conf)}
    try:
        _run_script(PROLOG, 48, tmp_path / "settings", **job_env)
        d = paths["run"] / "48"
        for name in ("tls.key", "tls.crt", "ca.crt"):
            assert (d / name).stat().st_mode & 0o777 == 0o600, name
        wait_for(lambda: fetch_status(Address(path=str(d / "agent.sock")))["coordinator"], 10,
                 what="the agent to coordinate")
        tcp = Address.parse(f"localhost:{port}")
        token = (d / "token").read_text().strip()
        job = ClientCredentials.tls(token, str(d / "ca.crt"), str(d / "tls.crt"), str(d / "tls.key"))
        assert fetch_status(tcp, creds=job)["node"] == "localhost"
        for wrong in (ClientCredentials(token),                                     # plaintext
                      ClientCredentials.tls(token, str(d / "ca.crt"), None, None)):  # no client certificate
            with pytest.raises(AgentUnreachable, match="UNAVAILABLE"):
                fetch_status(tcp, creds=wrong)
        _run_script(EPILOG, 48, tmp_path / "settings", **job_env)
        assert not (d / "tls.key").exists()

        ca_key.chmod(0o644)                                     # a CA key others may read: refused
        _run_script(PROLOG, 49, tmp_path / "settings", **job_env)
        assert "slurm-ca/ca.key must be root's, mode 0600" in paths["log"].read_text()
        assert not (paths["run"] / "49.pid").exists()
    finally:
        _stop_leftover_agents(paths["run"])


# -- a real Slurm ------------------------------------------------------------------------

class SlurmCluster:
    """slurmctld + slurmd (one node named after this host, on loopback) + munged, in ``root``."""

    def __init__(self, root: Path, settings: Path) -> None:
        self.root, self.node = root, socket.gethostname().split(".")[0]
        try:  # the sbatch example's rendezvous endpoint is the first node's name
            socket.gethostbyname(self.node)
        except OSError as exc:
            pytest.fail(f"this host's name {self.node!r} does not resolve ({exc}); add it to /etc/hosts")
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []
        # munged wants every directory above its socket searchable by all: pytest's tmp is not.
        self.munge_dir = Path(tempfile.mkdtemp(prefix="rankwatch-munge-"))
        self.munge_dir.chmod(0o755)
        self._write_conf(settings)

    def _write_conf(self, settings: Path) -> None:
        for name, script in (("prolog", PROLOG), ("epilog", EPILOG)):
            wrapper = self.root / f"{name}-wrapper.sh"
            wrapper.write_text(f"#!/bin/sh\nRANKWATCH_SLURM_CONFIG={shlex.quote(str(settings))} "
                               f"exec {shlex.quote(str(script))}\n")
            wrapper.chmod(0o755)
        for d in ("ctld-state", "slurmd-spool"):
            (self.root / d).mkdir()
        r = self.root
        self.conf.write_text(f"""\
ClusterName=rankwatch-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_dir / 'munge.sock'}
StateSaveLocation={r / 'ctld-state'}
SlurmdSpoolDir={r / 'slurmd-spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'slurmctld.log'}
SlurmdLogFile={r / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
KillWait=2
Prolog={r / 'prolog-wrapper.sh'}
Epilog={r / 'epilog-wrapper.sh'}
PrologFlags=Alloc
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, *cmd: str) -> None:
        with open(self.root / f"{name}.out", "w") as out:
            self.procs.append(subprocess.Popen(list(cmd), env=self.env, stdout=out,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))

    def start(self) -> SlurmCluster:
        m = self.munge_dir
        subprocess.run(["mungekey", "--create", "--keyfile", str(m / "munge.key")], check=True,
                       timeout=20)
        self._spawn("munged", "munged", "--foreground", f"--socket={m / 'munge.sock'}",
                    f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                    f"--seed-file={m / 'munged.seed'}", f"--log-file={m / 'munged.log'}")
        wait_for(lambda: (m / "munge.sock").exists(), 10, what=f"munged: {self._tail('munged.out')}")
        self._spawn("slurmctld", "slurmctld", "-D", "-f", str(self.conf))
        self._spawn("slurmd", "slurmd", "-D", "-f", str(self.conf), "-N", self.node)
        wait_for(lambda: self.run("sinfo", "-h", "-o", "%T").stdout.strip() == "idle", 30,
                 interval=0.3, what=f"the node to be idle: {self.logs()}")
        return self

    def run(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=30)

    def job_state(self, job: str) -> tuple[str, str]:
        out = self.run("scontrol", "-o", "show", "job", job).stdout
        state = re.search(r"JobState=(\S+)", out)
        code = re.search(r"ExitCode=(\S+)", out)
        return (state.group(1) if state else "?", code.group(1) if code else "?")

    def _tail(self, name: str, n: int = 15) -> str:
        path = self.root / name
        return "\n".join(path.read_text().splitlines()[-n:]) if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self._tail(n)}" for n in
                         ("slurmctld.log", "slurmctld.out", "slurmd.log", "slurmd.out", "munged.out"))

    def stop(self) -> None:
        """Cancel what still runs (while munge and the daemons are up), stop the daemons, and
        kill any job step or job process left behind: they all carry this cluster's SLURM_CONF."""
        if len(self.procs) == 3 and all(p.poll() is None for p in self.procs):
            self.run("scancel", "--partition", "debug")
            try:
                wait_for(lambda: not self.run("squeue", "-h").stdout.strip(), 20, interval=0.5)
            except TimeoutError:
                pass
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        mark = f"SLURM_CONF={self.conf}".encode()
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if mark in environ.read_bytes().split(b"\0") and environ.parent.name != str(os.getpid()):
                    os.kill(int(environ.parent.name), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        shutil.rmtree(self.munge_dir, ignore_errors=True)


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_real_slurm_job_gets_an_agent_from_the_prolog_and_the_epilog_keeps_its_incidents(tmp_path):
    _require("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "munged", "mungekey", "setpriv")
    paths = _write_settings(tmp_path / "settings", tmp_path, coordinator_port=free_port())
    cluster = SlurmCluster(tmp_path, tmp_path / "settings")
    try:
        cluster.start()
        # The repository's sbatch example on one node; rank 0 stalls in Python for 8 s at
        # step 6, which the prolog's agent (hang floor 2 s) must report as a hang.
        env = {**cluster.env, "PATH": f"{RANKWATCH.parent}:{os.environ['PATH']}",
               "OMP_NUM_THREADS": "1", "RANKWATCH_RUN_DIR": str(paths["run"]),
               "RDZV_PORT": str(free_port()), "CHECKPOINT_DIR": str(tmp_path / "ckpt")}
        r = subprocess.run(["sbatch", "--parsable", "--nodes", "1", "--time", "3",
                            "--chdir", str(tmp_path), "--output", str(tmp_path / "job.out"),
                            str(SBATCH), "--steps", "12", "--fault", "sleep_forward:0:6:8"],
                           env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        job = r.stdout.strip().split(";")[0]

        state, code = wait_for(lambda: (s := cluster.job_state(job))[0] in _TERMINAL and s, 120,
                               interval=0.5, what=f"job {job} to end")
        out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
        assert (state, code) == ("COMPLETED", "0:0"), f"{state} {code}\n{out}\n{cluster.logs()}"

        sock = paths["run"] / job / "agent.sock"
        assert f"streaming to agent at unix:{sock}" in out, out
        assert "starting a local one" not in out, "rankwatch run found no agent from the prolog"

        # The epilog ran (the job is COMPLETED only after it): agent gone, evidence kept.
        pid = _logged_pid(paths["log"], job)
        assert f"epilog job={job} node={cluster.node} agent stopped (pid {pid})" in paths["log"].read_text()
        wait_for(lambda: not _alive(pid), 5, what="the agent to exit")
        assert not sock.parent.exists() and not (paths["run"] / f"{job}.pid").exists()

        kept = paths["state"] / job / cluster.node
        final = json.loads((kept / "status.json").read_text())
        assert final["node"] == cluster.node
        # COORDINATOR_PORT: the job's first node (here its only one) coordinates the job.
        assert final["coordinator"] is True and final["coordinator_node"] == cluster.node
        assert [(r["rank"], r["step"]) for r in final["ranks"]] == [(0, 12)]
        # The file holds incidents and their later updates; its reader replays both.
        incidents = IncidentLog.replay(kept / "incidents.jsonl")
        hangs = [i for i in incidents if i.kind == "hang"]
        assert [(i.rank, i.node) for i in hangs] == [(0, cluster.node)], incidents
        assert hangs[0].detail["alive"] is True and "stacks" in hangs[0].detail
    finally:
        cluster.stop()
        _stop_leftover_agents(paths["run"])


def test_etcd_endpoints_make_the_jobs_agents_elect_their_coordinator_in_etcd(tmp_path):
    _require("setpriv", "setsid", "scontrol")
    etcd = EtcdCluster(tmp_path)
    port = free_port()
    paths = _write_settings(tmp_path / "settings", tmp_path, coordinator_port=port)
    with open(tmp_path / "settings", "a") as f:
        f.write(f"ETCD_ENDPOINTS={etcd.endpoints[0]}\nTOKEN_KEY_FILE=/nonexistent\nTLS_CA_KEY=/nonexistent\n")
    job_env = {"SLURMD_NODENAME": "localhost", "SLURM_NODELIST": "localhost,n2"}
    try:
        _run_script(PROLOG, 48, tmp_path / "settings", **job_env)
        agent = Address(path=str(paths["run"] / "48" / "agent.sock"))
        wait_for(lambda: fetch_status(agent)["coordinator"], 15, what="the agent to win the seat in etcd")
        assert "any node, elected in etcd" in paths["log"].read_text()
        with urllib.request.urlopen(f"{etcd.urls[0]}/v2/keys/rankwatch/48/coordinator", timeout=5) as r:
            assert json.load(r)["node"]["value"] == f"localhost:{port}"
        # A value that is not host:port[,...] is refused, and no agent starts.
        with open(tmp_path / "settings", "a") as f:
            f.write("ETCD_ENDPOINTS='h:1;touch /tmp/x'\n")
        _run_script(PROLOG, 49, tmp_path / "settings", **job_env)
        assert "ETCD_ENDPOINTS must be host:port" in paths["log"].read_text()
        assert not (paths["run"] / "49.pid").exists()
    finally:
        _stop_leftover_agents(paths["run"])
        etcd.stop()
