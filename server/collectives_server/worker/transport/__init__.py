"""The worker's transport beside gRPC: the bulk port, the call lanes it carries,
and who is on the other end of a loopback connection.

Modules:

* ``bulk``: the bulk port's listener: tickets, raw tensor bytes, lanes handed on
* ``lanes``: call lanes: small unary calls through the gRPC server's own
  interceptors and handlers, their tickets and their limits
* ``peer_identity``: the user id behind a loopback TCP peer (for shared memory)
* ``handoff``: a drain's handoff: what the drained worker offers, and how its
  successor copies it, worker to worker

Every connection opens with a prelude and speaks the frames of
``collectives.wire.frames``, the framing the SDK shares.
"""
