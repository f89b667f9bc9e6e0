"""The DCGM source against a real HTTP server on loopback serving a dcgm-exporter exposition.

The exposition (tests/data/dcgm-exporter-h100.prom) is written in dcgm-exporter's
format for a two-H100 node with Kubernetes pod labels, a MIG instance series and
one DCGM blank value.  This tests the scraper and parser honestly; it is not a
test against dcgm-exporter itself, which needs a GPU.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import parse_metrics, wait_for
from rankwatch.address import Address
from rankwatch.agent.gpu import GpuConfig
from rankwatch.agent.gpu.dcgm import DcgmSource
from rankwatch.status import fetch_status

FIXTURE = (Path(__file__).parent / "data" / "dcgm-exporter-h100.prom").read_text()


def with_value(text: str, metric: str, gpu: int, value: str) -> str:
    pattern = re.compile(rf'^({metric}{{gpu="{gpu}",[^}}]*}}) \S+$', re.M)
    out, n = pattern.subn(rf"\g<1> {value}", text)
    assert n == 1, (metric, gpu)
    return out


class Exporter:
    """A loopback HTTP server whose /metrics body the test sets."""

    def __init__(self) -> None:
        self.body, self.status = FIXTURE, 200
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                data = exporter.body.encode()
                self.send_response(exporter.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    e = Exporter()
    yield e
    e.close()


def test_readings_from_a_scrape(exporter):
    r0, r1 = DcgmSource(exporter.url).read()
    assert (r0.index, r0.uuid, r0.name) == (0, "GPU-3f0c8a52-9a1e-3d7c-5b8e-1c2d3e4f5a60", "NVIDIA H100 80GB HBM3")
    assert r0.utilization_ratio == pytest.approx(0.98)  # not the MIG instance's 12 %
    assert r0.sm_clock_hertz == 1980e6 and r1.temperature_celsius == 71.0
    assert r1.power_watts == pytest.approx(655.972) and r1.power_limit_watts == 700.0
    assert r1.memory_used_bytes == 69826 * 2**20
    assert r1.memory_total_bytes == (69826 + 11215 + 518) * 2**20
    assert r1.throttle == ("sw_power_cap", "hw_thermal_slowdown")
    assert r1.ecc == {("corrected", "volatile"): 12, ("uncorrected", "volatile"): 0,
                      ("corrected", "aggregate"): 40, ("uncorrected", "aggregate"): 1}
    assert r1.remapped_rows == {"correctable": 2, "uncorrectable": 1, "failed": 0}
    assert r1.pcie_replays == 3
    assert r1.nvlink_errors[("all", "crc_flit")] == 7 and r1.nvlink_errors[("all", "replay")] == 2


def test_a_changed_last_xid_is_an_event(exporter):
    source = DcgmSource(exporter.url)
    source.read()
    assert source.events(timedelta(milliseconds=10)) == []  # the first scrape is the baseline
    exporter.body = with_value(FIXTURE, "DCGM_FI_DEV_XID_ERRORS", 1, "79")
    source.read()
    (ev,) = source.events(timedelta(milliseconds=10))
    assert (ev.gpu, ev.xid) == (1, 79)
    source.read()
    assert source.events(timedelta(milliseconds=10)) == []  # unchanged: nothing new


def test_an_absent_or_broken_exporter_pauses_readings(exporter, caplog):
    source = DcgmSource(exporter.url, timeout=timedelta(seconds=1))
    exporter.status = 503
    with caplog.at_level(logging.WARNING):
        assert source.read() == []
        assert source.read() == []
    assert len([r for r in caplog.records if "dcgm-exporter" in r.getMessage()]) == 1
    exporter.status, exporter.body = 200, "DCGM_FI_DEV_GPU_TEMP{gpu=\"0\" 38\n"
    assert source.read() == []
    exporter.body = FIXTURE
    assert len(source.read()) == 2


def test_agent_with_dcgm_exports_and_raises_incidents(exporter, tmp_path):
    from rankwatch.agent.server import Agent, AgentConfig

    sock = Address(path=str(tmp_path / "agent.sock"))
    agent = Agent(AgentConfig(node_id="n0", listen=[sock], metrics_port=0, metrics_addr="127.0.0.1",
                              gpu=GpuConfig(dcgm_url=exporter.url, interval=timedelta(seconds=0.1))))
    agent.start()
    try:
        import urllib.request

        def metrics() -> dict:
            url = f"http://127.0.0.1:{agent.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as resp:
                return parse_metrics(resp.read().decode())

        m = metrics()
        g1 = {("node", "n0"), ("gpu", "1")}
        assert m[("rankwatch_gpu_temperature_celsius", frozenset(g1))] == 71.0
        assert m[("rankwatch_gpu_throttle", frozenset(g1 | {("reason", "hw_thermal_slowdown")}))] == 1
        assert any(k[0] == "rankwatch_gpu_info" and ("source", "dcgm") in k[1] for k in m)
        exporter.body = with_value(with_value(FIXTURE, "DCGM_FI_DEV_XID_ERRORS", 1, "79"),
                                   "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 1, "2")
        faults = wait_for(lambda: [i for i in fetch_status(sock)["incidents"] if i["kind"] == "gpu_fault"]
                          if len(fetch_status(sock)["incidents"]) >= 2 else None, 10, what="gpu_fault incidents")
        assert {(i["detail"]["reason"], i["detail"]["action"]) for i in faults} == {
            ("xid", "reboot"), ("ecc_uncorrected", "reset_gpu")}
        assert all(i["detail"]["gpu"] == 1 and i["detail"]["source"] == "dcgm" for i in faults)
        m = metrics()
        assert m[("rankwatch_gpu_xid_errors_total", frozenset(g1 | {("xid", "79"), ("action", "reboot")}))] == 1
    finally:
        agent.stop(timedelta(0))


def test_an_exporter_outage_hides_readings_but_not_what_changed_during_it(exporter):
    from rankwatch.agent.gpu import GpuCollector, GpuMonitor
    from rankwatch.agent.durable.incidents import IncidentLog

    incidents = IncidentLog(None)
    monitor = GpuMonitor("n0", GpuConfig(dcgm_url=exporter.url), incidents, list,
                         source=DcgmSource(exporter.url, timeout=timedelta(seconds=1)))
    monitor.poll()
    assert len(monitor.readings()) == 2
    exporter.status = 503
    monitor.poll()
    assert monitor.readings() == []  # no stale values on /metrics
    assert not any(family.samples for family in GpuCollector(monitor).collect())
    exporter.status = 200
    exporter.body = with_value(FIXTURE, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 0, "1")
    monitor.poll()
    assert [(i.detail["gpu"], i.detail["reason"]) for i in incidents.items] == [(0, "ecc_uncorrected")]
