"""A rank blocked in a send or receive reports the other end, as a world rank.

Real torch.distributed on gloo, two spawned ranks.  Rank 1 blocks in ``recv(src=0)``, then
in the wait of an ``irecv`` that ``batch_isend_irecv`` posts (it passes the peer as a rank
of the group, ``group_src``); a second thread builds rank 1's progress as the sender
thread does and writes what its in-flight record says.  Rank 0 sends each message only
once that record was seen.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from conftest import run_gloo_pair


def _wait_file(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.01)


def _body(rank: int, out: str) -> None:
    import threading

    import torch
    import torch.distributed as dist

    from rankwatch.hooks.instrument.batches import BatchBuilder
    from rankwatch.hooks.instrument.collectives import CollectiveInstrumentation
    from rankwatch.hooks.instrument.recorder import Recorder

    rec = Recorder()
    instr = CollectiveInstrumentation(rec)
    instr.install()
    builder = BatchBuilder(rec, 64, instr.last_seq, instr.group_seqs)
    base = Path(out)
    t = torch.zeros(8)
    if rank == 0:
        for name in ("recv", "irecv"):
            _wait_file(base / f"seen-{name}")
            if name == "recv":
                dist.send(t, dst=1)
            else:
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1)]):
                    w.wait()
        return

    def watch() -> None:
        seen = set()   # the issue times of the calls seen: the next one is another
        for name in ("recv", "irecv"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                p = builder._progress()
                if p.HasField("inflight") and p.inflight.op == "recv" and p.inflight.since not in seen:
                    seen.add(p.inflight.since)
                    (base / f"inflight-{name}.json").write_text(json.dumps(
                        {"op": p.inflight.op, "peer": p.inflight.peer if p.inflight.HasField("peer") else None}))
                    (base / f"seen-{name}").touch()
                    break
                time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    dist.recv(t, src=0)
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 0)])
    for w in works:
        w.wait()
    watcher.join(60)
    instr.uninstall()


def test_a_blocked_send_or_receive_names_its_peer(tmp_path):
    run_gloo_pair(_body, str(tmp_path), error_path=tmp_path / "error.txt")
    for name in ("recv", "irecv"):
        assert json.loads((tmp_path / f"inflight-{name}.json").read_text()) == {"op": "recv", "peer": 0}, name
