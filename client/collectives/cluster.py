"""``collectives.connect()`` and :class:`Cluster`, the SDK's one entry point.

A ``Cluster`` is a client's connection to one collectives cluster: a channel to
the coordinator plus a background thread that follows its membership (see
``_membership``), a cached channel per worker, and the calls of the public API.
The methods are written in three modules by concern, chained by inheritance:
``_core`` (connection, deadlines, retries), ``_data_plane`` (put/get/delete/
scatter), ``_collectives`` (broadcast ... new_group), ``_p2p`` (send, exchange,
destroy_group) and ``_models``; this class is where they meet and what users
import.

A ``Cluster`` is safe to use from several threads. Its collectives reach the
leader in call order (they run on one executor thread), ``async_op=True``
included; data-plane calls run on the caller's thread, so, as with
``torch.distributed``, wait for an async op before reading or replacing the
tensors it works on.
"""

from __future__ import annotations

import os

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


def connect(
    address: str,
    timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
    *,
    token: str | None = None,
    tls_ca: str | os.PathLike[str] | bytes | None = None,
    tls_cert: str | os.PathLike[str] | bytes | None = None,
    tls_key: str | os.PathLike[str] | bytes | None = None,
    tls: bool | None = None,
    shared_memory: bool | None = None,
    progress: bool | None = None,
) -> Cluster:
    """Connects to the coordinator at ``host:port`` and waits until a generation is formed.

    Example::

        with collectives.connect("127.0.0.1:50051") as cluster:
            cluster.put("x", torch.ones(4))
            cluster.all_reduce("x")

    Security (see ``docs/security.md``): ``token`` is sent as ``authorization:
    Bearer <token>`` on every call; ``tls_ca`` (PEM path or bytes) verifies the
    servers' certificates and turns TLS on (``tls=True`` alone: TLS with the
    system roots); ``tls_cert``/``tls_key`` are a client certificate for mutual
    TLS. Each falls back to ``COLLECTIVES_TOKEN``, ``COLLECTIVES_TLS_CA``,
    ``COLLECTIVES_TLS_CERT``, ``COLLECTIVES_TLS_KEY`` (and ``COLLECTIVES_TLS=1``)
    when None: argument > environment > none.

    ``shared_memory=True`` (or ``COLLECTIVES_SHM=1`` when None) lets ``put`` and
    ``get`` move payloads through ``/dev/shm`` instead of the gRPC stream, for
    workers on this host reached over loopback (same hostname, 127.x/::1/
    localhost address); other workers, or a worker that refuses it, get the
    stream. Each segment is unlinked as soon as the call is done.

    ``progress`` (or ``COLLECTIVES_PROGRESS`` when None): puts, gets, model
    loads and state-dict loads of 256 MiB or more draw a progress bar on stderr
    when it is a terminal; False (``COLLECTIVES_PROGRESS=0``) never draws one,
    True (``=1``) draws one even when stderr is not a terminal.

    Raises:
        InvalidArgument: ``address`` or ``timeout`` is malformed, or a TLS or
            token setting is unreadable or inconsistent.
        Unavailable: nothing answers at ``address`` within ``timeout`` seconds
            (also: a plaintext client against a TLS server, an untrusted certificate).
        PermissionDenied: the server requires a token and got none or a wrong one.
        DeadlineExceeded: the coordinator answers but no generation was formed
            within ``timeout`` seconds (the message quotes its status).
    """
    return Cluster(
        address,
        timeout,
        token=token,
        tls=tls,
        tls_ca=tls_ca,
        tls_cert=tls_cert,
        tls_key=tls_key,
        shared_memory=shared_memory,
        progress=progress,
    )
