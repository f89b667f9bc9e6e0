"""The harness's layouts without a process group: the degrees a world splits into
(``ParallelDims``), the layers each pipeline stage holds and the names it keeps, and a mixture
of experts routing in one process (its load, a hot expert)."""

from __future__ import annotations

import pytest
import torch

from rankwatch.hooks.harness.model import ModelConfig, Transformer
from rankwatch.hooks.harness.moe import MoE, take_expert_load
from rankwatch.hooks.harness.parallel import ParallelDims
from rankwatch.hooks.harness.pipeline import split_layers, stage_model
from rankwatch.hooks.train import parse_args


def test_dp_fills_what_the_other_degrees_leave():
    d = ParallelDims.from_flags(None, 1, 8, pp=2, ep=2)
    assert (d.dp, d.pp, d.ep, d.data) == (2, 2, 2, 4)
    assert ParallelDims.from_flags(None, 2, 8, pp=2).dp == 2
    assert ParallelDims.from_flags(None, 1, 4, cp=2).dp == 2


def test_a_replica_is_every_stage_of_it():
    d = ParallelDims.from_flags(None, 1, 8, 2, pp=2)
    assert (d.replicate, d.shard, d.replica_size) == (2, 2, 4)
    assert ParallelDims.from_flags(None, 2, 8, 2).replica_size == 4  # shard 2 x tp 2, as before


@pytest.mark.parametrize("flags,message", [
    ({"tp": 1, "world_size": 6, "pp": 4}, "must divide the world size"),
    ({"tp": 2, "world_size": 4, "ep": 2}, "--ep with --tp"),
    ({"tp": 1, "world_size": 8, "replicate": 2, "ep": 2}, "--replicate with --ep"),
])
def test_layouts_that_do_not_fit_say_why(flags, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims.from_flags(None, **flags)


def test_layers_split_evenly_or_as_asked():
    assert split_layers(4, 2) == [[0, 1], [2, 3]]
    assert split_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_layers(4, 2, "1,3") == [[0], [1, 2, 3]]
    for bad in ("1,2", "0,4", "a,b", "4"):
        with pytest.raises(ValueError, match="--pp-split"):
            split_layers(4, 2, bad)
    with pytest.raises(ValueError, match="at least 2 layers"):
        split_layers(1, 2)


def test_a_stage_keeps_the_whole_models_names():
    cfg = ModelConfig(n_layers=4)
    whole = {n for n, _ in Transformer(cfg).named_parameters()}
    first = {n for n, _ in stage_model(Transformer(cfg), 0, 2, [0]).named_parameters()}
    last = {n for n, _ in stage_model(Transformer(cfg), 1, 2, [1, 2, 3]).named_parameters()}
    assert first | last == whole and not first & last
    assert "tok_embeddings.weight" in first and "output.weight" in last
    assert all(n.startswith(("layers.1.", "layers.2.", "layers.3.", "norm.", "output.")) for n in last)
    x = stage_model(Transformer(cfg), 0, 2, [0])(torch.zeros(2, 8, dtype=torch.long))
    assert x.shape == (2, 8, cfg.dim)  # activations, not logits


def test_the_experts_load_adds_up_to_the_tokens_routed():
    torch.manual_seed(0)
    moe = MoE(dim=16, hidden_dim=32, experts=4, top_k=2)
    y = moe(torch.randn(3, 5, 16))
    assert y.shape == (3, 5, 16)
    y.sum().backward()
    assert all(p.grad is not None for p in moe.parameters())
    load = take_expert_load(moe)
    assert len(load) == 4 and sum(load) == 3 * 5 * 2
    assert take_expert_load(moe) == [0, 0, 0, 0]  # taken: it starts again


def test_a_router_bias_makes_an_expert_hot():
    torch.manual_seed(0)
    moe = MoE(dim=16, hidden_dim=32, experts=4, top_k=1, router_bias={2: 50.0})
    moe(torch.randn(4, 8, 16))
    assert take_expert_load(moe) == [0, 0, 32, 0]


def test_the_harness_takes_the_flags():
    a = parse_args(["--pp", "2", "--pp-schedule", "gpipe", "--microbatches", "4", "--ep", "2", "--cp", "2",
                    "--router-bias", "0:3.5", "--pp-split", "1,3"])
    assert (a.pp, a.pp_schedule, a.microbatches, a.ep, a.cp, a.router_bias, a.pp_split) == (
        2, "gpipe", 4, 2, 2, [(0, 3.5)], "1,3")
    with pytest.raises(SystemExit):
        parse_args(["--cp", "3", "--seq-len", "32"])
