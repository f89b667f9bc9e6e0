"""torchrun's way in: the ``torchrun.handlers`` entry points (``rankwatch`` on c10d,
``rankwatch-etcd`` on etcd-v2) and the handler creators they return, each wrapping torch's
stock dynamic rendezvous in :class:`~.handler.ExcludingRendezvousHandler`."""

from __future__ import annotations

import os
import socket
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

from rankwatch.address import AGENT_ENV, NODE_ID_ENV, Address
from rankwatch.hooks.rendezvous.handler import ExcludingRendezvousHandler
from rankwatch.hooks.rendezvous.worker_results import watch_from_env

__all__ = ["create_etcd_handler", "create_handler", "etcd_handler_factory", "handler_factory"]


def handler_factory():
    """The ``torchrun.handlers`` entry point: returns the handler creator torchrun registers
    (torchrun calls it at start-up whatever its backend: :func:`.worker_results.watch_from_env`)."""
    watch_from_env()
    return create_handler


def etcd_handler_factory():
    """The ``torchrun.handlers`` entry point of ``rankwatch-etcd``."""
    watch_from_env()
    return create_etcd_handler


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler over torch's c10d backend (its store lives in one node's torchrun)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    return _excluding(params, *create_backend(params))


def create_etcd_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler over torch's etcd-v2 backend (needs python-etcd and an etcd with the v2 API)."""
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend

    return _excluding(params, *create_backend(params))


def _excluding(params: RendezvousParameters, backend: Any, store: Store) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as stock

    inner = stock(store, backend, params)
    node = os.environ.get(NODE_ID_ENV) or socket.gethostname()
    agent = os.environ.get(AGENT_ENV)
    return ExcludingRendezvousHandler(inner, store, node, Address.parse(agent) if agent else None,
                                      backend=params.backend)
