"""What a coordinator of an HA set does beyond deciding: replicate, follow, forward.

The servicer (:mod:`..service`) keeps deciding with one :class:`Membership` and
one lock; with an etcd store its :class:`~.replication.Replication` is an
:class:`EtcdReplication`:

* as **leader**, every visible change is written to etcd before anyone sees it
  (:meth:`EtcdReplication.persist`); while etcd is away the change waits, and
  readers keep seeing the last state etcd accepted (``held``), so a generation
  that etcd has not recorded is never announced;
* as **standby**, the membership is a read-only copy of the document the leader
  wrote (:meth:`EtcdReplication.replica`), served to ``GetCluster`` and
  ``WatchCluster`` only once etcd confirms it is the stored one (the servicer
  asks at every read), and the worker-only writes (Register, Heartbeat, Leave) are
  forwarded to the leader with the caller's metadata (:meth:`EtcdReplication.forward`);
* on **taking over**, the new leader restores the document, gives every live
  worker a fresh lease, and numbers versions above anything handed out before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc
from collectives_server.coordinator.admission import LeaseBook
from collectives_server.coordinator.ha.etcd_store import (
    EtcdLeadership,
    NotLeaderError,
    StoreUnavailableError,
)
from collectives_server.coordinator.ha.membership_state import export_state, restore_state
from collectives_server.coordinator.membership import Membership, Outcome

__all__ = ["EtcdReplication"]

log = logging.getLogger(__name__)

# Longest a forwarded call waits for the leader.
_FORWARD_TIMEOUT_S = 5.0
# Channels kept to past and present leaders: an HA set is a handful of coordinators,
# and a forward still in flight to the previous leader keeps its channel open.
_CHANNELS_KEPT = 8
# Metadata the forwarding coordinator must not copy (gRPC sets its own).
_HOP_HEADERS = ("user-agent", "grpc-", ":")


class EtcdReplication:
    """A coordinator's place in an HA set on etcd. Methods marked "lock" run under
    the servicer's lock; the others take none of it."""

    def __init__(
        self,
        leadership: EtcdLeadership,
        new_membership: Callable[[], Membership],
        clock: Callable[[], float],
    ) -> None:
        self.leadership = leadership
        self._new_membership = new_membership
        self._clock = clock
        self.held = None
        self.published: coordinator_pb2.Cluster | None = None
        self._channels: dict[str, grpc.Channel] = {}
        self._channel_lock = threading.Lock()

    store = "etcd"
    checks_reads = True
    # The Cluster message readers see while a change waits for etcd (None: none waits).
    held: coordinator_pb2.Cluster | None = None

    @property
    def leading(self) -> bool:
        return self.leadership.leading

    @property
    def cut_off(self) -> bool:
        return self.leadership.cut_off

    @property
    def ttl_s(self) -> float:
        return float(self.leadership.ttl_s)

    def set_identity(self, address: str) -> None:
        return None  # the leadership names this coordinator once it campaigns

    @property
    def leader(self) -> str:
        return self.leadership.leader

    # ---- leader (lock) ----------------------------------------------------------

    def take_over(
        self, leases: LeaseBook, message: Callable[[Membership], Any]
    ) -> tuple[Membership, Outcome]:
        """A membership restored from etcd (or a fresh one) for a new leader, and
        the outcome of its first decision on it.

        What etcd holds is what readers keep seeing (``published``) until the
        new leader's own decision is recorded: restoring decides nothing, so
        ``message(membership)`` taken before :meth:`Membership.resume` is the
        recorded state.
        """
        doc = self.leadership.load()
        membership = self._new_membership()
        membership.sealer = self.leadership.identity
        now = self._clock()
        reason = f"{self.leadership.identity} took over as leader"
        if doc is not None:
            restore_state(doc, membership, leases, now=now, unix_now=time.time())
            # Above every version any coordinator handed out (see Coordinator.start).
            membership._version = max(membership.version, time.time_ns() // 1000)
        self.held = None
        self.published = message(membership) if doc is not None else None
        return membership, membership.resume(now, reason)

    def persist(
        self,
        membership: Membership,
        leases: LeaseBook,
        message: Callable[[], Any],
        *,
        retry: bool = True,
    ) -> bool:
        """Writes the state; False when it must wait (etcd away) or we no longer lead.

        ``message`` builds the Cluster message readers may now see. While a change
        already waits for etcd, only a ``retry`` (the ticker's) tries again: an
        unreachable etcd can take a whole request timeout to say so, and the
        caller holds the servicer's lock.
        """
        if self.held is not None and not retry:
            return False
        doc = export_state(membership, leases, now=self._clock(), unix_now=time.time())
        try:
            self.leadership.persist(doc)
        except (StoreUnavailableError, NotLeaderError) as exc:
            # Nobody sees a change etcd has not recorded: readers keep the last
            # recorded state (right after a takeover: the restored one). Without
            # leadership the change is never recorded; the next leader decides.
            if self.held is None:
                self.held = self.published if self.published is not None else message()
                log.warning("membership change not recorded in etcd: %s", exc)
            return False
        if self.held is not None:
            log.info("etcd is back: the waiting membership change is recorded")
        self.held = None
        self.published = message()
        return True

    # ---- standby (lock) ------------------------------------------------------------

    def replica(self, doc: dict[str, Any] | None, leases: LeaseBook) -> Membership:
        """A read-only copy of the leader's document, at the leader's version: it
        decides nothing (``deciding=False``), so it shows exactly what the leader
        recorded (``doc`` None: etcd holds none yet, an empty membership)."""
        membership = self._new_membership()
        membership.deciding = False
        if doc is not None:
            restore_state(doc, membership, leases, now=self._clock(), unix_now=time.time())
        self.held = None
        return membership

    # ---- forwarding (no lock) ----------------------------------------------------------

    def forward(
        self, method: str, request: Any, context: grpc.ServicerContext, *, long: bool = False
    ) -> Any:
        """Sends a write to the leader and returns its answer (or its error); within
        the forward timeout, or, ``long``, within the caller's own deadline."""
        leader = self.leader
        if not leader or leader == self.leadership.identity:
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{method}: no coordinator leads this cluster at the moment "
                f"(store {self.leadership.url}); retry with backoff",
            )
        stub = coordinator_pb2_grpc.CoordinatorStub(self._channel(leader))
        metadata = [
            (k, v) for k, v in context.invocation_metadata() if not k.startswith(_HOP_HEADERS)
        ]
        remaining = context.time_remaining()
        timeout = min(_FORWARD_TIMEOUT_S, remaining) if remaining else _FORWARD_TIMEOUT_S
        if long and remaining:
            timeout = remaining
        try:
            return getattr(stub, method)(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as err:
            context.abort(err.code(), f"{err.details()} (forwarded to the leader {leader})")
        except ValueError:  # grpc's "Cannot invoke RPC on closed channel!": we are closing
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{method}: this coordinator is shutting down; retry with backoff",
            )

    def _channel(self, address: str) -> grpc.Channel:
        """The channel to ``address``, kept while others are made: a leader change
        never closes a channel a forward is still using (only :meth:`close` does, or
        more than ``_CHANNELS_KEPT`` leaders, the oldest first)."""
        with self._channel_lock:
            channel = self._channels.pop(address, None)
            if channel is None:
                channel = grpc.insecure_channel(address)
                while len(self._channels) >= _CHANNELS_KEPT:
                    self._channels.pop(next(iter(self._channels))).close()
            self._channels[address] = channel  # most recently used last
            return channel

    def close(self) -> None:
        with self._channel_lock:
            for channel in self._channels.values():
                channel.close()
            self._channels = {}
