"""Probe the NVML source on a real GPU machine: one reading of every GPU, and the XID thread.

    python benchmarks/gpu_probe.py [--wait SECONDS] [--metrics]

Prints JSON: each GPU's reading as the agent sees it, how long a reading of all
GPUs takes, and the XID event thread's start, the XIDs it saw while waiting, and
how long it took to stop (bounded by the event wait timeout).  ``--metrics``
adds the ``rankwatch_gpu_*`` exposition the agent would serve.  Exits 1 if NVML
does not initialise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from datetime import timedelta

from prometheus_client import CollectorRegistry, generate_latest

from rankwatch.agent.gpu import GpuCollector, GpuConfig, GpuMonitor
from rankwatch.agent.gpu.base import XidEvent
from rankwatch.agent.gpu.nvml import NvmlSource, NvmlUnavailable
from rankwatch.agent.durable.incidents import IncidentLog

_WAIT = timedelta(milliseconds=500)


def _reading_json(reading: object) -> dict:
    out = dataclasses.asdict(reading)  # type: ignore[call-overload]
    for key in ("ecc", "nvlink_errors"):
        out[key] = {"/".join(k): v for k, v in out[key].items()}
    return out


def _xid_thread(source: NvmlSource, seconds: float) -> dict:
    seen: list[XidEvent] = []
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            seen.extend(source.events(_WAIT))

    began = time.perf_counter()
    thread = threading.Thread(target=run, name="gpu-probe-xid", daemon=True)
    thread.start()
    started = time.perf_counter() - began
    time.sleep(seconds)
    began = time.perf_counter()
    stop.set()
    thread.join(5)
    return {"start_seconds": round(started, 6), "waited_seconds": seconds,
            "stop_seconds": round(time.perf_counter() - began, 3), "stopped": not thread.is_alive(),
            "xids": [dataclasses.asdict(e) for e in seen]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wait", type=float, default=2.0, help="seconds the XID thread listens (default 2)")
    p.add_argument("--metrics", action="store_true", help="also print the rankwatch_gpu_* exposition")
    args = p.parse_args()
    try:
        began = time.perf_counter()
        source = NvmlSource()
        init = time.perf_counter() - began
    except NvmlUnavailable as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    try:
        source.read()  # the first reading also finds the active NVLinks
        began = time.perf_counter()
        readings = source.read()
        read = time.perf_counter() - began
        report = {"init_seconds": round(init, 6), "read_all_gpus_seconds": round(read, 6),
                  "gpus": [_reading_json(r) for r in readings], "xid_thread": _xid_thread(source, args.wait)}
        if args.metrics:
            monitor = GpuMonitor("probe", GpuConfig(source="nvml"), IncidentLog(None), list, source=source)
            monitor.poll()
            registry = CollectorRegistry(auto_describe=False)
            registry.register(GpuCollector(monitor))
            report["metrics"] = generate_latest(registry).decode().splitlines()
    finally:
        source.close()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
