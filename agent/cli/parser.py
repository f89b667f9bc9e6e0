"""The ``rankwatch`` command line's arguments: every command and its options (the agent's many
flags: :mod:`.agent_flags`; the converters that refuse a bad value: :mod:`.converters`;
commands: :mod:`.cli`).

A flag that sets a config field takes its default from that field (:func:`default`), so each
default is written once, beside the field's docstring (``tests/test_cli_defaults.py`` checks).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rankwatch import __version__
from rankwatch.agent.cli.converters import TOKEN_HELP as _TOKEN_HELP
from rankwatch.agent.cli.converters import address as _address
from rankwatch.agent.cli.converters import default

__all__ = ["build_parser", "default"]


class _Subcommand(argparse.ArgumentParser):
    """A subcommand's parser that may add its flags when first used (to parse, or to print help).

    The agent's defaults come from config classes whose modules bring numpy and the GPU package
    along: read up front, they would double the start-up of ``rankwatch status`` and ``diagnose``.
    """

    _later: Callable[[argparse.ArgumentParser], None] | None = None

    def add_later(self, add: Callable[[argparse.ArgumentParser], None]) -> None:
        self._later = add

    def _add_now(self) -> None:
        add, self._later = self._later, None
        if add is not None:
            add(self)

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: Any = None) -> tuple[Any, list[str]]:
        self._add_now()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._add_now()
        return super().format_usage()

    def format_help(self) -> str:
        self._add_now()
        return super().format_help()


if TYPE_CHECKING:
    _Commands = argparse._SubParsersAction[_Subcommand]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rankwatch", description="Observability and fault tolerance "
                                "for distributed PyTorch training.")
    p.add_argument("--version", action="version", version=f"rankwatch {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Subcommand)
    for add in (_agent_parser, _run_parser, _status_parser, _diagnose_parser, _checkpoint_parser, _demo_parser):
        add(sub)
    from rankwatch.agent.cli import analyze_cmd, certs

    certs.add_parser(sub)
    analyze_cmd.add_parser(sub)
    return p


def _agent_parser(sub: _Commands) -> None:
    sub.add_parser("agent", help="run the node agent").add_later(_agent_flags)


def _agent_flags(a: argparse.ArgumentParser) -> None:
    from rankwatch.agent.cli.agent_flags import add_agent_flags

    add_agent_flags(a)


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
