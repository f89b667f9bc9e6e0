"""A survivor's own shards, taken out of a step that failed part-way (``local_state``) and put
into the job rebuilt for the next generation (``restore``), train on exactly as a job that
never failed: two real ranks on gloo, FSDP2 with a root module that holds parameters of its
own (as a transformer's embedding and head are held).

FSDP2 keeps the root's parameters unsharded from its forward until its backward, and its
own ``reshard()`` leaves them so while the forward is under way: taken then, the root's
optimizer state was lost without a word and the recovered run's loss drifted from step
one after the recovery.  A failure in the forward, in the backward, and before the
optimizer step are each checked."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import run_gloo_pair

DIM = 16


def _job(meta: bool):
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rankwatch.hooks.recovery.inprocess import Job

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        model = nn.Sequential(nn.Linear(DIM, DIM), nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()), nn.Linear(DIM, 4))
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)   # the root holds model[0] and model[2]
    if meta:
        model.to_empty(device="cpu")
    return Job(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), replica_size=1)


def _step(job, step: int, fail: str = "") -> None:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x, y = torch.randn(8, DIM, generator=g), torch.randint(0, 4, (8,), generator=g)

    def boom(*_):
        raise RuntimeError("Connection reset by peer (scripted)")

    hook = None
    if fail == "forward":    # the root's parameters are gathered by now
        hook = job.model[1].register_forward_pre_hook(boom)
    elif fail == "backward":
        hook = job.model[1].register_full_backward_pre_hook(boom)
    elif fail == "optimizer":
        hook = job.optimizer.register_step_pre_hook(boom)
    try:
        torch.nn.functional.cross_entropy(job.model(x), y).backward()
        job.optimizer.step()
        job.optimizer.zero_grad()
    finally:
        if hook is not None:
            hook.remove()


def _run(rank: int, fail: str, out: str) -> None:
    from rankwatch.hooks.recovery.state import local_state, restore

    torch.set_num_threads(1)
    failed, reference = _job(meta=False), _job(meta=False)
    for step in (1, 2):
        _step(failed, step)
        _step(reference, step)
    try:
        _step(failed, 3, fail)
        raise AssertionError("the scripted failure did not happen")
    except RuntimeError as exc:
        assert "scripted" in str(exc), exc
    shards = local_state(failed)
    rebuilt = _job(meta=True)
    restore(rebuilt, shards)
    for step in (3, 4):
        _step(rebuilt, step)
        _step(reference, step)
    got = {n: p.to_local().clone() for n, p in rebuilt.model.named_parameters()}
    want = {n: p.to_local().clone() for n, p in reference.model.named_parameters()}
    steps = {n: float(rebuilt.optimizer.state[p]["step"]) for n, p in rebuilt.model.named_parameters()}
    if rank == 0:
        torch.save({"got": got, "want": want, "steps": steps, "saved": sorted(shards["optim"])}, out)


@pytest.mark.parametrize("fail", ["forward", "backward", "optimizer"])
def test_shards_taken_from_a_failed_step_train_on_as_an_unbroken_run(tmp_path, fail):
    out = tmp_path / "state.pt"
    run_gloo_pair(_run, fail, str(out), error_path=tmp_path / "rank.error")
    r = torch.load(out)
    names = ["0.weight", "0.bias", "1.0.weight", "1.0.bias", "2.weight", "2.bias"]
    assert r["saved"] == sorted(names)   # the root's own parameters' state too
    assert r["steps"] == {n: 4.0 for n in names}
    for name in names:
        assert torch.equal(r["got"][name], r["want"][name]), name
