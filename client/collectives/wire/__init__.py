"""The wire: what the SDK and the servers must agree on, byte for byte.

Everything here is shared by the SDK (``collectives``) and the daemons
(``collectives_server``). The daemons take from the SDK this package, the
generated stubs and a few public modules (errors, names, dtypes, reduce_ops,
shm), never a private ``collectives._*`` one. It is public and kept stable: a
module here changes only together with both sides. What it puts on the wire is plain and documented
(messages framed by hand are still valid protobuf that any gRPC client can
parse; the bulk port's preludes and the ``/dev/shm`` segment names are spelled
out here), so a client or server in another language can interoperate by
reading these modules and ``protos/``.

* :mod:`.codec`: hand-framed ``PutTensorRequest``/``GetTensorResponse`` bytes,
  tensor headers and their checks (``collectives.codec`` re-exports it);
* :mod:`.limits`: the largest gRPC message either side sends or accepts;
* :mod:`.bulk_frames`: the bulk port's preludes, acknowledgement and tickets;
* :mod:`.shm_names`: where shared-memory segments live and how they are named;
* :mod:`.security`: channel security (TLS, bearer token) and token checks;
* :mod:`.pytree`: nested inputs and outputs as the wire's ``Value``;
* :mod:`.memory`: receive buffers that fault in huge pages;
* :mod:`.membership`: the digest naming which membership a generation is.

Nothing is imported here, so ``import collectives.wire.security`` (no torch)
stays cheap.
"""
