"""``collectives.connect()`` and :class:`Cluster`, the SDK's one entry point.

A ``Cluster`` is a client's connection to one collectives cluster: a channel to
the coordinator plus a background thread that follows its membership (see
``_membership``), a cached channel per worker, and the calls of the public API.
The methods are written in three modules by concern, chained by inheritance:
``_core`` (connection, deadlines, retries), ``_data_plane`` (put/get/delete/
scatter) and ``_collectives`` (broadcast ... new_group); this class is where
they meet and what users import.

A ``Cluster`` is safe to use from several threads. Its collectives reach the
leader in call order (they run on one executor thread), ``async_op=True``
included; data-plane calls run on the caller's thread, so, as with
``torch.distributed``, wait for an async op before reading or replacing the
tensors it works on.
"""

from __future__ import annotations

from collectives._core import DEFAULT_CONNECT_TIMEOUT_S
from collectives._models import _Models

__all__ = ["Cluster", "connect"]


class Cluster(_Models):
    """A connection to a collectives cluster; see :func:`connect`.

    ``Cluster(address, timeout)`` connects exactly like ``connect(address, timeout)``.
    Use it as a context manager, or call :meth:`close`.
    """

    def __enter__(self) -> Cluster:
        return self


def connect(address: str, timeout: float = DEFAULT_CONNECT_TIMEOUT_S) -> Cluster:
    """Connects to the coordinator at ``host:port`` and waits until a generation is formed.

    Example::

        with collectives.connect("127.0.0.1:50051") as cluster:
            cluster.put("x", torch.ones(4))
            cluster.all_reduce("x")

    Raises:
        InvalidArgument: ``address`` or ``timeout`` is malformed.
        Unavailable: nothing answers at ``address`` within ``timeout`` seconds.
        DeadlineExceeded: the coordinator answers but no generation was formed
            within ``timeout`` seconds (the message quotes its status).
    """
    return Cluster(address, timeout)
