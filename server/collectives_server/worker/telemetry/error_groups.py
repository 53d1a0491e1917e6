"""Failed ops aggregated: one group per kind, code and message, with a count.

A client that retries a failing op in a loop makes the same failure thousands
of times; operators need it once, with how often, since when, until when and
who issued it. The message is kept (tensor names included), so two different
missing tensors are two groups; only the op id is taken out of it (every op has
its own): the ``op 48 (all_reduce, generation 1): `` prefix every rank puts on
a failed op goes (the kind is the group's, the last op id is kept apart), and
any other ``op 48`` reads ``op #``. At most :data:`MAX_ERROR_GROUPS`
groups are kept; a new one evicts the group seen least recently.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from collectives.v1 import status_pb2
from collectives_server.worker.telemetry.windows import WindowedRate

__all__ = ["MAX_ERROR_GROUPS", "MESSAGE_CHARS", "ErrorGroups", "grouped_message"]

MAX_ERROR_GROUPS = 16
# A group's message is reported cut to this many characters (it is grouped whole).
MESSAGE_CHARS = 512

_WORDED = re.compile(r"^op \d+ \([^)]*\): ")
_OP_ID = re.compile(r"\bop \d+\b")


def grouped_message(message: str) -> str:
    """``message`` without the op id it names (see the module's docstring)."""
    return _OP_ID.sub("op #", _WORDED.sub("", message, count=1))


@dataclass
class _Group:
    kind: str
    code: str
    message: str
    first_unix_s: float
    last_unix_s: float = 0.0
    count: int = 0
    client: str = ""
    last_op_id: int = 0
    rate: WindowedRate = field(default_factory=WindowedRate)


class ErrorGroups:
    """The groups; not thread-safe (the stats lock guards it)."""

    def __init__(self, limit: int = MAX_ERROR_GROUPS) -> None:
        self._limit = limit
        # (kind, code, message) -> group, least recently seen first.
        self._groups: dict[tuple[str, str, str], _Group] = {}

    def record(self, kind: str, code: str, message: str, op_id: int = 0, client: str = "") -> None:
        """Counts one failure of ``kind`` with gRPC code name ``code``."""
        now, now_s = time.time(), time.monotonic()
        message = grouped_message(message)
        key = (kind, code, message)
        group = self._groups.pop(key, None)
        if group is None:
            group = _Group(kind, code, message, first_unix_s=now)
            while len(self._groups) >= self._limit:
                del self._groups[next(iter(self._groups))]
        self._groups[key] = group
        group.count += 1
        group.last_unix_s = now
        group.last_op_id = op_id or group.last_op_id
        group.client = client or group.client
        group.rate.add(now_s)

    def attribute(self, code: str, message: str, client: str) -> None:
        """Names ``client`` as the issuer of the latest failure with this code and
        message (the call's handler knows the client; the op's record does not)."""
        message = grouped_message(message)
        for key in reversed(self._groups):
            if key[1] == code and key[2] == message:
                self._groups[key].client = client
                return

    def __len__(self) -> int:
        return len(self._groups)

    def to_proto(self) -> list[status_pb2.ErrorGroup]:
        """The groups, most recently seen first."""
        now_s = time.monotonic()
        return [
            status_pb2.ErrorGroup(
                kind=g.kind,
                code=g.code,
                message=g.message[:MESSAGE_CHARS],
                count=g.count,
                first_unix_time_s=g.first_unix_s,
                last_unix_time_s=g.last_unix_s,
                rate_per_s=g.rate.rate(now_s),
                client=g.client,
                last_op_id=g.last_op_id,
            )
            for g in reversed(self._groups.values())
        ]
