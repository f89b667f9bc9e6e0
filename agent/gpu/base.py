"""What every GPU source delivers: readings, XID events, and the ``GpuSource`` protocol.

NVML, a dcgm-exporter scrape and the scripted fault source all implement
:class:`GpuSource`, so that everything downstream (metrics, fault detection,
incidents, the rank mapping) is one code path whatever the source.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

__all__ = [
    "ECC_COUNTERS", "ECC_SEVERITIES", "NVLINK_ERROR_TYPES", "RECOVERY_ACTIONS", "REMAP_STATES",
    "SLOWDOWN_REASONS",
    "THROTTLE_REASONS", "GpuReading", "GpuSource", "XidEvent", "decode_throttle",
]

# NVML's clock event (throttle) reason bits, in bit order: bit i is THROTTLE_REASONS[i].
THROTTLE_REASONS: tuple[str, ...] = (
    "gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
    "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown",
    "display_clock_setting",
)
# The reasons that hold clocks below what the work asks for.  gpu_idle (no work),
# applications_clocks_setting and display_clock_setting (configuration) are left out.
SLOWDOWN_REASONS: frozenset[str] = frozenset({
    "sw_power_cap", "hw_slowdown", "sync_boost", "sw_thermal_slowdown", "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
})
ECC_SEVERITIES = ("corrected", "uncorrected")
ECC_COUNTERS = ("volatile", "aggregate")
REMAP_STATES = ("correctable", "uncorrectable", "pending", "failed")
NVLINK_ERROR_TYPES = ("crc_flit", "crc_data", "replay", "recovery")
# What the driver says the GPU needs (NVML's nvmlDeviceGpuRecoveryAction_t, by value;
# R550+ drivers, read through the field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION).
RECOVERY_ACTIONS: tuple[str, ...] = (
    "none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset", "recover_imex_domain",
    "bus_reset", "system_reboot",
)


def decode_throttle(mask: int) -> tuple[str, ...]:
    """Names of the reasons set in an NVML clock-event-reasons bit mask.

    Bits beyond the known reasons (newer drivers add some) are ignored.
    """
    return tuple(name for bit, name in enumerate(THROTTLE_REASONS) if mask >> bit & 1)


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one moment.  ``None`` or a missing key means the field is not available.

    Counters (``ecc``, ``pcie_replays``, ``nvlink_errors``) are the device's own
    running totals.
    """

    index: int
    uuid: str
    name: str
    up: bool = True
    """False once the GPU stopped answering (fell off the bus, or needs a reset)."""
    error: str | None = None
    """Why the GPU is not up, as the source reported it."""
    temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    throttle: tuple[str, ...] | None = None
    """Active reasons from THROTTLE_REASONS; None if the source cannot tell."""
    ecc: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(severity, counter) -> errors, severity in ECC_SEVERITIES, counter in ECC_COUNTERS."""
    remapped_rows: Mapping[str, int] = field(default_factory=dict)
    """state -> value: rows remapped (correctable, uncorrectable) and flags (pending, failed)."""
    pcie_replays: int | None = None
    nvlink_errors: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(link, type) -> errors, type in NVLINK_ERROR_TYPES."""
    recovery_action: str | None = None
    """What the driver says the GPU needs, from RECOVERY_ACTIONS; None if it cannot tell."""

    def ecc_count(self, severity: str) -> int | None:
        """The volatile count of a severity, else the aggregate one, else None."""
        for counter in ECC_COUNTERS:
            if (severity, counter) in self.ecc:
                return self.ecc[(severity, counter)]
        return None


@dataclass(frozen=True)
class XidEvent:
    gpu: int
    xid: int
    at: float
    """Unix time the source saw it."""


class GpuSource(Protocol):
    """A device (or something that looks like one) the GPU monitor reads.

    ``read`` and ``events`` are called from two different threads.
    """

    name: str
    """The ``source`` label: nvml, dcgm or script."""

    def read(self) -> list[GpuReading]:
        """Read every GPU now.  A GPU that does not answer comes back with ``up=False``."""
        ...

    def events(self, timeout: timedelta) -> list[XidEvent]:
        """XID events, waiting at most ``timeout`` for one; [] if none came."""
        ...

    def close(self) -> None:
        """Release the device; called once both threads have stopped."""
        ...
