"""What ``rankwatch run`` changes in torchrun's arguments (``agent/torchrun_args.plan``)."""

from __future__ import annotations

import pytest
from torch.distributed.run import get_args_parser

from rankwatch.agent.cli import torchrun_args
from rankwatch.agent.cli.torchrun_args import DEFAULT_MAX_RESTARTS, fast_timings, plan

FAST3 = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1,join_timeout=600"


def test_the_options_without_a_value_are_torchruns():
    # The launcher options end at the script; telling where needs to know which take a value.
    no_value = {s for a in get_args_parser()._actions if a.option_strings and a.nargs == 0
                for s in a.option_strings}
    assert no_value == torchrun_args._NO_VALUE
    assert all(a.nargs is None for a in get_args_parser()._actions if a.option_strings and a.nargs != 0)


@pytest.mark.parametrize("given,expected", [
    (["--rdzv-backend", "c10d", "-m", "m", "--rdzv-backend", "c10d"],
     ["--rdzv-backend", "rankwatch", "-m", "m", "--rdzv-backend", "c10d"]),  # the script's own args stay
    (["--rdzv-backend", "etcd-v2", "train.py"], ["--rdzv-backend", "rankwatch-etcd", "train.py"]),
    (["--rdzv_backend=etcd-v2", "train.py"], ["--rdzv_backend=rankwatch-etcd", "train.py"]),
    (["--rdzv-backend=c10d", "train.py"], ["--rdzv-backend=rankwatch", "train.py"]),
    (["--rdzv-backend", "rankwatch", "train.py"], ["--rdzv-backend", "rankwatch", "train.py"]),
])
def test_dynamic_backends_become_rankwatchs(given, expected):
    launch = plan(given, {})
    assert launch.args == ["--rdzv-conf", FAST3, *expected]
    wrapped = launch.args != ["--rdzv-conf", FAST3, *given]
    assert launch.env == ({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if wrapped else {})
    assert wrapped == (given != expected)


def test_without_wrapping_the_backend_stays_and_timings_still_come():
    launch = plan(["--nnodes", "2", "--rdzv-backend", "c10d", "t.py"], {}, wrap=False)
    assert launch.args == ["--max-restarts", str(DEFAULT_MAX_RESTARTS), "--rdzv-conf", FAST3,
                           "--nnodes", "2", "--rdzv-backend", "c10d", "t.py"]
    assert launch.env == {}


@pytest.mark.parametrize("given", [
    ["--standalone", "--nproc-per-node", "4", "-m", "rankwatch.hooks.train", "--rdzv-backend", "c10d"],
    ["--nnodes", "2", "--rdzv-backend", "static", "--master-addr", "h", "t.py"],
    ["--nnodes", "2", "t.py"],                                       # torchrun's default: static
    ["--nnodes", "2", "--rdzv-backend", "etcd", "t.py"],             # the legacy etcd rendezvous
])
def test_single_node_and_static_jobs_are_left_alone(given):
    assert plan(given, {}) == torchrun_args.Launch(given)


def test_standalone_from_the_environment_is_left_alone():
    given = ["--rdzv-backend", "c10d", "t.py"]
    assert plan(given, {"PET_STANDALONE": "1"}).args == given


def test_the_users_own_timings_are_kept_and_only_the_missing_ones_added():
    launch = plan(["--nnodes", "1:2", "--rdzv-backend", "c10d",
                   "--rdzv-conf", "is_host=0,last_call_timeout=7,keep_alive_interval=2", "t.py", "--lr", "1"], {})
    conf = launch.args[launch.args.index("--rdzv-conf") + 1]
    assert conf == "is_host=0,last_call_timeout=7,keep_alive_interval=2,keep_alive_max_attempt=3,join_timeout=600"
    assert launch.args[-3:] == ["t.py", "--lr", "1"]
    assert launch.notes[0] == ("rendezvous: keep_alive_max_attempt=3 (torch's 3), join_timeout=600 (torch's 600); "
                               "set any in --rdzv-conf to choose it")


def test_all_four_timings_given_changes_no_conf():
    conf = "keep_alive_interval=5,keep_alive_max_attempt=3,last_call_timeout=30,join_timeout=900"
    given = ["--nnodes", "2", "--max-restarts", "0", "--rdzv-backend", "c10d", "--rdzv_conf=" + conf, "t.py"]
    launch = plan(given, {})
    assert launch.args == [a.replace("c10d", "rankwatch") for a in given]
    assert launch.notes == []


def test_settings_from_torchruns_environment_variables_count_as_given():
    env = {"PET_RDZV_BACKEND": "etcd-v2", "PET_RDZV_CONF": "last_call_timeout=4", "PET_NNODES": "1:3",
           "PET_MAX_RESTARTS": "0"}
    launch = plan(["-m", "train"], env)
    # The flags outrank the environment, so the merged conf keeps the user's key.
    assert launch.args == ["--rdzv-conf", "last_call_timeout=4,keep_alive_interval=1,keep_alive_max_attempt=3,"
                                          "join_timeout=600", "--rdzv-backend", "rankwatch-etcd", "-m", "train"]
    assert launch.env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def test_a_multi_node_job_without_max_restarts_gets_the_default():
    launch = plan(["--nnodes=2:4", "--rdzv-backend", "c10d", "-m", "train", "--max-restarts", "9"], {})
    assert launch.args[:2] == ["--max-restarts", str(DEFAULT_MAX_RESTARTS)]
    i = launch.args.index("-m")
    assert launch.args[i:] == ["-m", "train", "--max-restarts", "9"]   # the script's own flag stays
    assert any(n.startswith(f"--max-restarts {DEFAULT_MAX_RESTARTS}") for n in launch.notes)
    assert "--max-restarts" not in plan(["--nnodes", "1", "--rdzv-backend", "c10d", "t.py"], {}).args


@pytest.mark.parametrize("nodes,interval", [(1, 1), (3, 1), (64, 1), (65, 2), (256, 4), (2048, 5), (16384, 5)])
def test_keep_alive_slows_with_the_jobs_size_up_to_torchs(nodes, interval):
    t = fast_timings(nodes)
    assert t["keep_alive_interval"] == t["last_call_timeout"] == str(interval)
    assert t["keep_alive_max_attempt"] == "3" and t["join_timeout"] == "600"
    launch = plan(["--nnodes", f"1:{nodes}", "--rdzv-backend", "c10d", "t.py"], {})
    assert f"keep_alive_interval={interval}" in launch.args[launch.args.index("--rdzv-conf") + 1]


def test_designs_multi_node_command_gets_the_rankwatch_rendezvous():
    # DESIGN.md's command names no backend: torchrun's static one would refuse --nnodes 2:3.
    given = ["--nnodes", "2:3", "--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:29400",
             "--rdzv-id", "job1", "-m", "rankwatch.hooks.train", "--steps", "500"]
    launch = plan(given, {})
    assert launch.args == ["--max-restarts", str(DEFAULT_MAX_RESTARTS), "--rdzv-conf", FAST3,
                           "--rdzv-backend", "rankwatch", *given]
    assert launch.notes[0].startswith("no --rdzv-backend: c10d")
    assert plan(given, {}, wrap=False).args[4:6] == ["--rdzv-backend", "c10d"]


@pytest.mark.parametrize("given", [
    ["--nnodes", "2", "--node-rank", "1", "--master-addr", "h", "t.py"],
    ["--nnodes", "2", "--node_rank=0", "--rdzv-endpoint", "h:1", "t.py"],
    ["--nproc-per-node", "2", "t.py"],
])
def test_a_static_job_without_a_backend_is_left_alone(given):
    assert plan(given, {}) == torchrun_args.Launch(given)
    assert plan(given[:-1] + ["t.py"], {"PET_MASTER_ADDR": "h", "PET_RDZV_ENDPOINT": "h:1"}).args == given
