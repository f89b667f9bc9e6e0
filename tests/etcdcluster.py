"""Real etcd members on loopback for the tests (Debian's etcd-server, v2 API on)."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from conftest import wait_for
from multinode import free_port


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/keys/", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


class EtcdCluster:
    """``members`` etcd processes forming one cluster; ``endpoints`` are their client HOST:PORTs."""

    def __init__(self, tmp: Path, members: int = 1) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            pytest.fail("etcd not found on PATH: install Debian's 'etcd-server' (.ci/apt-packages lists it)")
        ports = [(free_port(), free_port()) for _ in range(members)]
        initial = ",".join(f"e{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
        self.urls = [f"http://127.0.0.1:{client}" for client, _ in ports]
        self.endpoints = [f"127.0.0.1:{client}" for client, _ in ports]
        self.procs: list[subprocess.Popen] = []
        for i, (client, peer) in enumerate(ports):
            log = open(tmp / f"etcd{i}.log", "w")
            self.procs.append(subprocess.Popen(
                [exe, "--name", f"e{i}", "--data-dir", str(tmp / f"etcd{i}"), "--enable-v2=true",
                 "--listen-client-urls", self.urls[i], "--advertise-client-urls", self.urls[i],
                 "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--heartbeat-interval", "100", "--election-timeout", "1000"],
                stdout=log, stderr=subprocess.STDOUT))
        try:
            for i, url in enumerate(self.urls):
                wait_for(lambda: self.procs[i].poll() is None and answers(url), 60, what=f"etcd member {i}")
        except BaseException:
            self.stop()
            raise

    def _v3(self, member: int, call: str, body: dict | None = None) -> dict:
        """One call of etcd's v3 JSON gateway on ``member``."""
        req = urllib.request.Request(f"{self.urls[member]}/v3/{call}", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.load(r)

    def leader(self) -> int | None:
        """The member that leads the cluster now, asked of the first live member (None: the
        members are still electing one, or the one they name is not a member)."""
        live = next(i for i, p in enumerate(self.procs) if p.poll() is None)
        lead = self._v3(live, "maintenance/status").get("leader")   # absent while electing
        return next((i for i, m in self._members().items() if m == lead), None)

    def _members(self) -> dict[int, str]:
        live = next(i for i, p in enumerate(self.procs) if p.poll() is None)
        return {int(m["name"][1:]): m["ID"] for m in self._v3(live, "cluster/member/list")["members"]}

    def move_leader(self, to: int) -> None:
        """Hand the leadership to member ``to`` (asked of the current leader)."""
        now = wait_for(lambda: self.leader() is not None and [self.leader()], 10, what="an etcd leader")[0]
        if now != to:
            self._v3(now, "maintenance/transfer-leadership", {"targetID": self._members()[to]})

    def kill(self, member: int) -> None:
        self.procs[member].kill()
        self.procs[member].wait(10)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
