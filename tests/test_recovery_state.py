"""A joiner's state from a live replica (``send_state`` / ``recv_state``), between two real
processes on gloo: every tensor arrives equal, in its dtype and shape, the small values
travel in the header, and a header that announces more than the receiver's job can hold, or
that carries anything but plain data (a pickled call), is refused before anything is
allocated or run."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

from conftest import run_gloo_pair
from rankwatch.hooks.recovery.state import _SLOT, StateMismatch, _send_header, recv_state, send_state


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(96, 64, generator=g)   # 6,144 elements: on the wire as a tensor
    return {"params": {"w": big, "b": torch.randn(64, generator=g), "h": big.to(torch.bfloat16)},
            "optim": {"w": {"step": torch.tensor(7.0), "exp_avg": torch.randn(96, 64, generator=g),
                            "exp_avg_sq": torch.rand(96, 64, generator=g), "lr_scale": 0.5},
                      "h": {"step": 3}}}


class _Call:
    """Pickled, it calls ``os.mkdir(path)`` when unpickled: what a hostile peer could send."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.path,))


def _hostile(role: str, out: str) -> None:
    """Rank 0 of a hostile pair: a header the receiver must refuse."""
    if role == "oversized":    # 64 GiB of optimizer state
        _send_header({"params": {}, "optim": {"w": {"exp_avg": (_SLOT, (1 << 34,), "float32")}}}, 1)
    elif role == "malformed":  # a tensor of negative size
        _send_header({"params": {}, "optim": {"w": {"exp_avg": (_SLOT, (4, -1), "float32")}}}, 1)
    elif role == "code":       # a pickle that runs a call when loaded
        _send_header(None, 1, raw=pickle.dumps({"params": {"w": _Call(out + ".ran")}, "optim": {}}))
    elif role == "long_header":  # a header of 1 TiB
        dist.send(torch.tensor([1 << 40], dtype=torch.int64), dst=1)


def _run(rank: int, role: str, out: str) -> None:
    if role == "whole":
        if rank == 0:
            send_state(_state(), 1)
        else:
            torch.save(recv_state(0), out)
    elif rank == 0:
        _hostile(role, out)
    else:
        try:
            recv_state(0, limit=1 << 20)
        except StateMismatch as exc:
            Path(out).write_text(str(exc))


def _spawn(role: str, out: Path) -> None:
    run_gloo_pair(_run, role, str(out), error_path=Path(str(out) + ".error"))


def test_the_state_arrives_whole(tmp_path):
    out = tmp_path / "got.pt"
    _spawn("whole", out)
    got, sent = torch.load(out), _state()
    assert list(got["params"]) == list(sent["params"]) and list(got["optim"]) == list(sent["optim"])
    for name, t in sent["params"].items():
        assert got["params"][name].dtype == t.dtype and torch.equal(got["params"][name], t), name
    for name, per in sent["optim"].items():
        assert set(got["optim"][name]) == set(per)
        for k, v in per.items():
            assert (torch.equal(got["optim"][name][k], v) if isinstance(v, torch.Tensor)
                    else got["optim"][name][k] == v), (name, k)


def test_a_header_announcing_more_than_the_job_holds_is_refused(tmp_path):
    out = tmp_path / "refused.txt"
    _spawn("oversized", out)
    assert "announced 68719476736 bytes of state" in out.read_text()


def test_a_header_announcing_a_negative_size_is_refused(tmp_path):
    out = tmp_path / "refused.txt"
    _spawn("malformed", out)
    assert "announced a tensor of shape (4, -1)" in out.read_text()


def test_a_header_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    out = tmp_path / "refused.txt"
    _spawn("code", out)
    assert "the source's state header is not plain data" in out.read_text()
    assert not (tmp_path / "refused.txt.ran").exists()


def test_a_header_announcing_a_terabyte_of_header_is_refused(tmp_path):
    out = tmp_path / "refused.txt"
    _spawn("long_header", out)
    assert "announced a header of 1099511627776 bytes" in out.read_text()
