"""Peer snapshots put back in two real gloo processes (FSDP2 over both, one rank a "node"):
the exchange with the buddy, the state a recovery that admits joiners copies beside the
snapshots (``keep_now``), and ``reshard.assemble`` choosing by step between them.  A world
that keeps its layout gets its shards back bit for bit, and trains on as a run that never
stopped; every optimizer state it gets owns its storage (a view into the whole tensor broke
DCP's asynchronous staging and kept the whole tensor alive)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from conftest import run_gloo_pair
from test_recovery_local_state import _job, _step


def _state(job) -> dict:
    out = {}
    for n, p in job.model.named_parameters():
        out[n] = p.to_local().clone()
        for k, v in job.optimizer.state.get(p, {}).items():
            out[f"{n}/{k}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    return out


def _owns_storage(job) -> bool:
    for p in job.model.parameters():
        for v in job.optimizer.state.get(p, {}).values():
            local = v.to_local() if hasattr(v, "to_local") else v
            if local.storage_offset() != 0 or local.untyped_storage().nbytes() != local.nbytes:
                return False
    return True


def _run(rank: int, out: str) -> None:
    from rankwatch.hooks.recovery import reshard
    from rankwatch.hooks.recovery.snapshot import PeerSnapshots

    torch.set_num_threads(1)
    job, reference = _job(meta=False), _job(meta=False)
    snaps = PeerSnapshots(2)
    snaps.regroup((0, 1), f"n{rank}")
    want = {}
    for step in (1, 2, 3, 4):
        _step(job, step)
        _step(reference, step)
        want[step] = _state(reference)
        if step == 2:
            snaps.take(job, step)
            assert snaps.wait(30)
        if step == 3:
            snaps.keep_now(job, step)
    held = snaps.holdings()
    results = {"held": held}
    for step in (2, 3):   # the snapshot's step, and the one a joiner's recovery copied
        rebuilt = _job(meta=True)
        got = reshard.assemble(rebuilt, snaps, ((0, 0), (1, 1)), (0, 1), rank, step)
        results[step] = {"equal": all(torch.equal(v, want[step][k]) for k, v in _state(rebuilt).items()),
                         "owns": _owns_storage(rebuilt), "received": got}
        if step == 3:   # the same layout trains on as the run that never stopped
            _step(rebuilt, 4)
            results["on"] = all(torch.equal(v, want[4][k]) for k, v in _state(rebuilt).items())
    dist.barrier()
    if rank == 0:
        torch.save(results, out)


def test_snapshots_and_the_state_kept_now_come_back_bit_for_bit(tmp_path):
    out = tmp_path / "r.pt"
    run_gloo_pair(_run, str(out), error_path=tmp_path / "rank.error")
    r = torch.load(out)
    assert r["held"] == {"own": 2, "now": 3, "held": {"1": 2}}   # rank 0 holds rank 1's copy
    for step in (2, 3):
        assert r[step]["equal"], step
        assert r[step]["owns"], step
        assert r[step]["received"] > 0   # rank 1's shards came over the wire
    assert r["on"]
