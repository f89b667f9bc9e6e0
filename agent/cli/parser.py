"""The ``rankwatch`` command line's arguments: every command, option and default, and the
converters that refuse a bad value with a clear message (commands: :mod:`.cli`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from rankwatch import __version__
from rankwatch.address import Address
from rankwatch.agent.job.pacing import LoadConfig
from rankwatch.agent.job.routing import RelayConfig
from rankwatch.agent.views.rank_list import DEFAULT_MAX_RANKS

__all__ = ["build_parser"]

T = TypeVar("T")

if TYPE_CHECKING:
    _Commands = argparse._SubParsersAction[argparse.ArgumentParser]


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
    for add in (_agent_parser, _run_parser, _status_parser, _diagnose_parser, _checkpoint_parser, _demo_parser):
        add(sub)
    return p


def _agent_parser(sub: _Commands) -> None:
    """``rankwatch agent``: its flags by concern, in the order its help lists them."""
    a = sub.add_parser("agent", help="run the node agent")
    _agent_node(a)
    _agent_detectors(a)
    _agent_coordination(a)
    _agent_trust(a)
    _agent_policy(a)
    _agent_gpu(a)
    a.add_argument("--rank-grace", type=_positive, default=60.0, metavar="SECONDS",
                   help="how long a disconnected rank stays in /metrics (default 60)")
    _agent_relays(a)
    a.add_argument("--status-max-ranks", type=int, default=DEFAULT_MAX_RANKS, metavar="N",
                   help=f"the most ranks a status answer lists unless asked for all: a bigger job's "
                        f"view lists the ranks not ok first (default {DEFAULT_MAX_RANKS})")


def _agent_node(a: argparse.ArgumentParser) -> None:
    """The agent's flags for what it serves: where it listens, its /metrics, its node id and state directory."""
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


def _agent_detectors(a: argparse.ArgumentParser) -> None:
    """The agent's flags for hang and straggler detection."""
    a.add_argument("--hang-floor", type=_positive, default=5.0, metavar="SECONDS",
                   help="shortest stall called a hang (default 5)")
    a.add_argument("--straggler-threshold", type=_positive, default=None, metavar="RATIO",
                   help="flag ranks whose own work is this much above the others' (default 0.08: 8%%)")
    a.add_argument("--straggler-window", type=int, default=None, metavar="STEPS",
                   help="steps per straggler slowdown estimate (default 16)")
    a.add_argument("--straggler-evidence", type=_positive, default=None, metavar="LEVEL",
                   help="CUSUM level that confirms a slowdown: higher is slower and surer")


def _agent_coordination(a: argparse.ArgumentParser) -> None:
    """The agent's flags for which agent coordinates the job."""
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


def _agent_trust(a: argparse.ArgumentParser) -> None:
    """The agent's flags for the token, mutual TLS and the stream caps."""
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


def _agent_policy(a: argparse.ArgumentParser) -> None:
    """The agent's flags for the coordinator's policy: evictions, the minimum job, silent bursts."""
    a.add_argument("--evict-straggler-speedup", type=_positive, default=1.25, metavar="X",
                   help="evict a straggling node at the next checkpoint when the job would step "
                        "X times faster without it (default 1.25; inf never evicts)")
    a.add_argument("--min-nodes", type=int, default=1, metavar="N",
                   help="never exclude a node if fewer would remain (torchrun's --nnodes MIN)")
    a.add_argument("--silent-burst-nodes", type=int, default=4, metavar="N",
                   help="more nodes than N (and than --silent-burst-share of the job) silent at once "
                        "are the coordinator's or the network's trouble: none is excluded for its "
                        "silence alone (default 4)")
    a.add_argument("--silent-burst-share", type=float, default=0.02, metavar="F",
                   help="see --silent-burst-nodes (default 0.02: 2%% of the job's nodes)")
    a.add_argument("--silent-burst-seconds", type=float, default=30.0, metavar="SECONDS",
                   help="a node excluded for its silence counts in the burst this long, so that at "
                        "most the burst's size are excluded for silence in that time (default 30)")


def _agent_gpu(a: argparse.ArgumentParser) -> None:
    """The agent's flags for GPU health."""
    a.add_argument("--gpu-source", type=_gpu_source, default="auto", metavar="{auto,nvml,none,script:PATH}",
                   help="GPU health: NVML, none, or a fault script (JSON); auto (default) uses NVML "
                        "if it initialises, else none")
    a.add_argument("--dcgm-url", default=None, metavar="URL",
                   help="scrape this dcgm-exporter /metrics for GPU health instead of NVML")
    a.add_argument("--gpu-interval", type=_positive, default=None, metavar="SECONDS",
                   help="between GPU readings (default 5; 0.5 for a script)")


def _agent_relays(a: argparse.ArgumentParser) -> None:
    """The agent's flags for a big job's relays and first syncs."""
    a.add_argument("--relay-group", type=int, default=64, metavar="N",
                   help="in a big job, nodes sync through one relay agent per N nodes (default 64; "
                        "0: every node syncs with the coordinator; the coordinator's setting)")
    a.add_argument("--relay-min-nodes", type=int, default=128, metavar="N",
                   help="relays only in a job of at least N nodes (default 128)")
    a.add_argument("--relay-whole-every-seconds", type=float, default=RelayConfig().whole_every_seconds,
                   metavar="S", help=f"as a relay, send each node's summary whole at least every S seconds "
                                     f"(default {RelayConfig().whole_every_seconds:g}; beats between)")
    a.add_argument("--relay-whole-every-intervals", type=float, default=RelayConfig().whole_every_intervals,
                   metavar="K", help="... or every K sync intervals when the coordinator asks for slower syncs, "
                                     "if that is longer (default 4; 0: every S seconds however slow)")
    a.add_argument("--relay-whole-every-steps", type=int, default=RelayConfig().whole_every_steps, metavar="N",
                   help=f"as a relay, also send a node's summary whole once its ranks completed N steps "
                        f"since the last, if that comes first (default {RelayConfig().whole_every_steps})")
    a.add_argument("--relay-long-wait-spread-seconds", type=float, default=RelayConfig().long_wait_spread_seconds,
                   metavar="S", help=f"as a relay, send a node whole once a collective waited (or its ranks stood "
                                     f"still) {RelayConfig().long_wait_seconds:g} s plus the node's own share of S "
                                     f"seconds, spreading a job-wide hang's summaries (default "
                                     f"{RelayConfig().long_wait_spread_seconds:g}; 0: all at once)")
    a.add_argument("--job-nodes", type=int, default=0, metavar="N",
                   help=f"the job's node count, if known (a Slurm job's SLURM_JOB_NUM_NODES): a big job's "
                        f"agents spread their first syncs over N/{LoadConfig().first_syncs_per_second:g} s, "
                        f"at least {LoadConfig().first_sync_spread:g} s (default 0: not known)")
    a.add_argument("--relay-busy-hold-seconds", type=float, default=RelayConfig().busy_hold_seconds, metavar="S",
                   help=f"as a relay whose coordinator is busy, hold the nodes' summaries and have them back "
                        f"off for up to S seconds after its last reply, before sending them to the "
                        f"coordinator themselves (default {RelayConfig().busy_hold_seconds:g}; 0: never)")


def _run_parser(sub: _Commands) -> None:
    r = sub.add_parser("run", help="run torchrun with rankwatch wired in",
                       usage="rankwatch run [--agent ADDR] [--node-id ID] -- <torchrun args>")
    r.add_argument("--agent", type=_address, default=None, metavar="ADDR")
    r.add_argument("--node-id", default=None)
    r.add_argument("torchrun_args", nargs=argparse.REMAINDER, help="after --: passed to torchrun")


def _status_parser(sub: _Commands) -> None:
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


def _diagnose_parser(sub: _Commands) -> None:
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


def _checkpoint_parser(sub: _Commands) -> None:
    c = sub.add_parser("checkpoint", help="ask the job for a checkpoint now")
    c.add_argument("--agent", type=_address, default=None, metavar="ADDR")
    c.add_argument("--reason", default="operator", help="recorded with the request")
    c.add_argument("--token-file", type=Path, default=None, metavar="PATH", help=_TOKEN_HELP)


def _demo_parser(sub: _Commands) -> None:
    m = sub.add_parser("demo", help="a local CPU job under rankwatch, with a live view")
    m.add_argument("--steps", type=int, default=None,
                   help="training steps (default: enough for the whole story, demo.DEMO_STEPS)")
    m.add_argument("--no-live", action="store_true", help="print lines instead of a live table")
