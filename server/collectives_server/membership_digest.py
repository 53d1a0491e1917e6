"""The membership digest: which membership a generation number names.

A generation is one fixed membership, its member ids in rank order. The
coordinator sends the digest of that list with the generation
(``Cluster.membership_digest``); a worker joins a process group only for the
digest its generation record carries (the group's store prefix includes it),
the SDK sends the digest it saw with every op (``OpOptions.membership_digest``),
and the leader stamps its group's digest on every op it announces
(``OpDescriptor.membership_digest``). Two memberships under one generation
number therefore never meet in one process group, and an op meant for one is
refused by the other before any data moves.

The digest is the first 16 hex digits of SHA-256 over the member ids in rank
order, each followed by a newline: another implementation computes it from
the ``Cluster`` message alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["DIGEST_HEX_DIGITS", "membership_digest"]

DIGEST_HEX_DIGITS = 16


def membership_digest(member_ids: Iterable[str]) -> str:
    """The digest of ``member_ids`` in rank order; "" for no members (not formed)."""
    ids = list(member_ids)
    if not ids:
        return ""
    text = "".join(f"{worker_id}\n" for worker_id in ids)
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_HEX_DIGITS]
