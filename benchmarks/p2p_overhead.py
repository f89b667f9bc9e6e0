"""What timing a point-to-point or all-to-all call costs the training thread (gloo, 2 ranks).

    python benchmarks/p2p_overhead.py [--rounds 21] [--calls 400]

Two spawned ranks on loopback gloo.  Each round runs every operation bare and then timed
(rankwatch's collective wrappers installed: the same ones ``rankwatch.hooks.init`` and the
zero-code bootstrap install), ``--calls`` times each, in alternating order from round to
round; the figure is the median over rounds of the timed arm's time per call less the bare
arm's, on rank 0.  Operations, each a ping-pong so both ranks stay in step:

* ``send``/``recv`` of 4 KiB (rank 0 sends, then receives the echo): 2 calls a pair;
* ``isend``/``irecv`` + ``wait()``: 2 calls a pair (each timed at its wait);
* ``batch_isend_irecv`` of one send and one receive + ``wait()``: 2 ops a call;
* ``all_to_all_single`` with uneven splits (rank 0 sends 3 KiB to rank 1 and gets 1 KiB).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ("send/recv", "isend/irecv", "batch_isend_irecv", "all_to_all_single (uneven)")


def _ping(rank: int, op: str, t: torch.Tensor, buf: torch.Tensor, a2a: tuple) -> None:
    peer = 1 - rank
    if op == "send/recv":
        if rank == 0:
            dist.send(t, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(t, peer)
    elif op == "isend/irecv":
        if rank == 0:
            dist.isend(t, peer).wait()
            dist.irecv(buf, peer).wait()
        else:
            dist.irecv(buf, peer).wait()
            dist.isend(t, peer).wait()
    elif op == "batch_isend_irecv":
        ops = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, buf, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    else:
        inp, out, ins, outs = a2a
        dist.all_to_all_single(out, inp, output_split_sizes=outs, input_split_sizes=ins)


def _arm(rank: int, op: str, calls: int, args: tuple) -> float:
    dist.barrier()
    start = time.perf_counter_ns()
    for _ in range(calls):
        _ping(rank, op, *args)
    return (time.perf_counter_ns() - start) / calls


def _worker(rank: int, port: int, rounds: int, calls: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from rankwatch.hooks.instrument.collectives import CollectiveInstrumentation
    from rankwatch.hooks.instrument.recorder import Recorder

    instr = CollectiveInstrumentation(Recorder(capacity=4096))
    t, buf = torch.ones(1024), torch.empty(1024)
    # Uneven: rank 0 sends 768 floats (3 KiB) to rank 1 and gets 256 (1 KiB) back.
    ins = [256, 768] if rank == 0 else [256, 256]
    outs = [256, 256] if rank == 0 else [768, 256]
    a2a = (torch.ones(sum(ins)), torch.empty(sum(outs)), ins, outs)
    args = (t, buf, a2a)
    for op in OPS:   # warm up the connections
        _arm(rank, op, 20, args)
    added: dict[str, list[float]] = {op: [] for op in OPS}
    for r in range(rounds):
        for op in OPS:
            times = {}
            for arm in (("bare", "timed") if r % 2 == 0 else ("timed", "bare")):
                if arm == "timed":
                    instr.install()
                times[arm] = _arm(rank, op, calls, args)
                instr.uninstall()
            added[op].append(times["timed"] - times["bare"])
    if rank == 0:
        per_call = {"send/recv": 2, "isend/irecv": 2, "batch_isend_irecv": 1, "all_to_all_single (uneven)": 1}
        with open(out, "w") as f:
            for op in OPS:
                med = statistics.median(added[op]) / per_call[op]
                q1, _, q3 = statistics.quantiles(added[op], n=4)
                f.write(f"| {op} | {med / 1000:+.2f} us | {q1 / per_call[op] / 1000:+.2f} .. "
                        f"{q3 / per_call[op] / 1000:+.2f} us |\n")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--port", type=int, default=29631)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.md")
        mp.spawn(_worker, args=(a.port, a.rounds, a.calls, out), nprocs=2, join=True)
        print(f"| operation | added per call (median of {a.rounds} rounds) | interquartile |")
        print("|---|---|---|")
        with open(out) as f:
            print(f.read(), end="")


if __name__ == "__main__":
    main()
