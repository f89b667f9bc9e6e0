"""The scripted fault source: GPUs that follow a timed script, for tests and ``rankwatch demo``.

It implements :class:`~rankwatch.agent.gpu.base.GpuSource`, so a scripted XID
takes the same path through the agent as one from NVML.  A script is JSON::

    {"gpus": {"count": 2, "name": "NVIDIA H100 80GB HBM3", "nvlinks": 0},
     "events": [
       {"at": 1.0, "gpu": 0, "throttle": ["hw_thermal_slowdown"]},
       {"at": 2,   "gpu": 0, "ecc": {"corrected": 5}},
       {"at": 2,   "gpu": 0, "remap": {"pending": 1}},
       {"at": 3.0, "gpu": 1, "xid": 79},
       {"at": 4,   "gpu": 1, "lost": true}]}

``at`` is seconds after the agent started.  An event may combine keys:

- ``xid``: an XID event on that GPU.
- ``throttle``: the active clock-event reasons from now on ([] clears them).  A
  thermal reason raises the temperature to 89 C; any slowdown drops the SM clock
  from 1980 to 1410 MHz.
- ``ecc``: ``{"corrected": n, "uncorrected": n}`` errors added to the volatile
  and aggregate counts.
- ``remap``: ``{"correctable": n, "uncorrectable": n, "pending": 0|1, "failed": 0|1}``
  sets those row-remapper values.
- ``pcie_replays``: replays added.
- ``nvlink``: ``{"<link>": {"crc_flit": n, "crc_data": n, "replay": n, "recovery": n}}``
  errors added on a link (below ``nvlinks``).
- ``recovery_action``: what the driver asks for from now on, one of ``none``,
  ``gpu_reset``, ``node_reboot``, ``drain_p2p``, ``drain_and_reset``, ...
  (``RECOVERY_ACTIONS``); ``none`` until a script sets it.
- ``lost``: true, and the GPU stops answering; false, and it is back.

Nothing else happens on its own: an XID 79 does not make the GPU lost unless
the script says ``"lost": true`` too.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from rankwatch.agent.gpu.base import (
    ECC_COUNTERS,
    NVLINK_ERROR_TYPES,
    RECOVERY_ACTIONS,
    REMAP_STATES,
    SLOWDOWN_REASONS,
    THROTTLE_REASONS,
    GpuReading,
    XidEvent,
)

__all__ = ["DEMO_SCRIPT", "Script", "ScriptError", "ScriptedSource", "load_script", "parse_script"]

DEMO_SCRIPT = Path(__file__).parent / "scripts" / "demo.json"
"""The script ``rankwatch demo`` runs: a thermal slowdown, then corrected ECC errors and a pending remap."""

_EVENT_KEYS = ("at", "gpu", "xid", "throttle", "ecc", "remap", "pcie_replays", "nvlink",
               "recovery_action", "lost")
_MAX_GPUS = 64
_MAX_LINKS = 36
_MIB = 1 << 20


class ScriptError(ValueError):
    """A GPU script that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True)
class ScriptEvent:
    at: float
    gpu: int
    changes: Mapping[str, Any]


@dataclass(frozen=True)
class Script:
    gpu_count: int
    gpu_name: str
    nvlinks: int
    events: tuple[ScriptEvent, ...]
    origin: str = "<script>"


def load_script(path: Path) -> Script:
    """Read and validate a script file.

    Raises:
        ScriptError: unreadable, not JSON, or not a valid script.
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ScriptError(f"GPU script {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ScriptError(f"GPU script {path}: not JSON: {exc}") from None
    return parse_script(data, str(path))


def parse_script(data: Any, origin: str = "<script>") -> Script:
    """Validate a decoded script.

    Raises:
        ScriptError: naming the entry and the key at fault.
    """
    def fail(where: str, msg: str) -> ScriptError:
        return ScriptError(f"GPU script {origin}: {where}: {msg}")

    if not isinstance(data, dict) or set(data) - {"gpus", "events"}:
        raise fail("top level", 'expected an object with "gpus" and "events"')
    gpus = data.get("gpus")
    if not isinstance(gpus, dict) or set(gpus) - {"count", "name", "nvlinks"}:
        raise fail("gpus", 'expected {"count": N, "name": "...", "nvlinks": N}')
    count = _int(gpus.get("count"), 1, _MAX_GPUS, lambda m: fail("gpus.count", m))
    name = gpus.get("name", "Scripted GPU")
    if not isinstance(name, str) or not 0 < len(name) <= 96:
        raise fail("gpus.name", "expected a name of 1 to 96 characters")
    nvlinks = _int(gpus.get("nvlinks", 0), 0, _MAX_LINKS, lambda m: fail("gpus.nvlinks", m))
    raw = data.get("events", [])
    if not isinstance(raw, list):
        raise fail("events", "expected a list")
    events = [_event(e, count, nvlinks, _failing_at(fail, i)) for i, e in enumerate(raw)]
    events.sort(key=lambda e: e.at)  # stable: events at the same time keep their order
    return Script(count, name, nvlinks, tuple(events), origin)


def _int(value: Any, lo: int, hi: int, fail: Callable[[str], ScriptError]) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise fail(f"expected an integer from {lo} to {hi}, got {value!r}")
    return value


def _counts(value: Any, keys: tuple[str, ...], hi: int, fail: Callable[[str], ScriptError]) -> dict[str, int]:
    if not isinstance(value, dict) or not value or set(value) - set(keys):
        raise fail(f"expected an object with keys from {', '.join(keys)}")
    return {k: _int(v, 0, hi, fail) for k, v in value.items()}


def _failing_at(fail: Callable[[str, str], ScriptError], i: int) -> Callable[[str], ScriptError]:
    """``fail`` bound to ``events[i]``: the message names the event that is wrong."""
    return lambda m: fail(f"events[{i}]", m)


def _event(e: Any, count: int, nvlinks: int, fail: Callable[[str], ScriptError]) -> ScriptEvent:
    if not isinstance(e, dict):
        raise fail("expected an object")
    unknown = set(e) - set(_EVENT_KEYS)
    if unknown:
        raise fail(f"unknown key {sorted(unknown)[0]!r} (known: {', '.join(_EVENT_KEYS)})")
    at = e.get("at")
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not 0 <= at < 1e7:
        raise fail(f"'at' must be seconds after the agent starts, got {at!r}")
    gpu = _int(e.get("gpu"), 0, count - 1, lambda m: fail(f"'gpu': {m}"))
    changes: dict[str, Any] = {}
    if "xid" in e:
        changes["xid"] = _int(e["xid"], 1, 65535, lambda m: fail(f"'xid': {m}"))
    if "throttle" in e:
        names = e["throttle"]
        if not isinstance(names, list) or any(n not in THROTTLE_REASONS for n in names):
            raise fail(f"'throttle' must list reasons from {', '.join(THROTTLE_REASONS)}")
        changes["throttle"] = tuple(n for n in THROTTLE_REASONS if n in names)
    if "ecc" in e:
        changes["ecc"] = _counts(e["ecc"], ("corrected", "uncorrected"), 1 << 30, lambda m: fail(f"'ecc': {m}"))
    if "remap" in e:
        changes["remap"] = _counts(e["remap"], REMAP_STATES, 1 << 20, lambda m: fail(f"'remap': {m}"))
    if "pcie_replays" in e:
        changes["pcie_replays"] = _int(e["pcie_replays"], 0, 1 << 30, lambda m: fail(f"'pcie_replays': {m}"))
    if "nvlink" in e:
        changes["nvlink"] = _nvlink(e["nvlink"], nvlinks, fail)
    if "recovery_action" in e:
        if e["recovery_action"] not in RECOVERY_ACTIONS:
            raise fail(f"'recovery_action' must be one of {', '.join(RECOVERY_ACTIONS)}")
        changes["recovery_action"] = e["recovery_action"]
    if "lost" in e:
        if not isinstance(e["lost"], bool):
            raise fail("'lost' must be true or false")
        changes["lost"] = e["lost"]
    if not changes:
        raise fail("an event needs at least one of " + ", ".join(_EVENT_KEYS[2:]))
    return ScriptEvent(float(at), gpu, changes)


def _nvlink(value: Any, nvlinks: int, fail: Callable[[str], ScriptError]) -> dict[int, dict[str, int]]:
    if not isinstance(value, dict) or not value:
        raise fail("'nvlink' must map a link number to error counts")
    out = {}
    for link, counts in value.items():
        if not str(link).isdigit() or int(link) >= nvlinks:
            raise fail(f"'nvlink': link {link!r} is not below gpus.nvlinks ({nvlinks})")
        out[int(link)] = _counts(counts, NVLINK_ERROR_TYPES, 1 << 30, lambda m: fail(f"'nvlink' {link}: {m}"))
    return out


@dataclass
class _Gpu:
    throttle: tuple[str, ...] = ()
    ecc: dict[str, int] = field(default_factory=lambda: {"corrected": 0, "uncorrected": 0})
    remap: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REMAP_STATES, 0))
    pcie_replays: int = 0
    nvlink: dict[tuple[str, str], int] = field(default_factory=dict)
    recovery_action: str = "none"
    lost: bool = False


class ScriptedSource:
    """GPUs that follow ``script``; time 0 is when the source is made.

    Args:
        script: a validated script.
        clock: Unix time, injected for tests.
    """

    name = "script"

    def __init__(self, script: Script, clock: Callable[[], float] = time.time) -> None:
        self._script = script
        self._clock = clock
        self._t0 = clock()
        self._gpus = [_Gpu(nvlink={(str(link), t): 0 for link in range(script.nvlinks)
                                   for t in NVLINK_ERROR_TYPES}) for _ in range(script.gpu_count)]
        self._states = [e for e in script.events if set(e.changes) - {"xid"}]
        self._xids = [e for e in script.events if "xid" in e.changes]
        self._applied = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def read(self) -> list[GpuReading]:
        with self._lock:
            elapsed = self._clock() - self._t0
            while self._applied < len(self._states) and self._states[self._applied].at <= elapsed:
                ev = self._states[self._applied]
                _apply(self._gpus[ev.gpu], ev.changes)
                self._applied += 1
            return [self._reading(i, g) for i, g in enumerate(self._gpus)]

    def fire(self, gpu: int, xid: int) -> None:
        """Raise XID ``xid`` on ``gpu`` now, outside the timeline (``rankwatch demo`` fires its
        fatal fault when the story reaches it, whatever the machine's speed)."""
        if not 0 <= gpu < self._script.gpu_count:
            raise ScriptError(f"no GPU {gpu} in the script ({self._script.gpu_count} GPUs)")
        with self._lock:
            self._xids.insert(0, ScriptEvent(self._clock() - self._t0, gpu, {"xid": int(xid)}))

    def change(self, gpu: int, **changes: Any) -> None:
        """Apply a state change to ``gpu`` now, outside the timeline (``rankwatch demo`` heats
        its GPU and grows its ECC counts at given steps, whatever the machine's speed).

        ``changes`` take the keys of a script event (``throttle=[...]``, ``ecc={...}``, ...).

        Raises:
            ScriptError: the change is not one a script could hold.
        """
        ev = _event({"at": 0, "gpu": gpu, **changes}, self._script.gpu_count, self._script.nvlinks,
                    lambda m: ScriptError(f"GPU change: {m}"))
        if "xid" in ev.changes:
            raise ScriptError("an XID is raised with fire(), not change()")
        with self._lock:
            _apply(self._gpus[ev.gpu], ev.changes)

    def events(self, timeout: timedelta) -> list[XidEvent]:
        if not self._xids:
            self._closed.wait(timeout.total_seconds())
            return []
        due = self._t0 + self._xids[0].at
        wait = due - self._clock()
        if wait > 0:
            if self._closed.wait(min(wait, timeout.total_seconds())) or wait > timeout.total_seconds():
                return []
        with self._lock:
            ev = self._xids.pop(0)
        return [XidEvent(ev.gpu, ev.changes["xid"], self._clock())]

    def close(self) -> None:
        self._closed.set()

    def _reading(self, index: int, g: _Gpu) -> GpuReading:
        uuid = f"GPU-5c41a7ed-0000-4000-8000-{index:012d}"
        if g.lost:
            return GpuReading(index, uuid, self._script.gpu_name, up=False, error="GPU is lost (scripted)")
        hot = any("thermal" in r for r in g.throttle)
        slow = any(r in SLOWDOWN_REASONS for r in g.throttle)
        ecc = {(sev, counter): n for sev, n in g.ecc.items() for counter in ECC_COUNTERS}
        return GpuReading(
            index, uuid, self._script.gpu_name,
            temperature_celsius=89.0 if hot else 47.0, power_watts=310.0, power_limit_watts=700.0,
            sm_clock_hertz=(1410.0 if slow else 1980.0) * 1e6, memory_clock_hertz=2619e6,
            utilization_ratio=0.97, memory_utilization_ratio=0.41,
            memory_used_bytes=61440.0 * _MIB, memory_total_bytes=81559.0 * _MIB,
            throttle=g.throttle, ecc=ecc, remapped_rows=dict(g.remap),
            pcie_replays=g.pcie_replays, nvlink_errors=dict(g.nvlink),
            recovery_action=g.recovery_action)


def _apply(g: _Gpu, changes: Mapping[str, Any]) -> None:
    if "throttle" in changes:
        g.throttle = changes["throttle"]
    for sev, n in changes.get("ecc", {}).items():
        g.ecc[sev] += n
    g.remap.update(changes.get("remap", {}))
    g.pcie_replays += changes.get("pcie_replays", 0)
    for link, counts in changes.get("nvlink", {}).items():
        for kind, n in counts.items():
            g.nvlink[(str(link), kind)] += n
    g.recovery_action = changes.get("recovery_action", g.recovery_action)
    if "lost" in changes:
        g.lost = changes["lost"]
