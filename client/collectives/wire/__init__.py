"""The wire: what the SDK and the servers must agree on, byte for byte.

Everything here is shared by the SDK (``collectives``) and the daemons
(``collectives_server``). The daemons import of the SDK only this package, the
generated stubs (``collectives.v1``), ``collectives.errors`` and
``collectives.reduce_ops`` (``tests/unit/test_layering.py`` says so). A module
here changes only together with both sides: the two distributions ship in
lockstep, and ``protos/`` is the contract. What it puts on the wire is plain
and documented (messages framed by hand are still valid protobuf that any gRPC
client can parse; the raw connections' preludes and the ``/dev/shm`` segment names
are spelled out here), so a client or server in another language can
interoperate by reading these modules and ``protos/``.

========================  =====================================================
module                    what it holds
========================  =====================================================
:mod:`.op_specs`          every op kind: its arguments, result tensors, checks
:mod:`.op_args`           checks of an op's arguments shared by SDK and worker
:mod:`.names`             tensor names: the grammar and the reserved prefixes
:mod:`.dtypes`            torch dtypes to and from the wire's enum
:mod:`.codec`             hand-framed put/get bytes, tensor headers, checks
:mod:`.pytree`            nested inputs and outputs as the wire's ``Value``
:mod:`.limits`            message sizes, the bulk threshold, a model load's time
:mod:`.frames`            every raw TCP connection's prelude and frames (bulk,
                          call lanes, the control channel)
:mod:`.socket_timeouts`   read and write timeouts the kernel keeps on a socket
:mod:`.shm`               ``/dev/shm`` segments: names, creation, checked opens
:mod:`.memory`            receive buffers that fault in huge pages
:mod:`.security`          channel security (TLS, bearer token), token checks
:mod:`.targets`           an address list as a gRPC target (channel options)
:mod:`.raw_tls`           TLS on the bulk port and call lanes (both ends' contexts)
:mod:`.cluster_state`     the cluster's state as values (SDK and dashboard JSON)
:mod:`.batching`          the dynamic batching policy a model is loaded with
:mod:`.op_phases`         an op's phases and the spans between them, defined once
========================  =====================================================

Nothing is imported here, so ``import collectives.wire.security`` (no torch)
stays cheap.
"""
