"""A drain's handoff on a worker: what the drained worker offers, and how its
successor copies it.

When the coordinator drains a member (``Coordinator.Drain``) it seals the next
generation with a spare in that member's rank and leaves a handoff pending
(``Cluster.handoff``); no member joins that generation before the handoff ends.
On the workers:

* The drained worker retires its generation, waits for the op it may be running
  to end, and closes its tensor store to clients
  (:meth:`~collectives_server.worker.data.store.TensorStore.close_for_handoff`):
  from then on what it holds cannot change, and every data-plane call answers
  UNAVAILABLE, which the SDK retries on whoever holds the rank next. Its
  :class:`HandoffSource` answers the successor's ``Handoff`` (the manifest) and
  ``HandoffTensors`` calls (each tensor inline, or by a ticket for the bulk port).
* The successor closes its own store the same way, copies every tensor straight
  from the drained worker (:func:`copy_from`: worker to worker, the payloads on one
  raw TCP connection), installs them all at once in place of whatever it held
  (nothing when the copy fails: no tensor is ever half moved), reopens its store
  and reports in its heartbeats until the coordinator ends the handoff.
* In a shrink (no successor) the drained worker reports the names it held: they
  leave with the rank.

Before the seal, while the drain prepares (``Handoff.preparing``), the successor
takes a *copy ahead*: the drained worker offers what it holds at that moment
(:meth:`HandoffSource.offer_ahead`) with its store still open, and the successor
copies it as above. After the seal the successor asks only for what changed since:
the drained worker compares what it holds then with what it offered ahead, tensor
object by tensor object. That comparison is exact because the store never writes a
tensor in place (every put or commit swaps in a new object), so a name holding the
same object holds the same bytes; a name gone since is left out of both lists.

Models are not copied here: the successor gets every model, at its newest
version, from its peers in the next generation's first step
(``engine.model_sync``), as any worker joining a generation does. The copy ahead
fetches only how each one is built (an exported model's archive), so that the
successor builds the modules before the seal (``models.built_ahead``).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from collectives.errors import CollectiveError, FailedPrecondition, NotFound
from collectives.v1 import coordinator_pb2, worker_pb2, worker_pb2_grpc
from collectives.wire import codec, socket_timeouts
from collectives.wire.frames import BULK, prelude
from collectives.wire.raw_tls import client_context
from collectives.wire.security import ChannelSecurity
from collectives.wire.socket_timeouts import KernelTimeouts

__all__ = ["HandoffCopy", "HandoffSource", "copy_from"]

# gRPC messages of a handoff: a manifest of many headers, tensors answered inline.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# What one HandoffTensors call asks for: at most this many tensors and bytes.
_BATCH_TENSORS = 64
_BATCH_BYTES = 64 * 1024 * 1024
# The successor reads a tensor in chunks of this many bytes while a ticket may still
# come (it sends that ticket's prelude between two chunks), then all at once.
_CHUNK_BYTES = 4 * 1024 * 1024
# A read may overrun the handoff's deadline by this much (the kernel keeps the bound).
_SLACK_S = 0.05


class HandoffSource:
    """The drained worker's side: its tensors, fixed once its store closed, offered
    to the successor of one handoff (``generation_after``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._generation_after = 0
        self._tensors: dict[str, torch.Tensor] = {}
        self._gradients: dict[tuple[str, str], torch.Tensor] = {}
        # What the copy ahead of ``_ahead_generation`` was offered (held until the end,
        # so that each object's identity still names the bytes the successor copied),
        # and which snapshot that is (one drain's).
        self._ahead_generation = 0
        self._ahead: dict[str, torch.Tensor] = {}
        self._ahead_snapshot = ""

    def offer_ahead(
        self, generation_after: int, tensors: dict[str, torch.Tensor], snapshot: str
    ) -> None:
        """While the drain into ``generation_after`` prepares: ``tensors`` (what this
        worker holds now, its store still open) are what the copy ahead may take, as
        the snapshot named ``snapshot`` (one per drain)."""
        with self._cond:
            self._ahead_generation = generation_after
            self._ahead = tensors
            self._ahead_snapshot = snapshot
            self._cond.notify_all()

    def ahead_offer(
        self, generation_after: int, timeout_s: float
    ) -> tuple[dict[str, torch.Tensor], str]:
        """What the copy ahead of ``generation_after`` may take, and its snapshot's name,
        waiting up to ``timeout_s`` for this worker to offer it.

        Raises:
            FailedPrecondition: this worker offers nothing to ``generation_after``.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._ahead_generation == generation_after, timeout_s)
            if self._ahead_generation == generation_after:
                return self._ahead, self._ahead_snapshot
        raise FailedPrecondition(
            f"this worker offers no copy ahead for generation {generation_after} "
            "(it is not being drained into it, or not yet)"
        )

    def unchanged(self, generation_after: int, snapshot: str) -> set[str]:
        """The names offered to ``generation_after`` that still hold what the copy ahead
        named ``snapshot`` was offered (see the module); none when ``snapshot`` is not
        the one offered (the successor's copy ahead is of another drain)."""
        with self._cond:
            if self._ahead_generation != generation_after or self._ahead_snapshot != snapshot:
                return set()
            return {n for n, t in self._tensors.items() if self._ahead.get(n) is t}

    def offer(
        self,
        generation_after: int,
        tensors: dict[str, torch.Tensor],
        gradients: dict[tuple[str, str], torch.Tensor] | None = None,
    ) -> None:
        """Ready: ``tensors`` (and the models' ``gradients``, by (model, parameter)) are
        what the successor of ``generation_after`` may copy."""
        with self._cond:
            self._generation_after = generation_after
            self._tensors = tensors
            self._gradients = dict(gradients or {})
            self._cond.notify_all()

    def withdraw(self) -> None:
        """The handoff ended (or was called off): nothing is offered any more."""
        with self._cond:
            self._generation_after = self._ahead_generation = 0
            self._tensors, self._ahead, self._ahead_snapshot = {}, {}, ""
            self._gradients = {}
            self._cond.notify_all()

    def gradients(self, generation_after: int) -> dict[tuple[str, str], torch.Tensor]:
        """The models' gradients offered to ``generation_after`` (see :meth:`manifest`)."""
        self.manifest(generation_after, 0.0)
        with self._cond:
            return self._gradients

    def manifest(self, generation_after: int, timeout_s: float) -> dict[str, torch.Tensor]:
        """The tensors offered to ``generation_after``, waiting up to ``timeout_s`` for
        this worker to get there (the successor may hear of the drain first).

        Raises:
            FailedPrecondition: this worker offers nothing to ``generation_after``.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._generation_after == generation_after, timeout_s)
            if self._generation_after != generation_after:
                raise FailedPrecondition(
                    f"this worker has no handoff for generation {generation_after} ready "
                    "(it is not being drained into it, or not yet)"
                )
            return self._tensors

    def tensor(
        self, generation_after: int, name: str, model: str = "", *, ahead_snapshot: str = ""
    ) -> torch.Tensor:
        """One offered tensor (with ``model``: that model's gradient of parameter ``name``;
        with ``ahead_snapshot``: one of that snapshot, offered to the copy ahead).

        Raises:
            FailedPrecondition: nothing is offered to ``generation_after`` (or that
                snapshot is no longer the one offered ahead).
            NotFound: ``name`` is not among the offered tensors.
        """
        if model:
            gradients = self.gradients(generation_after)
            if (model, name) not in gradients:
                raise NotFound(f"no gradient of {model!r}'s {name!r} is part of this handoff")
            return gradients[(model, name)]
        if ahead_snapshot:
            tensors, snapshot = self.ahead_offer(generation_after, 0.0)
            if snapshot != ahead_snapshot:
                raise FailedPrecondition(
                    f"the copy ahead's snapshot {ahead_snapshot!r} is no longer offered"
                )
        else:
            tensors = self.manifest(generation_after, 0.0)
        if name not in tensors:
            raise NotFound(f"tensor {name!r} is not part of this handoff")
        return tensors[name]


@dataclass(frozen=True)
class HandoffCopy:
    """What a successor copied: every tensor, or nothing (``error``); ``seconds`` from
    the manifest's arrival (the transfer itself) to the last byte."""

    tensors: dict[str, torch.Tensor]
    nbytes: int
    seconds: float
    error: str = ""
    models: int = 0  # the drained worker hosted these (they come from the peers)
    # Their gradients on the drained worker, by (model, parameter).
    gradients: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    kept: int = 0  # of ``tensors``: taken from the copy ahead (unchanged since)
    snapshot: str = ""  # a copy ahead: the drained worker's snapshot it is of
    # A copy ahead: how the drained worker's models are built, and each exported one's
    # archive by model (models.built_ahead builds them before the seal).
    model_builds: list[worker_pb2.ModelSpec] = field(default_factory=list)
    archives: dict[str, torch.Tensor] = field(default_factory=dict)

    def result(self, generation_after: int) -> coordinator_pb2.HandoffResult:
        """The heartbeat field that reports it."""
        return coordinator_pb2.HandoffResult(
            generation_after=generation_after,
            ok=not self.error,
            error=self.error,
            tensors=len(self.tensors),
            bytes=self.nbytes,
            seconds=self.seconds,
            models=self.models,
        )


def copy_from(
    address: str,
    generation_after: int,
    security: ChannelSecurity,
    timeout_s: float,
    on_bytes: Callable[[int], None] = lambda copied: None,
    *,
    ahead: bool = False,
    reuse: HandoffCopy | None = None,
) -> HandoffCopy:
    """Copies every tensor the drained worker at ``address`` offers to
    ``generation_after``; all of them or (with ``error`` set) none. ``on_bytes`` hears
    the bytes copied so far after each tensor.

    ``ahead``: the copy ahead, while the drain prepares. ``reuse``: the copy ahead
    this successor took; only what changed since moves, the rest is taken from it
    (``nbytes`` counts both: what the rank holds), when the drained worker still
    offers that snapshot (else everything moves)."""
    started = time.monotonic()
    deadline = started + timeout_s
    options = [
        ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ]
    channel = security.open_channel(address, options)
    tensors: dict[str, torch.Tensor] = {}
    gradients: dict[tuple[str, str], torch.Tensor] = {}
    archives: dict[str, torch.Tensor] = {}
    nbytes = 0
    try:
        stub = worker_pb2_grpc.WorkerStub(channel)
        manifest = stub.Handoff(
            worker_pb2.HandoffRequest(
                generation_after=generation_after,
                ahead=ahead,
                ahead_snapshot=reuse.snapshot if reuse is not None else "",
            ),
            timeout=_left(deadline),
        )
        kept = reuse.tensors if reuse is not None else {}
        for name in manifest.unchanged:
            if name not in kept:
                raise ValueError(f"the drained worker counts {name!r} as copied ahead; it was not")
            tensors[name] = kept[name]
            nbytes += kept[name].numel() * kept[name].element_size()
        # The transfer's time counts from here: the drained worker's wait for its last
        # op to end, before it offers anything, is the handoff's, not the copy's.
        started = time.monotonic()

        def answers_of(items: list[worker_pb2.HandoffItem]) -> grpc.Future:
            request = worker_pb2.HandoffTensorsRequest(
                generation_after=generation_after,
                items=items,
                ahead=ahead,
                ahead_snapshot=manifest.ahead_snapshot,
            )
            return stub.HandoffTensors.future(request, timeout=_left(deadline))

        item_of = worker_pb2.HandoffItem
        wanted = [item_of(name=header.name) for header in manifest.tensors]
        wanted += [item_of(model=g.model, name=g.header.name) for g in manifest.gradients]
        sizes = [h.nbytes for h in manifest.tensors] + [g.header.nbytes for g in manifest.gradients]
        archived = [b for b in manifest.model_builds if b.archive_nbytes]
        wanted += [item_of(model=b.name, archive=True) for b in archived]
        sizes += [b.archive_nbytes for b in archived]
        with _BulkReader(address, manifest.bulk_port, client_context(security)) as reader:
            tickets = _Tickets(sizes, lambda first, end: answers_of(wanted[first:end]))
            for i, item in enumerate(wanted):
                answer = tickets.answer(i)
                meta = codec.check_header(answer.header)
                if answer.ticket:
                    if tickets.opened <= i:
                        reader.open(answer.ticket, deadline)
                        tickets.opened = i + 1
                    got = reader.read(meta, deadline, lambda: tickets.open_ahead(reader, deadline))
                else:
                    tickets.opened = max(tickets.opened, i + 1)
                    got = codec.tensor_from_bytes(answer.inline_data, meta)
                if item.archive:
                    archives[item.model] = got
                    continue  # (not the rank's: a model's build)
                if item.model:
                    gradients[(item.model, meta.name)] = got
                else:
                    tensors[meta.name] = got
                nbytes += meta.nbytes
                on_bytes(nbytes)
    except grpc.RpcError as err:
        shown = f"{err.code().name}: {err.details()}"
        return HandoffCopy({}, 0, time.monotonic() - started, f"from {address}: {shown}")
    except (OSError, ValueError, CollectiveError) as exc:  # the bulk connection, a header
        return HandoffCopy({}, 0, time.monotonic() - started, f"from {address}: {exc}")
    finally:
        channel.close()
    seconds = time.monotonic() - started
    return HandoffCopy(
        tensors,
        nbytes,
        seconds,
        models=len(manifest.models),
        gradients=gradients,
        kept=len(manifest.unchanged),
        snapshot=manifest.ahead_snapshot,
        model_builds=list(manifest.model_builds),
        archives=archives,
    )


class _Tickets:
    """The successor's ``HandoffTensors`` calls: the tensors asked for in batches (each
    at most ``_BATCH_TENSORS`` tensors and ``_BATCH_BYTES`` bytes, a larger tensor
    alone), the next batch asked for while the one before is read, so that neither a
    call's round trip per tensor nor the wait for a batch stalls the copy; the
    drained worker holds at most two batches ready. The prelude of each ticket known
    is sent while the tensor before it still arrives (:meth:`open_ahead`): the bulk
    stream never idles between tensors."""

    def __init__(self, sizes: list[int], ask: Callable[[int, int], grpc.Future]) -> None:
        self._ask = ask
        self._batches: list[tuple[int, int]] = []  # [first, end) of each batch, in order
        first = 0
        while first < len(sizes):
            end, nbytes = first + 1, sizes[first]
            while (
                end < len(sizes)
                and end - first < _BATCH_TENSORS
                and nbytes + sizes[end] <= _BATCH_BYTES
            ):
                nbytes += sizes[end]
                end += 1
            self._batches.append((first, end))
            first = end
        self._batch_of = [b for b, (lo, hi) in enumerate(self._batches) for _ in range(lo, hi)]
        self._asked: dict[int, grpc.Future] = {}  # batch -> its call
        self.opened = 0  # the tensors before this one were asked for on the bulk port

    def _call(self, batch: int) -> grpc.Future:
        if batch not in self._asked:
            self._asked[batch] = self._ask(*self._batches[batch])
        return self._asked[batch]

    def answer(self, i: int) -> worker_pb2.GetTensorBulkResponse:
        """Tensor ``i``'s answer (the tensors are taken in order); asks for the next
        batch as ``i``'s arrives."""
        batch = self._batch_of[i]
        answers = self._call(batch).result()
        if batch + 1 < len(self._batches):
            self._call(batch + 1)
        if i + 1 == self._batches[batch][1]:
            del self._asked[batch]  # read to its end
        first = self._batches[batch][0]
        if len(answers.tensors) != self._batches[batch][1] - first:
            raise ValueError("the drained worker answered another number of tensors")
        return answers.tensors[i - first]

    def open_ahead(self, reader: _BulkReader, deadline: float) -> bool:
        """Sends the preludes of the tickets answered since (never waits for a call);
        whether a call asked for is still unanswered (else nothing more can be opened
        before the next tensor)."""
        while self.opened < len(self._batch_of):
            batch = self._batch_of[self.opened]
            call = self._asked.get(batch)
            if call is None:
                return False
            if not call.done():
                return True
            answers = call.result()
            index = self.opened - self._batches[batch][0]
            if index >= len(answers.tensors):
                return False  # (answer() says so when it gets there)
            ticket = answers.tensors[index].ticket
            if ticket:
                reader.open(ticket, deadline)
            self.opened += 1
        return False


class _BulkReader:
    """One bulk connection to the drained worker, opened at the first ticket and kept
    for the next ones (each transfer opens with its own prelude)."""

    def __init__(self, address: str, port: int, tls: ssl.SSLContext | None) -> None:
        self._host = address.rsplit(":", 1)[0].strip("[]")
        self._port = port
        self._tls = tls
        self._sock: socket.socket | None = None
        self._timeouts: KernelTimeouts

    def __enter__(self) -> _BulkReader:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()

    def open(self, ticket: bytes, deadline: float) -> None:
        """Asks for the transfer of ``ticket``: its bytes follow those of the transfers
        opened before it, in order (see :meth:`read`)."""
        if not self._port:
            raise OSError("the drained worker answered a ticket but has no bulk port")
        if self._sock is None:
            sock = socket.create_connection((self._host, self._port), timeout=_left(deadline))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._host)
            self._sock = sock
            # Blocking, its bounds kept by the kernel: a read of a whole chunk is then
            # one system call (MSG_WAITALL), not one per segment that arrived.
            self._timeouts = KernelTimeouts(sock, _left(deadline))
        self._timeouts.fit(_left(deadline), _SLACK_S)
        socket_timeouts.sendall(self._sock, prelude(BULK, ticket))

    def read(
        self, meta: codec.CheckedHeader, deadline: float, meanwhile: Callable[[], bool]
    ) -> torch.Tensor:
        """The bytes of the oldest transfer opened and not yet read, into fresh memory;
        ``meanwhile`` is called between reads (it may :meth:`open` the next one) until
        it returns False."""
        sock = self._sock
        if sock is None:
            raise OSError("no transfer was opened on the bulk connection")
        buffer = codec.allocate_bytes(meta.nbytes)
        view = codec.tensor_memoryview(buffer)
        # (A TLS socket reads a record at a time: no flags.)
        flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
        got = 0
        waiting = True
        while got < meta.nbytes:
            self._timeouts.fit(_left(deadline), _SLACK_S)
            # While a ticket may still come, chunks small enough to send its prelude
            # before this tensor's last byte; then the rest at once.
            end = min(meta.nbytes, got + _CHUNK_BYTES) if waiting else meta.nbytes
            try:
                n = sock.recv_into(view[got:end], end - got, flags)
            except socket_timeouts.TIMED_OUT:
                raise TimeoutError("the handoff ran out of time") from None
            if n == 0:
                raise OSError(f"the bulk connection closed after {got} of {meta.nbytes} bytes")
            got += n
            waiting = waiting and meanwhile()
        return codec.typed(buffer, meta)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the handoff ran out of time")
    return left
