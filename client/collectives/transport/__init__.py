"""The SDK's transport: how a call and a tensor's bytes reach a worker, on any road.

Every call site writes the same thing whatever the road:
``endpoint.unary(method)(request, timeout, what)`` or ``.future(...)`` for a
unary call, ``put_tensor`` / ``get_tensor`` for a tensor. Which road that takes
is decided in one place, :mod:`.roads`.

========================  =====================================================
module                    what it holds
========================  =====================================================
:mod:`.channels`          gRPC channels, deadlines, unary calls (no torch: the
                          CLI starts fast)
:mod:`.endpoints`         a worker's endpoint: its channel, lanes, bulk port;
                          tensor puts and gets over the stream, bulk or shm
:mod:`.roads`             the one policy: which road a call or a tensor takes
:mod:`.calls`             a call in flight, whatever its road, as the fan-out
                          waits on it
:mod:`.lanes`             call lanes: small unary calls over kept raw TCP
:mod:`.bulk`              the bulk port: large payloads over raw TCP (or TLS)
:mod:`.shm`               same-host tensors through ``/dev/shm``
:mod:`.model_streams`     model archives and tensor dicts streamed over gRPC
========================  =====================================================

The framing every raw connection speaks is :mod:`collectives.wire.frames`,
shared with the worker.
"""
