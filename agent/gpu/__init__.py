"""GPU health: NVML, a dcgm-exporter scrape or a scripted fault source, one path downstream."""

from rankwatch.agent.gpu.base import GpuReading, GpuSource, XidEvent
from rankwatch.agent.gpu.settings import GpuConfig, parse_gpu_source
from rankwatch.agent.gpu.gauges import GpuCollector
from rankwatch.agent.gpu.monitor import GpuEvent, GpuMonitor, RankDevice
from rankwatch.agent.gpu.script import DEMO_SCRIPT, ScriptError, load_script

__all__ = [
    "DEMO_SCRIPT", "GpuCollector", "GpuConfig", "GpuEvent", "GpuMonitor", "GpuReading", "GpuSource", "RankDevice",
    "ScriptError", "XidEvent", "load_script", "parse_gpu_source",
]
