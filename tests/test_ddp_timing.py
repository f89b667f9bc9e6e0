"""DDP's gradient reduction under zero-code step hooks, on a real one-rank gloo group in this
process: one ``all_reduce`` record per backward that reduced (none under ``no_sync()``), with
the model's gradient bytes and the group's sequence number, the wait charged as blocked time,
and the step phases still marked; DDP's own C++ reduction stays in place (no comm hook)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from rankwatch.hooks.instrument.collectives import CollectiveInstrumentation
from rankwatch.hooks.instrument.ddp_timing import DdpTiming
from rankwatch.hooks.instrument.recorder import OP_CODE, PHASES, Recorder
from rankwatch.hooks.instrument.step_hooks import StepHooks


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, synced: bool = True) -> None:
    for _ in range(steps):
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        if synced:
            F.cross_entropy(model(x), y).backward()
        else:
            with model.no_sync():
                F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_ddp_reductions_and_step_phases_are_recorded(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    rec = Recorder()
    instr = CollectiveInstrumentation(rec)
    ddp_timing = DdpTiming(lambda: (rec, instr))
    hooks = StepHooks(rec, ddp=ddp_timing)
    hooks.install()
    try:
        model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pg = dist.distributed_c10d._get_default_group()
        _train(model, opt, 5)
        seq_after = pg._get_sequence_number_for_group()
        _train(model, opt, 3, synced=False)
    finally:
        hooks.uninstall()
        dist.destroy_process_group()
    assert model._get_ddp_logging_data().get("comm_hook", "") in ("", None)   # DDP's own reduction
    assert hooks.errors == 0 and ddp_timing.errors == 0 and hooks.steps == 8
    colls = list(rec.collectives)
    assert len(colls) == 5, colls   # one per synced backward; no_sync() reduced nothing
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    for c in colls:
        _, op, pgc, seq, t0, t1, size = c
        assert op == OP_CODE["all_reduce"] and size == nbytes and 0 < t0 < t1
    assert colls[-1][3] == seq_after
    steps = list(rec.steps)
    assert [s[0] for s in steps] == list(range(1, 9))
    for s in steps[:5]:   # (step, start, end, phase ns in PHASES order..., blocked ns)
        phases = dict(zip(PHASES, s[3:3 + len(PHASES)]))
        assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0, s
        assert s[-1] > 0, s   # the backward's wait for DDP's buckets is blocked time
    for s in steps[5:]:
        assert s[-1] == 0, s
