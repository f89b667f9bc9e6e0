"""Every ``rankwatch`` flag that sets a config field takes that field's default: one source.

The tables below say, for each flag of each command, where its value goes.  The check at the
end walks every ``add_argument`` of every command and fails on a flag none of them names; the
one before it reads ``agent/cli/app.py`` for the flags it passes into a config, and fails
unless those are exactly the flags the tables put behind a field.
"""

from __future__ import annotations

import argparse
import ast
import re
import textwrap
from pathlib import Path

import pytest

from rankwatch.agent.cli import app
from rankwatch.agent.cli.parser import build_parser, default
from rankwatch.agent.config import AgentConfig
from rankwatch.agent.detect.hang_verdict import HangConfig
from rankwatch.agent.detect.straggler import StragglerConfig
from rankwatch.agent.gpu.settings import GpuConfig
from rankwatch.agent.job.pacing import LoadConfig
from rankwatch.agent.job.policy import PolicyConfig
from rankwatch.agent.relays.routing import RelayConfig
from rankwatch.agent.rpc.limits import StreamLimits
from rankwatch.agent.rpc.tls import TlsConfig

APP = Path(__file__).resolve().parent.parent / "agent" / "cli" / "app.py"

# (command, dest) -> (config, field): the flag's default is the field's.
FIELDS: dict[tuple[str, str], tuple[type, str]] = {
    ("agent", "metrics_port"): (AgentConfig, "metrics_port"),
    ("agent", "metrics_addr"): (AgentConfig, "metrics_addr"),
    ("agent", "hang_floor"): (HangConfig, "floor_seconds"),
    ("agent", "coordinator"): (AgentConfig, "coordinators"),
    ("agent", "election"): (AgentConfig, "election"),
    ("agent", "job_id"): (AgentConfig, "job_id"),
    ("agent", "advertise"): (AgentConfig, "advertise"),
    ("agent", "evict_straggler_speedup"): (PolicyConfig, "evict_straggler_speedup"),
    ("agent", "min_nodes"): (PolicyConfig, "min_nodes"),
    ("agent", "silent_burst_nodes"): (PolicyConfig, "silent_burst_nodes"),
    ("agent", "silent_burst_share"): (PolicyConfig, "silent_burst_share"),
    ("agent", "silent_burst_seconds"): (PolicyConfig, "silent_burst_seconds"),
    ("agent", "gpu_source"): (GpuConfig, "source"),
    ("agent", "dcgm_url"): (GpuConfig, "dcgm_url"),
    ("agent", "rank_grace"): (AgentConfig, "rank_grace"),
    ("agent", "relay_group"): (RelayConfig, "group_size"),
    ("agent", "relay_min_nodes"): (RelayConfig, "min_nodes"),
    ("agent", "relay_whole_every_seconds"): (RelayConfig, "whole_every_seconds"),
    ("agent", "relay_whole_every_intervals"): (RelayConfig, "whole_every_intervals"),
    ("agent", "relay_whole_every_steps"): (RelayConfig, "whole_every_steps"),
    ("agent", "relay_long_wait_spread_seconds"): (RelayConfig, "long_wait_spread_seconds"),
    ("agent", "relay_busy_hold_seconds"): (RelayConfig, "busy_hold_seconds"),
    ("agent", "job_nodes"): (AgentConfig, "job_nodes"),
    ("agent", "status_max_ranks"): (AgentConfig, "status_max_ranks"),
    ("agent", "history_bytes"): (AgentConfig, "history_bytes"),
}
# What the app reads of a parsed value, where that is not the value itself.
READ = {("agent", "gpu_source"): lambda parsed: parsed[0]}   # (source, script)

# (command, dest) -> (config, field): None means "not given", and the app leaves the field at
# its own default (the flag's help quotes it).
UNSET: dict[tuple[str, str], tuple[type, str]] = {
    ("agent", "straggler_threshold"): (StragglerConfig, "threshold"),
    ("agent", "straggler_window"): (StragglerConfig, "window"),
    ("agent", "straggler_evidence"): (StragglerConfig, "evidence"),
    ("agent", "max_streams"): (StreamLimits, "total"),
    ("agent", "control_reserve"): (StreamLimits, "reserve"),
    ("agent", "max_waiting_per_peer"): (StreamLimits, "waiting_per_peer"),
    ("agent", "max_streams_per_peer"): (StreamLimits, "per_peer"),
    ("agent", "max_streams_per_process"): (StreamLimits, "per_process"),
    ("agent", "gpu_interval"): (GpuConfig, "interval"),
}

# Flags that feed a config field whose default is not theirs to take: the field has none, or
# the app resolves the flag's None itself.
OWN: dict[tuple[str, str], str] = {
    ("agent", "listen"): "AgentConfig.listen has no default: None is $RANKWATCH_AGENT, then the per-user socket",
    ("agent", "node_id"): "AgentConfig.node_id has no default: None is $RANKWATCH_NODE_ID, then the host name",
    ("agent", "state_dir"): "None is $RANKWATCH_STATE_DIR, else the per-user directory (AgentConfig's None: memory)",
    ("agent", "token_file"): "the token is read from it, else from $RANKWATCH_TOKEN_FILE or $RANKWATCH_TOKEN",
    ("agent", "tls_cert"): "TlsConfig.cert has no default: no TLS unless all three files are given",
    ("agent", "tls_key"): "TlsConfig.key has no default",
    ("agent", "tls_ca"): "TlsConfig.ca has no default",
}
NO_DEFAULT = {("agent", "listen"): (AgentConfig, "listen"), ("agent", "node_id"): (AgentConfig, "node_id"),
              ("agent", "tls_cert"): (TlsConfig, "cert"), ("agent", "tls_key"): (TlsConfig, "key"),
              ("agent", "tls_ca"): (TlsConfig, "ca")}

# Flags with no config field behind them.
NO_FIELD = {
    ("", "verbose"),
    ("run", "agent"), ("run", "node_id"), ("run", "torchrun_args"),
    ("status", "agent"), ("status", "json"), ("status", "all_ranks"), ("status", "state_dir"),
    ("status", "node_id"), ("status", "token_file"),
    ("diagnose", "agent"), ("diagnose", "state_dir"), ("diagnose", "node_id"), ("diagnose", "json"),
    ("diagnose", "incident"), ("diagnose", "token_file"),
    ("checkpoint", "agent"), ("checkpoint", "reason"), ("checkpoint", "token_file"),
    ("demo", "steps"), ("demo", "no_live"),
    ("analyze", "paths"), ("analyze", "json"), ("analyze", "html"), ("analyze", "compare"),
    ("analyze", "fail_over"), ("analyze", "max_ops"), ("analyze", "no_whatif"),
    ("certs", "certs_command"),   # its actions' flags are certs.py's own (no config behind them)
}


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, its flags added ("" is the top level)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in sub.choices.values():
        command.format_help()   # a command may add its flags on first use
    return {"": parser, **sub.choices}


def _flags() -> dict[tuple[str, str], argparse.Action]:
    """(command, dest) -> its action, for every flag and positional of every command."""
    return {(name, a.dest): a for name, p in _commands().items() for a in p._actions
            if a.dest not in ("help", "version", "command")}


def _parsed(command: str) -> argparse.Namespace:
    return build_parser().parse_args([command])


@pytest.mark.parametrize("flag", sorted(FIELDS), ids="-".join)
def test_a_flag_defaults_to_its_field(flag):
    owner, field = FIELDS[flag]
    command, dest = flag
    parsed = getattr(_parsed(command), dest)
    assert READ.get(flag, lambda v: v)(parsed) == default(owner, field)


@pytest.mark.parametrize("flag", sorted(UNSET), ids="-".join)
def test_a_flag_not_given_leaves_its_field_at_its_default(flag):
    owner, field = UNSET[flag]
    default(owner, field)   # the field exists and has a default
    assert getattr(_parsed(flag[0]), flag[1]) is None


def test_the_app_builds_the_defaults_from_flags_not_given():
    args = _parsed("agent")
    assert app._straggler_config(args) == StragglerConfig()
    assert app._stream_limits(args) == StreamLimits()


@pytest.mark.parametrize("flag", sorted(NO_DEFAULT), ids="-".join)
def test_a_field_without_a_default_has_none(flag):
    owner, field = NO_DEFAULT[flag]
    with pytest.raises(TypeError, match="has no default"):
        default(owner, field)


def test_help_quotes_the_fields_defaults():
    text = re.sub(r"\s+", " ", _commands()["agent"].format_help())
    assert f"default {default(PolicyConfig, 'evict_straggler_speedup'):g}; inf never evicts" in text
    assert f"(default {default(StragglerConfig, 'threshold'):g}: 8%)" in text
    assert f"default {default(AgentConfig, 'metrics_port')})" in text
    assert f"over N/{default(LoadConfig, 'first_syncs_per_second'):g} s" in text
    assert f"(default {default(StreamLimits, 'total')}); more are refused" in text


def test_default_reads_dataclass_fields_and_constructor_keywords():
    assert default(PolicyConfig, "evict_straggler_speedup") == PolicyConfig().evict_straggler_speedup
    assert default(AgentConfig, "rank_grace") == 60.0
    with pytest.raises(KeyError):
        default(PolicyConfig, "no_such_field")


def _config_dests(source: str) -> set[str]:
    """The ``args.X`` that reach a config's constructor (a call to a class ``...Config`` or ``...Limits``)
    in ``source``: in its arguments, or through the local names they use, assigned in the same
    function (``kind, script = args.gpu_source``; ``knobs = {...}`` then ``**knobs``)."""
    found: set[str] = set()
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        assigned: dict[str, list[ast.AST]] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            assigned.setdefault(name.id, []).append(node.value)
        todo: list[ast.AST] = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and re.fullmatch(
            r"[A-Z]\w*(Config|Limits)", getattr(c.func, "id", getattr(c.func, "attr", "")))]
        seen: set[str] = set()
        while todo:
            for node in ast.walk(todo.pop()):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
                    found.add(node.attr)
                elif isinstance(node, ast.Name) and node.id in assigned and node.id not in seen:
                    seen.add(node.id)
                    todo.extend(assigned[node.id])
    return found


def test_the_config_reader_sees_every_way_in():
    source = textwrap.dedent("""
        def f(args):
            kind, _ = args.pair
            knobs = {"a": args.a}
            knobs = {k: v for k, v in knobs.items() if v}
            chosen = args.chosen or 1
            picked = g(chosen)
            logging.basicConfig(level=args.verbose)
            return X.OneConfig(kind=kind, b=args.b, c=H(args.c), d=picked, **knobs), Other(args.not_config)
    """)
    assert _config_dests(source) == {"pair", "a", "chosen", "b", "c"}


def test_the_tables_name_exactly_the_flags_the_app_passes_into_a_config():
    behind = {dest for _, dest in (*FIELDS, *UNSET, *OWN)}
    assert _config_dests(APP.read_text()) == behind


def test_every_flag_of_every_command_is_in_one_table():
    tables = [set(FIELDS), set(UNSET), set(OWN), NO_FIELD]
    named = set().union(*tables)
    assert sum(map(len, tables)) == len(named), "a flag is in two tables"
    flags = set(_flags())
    assert flags - named == set(), "flags in no table: where do their values go?"
    assert named - flags == set(), "table rows for flags that no longer exist"
    assert set(NO_DEFAULT) <= set(OWN)
