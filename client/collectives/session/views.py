"""What a ``Cluster`` shows of the cluster without an RPC, and :meth:`refresh`.

The SDK keeps the latest cluster view current by watching the coordinator
(``_session``); these read it. ``Cluster`` exposes each as its own property or
method (``cluster._view``), with this text as its docstring.
"""

from __future__ import annotations

from collectives.session.connection import ClusterSession
from collectives.wire.cluster_state import ClusterSnapshot, GenerationRecord, WorkerInfo

__all__ = ["ClusterView"]


class ClusterView:
    """The cluster as the client last heard of it."""

    def __init__(self, session: ClusterSession) -> None:
        self._session = session

    @property
    def address(self) -> str:
        """The coordinator's ``host:port``."""
        return self._session.address

    @property
    def generation(self) -> int:
        """The latest generation the coordinator announced."""
        return self._session.snapshot().generation

    @property
    def world_size(self) -> int:
        """Number of ranks in the latest generation."""
        return self._session.snapshot().world_size

    @property
    def formed(self) -> bool:
        """True while a generation is sealed and enough members are alive."""
        return self._session.snapshot().formed

    @property
    def ready(self) -> bool:
        """True once every member joined the latest generation's process group."""
        return self._session.snapshot().ready

    @property
    def status(self) -> str:
        """The coordinator's human-readable status line."""
        return self._session.snapshot().status

    @property
    def leader(self) -> str | None:
        """Address of rank 0, which sequences every collective (None when not formed)."""
        return self._session.snapshot().leader_address

    @property
    def op_timeout_s(self) -> float:
        """The cluster's collective timeout (the servers' ``--op-timeout-s``)."""
        return self._session.snapshot().op_timeout_s

    @property
    def default_timeout_s(self) -> float:
        """Timeout of a call made without ``timeout=``: ``op_timeout_s`` + 5 s."""
        return self._session.default_timeout_s

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._session.closed

    def workers(self) -> list[WorkerInfo]:
        """Every registered worker: members in rank order, then the others (rank -1).

        A non-member's ``state`` says why: ``joining`` (the next generation takes it
        in), ``spare`` (the generation is full, ``--max-workers``: it takes the place
        of a member that is lost or leaves) or ``lost``. Reads the view the SDK keeps
        current by watching the coordinator; no RPC.

        Returns:
            One ``WorkerInfo`` per worker.
        """
        return list(self._session.snapshot().workers)

    def snapshot(self) -> ClusterSnapshot:
        """The whole latest cluster view (generation, status, workers, ...); no RPC.

        With several coordinators (an HA set, see :func:`~collectives.connect`),
        ``coordinator_leader`` names the one that leads and ``store`` says where
        membership lives (``"memory"`` or ``"etcd"``). ``membership_digest`` names
        which membership the generation is: SHA-256 of the member ids in rank
        order, 16 hex digits (``collectives_server.membership_digest``). The SDK
        sends it with every op and a worker whose group is another membership
        refuses the op with ``Unavailable`` before anything runs, so one
        generation number can never compute with two member lists.

        Returns:
            The ``ClusterSnapshot`` the background watch delivered last.
        """
        return self._session.snapshot()

    def history(self) -> list[GenerationRecord]:
        """Recent sealed generations, oldest first (time, size, members, reason); no RPC.

        Each record's ``sealed_by`` names the coordinator that sealed that
        generation, and its ``membership_digest`` the membership (see
        :meth:`snapshot`).

        Returns:
            One ``GenerationRecord`` per generation.
        """
        return list(self._session.snapshot().history)

    def refresh(self, timeout: float | None = None) -> ClusterSnapshot:
        """Asks the coordinator for the cluster now instead of waiting for the watch.

        Args:
            timeout: seconds to wait for the answer; None means 5 s. Defaults to ``None``.

        Returns:
            The coordinator's current ``ClusterSnapshot`` (also what the views show next).

        Raises:
            InvalidArgument: ``timeout`` is not a positive number.
            Unavailable: the coordinator does not answer, or the connection is closed.
            DeadlineExceeded: no answer within ``timeout`` seconds.
        """
        return self._session.refresh(timeout)
