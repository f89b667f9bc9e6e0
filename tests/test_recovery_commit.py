"""The step commit (``hooks/recovery/commit.py``): what one rank's read of it means, the
commit on a real gloo group, and the NCCL watchdog mode the tier asks for."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rankwatch.hooks.recovery import net
from rankwatch.hooks.recovery.inprocess import is_peer_failure
from rankwatch.hooks.recovery.commit import (FAILED_BEFORE, FAILED_INSIDE, PASSED, CommitIncomplete, StepCommit,
                                             gates_on_device, outcome)


@pytest.mark.parametrize("total, world, reached, expected", [
    (4.0, 4, True, PASSED),           # every rank added its 1
    (3.0, 4, True, FAILED_INSIDE),    # cut short after this rank's part: its gradients are whole
    (1.0, 4, True, FAILED_INSIDE),    # only its own 1 (NCCL: aborted before the reduction)
    (1.0, 4, False, FAILED_BEFORE),   # NCCL: the step failed before this rank reached the commit
    (4.0, 4, False, PASSED),          # the whole world's sum proves every rank was there
    (5.0, 4, True, FAILED_INSIDE),    # garbage is never a pass
    (0.0, 1, False, FAILED_BEFORE),
])
def test_what_a_read_of_the_commit_means(total, world, reached, expected):
    assert outcome(total, world, reached) == expected


def test_a_commit_that_did_not_complete_is_a_peer_failure_for_the_tier():
    assert is_peer_failure(CommitIncomplete("the step commit did not complete on this rank (1 of 4 ranks)"))


@pytest.fixture
def one_rank_world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_each_optimizer_step_passes_the_commit_on_a_real_group(one_rank_world):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    commit = StepCommit("gloo")
    commit.attach(opt)
    for wrong in (torch.zeros(1, device="meta"), [1.0]):   # not on the commit's device: said, nothing kept
        with pytest.raises(ValueError, match="the step commit's device"):
            commit.carry(wrong)
    for _ in range(3):
        before = model.weight.detach().clone()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()           # raises CommitIncomplete unless the world's sum came back
        opt.zero_grad()
        assert not torch.equal(model.weight, before)   # the step applied
    assert not commit.failed_inside()


def test_the_tier_asks_nccl_to_abort_a_failed_collective_without_ending_the_process(monkeypatch, caplog):
    for before in (None, "1", "3"):   # unset, torchrun's own setting, PyTorch's default
        if before is None:
            monkeypatch.delenv(net.ASYNC_ERROR_HANDLING, raising=False)
        else:
            monkeypatch.setenv(net.ASYNC_ERROR_HANDLING, before)
        with caplog.at_level(logging.INFO):
            net.nccl_errors_to_caller()
        assert os.environ[net.ASYNC_ERROR_HANDLING] == "2"
        assert f"(was {before or 'unset'})" in caplog.text


def test_leaving_a_step_whose_communicators_the_watchdog_already_aborted_is_no_error():
    """On NCCL the watchdog aborts a failed collective's communicators itself (mode 2), and
    torch then forgets the default group: the tier's own abort finds nothing to abort and
    says so, rather than raising (seen on a GPU, where it skipped the rest of leaving)."""
    assert not dist.is_initialized()
    assert net.abort_nccl() is False


def _fused_job(commit: StepCommit):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    commit.attach(opt)
    return model, opt


def _step(model, opt) -> None:
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_a_fused_optimizer_is_gated_on_the_device_and_steps_when_the_commit_passed(one_rank_world):
    commit = StepCommit("gloo", device_gate=True)    # on NCCL this is the default
    model, opt = _fused_job(commit)
    assert gates_on_device(opt)
    for _ in range(3):
        before = model.weight.detach().clone()
        _step(model, opt)
        assert not torch.equal(model.weight, before)   # applied
    assert not hasattr(opt, "found_inf")               # handed back as it was: none
    assert commit.unapplied() == 0                     # every step the host saw was applied
    assert float(next(iter(opt.state.values()))["step"]) == 3


def test_a_scalers_found_inf_still_skips_the_gated_step_and_is_handed_back(one_rank_world):
    commit = StepCommit("gloo", device_gate=True)
    model, opt = _fused_job(commit)
    _step(model, opt)
    theirs = torch.tensor(1.0)                          # as AMP's scaler sets it: an overflow
    opt.found_inf = theirs
    before = model.weight.detach().clone()
    _step(model, opt)
    assert torch.equal(model.weight, before)            # skipped on the device
    assert opt.found_inf is theirs
    assert float(next(iter(opt.state.values()))["step"]) == 1   # the skipped step is not counted
    # The device counted the skipped step's commit as passed: the scaler skipped it, not a
    # failure, so the recovery is told of no unapplied step.
    assert commit.unapplied() == 0


def test_an_optimizer_that_cannot_skip_on_the_device_is_not_gated_there():
    model = torch.nn.Linear(4, 1)
    assert not gates_on_device(torch.optim.AdamW(model.parameters(), foreach=False))
    assert not gates_on_device(torch.optim.SGD(model.parameters(), lr=0.1))
    assert gates_on_device(torch.optim.SGD(model.parameters(), lr=0.1, fused=True))


@pytest.mark.gpu
def test_on_nccl_a_fused_optimizer_steps_through_the_device_gate_without_a_host_wait(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        model = torch.nn.Linear(64, 64, device="cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        commit = StepCommit("nccl")
        commit.attach(opt)
        x = torch.ones(8, 64, device="cuda")
        for _ in range(5):
            before = model.weight.detach().clone()
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            assert not torch.equal(model.weight, before)
        assert commit._passed is not None          # it went through the device gate
        assert commit.unapplied() == 0
        assert float(next(iter(opt.state.values()))["step"]) == 5
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_a_users_own_loop_trains_on_nccl_through_the_tier_and_its_device_gate(tmp_path):
    """The README's loop (tests/data/user_recovery.py) on NCCL under a real torchrun:
    the tier sets the watchdog to abort without ending the worker, and fused AdamW steps
    through the device gate, every step applied once."""
    script = Path(__file__).parent / "data" / "user_recovery.py"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                          str(script), "--device", "cuda", "--steps", "12", "--out", str(tmp_path / "out")],
                         env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "rank0.json").read_text())
    assert record["applied"] == list(range(1, 13))
    assert record["recoveries"] == []
    assert record["nccl_error_handling"] == "2"   # torchrun gave it 1: the watchdog would end the worker


def _carrying_rank(rank: int, store_path: str, out: str) -> None:
    """Two ranks, two optimizers (host and device gate): each step carries [rank + 1, step]
    in the commit; what comes back is compared with a plain all-reduce of the same values."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    got = []
    for gate in (False, True):
        commit = StepCommit("gloo", device_gate=gate)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=gate or None)
        assert not commit.carry(torch.zeros(1))    # nothing attached: no commit runs, sum it yourself
        commit.attach(opt)
        for step in range(1, 4):
            model(torch.ones(2, 4)).sum().backward()
            carried = torch.tensor([rank + 1.0, float(step)])
            own = carried.clone()
            assert commit.carry(carried)
            opt.step()
            opt.zero_grad()
            dist.all_reduce(own)
            assert torch.equal(carried, own), (carried, own)
            got.append(carried.tolist())
        before = model.weight.detach().clone()
        _step(model, opt)                          # nothing carried: the commit alone, as ever
        assert not torch.equal(model.weight, before)
        assert commit.unapplied() == 0
    Path(out, f"rank{rank}.json").write_text(json.dumps(got))
    dist.barrier()   # neither rank tears the group down while the other still talks on it
    dist.destroy_process_group()
    # torch 2.13 keeps a gloo group alive after destroy_process_group (its threads run on)
    # once torch._dynamo is imported, as making any torch.optim optimizer does; one exit in
    # eight here then aborted in C++ teardown ("terminate called without an active
    # exception").  The results are written: leave without that teardown.
    os._exit(0)


def test_values_carried_in_the_commit_come_back_summed_over_the_world(tmp_path):
    """Real gloo, two ranks: a loop's per-step sums ride in the commit's one all-reduce,
    through the host check and through the device gate alike."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_carrying_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    want = [[3.0, 2.0 * s] for s in (1, 2, 3)] * 2
    assert json.loads((tmp_path / "rank0.json").read_text()) == want
    assert json.loads((tmp_path / "rank1.json").read_text()) == want
