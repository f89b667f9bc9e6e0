"""The NVML source: every GPU of the node through nvidia-ml-py (``import pynvml``).

Any NVML call may fail.  A field the GPU or driver does not offer
(``NOT_SUPPORTED``, ``NO_PERMISSION``, ``FUNCTION_NOT_FOUND``, ...) is left out
of the reading; any other error is logged once per GPU and field and the field
is left out too.  ``GPU_IS_LOST`` (fell off the bus) and ``RESET_REQUIRED``
make the whole reading ``up=False``.  Nothing here raises into the agent after
:class:`NvmlSource` is made.

XIDs come from an NVML event set: every GPU is registered for
``nvmlEventTypeXidCriticalError``, and :meth:`NvmlSource.events` waits on the set
with a timeout, so the thread that calls it can stop.
"""

from __future__ import annotations

import ctypes
import logging
import time
from datetime import timedelta
from types import ModuleType
from typing import Any

from rankwatch.agent.gpu.base import (
    NVLINK_ERROR_TYPES,
    RECOVERY_ACTIONS,
    GpuReading,
    XidEvent,
    decode_throttle,
)

__all__ = ["NvmlSource", "NvmlUnavailable"]

log = logging.getLogger(__name__)

# NVML return codes (nvml.h), so that a missing constant in an old binding cannot break us.
_NOT_SUPPORTED, _NO_PERMISSION, _NOT_FOUND, _INVALID_ARGUMENT = 3, 4, 6, 2
_TIMEOUT, _GPU_IS_LOST, _FUNCTION_NOT_FOUND, _RESET_REQUIRED = 10, 15, 13, 16
_ABSENT = frozenset({_NOT_SUPPORTED, _NO_PERMISSION, _NOT_FOUND, _INVALID_ARGUMENT, _FUNCTION_NOT_FOUND})
_LOST = frozenset({_GPU_IS_LOST, _RESET_REQUIRED})
_XID_EVENT = 0x8                                  # nvmlEventTypeXidCriticalError
_CLOCK_SM, _CLOCK_MEM, _TEMPERATURE_GPU = 1, 2, 0
_ECC_TYPES = {"corrected": 0, "uncorrected": 1}   # NVML_MEMORY_ERROR_TYPE_*
_ECC_COUNTERS = {"volatile": 0, "aggregate": 1}   # NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC
_NVLINK_COUNTERS = {"replay": 0, "recovery": 1, "crc_flit": 2, "crc_data": 3}  # NVML_NVLINK_ERROR_DL_*
_FI_RECOVERY_ACTION = 230                          # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or initialised (no driver, no GPU, no library)."""


class _Lost(Exception):
    def __init__(self, error: str) -> None:
        self.error = error


class _Gpu:
    def __init__(self, index: int, handle: Any, uuid: str, name: str) -> None:
        self.index, self.handle, self.uuid, self.name = index, handle, uuid, name
        self.links: list[int] | None = None  # active NVLinks, found on the first reading


class NvmlSource:
    """Args:
        nvml: the ``pynvml`` module; injectable so that unit tests can exercise
            the decoding and error handling without a GPU.

    Raises:
        NvmlUnavailable: NVML does not initialise here.
    """

    name = "nvml"

    def __init__(self, nvml: ModuleType | None = None) -> None:
        if nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc})") from None
            nvml = pynvml
        self._nvml: Any = nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError or a loader error
            raise NvmlUnavailable(f"NVML did not initialise: {exc}") from None
        try:
            self._gpus = [self._open(i) for i in range(nvml.nvmlDeviceGetCount())]
        except Exception as exc:  # noqa: BLE001
            nvml.nvmlShutdown()
            raise NvmlUnavailable(f"NVML could not list the GPUs: {exc}") from None
        self._event_set: Any = None
        self._events_failed = False
        self._warned: set[tuple[int, str, int | None]] = set()

    def _open(self, index: int) -> _Gpu:
        nv = self._nvml
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        except nv.NVMLError as exc:
            log.warning("GPU %d: no handle (%s); reported as lost", index, exc)
            return _Gpu(index, None, "", "")
        uuid = _text(self._field(index, "uuid", nv.nvmlDeviceGetUUID, handle, lost_ok=True) or "")
        name = _text(self._field(index, "name", nv.nvmlDeviceGetName, handle, lost_ok=True) or "")
        return _Gpu(index, handle, uuid, name)

    # -- readings ---------------------------------------------------------------
    def read(self) -> list[GpuReading]:
        return [self._read(g) for g in self._gpus]

    def _read(self, g: _Gpu) -> GpuReading:
        if g.handle is None:
            return GpuReading(g.index, g.uuid, g.name, up=False, error="no NVML handle")
        try:
            return GpuReading(g.index, g.uuid, g.name, **self._fields(g))
        except _Lost as lost:
            return GpuReading(g.index, g.uuid, g.name, up=False, error=lost.error)

    def _fields(self, g: _Gpu) -> dict[str, Any]:
        nv, h, f = self._nvml, g.handle, lambda name, fn, *a: self._field(g.index, name, fn, h, *a)
        power = f("power", nv.nvmlDeviceGetPowerUsage)
        limit = f("power_limit", nv.nvmlDeviceGetEnforcedPowerLimit)
        sm, mem = f("sm_clock", nv.nvmlDeviceGetClockInfo, _CLOCK_SM), f("mem_clock", nv.nvmlDeviceGetClockInfo, _CLOCK_MEM)
        util, meminfo = f("utilization", nv.nvmlDeviceGetUtilizationRates), f("memory", nv.nvmlDeviceGetMemoryInfo)
        mask = f("throttle", _throttle_reader(nv))
        return {
            "temperature_celsius": _num(f("temperature", nv.nvmlDeviceGetTemperature, _TEMPERATURE_GPU)),
            "power_watts": power / 1000.0 if power is not None else None,
            "power_limit_watts": limit / 1000.0 if limit is not None else None,
            "sm_clock_hertz": sm * 1e6 if sm is not None else None,
            "memory_clock_hertz": mem * 1e6 if mem is not None else None,
            "utilization_ratio": util.gpu / 100.0 if util is not None else None,
            "memory_utilization_ratio": util.memory / 100.0 if util is not None else None,
            "memory_used_bytes": float(meminfo.used) if meminfo is not None else None,
            "memory_total_bytes": float(meminfo.total) if meminfo is not None else None,
            "throttle": decode_throttle(int(mask)) if mask is not None else None,
            "ecc": self._ecc(g),
            "remapped_rows": self._remapped(g),
            "pcie_replays": _int(f("pcie_replays", nv.nvmlDeviceGetPcieReplayCounter)),
            "nvlink_errors": self._nvlink(g),
            "recovery_action": self._recovery_action(g),
        }

    def _recovery_action(self, g: _Gpu) -> str | None:
        """The driver's recovery action for the GPU (drivers from R550), or None."""
        values = self._field(g.index, "recovery_action", self._nvml.nvmlDeviceGetFieldValues,
                             g.handle, [_FI_RECOVERY_ACTION])
        if not values or values[0].nvmlReturn != 0:  # NVML_SUCCESS; older drivers say NOT_SUPPORTED
            return None
        code = int(values[0].value.uiVal)
        return RECOVERY_ACTIONS[code] if 0 <= code < len(RECOVERY_ACTIONS) else f"unknown_{code}"

    def _ecc(self, g: _Gpu) -> dict[tuple[str, str], int]:
        out = {}
        for sev, etype in _ECC_TYPES.items():
            for counter, ctype in _ECC_COUNTERS.items():
                n = self._field(g.index, f"ecc_{sev}_{counter}", self._nvml.nvmlDeviceGetTotalEccErrors,
                                g.handle, etype, ctype)
                if n is not None:
                    out[(sev, counter)] = int(n)
        return out

    def _remapped(self, g: _Gpu) -> dict[str, int]:
        rows = self._field(g.index, "remapped_rows", self._nvml.nvmlDeviceGetRemappedRows, g.handle)
        if rows is None:
            return {}
        corr, unc, pending, failed = rows
        return {"correctable": int(corr), "uncorrectable": int(unc),
                "pending": 1 if pending else 0, "failed": 1 if failed else 0}

    def _nvlink(self, g: _Gpu) -> dict[tuple[str, str], int]:
        nv = self._nvml
        if g.links is None:
            g.links = [link for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))
                       if self._field(g.index, "nvlink_state", nv.nvmlDeviceGetNvLinkState, g.handle, link,
                                      quiet=True)]
        out = {}
        for link in g.links:
            for kind in NVLINK_ERROR_TYPES:
                n = self._field(g.index, f"nvlink_{kind}", nv.nvmlDeviceGetNvLinkErrorCounter,
                                g.handle, link, _NVLINK_COUNTERS[kind])
                if n is not None:
                    out[(str(link), kind)] = int(n)
        return out

    def _field(self, index: int, name: str, fn: Any, *args: Any, lost_ok: bool = False,
               quiet: bool = False) -> Any:
        """One NVML call: its value, or None if the field is not available.

        Raises:
            _Lost: the GPU fell off the bus or needs a reset (unless ``lost_ok``).
        """
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in _LOST and not lost_ok:
                raise _Lost(str(exc)) from None
            if code not in _ABSENT and not quiet and (index, name, code) not in self._warned:
                self._warned.add((index, name, code))
                log.warning("GPU %d: NVML %s failed (%s); left out", index, name, exc)
            return None

    # -- XID events -------------------------------------------------------------
    def events(self, timeout: timedelta) -> list[XidEvent]:
        nv = self._nvml
        if self._event_set is None and not self._start_events():
            time.sleep(timeout.total_seconds())
            return []
        try:
            data = nv.nvmlEventSetWait(self._event_set, int(timeout.total_seconds() * 1000))
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) != _TIMEOUT:
                # A lost GPU answers here too; the poller reports it.  Don't spin.
                log.debug("NVML event wait: %s", exc)
                time.sleep(timeout.total_seconds())
            return []
        if not data.eventType & _XID_EVENT:
            return []
        return [XidEvent(self._index_of(data.device), int(data.eventData), time.time())]

    def _start_events(self) -> bool:
        if self._events_failed:
            return False
        nv = self._nvml
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            log.warning("NVML event set unavailable (%s): no XID events", exc)
            self._events_failed = True
            return False
        registered = 0
        for g in self._gpus:
            if g.handle is None:
                continue
            try:
                nv.nvmlDeviceRegisterEvents(g.handle, _XID_EVENT, self._event_set)
                registered += 1
            except nv.NVMLError as exc:
                log.warning("GPU %d: XID events unavailable (%s)", g.index, exc)
        log.info("XID events: %d of %d GPUs registered", registered, len(self._gpus))
        return True

    def _index_of(self, device: Any) -> int:
        try:
            return int(self._nvml.nvmlDeviceGetIndex(device))
        except self._nvml.NVMLError:
            addr = _address(device)
            return next((g.index for g in self._gpus if addr is not None and _address(g.handle) == addr), -1)

    def close(self) -> None:
        nv = self._nvml
        try:
            if self._event_set is not None:
                nv.nvmlEventSetFree(self._event_set)
                self._event_set = None
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            log.warning("NVML shutdown: %s", exc)


def _throttle_reader(nv: ModuleType) -> Any:
    # Renamed "clock event reasons" in newer drivers; the old name still works on old ones.
    return getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _num(value: Any) -> float | None:
    return float(value) if value is not None else None


def _int(value: Any) -> int | None:
    return int(value) if value is not None else None


def _address(handle: Any) -> int | None:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None
