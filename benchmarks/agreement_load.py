"""The in-process agreement at scale: its store traffic from N nodes x R ranks against one real store.

The recovery store is a real ``torch.distributed.TCPStore`` server in a process of its own
(the rendezvous store's kind; libuv, torch's default).  Every member of generation 0 has
registered (its node, its liveness address: one listening socket that accepts, so every
member looks alive), untimed.  Then a node is lost and the survivors agree on generation 1:

* the decider is the real :meth:`Round.agree` (``rankwatch.hooks.recovery.protocol``), in a
  thread of this process, and arrives first (so it waits for everyone: the worst order);
  hierarchical, it posts its node's eight ranks (``node_entries``);
* the other survivors are simulated by ``--processes`` processes with ``--threads`` threads
  each, one store connection per thread, each thread playing its share of the survivors one
  after another.  ``--protocol flat`` (one post per rank): each survivor's post is
  :meth:`Round.post` and its read :meth:`Round.collect`, the real methods.  ``--protocol
  hierarchical`` (one post per node): each node's first rank posts the node's steps
  (:meth:`Round.post_many`) and reads the decision once (:meth:`Round.collect`); its other
  ranks' hand-over to it is node-local and not simulated.  ``--protocol v1``: the protocol
  before this benchmark (a post of ``alive`` and an ``arrived`` count per rank, then a wait,
  the decision and the joiners' count per rank), its survivors as raw store calls and its
  decider that commit's ``Round``, read from git.

Measured: the time from the first post to the last survivor's read of the decision (and to
the decision written), the store process's CPU over that time (``/proc/<pid>/stat``), the
generator's CPU, and the decision's size.  Each generator thread's first read is the real
:meth:`Round.collect`; its others make the same store requests (wait, get, the joiners'
count) without parsing the decision, which each survivor does on its own CPU (its cost,
``parse_ms``, is measured apart).  The generator shares the machine's cores with the store.

    python benchmarks/agreement_load.py --nodes 2048 --ranks 8 --protocol hierarchical [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta

_SERVER = ("import sys; from torch.distributed import TCPStore; "
           "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, timeout=__import__('datetime')"
           ".timedelta(seconds=300)); print(s.port, flush=True); sys.stdin.read()")
_PREFIX = "rankwatch/job/round/0/"


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client(port: int):
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=300))


_V1_COMMIT = "42b4767"   # the last commit with the per-rank protocol (``--protocol v1``)


def _round(store, protocol: str = "flat"):
    if protocol == "v1":   # that commit's protocol module, read from git
        import types

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        old = {}
        for name in ("decide", "protocol"):   # its decision (a member list, not runs) too
            text = subprocess.run(["git", "-C", root, "show", f"{_V1_COMMIT}:hooks/recovery/{name}.py"],
                                  capture_output=True, text=True, check=True).stdout
            old[name] = sys.modules[f"{name}_v1"] = types.ModuleType(f"{name}_v1")
            saved = sys.modules["rankwatch.hooks.recovery.decide"]
            sys.modules["rankwatch.hooks.recovery.decide"] = old.get("decide", saved)
            try:
                exec(compile(text, f"{name}_v1.py", "exec"), old[name].__dict__)
            finally:
                sys.modules["rankwatch.hooks.recovery.decide"] = saved
        Round = old["protocol"].Round
    else:
        import rankwatch.hooks.recovery.decide  # noqa: F401  (for v1's swap)
        from rankwatch.hooks.recovery.protocol import Round
    return Round(store, _PREFIX, {"RANKWATCH_NODE_ID": "sim"}, settle=30.0)


def _register(port: int, nodes: int, ranks: int, live: str, gone: str) -> None:
    """Generation 0's members: the last node's liveness address refuses (it was lost)."""
    store, world = _client(port), nodes * ranks
    keys, values = [], []
    for r in range(world):
        keys += [f"{_PREFIX}inproc/node/{r}", f"{_PREFIX}inproc/live/{r}"]
        values += [f"sim{r // ranks:05d}".encode(), (gone if r // ranks == nodes - 1 else live).encode()]
    for i in range(0, len(keys), 4096):
        store.multi_set(keys[i:i + 4096], values[i:i + 4096])
    store.set(f"{_PREFIX}inproc/world0", str(world))


def _survivors(args, lost: int) -> list[int]:
    """Ranks (flat, v1) or node indices (hierarchical) the generator plays: all but the
    decider's and the lost node's."""
    if args.protocol == "hierarchical":
        return [n for n in range(args.nodes) if n not in (0, lost)]
    return [r for r in range(args.nodes * args.ranks) if r // args.ranks != lost and r != 0]


def _thread(args, port: int, mine: list[int], step: int, out: list) -> None:
    store = _client(port)
    gen = f"{_PREFIX}inproc/gen/1/"
    store.add(f"{_PREFIX}connected", 1)
    store.wait([f"{_PREFIX}go"], timedelta(seconds=120))
    if args.protocol == "v1":
        for r in mine:
            store.set(f"{gen}alive/{r}", str(step))
            store.add(f"{gen}arrived", 1)
        for _ in mine:
            store.wait([f"{gen}decision"], timedelta(seconds=300))
            store.get(f"{gen}decision")
            store.add(f"{_PREFIX}inproc/join/seq", 0)
    else:
        rnd = _round(store)
        old = _membership(args)
        for x in mine:
            if args.protocol == "hierarchical":
                rnd.post_many(old, {x * args.ranks + i: (step, False, None) for i in range(args.ranks)})
            else:
                rnd.post(old, x, step)
        for i, _ in enumerate(mine):
            if i == 0:   # the real read, decision parsed and checked
                rnd.collect(old)
            else:        # the same store requests; the parse is each survivor's own CPU (``parse_ms``)
                store.wait([f"{gen}decision"], timedelta(seconds=300))
                store.get(f"{gen}decision")
                store.add(f"{_PREFIX}inproc/join/seq", 0)
    out.append(time.time())


def _membership(args):
    from rankwatch.hooks.recovery.decide import Membership

    world = args.nodes * args.ranks
    return Membership(generation=0, rank=0, world_size=world, members=tuple(range(world)))


def _process(args, port: int, mine: list[int], step: int, q) -> None:
    out: list[float] = []
    per = [mine[i::args.threads] for i in range(args.threads)]
    threads = [threading.Thread(target=_thread, args=(args, port, p, step, out)) for p in per if p]
    t = time.process_time()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    q.put((max(out), time.process_time() - t))


def _listener() -> tuple[socket.socket, str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4096)

    def accept() -> None:
        while True:
            try:
                s.accept()[0].close()
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return s, f"127.0.0.1:{s.getsockname()[1]}"


def _closed_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    where = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    return where


def once(args) -> dict:
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        listener, live = _listener()
        _register(port, args.nodes, args.ranks, live, _closed_port())
        lost, step = args.nodes - 1, 1000
        q = mp.get_context("fork").Queue()
        share = _survivors(args, lost)
        procs = [mp.get_context("fork").Process(target=_process, args=(args, port, share[i::args.processes], step, q))
                 for i in range(args.processes)]
        for p in procs:
            p.start()
        decided: dict = {}
        store = _client(port)
        decider = threading.Thread(target=_decide, args=(args, port, step, decided))
        threads = sum(min(args.threads, len(share[i::args.processes])) for i in range(args.processes))
        while int(store.add(f"{_PREFIX}connected", 0)) < threads:   # every generator thread waits for the go
            time.sleep(0.01)
        cpu0, t0 = _cpu(server.pid), time.time()
        decider.start()
        while int(store.add(f"{_PREFIX}inproc/gen/1/arrived", 0)) < 1:
            time.sleep(0.001)
        store.set(f"{_PREFIX}go", "1")
        ends = [q.get(timeout=600) for _ in procs]
        decider.join()
        end = max([e for e, _ in ends] + [decided["at"]])
        row = {"seconds": end - t0, "decided": decided["at"] - t0, "store_cpu": _cpu(server.pid) - cpu0,
               "generator_cpu": sum(c for _, c in ends), "decision_bytes": decided["bytes"],
               "ok": decided["ok"], "members": decided["members"], "parse_ms": decided["parse_ms"]}
        for p in procs:
            p.join()
        listener.close()
        return row
    finally:
        server.kill()
        server.wait()


def _decide(args, port: int, step: int, out: dict) -> None:
    """Rank 0, the first to arrive: the real ``Round.agree``."""
    from rankwatch.hooks.recovery.decide import Decision

    store = _client(port)
    rnd = _round(store, args.protocol)
    mine = {r: (step, False, None) for r in range(1, args.ranks)} if args.protocol == "hierarchical" else None
    kw = {"node_entries": mine} if mine else {}
    d = rnd.agree(_membership(args), step, replica_size=args.ranks, ready=False, settled=set(), **kw)
    text = store.get(f"{_PREFIX}inproc/gen/1/decision").decode()
    t = time.process_time()
    for _ in range(20):
        Decision.from_json(text, _membership(args).members)
    out.update(at=time.time(), ok=d.ok, members=len(d.members), bytes=len(text),
               parse_ms=(time.process_time() - t) / 20 * 1e3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2048)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--protocol", choices=("v1", "flat", "hierarchical"), default="hierarchical")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--threads", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    rows = []
    for _ in range(args.runs):
        rows.append(once(args))
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in ("seconds", "decided", "store_cpu", "generator_cpu")}
    print(f"{args.protocol}, {args.nodes} nodes x {args.ranks} ranks, {args.runs} runs: median {med['seconds']:.3f} s "
          f"(max {max(r['seconds'] for r in rows):.3f}), decided at {med['decided']:.3f} s, store CPU "
          f"{med['store_cpu']:.3f} s, a survivor's parse {rows[-1]['parse_ms']:.2f} ms, generator CPU "
          f"{med['generator_cpu']:.2f} s, decision {rows[-1]['decision_bytes']} bytes, ok {rows[-1]['ok']}, "
          f"{rows[-1]['members']} members", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
