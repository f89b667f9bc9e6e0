"""Deciding what a GPU reading or an XID means, in pure functions with injected time.

A *fatal* finding is a fault the job cannot ride out on that GPU: an XID whose
catalogue action is reboot, reset_gpu or restart_app, a rise of uncorrected ECC
errors, a failed row remap, a lost GPU, a recovery action the driver asks for.  A *risk* finding is an early sign:
corrected ECC errors rising, a row remap pending (the GPU needs a reset at its
next chance), a thermal or hardware slowdown that lasts.  Fatal findings become
``gpu_fault`` incidents; risks go to the agent's listeners only.  Unknown XIDs
are the exception described in :mod:`rankwatch.agent.gpu.xid`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from rankwatch.agent.gpu.base import GpuReading, XidEvent
from rankwatch.agent.gpu.xid import FATAL_ACTIONS, action_for, describe

__all__ = ["Finding", "ThrottleTracker", "compare", "xid_finding"]

# Reasons that mean the GPU protects itself (heat, power delivery, an external
# slowdown signal); sw_power_cap is normal at full load and sync_boost follows others.
_HEALTH_THROTTLE = ("hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                    "hw_power_brake_slowdown")
# The driver's recovery action (GpuReading.recovery_action) -> what the job must do.
# Every action but "none" means the GPU cannot serve the job as it is: draining
# peer-to-peer traffic or an IMEX domain stops the job's NCCL traffic too.
_RECOVERY_FATAL_ACTION = {
    "gpu_reset": "reset_gpu", "bus_reset": "reset_gpu", "drain_and_reset": "reset_gpu",
    "node_reboot": "reboot", "system_reboot": "reboot",
    "drain_p2p": "restart_app", "recover_imex_domain": "restart_app",
}


@dataclass(frozen=True)
class Finding:
    gpu: int
    kind: str
    """"fatal" or "risk"."""
    reason: str
    """xid, gpu_lost, ecc_uncorrected, row_remap_failed, recovery_action, ecc_corrected,
    row_remap_pending, throttle."""
    action: str
    """What the GPU needs: reboot, reset_gpu, restart_app, or none for a risk; unknown for an unknown XID."""
    incident: bool
    xid: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def xid_finding(event: XidEvent) -> Finding | None:
    """A finding for an XID, or None for one the catalogue says to ignore."""
    action = action_for(event.xid)
    if action == "ignore":
        return None
    detail = {"description": describe(event.xid)}
    if action in FATAL_ACTIONS:
        return Finding(event.gpu, "fatal", "xid", action, True, event.xid, detail)
    return Finding(event.gpu, "risk", "xid", action, True, event.xid, detail)


def compare(prev: GpuReading | None, cur: GpuReading) -> list[Finding]:
    """Findings from one GPU's reading against its previous one (None on the first).

    Counts that went down were reset (driver reload, GPU reset) and say nothing.
    On the first reading, counts are history, but a lost GPU, a failed remap or
    a pending one are states, and are reported.
    """
    gpu = cur.index
    if not cur.up:
        if prev is None or prev.up:
            return [Finding(gpu, "fatal", "gpu_lost", "reboot", True,
                            detail={"error": cur.error or "the GPU does not answer"})]
        return []
    if prev is not None and not prev.up:
        prev = None  # back after a reset: start counting afresh
    out = []
    failed, pending = cur.remapped_rows.get("failed", 0), cur.remapped_rows.get("pending", 0)
    if failed and (prev is None or not prev.remapped_rows.get("failed", 0)):
        out.append(Finding(gpu, "fatal", "row_remap_failed", "reset_gpu", True,
                           detail={"note": "row remapping failed: the GPU needs service"}))
    wanted = cur.recovery_action
    if wanted is not None and wanted != "none" and (prev is None or prev.recovery_action != wanted):
        out.append(Finding(gpu, "fatal", "recovery_action", _RECOVERY_FATAL_ACTION.get(wanted, "reboot"),
                           True, detail={"recovery_action": wanted}))
    if pending and (prev is None or not prev.remapped_rows.get("pending", 0)):
        out.append(Finding(gpu, "risk", "row_remap_pending", "reset_gpu", False,
                           detail={"note": "a row remap waits for the next GPU reset"}))
    if prev is None:
        return out
    rise = _rise(prev.ecc_count("uncorrected"), cur.ecc_count("uncorrected"))
    if rise:
        out.append(Finding(gpu, "fatal", "ecc_uncorrected", "reset_gpu", True,
                           detail={"new_errors": rise, "total": cur.ecc_count("uncorrected")}))
    rise = _rise(prev.ecc_count("corrected"), cur.ecc_count("corrected"))
    if rise:
        out.append(Finding(gpu, "risk", "ecc_corrected", "none", False,
                           detail={"new_errors": rise, "total": cur.ecc_count("corrected")}))
    return out


def _rise(before: int | None, after: int | None) -> int:
    if before is None or after is None or after <= before:
        return 0
    return after - before


class ThrottleTracker:
    """Flags a health slowdown once it has lasted ``sustain``; re-arms when it clears.

    Args:
        sustain: how long a thermal or hardware slowdown must last to be a risk.
    """

    def __init__(self, sustain: timedelta) -> None:
        self._sustain = sustain.total_seconds()
        self._since: dict[int, float] = {}
        self._flagged: set[int] = set()

    def update(self, reading: GpuReading, now: float) -> Finding | None:
        gpu = reading.index
        active = [r for r in _HEALTH_THROTTLE if r in (reading.throttle or ())]
        if not reading.up or not active:
            self._since.pop(gpu, None)
            self._flagged.discard(gpu)
            return None
        since = self._since.setdefault(gpu, now)
        if gpu in self._flagged or now - since < self._sustain:
            return None
        self._flagged.add(gpu)
        return Finding(gpu, "risk", "throttle", "none", False,
                       detail={"throttle": active, "for_seconds": round(now - since, 3)})
