"""Steps and phases from PyTorch's own hooks (zero-code instrumentation), on a real model and
optimizer in this process: every loop shape counts its optimizer steps, no more, no fewer."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rankwatch.hooks.instrument.recorder import ACTIVITY_EVAL, ACTIVITY_TRAIN, Recorder
from rankwatch.hooks.instrument.step_hooks import StepHooks

FETCH = 0.02


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.fixture
def hooked():
    rec = Recorder()
    hooks = StepHooks(rec)
    hooks.install()
    try:
        yield rec
    finally:
        hooks.uninstall()


def _batch(sleep: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    if sleep:
        time.sleep(sleep)
    return torch.randn(4, 8), torch.randint(0, 4, (4,))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, accumulate: int = 1,
           eval_every: int = 0, fetch: float = 0.0) -> None:
    for n in range(1, steps + 1):
        for _ in range(accumulate):
            x, y = _batch(fetch)
            (F.cross_entropy(model(x), y) / accumulate).backward()
        opt.step()
        opt.zero_grad()
        if eval_every and n % eval_every == 0:
            with torch.no_grad():
                for _ in range(3):
                    model(torch.randn(4, 8))


def test_one_step_per_optimizer_step(hooked):
    model = Net()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 7)
    assert [s[0] for s in hooked.steps] == list(range(1, 8))
    assert hooked.step == 7   # no step 8 opened: the loop ended


def test_gradient_accumulation_is_one_step_per_update(hooked):
    model = Net()
    _train(model, torch.optim.AdamW(model.parameters()), 5, accumulate=4)
    assert [s[0] for s in hooked.steps] == [1, 2, 3, 4, 5]


def test_an_eval_pass_is_no_step_and_in_no_steps_time(hooked):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, opt, 6, eval_every=2)
    assert [s[0] for s in hooked.steps] == list(range(1, 7))
    with torch.no_grad():
        model(torch.randn(4, 8))
    assert hooked.activity == ACTIVITY_EVAL
    time.sleep(0.05)   # eval-side host time after the last eval forward is the next step's data
    with torch.no_grad():
        model(torch.randn(4, 8))
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()
    assert hooked.activity == ACTIVITY_TRAIN
    opt.step()
    *_, (step, t0, t1, data, *_r) = hooked.steps
    assert step == 7 and (t1 - t0) < 0.05e9, "the eval before the step is not in its time"


def test_several_optimizers_one_after_the_other_are_one_step(hooked):
    """A Hugging Face-style loop: one backward, then each optimizer steps."""
    enc, head = Net(), nn.Linear(4, 4)
    opts = [torch.optim.AdamW(enc.parameters()), torch.optim.SGD(head.parameters(), lr=0.1)]
    for _ in range(5):
        x, y = _batch()
        F.cross_entropy(head(enc(x)), y).backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()
    assert [s[0] for s in hooked.steps] == [1, 2, 3, 4, 5]


def test_the_wait_for_a_batch_is_the_data_phase(hooked):
    model = Net()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 4, fetch=FETCH)
    # From the second step on, the fetch follows the step before's end: it is in the step.
    for step, t0, t1, data, forward, backward, optimizer, *_r in list(hooked.steps)[1:]:
        assert data >= FETCH * 1e9, step
        assert forward > 0 and backward > 0 and optimizer > 0
        assert data + forward + backward + optimizer <= t1 - t0


SLOW_FETCH = 0.1


def _token_count_body(rank: int, out_dir: str) -> None:
    """A Trainer-shaped loop on a real gloo pair: fetch (rank 1 slowly), all-gather the batch's
    token count, forward, backward, optimizer step."""
    import json

    import torch.distributed as dist

    from rankwatch.hooks.instrument.collectives import CollectiveInstrumentation

    rec = Recorder()
    instr = CollectiveInstrumentation(rec)
    instr.install()
    hooks = StepHooks(rec)
    hooks.install()
    try:
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            x, y = _batch(SLOW_FETCH if rank == 1 else 0.0)
            counts = torch.zeros(2, dtype=torch.long)
            dist.all_gather_into_tensor(counts, torch.tensor([len(y)]))
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        hooks.uninstall()
        instr.uninstall()
    with open(f"{out_dir}/steps{rank}.json", "w") as f:
        json.dump([list(s) for s in rec.steps], f)


def test_a_wait_for_a_slower_peer_before_the_forward_is_wait_not_data(tmp_path):
    """The rank with the fast loader waits in the token-count all-gather for the slow one: its
    step counts that as time blocked in collectives, and its data phase as its own loader's
    time only; the slow rank's data phase holds its slow fetch."""
    import json

    from conftest import run_gloo_pair

    run_gloo_pair(_token_count_body, str(tmp_path), error_path=tmp_path / "error.txt")
    fast, slow = (json.loads((tmp_path / f"steps{r}.json").read_text()) for r in (0, 1))
    assert [s[0] for s in fast] == [s[0] for s in slow] == [1, 2, 3, 4, 5]
    # From the second step on each step is dated from the step before's end (zero-code).
    for (step, t0, t1, data, *_p, blocked), (_, _, _, slow_data, *_q, slow_blocked) in zip(fast[1:], slow[1:]):
        assert data < 0.3 * SLOW_FETCH * 1e9 < 0.7 * SLOW_FETCH * 1e9 < blocked, (step, data, blocked)
        assert slow_data > 0.9 * SLOW_FETCH * 1e9 > 3 * slow_blocked, (step, slow_data, slow_blocked)
        assert blocked <= t1 - t0


def test_a_nested_module_is_not_a_new_forward(hooked):
    """Only the root call marks: its submodules run inside it."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    (_, t0, t1, data, forward, backward, optimizer, *_r), = hooked.steps
    assert forward > 0 and data < forward + backward + optimizer
    # The first step found the root: from now on only it is hooked, no other module pays.
    from torch.nn.modules import module as nn_module

    assert not nn_module._global_forward_pre_hooks and not nn_module._global_forward_hooks
    assert len(model._forward_pre_hooks) == 1 and not model.body[0]._forward_pre_hooks


def test_uninstall_removes_every_hook():
    rec = Recorder()
    hooks = StepHooks(rec)
    hooks.install()
    hooks.uninstall()
    model = Net()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 3)
    assert list(rec.steps) == [] and torch.autograd.backward.__module__ == "torch.autograd"
