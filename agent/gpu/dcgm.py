"""The DCGM source: a scrape of a co-located dcgm-exporter's ``/metrics``.

For nodes where the agent has no NVML of its own but dcgm-exporter runs (the
GPU Operator's DaemonSet).  dcgm-exporter labels each series with ``gpu`` (the
index), ``UUID`` and ``modelName``; series of MIG instances (``GPU_I_ID`` set)
are skipped.  Which fields appear depends on the exporter's counters file; a
missing field is absent here too, and so are DCGM's "blank" sentinel values.

What a scrape cannot tell, compared with NVML:
- XIDs: ``DCGM_FI_DEV_XID_ERRORS`` holds only the *last* XID of each GPU, so a
  new XID is seen when that value changes between two scrapes; the same XID
  again, or two XIDs within one interval, count once.
- A lost GPU: a GPU that falls off the bus is seen through its XID 79 only.
- NVLink: the ``..._COUNT_TOTAL`` fields sum all links (``link="all"``);
  per-link fields (``..._COUNT_L<n>``) are used when the exporter has them.
"""

from __future__ import annotations

import logging
import queue
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from rankwatch.agent.gpu.base import GpuReading, XidEvent, decode_throttle

__all__ = ["DcgmSource", "parse_exposition"]

log = logging.getLogger(__name__)

_MIB = float(1 << 20)
_MAX_BODY = 16 << 20
# DCGM marks "no value" with sentinels: int32 values from 0x7ffffff0 up, int64 from
# 0x7ffffffffffffff0 up, doubles from 2**47 up.  No field read here reaches them.
_INT32_BLANK = 0x7FFFFFF0
_FP64_BLANK = float(1 << 47)

_SCALAR = {  # DCGM field -> (GpuReading field, scale)
    "DCGM_FI_DEV_GPU_TEMP": ("temperature_celsius", 1.0),
    "DCGM_FI_DEV_POWER_USAGE": ("power_watts", 1.0),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": ("power_limit_watts", 1.0),
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_hertz", 1e6),
    "DCGM_FI_DEV_MEM_CLOCK": ("memory_clock_hertz", 1e6),
    "DCGM_FI_DEV_GPU_UTIL": ("utilization_ratio", 0.01),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("memory_utilization_ratio", 0.01),
    "DCGM_FI_DEV_FB_USED": ("memory_used_bytes", _MIB),
    "DCGM_FI_DEV_FB_TOTAL": ("memory_total_bytes", _MIB),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("pcie_replays", 1.0),
}
_ECC = {
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("corrected", "volatile"),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("uncorrected", "volatile"),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": ("corrected", "aggregate"),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": ("uncorrected", "aggregate"),
}
_REMAP = {
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "correctable",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "uncorrectable",
    "DCGM_FI_DEV_ROW_REMAP_PENDING": "pending",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "failed",
}
_THROTTLE = ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
_NVLINK = re.compile(r"DCGM_FI_DEV_NVLINK_(CRC_FLIT|CRC_DATA|REPLAY|RECOVERY)_ERROR_COUNT_(TOTAL|L(\d+))")
_XID = "DCGM_FI_DEV_XID_ERRORS"


def parse_exposition(text: str) -> tuple[list[GpuReading], dict[int, int]]:
    """Readings of every GPU in a dcgm-exporter exposition, and each GPU's last XID.

    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    gpus: dict[int, dict[str, Any]] = {}
    for name, labels, value in _samples(text):
        if labels.get("GPU_I_ID") or not labels.get("gpu", "").isdigit() or _blank(value):
            continue
        g = gpus.setdefault(int(labels["gpu"]), {"uuid": labels.get("UUID", ""),
                                                 "name": labels.get("modelName", ""), "fields": {}})
        g["fields"][name] = value
    readings, xids = [], {}
    for index in sorted(gpus):
        g = gpus[index]
        readings.append(_reading(index, g["uuid"], g["name"], g["fields"]))
        if _XID in g["fields"]:
            xids[index] = int(g["fields"][_XID])
    return readings, xids


def _samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            # The parser names a counter's samples "<family>_total"; DCGM's own names are the families.
            if s.name in (family.name, family.name + "_total"):
                yield family.name, s.labels, float(s.value)


def _blank(value: float) -> bool:
    return value != value or value >= _FP64_BLANK or _INT32_BLANK <= value <= 0x7FFFFFFF


def _reading(index: int, uuid: str, name: str, f: dict[str, float]) -> GpuReading:
    values: dict[str, Any] = {field: f[key] * scale for key, (field, scale) in _SCALAR.items() if key in f}
    if "memory_total_bytes" not in values and {"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"} <= f.keys():
        total = f["DCGM_FI_DEV_FB_USED"] + f["DCGM_FI_DEV_FB_FREE"] + f.get("DCGM_FI_DEV_FB_RESERVED", 0.0)
        values["memory_total_bytes"] = total * _MIB
    if "pcie_replays" in values:
        values["pcie_replays"] = int(values["pcie_replays"])
    mask = next((f[k] for k in _THROTTLE if k in f), None)
    values["throttle"] = decode_throttle(int(mask)) if mask is not None else None
    values["ecc"] = {key: int(f[k]) for k, key in _ECC.items() if k in f}
    values["remapped_rows"] = {state: int(f[k]) for k, state in _REMAP.items() if k in f}
    values["nvlink_errors"] = _nvlink(f)
    return GpuReading(index, uuid, name, **values)


def _nvlink(f: dict[str, float]) -> dict[tuple[str, str], int]:
    per_link: dict[tuple[str, str], int] = {}
    total: dict[tuple[str, str], int] = {}
    for key, value in f.items():
        m = _NVLINK.fullmatch(key)
        if m:
            kind = m.group(1).lower()
            if m.group(3) is None:
                total[("all", kind)] = int(value)
            else:
                per_link[(m.group(3), kind)] = int(value)
    return per_link or total


class DcgmSource:
    """Args:
        url: the exporter's metrics URL, e.g. ``http://127.0.0.1:9400/metrics``.
        timeout: per scrape.
    """

    name = "dcgm"

    def __init__(self, url: str, timeout: timedelta = timedelta(seconds=2)) -> None:
        self._url, self._timeout = url, timeout
        self._last_xid: dict[int, int] = {}
        self._xids: queue.Queue[XidEvent] = queue.Queue()
        self._failing = False

    def read(self) -> list[GpuReading]:
        try:
            with urllib.request.urlopen(self._url, timeout=self._timeout.total_seconds()) as resp:
                body = resp.read(_MAX_BODY + 1)
            if len(body) > _MAX_BODY:
                raise ValueError(f"exposition larger than {_MAX_BODY} bytes")
            readings, xids = parse_exposition(body.decode("utf-8", errors="replace"))
        except (OSError, ValueError, urllib.error.URLError) as exc:
            if not self._failing:
                log.warning("dcgm-exporter at %s: %s (GPU readings paused until it answers)", self._url, exc)
            self._failing = True
            return []
        if self._failing:
            log.info("dcgm-exporter at %s answers again", self._url)
            self._failing = False
        self._note_xids(xids)
        return readings

    def _note_xids(self, xids: dict[int, int]) -> None:
        now = time.time()
        for gpu, xid in xids.items():
            before = self._last_xid.get(gpu)
            self._last_xid[gpu] = xid
            if before is not None and xid != before and xid > 0:
                self._xids.put(XidEvent(gpu, xid, now))

    def events(self, timeout: timedelta) -> list[XidEvent]:
        try:
            return [self._xids.get(timeout=timeout.total_seconds())]
        except queue.Empty:
            return []

    def close(self) -> None:
        pass
