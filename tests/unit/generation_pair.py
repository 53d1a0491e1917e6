"""Two real ``Generation`` loops of one generation (a leader and a follower) in one
process: real gloo groups and control channels over a real TCPStore on loopback,
real tensor stores whose commits a test can hold at the door."""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist
from helpers import wait_until

from collectives.errors import CollectiveError
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import spec_named
from collectives_server.membership_digest import membership_digest
from collectives_server.worker.data.store import TensorStore
from collectives_server.worker.engine.generation import (
    Generation,
    GenerationHooks,
    GenerationSpec,
)
from collectives_server.worker.engine.sequencer import Ticket

__all__ = ["DIGEST", "TIMEOUT_S", "GatedStore", "Pair", "descriptor"]

TIMEOUT_S = 20.0
DIGEST = membership_digest(["t-1", "t-2"])


class GatedStore(TensorStore):
    """A real tensor store whose commits can be held at the door: the test sees a rank
    between its last exchange of an op and its commit (``replace`` is the commit)."""

    def __init__(self, device: torch.device, limit: int | None) -> None:
        super().__init__(device, limit)
        self.hold_commits = False
        self.fail_commits_of: str | None = None  # a commit of this name raises
        self.held = threading.Event()
        self.release = threading.Event()

    def replace(self, name: str, tensor: torch.Tensor, watch=None, op=None):
        if self.hold_commits:
            self.held.set()
            assert self.release.wait(TIMEOUT_S)
        if name == self.fail_commits_of:
            raise RuntimeError(f"test: the commit of {name!r} fails")
        return super().replace(name, tensor, watch=watch, op=op)


def descriptor(kind: str, **args) -> worker_pb2.OpDescriptor:
    return worker_pb2.OpDescriptor(
        kind=spec_named(kind).kind, tensor=worker_pb2.TensorOpArgs(**args)
    )


class Pair:
    """A leader (rank 0) and a follower (rank 1) of one generation."""

    def __init__(
        self,
        limits: tuple[int | None, int | None] = (None, None),
        rebuild_after_s: float = 10.0,
        gated: bool = False,
    ) -> None:
        """``gated``: generations sealed by a drain (GenerationSpec.gated), not waited
        for here: the test opens them (``Generation.open``)."""
        self.stores = [GatedStore(torch.device("cpu"), limit) for limit in limits]
        self.done: list[list[worker_pb2.OpDescriptor]] = [[], []]
        self.threads: list[list[str]] = [[], []]  # the thread that concluded each op
        self._rebuild_after_s = rebuild_after_s
        self._gated = gated
        self.joined = [threading.Event(), threading.Event()]  # each rank's on_joined
        master = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )  # fmt: skip
        client = dist.TCPStore(
            "127.0.0.1", master.port, is_master=False,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )  # fmt: skip
        self._tcp = [master, client]
        self.generations = [self._generation(rank) for rank in range(2)]
        for g in self.generations:
            g.start()
        for g in self.generations:
            assert gated or g.ready.wait(TIMEOUT_S), "the generation did not form"

    def _generation(self, rank: int) -> Generation:
        spec = GenerationSpec(
            generation=1,
            membership_digest=DIGEST,
            rank=rank,
            world_size=2,
            tcp_store=self._tcp[rank],
            store=self.stores[rank],
            op_timeout_s=TIMEOUT_S,
            device=torch.device("cpu"),
            host="127.0.0.1",
            queue_size=8,
            rebuild_after_s=self._rebuild_after_s,
            gated=self._gated,
        )
        hooks = GenerationHooks(
            on_joined=lambda generation, rank=rank: self.joined[rank].set(),
            on_op_done=lambda desc, outcome, latency, rank=rank: self._done(rank, desc),
        )
        return Generation(spec, hooks)

    def _done(self, rank: int, desc: worker_pb2.OpDescriptor) -> None:
        self.threads[rank].append(threading.current_thread().name)
        self.done[rank].append(desc)

    def submit(self, kind: str, claim_if_idle: bool = False, **args) -> Ticket:
        """Admits an op on the leader; with ``claim_if_idle``, as the RPC handler does
        (the caller then runs a ticket marked ``claimed`` with
        ``generations[0].run_claimed``)."""
        return self.generations[0].submit(descriptor(kind, **args), claim_if_idle=claim_if_idle)

    def run(self, kind: str, **args):
        """Runs an op; returns once the leader answered *and* the follower finished it
        (so that ``peek`` on either store shows the outcome)."""
        try:
            result = self.submit(kind, **args).future.result(TIMEOUT_S)
        except CollectiveError as err:
            result = err
        wait_until(lambda: len(self.done[1]) == len(self.done[0]), 10, "the follower")
        return result

    def close(self) -> None:
        self.stores[1].release.set()
        self.generations[0].stop()
        for g in self.generations:
            g.finished.wait(TIMEOUT_S)
