"""The command line's value converters: each refuses a bad value with a clear message, and
:func:`default` reads a flag's default from the config field it sets, so each default is
written once, beside the field's docstring (``tests/test_cli_defaults.py`` checks)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from rankwatch.address import Address

__all__ = ["TOKEN_HELP", "address", "argument", "default", "gpu_source", "port", "positive"]

T = TypeVar("T")


def default(owner: type, name: str) -> Any:
    """The default of ``owner``'s field ``name`` (a dataclass), or of its constructor's keyword
    ``name`` (a plain class such as :class:`~rankwatch.agent.config.AgentConfig`).

    Raises:
        KeyError: ``owner`` has no such field.
        TypeError: the field has no default (or only a default factory).
    """
    if dataclasses.is_dataclass(owner):
        value = {f.name: f for f in dataclasses.fields(owner)}[name].default
    else:
        value = inspect.signature(owner).parameters[name].default
    if value is dataclasses.MISSING or value is inspect.Parameter.empty:
        raise TypeError(f"{owner.__name__}.{name} has no default")
    return value


def argument(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from a parser that raises ValueError with a readable message."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def parse_positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{value} must be positive")
    return value


def parse_port(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"{text!r} is not a port number")
    if not 0 <= int(text) < 65536:
        raise ValueError(f"port {int(text)} out of range 0-65535")
    return int(text)


def _gpu_source_of(text: str) -> tuple[str, object]:
    from rankwatch.agent.gpu import parse_gpu_source

    return parse_gpu_source(text)


address = argument(Address.parse)
positive = argument(parse_positive)
port = argument(parse_port)
gpu_source = argument(_gpu_source_of)


TOKEN_HELP = ("the job's shared token, for an agent over TCP (default: $RANKWATCH_TOKEN_FILE, then "
               "$RANKWATCH_TOKEN); TLS files come from $RANKWATCH_TLS_CA, _CERT and _KEY")
