"""What reading the Flight Recorder for a hang costs the rank's sender thread.

    python benchmarks/flight_recorder.py [--entries 2000] [--repeats 31]

A one-rank gloo process group (a real ``torch.distributed`` run, no torchrun
needed) fills Flight Recorder's ring (``TORCH_FR_BUFFER_SIZE``, as ``rankwatch
run`` sets it) with all-reduces, then times :func:`flight_recorder_pending`,
the extract a stuck rank's sender thread sends with its stacks, against
PyTorch's raw JSON dump of the same buffer.  The extract is taken only while a
step overruns (at most every 2 s), never on the training thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from rankwatch.agent.cli.ports import free_port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=2000, help="the ring's size, filled to the brim")
    ap.add_argument("--repeats", type=int, default=31)
    args = ap.parse_args()
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(args.entries)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")

    import torch
    import torch.distributed as dist

    from rankwatch.hooks.instrument.hang_evidence import flight_recorder_pending

    dist.init_process_group("gloo")
    t = torch.ones(16)
    for _ in range(args.entries + 10):
        dist.all_reduce(t)

    def timed(fn) -> float:
        samples = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    raw = torch._C._distributed_c10d._dump_fr_trace_json
    n = len(json.loads(raw(includeCollectives=True))["entries"])
    extract = flight_recorder_pending()
    print(f"| entries in the ring | {n} |")
    print(f"| PyTorch's JSON dump (median of {args.repeats}) | {timed(raw) * 1e3:.2f} ms |")
    print(f"| rankwatch's extract (dump, parse, cut; median) | {timed(flight_recorder_pending) * 1e3:.2f} ms |")
    print(f"| extract size | {len(extract)} bytes |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
