"""The GPU monitor: reads a source, keeps the latest readings, turns faults into incidents.

Two threads: one reads every GPU each interval and compares with the previous
reading; one waits for XID events.  Findings (see :mod:`.faults`) name the ranks
that use the GPU.  Fatal ones become ``gpu_fault`` incidents, and every finding
goes to the listeners as a :class:`GpuEvent`.

Which ranks use a GPU: a CUDA rank reports its GPU's UUID, and the rank uses
the GPU whose reading carries that UUID, whatever ``CUDA_VISIBLE_DEVICES`` and
``CUDA_DEVICE_ORDER`` made of the indices.  Without a UUID, or before the GPU's
first reading, the rank's ``device`` and ``local_rank`` decide: with ``cuda:N`` it
uses GPU N; otherwise (a device name such as "NVIDIA H100 80GB HBM3", or "cpu" in
a CPU job driven by a scripted source) GPU ``local_rank``, the torchrun convention,
taken as the node's NVML index.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from rankwatch.agent.gpu.base import SLOWDOWN_REASONS, GpuReading, GpuSource, XidEvent
from rankwatch.agent.gpu.settings import GpuConfig, open_source
from rankwatch.agent.gpu.faults import Finding, ThrottleTracker, compare, xid_finding
from rankwatch.agent.gpu.xid import describe
from rankwatch.agent.durable.incidents import Incident, IncidentLog

__all__ = ["GpuEvent", "GpuMonitor", "RankDevice", "gpu_of"]

log = logging.getLogger(__name__)

_CUDA = re.compile(r"cuda:(\d+)")
_EVENT_WAIT = timedelta(milliseconds=500)


@dataclass(frozen=True)
class RankDevice:
    """What the monitor needs to know of a rank on this node."""

    rank: int
    device: str
    local_rank: int
    step: int
    uuid: str = ""
    """The GPU's UUID as the rank's CUDA reports it ("GPU-..."), "" if unknown."""


@dataclass(frozen=True)
class GpuEvent:
    """A fatal fault or a risk on one of this node's GPUs, for the agent's listeners."""

    node: str
    gpu: int
    kind: str
    """"fatal" (the GPU cannot go on: restart, reset or reboot) or "risk" (an early sign)."""
    reason: str
    """xid, gpu_lost, ecc_uncorrected, row_remap_failed, ecc_corrected, row_remap_pending, throttle."""
    xid: int | None
    action: str
    """reboot, reset_gpu, restart_app; none for most risks; unknown for an unknown XID."""
    ranks: tuple[int, ...]
    at: float
    """Unix time."""
    uuid: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    """What was seen, e.g. {"new_errors": 3, "total": 12} or {"throttle": ["hw_thermal_slowdown"]}."""
    incident: Incident | None = None
    """The ``gpu_fault`` incident recorded for it, if any."""


def _uuid_key(uuid: str) -> str:
    """A UUID as NVML ("GPU-5c41...") or CUDA ("5c41...") spells it, in one form."""
    u = uuid.strip().lower()
    return u[4:] if u.startswith(("gpu-", "mig-")) else u


def gpu_of(device: str, local_rank: int) -> int:
    """The GPU index a rank uses (see the module docstring)."""
    m = _CUDA.fullmatch(device.strip())
    return int(m.group(1)) if m else local_rank


class GpuMonitor:
    """Args:
        node: this node's id.
        config: the source and thresholds.
        incidents: where ``gpu_fault`` incidents go.
        ranks: this node's current ranks.
        clock: Unix time, injected for tests.
        source: used instead of the one ``config`` names (tests).
    """

    def __init__(self, node: str, config: GpuConfig, incidents: IncidentLog,
                 ranks: Callable[[], list[RankDevice]], clock: Callable[[], float] = time.time,
                 source: GpuSource | None = None) -> None:
        self.node, self.config = node, config
        self.listeners: list[Callable[[GpuEvent], None]] = []
        self._incidents, self._ranks, self._clock = incidents, ranks, clock
        self._source: GpuSource | None = source
        self._readings: dict[int, GpuReading] = {}   # the latest read: what /metrics shows
        self._last_seen: dict[int, GpuReading] = {}  # each GPU's last reading: what changes are against
        self._xid_counts: dict[tuple[int, int], int] = {}
        self._throttle = ThrottleTracker(config.throttle_sustain)
        self._last_reported: dict[tuple[int, str, int | None], float] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False

    @property
    def source(self) -> GpuSource | None:
        """The open source, or None before :meth:`start` (or when there is none)."""
        return self._source

    @property
    def source_name(self) -> str | None:
        return self._source.name if self._source is not None else None

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> None:
        """Open the source and start reading.

        Raises:
            NvmlUnavailable: the config asks for NVML and there is none.
        """
        if self._source is None:
            self._source = open_source(self.config)
        if self._source is None:
            return
        self.poll()  # the first reading is there before the agent serves
        self._threads = [threading.Thread(target=self._poll_loop, name="rankwatch-gpu-poll", daemon=True),
                         threading.Thread(target=self._event_loop, name="rankwatch-gpu-xid", daemon=True)]
        for t in self._threads:
            t.start()

    def stop(self, timeout: timedelta = timedelta(seconds=2)) -> None:
        self._stopped.set()
        for t in self._threads:
            t.join(timeout.total_seconds())
        if self._source is not None and not self._closed and not any(t.is_alive() for t in self._threads):
            self._source.close()
            self._closed = True
        self._threads = []

    def _poll_loop(self) -> None:
        while not self._stopped.wait(self.config.poll_interval.total_seconds()):
            self.poll()

    def _event_loop(self) -> None:
        assert self._source is not None
        while not self._stopped.is_set():
            try:
                events = self._source.events(_EVENT_WAIT)
            except Exception:  # noqa: BLE001 - the agent never dies of a source bug
                log.exception("GPU event source failed")
                self._stopped.wait(_EVENT_WAIT.total_seconds())
                continue
            for ev in events:
                self.on_xid(ev)

    # -- inputs -----------------------------------------------------------------
    def poll(self) -> None:
        """Read every GPU once and act on what changed."""
        assert self._source is not None
        try:
            readings = self._source.read()
        except Exception:  # noqa: BLE001
            log.exception("GPU source read failed")
            return
        now = self._clock()
        findings: list[tuple[Finding, str]] = []
        with self._lock:
            for r in readings:
                # A source that missed a read (an exporter down) still compares against its last one.
                found = compare(self._last_seen.get(r.index), r)
                self._last_seen[r.index] = r
                throttle = self._throttle.update(r, now)
                findings += [(f, r.uuid) for f in found + ([throttle] if throttle else [])]
            self._readings = {r.index: r for r in readings}
        for finding, uuid in findings:
            self._report(finding, uuid, now)

    def on_xid(self, event: XidEvent) -> None:
        """Count an XID and act on it per the catalogue."""
        with self._lock:
            key = (event.gpu, event.xid)
            self._xid_counts[key] = self._xid_counts.get(key, 0) + 1
            uuid = self._last_seen[event.gpu].uuid if event.gpu in self._last_seen else ""
        finding = xid_finding(event)
        if finding is None:
            log.info("GPU %d: %s (catalogue: ignore)", event.gpu, describe(event.xid))
            return
        self._report(finding, uuid, event.at)

    # -- outputs ----------------------------------------------------------------
    def _report(self, f: Finding, uuid: str, at: float) -> None:
        key = (f.gpu, f.reason, f.xid)
        with self._lock:
            last = self._last_reported.get(key)
            if last is not None and at - last < self.config.repeat_cooldown.total_seconds():
                return
            self._last_reported[key] = at
        ranks = [r for r in self._ranks() if self.gpu_of_rank(r) == f.gpu]
        ranks.sort(key=lambda r: r.rank)
        rank_ids = tuple(r.rank for r in ranks)
        what = describe(f.xid) if f.xid is not None else f.reason.replace("_", " ")
        incident = None
        if f.incident:
            detail = {"gpu": f.gpu, "uuid": uuid, "xid": f.xid, "action": f.action, "reason": f.reason,
                      "fatal": f.kind == "fatal", "ranks": list(rank_ids), "source": self.source_name,
                      **f.detail}
            incident = self._incidents.add(kind="gpu_fault", node=self.node,
                                           rank=ranks[0].rank if ranks else -1,
                                           step=ranks[0].step if ranks else -1, detected_at=at, detail=detail)
        level = logging.WARNING if f.kind == "fatal" or f.incident else logging.INFO
        log.log(level, "GPU %s %d: %s -> %s; ranks %s", "FAULT on" if f.kind == "fatal" else "risk on",
                f.gpu, what, f.action, list(rank_ids) or "none")
        event = GpuEvent(self.node, f.gpu, f.kind, f.reason, f.xid, f.action, rank_ids, at, uuid,
                         dict(f.detail), incident)
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the others
                log.exception("GPU event listener %r failed", listener)

    # -- views ------------------------------------------------------------------
    def readings(self) -> list[GpuReading]:
        with self._lock:
            return [self._readings[i] for i in sorted(self._readings)]

    def xid_counts(self) -> dict[tuple[int, int], int]:
        """(gpu, xid) -> XIDs seen since the agent started."""
        with self._lock:
            return dict(self._xid_counts)

    def gpu_of_rank(self, r: RankDevice) -> int:
        """The index of the GPU a rank uses: by its UUID where a reading has it, else
        :func:`gpu_of`."""
        if r.uuid:
            want = _uuid_key(r.uuid)
            with self._lock:
                for index, reading in self._last_seen.items():
                    if reading.uuid and _uuid_key(reading.uuid) == want:
                        return index
        return gpu_of(r.device, r.local_rank)

    def utilization(self, ranks: list[RankDevice]) -> float | None:
        """The mean utilisation (0 to 1) of the GPUs these ranks use, each GPU once, among those
        up with a reading of it; None when there is none (no GPU, or CPU ranks)."""
        gpus = {self.gpu_of_rank(r) for r in ranks}
        with self._lock:
            values = [g.utilization_ratio for i, g in self._readings.items()
                      if i in gpus and g.up and g.utilization_ratio is not None]
        return sum(values) / len(values) if values else None

    def throttle_for_rank(self, r: RankDevice) -> list[str]:
        """Slowdown reasons active on the GPU a rank uses ([] if none, or no such GPU)."""
        gpu = self.gpu_of_rank(r)
        with self._lock:
            reading = self._readings.get(gpu)
        if reading is None or not reading.up:
            return []
        return [r for r in reading.throttle or () if r in SLOWDOWN_REASONS]
