"""The wire: what the SDK and the servers must agree on, byte for byte.

Everything here is shared by the SDK (``collectives``) and the daemons
(``collectives_server``), which import it from this package and from nowhere
else in the SDK. It is public and kept stable: a module here changes only
together with both sides, and everything it produces is valid on the wire
(protobuf framing a generic gRPC client can parse, the bulk port's preludes,
``/dev/shm`` segment names), so a client or server written in another language
can interoperate by reading these modules and ``protos/``.

* :mod:`.codec`: hand-framed ``PutTensorRequest``/``GetTensorResponse`` bytes,
  tensor headers and their checks (``collectives.codec`` re-exports it);
* :mod:`.limits`: the largest gRPC message either side sends or accepts;
* :mod:`.bulk_frames`: the bulk port's preludes, acknowledgement and tickets;
* :mod:`.shm_names`: where shared-memory segments live and how they are named;
* :mod:`.security`: channel security (TLS, bearer token) and token checks;
* :mod:`.pytree`: nested inputs and outputs as the wire's ``Value``;
* :mod:`.memory`: receive buffers that fault in huge pages.

Nothing is imported here, so ``import collectives.wire.security`` (no torch)
stays cheap.
"""
