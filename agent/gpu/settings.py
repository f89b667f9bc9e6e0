"""The GPU monitor's configuration and the choice of its source."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

from rankwatch.agent.gpu.base import GpuSource
from rankwatch.agent.gpu.dcgm import DcgmSource
from rankwatch.agent.gpu.nvml import NvmlSource, NvmlUnavailable
from rankwatch.agent.gpu.script import Script, ScriptedSource, load_script

__all__ = ["SOURCES", "GpuConfig", "open_source", "parse_gpu_source"]

log = logging.getLogger(__name__)

SOURCES = ("auto", "nvml", "none", "script", "dcgm")


def parse_gpu_source(text: str) -> tuple[str, Script | None]:
    """``auto``, ``nvml``, ``none`` or ``script:PATH`` (the script is read and checked now).

    Raises:
        ValueError: anything else, or a script that cannot be used.
    """
    if text in ("auto", "nvml", "none"):
        return text, None
    if text.startswith("script:") and len(text) > len("script:"):
        return "script", load_script(Path(text[len("script:"):]))
    raise ValueError(f"GPU source {text!r}: expected auto, nvml, none or script:PATH")


@dataclass(frozen=True, kw_only=True)
class GpuConfig:
    source: str = "auto"
    """auto (NVML if it initialises, else none), nvml, none, script (needs ``script``),
    or dcgm (needs ``dcgm_url``; chosen by a ``dcgm_url`` with source auto)."""
    script: Script | None = None
    """The fault script of the scripted source."""
    dcgm_url: str | None = None
    """A dcgm-exporter ``/metrics`` URL to scrape instead of NVML."""
    interval: timedelta | None = None
    """Between readings; default 5 s, 0.5 s for a script."""
    throttle_sustain: timedelta = timedelta(seconds=10)
    """How long a thermal or hardware slowdown lasts before it is a risk."""
    repeat_cooldown: timedelta = timedelta(seconds=60)
    """The same finding on the same GPU is reported at most once per cooldown."""

    def __post_init__(self) -> None:
        if self.dcgm_url is not None:
            url = urlparse(self.dcgm_url)
            if url.scheme not in ("http", "https") or not url.netloc:
                raise ValueError(f"GpuConfig.dcgm_url {self.dcgm_url!r}: expected http://HOST:PORT/metrics")
            if self.source not in ("auto", "dcgm"):
                raise ValueError(f"GpuConfig: a DCGM URL and GPU source {self.source!r} exclude each "
                                 "other (dcgm-exporter and NVML read the same GPUs); pick one")
            object.__setattr__(self, "source", "dcgm")
        if self.source not in SOURCES:
            raise ValueError(f"GpuConfig.source {self.source!r}: expected one of {', '.join(SOURCES)}")
        if self.source == "script" and self.script is None:
            raise ValueError("GpuConfig.source 'script' needs a script")
        if self.source == "dcgm" and self.dcgm_url is None:
            raise ValueError("GpuConfig.source 'dcgm' needs dcgm_url")
        if self.interval is not None and self.interval <= timedelta(0):
            raise ValueError(f"GpuConfig.interval {self.interval} must be positive")

    @property
    def poll_interval(self) -> timedelta:
        if self.interval is not None:
            return self.interval
        return timedelta(seconds=0.5 if self.source == "script" else 5.0)


def open_source(config: GpuConfig) -> GpuSource | None:
    """The configured source, or None for no GPU monitoring.

    Raises:
        NvmlUnavailable: source ``nvml`` and NVML does not initialise.
    """
    if config.source == "none":
        return None
    if config.source == "script":
        assert config.script is not None
        log.info("GPU source: script %s (%d GPUs)", config.script.origin, config.script.gpu_count)
        return ScriptedSource(config.script)
    if config.source == "dcgm":
        assert config.dcgm_url is not None
        log.info("GPU source: dcgm-exporter at %s", config.dcgm_url)
        return DcgmSource(config.dcgm_url)
    try:
        source = NvmlSource()
    except NvmlUnavailable as exc:
        if config.source == "nvml":
            raise
        log.info("GPU source: none (%s)", exc)
        return None
    log.info("GPU source: NVML")
    return source
