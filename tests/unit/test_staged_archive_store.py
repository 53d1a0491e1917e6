"""A staged model archive (``__archive/<id>``) in a worker's store expires like an upload.

load_model replicates a large archive to every rank under a reserved name and
each worker's LoadModel deletes it once read; a client that dies in between
must not leave the bytes held forever: the store's idle expiry drops it.
"""

from __future__ import annotations

import time

import torch

from collectives.wire.names import ARCHIVE_PREFIX, UPLOAD_PREFIX, reserved_prefix
from collectives_server.worker.data.store import UPLOAD_IDLE_S, TensorStore


def _store() -> TensorStore:
    return TensorStore(torch.device("cpu"))


def test_reserved_prefixes() -> None:
    assert reserved_prefix(f"{ARCHIVE_PREFIX}abc") == ARCHIVE_PREFIX
    assert reserved_prefix(f"{UPLOAD_PREFIX}abc/put") == UPLOAD_PREFIX
    assert reserved_prefix("archive/abc") is None


def test_a_staged_archive_expires_whichever_way_it_was_stored() -> None:
    store = _store()
    t = torch.zeros(16, dtype=torch.uint8)
    store.put(f"{ARCHIVE_PREFIX}put", t)
    store.replace(f"{ARCHIVE_PREFIX}replaced", t.clone())  # a follower's commit
    upload = f"{UPLOAD_PREFIX}x/put"
    store.put(upload, t.clone())
    store.adopt(f"{ARCHIVE_PREFIX}adopted", store.get(upload), upload)  # the leader's commit
    store.put("user", t.clone())
    now = time.monotonic()
    assert store.expire_uploads(now=now) == 0  # fresh
    assert store.expire_uploads(now=now + UPLOAD_IDLE_S + 1) == 3
    assert [i.name for i in store.infos()] == ["user"]
    assert store.stats() == (1, 16)


def test_a_read_archive_leaves_no_expiry_record() -> None:
    store = _store()
    t = torch.zeros(8, dtype=torch.uint8)
    store.put(f"{ARCHIVE_PREFIX}a", t)
    assert store.delete_if_same(f"{ARCHIVE_PREFIX}a", t)
    store.put(f"{ARCHIVE_PREFIX}b", t.clone())
    assert store.delete(f"{ARCHIVE_PREFIX}b")
    assert store._uploads == {}
