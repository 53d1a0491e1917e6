"""Where a coordinator's decisions are kept: the strategy the servicer is written against.

The servicer (:mod:`..service`) decides membership with one :class:`Membership`
and one lock, and asks its :class:`Replication` what else a decision needs:
whether this coordinator leads (a standby forwards the workers' writes and
serves a copy), what readers may see while a change waits for the store
(``held``), and to record each change before anyone sees it (``persist``).

Two strategies: :class:`InMemory` (``--store memory``, the default: this process
is the only coordinator, always leading, nothing to record) and
:class:`~.etcd_replication.EtcdReplication` (an HA set on etcd, after torch
elastic's ``RendezvousBackend``: the state is written to and read from the
store). The servicer has no branch on which one it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import grpc

from collectives.v1 import coordinator_pb2
from collectives_server.coordinator.admission import LeaseBook
from collectives_server.coordinator.membership import Membership

__all__ = ["InMemory", "Replication"]


class Replication(Protocol):
    """What the servicer asks of the place its decisions are kept. Methods other
    than :meth:`forward` and :meth:`close` run under the servicer's lock."""

    @property
    def store(self) -> str:
        """The store's kind as the Cluster message names it: ``memory`` or ``etcd``."""
        ...

    @property
    def leading(self) -> bool:
        """Whether this coordinator decides membership now."""
        ...

    @property
    def leader(self) -> str:
        """The address of the coordinator that decides ("" while none does)."""
        ...

    @property
    def held(self) -> coordinator_pb2.Cluster | None:
        """What readers see while a change waits for the store (None: none waits)."""
        ...

    @property
    def cut_off(self) -> bool:
        """Whether this coordinator lost the store for longer than its lease, so that
        its view may be stale and it must not serve reads."""
        ...

    @property
    def checks_reads(self) -> bool:
        """Whether a read must first be shown current against the store."""
        ...

    @property
    def ttl_s(self) -> float:
        """How long the store may be unreachable before :attr:`cut_off`."""
        ...

    def set_identity(self, address: str) -> None:
        """This coordinator's address, once its server listens."""

    def persist(
        self,
        membership: Membership,
        leases: LeaseBook,
        message: Callable[[], Any],
        *,
        retry: bool = True,
    ) -> bool:
        """Records the state before anyone sees it; False when it must wait."""
        ...

    def forward(
        self, method: str, request: Any, context: grpc.ServicerContext, *, long: bool = False
    ) -> Any:
        """A standby's answer to a write: the leader's. ``long``: a call that runs as long
        as its caller allows (a drain), not a write answered at once."""
        ...

    def close(self) -> None:
        """Releases what the strategy holds (channels, the store's client)."""


class InMemory:
    """``--store memory``: this coordinator alone decides and keeps nothing elsewhere."""

    store = "memory"
    leading = True
    leader = ""
    held: coordinator_pb2.Cluster | None = None
    cut_off = False
    checks_reads = False
    ttl_s = 0.0

    def __init__(self, identity: str = "") -> None:
        self.leader = identity

    def set_identity(self, address: str) -> None:
        self.leader = address

    def persist(
        self,
        membership: Membership,
        leases: LeaseBook,
        message: Callable[[], Any],
        *,
        retry: bool = True,
    ) -> bool:
        return True  # nothing to record: this process's memory is the store

    def forward(
        self, method: str, request: Any, context: grpc.ServicerContext, *, long: bool = False
    ) -> Any:
        raise AssertionError(f"{method}: a memory store's coordinator always leads")

    def close(self) -> None:
        return None
