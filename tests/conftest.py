"""Shared fixtures: real agents in subprocesses or threads, real torchrun jobs."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

import cores
from rankwatch.address import Address
from rankwatch.status import AgentUnreachable, fetch_status


class AgentProcess:
    """``rankwatch agent`` in a subprocess, on a socket in the test's tmp dir.

    ``env`` is laid over this process's environment for the agent.
    """

    def __init__(self, sock: Path, node: str = "n0", log: Path | None = None,
                 extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        self.sock, self.node, self.extra, self.env = sock, node, extra, env
        self.addr = Address(path=str(sock))
        self.log = log or sock.with_suffix(".log")
        self.proc: subprocess.Popen | None = None
        self.metrics_port = 0

    def start(self, timeout: float = 15.0) -> AgentProcess:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rankwatch.agent.cli", "agent", "--listen", str(self.sock),
                 "--metrics-port", "0", "--metrics-addr", "127.0.0.1", "--node-id", self.node,
                 "--state-dir", str(self.sock.parent / f"state-{self.node}"), *self.extra],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env} if self.env else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"agent died: {self.log.read_text()}"
            try:
                self.metrics_port = fetch_status(self.addr, timedelta(seconds=1))["metrics_port"]
                return self
            except AgentUnreachable:
                time.sleep(0.1)
        raise TimeoutError("agent did not come up")

    def status(self) -> dict:
        return fetch_status(self.addr)

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_CORES = pytest.StashKey["cores.Cores"]()


@functools.lru_cache(maxsize=1)
def has_gpu() -> bool:
    """NVML initialises and lists a GPU (no torch import: most runs have no GPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no library, no driver, no device
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[_CORES] = cores.Cores(os.environ.get("PYTEST_XDIST_TESTRUNUID"), cores.order(items, has_gpu()))
    gpu_items = [item for item in items if "gpu" in item.keywords and item.get_closest_marker("gpu")]
    if gpu_items and not has_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (NVML finds none here); run `pytest -m gpu` on one")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Hold this worker's share of the cores for the item's file (tests/cores.py)."""
    held = item.config.stash.get(_CORES, None)
    if held is not None:
        held.enter(item)
    yield   # an old-style wrapper: the test's outcome never raises here
    if held is not None:
        held.leave(item, nextitem)


def pytest_unconfigure(config: pytest.Config) -> None:
    held = config.stash.get(_CORES, None)
    if held is not None:
        held.close()


_LEAK_ENV = "RANKWATCH_TEST_PROCESS_TAG"


@contextlib.contextmanager
def processes_cleaned_up() -> Iterator[None]:
    """Kill whatever the block started and left behind.

    torchrun starts each worker in its own session, so killing a launcher's process
    group leaves its workers training (or stopped) on a 2-core machine.  Every process
    the block starts inherits a tag in its environment; after the block, any process
    still carrying it is continued and killed.
    """
    import uuid

    import psutil

    tag = uuid.uuid4().hex
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(_LEAK_ENV, tag)
        try:
            yield
        finally:
            me = os.getpid()
            for p in psutil.process_iter():
                try:
                    if p.pid != me and p.environ().get(_LEAK_ENV) == tag:
                        p.send_signal(signal.SIGCONT)
                        p.kill()
                except (psutil.Error, OSError):
                    pass


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    """What a test starts ends with it (:func:`processes_cleaned_up`); a module-scoped
    fixture that starts processes cleans up after itself the same way."""
    with processes_cleaned_up():
        yield


@pytest.fixture
def agent_proc(tmp_path: Path) -> Iterator[AgentProcess]:
    agent = AgentProcess(tmp_path / "agent.sock").start()
    yield agent
    agent.stop()


def torchrun(nproc: int, *train_args: str, agent: Address | None = None, env: dict | None = None,
             log: Path | None = None) -> subprocess.Popen:
    """Start the harness under a real torchrun (standalone rendezvous, free port)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if agent is not None:
        full_env["RANKWATCH_AGENT"] = str(agent)
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         "-m", "rankwatch.hooks.train", *train_args],
        env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text into ``{(name, labels): value}`` using prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _gloo_rank(rank: int, port: int, body, args: tuple, error_path: str) -> None:
    import traceback

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        body(rank, *args)
        dist.barrier()
    except Exception:
        Path(error_path).write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_gloo_pair(body, *args, error_path: Path) -> None:
    """``body(rank, *args)`` in each of two processes of a real gloo group on loopback
    (``body`` a module-level function); a rank's exception is also written to ``error_path``."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gloo_rank, args=(port, body, args, str(error_path)), nprocs=2)
