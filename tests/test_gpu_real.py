"""The GPU paths on a real NVIDIA GPU: NVML readings, the UUID mapping, NCCL completion-hook timing.

Marked ``gpu``: they run where NVML initialises and CUDA sees a device
(``pytest -m gpu`` on a GPU machine), and are skipped, with that reason, on
CPU-only machines such as CI's.  Nothing here is a stand-in: the real
``pynvml``, the real driver, real NCCL communicators and a real agent.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from conftest import AgentProcess, parse_metrics, torchrun
from rankwatch.agent.gpu import GpuCollector, GpuConfig, GpuMonitor
from rankwatch.agent.gpu.base import RECOVERY_ACTIONS, THROTTLE_REASONS
from rankwatch.agent.gpu.nvml import NvmlSource
from rankwatch.agent.durable.incidents import IncidentLog

pytestmark = pytest.mark.gpu

GIB = float(1 << 30)


@pytest.fixture(scope="module")
def nvml() -> NvmlSource:
    source = NvmlSource()
    yield source
    source.close()


def test_every_gpu_reads_within_physical_ranges(nvml):
    readings = nvml.read()
    assert readings, "NVML initialised but lists no GPU"
    for r in readings:
        assert r.up and r.error is None, r
        assert r.uuid.startswith("GPU-") and len(r.uuid) == 40, r.uuid
        assert r.name.startswith("NVIDIA"), r.name
        assert 5.0 <= r.temperature_celsius <= 105.0
        assert 10.0 <= r.power_watts <= 1500.0
        assert 50.0 <= r.power_limit_watts <= 1500.0 and r.power_watts <= r.power_limit_watts * 1.25
        assert 100e6 <= r.sm_clock_hertz <= 3.5e9
        assert 100e6 <= r.memory_clock_hertz <= 15e9
        assert 0.0 <= r.utilization_ratio <= 1.0 and 0.0 <= r.memory_utilization_ratio <= 1.0
        assert 4 * GIB <= r.memory_total_bytes <= 512 * GIB
        assert 0.0 < r.memory_used_bytes <= r.memory_total_bytes
        assert r.throttle is not None and set(r.throttle) <= set(THROTTLE_REASONS)
        # Data-centre GPUs count ECC errors and remap rows; a healthy one has no failed remap.
        assert {("corrected", "volatile"), ("uncorrected", "volatile")} <= set(r.ecc)
        assert all(n >= 0 for n in r.ecc.values())
        assert r.remapped_rows.get("failed") == 0
        assert r.pcie_replays is not None and r.pcie_replays >= 0
        # Drivers from R550 on say what the GPU needs; a GPU that serves a job needs nothing.
        assert r.recovery_action == "none", r.recovery_action


def test_xid_event_wait_returns_within_its_timeout(nvml):
    began = time.monotonic()
    events = nvml.events(timedelta(milliseconds=300))
    took = time.monotonic() - began
    assert events == []  # a healthy GPU raises no XID
    assert took < 2.0


def test_exposition_of_a_real_gpu(nvml):
    monitor = GpuMonitor("gpu-node", GpuConfig(source="nvml"), IncidentLog(None), list, source=nvml)
    monitor.poll()
    registry = CollectorRegistry()
    registry.register(GpuCollector(monitor))
    m = parse_metrics(generate_latest(registry).decode())
    gpu0 = frozenset({("node", "gpu-node"), ("gpu", "0")})
    assert m[("rankwatch_gpu_up", gpu0)] == 1.0
    assert 5.0 <= m[("rankwatch_gpu_temperature_celsius", gpu0)] <= 105.0
    assert m[("rankwatch_gpu_recovery_action", gpu0 | {("action", "none")})] == 1.0
    assert sum(v for (name, labels), v in m.items()
               if name == "rankwatch_gpu_recovery_action" and ("gpu", "0") in labels) == 1.0
    assert {a for (name, labels), _ in m.items() if name == "rankwatch_gpu_recovery_action"
            for k, a in labels if k == "action"} == set(RECOVERY_ACTIONS)


def test_the_ranks_device_uuid_is_the_one_nvml_names(nvml):
    """What a CUDA rank puts in its hello matches NVML's UUID of the same device."""
    code = textwrap.dedent("""
        import torch
        from rankwatch.hooks.instrument.hello import device_uuid as _device_uuid
        torch.cuda.set_device(0)
        print(_device_uuid(torch))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == nvml.read()[0].uuid


# -- NCCL: the completion hook, in one process (world size 1) -------------------------------

_NCCL_PROBE = textwrap.dedent("""
    import json, os, statistics, sys, time
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"
    import torch, torch.distributed as dist
    from rankwatch.hooks.instrument.collectives import CollectiveInstrumentation
    from rankwatch.hooks.instrument.recorder import OPS, Recorder

    torch.cuda.set_device(0)
    store = dist.FileStore(sys.argv[1], 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    rec = Recorder()
    instr = CollectiveInstrumentation(rec)
    source = instr.install()
    late = dist.new_group([0])          # made after install: found at the next refresh
    instr.refresh()

    def drain(n, timeout=30.0):
        out, deadline = [], time.monotonic() + timeout
        while len(out) < n and time.monotonic() < deadline:
            while rec.collectives:
                out.append(rec.collectives.popleft())
            time.sleep(0.005)
        return out

    x = torch.randn(1 << 20, device="cuda")
    big_in = torch.randn(64 << 20, device="cuda")           # 256 MiB
    big_out = torch.empty_like(big_in)
    dist.all_reduce(x)
    dist.all_gather_into_tensor(big_out, big_in)
    dist.reduce_scatter_tensor(big_out, big_in)
    dist.all_reduce(x, group=late)
    torch.cuda.synchronize()
    first = drain(4)

    # Hook against CUDA events around the same collectives (256 MiB all-gathers).  A
    # busy kernel first keeps the host's issue time out of the events' interval.
    pairs = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(5_000_000)
        e0.record()
        dist.all_gather_into_tensor(big_out, big_in)
        e1.record()
        torch.cuda.synchronize()
        (r,) = drain(1)
        pairs.append(((r[5] - r[4]) * 1e-6, e0.elapsed_time(e1)))

    instr.uninstall()
    dist.all_reduce(x)
    torch.cuda.synchronize()
    off = drain(1, timeout=1.0)
    again = instr.install()
    dist.all_reduce(x)
    torch.cuda.synchronize()
    on = drain(1)
    print(json.dumps({"source": source, "again": again, "errors": instr.errors,
                      "first": [(OPS[r[1]], r[2], r[3], r[5] - r[4], r[6]) for r in first],
                      "pairs": pairs, "off": len(off), "on": len(on),
                      "groups": [str(pg.group_name) for pg in instr.pgs]}))
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def nccl_probe(tmp_path_factory) -> dict:
    import json

    store = tmp_path_factory.mktemp("nccl") / "store"
    out = subprocess.run([sys.executable, "-c", _NCCL_PROBE, str(store)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_nccl_collectives_are_timed_by_the_completion_hook_on_every_group(nccl_probe):
    assert nccl_probe["source"] == "nccl_completion_hook"
    assert nccl_probe["errors"] == 0
    ops = [(op, pg) for op, pg, _seq, _dur, _nbytes in nccl_probe["first"]]
    assert sorted(ops) == sorted([("all_reduce", 0), ("all_gather", 0), ("reduce_scatter", 0),
                                  ("all_reduce", 1)])
    assert len(nccl_probe["groups"]) == 2  # the default group and the one made after install
    seqs = [seq for op, pg, seq, _d, _b in nccl_probe["first"] if pg == 0]
    assert sorted(seqs) == list(range(min(seqs), min(seqs) + 3))
    assert all(dur > 0 for *_, dur, _b in nccl_probe["first"])


def test_the_hooks_durations_agree_with_cuda_events(nccl_probe):
    ratios = [hook / event for hook, event in nccl_probe["pairs"]]
    assert statistics.median(ratios) == pytest.approx(1.0, abs=0.10), nccl_probe["pairs"]


def test_uninstalled_hooks_record_nothing_and_come_back(nccl_probe):
    assert nccl_probe["off"] == 0
    assert nccl_probe["again"] == "nccl_completion_hook" and nccl_probe["on"] == 1


# -- A real NCCL job under a real agent ----------------------------------------------------

def test_nccl_job_reports_hook_latencies_and_its_gpu(tmp_path: Path, nvml):
    agent = AgentProcess(tmp_path / "agent.sock", extra=("--gpu-source", "nvml")).start()
    try:
        job = torchrun(1, "--steps", "60", "--log-every", "0", "--dim", "256", "--layers", "2",
                       agent=agent.addr, log=tmp_path / "job.log",
                       env={"TORCH_NCCL_ENABLE_TIMING": "1"})
        assert job.wait(300) == 0, (tmp_path / "job.log").read_text()[-3000:]
        status = agent.status()
        (rank,) = status["ranks"]
        assert rank["backend"] == "nccl" and rank["collective_source"] == "nccl_completion_hook"
        assert rank["device_uuid"] == nvml.read()[0].uuid
        assert rank["step"] == 60 and rank["collectives"] >= 60
        m = parse_metrics(agent.metrics())
        counts = {dict(labels)["op"]: v for (name, labels), v in m.items()
                  if name == "rankwatch_collective_duration_seconds_count"}
        sums = {dict(labels)["op"]: v for (name, labels), v in m.items()
                if name == "rankwatch_collective_duration_seconds_sum"}
        assert counts.get("all_reduce", 0) >= 60  # the loss and checkpoint-agreement all-reduces
        assert all(0 < sums[op] / counts[op] < 0.1 for op in counts if counts[op])
        assert m[("rankwatch_gpu_up", frozenset({("node", "n0"), ("gpu", "0")}))] == 1.0
    finally:
        agent.stop()
