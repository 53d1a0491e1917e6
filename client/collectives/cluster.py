"""``collectives.connect()`` and :class:`Cluster`, the SDK's one entry point.

A ``Cluster`` composes a :class:`~collectives.session.connection.ClusterSession`
(channels, the membership view, deadlines, retries, the op order) and the parts
that take it: ``DataPlane``, ``Collectives``, ``PeerToPeer``, ``Models`` and
``Operations``. Each public method is a part's own, its signature and docstring
copied once when the class is made (:func:`_delegated`): the part's docstring is
the one reference (``help(cluster.all_reduce)``, ``docs/api.md``). Thread-safe.
"""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Callable
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

from collectives.addresses import resolve_coordinator
from collectives.data_parallel import DataParallel
from collectives.models.part import Models
from collectives.observe.operations import Operations
from collectives.ops.collectives import Collectives
from collectives.ops.data_plane import DataPlane
from collectives.ops.p2p import PeerToPeer
from collectives.session.connection import DEFAULT_CONNECT_TIMEOUT_S, ClusterSession
from collectives.session.views import ClusterView

__all__ = ["Cluster", "connect"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _delegated(
    part: str, method: Callable[Concatenate[Any, _P], _R]
) -> Callable[Concatenate[Cluster, _P], _R]:
    """``Cluster``'s method that calls ``method`` on its part ``part`` (an attribute),
    with the part's signature and docstring: one definition of each public call."""
    bound = operator.attrgetter(f"{part}.{method.__name__}")

    def call(self: Cluster, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return bound(self)(*args, **kwargs)

    functools.update_wrapper(call, method)
    call.__qualname__ = f"Cluster.{method.__name__}"
    call.__module__ = __name__
    return call


def _viewed(prop: property) -> property:
    """``Cluster``'s property reading ``prop`` of its :class:`ClusterView`."""
    getter = prop.fget
    assert getter is not None
    return property(lambda self: getter(self._view), doc=prop.__doc__)


class Cluster:
    """A connection to a collectives cluster; see :func:`connect`.

    ``Cluster(address, timeout)`` connects exactly like ``connect(address, timeout)``.
    Use it as a context manager, or call :meth:`close`. The conventions every call
    shares (global ranks, ``out=None``, ``timeout``, ``async_op``) are in
    ``docs/api.md``, "Conventions shared by every call".
    """

    def __init__(
        self,
        address: str | None = None,
        timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        *,
        token: str | None = None,
        tls: bool | None = None,
        tls_ca: str | os.PathLike[str] | bytes | None = None,
        tls_cert: str | os.PathLike[str] | bytes | None = None,
        tls_key: str | os.PathLike[str] | bytes | None = None,
        shared_memory: bool | None = None,
        progress: bool | None = None,
        name: str | None = None,
    ) -> None:
        """Connects to the coordinator at ``address``; see :func:`connect`."""
        self._session = ClusterSession(
            resolve_coordinator(address),
            timeout,
            token=token,
            tls=tls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            shared_memory=shared_memory,
            progress=progress,
            name=name,
        )
        self._data_plane = DataPlane(self._session)
        self._collectives = Collectives(self._session, self._data_plane)
        self._p2p = PeerToPeer(self._session, self._collectives, self._data_plane)
        self._models = Models(self._session, self._data_plane)
        self._operations = Operations(self._session)
        self._view = ClusterView(self._session)

    # --- the cluster view (no RPC, but refresh) ----------------------------------

    address = _viewed(ClusterView.address)
    generation = _viewed(ClusterView.generation)
    world_size = _viewed(ClusterView.world_size)
    formed = _viewed(ClusterView.formed)
    ready = _viewed(ClusterView.ready)
    status = _viewed(ClusterView.status)
    leader = _viewed(ClusterView.leader)
    op_timeout_s = _viewed(ClusterView.op_timeout_s)
    default_timeout_s = _viewed(ClusterView.default_timeout_s)
    closed = _viewed(ClusterView.closed)
    workers = _delegated("_view", ClusterView.workers)
    snapshot = _delegated("_view", ClusterView.snapshot)
    history = _delegated("_view", ClusterView.history)
    refresh = _delegated("_view", ClusterView.refresh)

    # --- lifecycle -----------------------------------------------------------------

    def close(self) -> None:
        """Stops watching the coordinator and closes every channel; idempotent.

        Pending ``async_op`` calls that have not started are cancelled (their
        ``Work`` raises ``Unavailable``). A call in flight on another thread (a
        collective waiting at the leader, a transfer, a forward) ends at once
        with ``Unavailable`` ("the cluster handle was closed"), never
        ``DeadlineExceeded``: nothing timed out, and a retry on a closed handle
        cannot succeed. What the workers already received still runs there.
        """
        self._session.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._session.closed:
            return f"<Cluster {self._session.address} closed>"
        return f"<Cluster {self._session.address} {self._session.describe()}>"

    # --- placing tensors (data plane) ----------------------------------------------

    put = _delegated("_data_plane", DataPlane.put)
    get = _delegated("_data_plane", DataPlane.get)
    delete = _delegated("_data_plane", DataPlane.delete)
    scatter = _delegated("_data_plane", DataPlane.scatter)

    # --- collectives ---------------------------------------------------------------

    broadcast = _delegated("_collectives", Collectives.broadcast)
    all_reduce = _delegated("_collectives", Collectives.all_reduce)
    reduce = _delegated("_collectives", Collectives.reduce)
    all_gather = _delegated("_collectives", Collectives.all_gather)
    gather = _delegated("_collectives", Collectives.gather)
    reduce_scatter = _delegated("_collectives", Collectives.reduce_scatter)
    all_to_all = _delegated("_collectives", Collectives.all_to_all)
    barrier = _delegated("_collectives", Collectives.barrier)
    new_group = _delegated("_collectives", Collectives.new_group)

    # --- point to point ------------------------------------------------------------

    send = _delegated("_p2p", PeerToPeer.send)
    exchange = _delegated("_p2p", PeerToPeer.exchange)
    destroy_group = _delegated("_p2p", PeerToPeer.destroy_group)

    # --- operations ----------------------------------------------------------------

    flight_record = _delegated("_operations", Operations.flight_record)
    drain = _delegated("_operations", Operations.drain)

    # --- models --------------------------------------------------------------------

    load_model = _delegated("_models", Models.load_model)
    unload_model = _delegated("_models", Models.unload_model)
    models = _delegated("_models", Models.models)
    set_model_mode = _delegated("_models", Models.set_model_mode)

    def data_parallel(self, name: str, dim: int = 0, timeout: float | None = None) -> DataParallel:
        """A callable that runs model ``name`` data-parallel over the workers.

        Args:
            name: the model.
            dim: the dimension inputs are split and outputs gathered along (a
                module loaded with ``load_model`` must have been loaded with
                ``batch_dim=dim``). Defaults to ``0``.
            timeout: seconds for each call of the callable; None means
                ``default_timeout_s``. Defaults to ``None``.

        Returns:
            A ``DataParallel`` (no RPC until it is called).

        Raises:
            InvalidArgument: a bad model name.
        """
        return DataParallel(self._session, self._models, name, dim=dim, timeout=timeout)

    all_reduce_gradients = _delegated("_models", Models.all_reduce_gradients)
    train_step = _delegated("_models", Models.train_step)
    step = _delegated("_models", Models.step)
    apply = _delegated("_models", Models.apply)
    zero_grad = _delegated("_models", Models.zero_grad)
    gradients = _delegated("_models", Models.gradients)
    state_dict = _delegated("_models", Models.state_dict)
    publish = _delegated("_models", Models.publish)
    load_state_dict = _delegated("_models", Models.load_state_dict)


def connect(
    address: str | None = None,
    timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
    *,
    token: str | None = None,
    tls_ca: str | os.PathLike[str] | bytes | None = None,
    tls_cert: str | os.PathLike[str] | bytes | None = None,
    tls_key: str | os.PathLike[str] | bytes | None = None,
    tls: bool | None = None,
    shared_memory: bool | None = None,
    progress: bool | None = None,
    name: str | None = None,
) -> Cluster:
    """Connects to the coordinator at ``host:port`` and waits until a generation is formed.

    It returns once the generation is sealed and every member reports ready
    (joined its process group); if the members are still joining when
    ``timeout`` runs out it returns anyway with the formed cluster, and the
    first op waits for them. ``Cluster(address, timeout, ...)`` is the same.
    Use the result as a context manager, or call ``close()``.

    Security settings (see ``docs/security.md``) and ``shared_memory`` each fall
    back, when None, to ``COLLECTIVES_TOKEN``, ``COLLECTIVES_TLS_CA``,
    ``COLLECTIVES_TLS_CERT``, ``COLLECTIVES_TLS_KEY``, ``COLLECTIVES_TLS=1``,
    ``COLLECTIVES_SHM=1``: argument > environment > none.

    Args:
        address: the coordinator's ``host:port``. It may list several
            coordinators, ``"h1:p1,h2:p2,h3:p3"`` (an HA set on etcd, see
            ``docs/deploying.md``): calls go round-robin to those that answer,
            any of them serves the cluster's state, and a failover among them
            interrupts no op (:meth:`Cluster.snapshot` says which one leads).
            None (``collectives.connect()``) reads ``COLLECTIVES_COORDINATOR``,
            the variable the ``collectives`` commands read for
            ``--coordinator`` (argument > environment). Defaults to ``None``.
        timeout: seconds to wait for a formed generation. Defaults to ``30.0``.
        token: sent as ``authorization: Bearer <token>`` on every call (or
            ``COLLECTIVES_TOKEN`` when None). Defaults to ``None``.
        tls_ca: a PEM path or bytes that verifies the servers' certificates
            and turns TLS on (or ``COLLECTIVES_TLS_CA``). Defaults to ``None``.
        tls_cert: a client certificate (PEM path or bytes) for mutual TLS,
            with ``tls_key`` (or ``COLLECTIVES_TLS_CERT``). Defaults to ``None``.
        tls_key: the client certificate's key (or ``COLLECTIVES_TLS_KEY``).
            Defaults to ``None``.
        tls: ``tls=True`` alone: TLS with the system roots (or
            ``COLLECTIVES_TLS=1``). Defaults to ``None``.
        shared_memory: True (or ``COLLECTIVES_SHM=1`` when None) lets ``put``
            and ``get`` move payloads through ``/dev/shm`` instead of the gRPC
            stream, for workers on this host reached over loopback (same
            hostname, 127.x/::1/localhost address); other workers, or a worker
            that refuses it, get the stream. Each segment is unlinked as soon
            as the call is done. Defaults to ``None``.
        progress: progress bars (tqdm, on stderr) for puts, gets, scatters,
            model loads and state-dict loads of 256 MiB or more: None shows
            them when stderr is a terminal (``COLLECTIVES_PROGRESS=0`` turns
            them off, ``=1`` forces them on), False never, True always.
            Defaults to ``None``.
        name: this client's name for operators (or ``COLLECTIVES_CLIENT_NAME``
            when None), in the user agent of its calls: the workers list it
            among their clients and on the errors of the ops it issued, in
            ``collectives top``, ``status`` and the dashboard.
            Defaults to ``None``.

    Returns:
        The connected ``Cluster``.

    Raises:
        InvalidArgument: ``address`` is None and ``COLLECTIVES_COORDINATOR`` is
            unset or empty (the message names the variable); ``address`` or
            ``timeout`` is malformed, a TLS or token setting is unreadable or
            inconsistent, or ``address`` is not a coordinator: a worker (the
            message names its coordinator) or an HTTP port such as the
            dashboard's, said at once.
        Unavailable: nothing answers at ``address`` within ``timeout`` seconds
            (also: a plaintext client against a TLS server, an untrusted certificate).
        PermissionDenied: the server requires a token and got none or a wrong one.
        DeadlineExceeded: the coordinator answers but no generation was formed
            within ``timeout`` seconds (the message quotes its status).

    Example::

        with collectives.connect("127.0.0.1:50051") as cluster:
            cluster.put("x", torch.ones(4))
            cluster.all_reduce("x")
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
        name=name,
    )
