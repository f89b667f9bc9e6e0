"""The ``rankwatch`` command line.

    rankwatch agent [--listen ADDR]... [--metrics-port N] [--node-id ID]
    rankwatch run [--agent ADDR] [--node-id ID] -- <torchrun args>
    rankwatch status [--agent ADDR] [--json] [--state-dir DIR]
    rankwatch diagnose [--agent ADDR] [--json] [--state-dir DIR] [INCIDENT]
    rankwatch checkpoint [--agent ADDR]
    rankwatch demo

No torch is imported here: ``agent``, ``status`` and ``diagnose`` start fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rankwatch.address import Address, node_id, resolve
from rankwatch.agent.cli.parser import build_parser

if TYPE_CHECKING:
    from rankwatch.agent.config import AgentConfig
    from rankwatch.agent.detect.straggler import StragglerConfig
    from rankwatch.agent.rpc.limits import StreamLimits
    from rankwatch.agent.rpc.tls import TlsConfig

__all__ = ["main"]

def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s rankwatch %(levelname)s %(message)s")
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130


def _cmd_agent(args: argparse.Namespace) -> int:
    from rankwatch.agent.server import Agent

    try:
        config = _agent_config(args)
    except ValueError as exc:
        print(f"rankwatch agent: {exc}", file=sys.stderr)
        return 2
    if config is None:
        return 1
    agent = Agent(config)
    for log in (agent.incidents, agent.decision_log):   # an unwritable directory: said now, loudly
        if log.writer is not None:
            log.writer.probe()
    try:
        agent.start()
    except (RuntimeError, OSError) as exc:
        print(f"rankwatch agent: {exc}", file=sys.stderr)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop())
    agent.wait()
    return 0


def _agent_config(args: argparse.Namespace) -> AgentConfig | None:
    """The agent's configuration from its flags (ValueError: a value out of range; None: its
    directories cannot be made, said on stderr)."""
    from rankwatch.agent.config import AgentConfig
    from rankwatch.agent.durable.statedir import STATE_DIR_ENV
    from rankwatch.agent.detect.hang_verdict import HangConfig
    from rankwatch.agent.gpu import GpuConfig
    from rankwatch.agent.job.coordinator import PolicyConfig
    from rankwatch.agent.relays.routing import RelayConfig
    from rankwatch.agent.rpc.auth import load_token

    listen = args.listen or [resolve(None)]
    node = node_id(args.node_id)
    chosen = args.state_dir or (Path(os.environ[STATE_DIR_ENV]) if os.environ.get(STATE_DIR_ENV) else None)
    state_dir = _agent_dirs(chosen, listen, node)
    if state_dir is None:
        return None
    policy = PolicyConfig(min_nodes=args.min_nodes, evict_straggler_speedup=args.evict_straggler_speedup,
                          silent_burst_nodes=args.silent_burst_nodes, silent_burst_share=args.silent_burst_share,
                          silent_burst_seconds=args.silent_burst_seconds)
    kind, script = args.gpu_source
    gpu = GpuConfig(source=kind, script=script, dcgm_url=args.dcgm_url,
                    interval=timedelta(seconds=args.gpu_interval) if args.gpu_interval else None)
    relay = RelayConfig(group_size=args.relay_group, min_nodes=args.relay_min_nodes,
                        whole_every_seconds=args.relay_whole_every_seconds,
                        whole_every_intervals=args.relay_whole_every_intervals,
                        whole_every_steps=args.relay_whole_every_steps,
                        long_wait_spread_seconds=args.relay_long_wait_spread_seconds,
                        busy_hold_seconds=args.relay_busy_hold_seconds)
    return AgentConfig(node_id=node, listen=listen, metrics_port=args.metrics_port,
                       metrics_addr=args.metrics_addr, state_dir=state_dir,
                       hang=HangConfig(floor_seconds=args.hang_floor), straggler=_straggler_config(args),
                       coordinators=args.coordinator, policy=policy, gpu=gpu, token=load_token(args.token_file),
                       election=args.election, job_id=args.job_id, advertise=args.advertise,
                       tls=_tls_config(args), streams=_stream_limits(args), rank_grace=args.rank_grace,
                       status_max_ranks=args.status_max_ranks, relay=relay, job_nodes=args.job_nodes,
                       history_bytes=args.history_bytes)


def _tls_config(args: argparse.Namespace) -> TlsConfig | None:
    """--tls-cert, --tls-key and --tls-ca, all three or none (ValueError)."""
    from rankwatch.agent.rpc.tls import TlsConfig

    files = (args.tls_cert, args.tls_key, args.tls_ca)
    if not any(files):
        return None
    if not all(files):
        raise ValueError("mutual TLS needs --tls-cert, --tls-key and --tls-ca together")
    return TlsConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)


def _stream_limits(args: argparse.Namespace) -> StreamLimits:
    from rankwatch.agent.rpc.limits import StreamLimits

    knobs = {"total": args.max_streams, "per_peer": args.max_streams_per_peer,
             "reserve": args.control_reserve, "waiting_per_peer": args.max_waiting_per_peer,
             "per_process": args.max_streams_per_process}
    return StreamLimits(**{k: v for k, v in knobs.items() if v is not None})


def _agent_dirs(state_dir: Path | None, listen: list[Address], node: str) -> Path | None:
    """The agent's state directory, after checking the default directory if it is used.

    The default directory (``/tmp/rankwatch-<uid>``) must be the user's own, mode 0700,
    and not a symlink, else the agent refuses (None, the reason printed): another user
    could have made it first.  A state directory that cannot be made is not fatal: the
    agent starts, says so loudly, and keeps its records in memory (retried) until it can.
    """
    from rankwatch.address import default_dir
    from rankwatch.agent.durable.safedir import UnsafeDirectory, check_default, private_dir

    base = Path(default_dir())
    try:
        check_default(listen, state_dir_default=state_dir is None)
        if state_dir is None:
            return private_dir(base / node, repair=True)
    except UnsafeDirectory as exc:
        print(f"rankwatch agent: refusing the default directory: {exc}", file=sys.stderr)
        return None
    except OSError as exc:
        print(f"rankwatch agent: {base}: {exc}", file=sys.stderr)
        return None
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        logging.getLogger("rankwatch.agent").error("state directory %s: %s; incidents and decisions are "
                                                   "kept in memory until it can be written", state_dir, exc)
    return state_dir


def _straggler_config(args: argparse.Namespace) -> StragglerConfig:
    """The agent's --straggler-* flags over the defaults (a clear threshold never above the flag one)."""
    from rankwatch.agent.detect.straggler import StragglerConfig

    knobs = {"threshold": args.straggler_threshold, "window": args.straggler_window,
             "evidence": args.straggler_evidence}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    if "threshold" in knobs:
        knobs["clear_threshold"] = min(StragglerConfig.clear_threshold, knobs["threshold"])
    return StragglerConfig(**knobs)


def _cmd_run(args: argparse.Namespace) -> int:
    from rankwatch.agent.cli.run import run_torchrun

    rest = list(args.torchrun_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        print("rankwatch run: give torchrun's arguments after --, e.g. "
              "rankwatch run -- --standalone --nproc-per-node 4 -m rankwatch.hooks.train",
              file=sys.stderr)
        return 2
    try:
        return run_torchrun(resolve(str(args.agent) if args.agent else None),
                            node_id(args.node_id), rest)
    except RuntimeError as exc:
        print(f"rankwatch run: {exc}", file=sys.stderr)
        return 1


def _status(args: argparse.Namespace) -> dict | None:
    """The live view; else, when no agent answers, what it left in its state directory (saying
    so on one line: to stderr with --json).  None: neither (the reason is printed)."""
    from rankwatch.agent.durable import statedir
    from rankwatch.status import AgentUnreachable, fetch_status

    from rankwatch.credentials import ClientCredentials

    addr = resolve(str(args.agent) if args.agent else None)
    explicit = getattr(args, "state_dir", None)
    if explicit is None or args.command != "diagnose":
        try:
            every = getattr(args, "all_ranks", False)
            return fetch_status(addr, timedelta(seconds=30 if every else 3),
                                creds=ClientCredentials.from_env(token_file=args.token_file), all_ranks=every)
        except ValueError as exc:
            print(f"rankwatch {args.command}: {exc}", file=sys.stderr)
            return None
        except AgentUnreachable as exc:
            unreachable = str(exc)
    else:
        unreachable = ""
    try:
        where = statedir.locate(addr, node_id(getattr(args, "node_id", None)), explicit)
        left = statedir.read(where)
    except (FileNotFoundError, OSError) as exc:
        if unreachable:
            print(f"rankwatch {args.command}: {unreachable} (start one with `rankwatch agent`, "
                  f"or point --agent / $RANKWATCH_AGENT at it), and {exc}", file=sys.stderr)
        else:
            print(f"rankwatch {args.command}: {exc}", file=sys.stderr)
        return None
    print(f"rankwatch {args.command}: {left.line(addr if unreachable else None, where)}",
          file=sys.stderr if args.json else sys.stdout)
    args._earlier = left.every
    return left.status


def _cmd_status(args: argparse.Namespace) -> int:
    status = _status(args)
    if status is None:
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        from rich.console import Console

        from rankwatch.agent.cli.status_tables import conflicts_line, latency_table, rank_table, recovery_table

        console = Console(width=None if sys.stdout.isatty() else 140)
        console.print(rank_table(status))
        if status.get("ranks_left_out"):
            states = ", ".join(f"{n} {s}" for s, n in sorted(status["rank_states"].items()))
            console.print(f"{len(status['ranks'])} of {status['ranks_total']} ranks listed, those not ok "
                          f"first ({states}); --all-ranks lists every one")
        if any(r.get("op_latency") for r in status["ranks"]):
            console.print(latency_table(status))
        recoveries = recovery_table(status)
        if recoveries is not None:
            console.print(recoveries)
        conflicts = conflicts_line(status)
        if conflicts is not None:
            console.print(conflicts, style="bold red")
    return 0


def _cmd_diagnose(args: argparse.Namespace) -> int:
    status = _status(args)
    if status is None:
        return 1
    incidents = status["incidents"]
    if args.incident is not None:
        # This run's first; then an earlier run's in the same state directory.
        found = [i for i in incidents if i["id"] == args.incident] or \
                [i for i in getattr(args, "_earlier", []) if i["id"] == args.incident]
        if not found:
            print(f"rankwatch diagnose: no incident {args.incident!r} at this agent", file=sys.stderr)
            return 1
        chosen = found[-1]
    elif not incidents:
        print("no incidents recorded by this agent")
        return 0
    else:
        chosen = next((i for i in reversed(incidents) if i["kind"] == "hang"), None) or _failure(incidents)
    if args.json:
        print(json.dumps(chosen, indent=2))
        return 0
    from rankwatch.agent.views.story import tell

    print(tell(chosen, incidents))
    others = [i["id"] for i in incidents if i is not chosen]
    if others and args.incident is None:
        print(f"\nother incidents: {', '.join(others[-12:])} (rankwatch diagnose ID)")
    return 0


def _failure(incidents: list[dict[str, Any]]) -> dict[str, Any]:
    """The root cause of the latest worker failure, else the latest incident."""
    last = next((i for i in reversed(incidents) if i["kind"] == "rank_exit"), None)
    if last is None:
        return incidents[-1]
    root = last["detail"].get("root_cause")
    return next((i for i in incidents if i["id"] == root), last)


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    """Ask the job for a checkpoint; every rank saves after the step the coordinator names."""
    import grpc

    from rankwatch.agent.link.uplink import forward_checkpoint
    from rankwatch.credentials import ClientCredentials

    addr = resolve(str(args.agent) if args.agent else None)
    try:
        reply = forward_checkpoint(addr, args.reason, ClientCredentials.from_env(token_file=args.token_file))
    except ValueError as exc:
        print(f"rankwatch checkpoint: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            print(f"rankwatch checkpoint: refused: {exc.details()} (--token-file or $RANKWATCH_TOKEN)",
                  file=sys.stderr)
            return 1
        print(f"rankwatch checkpoint: no agent at {addr}: {exc.code().name}", file=sys.stderr)
        return 1
    if not reply.accepted:
        print(f"rankwatch checkpoint: refused: {reply.message}", file=sys.stderr)
        return 1
    print(f"checkpoint {reply.id}: {reply.message}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from rankwatch.agent.cli.demo import DEMO_STEPS, run_demo

    return run_demo(steps=args.steps or DEMO_STEPS, live=not args.no_live)


def _cmd_certs(args: argparse.Namespace) -> int:
    from rankwatch.agent.cli import certs

    return certs.run(args)


def _cmd_analyze(args: argparse.Namespace) -> int:
    from rankwatch.agent.cli import analyze_cmd

    return analyze_cmd.run(args)


_COMMANDS = {"agent": _cmd_agent, "run": _cmd_run, "status": _cmd_status, "diagnose": _cmd_diagnose,
             "checkpoint": _cmd_checkpoint, "demo": _cmd_demo, "certs": _cmd_certs, "analyze": _cmd_analyze}

if __name__ == "__main__":
    sys.exit(main())
