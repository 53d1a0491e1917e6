"""The garbage collector in a long-running daemon.

A worker imports torch, grpc and protobuf: hundreds of thousands of objects
that live as long as the process. CPython's cyclic collector walks all of them
at every full (generation 2) collection, and a daemon allocating a few
thousand objects per op triggers one every few hundred ops: a pause of tens
of milliseconds in the middle of whatever op runs then, on every rank, which
was one cause of the slow tail of ops (``bench``'s p99 against its p50). After
start-up, :func:`settle` moves everything alive into the permanent generation
(``gc.freeze``), so collections only ever look at what the daemon allocated
since; cycles among frozen objects are never freed, which is what start-up
objects are for anyway.
"""

from __future__ import annotations

import gc

__all__ = ["settle"]


def settle() -> None:
    """Collects once, then hides every surviving object from later collections."""
    gc.collect()
    gc.freeze()
