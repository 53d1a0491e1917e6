"""The call lane's framing: small unary calls over a kept raw TCP connection.

A gRPC unary call in Python costs the caller and the worker each more CPU
than a small call's own work (the HTTP/2 framing, the completion queue, a
thread hand-off on each side; measured in docs/perf-log.md, "Call lanes"). A
call lane carries the same request and response messages over one of the
worker's bulk-port connections, framed by length:

* the connection opens with the prelude ``LANE_MAGIC`` + a 16-byte ticket that
  the client got from ``GetDataPlane(open_lane=true)``, a gRPC call, so the
  lane inherits that call's token check; the worker answers ``ACK``;
* the ticket's answer names the methods the worker's lanes carry
  (``DataPlaneResponse.lane_methods``); a method's id on this lane is its
  position in that list, from 1, so a client and a worker of different
  releases agree on what each id means, and a method the worker does not name
  takes gRPC (a worker that names none is of the first lane release:
  :data:`FIRST_LANE_METHODS`);
* then, one call at a time: a request frame (:data:`REQUEST_HEADER`: the
  method's id, the payload's length, the seconds left of the call's deadline)
  and its serialized request message; the worker answers a response frame
  (:data:`RESPONSE_HEADER`: ``OK`` and the serialized response, or ``FAILED``
  (``FAILED_CLOSING`` when the lane closes after it) and a serialized
  ``google.rpc.Status`` carrying the code, the message and the details a gRPC
  call would have ended with).

The worker runs the call through the same handler, error boundary and
data-plane limits as the gRPC method, so an answer is the same on both paths.
The SDK's side is :mod:`collectives.lanes`, the worker's
``collectives_server.worker.rpc.lanes``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from collectives.wire.limits import MAX_MESSAGE_BYTES

__all__ = [
    "FAILED",
    "FAILED_CLOSING",
    "FIRST_LANE_METHODS",
    "LANE_MAGIC",
    "MAX_LANE_METHODS",
    "MAX_LANE_REQUEST_BYTES",
    "OK",
    "REQUEST_HEADER",
    "RESPONSE_HEADER",
    "lane_method_ids",
]

# A call-lane connection's prelude starts with this (then the ticket), where a
# bulk transfer's starts with ``bulk_frames.MAGIC``; same length.
LANE_MAGIC = b"CBL1"
# A request frame's header: method id (u8), payload bytes (u32), seconds left of
# the call's deadline (f64; 0 or less: the call has none).
REQUEST_HEADER = struct.Struct("<BId")
# A response frame's header: outcome (u8: OK, FAILED or FAILED_CLOSING), payload
# bytes (u32).
RESPONSE_HEADER = struct.Struct("<BI")
OK = 0
FAILED = 1
# Failed, and the worker closes the lane after this frame (the call was cancelled
# by the worker's limits, or the request frame was one it cannot read past).
FAILED_CLOSING = 2
# The methods a worker of the first lane release carries, in id order (from 1):
# what a ticket's answer that names no methods means.
FIRST_LANE_METHODS: tuple[str, ...] = (
    "Forward",
    "Broadcast",
    "AllReduce",
    "Reduce",
    "AllGather",
    "Gather",
    "ReduceScatter",
    "AllToAll",
    "Barrier",
    "Backward",
)
# A method id is one byte.
MAX_LANE_METHODS = 255


def lane_method_ids(named: Sequence[str]) -> dict[str, int]:
    """Each lane method's id, from the methods a worker named in a ticket's answer
    (``DataPlaneResponse.lane_methods``: ids are positions, from 1; an empty name is
    an id the worker does not serve); none named: the first lane release's."""
    methods = named or FIRST_LANE_METHODS
    return {name: i for i, name in enumerate(methods[:MAX_LANE_METHODS], start=1) if name}


# The largest request a lane carries (as a gRPC call would); the SDK sends larger
# ones, and a worker refuses them, as gRPC does.
MAX_LANE_REQUEST_BYTES = MAX_MESSAGE_BYTES
