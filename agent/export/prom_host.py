"""Host collector: the node's CPU and memory, the agent's own cost, each rank's process.

A collector is ``collect() -> Iterable[Metric]``; a missing source yields nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["HostCollector"]


class HostCollector:
    """Args:
        node: the ``node`` label.
        rank_pids: returns ``{rank: pid}`` of this node's live ranks.
    """

    def __init__(self, node: str, rank_pids: Callable[[], dict[int, int]]) -> None:
        self._node = node
        self._rank_pids = rank_pids
        self._self = psutil.Process(os.getpid())
        self._procs: dict[int, psutil.Process] = {}
        psutil.cpu_percent(None)  # prime the CPU delta

    def collect(self) -> Iterable[Metric]:
        node = [self._node]
        g = GaugeMetricFamily("rankwatch_host_cpu_utilization_ratio",
                              "Node CPU utilisation since the last scrape (0-1).", labels=["node"])
        g.add_metric(node, psutil.cpu_percent(None) / 100.0)
        yield g
        vm = psutil.virtual_memory()
        g = GaugeMetricFamily("rankwatch_host_memory_used_bytes", "Node memory in use.", labels=["node"])
        g.add_metric(node, float(vm.total - vm.available))
        yield g
        g = GaugeMetricFamily("rankwatch_host_memory_total_bytes", "Node memory.", labels=["node"])
        g.add_metric(node, float(vm.total))
        yield g
        g = GaugeMetricFamily("rankwatch_host_load1", "1-minute load average.", labels=["node"])
        g.add_metric(node, os.getloadavg()[0])
        yield g
        with self._self.oneshot():
            cpu = self._self.cpu_times()
            c = CounterMetricFamily("rankwatch_agent_cpu_seconds", "CPU time of the agent.", labels=["node"])
            c.add_metric(node, cpu.user + cpu.system)
            yield c
            g = GaugeMetricFamily("rankwatch_agent_resident_memory_bytes", "Agent RSS.", labels=["node"])
            g.add_metric(node, float(self._self.memory_info().rss))
            yield g
        yield from self._rank_processes()

    def _rank_processes(self) -> Iterable[Metric]:
        cpu = CounterMetricFamily("rankwatch_rank_cpu_seconds", "CPU time of a rank's process.",
                                  labels=["node", "rank"])
        rss = GaugeMetricFamily("rankwatch_rank_resident_memory_bytes", "RSS of a rank's process.",
                                labels=["node", "rank"])
        live = {}
        for rank, pid in self._rank_pids().items():
            try:
                proc = self._procs.get(pid) or psutil.Process(pid)
                with proc.oneshot():
                    t = proc.cpu_times()
                    cpu.add_metric([self._node, str(rank)], t.user + t.system)
                    rss.add_metric([self._node, str(rank)], float(proc.memory_info().rss))
                live[pid] = proc
            except psutil.Error:
                continue
        self._procs = live
        yield cpu
        yield rss
