"""Which pipeline stage a rank runs without a ``pp`` mesh: from the pipelining library's stage
objects' figures, and from the direction of a hand-rolled pipeline's P2P traffic."""

from __future__ import annotations

import pytest

from rankwatch.hooks.instrument.stage_infer import stage_from_traffic, stage_of, with_stage


def test_one_stage_a_rank_is_its_stage_index():
    assert stage_of(1, 2, 1, 2) == (1, 2)
    assert stage_of(0, 4, 0, 4) == (0, 4)


def test_several_stages_a_rank_is_its_place_in_the_pipeline_group():
    # Interleaved 1F1B, 2 ranks, 4 stages: rank 1 holds stages 1 and 3, either tells.
    assert stage_of(3, 4, 1, 2) == (1, 2) == stage_of(1, 4, 1, 2)


@pytest.mark.parametrize("figures", [(0, 1, 0, 1), (2, 2, 0, 2), (0, 2, 2, 2), (0, 4, 0, 1), (0, 2, 0, 3)])
def test_figures_that_make_no_pipeline_give_no_stage(figures):
    assert stage_of(*figures) is None


def test_the_first_stage_sends_first_the_last_receives_first():
    # Rank 0 sends its activation to 1, then gets the gradient back; rank 1 the other way round.
    assert stage_from_traffic(0, 2, [("send", 1), ("recv", 1)] * 4) == (0, 2)
    assert stage_from_traffic(1, 2, [("recv", 0), ("send", 0)] * 4) == (1, 2)


def test_a_middle_stage_receives_from_before_and_sends_after():
    ops = [("recv", 1), ("send", 3), ("recv", 3), ("send", 1)]
    assert stage_from_traffic(2, 4, ops) == (2, 4)


def test_replicas_a_stage_make_the_stride():
    # World 4, two replicas a stage, stage-major: rank 1 (stage 0) talks to 3, rank 2 (stage 1) to 0.
    assert stage_from_traffic(1, 4, [("send", 3), ("recv", 3)]) == (0, 2)
    assert stage_from_traffic(2, 4, [("recv", 0), ("send", 0)]) == (1, 2)


@pytest.mark.parametrize("rank, world, ops", [
    (0, 2, []),                                        # no traffic
    (1, 2, [("send", 0), ("recv", 0)]),                # sends its gradient first to a stage before it
    (2, 5, [("recv", 0)]),                             # a stride of 2 in a world of 5
    (1, 4, [("recv", 0), ("send", 3)]),                # peers at unequal strides
    (2, 4, [("send", 3), ("recv", 3)]),                # a first stage at rank 2: stages laid out replica-major
    (1, 4, [("recv", 0), ("send", 0)]),                # a last stage at rank 1 of 4 with stride 1
    (0, 2, [("send", 0), ("recv", 5)]),                # itself and a rank outside the world
])
def test_traffic_that_is_no_stage_major_pipeline_gives_no_stage(rank, world, ops):
    assert stage_from_traffic(rank, world, ops) is None


def test_a_found_stage_joins_the_mesh_unless_the_mesh_has_one():
    assert with_stage({"dp": 1}, {"dp": 2}, (1, 2)) == ({"dp": 1, "pp": 1}, {"dp": 2, "pp": 2})
    assert with_stage({"pp": 0}, {"pp": 2}, (1, 2)) == ({"pp": 0}, {"pp": 2})
    assert with_stage({}, {}, None) == ({}, {})
