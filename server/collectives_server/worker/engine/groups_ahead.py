"""A drain's next groups, formed ahead while the current generation still serves.

While a drain prepares generation g+1 (``Handoff.preparing``), every member of
g+1 forms its world groups (the gloo group and the control channel) under a store
prefix of that drain's own (``g{g+1}m{digest}/ahead/...``, never one a generation
forms at its seal, nor another drain's) on a thread of its own, then says in its
heartbeats that it is ready. When the coordinator seals g+1 with every member
ready (``Handoff.formed_ahead``), each member's generation takes these groups
instead of forming its own, so its first step waits only for the handoff. Sealed
otherwise (a member was late), every member drops them and forms g+1's groups as
usual: all members take the same road.

Only CPU workers form ahead. An NCCL communicator initialised while another one
runs collectives on the same devices may order their kernels differently on two
ranks and hang both; CUDA workers say they are ready at once and form at the seal.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from collectives_server.worker.engine.control_channel import ControlChannel
from collectives_server.worker.engine.process_groups import GroupHandles, build_groups

__all__ = ["AheadKey", "FormedGroups", "GroupsAhead", "ahead_prefix"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AheadKey:
    """The generation the groups are for, and this worker's place in it."""

    generation: int
    membership_digest: str
    rank: int
    world_size: int
    drain: str  # which drain prepares it (Handoff.drain_id)


def ahead_prefix(key: AheadKey) -> str:
    """The store prefix of groups formed ahead for ``key``'s drain."""
    drain = hashlib.sha256(key.drain.encode()).hexdigest()[:12]
    return f"g{key.generation}m{key.membership_digest}/ahead/{drain}"


@dataclass(frozen=True)
class FormedGroups:
    """World groups formed ahead for ``key``, and the rendezvous store they used."""

    key: AheadKey
    store: dist.Store
    prefix: str
    handles: GroupHandles
    channel: ControlChannel

    def release(self) -> None:
        self.channel.close()
        self.handles.release()


class GroupsAhead:
    """This worker's groups formed ahead: at most one set, for the drain in progress."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: AheadKey | None = None  # what is being formed, or was
        self._formed: FormedGroups | None = None

    def form(
        self,
        key: AheadKey,
        connect_store: Callable[[], dist.Store],
        timeout_s: float,
        device: torch.device,
        host: str | None,
        on_ready: Callable[[], None],
    ) -> None:
        """Starts forming the groups of ``key`` (once; another key's are dropped), then
        calls ``on_ready``. A worker not on CPU forms nothing and is ready at once."""
        with self._lock:
            if self._key == key:
                return
            self._drop_locked()
            self._key = key
        if device.type != "cpu":
            on_ready()
            return

        def run() -> None:
            try:
                store = connect_store()
                prefix = ahead_prefix(key)
                where = (store, prefix, key.rank, key.world_size, timeout_s)
                handles = build_groups(*where, device, host)
                channel = ControlChannel.connect(
                    dist.PrefixStore(f"{prefix}/ctlsock", store), *where[2:], host
                )
            except Exception as exc:  # a peer never came: the seal forms as usual
                log.warning("generation %d: groups not formed ahead: %s", key.generation, exc)
                return
            formed = FormedGroups(key, store, prefix, handles, channel)
            with self._lock:
                kept = self._key == key
                if kept:
                    self._formed = formed
            if not kept:
                formed.release()
                return
            on_ready()

        threading.Thread(target=run, name=f"groups-ahead-{key.generation}", daemon=True).start()

    def take(self, key: AheadKey) -> FormedGroups | None:
        """The groups formed for ``key``, handed over (None: none were; what was formed
        for another key is dropped)."""
        with self._lock:
            formed = self._formed if self._formed is not None and self._formed.key == key else None
            if formed is not None:
                self._formed, self._key = None, None
            else:
                self._drop_locked()
        return formed

    def drop(self) -> None:
        """Releases whatever was formed; a set still forming is released when done."""
        with self._lock:
            self._drop_locked()

    def _drop_locked(self) -> None:
        formed, self._formed, self._key = self._formed, None, None
        if formed is not None:
            formed.release()
