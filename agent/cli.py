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
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from rankwatch import __version__
from rankwatch.address import Address, node_id, resolve
from rankwatch.agent.status_ranks import DEFAULT_MAX_RANKS

if TYPE_CHECKING:
    from rankwatch.agent.straggler import StragglerConfig
    from rankwatch.agent.gate import StreamLimits
    from rankwatch.agent.tls import TlsConfig

__all__ = ["main"]

T = TypeVar("T")


def _argument(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from a parser that raises ValueError with a readable message."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def _parse_positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{value} must be positive")
    return value


def _parse_port(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"{text!r} is not a port number")
    if not 0 <= int(text) < 65536:
        raise ValueError(f"port {int(text)} out of range 0-65535")
    return int(text)


def _parse_gpu_source(text: str) -> tuple[str, object]:
    from rankwatch.agent.gpu import parse_gpu_source

    return parse_gpu_source(text)


_address = _argument(Address.parse)
_positive = _argument(_parse_positive)
_port = _argument(_parse_port)
_gpu_source = _argument(_parse_gpu_source)


_TOKEN_HELP = ("the job's shared token, for an agent over TCP (default: $RANKWATCH_TOKEN_FILE, then "
               "$RANKWATCH_TOKEN); TLS files come from $RANKWATCH_TLS_CA, _CERT and _KEY")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rankwatch", description="Observability and fault tolerance "
                                "for distributed PyTorch training.")
    p.add_argument("--version", action="version", version=f"rankwatch {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    a = sub.add_parser("agent", help="run the node agent")
    a.add_argument("--listen", type=_address, action="append", default=None, metavar="ADDR",
                   help="socket path, unix:PATH or HOST:PORT; repeatable "
                        "(default: $RANKWATCH_AGENT, then the per-user socket)")
    a.add_argument("--metrics-port", type=_port, default=9478, metavar="N",
                   help="HTTP port of /metrics (0 picks a free one; default 9478)")
    a.add_argument("--metrics-addr", default="0.0.0.0", help="interface of /metrics")
    a.add_argument("--node-id", default=None, help="default: $RANKWATCH_NODE_ID, then the host name")
    a.add_argument("--state-dir", type=Path, default=None,
                   help="keep incidents, decisions and the last status view here "
                        "(default $RANKWATCH_STATE_DIR, else /tmp/rankwatch-<uid>/<node-id>)")
    a.add_argument("--hang-floor", type=_positive, default=5.0, metavar="SECONDS",
                   help="shortest stall called a hang (default 5)")
    a.add_argument("--straggler-threshold", type=_positive, default=None, metavar="RATIO",
                   help="flag ranks whose own work is this much above the others' (default 0.08: 8%%)")
    a.add_argument("--straggler-window", type=int, default=None, metavar="STEPS",
                   help="steps per straggler slowdown estimate (default 16)")
    a.add_argument("--straggler-evidence", type=_positive, default=None, metavar="LEVEL",
                   help="CUSUM level that confirms a slowdown: higher is slower and surer")
    a.add_argument("--coordinator", type=_address, action="append", default=None, metavar="ADDR",
                   help="the job's coordinator candidates in node-rank order, repeatable; the "
                        "first that answers coordinates (this agent's own address may be one). "
                        "Default: this agent coordinates its own node alone")
    a.add_argument("--election", default=None, metavar="etcd://HOST:PORT[,...]",
                   help="the coordinator is the agent holding the job's key in this etcd (v2 API; "
                        "the [etcd] extra), instead of the --coordinator list's first")
    a.add_argument("--job-id", default="", metavar="ID", help="the job's id in etcd (with --election)")
    a.add_argument("--advertise", default=None, metavar="HOST:PORT",
                   help="this agent's address for the other agents (default: its first TCP --listen)")
    a.add_argument("--token-file", type=Path, default=None, metavar="PATH",
                   help="the job's shared token (mode 0600): every call over TCP needs it, and "
                        "Sync and RequestCheckpoint on the socket too (default: $RANKWATCH_TOKEN_FILE, "
                        "then $RANKWATCH_TOKEN; none: unchecked)")
    a.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                   help="this agent's certificate: TCP listeners use TLS and require client "
                        "certificates signed by --tls-ca; also presented to the coordinator")
    a.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="the key of --tls-cert")
    a.add_argument("--tls-ca", type=Path, default=None, metavar="PEM",
                   help="the CA that signs the job's certificates")
    a.add_argument("--max-streams", type=int, default=None, metavar="N",
                   help="rank streams served at once (default 128); more are refused")
    a.add_argument("--control-reserve", type=int, default=None, metavar="N",
                   help="server threads rank streams can never take, for Status, Sync and "
                        "RequestCheckpoint (default 32; half of them may wait for a request's message)")
    a.add_argument("--max-waiting-per-peer", type=int, default=None, metavar="N",
                   help="calls from one TCP host that may wait for their request's message (default 2)")
    a.add_argument("--max-streams-per-peer", type=int, default=None, metavar="N",
                   help="rank streams served at once from one TCP host (default 32)")
    a.add_argument("--evict-straggler-speedup", type=_positive, default=1.25, metavar="X",
                   help="evict a straggling node at the next checkpoint when the job would step "
                        "X times faster without it (default 1.25; inf never evicts)")
    a.add_argument("--min-nodes", type=int, default=1, metavar="N",
                   help="never exclude a node if fewer would remain (torchrun's --nnodes MIN)")
    a.add_argument("--gpu-source", type=_gpu_source, default="auto", metavar="{auto,nvml,none,script:PATH}",
                   help="GPU health: NVML, none, or a fault script (JSON); auto (default) uses NVML "
                        "if it initialises, else none")
    a.add_argument("--dcgm-url", default=None, metavar="URL",
                   help="scrape this dcgm-exporter /metrics for GPU health instead of NVML")
    a.add_argument("--gpu-interval", type=_positive, default=None, metavar="SECONDS",
                   help="between GPU readings (default 5; 0.5 for a script)")
    a.add_argument("--rank-grace", type=_positive, default=60.0, metavar="SECONDS",
                   help="how long a disconnected rank stays in /metrics (default 60)")
    a.add_argument("--relay-group", type=int, default=64, metavar="N",
                   help="in a big job, nodes sync through one relay agent per N nodes (default 64; "
                        "0: every node syncs with the coordinator; the coordinator's setting)")
    a.add_argument("--relay-min-nodes", type=int, default=128, metavar="N",
                   help="relays only in a job of at least N nodes (default 128)")
    a.add_argument("--status-max-ranks", type=int, default=DEFAULT_MAX_RANKS, metavar="N",
                   help=f"the most ranks a status answer lists unless asked for all: a bigger job's "
                        f"view lists the ranks not ok first (default {DEFAULT_MAX_RANKS})")

    r = sub.add_parser("run", help="run torchrun with rankwatch wired in",
                       usage="rankwatch run [--agent ADDR] [--node-id ID] -- <torchrun args>")
    r.add_argument("--agent", type=_address, default=None, metavar="ADDR")
    r.add_argument("--node-id", default=None)
    r.add_argument("torchrun_args", nargs=argparse.REMAINDER, help="after --: passed to torchrun")

    s = sub.add_parser("status", help="the agent's live view (or, when none answers, what it left)")
    s.add_argument("--agent", type=_address, default=None, metavar="ADDR")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--all-ranks", action="store_true",
                   help="every rank of a big job (by default a view over the agent's "
                        "--status-max-ranks lists the ranks not ok first, then others up to it)")
    s.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                   help="when no agent answers, read the view it left in DIR (default: the directory "
                        "its socket names, else $RANKWATCH_STATE_DIR, else /tmp/rankwatch-<uid>/<node-id>)")
    s.add_argument("--node-id", default=None, help="whose default state directory to read")
    s.add_argument("--token-file", type=Path, default=None, metavar="PATH", help=_TOKEN_HELP)

    d = sub.add_parser("diagnose", help="the evidence of an incident, told as a story")
    d.add_argument("--agent", type=_address, default=None, metavar="ADDR")
    d.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                   help="read the incidents an agent kept in DIR, resolutions included, instead of "
                        "asking a live one (default when no agent answers: as for status)")
    d.add_argument("--node-id", default=None, help="whose default state directory to read")
    d.add_argument("--json", action="store_true", help="the incident in the status --json form")
    d.add_argument("incident", nargs="?", default=None,
                   help="incident id (default: the latest hang, else the latest incident)")
    d.add_argument("--token-file", type=Path, default=None, metavar="PATH", help=_TOKEN_HELP)

    c = sub.add_parser("checkpoint", help="ask the job for a checkpoint now")
    c.add_argument("--agent", type=_address, default=None, metavar="ADDR")
    c.add_argument("--reason", default="operator", help="recorded with the request")
    c.add_argument("--token-file", type=Path, default=None, metavar="PATH", help=_TOKEN_HELP)

    m = sub.add_parser("demo", help="a local CPU job under rankwatch, with a live view")
    m.add_argument("--steps", type=int, default=160, help="training steps (default 160)")
    m.add_argument("--no-live", action="store_true", help="print lines instead of a live table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s rankwatch %(levelname)s %(message)s")
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130


def _cmd_agent(args: argparse.Namespace) -> int:
    from rankwatch.agent.server import Agent, AgentConfig

    from rankwatch.agent.hang import HangConfig

    listen = args.listen or [resolve(None)]
    node = node_id(args.node_id)
    from rankwatch.agent.statedir import STATE_DIR_ENV

    chosen = args.state_dir or (Path(os.environ[STATE_DIR_ENV]) if os.environ.get(STATE_DIR_ENV) else None)
    state_dir = _agent_dirs(chosen, listen, node)
    if state_dir is None:
        return 1
    from rankwatch.agent.coordinator import PolicyConfig
    from rankwatch.agent.relay_policy import RelayConfig

    from rankwatch.agent.gpu import GpuConfig

    from rankwatch.agent.auth import load_token

    try:
        policy = PolicyConfig(min_nodes=args.min_nodes,
                              evict_straggler_speedup=args.evict_straggler_speedup)
        token = load_token(args.token_file)
        tls = _tls_config(args)
        streams = _stream_limits(args)
        straggler = _straggler_config(args)
        kind, script = args.gpu_source
        gpu = GpuConfig(source=kind, script=script, dcgm_url=args.dcgm_url,
                        interval=timedelta(seconds=args.gpu_interval) if args.gpu_interval else None)
        config = AgentConfig(node_id=node, listen=listen, metrics_port=args.metrics_port,
                             metrics_addr=args.metrics_addr, state_dir=state_dir,
                             hang=HangConfig(floor_seconds=args.hang_floor), straggler=straggler,
                             coordinators=args.coordinator, policy=policy, gpu=gpu, token=token,
                             election=args.election, job_id=args.job_id, advertise=args.advertise,
                             tls=tls, streams=streams, rank_grace=args.rank_grace,
                             status_max_ranks=args.status_max_ranks,
                             relay=RelayConfig(group_size=args.relay_group, min_nodes=args.relay_min_nodes))
    except ValueError as exc:
        print(f"rankwatch agent: {exc}", file=sys.stderr)
        return 2
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


def _tls_config(args: argparse.Namespace) -> TlsConfig | None:
    """--tls-cert, --tls-key and --tls-ca, all three or none (ValueError)."""
    from rankwatch.agent.tls import TlsConfig

    files = (args.tls_cert, args.tls_key, args.tls_ca)
    if not any(files):
        return None
    if not all(files):
        raise ValueError("mutual TLS needs --tls-cert, --tls-key and --tls-ca together")
    return TlsConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)


def _stream_limits(args: argparse.Namespace) -> StreamLimits:
    from rankwatch.agent.gate import StreamLimits

    knobs = {"total": args.max_streams, "per_peer": args.max_streams_per_peer,
             "reserve": args.control_reserve, "waiting_per_peer": args.max_waiting_per_peer}
    return StreamLimits(**{k: v for k, v in knobs.items() if v is not None})


def _agent_dirs(state_dir: Path | None, listen: list[Address], node: str) -> Path | None:
    """The agent's state directory, after checking the default directory if it is used.

    The default directory (``/tmp/rankwatch-<uid>``) must be the user's own, mode 0700,
    and not a symlink, else the agent refuses (None, the reason printed): another user
    could have made it first.  A state directory that cannot be made is not fatal: the
    agent starts, says so loudly, and keeps its records in memory (retried) until it can.
    """
    from rankwatch.address import default_dir
    from rankwatch.agent.safedir import UnsafeDirectory, check_default, private_dir

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
    from rankwatch.agent.straggler import StragglerConfig

    knobs = {"threshold": args.straggler_threshold, "window": args.straggler_window,
             "evidence": args.straggler_evidence}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    if "threshold" in knobs:
        knobs["clear_threshold"] = min(StragglerConfig.clear_threshold, knobs["threshold"])
    return StragglerConfig(**knobs)


def _cmd_run(args: argparse.Namespace) -> int:
    from rankwatch.agent.run import run_torchrun

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
    from rankwatch.agent import statedir
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

        from rankwatch.agent.view import latency_table, rank_table, recovery_table

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
        chosen = next((i for i in reversed(incidents) if i["kind"] == "hang"), incidents[-1])
    if args.json:
        print(json.dumps(chosen, indent=2))
        return 0
    from rankwatch.agent.story import tell

    print(tell(chosen))
    others = [i["id"] for i in incidents if i is not chosen]
    if others and args.incident is None:
        print(f"\nother incidents: {', '.join(others[-12:])} (rankwatch diagnose ID)")
    return 0


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    """Ask the job for a checkpoint; every rank saves after the step the coordinator names."""
    import grpc

    from rankwatch.agent.jobsync import forward_checkpoint
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
    from rankwatch.agent.demo import run_demo

    return run_demo(steps=args.steps, live=not args.no_live)


_COMMANDS = {"agent": _cmd_agent, "run": _cmd_run, "status": _cmd_status,
             "diagnose": _cmd_diagnose, "checkpoint": _cmd_checkpoint, "demo": _cmd_demo}

if __name__ == "__main__":
    sys.exit(main())
