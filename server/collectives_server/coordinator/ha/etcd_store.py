"""Membership state in etcd, and one leader among the coordinators that share it.

``--store etcd://h1:p1[,h2:p2...] --cluster-name NAME`` keeps two keys under
``/collectives/NAME/``:

* ``leader``: the leading coordinator's address, attached to its etcd lease
  (``--leader-ttl-s``). A coordinator campaigns by creating the key if absent
  (a transaction on ``create_revision == 0``) and leads while its lease lives;
  the key's ``create_revision`` is its **fencing token**.
* ``state``: the membership document (:mod:`.membership_state`). Every write is
  a transaction conditioned on ``leader``'s ``create_revision`` still being the
  writer's token, so a coordinator that lost its lease (killed, partitioned
  from etcd, paused) can never write again: its seal of a generation is refused
  by etcd, not merely frowned upon.

A leader that cannot renew its lease for ``ttl - poll`` seconds steps down by
itself (it cannot know whether another took over).

A standby follows ``state`` by reading it every poll, but a poll can be late or
fail, so what a standby serves is checked at the time of the read: it asks etcd
for the document's revision (:meth:`EtcdLeadership.state_revision`, one read
answering every caller that asked before it started) and serves its copy only
if that is the revision it holds, after fetching the newer one
(:meth:`EtcdLeadership.read_state`) if not. A leader serves its own state while
its lease is fresh (renewed, counting from the request, less than ``ttl -
poll`` ago, so no other coordinator can have been elected), and otherwise only
once etcd confirms that its key is still the one it created
(:meth:`EtcdLeadership.confirm_leading`). When all of etcd is away
for a while, nobody leads, and the lease survives: etcd restarts leases with
their full TTL, so the same coordinator picks up where it was when etcd comes
back. Talks to etcd's v3 JSON gateway through ``etcd3gw`` (OpenStack's client),
failing over between the endpoints given.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import etcd3gw
from etcd3gw import exceptions as etcd_errors

__all__ = [
    "EtcdLeadership",
    "NotLeaderError",
    "StoreUnavailableError",
    "parse_etcd_url",
]

log = logging.getLogger(__name__)

_PREFIX = "/collectives"
# HTTP timeout of one etcd request; below the lease TTL so a hung request cannot
# outlive the leadership it is meant to renew.
_REQUEST_TIMEOUT_S = 1.0


class StoreUnavailableError(RuntimeError):
    """No etcd endpoint answered."""


class NotLeaderError(RuntimeError):
    """This coordinator does not (or no longer) lead: a write was refused."""


def parse_etcd_url(text: str) -> list[tuple[str, int]]:
    """``etcd://h1:p1,h2:p2`` -> ``[(h1, p1), (h2, p2)]``; raises ValueError."""
    if not text.startswith("etcd://"):
        raise ValueError(f"an etcd store is etcd://HOST:PORT[,HOST:PORT...], got {text!r}")
    endpoints = []
    for part in text[len("etcd://") :].rstrip("/").split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {part!r} in {text!r} is not HOST:PORT")
        endpoints.append((host.strip("[]"), int(port)))
    return endpoints


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


class _Etcd:
    """etcd3gw clients for every endpoint; a call goes to the first that answers."""

    def __init__(self, endpoints: list[tuple[str, int]]) -> None:
        self._clients = [
            etcd3gw.Etcd3Client(host=h, port=p, timeout=_REQUEST_TIMEOUT_S, api_path="/v3/")
            for h, p in endpoints
        ]
        self._current = 0
        self._lock = threading.Lock()

    def call(self, fn: Callable[[etcd3gw.Etcd3Client], Any]) -> Any:
        with self._lock:
            start = self._current
        errors = []
        for i in range(len(self._clients)):
            index = (start + i) % len(self._clients)
            client = self._clients[index]
            try:
                result = fn(client)
            except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError) as exc:
                errors.append(f"{client.host}:{client.port}: {type(exc).__name__}")
                continue
            except etcd_errors.Etcd3Exception as exc:
                raise StoreUnavailableError(f"etcd refused a request: {exc}") from None
            with self._lock:
                self._current = index
            return result
        raise StoreUnavailableError("no etcd endpoint answered (" + "; ".join(errors) + ")")

    def txn(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.call(lambda c: c.transaction(body))

    def range(self, key: str, keys_only: bool = False) -> dict[str, Any] | None:
        """The key's kv (value decoded, revisions as ints), or None if absent.

        ``keys_only``: the revisions without the value (which is then "").
        """
        body: dict[str, Any] = {"key": _b64(key)}
        if keys_only:
            body["keys_only"] = True
        reply = self.call(lambda c: c.post(c.get_url("/kv/range"), json=body))
        kvs = reply.get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        return {
            "value": _unb64(kv.get("value", "")),
            "create_revision": int(kv.get("create_revision", 0)),
            "mod_revision": int(kv.get("mod_revision", 0)),
            "lease": int(kv.get("lease", 0)),
        }


class EtcdLeadership:
    """Campaigns for leadership of ``cluster`` and keeps its membership document.

    ``on_change(leading)`` is called from the election thread when this
    coordinator starts or stops leading; ``on_state(doc, revision)`` when a
    standby reads a document it has not delivered yet (``doc`` None and
    ``revision`` 0 when etcd holds none), from the election thread's poll or
    from a caller of :meth:`read_state`. ``on_change`` is called without any
    lock of this object held, ``on_state`` with only the lock that orders the
    reads of the document (so copies are delivered in the order they were read).
    """

    def __init__(
        self,
        url: str,
        cluster: str,
        identity: str,
        *,
        ttl_s: int = 3,
        on_change: Callable[[bool], None] = lambda leading: None,
        on_state: Callable[[dict[str, Any] | None, int], None] = lambda doc, revision: None,
        on_reach: Callable[[bool], None] = lambda reached: None,
    ) -> None:
        if ttl_s < 1:
            raise ValueError(f"the leader TTL is whole seconds >= 1, got {ttl_s}")
        self.url = url
        self.identity = identity
        self.ttl_s = ttl_s
        endpoints = parse_etcd_url(url)
        self._etcd = _Etcd(endpoints)  # the election thread's
        self._writer = _Etcd(endpoints)  # the servicer's (persist, load): its own connections
        self._reader = _Etcd(endpoints)  # reads of the document (poll and readers), in order
        self._leader_key = f"{_PREFIX}/{cluster}/leader"
        self._state_key = f"{_PREFIX}/{cluster}/state"
        self.on_change = on_change
        self.on_state = on_state
        self.on_reach = on_reach  # etcd reachable again (True) / cut off for a TTL (False)
        self._lock = threading.Lock()
        self._lease_id = 0
        self._token = 0  # create_revision of our leader key while we lead
        self._leader = ""  # the leader's address as last read ("" when none)
        self._state_rev = -1  # mod_revision of the last document delivered (-1: none yet)
        # Reads of the document, one at a time: (when the last one was sent, its revision).
        self._read_lock = threading.Lock()
        self._read_at = -1.0
        self._read_rev = 0
        self._renewed_at = 0.0  # when the last lease grant or renewal that etcd accepted was sent
        self._reached_at = time.monotonic()  # the last etcd request that was answered
        self._untold = False  # stepped down inside persist(): on_change(False) still due
        self._told_cut_off = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.poll_s = min(0.25, ttl_s / 4)

    # ---- read side ------------------------------------------------------------

    @property
    def leading(self) -> bool:
        with self._lock:
            return self._token != 0

    @property
    def leader(self) -> str:
        """The leading coordinator's address, as last seen ("" if none)."""
        with self._lock:
            return self.identity if self._token else self._leader

    @property
    def cut_off(self) -> bool:
        """True when etcd has not answered for a whole TTL: this view may be stale."""
        return time.monotonic() - self._reached_at > self.ttl_s

    @property
    def lease_fresh(self) -> bool:
        """True while this coordinator leads on a lease renewed less than ``ttl - poll``
        ago (counted from the renewal's request): no other can have been elected since."""
        with self._lock:
            return (
                self._token != 0 and time.monotonic() - self._renewed_at < self.ttl_s - self.poll_s
            )

    # ---- proving a copy current (any thread) --------------------------------------------

    def state_revision(self, asked_at: float) -> int:
        """The stored document's revision in etcd now (0 while there is none).

        "Now" is a read sent at or after ``asked_at`` (``time.monotonic()``): one
        read answers every caller that asked before it was sent, so a crowd of
        readers costs etcd one request. etcd reads are linearizable, so the answer
        includes every write acknowledged before the caller asked.

        Raises StoreUnavailableError (no endpoint answered).
        """
        with self._read_lock:
            if self._read_at >= asked_at:
                return self._read_rev
            sent = time.monotonic()
            kv = self._reader.range(self._state_key, keys_only=True)
            self._note_read(sent, 0 if kv is None else kv["mod_revision"])
            return self._read_rev

    def read_state(self) -> int:
        """Reads the stored document, delivers it to ``on_state`` and returns its
        revision (0 while there is none).

        Raises StoreUnavailableError (no endpoint answered).
        """
        with self._read_lock:
            self._read_and_deliver(force=True)
            return self._read_rev

    def confirm_leading(self) -> bool:
        """Whether etcd still holds the leader key this coordinator created (its token).

        Raises StoreUnavailableError (no endpoint answered).
        """
        with self._lock:
            token = self._token
        if not token:
            return False
        with self._read_lock:
            kv = self._reader.range(self._leader_key, keys_only=True)
        return kv is not None and kv["create_revision"] == token

    def _note_read(self, sent: float, revision: int) -> None:
        """Records a read of the document (call with ``_read_lock`` held)."""
        if sent > self._read_at:
            self._read_at, self._read_rev = sent, revision

    def _read_and_deliver(self, force: bool) -> None:
        """Reads the document and hands it to ``on_state`` when it is new to this
        object, or always with ``force`` (call with ``_read_lock`` held)."""
        sent = time.monotonic()
        kv = self._reader.range(self._state_key)
        revision = 0 if kv is None else kv["mod_revision"]
        self._note_read(sent, revision)
        if revision == self._state_rev and not force:
            return
        self.on_state(None if kv is None else json.loads(kv["value"]), revision)
        self._state_rev = revision

    # ---- lifecycle ------------------------------------------------------------

    def start(self) -> EtcdLeadership:
        """Checks that etcd answers (raises StoreUnavailableError) and starts campaigning."""
        self._etcd.range(self._leader_key)
        self._thread = threading.Thread(target=self._run, name="coordinator-election", daemon=True)
        self._thread.start()
        return self

    def stop(self, resign: bool = True) -> None:
        """Stops campaigning; ``resign`` revokes the lease so a standby takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        lease, self._lease_id = self._lease_id, 0
        if resign and lease:
            with contextlib.suppress(StoreUnavailableError):  # else it runs out by itself
                self._etcd.call(lambda c: c.post(c.get_url("/kv/lease/revoke"), json={"ID": lease}))

    def step_down(self, why: str) -> None:
        """Gives up leading now (the lease stays: this coordinator may campaign again)."""
        self._lose(why)

    # ---- the document -----------------------------------------------------------

    def load(self) -> dict[str, Any] | None:
        """The stored document (None if there is none yet)."""
        kv = self._writer.range(self._state_key)
        return None if kv is None else json.loads(kv["value"])

    def persist(self, doc: dict[str, Any]) -> None:
        """Writes ``doc`` if we still lead (fenced by our token).

        Raises NotLeaderError (we lost the leadership: step down) or
        StoreUnavailableError (etcd is away: try again later).
        """
        with self._lock:
            token = self._token
        if not token:
            raise NotLeaderError("not the leader")
        body = {
            "compare": [
                {
                    "key": _b64(self._leader_key),
                    "target": "CREATE",
                    "result": "EQUAL",
                    "create_revision": token,
                }
            ],
            "success": [
                {"request_put": {"key": _b64(self._state_key), "value": _b64(json.dumps(doc))}}
            ],
            "failure": [],
        }
        if not self._writer.txn(body).get("succeeded"):
            # The caller holds its own lock: the election thread tells it (on_change).
            self._lose("a write was refused: another coordinator holds the leadership", False)
            raise NotLeaderError("the leadership moved to another coordinator")

    # ---- the election thread ------------------------------------------------------

    def _run(self) -> None:
        keepalive_s = self.ttl_s / 3
        next_keepalive = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                untold, self._untold = self._untold, False
            if untold:
                self.on_change(False)
            try:
                if not self._lease_id:
                    self._grant()
                    next_keepalive = now + keepalive_s
                elif now >= next_keepalive:
                    self._keepalive()
                    next_keepalive = now + keepalive_s
                if not self.leading and self._lease_id:
                    self._campaign()
                if not self.leading:
                    self._follow_state()
                self._reached_at = time.monotonic()
                if self._told_cut_off:
                    self._told_cut_off = False
                    log.info("etcd answers again")
                    self.on_reach(True)
            except StoreUnavailableError as exc:
                if not self._told_cut_off and self.cut_off:
                    self._told_cut_off = True
                    self.on_reach(False)
                silent = time.monotonic() - self._renewed_at
                if self.leading and silent > self.ttl_s - self.poll_s:
                    self._lose(f"etcd unreachable for {silent:.1f} s ({exc})")
                else:
                    log.debug("etcd: %s", exc)
            except Exception:  # never let the election thread die silently
                log.exception("coordinator election step failed")
            self._stop.wait(self.poll_s)

    def _grant(self) -> None:
        sent = time.monotonic()
        reply = self._etcd.call(
            lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": self.ttl_s, "ID": 0})
        )
        self._lease_id = int(reply["ID"])
        with self._lock:
            self._renewed_at = sent

    def _keepalive(self) -> None:
        lease = self._lease_id
        sent = time.monotonic()
        reply = self._etcd.call(lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": lease}))
        if int(reply.get("result", {}).get("TTL", -1)) <= 0:
            self._lease_id = 0
            if self.leading:
                self._lose("its etcd lease expired")
            return
        with self._lock:
            self._renewed_at = sent

    def _campaign(self) -> None:
        key = _b64(self._leader_key)
        body = {
            "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": 0}],
            "success": [
                {"request_put": {"key": key, "value": _b64(self.identity), "lease": self._lease_id}}
            ],
            "failure": [{"request_range": {"key": key}}],
        }
        reply = self._etcd.txn(body)
        if reply.get("succeeded"):
            self._win(int(reply["header"]["revision"]), "elected")
            return
        kvs = (reply.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        if not kvs:
            return  # the key went away in between: campaign again next round
        holder = _unb64(kvs[0].get("value", ""))
        if int(kvs[0].get("lease", 0)) == self._lease_id:
            # Our own key under our own lease: etcd was away and kept both.
            self._win(int(kvs[0]["create_revision"]), "resumed")
            return
        with self._lock:
            changed, self._leader = self._leader != holder, holder
        if changed:
            log.info("coordinator %s leads cluster key %s", holder, self._leader_key)

    def _win(self, token: int, how: str) -> None:
        with self._lock:
            self._token = token
            self._leader = self.identity
        log.info("%s leader (fencing token %d, lease %x)", how, token, self._lease_id)
        self.on_change(True)

    def _lose(self, why: str, notify: bool = True) -> None:
        with self._lock:
            was, self._token = self._token, 0
            self._leader = ""
            self._state_rev = -1  # deliver the document afresh to the standby
            self._untold = self._untold or (bool(was) and not notify)
        if was:
            log.warning("stepping down as leader: %s", why)
            if notify:
                self.on_change(False)

    def _follow_state(self) -> None:
        with self._read_lock:
            self._read_and_deliver(force=False)
