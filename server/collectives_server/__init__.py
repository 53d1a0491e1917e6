"""Daemons of the collectives service: the coordinator, the workers, and a local launcher.

Modules:

* ``cli/``: ``collectives-server``: one entry point, one module per subcommand
* ``control_protocol``: what the coordinator and its workers agree on beyond the protos
* ``coordinator/``: the coordinator: membership rules (:mod:`.membership`), gRPC servicer, daemon
* ``gc_tuning``: the garbage collector in a long-running daemon
* ``hosts``: which listening hosts mean "every interface", and the name peers dial then
* ``json_input``: client JSON, parsed with bounds: size and nesting depth checked before
  ``json.loads``
* ``local``: a coordinator and N workers as child processes on one machine: the embedded default
* ``logfmt``: log formats of the daemons: the classic text line, or one JSON object per line
* ``membership_digest``: the digest naming which membership a generation is (the
  coordinator computes it, the workers check it; the SDK passes on what it was given)
* ``metrics``: the Prometheus endpoint shared by the coordinator and the workers
* ``model_zoo``: model factories shipped with the server, for ``load_model(factory=...)``
* ``preloaded_workers``: worker processes forked from a zygote that imported torch once
* ``rpc/``: gRPC for every daemon: servers, the error boundary, call limits, health
* ``security``: server-side security: TLS/mutual TLS credentials and bearer-token authentication
* ``settings``: each configuration field declared once (flag, help, bounds, default): the
  CLI, ``local``'s children and the docs' flag tables follow from it
* ``signals``: waiting for SIGTERM/SIGINT (or a nudge from another thread) without deadlocks
* ``store_socket``: the rendezvous TCPStore each worker hosts, listening only on the interface
  asked for
* ``worker/``: a worker daemon: the composition root over its layers
"""

import os

__version__ = "0.1.0"

# Transparent huge pages for torch's large CPU allocations in the daemons (torch
# reads this once, at its first allocation of 2 MiB or more, so it is set on
# import, before any). Every received tensor and every collective's output is a
# fresh allocation; with 4 KiB pages the kernel's per-page faults cost more than
# the copy itself, several times over. Set it to 0 to opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# grpcio's sockets through its classic poller instead of its EventEngine: with
# the EventEngine, every message wakes one of its threads, which then wakes the
# server's polling thread and the handler's: about twice the context switches per
# heartbeat. grpc reads this once, when it is first imported, so it is set here:
# the package runs first under both entry points (``python -m collectives_server``
# and the ``collectives-server`` script), before any of its modules imports grpc.
# A value the user exported is kept (an empty one restores grpc's defaults). A
# program that imports collectives_server itself before grpc gets it too; one
# that imported grpc first keeps grpc's defaults. A coordinator serving many workers
# spends markedly less CPU this way: see docs/perf-log.md "gRPC without its EventEngine".
GRPC_EXPERIMENTS = "-event_engine_listener,-event_engine_for_all_other_endpoints"
os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
