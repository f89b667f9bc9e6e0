"""NVML field decoding and error handling, against a stand-in ``pynvml`` module.

This is NOT NVML coverage: there is no GPU here.  The stand-in answers the
calls NvmlSource makes the way NVML documents them (units, error codes), so
these tests pin the decoding (mW -> W, MHz -> Hz, percent -> ratio, throttle
bits -> names) and the error policy (unsupported fields left out, a lost GPU
reported as lost, nothing raised).  benchmarks/gpu_probe.py is the check on a
real GPU.
"""

from __future__ import annotations

import ctypes
import logging
import types
from types import SimpleNamespace
from datetime import timedelta

import pytest

from conftest import has_gpu
from rankwatch.agent.gpu.settings import GpuConfig, open_source
from rankwatch.agent.gpu.nvml import NvmlSource, NvmlUnavailable

NOT_SUPPORTED, NO_PERMISSION, TIMEOUT, GPU_IS_LOST, UNKNOWN = 3, 4, 10, 15, 999
FUNCTION_NOT_FOUND = 13


class FakeNvml(types.ModuleType):
    """Two GPUs; per-GPU overrides make a call raise an NVML error code."""

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    NVML_NVLINK_MAX_LINKS = 4

    def __init__(self, gpus: int = 2) -> None:
        super().__init__("pynvml")
        self.handles = [ctypes.c_void_p(0x1000 + i) for i in range(gpus)]
        self.fail: dict[tuple[int, str], int] = {}
        self.events: list[tuple[int, int]] = []   # (gpu, xid) waiting in the event set
        self.calls: list[str] = []
        self.init_error: int | None = None
        # GPU -> (nvmlReturn of the recovery-action field, its value): the field's own
        # return code, as NVML reports it inside the value struct.
        self.recovery: dict[int, tuple[int, int]] = {}

    def _gpu(self, handle) -> int:
        return next(i for i, h in enumerate(self.handles) if h.value == handle.value)

    def _call(self, name: str, handle, value):
        self.calls.append(name)
        code = self.fail.get((self._gpu(handle), name)) or self.fail.get((-1, name))
        if code is not None:
            raise self.NVMLError(code)
        return value

    def nvmlInit(self):
        if self.init_error is not None:
            raise self.NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return len(self.handles)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.handles[i]

    def nvmlDeviceGetIndex(self, h):
        return self._gpu(h)

    def nvmlDeviceGetUUID(self, h):
        return self._call("uuid", h, f"GPU-0000000{self._gpu(h)}")

    def nvmlDeviceGetName(self, h):
        return self._call("name", h, b"NVIDIA H100 80GB HBM3")

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == 0
        return self._call("temperature", h, 64)

    def nvmlDeviceGetPowerUsage(self, h):
        return self._call("power", h, 412345)  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._call("power_limit", h, 700000)

    def nvmlDeviceGetClockInfo(self, h, kind):
        return self._call("clock", h, {1: 1755, 2: 2619}[kind])  # MHz

    def nvmlDeviceGetUtilizationRates(self, h):
        return self._call("utilization", h, types.SimpleNamespace(gpu=98, memory=37))

    def nvmlDeviceGetMemoryInfo(self, h):
        return self._call("memory", h, types.SimpleNamespace(total=85520809984, free=1 << 30,
                                                             used=85520809984 - (1 << 30)))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._call("throttle", h, 0x4 | 0x40)

    def nvmlDeviceGetTotalEccErrors(self, h, etype, counter):
        return self._call("ecc", h, {(0, 0): 3, (1, 0): 0, (0, 1): 40, (1, 1): 1}[(etype, counter)])

    def nvmlDeviceGetRemappedRows(self, h):
        return self._call("remapped_rows", h, (2, 1, 1, 0))

    def nvmlDeviceGetPcieReplayCounter(self, h):
        return self._call("pcie", h, 5)

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= 2:
            raise self.NVMLError(NOT_SUPPORTED)
        return self._call("nvlink_state", h, 1)

    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        return self._call("nvlink", h, 10 * link + counter)

    def nvmlDeviceGetFieldValues(self, h, field_ids):
        assert field_ids == [230]  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
        ret, value = self.recovery.get(self._gpu(h), (0, 0))
        return self._call("field_values", h, [SimpleNamespace(fieldId=230, nvmlReturn=ret,
                                                              value=SimpleNamespace(uiVal=value))])

    def nvmlEventSetCreate(self):
        return ctypes.c_void_p(0xE000)

    def nvmlDeviceRegisterEvents(self, h, types_, event_set):
        assert types_ == 0x8
        self._call("register", h, None)

    def nvmlEventSetWait(self, event_set, timeout_ms):
        if not self.events:
            raise self.NVMLError(TIMEOUT)
        gpu, xid = self.events.pop(0)
        return types.SimpleNamespace(device=self.handles[gpu], eventType=0x8, eventData=xid)

    def nvmlEventSetFree(self, event_set):
        self.calls.append("event_set_free")


@pytest.fixture
def nv() -> FakeNvml:
    return FakeNvml()


def test_fields_are_decoded_to_base_units(nv):
    r = NvmlSource(nv).read()[0]
    assert (r.index, r.uuid, r.name, r.up) == (0, "GPU-00000000", "NVIDIA H100 80GB HBM3", True)
    assert r.temperature_celsius == 64.0
    assert r.power_watts == pytest.approx(412.345) and r.power_limit_watts == 700.0
    assert r.sm_clock_hertz == 1755e6 and r.memory_clock_hertz == 2619e6
    assert r.utilization_ratio == pytest.approx(0.98) and r.memory_utilization_ratio == pytest.approx(0.37)
    assert r.memory_total_bytes == 85520809984.0
    assert r.throttle == ("sw_power_cap", "hw_thermal_slowdown")
    assert r.ecc == {("corrected", "volatile"): 3, ("uncorrected", "volatile"): 0,
                     ("corrected", "aggregate"): 40, ("uncorrected", "aggregate"): 1}
    assert r.remapped_rows == {"correctable": 2, "uncorrectable": 1, "pending": 1, "failed": 0}
    assert r.pcie_replays == 5
    # Links 0 and 1 are active; counters replay=0, recovery=1, crc_flit=2, crc_data=3.
    assert r.nvlink_errors[("1", "crc_flit")] == 12 and r.nvlink_errors[("0", "replay")] == 0
    assert {link for link, _ in r.nvlink_errors} == {"0", "1"}
    assert r.recovery_action == "none"


def test_the_drivers_recovery_action_is_read_and_absent_where_unsupported(nv):
    nv.recovery[0] = (0, 2)              # NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    nv.recovery[1] = (NOT_SUPPORTED, 0)  # a pre-R550 driver answers inside the struct
    r0, r1 = NvmlSource(nv).read()
    assert (r0.recovery_action, r1.recovery_action) == ("node_reboot", None)
    nv.fail[(-1, "field_values")] = FUNCTION_NOT_FOUND  # an older library: no such call
    assert [r.recovery_action for r in NvmlSource(nv).read()] == [None, None]


def test_unsupported_fields_are_absent_and_quiet(nv, caplog):
    nv.fail[(0, "remapped_rows")] = NOT_SUPPORTED
    nv.fail[(0, "ecc")] = NOT_SUPPORTED
    nv.fail[(0, "power_limit")] = NO_PERMISSION
    with caplog.at_level(logging.WARNING):
        r0, r1 = NvmlSource(nv).read()
    assert r0.up and r0.remapped_rows == {} and r0.ecc == {} and r0.power_limit_watts is None
    assert r0.power_watts is not None
    assert r1.remapped_rows and r1.ecc  # the other GPU is unaffected
    assert not caplog.records


def test_other_errors_leave_the_field_out_and_are_logged_once(nv, caplog):
    nv.fail[(1, "temperature")] = UNKNOWN
    source = NvmlSource(nv)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            r = source.read()[1]
            assert r.up and r.temperature_celsius is None
    assert len([rec for rec in caplog.records if "temperature" in rec.getMessage()]) == 1


def test_a_gpu_that_fell_off_the_bus_is_reported_lost(nv):
    source = NvmlSource(nv)
    nv.fail[(1, "power")] = GPU_IS_LOST
    r0, r1 = source.read()
    assert r0.up
    assert not r1.up and r1.uuid == "GPU-00000001" and "15" in r1.error
    assert r1.temperature_celsius is None
    del nv.fail[(1, "power")]
    assert source.read()[1].up  # answers again after a reset


def test_xid_events_come_from_the_event_set_with_a_timeout(nv):
    source = NvmlSource(nv)
    assert source.events(timedelta(milliseconds=1)) == []  # NVML_ERROR_TIMEOUT: nothing, no error
    assert nv.calls.count("register") == 2
    nv.events.append((1, 79))
    (ev,) = source.events(timedelta(milliseconds=1))
    assert (ev.gpu, ev.xid) == (1, 79)
    source.close()
    assert nv.calls[-2:] == ["event_set_free", "shutdown"]


def test_a_gpu_without_xid_events_does_not_stop_the_others(nv):
    nv.fail[(0, "register")] = NOT_SUPPORTED
    source = NvmlSource(nv)
    nv.events.append((1, 48))
    (ev,) = source.events(timedelta(milliseconds=1))
    assert (ev.gpu, ev.xid) == (1, 48)


def test_no_nvml_is_an_error_only_when_asked_for(nv, monkeypatch, caplog):
    nv.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(NvmlUnavailable, match="did not initialise"):
        NvmlSource(nv)
    monkeypatch.setattr("rankwatch.agent.gpu.settings.NvmlSource", lambda: NvmlSource(nv))
    with caplog.at_level(logging.INFO):
        assert open_source(GpuConfig(source="auto")) is None
    assert any("GPU source: none" in r.getMessage() for r in caplog.records)
    with pytest.raises(NvmlUnavailable):
        open_source(GpuConfig(source="nvml"))


@pytest.mark.skipif(has_gpu(), reason="NVML works on this machine; the GPU case is the next test")
def test_auto_goes_on_without_the_real_nvml(caplog):
    """The real pynvml, on a machine without a driver: auto logs and goes on."""
    with caplog.at_level(logging.INFO):
        assert open_source(GpuConfig(source="auto")) is None
    assert any("GPU source: none" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
def test_auto_uses_the_real_nvml_on_a_gpu():
    source = open_source(GpuConfig(source="auto"))
    try:
        assert isinstance(source, NvmlSource)
    finally:
        source.close()
