"""The GPU monitor: findings to incidents and listeners, the rank mapping, the metrics it exports.

Driven by the scripted source on an injected clock, with a real IncidentLog and
prometheus_client's own exposition and parser.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from prometheus_client import CollectorRegistry, generate_latest

from conftest import parse_metrics
from rankwatch.agent.gpu import GpuCollector, GpuConfig, GpuEvent, GpuMonitor, RankDevice
from rankwatch.agent.gpu.base import XidEvent
from rankwatch.agent.gpu.monitor import gpu_of
from rankwatch.agent.gpu.script import ScriptedSource, parse_script
from rankwatch.agent.durable.incidents import IncidentLog

SCRIPT = parse_script({
    "gpus": {"count": 2, "name": "NVIDIA H100 80GB HBM3", "nvlinks": 1},
    "events": [
        {"at": 1, "gpu": 0, "throttle": ["hw_thermal_slowdown"]},
        {"at": 2, "gpu": 0, "ecc": {"corrected": 5}},
        {"at": 3, "gpu": 1, "ecc": {"uncorrected": 1}},
        {"at": 4, "gpu": 1, "lost": True},
    ],
})
RANKS = [RankDevice(rank=8, device="cpu", local_rank=0, step=40),
         RankDevice(rank=9, device="cpu", local_rank=1, step=41)]


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def make(ranks=RANKS, sustain=2.0):
    clock = Clock()
    incidents = IncidentLog(None)
    config = GpuConfig(source="script", script=SCRIPT, throttle_sustain=timedelta(seconds=sustain))
    monitor = GpuMonitor("n0", config, incidents, lambda: list(ranks), clock=clock,
                         source=ScriptedSource(SCRIPT, clock))
    events: list[GpuEvent] = []
    monitor.listeners.append(events.append)
    return monitor, clock, incidents, events


def test_a_rank_uses_its_cuda_index_else_its_local_rank():
    assert gpu_of("cuda:3", 0) == 3
    assert gpu_of("cpu", 2) == 2
    assert gpu_of("NVIDIA H100 80GB HBM3", 1) == 1


def test_a_fatal_xid_is_an_incident_naming_gpu_ranks_and_action():
    monitor, clock, incidents, events = make()
    monitor.poll()
    monitor.on_xid(XidEvent(gpu=1, xid=79, at=clock.now))
    (inc,) = incidents.items
    assert (inc.kind, inc.node, inc.rank, inc.step) == ("gpu_fault", "n0", 9, 41)
    d = inc.detail
    assert (d["gpu"], d["xid"], d["action"], d["ranks"], d["reason"], d["fatal"]) == (1, 79, "reboot", [9], "xid", True)
    assert d["uuid"].startswith("GPU-")
    (ev,) = events
    assert (ev.kind, ev.gpu, ev.xid, ev.action, ev.ranks, ev.incident) == ("fatal", 1, 79, "reboot", (9,), inc)


def test_repeats_are_counted_but_reported_once_per_cooldown():
    monitor, clock, incidents, events = make()
    for _ in range(3):
        monitor.on_xid(XidEvent(gpu=0, xid=13, at=clock.now))
    monitor.on_xid(XidEvent(gpu=0, xid=63, at=clock.now))  # catalogue: ignore
    assert monitor.xid_counts() == {(0, 13): 3, (0, 63): 1}
    assert len(incidents.items) == 1 and len(events) == 1
    monitor.on_xid(XidEvent(gpu=0, xid=13, at=clock.now + 61))
    assert len(incidents.items) == 2


def test_risks_go_to_listeners_and_faults_become_incidents_as_the_script_runs():
    monitor, clock, incidents, events = make()
    for _ in range(12):
        monitor.poll()
        clock.now += 0.5
    got = [(e.kind, e.reason, e.gpu, e.ranks) for e in events]
    # ECC at 2 s; the slowdown from 1 s has lasted 2 s at 3 s; uncorrected ECC at 3 s; lost at 4 s.
    assert got == [("risk", "ecc_corrected", 0, (8,)), ("risk", "throttle", 0, (8,)),
                   ("fatal", "ecc_uncorrected", 1, (9,)), ("fatal", "gpu_lost", 1, (9,))]
    assert [i.detail["reason"] for i in incidents.items] == ["ecc_uncorrected", "gpu_lost"]
    assert [i.detail["action"] for i in incidents.items] == ["reset_gpu", "reboot"]
    assert events[1].detail["throttle"] == ["hw_thermal_slowdown"]


def test_an_unknown_xid_is_an_incident_but_not_fatal():
    monitor, clock, incidents, events = make()
    monitor.on_xid(XidEvent(gpu=0, xid=999, at=clock.now))
    (inc,) = incidents.items
    assert (inc.detail["action"], inc.detail["fatal"]) == ("unknown", False)
    assert events[0].kind == "risk"


def test_without_ranks_the_incident_names_none():
    monitor, clock, incidents, _ = make(ranks=[])
    monitor.on_xid(XidEvent(gpu=1, xid=48, at=clock.now))
    (inc,) = incidents.items
    assert inc.rank == -1 and inc.step == -1 and inc.detail["ranks"] == []


def test_a_failing_listener_does_not_stop_the_others():
    monitor, clock, _, events = make()
    monitor.listeners.insert(0, lambda ev: 1 / 0)
    monitor.on_xid(XidEvent(gpu=0, xid=94, at=clock.now))
    assert [e.xid for e in events] == [94]


def test_throttle_for_rank_lists_slowdowns_of_the_ranks_gpu():
    monitor, clock, _, _ = make()
    monitor.poll()
    def on(device, local_rank, uuid=""):
        return monitor.throttle_for_rank(RankDevice(rank=0, device=device, local_rank=local_rank,
                                                    step=0, uuid=uuid))
    assert on("cpu", 0) == []
    clock.now += 1.0
    monitor.poll()
    assert on("cpu", 0) == ["hw_thermal_slowdown"]
    assert on("cuda:0", 5) == ["hw_thermal_slowdown"]
    assert on("cpu", 1) == []
    assert on("cpu", 7) == []  # no such GPU
    assert on("cpu", 1, uuid=UUID0) == ["hw_thermal_slowdown"]  # the UUID wins over the index


# The scripted source's UUID of GPU 0 and 1, as CUDA spells it (without NVML's "GPU-").
UUID0, UUID1 = "5c41a7ed-0000-4000-8000-000000000000", "5C41A7ED-0000-4000-8000-000000000001"


def test_ranks_map_to_gpus_by_uuid_whatever_the_indices():
    # CUDA_VISIBLE_DEVICES=1,0: local rank 0 runs on GPU 1 and local rank 1 on GPU 0.
    ranks = [RankDevice(rank=8, device="NVIDIA H100 80GB HBM3", local_rank=0, step=40, uuid=UUID1),
             RankDevice(rank=9, device="NVIDIA H100 80GB HBM3", local_rank=1, step=41,
                        uuid="GPU-" + UUID0)]
    monitor, clock, incidents, events = make(ranks=ranks)
    monitor.poll()
    monitor.on_xid(XidEvent(gpu=1, xid=79, at=clock.now))
    (inc,) = incidents.items
    assert (inc.rank, inc.detail["gpu"], inc.detail["ranks"]) == (8, 1, [8])
    monitor.on_xid(XidEvent(gpu=0, xid=48, at=clock.now))
    assert incidents.items[1].detail["ranks"] == [9]
    # A UUID no GPU reports (another node's, or none read yet) falls back to the local rank.
    stray = RankDevice(rank=3, device="cpu", local_rank=1, step=0, uuid="GPU-ffffffff")
    assert monitor.gpu_of_rank(stray) == 1


def scrape(monitor) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuCollector(monitor))
    return parse_metrics(generate_latest(registry).decode())


def test_metrics_follow_the_contract():
    monitor, clock, _, _ = make()
    clock.now += 3.5
    monitor.poll()
    monitor.on_xid(XidEvent(gpu=1, xid=79, at=clock.now))
    m = scrape(monitor)
    g0 = {("node", "n0"), ("gpu", "0")}
    assert m[("rankwatch_gpu_info", frozenset(g0 | {("uuid", "GPU-5c41a7ed-0000-4000-8000-000000000000"),
                                                   ("name", "NVIDIA H100 80GB HBM3"), ("source", "script")}))] == 1
    assert m[("rankwatch_gpu_up", frozenset(g0))] == 1
    assert m[("rankwatch_gpu_temperature_celsius", frozenset(g0))] == 89.0
    assert m[("rankwatch_gpu_sm_clock_hertz", frozenset(g0))] == 1410e6
    assert m[("rankwatch_gpu_memory_total_bytes", frozenset(g0))] > 8e10
    assert m[("rankwatch_gpu_throttle", frozenset(g0 | {("reason", "hw_thermal_slowdown")}))] == 1
    assert m[("rankwatch_gpu_throttle", frozenset(g0 | {("reason", "sw_power_cap")}))] == 0
    assert m[("rankwatch_gpu_ecc_errors_total",
              frozenset(g0 | {("severity", "corrected"), ("counter", "volatile")}))] == 5
    assert m[("rankwatch_gpu_remapped_rows", frozenset(g0 | {("state", "pending")}))] == 0
    assert m[("rankwatch_gpu_pcie_replays_total", frozenset(g0))] == 0
    assert m[("rankwatch_gpu_nvlink_errors_total", frozenset(g0 | {("link", "0"), ("type", "crc_flit")}))] == 0
    g1 = {("node", "n0"), ("gpu", "1")}
    assert m[("rankwatch_gpu_xid_errors_total", frozenset(g1 | {("xid", "79"), ("action", "reboot")}))] == 1
    assert m[("rankwatch_gpu_ecc_errors_total",
              frozenset(g1 | {("severity", "uncorrected"), ("counter", "aggregate")}))] == 1
    clock.now += 1.0
    monitor.poll()
    m = scrape(monitor)
    assert m[("rankwatch_gpu_up", frozenset(g1))] == 0
    assert ("rankwatch_gpu_temperature_celsius", frozenset(g1)) not in m  # a lost GPU has no readings


def test_no_source_no_series():
    monitor = GpuMonitor("n0", GpuConfig(source="none"), IncidentLog(None), list)
    monitor.start()
    assert scrape(monitor) == {}
    monitor.stop()


def test_threads_start_and_stop_promptly():
    script = parse_script({"gpus": {"count": 2}, "events": [{"at": 0.1, "gpu": 1, "xid": 79}]})
    monitor = GpuMonitor("n0", GpuConfig(source="script", script=script, interval=timedelta(seconds=0.05)),
                         IncidentLog(None), lambda: list(RANKS))
    fired = threading.Event()
    monitor.listeners.append(lambda ev: fired.set())
    monitor.start()
    try:
        assert fired.wait(5), "the scripted XID did not arrive"
        assert monitor.readings()[1].index == 1
    finally:
        began = time.monotonic()
        monitor.stop()
    assert time.monotonic() - began < 1.5
    assert not any(t.name.startswith("rankwatch-gpu") for t in threading.enumerate())
