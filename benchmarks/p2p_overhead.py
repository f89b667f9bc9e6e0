"""What timing a point-to-point or all-to-all call costs the training thread (gloo).

    python benchmarks/p2p_overhead.py [--rounds 31] [--calls 200]

Two parts:

* **The timer alone** (one process, a 1-rank gloo group): rankwatch's wrapper around a no-op
  verb with the real signature (``send``, ``isend`` and its ``Work.wait()``, ``recv``,
  ``batch_isend_irecv``'s ops, ``all_to_all_single`` with uneven splits), against the bare
  no-op: what the instrumentation adds per call, without the network's noise.  timeit,
  median of 9 repeats of 100,000 calls.
* **Two ranks on loopback** (a noisy bound): rank 0 sends 4 KiB and receives the echo, bare
  and timed (the wrappers installed as ``rankwatch.hooks.init`` installs them), in short
  rounds alternating the order; the median over rounds of the timed arm's time per call
  less the bare arm's.  On two shared cores one gloo round trip varies by hundreds of µs
  between rounds, far more than the timer costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import timeit

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

N = 100_000
REPEATS = 9


class _Done:
    """A completed ``Work``: what an async verb returns (its ``wait`` is a no-op)."""

    def wait(self, timeout=None):  # noqa: ANN001 - the Work signature
        return True


def _per_call(stmt: str, g: dict) -> float:
    return statistics.median(timeit.repeat(stmt, globals=g, number=N, repeat=REPEATS)) / N * 1e9


def timer_rows() -> list[tuple[str, float]]:
    """(verb, ns the wrapper adds per call) in this process, on a 1-rank gloo group."""
    from rankwatch.hooks.instrument.collectives import CollectiveInstrumentation
    from rankwatch.hooks.instrument.op_record import _PAYLOAD, _payload_reader, _peer_reader
    from rankwatch.hooks.instrument.recorder import Recorder

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29641")
    dist.init_process_group("gloo", rank=0, world_size=1)
    instr = CollectiveInstrumentation(Recorder(capacity=4096))
    c10d = dist.distributed_c10d
    done = _Done()
    instr._wrap_work_wait(_Done)   # the async verbs' completion timer, on the no-op Work

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):  # noqa: ANN001, ARG001
        return None

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):  # noqa: ANN001, ARG001
        return done

    def recv(tensor, src=None, group=None, tag=0, group_src=None):  # noqa: ANN001, ARG001
        return None

    def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None,  # noqa: A002, ANN001
            async_op=False):  # noqa: ANN001, ARG001
        return None

    def wrap(fn, name: str, op: str):  # noqa: ANN001, ANN202
        from rankwatch.hooks.instrument.recorder import OP_CODE

        return instr._dist_wrapper(fn, OP_CODE[op], c10d, _payload_reader(fn, _PAYLOAD.get(name)),
                                   _peer_reader(fn, name))

    t = torch.ones(1024)
    out, inp = torch.empty(1024), torch.ones(1024)
    g = {"t": t, "out": out, "inp": inp, "send": send, "isend": isend, "recv": recv, "a2a": a2a,
         "w_send": wrap(send, "send", "send"), "w_isend": wrap(isend, "isend", "send"),
         "w_recv": wrap(recv, "recv", "recv"), "w_a2a": wrap(a2a, "all_to_all_single", "all_to_all")}
    rows = [
        ("send (sync)", "send(t, 1)", "w_send(t, 1)"),
        ("recv (sync)", "recv(t, 1)", "w_recv(t, 1)"),
        ("isend + Work.wait()", "isend(t, 1).wait()", "w_isend(t, 1).wait()"),
        ("isend to a group rank (group_dst) + wait", "isend(t, group_dst=1).wait()", "w_isend(t, group_dst=1).wait()"),
        ("all_to_all_single, uneven splits", "a2a(out, inp, [256, 768], [768, 256])",
         "w_a2a(out, inp, [256, 768], [768, 256])"),
    ]
    result = [(name, _per_call(timed, g) - _per_call(bare, g)) for name, bare, timed in rows]
    instr.uninstall()
    dist.destroy_process_group()
    return result


def _ping(rank: int, t: torch.Tensor, buf: torch.Tensor) -> None:
    peer = 1 - rank
    if rank == 0:
        dist.send(t, peer)
        dist.recv(buf, peer)
    else:
        dist.recv(buf, peer)
        dist.send(t, peer)


def _pair(rank: int, port: int, rounds: int, calls: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from rankwatch.hooks.instrument.collectives import CollectiveInstrumentation
    from rankwatch.hooks.instrument.recorder import Recorder

    instr = CollectiveInstrumentation(Recorder(capacity=4096))
    t, buf = torch.ones(1024), torch.empty(1024)
    for _ in range(50):
        _ping(rank, t, buf)
    added, bare_times = [], []
    for r in range(rounds):
        times = {}
        for arm in (("bare", "timed") if r % 2 == 0 else ("timed", "bare")):
            if arm == "timed":
                instr.install()
            dist.barrier()
            start = time.perf_counter_ns()
            for _ in range(calls):
                _ping(rank, t, buf)
            times[arm] = (time.perf_counter_ns() - start) / (2 * calls)   # two calls a round trip
            instr.uninstall()
        added.append(times["timed"] - times["bare"])
        bare_times.append(times["bare"])
    if rank == 0:
        q1, med, q3 = statistics.quantiles(added, n=4)
        with open(out, "w") as f:
            f.write(f"{statistics.median(bare_times) / 1000:.1f} {med / 1000:+.1f} {q1 / 1000:+.1f} {q3 / 1000:+.1f}\n")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--port", type=int, default=29631)
    a = p.parse_args()
    print("| what the training thread runs | added by the timer |")
    print("|---|---|")
    for name, ns in timer_rows():
        print(f"| {name} | {ns:,.0f} ns |")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "pair.txt")
        mp.spawn(_pair, args=(a.port, a.rounds, a.calls, out), nprocs=2, join=True)
        bare, med, q1, q3 = open(out).read().split()
    print(f"\nTwo ranks, send/recv of 4 KiB: bare {bare} us a call; added by the timer {med} us "
          f"(interquartile {q1} .. {q3} us, {a.rounds} rounds of {a.calls} round trips)")


if __name__ == "__main__":
    main()
