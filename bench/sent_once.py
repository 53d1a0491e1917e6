"""What the rows of data sent once share (publish, replicated put): the anchor of
one put to rank 0 plus a direct gloo broadcast, and the client-egress row."""

from __future__ import annotations

from .core import MiB, Row, Stat, stat_of

__all__ = ["summed", "sent_once_rows"]


def summed(a: list[float], b: list[float]) -> list[float]:
    """The sums of ``a``'s and ``b``'s order statistics (sorted, element by element,
    the shorter list's length): the anchor whose median, p99 and worst are the sums of
    its two independently measured parts'."""
    return [x + y for x, y in zip(sorted(a), sorted(b), strict=False)]


def sent_once_rows(
    *,
    group: str,
    what: str,
    egress_what: str,
    bytes_name: str,
    service_s: list[float],
    put: list[float],
    bcast: list[float],
    world: int,
    nbytes: int,
    target: str,
    egress_target: str,
    egress: list[int],
    closed: int,
    extra: dict,
) -> list[Row]:
    """The timed row (service against put + broadcast) and, when egress was counted,
    the client-egress row (bytes sent per call against ``nbytes``). The timed row's
    extra holds the world, size and both anchor parts, then the row's own ``extra``."""
    label = f"{nbytes / MiB:.0f} MiB"
    put_text, bcast_text = stat_of(put, "s").text(), stat_of(bcast, "s").text()
    timed_extra = {"world": world, "bytes": nbytes, "put_s": put, "broadcast_s": bcast}
    timed_extra |= {"put": put_text, "broadcast": bcast_text, **extra}
    rows = [
        Row(
            group=group,
            what=what,
            service=stat_of(service_s, "s"),
            anchor_name=f"put {label} to rank 0 + direct gloo broadcast, {world} processes",
            anchor=stat_of(summed(put, bcast), "s"),
            target=target,
            note=f"anchor = put {put_text} + broadcast {bcast_text}"
            + ("" if egress else "; client egress not measured (no ss or /proc)"),
            extra=timed_extra,
        )
    ]
    if egress:
        rows.append(
            Row(
                group=group,
                what=egress_what,
                service=stat_of([n / MiB for n in egress], "MiB"),
                anchor_name=bytes_name,
                anchor=Stat(nbytes / MiB, nbytes / MiB, nbytes / MiB, "MiB", 1),
                target=egress_target,
                note="TCP bytes acked on this process's sockets (ss); "
                + (f"{closed} socket(s) closed mid-call: a lower bound" if closed else "exact"),
                extra={"world": world, "bytes": nbytes, "egress_bytes": egress, "closed": closed},
            )
        )
    return rows
