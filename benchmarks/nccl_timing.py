"""NCCL collective latency as rankwatch reports it, against CUDA events around the same calls.

    python benchmarks/nccl_timing.py [--repeats 30]      # one GPU, world size 1

With ``TORCH_NCCL_ENABLE_TIMING=1`` rankwatch takes each collective's duration
from ProcessGroupNCCL's completion hook: CUDA events recorded on the NCCL
stream around the kernel.  This benchmark issues out-of-place all-gathers and
reduce-scatters (world size 1: NCCL copies the buffer) and in-place
all-reduces of several sizes, brackets each call with CUDA events on the
issuing stream, and prints per op and size the medians of both and of their
ratio.  A busy kernel ahead of the first event keeps the host's issue time out
of the interval (without it, the events measured ~0.3 ms of host launch
latency on an H100); what is left is the hand-off between the two streams, a
few microseconds, so small collectives still read longer on the events.

It also times what the hook costs the issuing thread: the same collectives with
rankwatch's hook installed and not, interleaved, host time per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rankwatch.hooks.instrument.collectives import CollectiveInstrumentation  # noqa: E402
from rankwatch.hooks.instrument.recorder import OPS, Recorder  # noqa: E402

SIZES = (4 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30)  # bytes
_BUSY_CYCLES = 5_000_000  # ~2.5 ms of GPU clock: longer than the host takes to issue a collective


def _drain(rec: Recorder, n: int, timeout: float = 30.0) -> list[tuple]:
    out: list[tuple] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        while rec.collectives:
            out.append(rec.collectives.popleft())
        time.sleep(0.001)
    if len(out) < n:
        raise TimeoutError(f"{len(out)} of {n} completion records arrived")
    return out


def _issue(op: str, out: torch.Tensor, inp: torch.Tensor) -> None:
    if op == "all_gather":
        dist.all_gather_into_tensor(out, inp)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out, inp)
    else:
        dist.all_reduce(inp)


def compare(rec: Recorder, repeats: int) -> list[dict]:
    rows = []
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        for size in SIZES:
            inp = torch.randn(size // 4, device="cuda")
            out = torch.empty_like(inp)
            _issue(op, out, inp)  # warm-up
            torch.cuda.synchronize()
            _drain(rec, 1)
            hook, event = [], []
            for _ in range(repeats):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(_BUSY_CYCLES)  # the GPU is busy while the host issues
                e0.record()
                _issue(op, out, inp)
                e1.record()
                torch.cuda.synchronize()
                (r,) = _drain(rec, 1)
                assert OPS[r[1]] == op, (OPS[r[1]], op)
                hook.append((r[5] - r[4]) * 1e-6)
                event.append(e0.elapsed_time(e1))
            rows.append({"op": op, "bytes": size, "hook_ms": statistics.median(hook),
                         "event_ms": statistics.median(event),
                         "ratio": statistics.median(h / e for h, e in zip(hook, event))})
            del inp, out
    return rows


def host_cost(instr: CollectiveInstrumentation, rec: Recorder, repeats: int) -> dict:
    """Host time per small all-reduce with the hook recording and with it standing by."""
    x = torch.randn(1024, device="cuda")
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(repeats * 2):
        on = i % 2 == 0
        instr.install() if on else instr.uninstall()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        times[on].append((time.perf_counter() - t0) / 100)
        rec.collectives.clear()
    return {"on_us": statistics.median(times[True]) * 1e6, "off_us": statistics.median(times[False]) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        rec = Recorder()
        instr = CollectiveInstrumentation(rec)
        source = instr.install()
        print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; source: {source}")
        print("| op | bytes | hook (median ms) | CUDA events (median ms) | hook / events (median) |")
        print("|---|---|---|---|---|")
        for r in compare(rec, args.repeats):
            print(f"| {r['op']} | {r['bytes']:,} | {r['hook_ms']:.4f} | {r['event_ms']:.4f} | "
                  f"{r['ratio']:.3f} |", flush=True)
        cost = host_cost(instr, rec, args.repeats)
        print(f"| host time per 4 KiB all_reduce | hook on {cost['on_us']:.1f} us | "
              f"standing by {cost['off_us']:.1f} us | ratio {cost['on_us'] / cost['off_us']:.3f} |")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
