"""Agent addresses: parsing ``RANKWATCH_AGENT`` and choosing the default.

An address is a socket path (``/run/rankwatch.sock``), ``unix:PATH`` or
``HOST:PORT``.  Every command falls back to the same default, so that a
``rankwatch status`` in a second terminal finds the agent of a running demo.
The ranks (``rankwatch.hooks``) and the agent (``rankwatch.agent``) both read
them from here, so neither side imports the other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["AGENT_ENV", "AUTO_ENV", "EXIT_NOTE_ENV", "NODE_ID_ENV", "TMPDIR_ENV", "Address", "default_address", "default_dir", "node_id",
           "resolve"]

AGENT_ENV = "RANKWATCH_AGENT"
NODE_ID_ENV = "RANKWATCH_NODE_ID"
TMPDIR_ENV = "RANKWATCH_TMPDIR"
# Set by ``rankwatch run`` for its torchrun: a file where the rendezvous handler writes why it
# refused this node (an exclusion), so that ``rankwatch run`` exits 0 on a graceful refusal
# without asking an agent that may not have heard the decision yet.
EXIT_NOTE_ENV = "RANKWATCH_EXIT_NOTE"
# ``0``: ``rankwatch run`` leaves its workers uninstrumented unless the script calls
# ``rankwatch.hooks.init()`` (zero-code instrumentation is on by default).
AUTO_ENV = "RANKWATCH_AUTO"


@dataclass(frozen=True)
class Address:
    """A parsed agent address: a Unix socket ``path`` or a TCP ``host``/``port``."""

    path: str | None = None
    host: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> Address:
        """Parse ``unix:PATH``, a bare path, or ``HOST:PORT``.

        Raises:
            ValueError: the text is none of those.
        """
        text = text.strip()
        if not text:
            raise ValueError("empty agent address")
        if text.startswith("unix:"):
            path = text[len("unix:"):].removeprefix("//")
            if not path:
                raise ValueError(f"agent address {text!r} names no socket path")
            return cls(path=path)
        if "/" in text or text.endswith(".sock"):
            return cls(path=text)
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(
                f"agent address {text!r} is neither a socket path, unix:PATH nor HOST:PORT"
            )
        return cls(host=host.strip("[]") or "127.0.0.1", port=int(port))

    @property
    def is_unix(self) -> bool:
        return self.path is not None

    def grpc_target(self) -> str:
        """The target string for ``grpc.insecure_channel``."""
        if self.path is not None:
            return f"unix:{os.path.abspath(self.path)}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        if self.path is not None:
            return f"unix:{self.path}"
        return f"{self.host}:{self.port}"


def default_dir() -> str:
    """The per-user default directory, ``/tmp/rankwatch-<uid>`` (``$RANKWATCH_TMPDIR`` replaces
    ``/tmp``).  The agent uses it only if it is the user's own, mode 0700."""
    return os.path.join(os.environ.get(TMPDIR_ENV) or "/tmp", f"rankwatch-{os.getuid()}")


def default_address() -> Address:
    """The per-user default socket, ``/tmp/rankwatch-<uid>/agent.sock``."""
    return Address(path=os.path.join(default_dir(), "agent.sock"))


def resolve(explicit: str | None = None) -> Address:
    """The address to use: ``explicit``, else ``$RANKWATCH_AGENT``, else the default."""
    text = explicit or os.environ.get(AGENT_ENV, "")
    return Address.parse(text) if text else default_address()


def node_id(explicit: str | None = None) -> str:
    """The node's id: ``explicit``, else ``$RANKWATCH_NODE_ID``, else the host name."""
    return explicit or os.environ.get(NODE_ID_ENV) or os.uname().nodename
