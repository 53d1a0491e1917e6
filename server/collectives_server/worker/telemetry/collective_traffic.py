"""The payload bytes a collective moves into and out of one rank: a traffic model.

Counted from the op's operand size and the traffic of the bandwidth-optimal
algorithm for its kind, not measured on the wire: the worker moves an op's
bytes through several paths (gloo's own collectives, the ring reductions of
``kernels/ring_reductions``, operands riding inline in the operand exchange),
and the model gives every path the same, comparable number. Headers, the
exchange's control rows and retransmissions are not counted. With ``n`` the
operand bytes of one member (see ``OpSpec.operand_nbytes``) and ``p`` the
group's size, one rank moves (received, sent):

========================  ===========================  ===========================
kind                      received                     sent
========================  ===========================  ===========================
all_reduce                2(p-1)/p · n                 2(p-1)/p · n
reduce_scatter            (p-1)/p · n                  (p-1)/p · n
all_to_all                (p-1)/p · n                  (p-1)/p · n
all_gather                (p-1) · n                    (p-1) · n
broadcast                 root 0, others n             root (p-1) · n, others 0
reduce                    root (p-1) · n, others 0     root 0, others n
gather                    root (p-1) · n, others 0     root 0, others n
barrier, a group of one   0                            0
========================  ===========================  ===========================

So at world size 2 an all_reduce of 4 KiB counts 4 KiB received and 4 KiB sent
on each rank. Other kinds (model ops, coalesced ops, exchanges, the data plane)
count 0 here; the data plane's bytes are counted apart (``bytes_received`` and
``bytes_sent``).
"""

from __future__ import annotations

from collectives.wire.op_specs import OpKind

__all__ = ["collective_traffic"]


def collective_traffic(kind: int, nbytes: int, size: int, is_root: bool) -> tuple[int, int]:
    """(received, sent) payload bytes of one rank for an op of ``kind`` whose
    member operand is ``nbytes`` in a group of ``size``; ``is_root`` for rooted kinds."""
    if size <= 1 or nbytes <= 0:
        return 0, 0
    peers = size - 1
    if kind == OpKind.ALL_REDUCE:
        moved = 2 * peers * nbytes // size
        return moved, moved
    if kind in (OpKind.REDUCE_SCATTER, OpKind.ALL_TO_ALL):
        moved = peers * nbytes // size
        return moved, moved
    if kind == OpKind.ALL_GATHER:
        return peers * nbytes, peers * nbytes
    if kind == OpKind.BROADCAST:
        return (0, peers * nbytes) if is_root else (nbytes, 0)
    if kind in (OpKind.REDUCE, OpKind.GATHER):
        return (peers * nbytes, 0) if is_root else (0, nbytes)
    return 0, 0
