"""The scripted fault source: its file format, its errors, and its timeline (injected clock)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from rankwatch.agent.gpu import DEMO_SCRIPT
from rankwatch.agent.gpu.settings import GpuConfig, parse_gpu_source
from rankwatch.agent.gpu.script import ScriptedSource, ScriptError, load_script, parse_script

SCRIPT = {
    "gpus": {"count": 2, "name": "NVIDIA H100 80GB HBM3", "nvlinks": 2},
    "events": [
        {"at": 3.0, "gpu": 1, "xid": 79},
        {"at": 1.0, "gpu": 0, "throttle": ["hw_thermal_slowdown"]},
        {"at": 2, "gpu": 0, "ecc": {"corrected": 5}},
        {"at": 4, "gpu": 1, "lost": True},
        {"at": 2, "gpu": 0, "remap": {"pending": 1}, "nvlink": {"1": {"crc_flit": 3}}, "pcie_replays": 2},
    ],
}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_state_follows_the_script():
    clock = Clock()
    src = ScriptedSource(parse_script(SCRIPT), clock)
    r0, r1 = src.read()
    assert r0.throttle == () and r0.ecc[("corrected", "volatile")] == 0 and r1.up
    assert r0.temperature_celsius == 47.0 and r0.sm_clock_hertz == 1980e6
    clock.now += 1.0
    r0 = src.read()[0]
    assert r0.throttle == ("hw_thermal_slowdown",)
    assert r0.temperature_celsius == 89.0 and r0.sm_clock_hertz == 1410e6  # the look of a hot GPU
    clock.now += 1.0
    r0 = src.read()[0]
    assert r0.ecc[("corrected", "volatile")] == 5 and r0.ecc[("corrected", "aggregate")] == 5
    assert r0.remapped_rows["pending"] == 1 and r0.pcie_replays == 2
    assert r0.nvlink_errors[("1", "crc_flit")] == 3 and r0.nvlink_errors[("0", "crc_flit")] == 0
    clock.now += 2.0
    r1 = src.read()[1]
    assert not r1.up and r1.error


def test_xids_arrive_at_their_time_and_the_wait_is_bounded():
    src = ScriptedSource(parse_script({"gpus": {"count": 2}, "events": [{"at": 0.05, "gpu": 1, "xid": 79}]}))
    assert src.events(timedelta(milliseconds=1)) == []  # not due yet: returns within the timeout
    (ev,) = src.events(timedelta(seconds=2))
    assert (ev.gpu, ev.xid) == (1, 79)
    assert src.events(timedelta(milliseconds=1)) == []


def test_close_ends_a_wait():
    src = ScriptedSource(parse_script({"gpus": {"count": 1}, "events": [{"at": 60, "gpu": 0, "xid": 13}]}))
    src.close()
    assert src.events(timedelta(seconds=30)) == []


@pytest.mark.parametrize("script,message", [
    ([], "top level"),
    ({"gpus": {"count": 0}}, "gpus.count: expected an integer from 1 to 64"),
    ({"gpus": {"count": 2, "colour": "red"}}, "gpus"),
    ({"gpus": {"count": 2}, "events": [{"at": 1, "gpu": 2, "xid": 79}]}, "events[0]: 'gpu'"),
    ({"gpus": {"count": 2}, "events": [{"at": -1, "gpu": 0, "xid": 79}]}, "events[0]: 'at'"),
    ({"gpus": {"count": 2}, "events": [{"at": 1, "gpu": 0, "xdi": 79}]}, "unknown key 'xdi'"),
    ({"gpus": {"count": 2}, "events": [{"at": 1, "gpu": 0}]}, "needs at least one of"),
    ({"gpus": {"count": 2}, "events": [{"at": 1, "gpu": 0, "throttle": ["too_hot"]}]}, "'throttle'"),
    ({"gpus": {"count": 2}, "events": [{"at": 1, "gpu": 0, "ecc": {"single": 1}}]}, "'ecc'"),
    ({"gpus": {"count": 2}, "events": [{"at": 1, "gpu": 0, "nvlink": {"0": {"crc_flit": 1}}}]}, "nvlinks"),
    ({"gpus": {"count": 2}, "events": [{"at": 1, "gpu": 0, "lost": "yes"}]}, "'lost'"),
    ({"gpus": {"count": 2}, "events": [{"at": 1, "gpu": 0, "xid": True}]}, "'xid'"),
])
def test_bad_scripts_get_errors_that_name_the_entry(script, message):
    with pytest.raises(ScriptError) as info:
        parse_script(script, "faults.json")
    assert "faults.json" in str(info.value) and message in str(info.value)


def test_files_and_the_source_flag(tmp_path):
    path = tmp_path / "faults.json"
    path.write_text(json.dumps(SCRIPT))
    kind, script = parse_gpu_source(f"script:{path}")
    assert kind == "script" and script.gpu_count == 2 and len(script.events) == 5
    assert [e.at for e in script.events] == sorted(e.at for e in script.events)
    assert parse_gpu_source("auto") == ("auto", None)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ScriptError, match="not JSON"):
        parse_gpu_source(f"script:{tmp_path / 'bad.json'}")
    with pytest.raises(ScriptError, match="missing.json"):
        parse_gpu_source(f"script:{tmp_path / 'missing.json'}")
    with pytest.raises(ValueError, match="expected auto, nvml, none or script:PATH"):
        parse_gpu_source("nvml2")


def test_config_validation():
    assert GpuConfig(source="script", script=load_script(DEMO_SCRIPT)).poll_interval == timedelta(seconds=0.5)
    assert GpuConfig().poll_interval == timedelta(seconds=5)
    assert GpuConfig(dcgm_url="http://127.0.0.1:9400/metrics").source == "dcgm"
    with pytest.raises(ValueError, match="exclude each other"):
        GpuConfig(source="nvml", dcgm_url="http://127.0.0.1:9400/metrics")
    with pytest.raises(ValueError, match="dcgm_url"):
        GpuConfig(dcgm_url="127.0.0.1:9400")
    with pytest.raises(ValueError, match="needs a script"):
        GpuConfig(source="script")


def test_the_shipped_demo_script_is_valid():
    script = load_script(DEMO_SCRIPT)
    kinds = {k for e in script.events for k in e.changes}
    assert {"throttle", "ecc"} <= kinds


def test_fire_raises_an_xid_now_ahead_of_the_timeline():
    src = ScriptedSource(parse_script({"gpus": {"count": 2}, "events": [{"at": 60, "gpu": 0, "xid": 13}]}))
    src.fire(1, 79)
    (ev,) = src.events(timedelta(seconds=1))
    assert (ev.gpu, ev.xid) == (1, 79)
    assert src.events(timedelta(milliseconds=50)) == []  # the scripted one is still 60 s away
    with pytest.raises(ScriptError, match="no GPU 2"):
        src.fire(2, 79)


def test_change_applies_a_state_change_now_ahead_of_the_timeline():
    src = ScriptedSource(parse_script({"gpus": {"count": 2}, "events": [{"at": 60, "gpu": 0, "ecc": {"corrected": 9}}]}))
    src.change(1, throttle=["hw_thermal_slowdown"], ecc={"corrected": 6})
    r0, r1 = src.read()
    assert r1.throttle == ("hw_thermal_slowdown",) and r1.ecc[("corrected", "volatile")] == 6
    assert r0.ecc[("corrected", "volatile")] == 0  # the scripted one is still 60 s away
    with pytest.raises(ScriptError, match="'throttle'"):
        src.change(0, throttle=["too_hot"])
    with pytest.raises(ScriptError, match="'gpu'"):
        src.change(2, ecc={"corrected": 1})
    with pytest.raises(ScriptError, match="fire"):
        src.change(0, xid=79)
    assert src.read()[0].throttle == ()  # a refused change changed nothing
