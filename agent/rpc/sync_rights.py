"""Whom a ``Sync`` or ``SyncGroup`` may speak for, under mutual TLS: the decision.

With TLS on its TCP listeners, an agent (the coordinator, or a relay) takes a node's summary
only from that node, the way Kubernetes' node authorizer lets a kubelet change only its own
node's objects:

* a ``Sync`` over TCP must carry the summary of the node the caller's certificate names
  (:func:`~.tls.peer_names`);
* a ``SyncGroup``'s first summary is the relay's own, so it must be that node's too; its
  other summaries, beats and absences are other nodes', and need a certificate that names
  the node as a relay (``urn:rankwatch:relay:ID``);
* on the Unix socket (no certificate; the token is asked there too) only the agent's own
  node's summary is taken: the socket is the agent's own user's.

Anything else is refused with PERMISSION_DENIED and counted (``not_this_node``).  A
certificate without rankwatch names (:class:`~.tls.PeerNames` ``bound`` False) speaks for any
node, as the token does.  With a
token only, nothing here applies: every token holder is trusted alike (docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from rankwatch.agent.rpc.limits import is_local_peer
from rankwatch.agent.rpc.tls import PeerNames, peer_names

__all__ = ["METHODS", "Caller", "caller", "refusal"]

METHODS = ("Sync", "SyncGroup")


@dataclass(frozen=True)
class Caller:
    local: bool
    """On the agent's Unix socket."""
    names: PeerNames
    own: str
    """This agent's node id."""


def caller(context: grpc.ServicerContext, own: str) -> Caller:
    local = is_local_peer(context.peer())
    return Caller(local, PeerNames() if local else peer_names(context), own)


def refusal(method: str, request: Any, who: Caller) -> str | None:
    """Why ``request`` may not come from ``who`` (None: it may)."""
    if not who.local and not who.names.bound:   # a certificate without rankwatch names: as a token
        return None
    node = who.own if who.local else who.names.node
    if node is None:
        return "the caller's certificate names no node"
    if method == "Sync":
        if request.node_id != node:
            return f"a summary of node {request.node_id[:128]!r} from {_whose(who, node)}"
        return None
    if request.nodes and request.nodes[0].node_id != node:
        return f"a group led by node {request.nodes[0].node_id[:128]!r} from {_whose(who, node)}"
    others = len(request.nodes) > 1 or len(request.beats) or len(request.absent)
    if others and (who.local or not who.names.relay):
        return f"other nodes' summaries from {_whose(who, node)}, which is not named a relay"
    return None


def _whose(who: Caller, node: str) -> str:
    return "this agent's socket" if who.local else f"a certificate of node {node[:128]!r}"
